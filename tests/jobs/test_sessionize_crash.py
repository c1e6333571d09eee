"""kill -9 the sessionizer (driver, JVM and workers) at random points, and SIGTERM it once,
restart, and check that nothing was lost or doubled and that the sessions topic still equals
the sessions table."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from clickstream.config import ENV_NAMES, Config
from clickstream.io.kafka_broker import EmbeddedBroker
from clickstream.jobs.generate import Delivery, Scale, live_records
from tests import child_jvm
from tests.jobs.test_sessionize import (
    SCALE,
    assert_sessions_match_reference,
    assert_topic_equals_table,
    pageview,
    produce,
    table_rows,
)
from tests.reference import valid_events

CLI = [sys.executable, "-m", "clickstream.cli"]
JOB_LINE = re.compile(r"sessionize[ :]|  micro-batch \d+: ")
"""A line the sessionizer job prints. The JVM (log4j) and the Python processes Spark starts
write to the same stream on their own: at a stop, PySpark's source runner and worker daemon
print a BrokenPipeError traceback once the JVM closed their socket, and one such traceback
followed the job's summary in a CI run (the log was read as they wrote)."""


def cli_env(config: Config) -> dict[str, str]:
    env = dict(os.environ)
    for name, var in ENV_NAMES.items():
        value = getattr(config, name)
        if name in ("kafka_options", "spark_kafka_options"):
            continue
        env[var] = str(value)
    env["CLICKSTREAM_TRIGGER_INTERVAL"] = "0.5s"
    return {**env, **child_jvm.temp_folders_in(config.home / "jvm-temp")}


def start_sessionizer(config: Config, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "sessionize"], env=cli_env(config), stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def java_args(process_group: int) -> list[str]:
    """The command line of the JVM in a process group (the sessionizer's Spark driver)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != process_group:
                continue
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue  # ended while we looked
        if Path(args[0]).name == "java":
            return args
    raise AssertionError(f"no JVM in process group {process_group}")


def logged(config: Config, log: str) -> list[int]:
    """The batch ids in one of the sessionizer checkpoint's logs (offsets, commits)."""
    folder = config.checkpoint_path("sessionize") / log
    return sorted(int(p.name) for p in folder.glob("[0-9]*")) or [-1]


