"""kill -9 a backfill between merge, recompute and publish; the rerun ends where a clean run
ends: same tables, same topics, no duplicated corrections."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.io import read_point
from clickstream.io.kafka_broker import EmbeddedBroker
from clickstream.io.kafka_read import read_compacted
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.sessionize import run_sessionizer, stream_watermark_ms
from tests.jobs.test_backfill import (
    AHEAD_OF_THE_STREAM,
    ON_TIME_COPIES,
    START,
    STREAMED,
    assert_stored_once_and_folded_in,
    ms,
    order_row,
    pv_row,
    write_rows,
)
from tests.jobs.test_sessionize import (
    assert_read_point_is_latest,
    pageview,
    produce,
    table_rows,
)
from tests.jobs.test_sessionize_crash import cli_env

CRASH_POINTS = ("merge:", "record corrections:", "apply to tables:")

DRIVER = textwrap.dedent("""
    import os, signal, sys
    from clickstream.config import Config
    from clickstream.jobs.backfill import run_backfill
    crash_after = sys.argv[4]
    def progress(message):
        print(message, flush=True)
        if message.strip().startswith(crash_after):
            os.killpg(os.getpgid(0), signal.SIGKILL)
    run_backfill(Config.from_env(), kind=sys.argv[1], client_id=sys.argv[2], path=sys.argv[3],
                 progress=progress)
""")


def configured(config: Config, broker: EmbeddedBroker, name: str) -> Config:
    suffix = uuid.uuid4().hex[:8]
    result = config.replace(
        warehouse=config.warehouse / name, home=config.home / name,
        sessions_topic=f"sessions-{suffix}", attributions_topic=f"attributions-{suffix}")
    for topic in (result.sessions_topic, result.attributions_topic):
        broker.create_topic(topic, 2)
    return result


def snapshot(config: Config, spark: SparkSession) -> dict:
    def rows(name: str, key: str, drop: tuple[str, ...] = ()) -> list:
        return sorted((tuple((k, v) for k, v in sorted(r.items()) if k not in drop)
                       for r in table_rows(config, spark, name)), key=str)

    return {
        "pageviews": rows("pageviews", "event_id"),
        "orders": rows("orders", "order_id"),
        "sessions": rows("sessions", "session_id"),
        "attributions": rows("attributions", "order_id"),
        "corrections": sorted((r["entity"], r["key"], r["change"], r["old_revision"],
                               r["new_revision"]) for r in table_rows(config, spark,
                                                                      "corrections")),
        "sessions_topic": read_compacted(config, config.sessions_topic),
        "attributions_topic": read_compacted(config, config.attributions_topic),
    }


@pytest.mark.slow
def test_kill_9_between_steps_then_rerun_matches_a_clean_run(
    kafka_config: Config, broker: EmbeddedBroker, spark: SparkSession
) -> None:
    """Three batches; each one's first attempt is killed after a different step."""
    clean = configured(kafka_config, broker, "clean")
    crashed = configured(kafka_config, broker, "crashed")
    pageviews = [pv_row(f"e{i}", f"u{i % 3}", i * 7) for i in range(30)]
    later = [pv_row(f"x{i}", f"u{i % 3}", i * 7 + 3) for i in range(0, 30, 4)]
    orders = [order_row(f"o{i}", f"u{i % 3}", i * 11 + 1) for i in range(12)]
    write_rows(kafka_config, "p1", pageviews, "parquet")
    write_rows(kafka_config, "o1", orders, "csv")
    write_rows(kafka_config, "p2", later, "jsonl")
    steps = [("pageviews", "p1"), ("orders", "o1"), ("pageviews", "p2")]

    for kind, path in steps:
        run_backfill(clean, kind=kind, client_id="client-00", path=path, spark=spark,
                     progress=lambda _: None)

    for (kind, path), crash_after in zip(steps, CRASH_POINTS, strict=True):
        child = subprocess.run(
            [sys.executable, "-c", DRIVER, kind, "client-00", path, crash_after],
            env=cli_env(crashed), capture_output=True, text=True, timeout=600,
            start_new_session=True)
        assert child.returncode == -9, child.stdout + child.stderr
        # Killed after its merge or its plan: readers still see the client as it was.
        held = [g.client_id for g in read_point.open_groups(crashed)]
        assert held == ([] if crash_after == "apply to tables:" else ["client-00"])
        run_backfill(crashed, kind=kind, client_id="client-00", path=path, spark=spark,
                     progress=lambda _: None)
        assert read_point.open_groups(crashed) == []

    assert snapshot(crashed, spark) == snapshot(clean, spark)
    assert_read_point_is_latest(crashed, spark)
    assert os.path.isdir(Path(crashed.warehouse) / "corrections")


