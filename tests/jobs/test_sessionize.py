"""The streaming sessionizer end to end: embedded broker, Spark local, Delta tables on disk."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from deltalake.transaction import AddAction
from pyspark.sql import DataFrame, SparkSession

from clickstream.cli import main
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import (
    EXIT_NOT_RETRYABLE,
    ClickstreamError,
    ConfigError,
    DataLossError,
    RevenueOverflowError,
)
from clickstream.events.contract import URL_MAX_BYTES
from clickstream.io import read_point
from clickstream.io.delta_tables import DeltaTables, open_tables
from clickstream.io.kafka_broker import EmbeddedBroker
from clickstream.io.kafka_clients import make_producer
from clickstream.io.kafka_produce import flush_or_raise
from clickstream.io.kafka_read import read_compacted
from clickstream.jobs import sessionize
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.generate import Delivery, Scale, live_records
from clickstream.jobs.inspect import describe_read_point
from clickstream.jobs.recompute import run_full_recompute, run_recompute
from clickstream.jobs.republish import REPUBLISH_ROLE, run_republish
from clickstream.jobs.sessionize import (
    SESSIONIZER_ROLE,
    MicroBatchWriter,
    SessionizeSummary,
    StopBeforeMicroBatch,
    _side_by_side,
    build_stream,
    records_lock_path,
    run_sessionizer,
    sessionizer_lock_path,
    warehouse_sessionizer_lock_path,
)
from clickstream.progress import utc_text
from clickstream.sessions.batch_adapter import user_bucket
from clickstream.sessions.semantics import REVENUE_E4_MAX
from clickstream.tables import ORDERS, PAGEVIEWS
from tests.reference import reference_changelog_value, reference_sessions, valid_events

SCALE = Scale(clients=2, users_per_client=12, minutes=8 * 60,
              start=datetime(2026, 11, 1, tzinfo=UTC), sessions_per_user_per_day=6)


def produce(config: Config, records: list[tuple[str | None, str]], *,
            timestamp: datetime | None = None) -> None:
    """``timestamp``: the records' Kafka timestamp (CreateTime: the producer's clock)."""
    producer = make_producer(config)
    stamp = {} if timestamp is None else {"timestamp": int(timestamp.timestamp() * 1000)}
    for key, value in records:
        producer.produce(config.events_topic, key=key.encode() if key else None,
                         value=value.encode(), **stamp)
    flush_or_raise(producer, 30)


def pageview(user: str, at: datetime, event_id: str | None = None) -> tuple[str, str]:
    """One pageview record of client-00 as the events topic carries it."""
    return f"client-00/{user}", json.dumps({
        "event_id": event_id or f"{user}-{at.isoformat()}", "client_id": "client-00",
        "user_id": user, "event_type": "pageview", "ts": at.isoformat(), "url": "/",
        "referrer": ""})


def table_rows(config: Config, spark: SparkSession, name: str) -> list[dict]:
    tables = open_tables(config, spark)
    if not tables.exists(name):
        return []
    return tables.read_arrow(name).to_pylist()


def ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def assert_sessions_match_reference(config: Config, spark: SparkSession,
                                    events: list[dict], revised: bool = False) -> list[dict]:
    """Emitted sessions equal the reference's sessions that the final watermark closed; at
    their first revision, unless a recompute may have ``revised`` them."""
    expected, attributions = reference_sessions(events, config.session_gap_ms)
    watermark = max(e["ts_ms"] for e in events) - config.watermark_delay_ms
    closed = {sid: s for sid, s in expected.items()
              if s["end_ms"] + config.session_gap_ms <= watermark}
    rows = table_rows(config, spark, "sessions")
    got = {r["session_id"]: r for r in rows}
    assert len(rows) == len(got), "a session was written twice"
    assert set(got) == set(closed)
    for sid, session in closed.items():
        row = got[sid]
        assert (ms(row["session_start"]), ms(row["session_end"]), row["pageview_count"],
                row["landing_url"], row["exit_url"], row["order_count"], row["revenue"]) == (
            session["start_ms"], session["end_ms"], session["pageview_count"],
            session["landing_url"], session["exit_url"], session["order_count"],
            Decimal(session["revenue"]).quantize(Decimal("0.0001")))
        assert row["revision"] == 1 or revised
    stored_attributions = {r["order_id"]: r["session_id"]
                           for r in table_rows(config, spark, "attributions")}
    for order_id, session_id in stored_attributions.items():
        assert attributions[order_id] == session_id
    return rows


def assert_topic_equals_table(config: Config, rows: list[dict]) -> None:
    """Value for value: each session's changelog value as the contract shapes it."""
    topic = read_compacted(config, config.sessions_topic)
    assert topic == {row["session_id"]: reference_changelog_value(row) for row in rows}


def test_stream_gives_sessions_equal_to_a_straightforward_recomputation(
    stream_config: Config, spark: SparkSession
) -> None:
    records = live_records(SCALE, Delivery(late_fraction=0.0, duplicate_fraction=0.1,
                                           bad_fraction=0.03, jitter_seconds=120), seed=5)
    produce(stream_config, records)
    # A killed sessionizer's micro-batch of a checkpoint deleted since: no replay closes it.
    read_point.open_group(stream_config, open_tables(stream_config, spark),
                          "sessionize-deleted", read_point.EVERY_CLIENT)
    summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    events = valid_events(records)
    assert_read_point_is_latest(stream_config, spark)
    checkpoint = stream_config.checkpoint_path(sessionize.JOB)
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    point = read_point.current(stream_config)
    assert point is not None and point.stream_watermark_ms == sessionize.checkpoint_watermark_ms(
        checkpoint, last) > 0
    assert describe_read_point(stream_config)[1] == (
        f"  sessionizer's watermark there {utc_text(point.stream_watermark_ms)}: a session "
        "ending less than one gap before it may still be open")

    pageviews = table_rows(stream_config, spark, "pageviews")
    assert sorted(r["event_id"] for r in pageviews) == sorted(
        e["event_id"] for e in events if e["event_type"] == "pageview")
    orders = table_rows(stream_config, spark, "orders")
    assert sorted(r["order_id"] for r in orders) == sorted(
        e["order_id"] for e in events if e["event_type"] == "order")

    quarantine = table_rows(stream_config, spark, "quarantine")
    bad = [v for k, v in records if k is None]
    assert sorted(r["raw"] for r in quarantine) == sorted(bad)
    assert all(r["reason"] and r["source"].startswith(f"kafka:{stream_config.events_topic}/")
               for r in quarantine)
    assert summary.totals.duplicates + summary.totals.pageviews + summary.totals.orders >= len(
        events)

    rows = assert_sessions_match_reference(stream_config, spark, events)
    assert rows, "the data should close sessions"
    assert_topic_equals_table(stream_config, rows)

    # A rerun with nothing new changes nothing.
    versions = {name: open_tables(stream_config, spark).version(name)
                for name in ("pageviews", "sessions", "quarantine")}
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert versions == {name: open_tables(stream_config, spark).version(name)
                        for name in versions}


def assert_read_point_is_latest(config: Config, spark: SparkSession) -> None:
    """Every micro-batch closed its read point group (Z19): readers are sent to the tables'
    latest versions, no client held."""
    assert read_point.open_groups(config) == []
    point = read_point.current(config)
    assert point is not None and point.held == {}
    tables = open_tables(config, spark)
    assert dict(point.versions) == {
        spec.name: tables.version(spec.name) for spec in read_point.READ_POINT_TABLES}


def test_duplicates_and_reordering_within_the_watermark_change_nothing(
    stream_config: Config, spark: SparkSession, broker: EmbeddedBroker
) -> None:
    clean = live_records(SCALE, Delivery(late_fraction=0, duplicate_fraction=0, bad_fraction=0,
                                         jitter_seconds=1), seed=9)
    messy = live_records(SCALE, Delivery(late_fraction=0, duplicate_fraction=0.3,
                                         bad_fraction=0, jitter_seconds=240), seed=9)
    assert {v for _, v in clean} == {v for _, v in messy} and len(messy) > len(clean)
    first = stream_config
    second = stream_config.replace(
        home=stream_config.home.parent / "home2", warehouse=stream_config.home.parent / "wh2",
        events_topic=stream_config.events_topic + "-b",
        sessions_topic=stream_config.sessions_topic + "-b",
        attributions_topic=stream_config.attributions_topic + "-b")
    for topic in (second.events_topic, second.sessions_topic, second.attributions_topic):
        broker.create_topic(topic, 4)  # the sessionizer starts only with its changelog topics
    produce(first, clean)
    run_sessionizer(first, until_caught_up=True, spark=spark)
    produce(second, messy)
    run_sessionizer(second, until_caught_up=True, spark=spark)

    def snapshot(config: Config) -> tuple:
        sessions = sorted((r["session_id"], r["pageview_count"], r["revenue"])
                          for r in table_rows(config, spark, "sessions"))
        pageviews = sorted(r["event_id"] for r in table_rows(config, spark, "pageviews"))
        return sessions, pageviews

    assert snapshot(first) == snapshot(second)


