"""The orders upsert alone (issue #3, session 22): a year of one client's orders upserted into
the ``orders`` table as new orders, then the same orders again with every amount changed (every
file of the client rewritten).

Needs the prepared state of a full backfill benchmark run (``bench/backfill_bench.py --scale
full --workdir W``): its landing batch and its pre-backfill ``orders`` table (other clients'
orders), copied to a scratch folder. Prints the two timings and writes
``bench/results/upsert-<stamp>.json``.

    .venv/bin/python bench/upsert_bench.py --workdir /tmp/bb-full22
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from results_file import git_head, write_result

CLIENT = "client-00"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True,
                        help="a full backfill benchmark's workdir (prepared state)")
    args = parser.parse_args(argv)
    landing = args.workdir / "landing" / "orders" / CLIENT
    prepared = args.workdir / "warehouse-prebackfill" / "orders"
    if not landing.is_dir() or not prepared.is_dir():
        raise SystemExit(f"{args.workdir} holds no prepared full-scale state ({landing}, "
                         f"{prepared}); run bench/backfill_bench.py --scale full first")

    from pyspark.sql import functions as F

    from clickstream.config import Config
    from clickstream.io.delta_tables import open_tables
    from clickstream.spark_session import build_spark
    from clickstream.tables import ORDERS

    scratch = Path(tempfile.mkdtemp(prefix="upsert-bench-"))
    try:
        shutil.copytree(prepared, scratch / "warehouse" / "orders")
        config = Config(home=scratch / "home", warehouse=scratch / "warehouse",
                        landing=args.workdir / "landing", spark_master="local[2]",
                        driver_memory="8g")
        spark = build_spark(config, "upsert-bench")
        tables = open_tables(config, spark)
        batch = spark.read.parquet(str(landing)).select(
            "order_id", "client_id", "user_id", F.col("ts").cast("timestamp").alias("ts"),
            F.col("amount").cast(ORDERS.schema["amount"].dataType).alias("amount"),
            "currency", F.lit(None).cast("string").alias("event_id"),
            F.lit("bench").alias("source"), F.to_date("ts").alias("event_date")).cache()
        rows = batch.count()
        runs = []
        for version, label, rows_df in (
                (1, "new orders", batch),
                (2, "every order changed", batch.withColumn("amount", (F.col("amount") + 1).cast(
                    ORDERS.schema["amount"].dataType)))):
            started = time.monotonic()
            result = tables.upsert(ORDERS.name, rows_df, keys=["order_id"],
                                   partition_filter={"client_id": CLIENT},
                                   app_id="upsert-bench", version=version,
                                   metadata={"run_id": "bench", "cause": label})
            seconds = round(time.monotonic() - started, 2)
            runs.append({"label": label, "seconds": seconds, "inserted": result.inserted,
                         "updated": result.updated})
            print(f"{label}: {seconds:.1f}s ({result.inserted:,} inserted, "
                  f"{result.updated:,} updated)", flush=True)
        stored = tables.read(ORDERS.name, partition_filter={"client_id": CLIENT}).count()
        spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if stored != rows:
        raise SystemExit(f"client {CLIENT} holds {stored:,} orders after the upserts, not {rows:,}")
    result = {"benchmark": "orders upsert alone", "issue": 3, "git_head": git_head(),
              "command": "bench/upsert_bench.py --workdir " + str(args.workdir),
              "orders": rows, "runs": runs, "spark_master": "local[2]"}
    print(f"wrote {write_result('upsert', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
