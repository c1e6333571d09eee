"""Where a small ``sessionize --until-caught-up`` run's time goes: the moments of its query's
start and of each micro-batch, with Spark's own durations per micro-batch.

Each round is a fresh warehouse and topics: 12 pageviews of three users, a run, 6 more
pageviews five hours later, a second run (which closes the first run's sessions). All in one
process and one SparkSession, set up as a test worker's (``tests/conftest.py``: interpreted
expressions), so the numbers are those of the test suite's sessionizer runs; the first round
pays the cold JVM.

    .venv/bin/python bench/sessionizer_run_timeline.py [--rounds 3]

Prints one line per query event (seconds since the run was called, as the listener hears it:
Spark posts the events a few milliseconds late, so the last micro-batch's line may follow the
run's) and per run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers
from round_config import round_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pyspark.sql.streaming import StreamingQueryListener

    from clickstream.config import Config
    from clickstream.io.kafka_broker import EmbeddedBroker
    from clickstream.jobs.sessionize import run_sessionizer
    from clickstream.spark_session import build_spark
    from tests.conftest import INTERPRETED
    from tests.jobs.test_sessionize import pageview, produce

    root = Path(tempfile.mkdtemp(prefix="sessionizer-run-timeline-"))
    base = Config(home=root / "home", warehouse=root / "warehouse", landing=root / "landing",
                  spark_master="local[2]", shuffle_partitions=2, trigger_interval_seconds=0.5)
    spark = build_spark(base, "clickstream-bench-sessionizer-run-timeline")
    for key, value in INTERPRETED.items():
        spark.conf.set(key, value)
    called = time.monotonic()

    def at() -> str:
        return f"{time.monotonic() - called:6.2f} s"

    class Timeline(StreamingQueryListener):
        def onQueryStarted(self, event) -> None:
            print(f"  {at()} query started", flush=True)

        def onQueryProgress(self, event) -> None:
            progress = event.progress
            print(f"  {at()} micro-batch {progress.batchId} done: {progress.numInputRows} "
                  f"input rows, {dict(progress.durationMs)} ms", flush=True)

        def onQueryIdle(self, event) -> None:
            pass

        def onQueryTerminated(self, event) -> None:
            print(f"  {at()} query ended", flush=True)

    spark.streams.addListener(Timeline())
    start = datetime(2026, 3, 1, 9, tzinfo=UTC)
    with EmbeddedBroker(port=0) as broker:
        for round_number in range(args.rounds):
            config = round_config(base, broker, root / f"round-{round_number}",
                                  events_topic=True)
            produce(config, [pageview(f"u{i % 3}", start + timedelta(minutes=7 * i))
                             for i in range(12)])
            for run in (1, 2):
                called = time.monotonic()
                summary = run_sessionizer(config, until_caught_up=True, spark=spark)
                print(f"round {round_number} run {run}: {at()}; {summary.describe()}",
                      flush=True)
                produce(config, [pageview(f"u{i % 3}", start + timedelta(hours=5, minutes=7 * i))
                                 for i in range(6)])
    spark.stop()


if __name__ == "__main__":
    main()
