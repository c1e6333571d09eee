"""What a sessionizer checkpoint's first start pays to pin what the tables hold (``sessionize``
Z18): each client's latest ``ts`` in ``pageviews`` and ``orders``, from the files' statistics
where the table engine keeps them (``stored_history_until``).

Times ``stored_history_until`` on an existing warehouse (the backfill benchmark's, kept with
``--keep``: a year of one client's pageviews and orders beside two other clients'), in one
SparkSession, ``--rounds`` times: the first round pays the cold JVM and page cache as a
sessionizer's start does.

    .venv/bin/python bench/history_pin_bench.py --warehouse /tmp/bb-full/warehouse-backfill

Writes ``bench/results/history-pin-<UTC stamp>.json`` and prints one line per round.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import process_tree
from results_file import git_dirty, git_head, source_sha256, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warehouse", type=Path, required=True,
                        help="a warehouse folder holding pageviews and orders")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (args.warehouse / "pageviews").is_dir():
        parser.error(f"{args.warehouse} holds no pageviews table: run bench/backfill_bench.py "
                     "--scale full --workdir DIR --keep first, and name DIR/warehouse-backfill")

    from clickstream.config import Config
    from clickstream.io.delta_tables import open_tables
    from clickstream.jobs.sessionize import stored_history_until
    from clickstream.spark_session import build_spark

    config = Config(warehouse=args.warehouse, home=args.warehouse.parent / "pin-home",
                    shuffle_partitions=2)
    spark = build_spark(config, "history-pin-bench")
    tables = open_tables(config, spark)
    rows = {name: tables.row_count(name) for name in ("pageviews", "orders")}
    print(f"history pin: {args.warehouse}: {rows}", flush=True)
    rounds = []
    for number in range(args.rounds):
        started, cpu_before = time.monotonic(), _cpu_seconds()
        until = stored_history_until(tables, config.session_gap_ms)
        seconds, cpu = time.monotonic() - started, _cpu_seconds() - cpu_before
        rounds.append({"round": number, "seconds": round(seconds, 2),
                       "cpu_seconds": round(cpu, 2), "clients": len(until),
                       "load_average_1m": os.getloadavg()[0]})
        print(f"history pin round {number}: {seconds:.2f} s ({cpu:.1f} CPU-s), "
              f"{len(until)} clients", flush=True)
    spark.stop()
    path = write_result("history-pin", {
        "benchmark": "history-pin", "git_head": git_head(), "dirty": git_dirty("spark"),
        "source_sha256": source_sha256(), "warehouse": str(args.warehouse), "rows": rows,
        "rounds": rounds})
    print(f"history pin: {path}", flush=True)


def _cpu_seconds() -> float:
    """CPU seconds of this process and the JVM it started (the local executors' too)."""
    return sum(cpu for _, cpu in process_tree(os.getpid()).values())


if __name__ == "__main__":
    main()