def test_late_events_are_stored_and_queued_for_the_recompute(
    stream_config: Config, spark: SparkSession, capsys: pytest.CaptureFixture
) -> None:
    records = live_records(SCALE, Delivery(late_fraction=0.05, late_minutes=240,
                                           duplicate_fraction=0, bad_fraction=0), seed=21)
    stream_config = stream_config.replace(max_events_per_trigger=60)  # several micro-batches
    produce(stream_config, records)
    capsys.readouterr()
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    # A line counting late records says the watermark they were late for: one producer's
    # clock ahead moves it, and an operator saw only "N late queued" (review, session 78).
    lines = re.findall(r"^sessionize batch (\d+): .*?(\d+) late queued(.*)$",
                       capsys.readouterr().out, re.MULTILINE)
    late_lines = [(int(b), rest) for b, n, rest in lines if int(n)]
    assert late_lines and len(late_lines) < len(lines)
    checkpoint = stream_config.checkpoint_path("sessionize")
    for batch_id, rest in late_lines:
        watermark = utc_text(sessionize.checkpoint_watermark_ms(checkpoint, batch_id - 1))
        assert rest.endswith(f"attributions (late: ts at or before the watermark {watermark})"
                             f" ({rest.rsplit('(', 1)[1]}"), rest
    assert not any("(late:" in rest for _, n, rest in lines if not int(n))
    events = valid_events(records)
    pageviews = {r["event_id"] for r in table_rows(stream_config, spark, "pageviews")}
    assert pageviews == {e["event_id"] for e in events if e["event_type"] == "pageview"}
    queue = table_rows(stream_config, spark, "recompute_queue")
    assert queue, "the data has events later than the watermark"
    queued = {r["record_id"] for r in queue}
    # Sessions equal the reference over what the stream itself took in (queued rows excluded).
    on_time = [e for e in events
               if (e["order_id"] if e["event_type"] == "order" else e["event_id"]) not in queued]
    assert_sessions_match_reference(stream_config, spark, on_time)
    # A pageview hours later closes every session the stream holds: a recompute leaves a user
    # whose session is still open to the stream (its late rows stay queued), so otherwise
    # whether the queue empties depends on where the data ends.
    flush = pageview("flush", SCALE.start + timedelta(minutes=SCALE.minutes, hours=6), "flush")
    produce(stream_config, [flush])
    queue_version = open_tables(stream_config, spark).version("recompute_queue")
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    # (Z9) A micro-batch with nothing late leaves the queue as it was: for a while, each one
    # committed an empty transaction to it (review, session 77).
    assert open_tables(stream_config, spark).version("recompute_queue") == queue_version
    # The recompute folds the queue in: then they equal the reference over every valid event,
    # so an on-time event queued by mistake (and left out above) cannot hide a loss.
    run_recompute(stream_config, spark=spark)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_sessions_match_reference(stream_config, spark, valid_events([*records, flush]),
                                    revised=True)