def test_a_run_resumed_after_its_plan_still_queues_what_the_stream_owns(
    stream_config: Config, spark: SparkSession
) -> None:
    """Orders of a user whose session the stream still holds open are queued for the scheduled
    recompute; a run killed after recording its plan resumes that plan, and must not lose them."""
    def at(minutes: int) -> datetime:
        return START + timedelta(minutes=minutes)

    produce(stream_config, [pageview("open", at(0)), pageview("open", at(20)),
                            pageview("open", at(40))])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [pageview("other", at(45))])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert stream_watermark_ms(stream_config, "client-00") == ms(START + timedelta(minutes=45 - 10))
    orders = [order_row("o-open", "open", 25),  # inside the session the stream holds open
              order_row("o-old", "old", -24 * 60)]  # long closed: planned and recorded
    write_rows(stream_config, "late", orders, "jsonl")

    child = subprocess.run(
        [sys.executable, "-c", DRIVER, "orders", "client-00", "late", "record corrections:"],
        env=cli_env(stream_config), capture_output=True, text=True, timeout=600,
        start_new_session=True)
    assert child.returncode == -9, child.stdout + child.stderr
    resumed = run_backfill(stream_config, kind="orders", client_id="client-00", path="late",
                           spark=spark, progress=lambda _: None)

    # The totals the plan's rows cannot give back come from the commit that recorded them.
    totals = resumed.corrections
    assert (totals.resumed, totals.totals_recorded, totals.orders_attributed,
            totals.orders_unattributed, totals.deferred_users) == (True, True, 0, 1, 1)
    assert "orders attributed 0, unattributed 1" in totals.describe()
    assert {r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")} == {
        "o-open"}
    assert {r["order_id"]: r["session_id"]
            for r in table_rows(stream_config, spark, "attributions")} == {"o-old": None}


@pytest.mark.parametrize(("crash_after", "merged_earlier"), [
    ("queued ahead of the merge", False), ("merge:", True)])
def test_a_backfill_killed_before_it_planned_stores_once_what_the_stream_then_receives(
    stream_config: Config, spark: SparkSession, crash_after: str, merged_earlier: bool
) -> None:
    """(Z11, Z14) Each batch's first attempt is killed before its plan queued the rows of u,
    whom the stream holds: after its merge, or before it, once its rows were queued ahead of
    it. The stream then receives the same records on time. Killed after the merge, they were
    stored twice (and the client's next backfill of that day failed its tables_after_merge
    gate: duplicate keys); killed before, the rerun stores them."""
    produce(stream_config, STREAMED)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    paths = {kind: write_rows(stream_config, kind, rows, "parquet")
             for kind, rows in AHEAD_OF_THE_STREAM}
    for kind, path in paths.items():
        child = subprocess.run(
            [sys.executable, "-c", DRIVER, kind, "client-00", path, crash_after],
            env=cli_env(stream_config), capture_output=True, text=True, timeout=600,
            start_new_session=True)
        assert child.returncode == -9, child.stdout + child.stderr
    produce(stream_config, ON_TIME_COPIES)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    for kind, path in paths.items():
        said: list[str] = []
        rerun = run_backfill(stream_config, kind=kind, client_id="client-00", path=path,
                             spark=spark, progress=said.append)
        # The run's merged row, whichever attempt stored it (the killed one, after its merge).
        assert (rerun.rows_merged, rerun.corrections.deferred_users) == (1, 1)
        assert any("merged by an earlier attempt" in line for line in said) is merged_earlier
    assert_stored_once_and_folded_in(stream_config, spark)
