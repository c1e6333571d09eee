"""Validating one large single-row-group Parquet batch, spread over the cores or as read.

    .venv/bin/python bench/batch_spread_bench.py --rows 525234 --rounds 3
    .venv/bin/python bench/batch_spread_bench.py --rows 525234 --rounds 3 --cold

Spark reads a Parquet file by row groups, and pyarrow and pandas write up to ~1M rows as one:
a year of orders (the backfill benchmark's 525k) was validated, cached and merged in one task
until ``batch_input`` spread such a batch by key (``_spread_over_cores``). This measures what
that changes where it is taken: reading the batch, validating it (the copies' count, then the
cached batch's count), the ``historical_batch`` checks' job and the valid rows' count, both
readings alternated. In one process after a first round that warms the JVM, or with
``--cold`` each reading in a new process, as a backfill runs. Prints one line per reading.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from proc_cpu import process_cpu_s
from pyspark.sql import functions as F
from results_file import git_dirty, git_head, write_result

from clickstream.config import Config
from clickstream.jobs import batch_input
from clickstream.jobs.generate import write_table
from clickstream.quality.checks import historical_batch_checks
from clickstream.spark_session import build_spark

READINGS = {"spread": batch_input.SPREAD_MIN_BYTES, "as read": 1 << 62}


def _config(root: Path) -> Config:
    return Config(home=root / "home", warehouse=root / "warehouse", landing=root / "landing",
                  spark_master="local[2]", shuffle_partitions=2)


def _write_batch(root: Path, rows: int) -> None:
    start = datetime(2025, 11, 1, tzinfo=UTC)
    write_table(pa.table({
        "order_id": [f"o{i}" for i in range(rows)], "client_id": ["client-00"] * rows,
        "user_id": [f"u{i % 40_000}" for i in range(rows)],
        "ts": pa.array([start + timedelta(seconds=60 * i) for i in range(rows)],
                       pa.timestamp("ms", tz="UTC")),
        "amount": [f"{i % 500}.{i % 100:02d}" for i in range(rows)],
        "currency": ["EUR"] * rows}), _config(root).landing / "batch", "parquet",
        rows_per_file=rows)


def _readings(root: Path, labels: list[str]) -> list[dict[str, Any]]:
    """Each of ``labels`` read and validated once, in this process, in order."""
    config = _config(root)
    spark = build_spark(config, "batch-spread-bench")
    jvm = spark._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    files = batch_input.list_batch_files(config, "batch")
    done = []
    try:
        for label in labels:
            batch_input.SPREAD_MIN_BYTES = READINGS[label]
            started, cpu = time.monotonic(), process_cpu_s(jvm)
            raw = batch_input.read_batch(spark, files, "orders")
            batch = batch_input.validate_batch(raw, "orders", "client-00",
                                               config.max_ts_ahead_ms).persist()
            rows = batch.count()
            validated = time.monotonic()
            historical_batch_checks(batch, raw.schema, "orders", "order_id", "client-00")
            valid = batch_input.valid_rows(batch, "orders").count()
            finished, cpu_used = time.monotonic(), process_cpu_s(jvm) - cpu
            tasks = [r["count"] for r in batch.groupBy(F.spark_partition_id().alias("task"))
                     .count().orderBy("task").collect()]
            batch.unpersist(blocking=True)
            if valid != rows:
                raise SystemExit(f"{label}: {valid:,} valid rows of {rows:,}")
            done.append({"reading": label, "rows_of_tasks_with_rows": tasks,
                         "validate_s": round(validated - started, 2),
                         "checks_and_valid_s": round(finished - validated, 2),
                         "seconds": round(finished - started, 2),
                         "jvm_cpu_s": round(cpu_used, 1)})
    finally:
        batch_input.SPREAD_MIN_BYTES = READINGS["spread"]
        spark.stop()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=525_234)
    parser.add_argument("--rounds", type=int, default=3, help="warm: the first one warms the JVM")
    parser.add_argument("--cold", action="store_true", help="each reading in a new process")
    parser.add_argument("--in-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_child:  # --cold's child: one reading of the batch under this root
        root, label = json.loads(args.in_child)
        print(json.dumps(_readings(Path(root), [label])[0]))
        return
    root = Path(tempfile.mkdtemp(prefix="batch-spread-bench-"))
    runs = []
    try:
        _write_batch(root, args.rows)
        order = [label for round_ in range(args.rounds)
                 for label in (list(READINGS) if round_ % 2 == 0 else list(READINGS)[::-1])]
        if args.cold:
            for label in order:
                child = subprocess.run(
                    [sys.executable, __file__, "--in-child", json.dumps([str(root), label])],
                    capture_output=True, text=True, check=True)
                runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
        else:
            runs = _readings(root, order)
            for run in runs:
                print(run, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cold = " --cold" if args.cold else ""
    result = {"benchmark": "one single-row-group Parquet batch validated, spread or as read",
              "issue": 3, "git_head": git_head(), "dirty": git_dirty("spark"),
              "command": f"bench/batch_spread_bench.py --rows {args.rows} --rounds "
                         f"{args.rounds}{cold}",
              "rows": args.rows, "row_groups": 1, "cold": args.cold, "runs": runs,
              "spark_master": "local[2]"}
    print(f"wrote {write_result('batch-spread', result)}")


if __name__ == "__main__":
    main()
