"""Validating one large CSV file: standard CSV (``batch_input`` B14) against Spark's defaults.

    .venv/bin/python bench/csv_read_bench.py --rows 1000000 --rounds 3

Standard CSV lets a quoted field span lines, so Spark reads each file in one task; its
defaults split a file across tasks but misread standard CSV (B14). This measures what the
correct reading costs on one file: the time to validate it and count its valid rows, the two
readings alternated after a first round that warms the JVM. Prints one line per reading.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from results_file import git_dirty, git_head, write_result

from clickstream.config import Config
from clickstream.jobs import batch_input
from clickstream.jobs.generate import write_table
from clickstream.spark_session import build_spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="the first one warms the JVM")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="csv-read-bench-"))
    config = Config(home=root / "home", warehouse=root / "warehouse", landing=root / "landing",
                    spark_master="local[2]", shuffle_partitions=2)
    n, start = args.rows, datetime(2026, 11, 1, tzinfo=UTC)
    write_table(pa.table({
        "event_id": [f"e{i}" for i in range(n)], "client_id": ["client-00"] * n,
        "user_id": [f"u{i % 5000}" for i in range(n)],
        "ts": [start + timedelta(seconds=i) for i in range(n)],
        "url": [f"/p/{i % 300}" for i in range(n)], "referrer": ["https://r/"] * n}),
        config.landing / "batch", "csv", rows_per_file=n)
    spark = build_spark(config, "csv-read-bench")
    standard = dict(batch_input.CSV_STANDARD)
    runs = []
    try:
        for round_ in range(args.rounds):
            for label, options in (("standard", standard), ("spark defaults", {})):
                batch_input.CSV_STANDARD = options
                files = batch_input.list_batch_files(config, "batch")
                started = time.monotonic()
                valid = batch_input.validate_batch(
                    batch_input.read_batch(spark, files, "pageviews"), "pageviews",
                    "client-00", config.max_ts_ahead_ms).where("error is null").count()
                seconds = round(time.monotonic() - started, 2)
                if valid != n:
                    raise SystemExit(f"{label}: {valid:,} valid rows of {n:,}")
                runs.append({"round": round_, "reading": label, "seconds": seconds})
                print(f"round {round_} {label}: {valid:,} valid rows in {seconds:.1f}s",
                      flush=True)
    finally:
        batch_input.CSV_STANDARD = standard
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "one CSV file validated, standard CSV vs Spark's defaults",
              "issue": 3, "git_head": git_head(), "dirty": git_dirty("spark"),
              "command": f"bench/csv_read_bench.py --rows {n} --rounds {args.rounds}",
              "rows": n, "files": 1, "runs": runs, "spark_master": "local[2]"}
    print(f"wrote {write_result('csv-read', result)}")


if __name__ == "__main__":
    main()