def wait_for_a_batch_in_flight(config: Config, timeout_s: float = 120) -> int:
    """The id of a micro-batch planned and not yet committed, once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        planned, committed = logged(config, "offsets")[-1], logged(config, "commits")[-1]
        if planned > committed:
            return planned
        time.sleep(0.05)
    raise AssertionError(f"no micro-batch was in flight within {timeout_s}s")


def group_ends(process_group: int, timeout_s: float = 30) -> bool:
    """Whether every process of the group has ended within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(process_group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def wait_for_batches(log: Path, at_least: int, timeout_s: float = 480) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count("sessionize batch ") >= at_least:
            return
        time.sleep(0.2)
    raise AssertionError(f"sessionizer made no progress in {timeout_s}s:\n{log.read_text()}")


@pytest.mark.slow
def test_kill_9_at_random_points_loses_and_doubles_nothing(
    kafka_config: Config, broker: EmbeddedBroker, spark: SparkSession, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    config = kafka_config.replace(
        events_topic=f"events-{suffix}", sessions_topic=f"sessions-{suffix}",
        attributions_topic=f"attributions-{suffix}", max_events_per_trigger=80,
        driver_memory="1g")
    for topic in (config.events_topic, config.sessions_topic, config.attributions_topic):
        broker.create_topic(topic, 4)
    scale = Scale(**{**SCALE.__dict__, "clients": 3})
    records = live_records(scale, Delivery(late_fraction=0.02, duplicate_fraction=0.1,
                                           bad_fraction=0.02), seed=77)
    rng = random.Random(77)
    chunks = records
    cut = [0, len(chunks) // 3, 2 * len(chunks) // 3, len(chunks)]
    log = tmp_path / "sessionize.log"
    batches_seen = 0
    for round_number in range(3):
        produce(config, chunks[cut[round_number]: cut[round_number + 1]])
        process = start_sessionizer(config, log)
        try:
            batches_seen += 1
            wait_for_batches(log, batches_seen)
            if round_number == 0:  # the long-running driver takes its whole heap at start
                assert {"-Xmx1g", "-Xms1g", "-XX:+AlwaysPreTouch"} <= set(
                    java_args(process.pid))
            time.sleep(rng.uniform(0.0, 3.0))  # a random point inside the next batches
            if round_number == 2:  # the last round is stopped as the README says: SIGTERM
                in_flight = wait_for_a_batch_in_flight(config)
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
                text = log.read_text()
                # The summary is the last line the job prints; the JVM and Spark's Python
                # processes write to the same stream, so their lines may follow (JOB_LINE).
                own_lines = [line for line in text.splitlines() if JOB_LINE.match(line)]
                assert re.match(r"sessionize: \d+ micro-batch", own_lines[-1]), text[-3000:]
                assert "StackOverflowError" not in text and "Exception in thread" not in text
                assert logged(config, "commits")[-1] >= in_flight  # finished, not cut off
                assert group_ends(process.pid), "the sessionizer's JVM outlived it"
        finally:
            with contextlib.suppress(ProcessLookupError):  # none left after a SIGTERM
                os.killpg(process.pid, signal.SIGKILL)  # the driver's JVM too
            process.wait()
        batches_seen = log.read_text().count("sessionize batch ")

    finish = subprocess.run([*CLI, "sessionize", "--until-caught-up"], env=cli_env(config),
                            capture_output=True, text=True, timeout=600)
    assert finish.returncode == 0, finish.stdout + finish.stderr

    events = valid_events(records)
    pageviews = [r["event_id"] for r in table_rows(config, spark, "pageviews")]
    assert len(pageviews) == len(set(pageviews)), "a pageview was stored twice"
    assert set(pageviews) == {e["event_id"] for e in events if e["event_type"] == "pageview"}
    orders = [r["order_id"] for r in table_rows(config, spark, "orders")]
    assert sorted(orders) == sorted(e["order_id"] for e in events if e["event_type"] == "order")
    quarantine = [r["source"] for r in table_rows(config, spark, "quarantine")]
    assert len(quarantine) == len(set(quarantine)) == sum(1 for k, _ in records if k is None)

    queued = {r["record_id"] for r in table_rows(config, spark, "recompute_queue")}
    on_time = [e for e in events
               if (e["order_id"] if e["event_type"] == "order" else e["event_id"]) not in queued]
    rows = assert_sessions_match_reference(config, spark, on_time)
    assert_topic_equals_table(config, rows)
    # And after the recompute folded the queue in, every valid event is in the sessions: a
    # replay that queued an on-time event (left out above) still loses nothing.
    recompute = subprocess.run([*CLI, "recompute"], env=cli_env(config), capture_output=True,
                               text=True, timeout=600)
    assert recompute.returncode == 0, recompute.stdout + recompute.stderr
    assert table_rows(config, spark, "recompute_queue") == []
    assert_topic_equals_table(config, assert_sessions_match_reference(config, spark, events,
                                                                      revised=True))


def test_ctrl_c_stops_the_sessionizer_cleanly_and_says_it_was_interrupted(
    kafka_config: Config, broker: EmbeddedBroker, spark: SparkSession, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) stops as SIGTERM does, after the
    micro-batch, and exits 130: a script running the sessionizer (the demo) went on to its
    next step after a Ctrl-C, as bash goes on after a command that exits 0."""
    suffix = uuid.uuid4().hex[:8]
    config = kafka_config.replace(
        events_topic=f"events-{suffix}", sessions_topic=f"sessions-{suffix}",
        attributions_topic=f"attributions-{suffix}", driver_memory="1g")
    for topic in (config.events_topic, config.sessions_topic, config.attributions_topic):
        broker.create_topic(topic, 4)
    produce(config, [pageview("u", datetime(2026, 11, 1, tzinfo=UTC), "p1")])
    log = tmp_path / "sessionize.log"
    process = start_sessionizer(config, log)
    try:
        wait_for_batches(log, 1)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=120) == 128 + signal.SIGINT, log.read_text()[-3000:]
        assert re.search(r"^sessionize: stopped; micro-batches up to \d+ are committed$",
                         log.read_text(), re.MULTILINE), log.read_text()[-3000:]
        assert [r["event_id"] for r in table_rows(config, spark, "pageviews")] == ["p1"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
