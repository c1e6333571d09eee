"""Where a tiny backfill's time goes: the Spark jobs and Python time of a few-row correction.

A backfill of two pageviews, then one order, then the same pageviews again (a rerun: nothing
to do), each on a fresh warehouse and topics, ``--rounds`` times in one process and one
SparkSession (as a test worker runs them; the first round pays the cold JVM). Per run: wall
time, Spark jobs (a job group per run) and, with ``--profile``, the Spark actions the product
called (``collect``, ``count``, ``first``, ``localCheckpoint``, ...) with their time, taken by
``cProfile`` on the Python side, and with ``--jobs`` the Spark jobs by the call site Spark
names them after. Adaptive execution runs each shuffle stage of a query as a job of its own,
named like the action's: the product's line where PySpark records it (``collect``, ``first``),
else a frame of the Spark SQL thread pool that submitted it (``count``, ``localCheckpoint``,
broadcasts), listed here as ``NO_CALL_SITE``. Most of the test suite's time is runs like
these (BENCHMARKS.md, "The test suite's cost", session 55).

    .venv/bin/python bench/small_backfill_profile.py [--rounds 3] [--profile] [--jobs]

Writes ``bench/results/small-backfill-<UTC stamp>.json`` and prints one line per run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import REPO, git_dirty, git_head, write_result
from round_config import round_config

sys.path.insert(0, str(REPO))  # the tests' batch builders
ACTIONS = ("collect", "count", "first", "take", "isEmpty", "localCheckpoint", "toArrow",
           "toPandas", "toLocalIterator", "checkpoint")
NO_CALL_SITE = "(no call site: a count, a local checkpoint or a broadcast, from Spark's pool)"
POOL_FRAME = "withThreadLocalCaptured"  # the frame Spark names a pool thread's jobs after


def spark_actions(profile: cProfile.Profile) -> list[dict[str, Any]]:
    """The product's calls of DataFrame actions: caller, action, calls, cumulative seconds."""
    found = []
    for (path, _, name), (*_, callers) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if not path.endswith("pyspark/sql/classic/dataframe.py") or name not in ACTIONS:
            continue
        for (caller_path, line, caller), (_, calls, _, seconds) in callers.items():
            if "pyspark/" not in caller_path:
                found.append({"caller": f"{Path(caller_path).name}:{line} {caller}",
                              "action": name, "calls": calls, "seconds": round(seconds, 3)})
    return sorted(found, key=lambda a: -a["seconds"])


def jobs_by_call_site(tracker: Any, group: str) -> dict[str, int]:
    """The job group's Spark jobs counted by call site: the name of each job's last stage."""
    sites: Counter[str] = Counter()
    for job_id in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job_id)
        stages = [tracker.getStageInfo(stage) for stage in info.stageIds] if info else []
        names = [stage.name for stage in stages if stage is not None]
        site = names[-1] if names else "(stage info gone)"
        sites[NO_CALL_SITE if POOL_FRAME in site else site] += 1
    return dict(sites.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the runs of the last round and list their Spark actions")
    parser.add_argument("--jobs", action="store_true",
                        help="count the last round's Spark jobs by call site")
    args = parser.parse_args()

    from clickstream.config import Config
    from clickstream.io.kafka_broker import EmbeddedBroker
    from clickstream.jobs.backfill import run_backfill
    from clickstream.spark_session import build_spark
    from tests.jobs.test_backfill import order_row, pv_row, write_rows

    root = Path(tempfile.mkdtemp(prefix="small-backfill-"))
    base = Config(home=root / "home", warehouse=root / "warehouse", landing=root / "landing",
                  spark_master="local[2]", shuffle_partitions=2)
    spark = build_spark(base, "clickstream-bench-small-backfill")
    tracker = spark.sparkContext.statusTracker()
    runs: list[dict[str, Any]] = []
    with EmbeddedBroker(port=0) as broker:
        for round_number in range(args.rounds):
            config = round_config(base, broker, root / f"round-{round_number}")
            pageviews = write_rows(config, "p", [pv_row("a", "u", 0), pv_row("b", "v", 1)],
                                   "csv")
            orders = write_rows(config, "o", [order_row("o1", "u", 2)], "jsonl")
            for name, kind, path in (("pageviews", "pageviews", pageviews),
                                     ("orders", "orders", orders),
                                     ("pageviews again", "pageviews", pageviews)):
                group = f"{round_number}-{name}"
                spark.sparkContext.setJobGroup(group, group)
                profile = cProfile.Profile() if args.profile and round_number == args.rounds - 1 \
                    else None
                started = time.monotonic()
                if profile is not None:
                    profile.enable()
                run_backfill(config, kind=kind, client_id="client-00",  # type: ignore[arg-type]
                             path=path, spark=spark, progress=lambda _: None)
                if profile is not None:
                    profile.disable()
                run = {"round": round_number, "run": name,
                       "wall_s": round(time.monotonic() - started, 2),
                       "spark_jobs": len(tracker.getJobIdsForGroup(group))}
                if profile is not None:
                    run["spark_actions"] = spark_actions(profile)
                if args.jobs and round_number == args.rounds - 1:
                    run["jobs_by_call_site"] = jobs_by_call_site(tracker, group)
                runs.append(run)
                print(f"round {round_number} {name}: {run['wall_s']} s, "
                      f"{run['spark_jobs']} Spark jobs", flush=True)
                for site, count in run.get("jobs_by_call_site", {}).items():
                    print(f"  {count:4d}  {site}", flush=True)
    spark.stop()
    path = write_result("small-backfill", {"git_head": git_head(), "git_dirty": git_dirty(),
                                           "rounds": args.rounds, "runs": runs})
    print(f"result: {path}")


if __name__ == "__main__":
    main()