def test_a_late_copy_of_a_stored_pageview_is_not_queued_again(
    stream_config: Config, spark: SparkSession
) -> None:
    """Z8: a retry delivered after the watermark passed its first, sessionized copy has nothing
    left to fold in; a late pageview no one stored is queued."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    minutes = [start + timedelta(minutes=m) for m in (0, 5, 60, 61)]
    for records in ([pageview("a", minutes[0], "p1"), pageview("b", minutes[2], "pb")],
                    [pageview("c", minutes[3], "pc")],  # the watermark moves on
                    [pageview("a", minutes[0], "p1"), pageview("a", minutes[1], "p2")]):
        produce(stream_config, records)
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    queued = [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")]
    assert queued == ["p2"]
    pageviews = [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")]
    assert sorted(pageviews) == ["p1", "p2", "pb", "pc"]


def test_an_event_from_a_wrong_clock_is_quarantined_and_does_not_move_the_watermark(
    stream_config: Config, spark: SparkSession
) -> None:
    """One event stamped decades ahead carried the watermark with it: every on-time event
    after it counted as late (stored and queued, never joining the stream's sessions). The
    wrong clock stamps the Kafka record too (CreateTime, the topic's default): the
    micro-batch's time is what catches it."""
    start = datetime(2026, 11, 1, tzinfo=UTC)  # behind the broker's clock, as received
    wrong_clock = datetime(2099, 1, 1, tzinfo=UTC)
    future = pageview("z", wrong_clock, "from-a-wrong-clock")
    produce(stream_config, [pageview("a", start, "p1")])
    produce(stream_config, [future], timestamp=wrong_clock)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [pageview("a", start + timedelta(minutes=5), "p2")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    assert table_rows(stream_config, spark, "recompute_queue") == []
    (quarantined,) = table_rows(stream_config, spark, "quarantine")
    assert quarantined["raw"] == future[1]
    assert quarantined["reason"].startswith(
        "ts '2099-01-01T00:00:00+00:00' is more than 10 minutes ahead of its arrival at the "
        "stream (")
    assert "stream (2099-" not in quarantined["reason"]  # the micro-batch's time, not the record's
    assert sorted(r["event_id"] for r in table_rows(stream_config, spark, "pageviews")) == [
        "p1", "p2"]
    produce(stream_config, [pageview("b", start + timedelta(hours=2), "closes-a")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    (session,) = table_rows(stream_config, spark, "sessions")
    assert (session["user_id"], session["pageview_count"]) == ("a", 2)


def test_data_loss_is_detected_instead_of_skipped(
    stream_config: Config, spark: SparkSession, broker: EmbeddedBroker,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    topic = f"events-loss-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    config = stream_config.replace(events_topic=topic)
    event = {"client_id": "c", "user_id": "u", "event_type": "pageview", "url": "/",
             "ts": "2026-11-01T00:00:00Z"}
    produce(config, [("c/u", json.dumps({**event, "event_id": f"e{i}"})) for i in range(10)])
    run_sessionizer(config, until_caught_up=True, spark=spark)
    produce(config, [("c/u", json.dumps({**event, "event_id": f"f{i}"})) for i in range(10)])
    broker.delete_records(topic, 0, 15)  # the broker drops 10..14 before we read them
    with pytest.raises(DataLossError, match=r"records 10\.\.14 were dropped") as lost:
        run_sessionizer(config, until_caught_up=True, spark=spark)
    assert str(lost.value).endswith(
        f" (the sessionizer's checkpoint: {config.checkpoint_path('sessionize')})")
    # A retry would fail the same way: the command's status says so (errors.NOT_RETRYABLE),
    # and the sessionizer DAG's task then fails without retrying.
    for name, variable in ENV_NAMES.items():
        if name not in ("kafka_options", "spark_kafka_options"):
            monkeypatch.setenv(variable, str(getattr(config, name)))
    assert main(["sessionize", "--until-caught-up"]) == EXIT_NOT_RETRYABLE
    assert "records 10..14 were dropped" in capsys.readouterr().err


def test_an_unforeseen_error_in_the_sink_is_named_and_its_traceback_kept(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture
) -> None:
    """Spark's first line of a failed micro-batch ends at "Return Message: Traceback (most
    recent call last):": the one line printed named neither the error nor its object, and
    no traceback was kept, as for a known error."""
    produce(stream_config, [pageview("u", datetime(2026, 11, 1, tzinfo=UTC), "e1")])

    def no_write_access(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "/warehouse/quarantine")

    monkeypatch.setattr(sessionize, "gate_raw_events", no_write_access)
    for name, variable in ENV_NAMES.items():
        if name not in ("kafka_options", "spark_kafka_options"):
            monkeypatch.setenv(variable, str(getattr(stream_config, name)))
    assert main(["sessionize", "--until-caught-up"]) == 1
    error = capsys.readouterr().err
    assert ("the sessionizer query failed: PermissionError: [Errno 13] Permission denied: "
            "'/warehouse/quarantine'; it resumes from its checkpoint when restarted; "
            "traceback in ") in error, error
    kept = Path(error.rsplit("traceback in ", 1)[1].strip())
    assert "PermissionError" in kept.read_text()


def test_accepted_data_loss_is_quarantined_once_and_the_stream_goes_on(
    stream_config: Config, spark: SparkSession, broker: EmbeddedBroker
) -> None:
    """CLICKSTREAM_FAIL_ON_DATA_LOSS=false (kafka_source K1): records the broker dropped
    before the sessionizer read them reach quarantine as one row naming the lost run, with
    the micro-batch that planned them, so a replay of that micro-batch records nothing twice;
    the checkpoint is kept and every record left is stored. A micro-batch holding nothing but
    the marker passes the raw_events gate too."""
    topic = f"events-loss-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    config = stream_config.replace(events_topic=topic, fail_on_data_loss=False)
    event = {"client_id": "c", "user_id": "u", "event_type": "pageview", "url": "/",
             "ts": "2026-11-01T00:00:00Z"}

    def send(prefix: str) -> None:
        produce(config, [("c/u", json.dumps({**event, "event_id": f"{prefix}{i}"}))
                         for i in range(10)])

    def lost(first: int, last: int) -> dict:
        return {"raw": None, "source": f"kafka:{topic}/0/{first}", "client_id": None,
                "reason": f"records {first}..{last} of {topic} partition 0 were dropped by the "
                "broker before the sessionizer read them (CLICKSTREAM_FAIL_ON_DATA_LOSS=false): "
                "they are lost; if you still have them, load them with `clickstream backfill`"}

    def quarantined() -> list[dict]:
        return sorted(({k: r[k] for k in ("raw", "source", "client_id", "reason")}
                       for r in table_rows(config, spark, "quarantine")),
                      key=lambda r: r["source"])

    def stored() -> list[str]:
        return sorted(r["event_id"] for r in table_rows(config, spark, "pageviews"))

    send("e")
    run_sessionizer(config, until_caught_up=True, spark=spark)
    send("f")
    broker.delete_records(topic, 0, 15)  # the broker drops 10..14 before we read them
    run_sessionizer(config, until_caught_up=True, spark=spark)
    survivors = sorted([f"e{i}" for i in range(10)] + [f"f{i}" for i in range(5, 10)])
    assert (quarantined(), stored()) == ([lost(10, 14)], survivors)

    # Replay that micro-batch, as after a crash before its commit: nothing is recorded twice.
    commits = config.checkpoint_path(sessionize.JOB) / "commits"
    last = max(int(path.name) for path in commits.glob("[0-9]*"))
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink(missing_ok=True)
    run_sessionizer(config, until_caught_up=True, spark=spark)
    run_sessionizer(config, until_caught_up=True, spark=spark)
    assert (quarantined(), stored()) == ([lost(10, 14)], survivors)

    send("g")
    broker.delete_records(topic, 0, 30)  # all of the next micro-batch is lost
    run_sessionizer(config, until_caught_up=True, spark=spark)
    assert (quarantined(), stored()) == ([lost(10, 14), lost(20, 29)], survivors)


def test_each_branch_parses_a_record_once(stream_config: Config, spark: SparkSession,
                                         spark_conf: Callable[[str, str], None],
                                         capsys: pytest.CaptureFixture) -> None:
    """Spark must not push the session branch's filter on ``event_type`` below the parse,
    where it becomes a second ``from_json`` of every record (~15% of the stream's throughput,
    BENCHMARKS.md): one parse for the records branch, one for the session branch."""
    spark_conf("spark.sql.maxPlanStringLength", str(2**31 - 16))  # the whole plan, uncut
    build_stream(spark, stream_config).explain("formatted")
    plan = capsys.readouterr().out
    assert plan.count("from_json(") == 2, plan


def test_a_batch_stores_its_pageviews_before_the_sessions_it_closes(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Z6) The sink writes side by side, yet a session visible in ``sessions`` has its
    pageviews in ``pageviews``: within a micro-batch the pageviews commit first, even when
    their commit is the slow one."""
    def slow_pageviews(table: str, attempt: int) -> None:
        if table == "pageviews":
            time.sleep(1.0)

    monkeypatch.setattr(sessionize, "open_tables", lambda config, spark: open_tables(
        config, spark, before_commit=slow_pageviews))
    records = live_records(SCALE, Delivery(late_fraction=0, duplicate_fraction=0,
                                           bad_fraction=0), seed=21)
    config = stream_config.replace(max_events_per_trigger=50)  # sessions close mid-stream
    produce(config, records)
    run_sessionizer(config, until_caught_up=True, spark=spark)

    def commit_times(name: str) -> dict[str, int]:
        """Commit time (epoch ms) by the micro-batch that made it."""
        return {c["cause"]: c["timestamp"] for c in open_tables(config, spark).history(name)
                if str(c.get("cause", "")).startswith("sessionize batch")}

    pageviews, sessions = commit_times("pageviews"), commit_times("sessions")
    both = sorted(set(pageviews) & set(sessions))
    assert both, "some micro-batch should store pageviews and close sessions"
    assert all(pageviews[batch] <= sessions[batch] for batch in both), (pageviews, sessions)


def test_side_by_side_writes_that_fail_together_raise_the_first_and_name_the_others(
    spark: SparkSession,
) -> None:
    """(Z6, Z7) Every write ends before the batch fails; the failure raised names the other
    write that failed too, whose reason was lost before."""
    def failing(reason: str) -> Callable[[], int]:
        def write() -> int:
            raise ValueError(reason)
        return write

    done: list[str] = []
    with pytest.raises(ValueError, match=r"^pageviews disk full") as raised:
        _side_by_side(spark, {"pageviews": failing("pageviews disk full"),
                              "quarantine": lambda: done.append("quarantine") or 1,
                              "sessions": failing("sessions commit refused")})
    assert done == ["quarantine"]
    assert raised.value.__notes__ == ["sessions failed as well: sessions commit refused"]


def probe_records_lock(monkeypatch: pytest.MonkeyPatch, module: object
                       ) -> dict[str, list[bool]]:
    """Per table, whether the records lock (Z14) was held at each of its commits by the tables
    ``module`` opens: filled as they commit."""
    held_at: dict[str, list[bool]] = {}

    def opened(config: Config, spark: SparkSession) -> DeltaTables:
        def lock_held(table: str, attempt: int) -> None:
            path = records_lock_path(config)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held_at.setdefault(table, []).append(True)
                    return
                fcntl.flock(handle, fcntl.LOCK_UN)
                held_at.setdefault(table, []).append(False)

        return open_tables(config, spark, before_commit=lock_held)

    monkeypatch.setattr(module, "open_tables", opened)
    return held_at


def test_a_batch_holds_the_records_lock_until_its_records_are_stored(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Z14) A backfill's merge holds the records lock from its read to its commit: a
    micro-batch holds it from its read of the queue through its records' commits, and lets
    it go before the sessions it derives (a merge waits for one wave, not a batch)."""
    held_at = probe_records_lock(monkeypatch, sessionize)
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("u", start), pageview("u", start + timedelta(hours=2))])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert held_at == {"pageviews": [True], "sessions": [False]}


@pytest.mark.parametrize("first_start", [False, True])
def test_a_second_signal_stops_a_batch_waiting_for_a_merge_at_once(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
    first_start: bool
) -> None:
    """(Z13) The micro-batch waits for the records lock a backfill's merge holds: Spark's
    ``stop()`` waits for the writer, which waited in ``flock`` as long as the merge ran, so a
    second signal did not stop it. It gives up its wait now and writes nothing; the next
    start stores the batch. A ``first_start`` waits before its first micro-batch, to pin what
    the tables hold (Z18), and gives up that wait the same way."""
    stored = []
    if not first_start:
        produce(stream_config, [pageview("p", datetime(2026, 11, 1, tzinfo=UTC), "p0")])
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
        stored = ["p0"]
    waiting = threading.Event()
    lock = sessionize.records_lock

    def noticed(config: Config, on_wait: Callable[[], None] | None = None, **kwargs):
        def wait() -> None:
            waiting.set()
            if on_wait is not None:
                on_wait()
        return lock(config, wait, **kwargs)

    stopped, merge_ended = threading.Event(), threading.Event()

    def signal_twice_once_it_waits() -> None:
        waiting.wait(120)  # and then whatever happened: the run must end
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        if not stopped.wait(60):  # still waiting: the merge ends, so that the run can end
            merge_ended.set()
            fcntl.flock(merge, fcntl.LOCK_UN)

    monkeypatch.setattr(sessionize, "records_lock", noticed)
    produce(stream_config, [pageview("u", datetime(2026, 11, 1, tzinfo=UTC), "u1")])
    path = records_lock_path(stream_config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as merge:  # a backfill's merge holds it
        fcntl.flock(merge, fcntl.LOCK_EX)
        signals = threading.Thread(target=signal_twice_once_it_waits, daemon=True)
        signals.start()
        summary = run_sessionizer(stream_config, spark=spark)
        stopped.set()
        signals.join()
    assert waiting.is_set() and not merge_ended.is_set()
    assert summary.batches == 0
    assert [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")] == stored
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert sorted(r["event_id"] for r in table_rows(stream_config, spark, "pageviews")) == [
        *stored, "u1"]


def test_a_replay_under_a_stricter_setting_quarantines_what_the_first_attempt_passed(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Z21) The micro-batch dies at its pageviews commit, its quarantine committed; it is
    replayed under a stricter CLICKSTREAM_MAX_TS_AHEAD, which refuses a pageview the first
    attempt passed. The replay skipped its committed quarantine write, so that pageview went
    to neither table (review, session 88). Each record is now in one of them, once."""
    sent = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("u", sent, "kept"),
                            pageview("u", sent + timedelta(minutes=5), "ahead"),
                            ("client-00/u", "not json")], timestamp=sent)

    def crash_at_the_pageviews_commit(table: str, attempt: int) -> None:
        if table != "pageviews":
            return
        deadline = time.monotonic() + 15  # written side by side: the quarantine's first
        while not table_rows(stream_config, spark, "quarantine") and time.monotonic() < deadline:
            time.sleep(0.2)
        raise RuntimeError("killed before the pageviews commit")

    monkeypatch.setattr(sessionize, "open_tables", lambda config, spark: open_tables(
        config, spark, before_commit=crash_at_the_pageviews_commit))
    with pytest.raises(ClickstreamError):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    monkeypatch.setattr(sessionize, "open_tables", open_tables)
    assert [r["raw"] for r in table_rows(stream_config, spark, "quarantine")] == ["not json"]
    assert table_rows(stream_config, spark, "pageviews") == []

    stricter = stream_config.replace(max_ts_ahead_minutes=1.0)
    run_sessionizer(stricter, until_caught_up=True, spark=spark)  # replays the micro-batch
    quarantined = table_rows(stream_config, spark, "quarantine")
    assert sorted(json.loads(r["raw"])["event_id"] if r["raw"] != "not json" else r["raw"]
                  for r in quarantined) == ["ahead", "not json"], quarantined
    assert len({r["source"] for r in quarantined}) == 2
    assert [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")] == ["kept"]


def test_a_crash_before_the_pageviews_commit_cannot_let_a_recompute_drop_the_late_pageview(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Z9) The micro-batch holding a late pageview dies at its pageviews commit, having waited
    for the queue's commit as long as a side-by-side queue write could take; a recompute runs
    while the stream is down, then the stream restarts and the recompute runs again: the late
    pageview reaches its session. Queued beside the pageviews, the queue row committed first,
    the first recompute found nothing stored to fold in and removed it, and the replay skipped
    its already committed queue write."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("a", start, "a1"),
                            pageview("a", start + timedelta(minutes=5), "a2"),
                            pageview("x", start + timedelta(hours=5), "x1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert [r["pageview_count"] for r in table_rows(stream_config, spark, "sessions")] == [2]

    def crash_at_the_pageviews_commit(table: str, attempt: int) -> None:
        if table != "pageviews":
            return
        deadline = time.monotonic() + 15
        while (not table_rows(stream_config, spark, "recompute_queue")
               and time.monotonic() < deadline):
            time.sleep(0.2)
        raise RuntimeError("killed before the pageviews commit")

    monkeypatch.setattr(sessionize, "open_tables", lambda config, spark: open_tables(
        config, spark, before_commit=crash_at_the_pageviews_commit))
    produce(stream_config, [pageview("a", start + timedelta(minutes=10), "late1")])
    with pytest.raises(ClickstreamError):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    monkeypatch.setattr(sessionize, "open_tables", open_tables)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    # The failed micro-batch holds every client at the read point until its replay (Z19).
    (held,) = read_point.open_groups(stream_config)
    assert held.client_id == read_point.EVERY_CLIENT and held.group.startswith("sessionize-")
    assert read_point.describe_open_groups(stream_config) == [
        f"{held.describe()}; no sessionizer is running: its next start replays the "
        "micro-batch and closes it"]
    stopped_at = read_point.current(stream_config)

    run_recompute(stream_config, spark=spark)  # scheduled, while the stream is down
    assert read_point.current(stream_config) == stopped_at
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # replays the batch
    assert_read_point_is_latest(stream_config, spark)
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "late1"]
    run_recompute(stream_config, spark=spark)

    sessions = [(r["user_id"], r["pageview_count"])
                for r in table_rows(stream_config, spark, "sessions") if r["user_id"] == "a"]
    assert sessions == [("a", 3)]
    assert table_rows(stream_config, spark, "recompute_queue") == []


def test_a_replay_publishes_the_attribution_its_crashed_attempt_stored(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Z16) A micro-batch commits O1's attribution and dies before publishing it; a backfill
    then queues O1 (the client sent it again), ahead of its merge (Z11). The replay left the
    queued order out of what it published, and the recompute found the stored row unchanged:
    O1 was in the table and never on the topic."""
    start = datetime(2026, 11, 1, 5, tzinfo=UTC)
    produce(stream_config, [pageview("x", start, "x1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [order("o", start - timedelta(minutes=5), "O1"),
                            pageview("x", start + timedelta(hours=1), "x2")])
    publish = sessionize.publish_attributions

    def killed(config: Config, rows: DataFrame) -> int:
        raise RuntimeError("killed between the attributions commit and their publish")

    monkeypatch.setattr(sessionize, "publish_attributions", killed)
    with pytest.raises(ClickstreamError):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    monkeypatch.setattr(sessionize, "publish_attributions", publish)
    assert [r["order_id"] for r in table_rows(stream_config, spark, "attributions")] == ["O1"]

    batch = stream_config.landing / "o"
    batch.mkdir(parents=True)
    (batch / "orders.csv").write_text(
        "order_id,client_id,user_id,ts,amount,currency\n"
        f"O1,client-00,o,{(start - timedelta(minutes=5)).isoformat()},10.00,EUR\n")
    run_backfill(stream_config, kind="orders", client_id="client-00", path="o", spark=spark,
                 progress=lambda line: None)
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "O1"]

    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # replays the batch
    produce(stream_config, [pageview("x", start + timedelta(hours=5), "x3")])  # o is let go
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    run_recompute(stream_config, spark=spark, progress=lambda line: None)
    table = {r["order_id"]: reference_changelog_value(r)
             for r in table_rows(stream_config, spark, "attributions")}
    assert set(table) == {"O1"}
    assert read_compacted(stream_config, stream_config.attributions_topic) == table


def test_a_logout_before_the_pageviews_between_ends_no_session(
    stream_config: Config, spark: SparkSession
) -> None:
    """A field question (README, Field questions): a logout delivered before the pageviews
    between. Only pageviews shape sessions: the logout is stored in ``other_events``, once,
    and the session holds every pageview, however they were delivered."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    logout = ("client-00/u", json.dumps({
        "event_id": "bye", "client_id": "client-00", "user_id": "u", "event_type": "logout",
        "ts": (start + timedelta(minutes=25)).isoformat()}))
    produce(stream_config, [pageview("u", start, "p1"), logout, logout])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [pageview("u", start + timedelta(minutes=m), f"p{m}")
                            for m in (10, 20, 24)] + [
        pageview("w", start + timedelta(hours=2), "closes-u")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    (session,) = [r for r in table_rows(stream_config, spark, "sessions") if r["user_id"] == "u"]
    assert (session["session_start"], session["session_end"], session["pageview_count"]) == (
        start, start + timedelta(minutes=24), 4)
    assert [(r["event_id"], r["event_type"]) for r in table_rows(
        stream_config, spark, "other_events")] == [("bye", "logout")]


def test_orders_past_the_largest_session_revenue_stop_the_stream_as_not_retryable(
    stream_config: Config, spark: SparkSession
) -> None:
    """The session state refuses a revenue past 64 bits in Spark's Python worker: the query
    failed as "the sessionizer query failed: OverflowError ... it resumes from its checkpoint
    when restarted" (exit 1, retried), though the state holds those orders and stops so at
    every restart (review, session 78). Now the product's reason, not retryable."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    count = REVENUE_E4_MAX // (10**16 - 1) + 1  # 923 of the largest amount: past 64 bits
    produce(stream_config, [pageview("u", start, "p1"), *(
        order("u", start + timedelta(seconds=1 + i), f"o{i}", "999999999999.9999")
        for i in range(count)), pageview("w", start + timedelta(hours=2), "closes-u")])
    with pytest.raises(RevenueOverflowError, match=(
            r"^session [0-9a-f]+: its attributed orders add up to 922999999999999\.9077, .*; "
            r"the sessionizer's state holds those orders, so it stops so again at every")):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)


def order(user: str, at: datetime, order_id: str, amount: str = "10.00",
          event_id: str | None = None) -> tuple[str, str]:
    """One order record of client-00 as the events topic carries it."""
    return f"client-00/{user}", json.dumps({
        "event_id": event_id or f"ev-{order_id}", "client_id": "client-00", "user_id": user,
        "event_type": "order", "ts": at.isoformat(), "url": "/", "referrer": "",
        "order_id": order_id, "amount": amount, "currency": "EUR"})


def test_the_stream_splits_and_attributes_at_the_exact_boundaries(
    stream_config: Config, spark: SparkSession
) -> None:
    """Through real Spark (the property test drives the processor alone): pageviews a gap
    less 1 ms apart share a session, a gap apart do not; an order at end + gap less 1 ms is
    the session's, one at end + gap is not; a user's event arriving after later ones, inside
    the watermark delay, still joins its session."""
    gap = timedelta(milliseconds=stream_config.session_gap_ms)
    start = datetime(2026, 11, 1, 9, tzinfo=UTC)
    first_end = start + gap - timedelta(milliseconds=1)
    second = first_end + gap
    almost, exactly = second + gap - timedelta(milliseconds=1), second + gap
    # The watermark after the first micro-batch: p3's time less the delay.
    watermark = second - timedelta(milliseconds=stream_config.watermark_delay_ms)
    records = [pageview("u", start, "p1"), pageview("u", first_end, "p2"),
               pageview("u", second, "p3"), pageview("w", watermark + timedelta(minutes=5), "w2"),
               pageview("w", watermark + timedelta(minutes=2), "w1"),  # after w2, on time
               order("u", almost, "o-in"), order("u", exactly, "o-out"),
               pageview("flush", start + timedelta(days=1), "flush")]
    for chunk in (records[:3], records[3:4], records[4:]):  # micro-batches in this order
        produce(stream_config, chunk)
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    rows = assert_sessions_match_reference(stream_config, spark, valid_events(records))
    sessions = sorted((r["user_id"], r["pageview_count"], r["order_count"]) for r in rows)
    assert sessions == [("u", 1, 1), ("u", 2, 0), ("w", 2, 0)]
    attributions = {r["order_id"]: r["session_id"]
                    for r in table_rows(stream_config, spark, "attributions")}
    second_id = next(r["session_id"] for r in rows if r["session_start"] == second)
    assert attributions == {"o-in": second_id, "o-out": None}
    assert table_rows(stream_config, spark, "recompute_queue") == []  # nothing was late


def test_an_amount_too_large_to_keep_exactly_is_quarantined_and_the_stream_goes_on(
    stream_config: Config, spark: SparkSession
) -> None:
    """An amount times 10**4 must fit 64 bits: one with 16 digits before the point stopped
    the stream for good (the cast overflowed under ANSI in every replay)."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    too_large = order("a", start, "big", amount="1000000000000000.00")
    produce(stream_config, [too_large, order("a", start, "max", amount="999999999999.9999"),
                            pageview("a", start, "p1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert [r["order_id"] for r in table_rows(stream_config, spark, "orders")] == ["max"]
    assert [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")] == ["p1"]
    (quarantined,) = table_rows(stream_config, spark, "quarantine")
    assert quarantined["raw"] == too_large[1]
    assert quarantined["reason"].startswith(
        "amount '1000000000000000.00' is too large: at most 12 digits before the decimal point")


def test_records_that_are_not_utf8_are_quarantined_with_their_bytes_and_the_stream_goes_on(
    stream_config: Config, spark: SparkSession
) -> None:
    """The contract's values are UTF-8 JSON. Spark's cast of bytes to text does not check
    them: a Latin-1 url was stored as a valid pageview with its byte replaced (the record
    altered, not quarantined), and invalid bytes in a quarantined value or in the reason
    quoting a key failed the write's statistics at every replay, stopping the stream."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    latin1 = pageview("a", start, "latin")[1].replace('"url": "/"', '"url": "/caf\xe9"').encode(
        "latin-1")
    not_text = b"\xff\xfe{"
    bad_key = pageview("b", start, "bad-key")[1].encode()
    producer = make_producer(stream_config)
    for key, value in [(b"client-00/a", latin1), (b"client-00/a", not_text),
                       (b"client-00/\xff", bad_key),
                       tuple(part.encode() for part in pageview("c", start, "p1"))]:
        producer.produce(stream_config.events_topic, key=key, value=value)
    flush_or_raise(producer, 30)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")] == ["p1"]
    quarantined = {r["raw"]: r["reason"] for r in table_rows(stream_config, spark, "quarantine")}
    assert len(quarantined) == 3
    for value in (latin1, not_text):
        raw = "base64:" + base64.b64encode(value).decode()
        assert quarantined.pop(raw).startswith("value is not UTF-8 text")
    assert quarantined == {bad_key.decode(): quarantined[bad_key.decode()]}
    assert quarantined[bad_key.decode()].startswith("key is not UTF-8 text")


def with_url(record: tuple[str, str], url: str) -> tuple[str, str]:
    key, value = record
    return key, json.dumps({**json.loads(value), "url": url})


def test_a_pageview_whose_url_is_too_long_is_quarantined_and_the_stream_goes_on(
    stream_config: Config, spark: SparkSession
) -> None:
    """A session's value carries its landing and exit url: one pageview with a 600 KB url
    (one Kafka message) made a 1.2 MB session value, over the producer's limit
    (MSG_SIZE_TOO_LARGE), and the stream failed on it at every restart. Two urls of the
    largest length, of a character JSON escapes as six bytes, still fit."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    too_long = with_url(pageview("long", start, "p-long"), "/" + "x" * 600_000)
    landing, exit_url = ("/" + c * (URL_MAX_BYTES - 1) for c in ("\x01", "\x02"))
    produce(stream_config, [too_long, with_url(pageview("u", start, "u1"), landing),
                            with_url(pageview("u", start + timedelta(minutes=5), "u2"), exit_url),
                            pageview("w", start + timedelta(hours=5), "flush")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    (quarantined,) = table_rows(stream_config, spark, "quarantine")
    assert quarantined["raw"] == too_long[1]
    assert quarantined["reason"].startswith(
        f"url is 600001 bytes long, more than the {URL_MAX_BYTES} a url may have")
    (session,) = table_rows(stream_config, spark, "sessions")
    assert (session["user_id"], session["landing_url"], session["exit_url"]) == (
        "u", landing, exit_url)
    topic = read_compacted(stream_config, stream_config.sessions_topic)
    assert {k: (v["landing_url"], v["exit_url"]) for k, v in topic.items()} == {
        session["session_id"]: (landing, exit_url)}


def test_a_session_revenue_is_exact_to_the_last_decimal_at_the_largest_amount(
    stream_config: Config, spark: SparkSession
) -> None:
    """revenue_e4 / 10**4 must be a decimal division: as a double it kept ~16 significant
    digits, and 999999999999.9999 came out as 1000000000000.0000."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("a", start, "p1"),
                            order("a", start + timedelta(minutes=1), "max",
                                  amount="999999999999.9999"),
                            pageview("x", start + timedelta(hours=5), "x1")])  # closes a's
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    (session,) = table_rows(stream_config, spark, "sessions")
    assert (session["order_count"], session["revenue"]) == (1, Decimal("999999999999.9999"))
    topic = read_compacted(stream_config, stream_config.sessions_topic)
    assert Decimal(topic[session["session_id"]]["revenue"]) == Decimal("999999999999.9999")


def test_a_retried_pageview_does_not_drop_an_order_whose_order_id_equals_its_event_id(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z3) Pageview and order ids are separate namespaces: the state's duplicate row of the
    retried pageview '42' dropped the new order '42' from the orders table too, with no
    quarantine row."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("a", start, "42")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [pageview("a", start, "42"),  # an on-time retry: a duplicate
                            order("a", start + timedelta(minutes=1), "42", event_id="o-ev")])
    summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert summary.totals.duplicates == 1
    assert [r["order_id"] for r in table_rows(stream_config, spark, "orders")] == ["42"]
    assert [r["event_id"] for r in table_rows(stream_config, spark, "pageviews")] == ["42"]
    assert table_rows(stream_config, spark, "quarantine") == []


