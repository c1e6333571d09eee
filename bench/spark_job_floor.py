"""The fixed cost of one Spark job process on this machine: the least any `clickstream` step pays.

Each run is a fresh Python process that does what every backfill / recompute step does before
its real work, and nothing else: start Spark with the product's settings
(``spark_session.build_spark``), commit 10 rows to a new Delta table with the product's writer
(``append_once``) and read them back through the Delta log. The wall time of the whole process
is the floor under the backfill's time for any batch, however small (issue #3 compares the
backfill with a DuckDB recompute of a year of data, 14.6-16.1 s in BENCHMARKS.md).

Usage: ``.venv/bin/python bench/spark_job_floor.py [--runs 3] [--class-archive auto,off]``;
writes ``bench/results/spark-job-floor-<UTC stamp>.json`` and prints one line per setting.
``--class-archive`` alternates the settings of ``CLICKSTREAM_JVM_CLASS_ARCHIVE`` run by run
(session 38: the JVM class archive, ``clickstream.jvm_class_archive``).
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

from proc_cpu import process_tree
from results_file import git_dirty, git_head, write_result


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
    jvm = spark.sparkContext._gateway.proc.pid  # the JVM pyspark started for this process
    jvm_cpu_s = sum(cpu for _, cpu in process_tree(jvm).values())  # its Python workers too
    spark.stop()
    own = os.times()
    print(json.dumps({"spark_up_s": spark_up, "written_s": written, "read_s": done,
                      "rows_read": read_back, "jvm_cpu": round(jvm_cpu_s, 2),
                      "python_cpu": round(own.user + own.system, 2)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes to time")
    parser.add_argument("--class-archive", default="auto",
                        help="CLICKSTREAM_JVM_CLASS_ARCHIVE settings to alternate (auto,off)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return 0
    runs = []
    modes = args.class_archive.split(",")
    for index in range(args.runs * len(modes)):
        mode = modes[index % len(modes)]
        with tempfile.TemporaryDirectory(prefix="clickstream-floor-") as folder:
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, __file__, "--child", folder], capture_output=True, text=True,
                check=False, env={**os.environ, "CLICKSTREAM_JVM_CLASS_ARCHIVE": mode})
            wall = time.monotonic() - started
        if done.returncode != 0:
            print(f"spark job floor: a run failed: {done.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
            return 1
        steps = json.loads(done.stdout.strip().splitlines()[-1])
        # CLOCK_MONOTONIC is one clock for the whole machine: the child's readings are seconds
        # since this process started it.
        runs.append({"class_archive": mode, "process_wall_s": round(wall, 2),
                     "rows_read": steps["rows_read"], "jvm_cpu_s": steps["jvm_cpu"],
                     "python_cpu_s": steps["python_cpu"],
                     **{k: round(v - started, 2) for k, v in steps.items() if k.endswith("_s")},
                     "loadavg_after": os.getloadavg()[0]})
    by_mode = {mode: {f"median_{measure}": statistics.median(
        r[measure] for r in runs if r["class_archive"] == mode)
        for measure in ("process_wall_s", "spark_up_s", "jvm_cpu_s")} for mode in modes}
    result = {"benchmark": "spark-job-floor", "commit": git_head(),
              "uncommitted": git_dirty("spark", "bench"), "cpus": os.cpu_count(),
              "runs": runs, "median_process_wall_s": by_mode[modes[0]]["median_process_wall_s"],
              "by_class_archive": by_mode,
              "finished_at": datetime.now(UTC).isoformat(timespec="seconds")}
    out = write_result("spark-job-floor", result, indent=1)
    for mode, medians in by_mode.items():
        print(f"spark job floor, class archive {mode}: {medians['median_process_wall_s']:.1f} s "
              f"per process, Spark up at {medians['median_spark_up_s']:.1f} s, JVM CPU "
              f"{medians['median_jvm_cpu_s']:.1f} s (medians of {args.runs}; Spark up, one "
              f"10-row Delta commit, one read)")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
