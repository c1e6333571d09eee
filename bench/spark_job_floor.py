"""The fixed cost of one Spark job process on this machine: the least any `clickstream` step pays.

Each run is a fresh Python process that does what every backfill / recompute step does before
its real work, and nothing else: start Spark with the product's settings
(``spark_session.build_spark``), commit 10 rows to a new Delta table with the product's writer
(``append_once``) and read them back through the Delta log. The wall time of the whole process
is the floor under the backfill's time for any batch, however small (issue #3 compares the
backfill with a DuckDB recompute of a year of data, 14.6-16.1 s in BENCHMARKS.md).

Usage: ``.venv/bin/python bench/spark_job_floor.py [--runs 3]``; writes
``bench/results/spark-job-floor-<UTC stamp>.json`` and prints one line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime

from results_file import git_head, write_result


def child(folder: str) -> None:
    """One run: Spark up, one commit, one read; prints the seconds of each step since start."""
    from pyspark.sql import functions as F

    from clickstream.config import Config
    from clickstream.io.delta_tables import open_tables
    from clickstream.spark_session import build_spark

    config = Config.from_env({**os.environ, "CLICKSTREAM_WAREHOUSE": folder,
                              "CLICKSTREAM_HOME": os.path.join(folder, "home")})
    spark = build_spark(config, "clickstream-bench-floor")
    spark_up = time.monotonic()
    tables = open_tables(config, spark)
    rows = spark.range(10).select(F.col("id").cast("string").alias("key"),
                                  F.lit("client-00").alias("client_id"))
    tables.append_once("floor", rows, app_id="bench-floor", version=1,
                       partition_by=("client_id",), metadata={"cause": "bench floor"})
    written = time.monotonic()
    read_back = tables.read("floor").count()
    done = time.monotonic()
    spark.stop()
    print(json.dumps({"spark_up_s": spark_up, "written_s": written, "read_s": done,
                      "rows_read": read_back}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes to time")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="clickstream-floor-") as folder:
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, __file__, "--child", folder], capture_output=True, text=True,
                check=False)
            wall = time.monotonic() - started
        if done.returncode != 0:
            print(f"spark job floor: a run failed: {done.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
            return 1
        steps = json.loads(done.stdout.strip().splitlines()[-1])
        # CLOCK_MONOTONIC is one clock for the whole machine: the child's readings are seconds
        # since this process started it.
        runs.append({"process_wall_s": round(wall, 2), "rows_read": steps["rows_read"],
                     **{k: round(v - started, 2) for k, v in steps.items() if k.endswith("_s")},
                     "loadavg_after": os.getloadavg()[0]})
    result = {"benchmark": "spark-job-floor", "commit": git_head(), "cpus": os.cpu_count(),
              "runs": runs,
              "median_process_wall_s": statistics.median(r["process_wall_s"] for r in runs),
              "finished_at": datetime.now(UTC).isoformat(timespec="seconds")}
    out = write_result("spark-job-floor", result, indent=1)
    print(f"spark job floor: {result['median_process_wall_s']:.1f} s per process (median of "
          f"{len(runs)}; Spark up, one 10-row Delta commit, one read) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