def test_differing_copies_of_an_id_in_one_micro_batch_are_stored_as_the_sessions_count_them(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z12) A producer reusing ids: of the copies of an id in one micro-batch, the table
    stores the one the session state counts, whichever arrives first: an on-time copy before a
    late one (the state never sees late rows), then the earlier, then the smaller amount."""
    start = datetime(2026, 11, 1, 9, tzinfo=UTC)

    def at(hours: int) -> timedelta:  # after 09:00
        return timedelta(hours=hours)

    produce(stream_config, [pageview("w", start + at(3), "advance")])  # the watermark: ~12:00
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    on_time_p, late_p = pageview("u", start + at(5), "p"), pageview("u", start, "p")
    later_q, earlier_q = pageview("u", start + at(6), "q"), pageview("u", start + at(4), "q")
    earlier_r, later_r = pageview("u", start + at(7), "r"), pageview("u", start + at(8), "r")
    larger, smaller = (order("u", start + at(4) + timedelta(minutes=1), "o", amount)
                       for amount in ("9.00", "3.00"))
    flush = pageview("flush", start + timedelta(days=1), "flush")
    produce(stream_config, [late_p, on_time_p, later_q, larger, earlier_q, smaller, earlier_r,
                            later_r, flush])  # winners after losers, and before (r)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    stored = {r["event_id"]: r["ts"] for r in table_rows(stream_config, spark, "pageviews")}
    assert stored == {"advance": start + at(3), "p": start + at(5), "q": start + at(4),
                      "r": start + at(7), "flush": start + timedelta(days=1)}
    assert [(r["order_id"], r["amount"]) for r in table_rows(stream_config, spark, "orders")] == [
        ("o", Decimal("3.00"))]
    assert table_rows(stream_config, spark, "recompute_queue") == []  # the late copy lost
    # The sessions are those of the stored copies: u at 13:00 holds the order.
    rows = assert_sessions_match_reference(stream_config, spark, valid_events(
        [pageview("w", start + at(3), "advance"), on_time_p, earlier_q, smaller, earlier_r,
         flush]))
    assert sorted((r["user_id"], r["session_start"], r["order_count"], r["revenue"])
                  for r in rows) == [
        ("u", start + at(4), 1, Decimal("3.00")), ("u", start + at(5), 0, Decimal("0.0000")),
        ("u", start + at(7), 0, Decimal("0.0000")), ("w", start + at(3), 0, Decimal("0.0000"))]
    assert_topic_equals_table(stream_config, rows)


def test_a_late_copy_of_an_order_id_another_user_holds_is_attributed_beside_it(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z12, ``corrections`` C13) A producer reuses order id o for users a and b (their state
    kept apart). a's copy comes on time and is attributed by the stream; b's comes late, on
    the day before, is stored and queued. The recompute folding it in would create o's
    attribution at b while o is attributed at a, which C13 takes for an order a batch moved:
    unless ``orders`` still holds a's copy, it plans a's place too, and then moved the one
    key o from a to b, leaving a's session counting an order nothing attributed to it."""
    start = datetime(2026, 11, 1, 9, tzinfo=UTC)
    users = spark.createDataFrame([("client-00", "a"), ("client-00", "b")],
                                  "client_id string, user_id string")
    assert len({r[0] for r in users.select(user_bucket(16)).collect()}) == 2
    produce(stream_config, [pageview("a", start, "a1"), order("a", start + timedelta(minutes=1),
                                                              "o", event_id="oa")])
    produce(stream_config, [pageview("w", start + timedelta(hours=3), "advance")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    day_before = start - timedelta(days=1)
    produce(stream_config, [pageview("b", day_before, "b1"),
                            order("b", day_before + timedelta(minutes=1), "o", "3.00", "ob")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert sorted(r["user_id"] for r in table_rows(stream_config, spark, "orders")) == ["a", "b"]
    run_recompute(stream_config, spark=spark)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    sessions = {r["session_id"]: (r["user_id"], r["order_count"], r["revenue"])
                for r in table_rows(stream_config, spark, "sessions")}
    assert sorted(v for v in sessions.values() if v[0] != "w") == [
        ("a", 1, Decimal("10.0000")), ("b", 1, Decimal("3.0000"))]
    assert sorted((r["user_id"], sessions[r["session_id"]][0]) for r in table_rows(
        stream_config, spark, "attributions")) == [("a", "a"), ("b", "b")]


def test_an_on_time_retry_within_the_watermark_millisecond_is_still_a_duplicate(
    stream_config: Config, spark: SparkSession
) -> None:
    """(S3) Spark compares event times in microseconds: a pageview 0.5 ms after the watermark
    was on time in the next micro-batch, but the state kept ids by their millisecond and let
    this one go with the watermark: its retry was stored and counted a second time. Times are
    now kept to the millisecond (contract.TS_PRECISION): the retry is at the watermark, late,
    and dropped as a copy of its day's stored row (counted among the duplicates)."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    just_after = start + timedelta(microseconds=500)
    delay = timedelta(milliseconds=stream_config.watermark_delay_ms)
    for records in ([pageview("a", just_after, "p1"), pageview("b", start + delay, "q")],
                    [pageview("a", start + timedelta(minutes=5), "p2")],  # the watermark: start
                    [pageview("a", just_after, "p1")]):  # at the watermark's millisecond
        produce(stream_config, records)
        summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert (summary.totals.duplicates, summary.totals.late_queued) == (1, 0)
    assert sorted(r["event_id"] for r in table_rows(stream_config, spark, "pageviews")) == [
        "p1", "p2", "q"]


def test_the_progress_counts_every_copy_dropped_as_a_duplicate(
    stream_config: Config, spark: SparkSession
) -> None:
    """Copies of an id within one micro-batch, and a late copy of a stored record, were
    dropped without a count: a micro-batch of 3 records showed 1 pageview and 0 duplicates,
    one of 1 record showed 0 of everything."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    retried = pageview("a", start, "p1")
    produce(stream_config, [retried, retried, retried])  # a producer retrying twice
    first = run_sessionizer(stream_config, until_caught_up=True, spark=spark).totals
    assert (first.records, first.pageviews, first.duplicates) == (3, 1, 2)
    produce(stream_config, [pageview("x", start + timedelta(hours=5), "x1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [retried])  # late now, and stored already
    late = run_sessionizer(stream_config, until_caught_up=True, spark=spark).totals
    assert (late.records, late.pageviews, late.late_queued, late.duplicates) == (1, 0, 0, 1)
    assert sorted(r["event_id"] for r in table_rows(stream_config, spark, "pageviews")) == [
        "p1", "x1"]


def test_a_copy_of_a_pageview_with_another_time_in_a_later_micro_batch_is_stored_once(
    stream_config: Config, spark: SparkSession
) -> None:
    """(S6) A producer reusing an id with another ts: the state looked for the id only among
    the ids of the slices holding the copy's own ts, so the copy was sessionized and stored a
    second time (``pageviews`` holds each event_id once), and its session counted both."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("a", start, "p1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [pageview("a", start + timedelta(minutes=5), "p1")])
    again = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert again.totals.duplicates == 1
    closing = timedelta(milliseconds=stream_config.watermark_delay_ms) + timedelta(hours=2)
    produce(stream_config, [pageview("b", start + closing, "q")])  # closes a's session
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert sorted((r["event_id"], r["ts"]) for r in table_rows(
        stream_config, spark, "pageviews")) == [("p1", start), ("q", start + closing)]
    assert [(r["user_id"], r["pageview_count"], r["session_end"]) for r in table_rows(
        stream_config, spark, "sessions")] == [("a", 1, start)]


def test_an_on_time_retry_of_an_unattributed_order_within_the_watermark_millisecond_is_held(
    stream_config: Config, spark: SparkSession
) -> None:
    """(S3) An order no session covers was emitted, and let go, once the watermark reached its
    millisecond; 0.5 ms after the watermark, its retry was still on time: stored and
    attributed a second time. Times are now kept to the millisecond (contract.TS_PRECISION):
    the retry is at the watermark, late, and dropped as a copy of its day's stored row."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    just_after = start + timedelta(microseconds=500)
    delay = timedelta(milliseconds=stream_config.watermark_delay_ms)
    duplicates = []
    for records in ([order("c", just_after, "o1"), pageview("b", start + delay, "q")],
                    [pageview("a", start + timedelta(minutes=5), "p2")],  # the watermark: start
                    [order("c", just_after, "o1")],  # at the watermark's millisecond
                    [pageview("b", start + delay + timedelta(minutes=1), "q2")]):  # it moves on
        produce(stream_config, records)
        duplicates.append(run_sessionizer(stream_config, until_caught_up=True,
                                          spark=spark).totals.duplicates)
    assert duplicates == [0, 0, 1, 0]  # the late copy, dropped, is counted
    assert [r["order_id"] for r in table_rows(stream_config, spark, "orders")] == ["o1"]
    assert [(r["order_id"], r["session_id"])
            for r in table_rows(stream_config, spark, "attributions")] == [("o1", None)]


def test_two_clients_pageviews_with_the_same_event_id_are_each_stored_once(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z3) Tables are per client, and so are ids: the sink kept one row per event_id across
    clients, so one client's pageview was dropped unseen (no quarantine row) while its
    session, which the state built from it, was stored. On time and late alike."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    delay = timedelta(milliseconds=stream_config.watermark_delay_ms)

    def of(client: str, user: str, at: datetime, event_id: str) -> tuple[str, str]:
        key, value = pageview(user, at, event_id)
        return key.replace("client-00", client), value.replace("client-00", client)

    for records in ([of("client-00", "a", start, "1001"), of("client-01", "z", start, "1001"),
                     of("client-00", "b", start + delay + timedelta(hours=2), "x")],
                    [of("client-00", "a", start + timedelta(minutes=1), "2002"),  # late
                     of("client-01", "z", start + timedelta(minutes=1), "2002")]):
        produce(stream_config, records)
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert sorted((r["client_id"], r["event_id"])
                  for r in table_rows(stream_config, spark, "pageviews")) == [
        ("client-00", "1001"), ("client-00", "2002"), ("client-00", "x"),
        ("client-01", "1001"), ("client-01", "2002")]
    assert sorted((r["client_id"], r["record_id"])
                  for r in table_rows(stream_config, spark, "recompute_queue")) == [
        ("client-00", "2002"), ("client-01", "2002")]


def same_bucket_user(spark: SparkSession, client: str, user: str, other_client: str) -> str:
    """A user of ``other_client`` whose state bucket is that of ``client``/``user``."""
    candidates = [(client, user)] + [(other_client, f"user-{n}") for n in range(256)]
    rows = spark.createDataFrame(candidates, ["client_id", "user_id"]).select(
        "user_id", user_bucket(sessionize.STATE_BUCKETS).alias("bucket")).collect()
    return next(r["user_id"] for r in rows[1:] if r["bucket"] == rows[0]["bucket"])


def test_two_clients_of_one_state_bucket_may_send_the_same_ids(
    stream_config: Config, spark: SparkSession
) -> None:
    """(S8) The state held ids across the clients of its bucket: another client's pageview and
    order with ids it held were taken for on-time retries, neither stored nor sessionized,
    and left no quarantine row."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    late_enough = timedelta(milliseconds=stream_config.watermark_delay_ms) + timedelta(hours=2)
    other = same_bucket_user(spark, "client-00", "a", "client-01")

    def of_client_01(record: tuple[str, str]) -> tuple[str, str]:
        key, value = record
        return (key.replace("client-00/a", f"client-01/{other}"),
                value.replace("client-00", "client-01").replace('"a"', f'"{other}"'))

    first = [pageview("a", start, "1001"), order("a", start + timedelta(seconds=1), "o7")]
    second = [of_client_01(pageview("a", start + timedelta(minutes=1), "1001")),
              of_client_01(order("a", start + timedelta(minutes=1, seconds=1), "o7"))]
    duplicates = 0
    for records in (first, second, [pageview("b", start + late_enough)],
                    [pageview("b", start + late_enough + timedelta(minutes=1))]):
        produce(stream_config, records)
        summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
        duplicates += summary.totals.duplicates
    assert duplicates == 0
    for table, key, record_id in (("pageviews", "event_id", "1001"),
                                  ("orders", "order_id", "o7")):
        assert sorted((r["client_id"], r[key]) for r in table_rows(stream_config, spark, table)
                      if r["user_id"] != "b") == [("client-00", record_id),
                                                  ("client-01", record_id)]
    assert sorted((r["client_id"], r["user_id"], r["pageview_count"], r["order_count"])
                  for r in table_rows(stream_config, spark, "sessions")
                  if r["user_id"] != "b") == [("client-00", "a", 1, 1), ("client-01", other, 1, 1)]
    assert table_rows(stream_config, spark, "quarantine") == []


HOLD_THE_SESSIONIZER_LOCKS = """
import sys, time
from contextlib import ExitStack
from pathlib import Path
from clickstream.locks import exclusive_or_refuse
with ExitStack() as held:
    for path in sys.argv[2:]:
        held.enter_context(exclusive_or_refuse(Path(path), RuntimeError, sys.argv[1]))
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_sessionizer_on_the_checkpoint_or_warehouse_is_refused_at_once(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z15) Spark guards a checkpoint within one JVM only: a sessionizer in another process
    (the DAG's, while one runs from the shell) holds it, and this one is refused at once. One
    with another home (another checkpoint) would run beside it into the same tables: refused
    too."""
    checkpoint = stream_config.checkpoint_path("sessionize")
    produce(stream_config, [pageview("u", datetime(2026, 11, 1, tzinfo=UTC), "p1")])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_SESSIONIZER_LOCKS, SESSIONIZER_ROLE,
         str(sessionizer_lock_path(stream_config)),
         str(warehouse_sessionizer_lock_path(stream_config))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ClickstreamError) as refused:
            run_sessionizer(stream_config, until_caught_up=True, spark=spark)
        assert str(refused.value).startswith(
            f"another sessionizer (pid {holder.pid}) is running on the checkpoint {checkpoint} "
            f"(it holds {sessionizer_lock_path(stream_config)}): two would run the same "
            "micro-batches at once. Stop that one first")
        shell = stream_config.replace(home=stream_config.home.parent / "shell-home")
        with pytest.raises(ClickstreamError) as beside:
            run_sessionizer(shell, until_caught_up=True, spark=spark)
        assert str(beside.value).startswith(
            f"another sessionizer (pid {holder.pid}) is running into the warehouse "
            f"{stream_config.warehouse} (it holds "
            f"{warehouse_sessionizer_lock_path(stream_config)}): this one, on the checkpoint "
            f"{shell.checkpoint_path('sessionize')}, would sessionize the same events into the "
            "same tables and topics beside it. Stop that one first")
        assert not checkpoint.exists() and not shell.checkpoint_path("sessionize").exists()
        assert open_tables(stream_config, spark).version("pageviews") == -1
    finally:
        holder.kill()  # SIGKILL: the lock goes with its holder
        holder.wait(timeout=30)

    # `republish` takes the warehouse's lock too: each is told which it met (both used to be
    # told "a sessionizer runs").
    republishing = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_SESSIONIZER_LOCKS, REPUBLISH_ROLE,
         str(warehouse_sessionizer_lock_path(stream_config))], stdout=subprocess.PIPE, text=True)
    try:
        assert republishing.stdout is not None
        assert republishing.stdout.readline().strip() == "held"
        with pytest.raises(ClickstreamError) as refused:
            run_sessionizer(stream_config, until_caught_up=True, spark=spark)
        assert str(refused.value).startswith(
            f"a `clickstream republish` (pid {republishing.pid}) holds "
            f"{warehouse_sessionizer_lock_path(stream_config)}: it publishes the warehouse ")
        with pytest.raises(ClickstreamError) as second:
            run_republish(stream_config, spark=spark)
        assert str(second.value).startswith(
            f"another `clickstream republish` (pid {republishing.pid}) is publishing the "
            f"warehouse {stream_config.warehouse}'s tables")
    finally:
        republishing.kill()
        republishing.wait(timeout=30)

    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert [row["event_id"] for row in table_rows(stream_config, spark, "pageviews")] == ["p1"]


@pytest.mark.parametrize("note", ['{"checkpoint": "/x"', '["/x"]', '{"home": "/x"}'],
                         ids=["cut", "a list", "no checkpoint"])
def test_a_hand_edited_sessionizer_note_stops_corrections_saying_what_to_do(
        config: Config, note: str) -> None:
    """(Z17) A correction run read the warehouse's note of its sessionizer unchecked: an
    edited one failed it with Python's own JSON or key error."""
    sessionize.record_stream_settings(config)
    sessionize.check_stream_settings(config)  # its own sessionizer's note: nothing to refuse
    path = config.warehouse / sessionize.STREAM_SETTINGS_FILE
    path.write_text(note)
    with pytest.raises(ConfigError, match=(
            rf"^{re.escape(str(path))} is not the note a sessionizer writes \(read: .+\); "
            r"each sessionizer start writes it whole, so it was edited by hand\. Start the "
            r"sessionizer once")):
        sessionize.check_stream_settings(config)


def test_an_events_log_the_checkpoint_did_not_read_stops_the_sessionizer_before_spark(
    stream_config: Config, spark: SparkSession, capsys: pytest.CaptureFixture
) -> None:
    """A broker restarted empty (here: another one with the same topics): the source stopped
    the query ~15 s in, after Spark's error log and two tracebacks; now refused first."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    produce(stream_config, [pageview("a", start, "a1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    topics = (stream_config.events_topic, stream_config.sessions_topic,
              stream_config.attributions_topic)
    with EmbeddedBroker(port=0, topics=dict.fromkeys(topics, 4)) as other:
        moved = stream_config.replace(kafka_bootstrap_servers=other.bootstrap_servers)
        capsys.readouterr()
        with pytest.raises(DataLossError, match=f"^topic {stream_config.events_topic} is not "
                                                "the log its stored offsets were read from"):
            run_sessionizer(moved, until_caught_up=True, spark=spark)
        assert "sessionize:" not in capsys.readouterr().out  # no query was started


def test_a_restart_with_another_session_gap_is_refused(
    stream_config: Config, spark: SparkSession
) -> None:
    """(Z10) The state's open sessions were merged with the first start's gap: a restart with
    another one mixed both silently (a1 and a2, 20 minutes apart, became one session under a
    10-minute gap). It is refused, changing nothing, and goes on once the gap is set back."""
    start = datetime(2026, 11, 1, tzinfo=UTC)
    thirty = stream_config.replace(session_gap_minutes=30.0)
    produce(thirty, [pageview("a", start, "a1"),
                     pageview("a", start + timedelta(minutes=20), "a2")])
    run_sessionizer(thirty, until_caught_up=True, spark=spark)
    produce(thirty, [pageview("b", start + timedelta(hours=3), "b1")])  # closes a's session

    ten = stream_config.replace(session_gap_minutes=10.0)
    versions = {name: open_tables(ten, spark).version(name) for name in ("pageviews",)}
    with pytest.raises(ConfigError) as refused:
        run_sessionizer(ten, until_caught_up=True, spark=spark)
    message = str(refused.value)
    assert message.startswith(
        "the session gap is 10 minutes (CLICKSTREAM_SESSION_GAP or --session-gap) but the "
        f"sessionizer's checkpoint {ten.checkpoint_path('sessionize')} was started with 30 "
        "minutes")
    assert "Set the gap back to 30 minutes" in message
    assert "`clickstream recompute --full --client C` for every client" in message
    assert versions == {name: open_tables(ten, spark).version(name) for name in versions}
    assert table_rows(ten, spark, "sessions") == []
    # A batch correction with the other gap would split or merge the stream's sessions.
    for correction in (partial(run_recompute, ten), partial(run_full_recompute, ten,
                                                            client_id="client-00"),
                       partial(run_backfill, ten, kind="pageviews", client_id="client-00",
                               path="any")):
        with pytest.raises(ConfigError, match=r"^the session gap is 10 minutes .* started with "
                           r"30 minutes: sessions computed with another gap"):
            correction(spark=spark)

    run_sessionizer(thirty, until_caught_up=True, spark=spark)
    assert [(r["user_id"], r["pageview_count"])
            for r in table_rows(thirty, spark, "sessions")] == [("a", 2)]


def test_a_new_checkpoint_reading_the_topic_again_stores_and_sessionizes_nothing_twice(
    stream_config: Config, spark: SparkSession, capsys: pytest.CaptureFixture
) -> None:
    """(Z18) The checkpoint is moved away and the sessionizer started again: the new one reads
    the topic from its start, and what the tables hold is history to it. It stored every
    pageview a second time and emitted every session again. Now it stores and emits nothing
    of what it reads again, and queues it (the same deliveries stored it: Z8); once the
    stream has moved on, a recompute folds that in, which emits the sessions the old
    checkpoint held open and changes nothing else."""
    records = live_records(SCALE, Delivery(late_fraction=0.0, duplicate_fraction=0.1,
                                           bad_fraction=0.0, jitter_seconds=120), seed=7)
    produce(stream_config, records)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    kept = {name: table_rows(stream_config, spark, name)
            for name in ("pageviews", "orders", "sessions", "attributions")}
    open_before = reference_sessions(valid_events(records), stream_config.session_gap_ms
                                     )[0].keys() - {
        r["session_id"] for r in kept["sessions"]}
    assert kept["sessions"] and open_before, "the data should close sessions and hold some"
    checkpoint = stream_config.checkpoint_path("sessionize")
    checkpoint.rename(checkpoint.with_name("sessionize-moved-away"))

    capsys.readouterr()
    summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert (summary.totals.pageviews, summary.totals.orders, summary.totals.sessions) == (
        0, 0, 0)
    for name, rows in kept.items():
        assert table_rows(stream_config, spark, name) == rows, name
    assert summary.totals.late_queued == len(kept["pageviews"]) + len(kept["orders"])
    out = capsys.readouterr().out  # a new checkpoint's first watermark is none: not said
    assert "within the history the tables held at start (Z18)) (" in out and "1970" not in out

    last = max(r["ts"] for r in kept["pageviews"])
    moved_on = [pageview("new", last + timedelta(hours=1), "n1"),
                pageview("new", last + timedelta(days=1), "n2")]
    produce(stream_config, moved_on)
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    run_recompute(stream_config, spark=spark)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    rows = assert_sessions_match_reference(stream_config, spark,
                                           valid_events([*records, *moved_on]), revised=True)
    assert open_before <= {r["session_id"] for r in rows}
    assert {r["session_id"]: r for r in rows if r["session_id"] not in open_before} == {
        r["session_id"]: r for r in kept["sessions"]} | {
        r["session_id"]: r for r in rows if r["user_id"] == "new"}
    assert_topic_equals_table(stream_config, rows)


def test_history_is_read_from_the_rows_of_files_the_log_keeps_no_statistics_for(
    config: Config, spark: SparkSession
) -> None:
    """(Z18) The pin takes a client's latest record from the files' statistics; a file
    another engine committed without them is not skipped but read, so its client's history
    is not cut short (a record at or before it would be stored and sessionized again)."""
    day = datetime(2026, 11, 1, tzinfo=UTC)
    tables = open_tables(config, spark)

    def pageviews(*rows: tuple[str, str, datetime]) -> DataFrame:
        return spark.createDataFrame(
            [(event_id, client, "u", at, "/", "", "test", at.date())
             for event_id, client, at in rows], PAGEVIEWS.schema)

    for version, spec, frame in (
            (1, PAGEVIEWS, pageviews(("a1", "c1", day + timedelta(hours=3)),
                                     ("a2", "c1", day + timedelta(hours=5)))),
            (1, ORDERS, spark.createDataFrame(
                [("o1", "c2", "u", day + timedelta(hours=2), Decimal("1"), "EUR", None,
                  "test", day.date())], ORDERS.schema))):
        tables.append_once(spec.name, frame, app_id="test", version=version,
                           partition_by=spec.partition_by, metadata={"run_id": "t", "cause": "t"})
    # c2's pageviews come in a file whose add action has no statistics.
    path = Path(tables.table_path(PAGEVIEWS.name))
    written = next(path.rglob("*.parquet"))
    no_stats = path / "client_id=c2" / "event_date=2026-11-01" / "no-stats.parquet"
    no_stats.parent.mkdir(parents=True)
    pq.write_table(pa.table({"event_id": ["b1", "b2"], "user_id": ["u", "u"],
                             "ts": [day + timedelta(hours=4), day + timedelta(hours=9)],
                             "url": ["/", "/"], "referrer": ["", ""], "source": ["t", "t"]},
                            schema=pq.read_schema(written)), no_stats)
    table = DeltaTable(str(path))
    table.create_write_transaction(
        [AddAction(path="client_id=c2/event_date=2026-11-01/no-stats.parquet",
                   size=no_stats.stat().st_size,
                   partition_values={"client_id": "c2", "event_date": "2026-11-01"},
                   modification_time=int(time.time() * 1000), data_change=True, stats="")],
        mode="append", schema=table.schema(), partition_by=list(PAGEVIEWS.partition_by))

    highs = tables.largest_by_partition(PAGEVIEWS.name, "ts", "client_id")
    assert highs == {"c1": day + timedelta(hours=5), "c2": None}
    gap = config.session_gap_ms
    assert sessionize.stored_history_until(tables, gap) == {
        "c1": ms(day + timedelta(hours=5)) + gap, "c2": ms(day + timedelta(hours=9)) + gap}


def test_a_stop_refuses_the_micro_batches_after_those_planned_before_reading_them(
    stream_config: Config, spark: SparkSession, tmp_path: Path
) -> None:
    """(Z13) The writer refuses a batch after the stop's bound before it reads the batch (a
    None here), so the batch commits nothing and the next start replays it."""
    writer = MicroBatchWriter(stream_config, open_tables(stream_config, spark), tmp_path,
                              SessionizeSummary())
    assert writer.stop_after(2) == 2
    with pytest.raises(StopBeforeMicroBatch, match="micro-batch 3 was not started"):
        writer(None, 3)  # type: ignore[arg-type]
