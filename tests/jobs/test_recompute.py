"""The scheduled recompute beside a running stream, and correction runs of one client that
interrupt each other: queued rows are never lost, and the sessions topic's compacted view
always ends equal to the sessions table (the brief's invariant)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from itertools import count
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from clickstream.cli import main
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import (
    NOT_RETRYABLE,
    ClickstreamError,
    CommitConflictError,
    DeliveryError,
    QualityGateFailedError,
    RevenueOverflowError,
)
from clickstream.io import read_point
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_changelog import publish_sessions
from clickstream.io.kafka_clients import make_consumer
from clickstream.io.kafka_read import read_compacted
from clickstream.io.kafka_topics import topic_watermarks
from clickstream.jobs import backfill_steps, corrections, recompute, sessionize
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.recompute import run_full_recompute, run_recompute
from clickstream.jobs.sessionize import run_sessionizer
from clickstream.quality.reports import read_entries, reports_dir
from clickstream.sessions.semantics import REVENUE_E4_MAX, session_id
from clickstream.tables import CORRECTIONS, ORDERS, PAGEVIEWS, RECOMPUTE_QUEUE, SESSIONS
from tests.jobs.test_backfill import (
    START,
    assert_tables_equal_from_scratch,
    ms,
    order_row,
    pv_row,
    write_rows,
)
from tests.jobs.test_corrections import (
    REUSED_AT,
    _order_id_reused_by_two_users,
    _stored_copies_of_o,
)
from tests.jobs.test_sessionize import order, pageview, produce, table_rows
from tests.reference import reference_changelog_value, valid_events

_steps = count(1)


class Killed(BaseException):
    """Stands in for kill -9 at a chosen point: nothing after it runs."""


def quiet(_: str) -> None:
    pass


def killed_at(monkeypatch: pytest.MonkeyPatch, module: object, name: str,
              run: Callable[[], object]) -> None:
    """Run ``run`` killed when it reaches ``module.name``; the function is back afterwards."""
    original = getattr(module, name)

    def killed(*args: object, **kwargs: object) -> None:
        raise Killed(f"at {name}")

    monkeypatch.setattr(module, name, killed)
    with pytest.raises(Killed):
        run()
    monkeypatch.setattr(module, name, original)


def stored_by_the_stream(config: Config, spark: SparkSession,
                         rows: list[tuple[str, str, str, int]]) -> None:
    """Pageviews (event_id, client, user, minutes after START) as the sessionizer stores them."""
    data = [{"event_id": e, "client_id": c, "user_id": u, "ts": START + timedelta(minutes=m),
             "url": f"/{e}", "referrer": "", "source": "events/0/1",
             "event_date": (START + timedelta(minutes=m)).date()} for e, c, u, m in rows]
    open_tables(config, spark).append_once(
        PAGEVIEWS.name, spark.createDataFrame(data, PAGEVIEWS.schema), app_id="test-stream",
        version=next(_steps), partition_by=PAGEVIEWS.partition_by,
        metadata={"run_id": "test", "cause": "test"})


def queued_by_the_stream(config: Config, spark: SparkSession,
                         rows: list[tuple[str, str, str, int]]) -> None:
    data = [{"client_id": c, "user_id": u, "kind": "pageview", "record_id": e,
             "ts": START + timedelta(minutes=m), "queued_by": "sessionize batch 7",
             "event_date": (START + timedelta(minutes=m)).date()} for e, c, u, m in rows]
    open_tables(config, spark).append_once(
        RECOMPUTE_QUEUE.name, spark.createDataFrame(data, RECOMPUTE_QUEUE.schema),
        app_id="test-stream-queue", version=next(_steps),
        partition_by=RECOMPUTE_QUEUE.partition_by, metadata={"run_id": "test", "cause": "test"})


def late(config: Config, spark: SparkSession, rows: list[tuple[str, str, str, int]]) -> None:
    stored_by_the_stream(config, spark, rows)
    queued_by_the_stream(config, spark, rows)


def users_with_sessions(config: Config, spark: SparkSession) -> set[tuple[str, str]]:
    return {(r["client_id"], r["user_id"]) for r in table_rows(config, spark, "sessions")}


def assert_topic_equals_table(config: Config, spark: SparkSession) -> None:
    """Value for value, as the contract shapes a session's changelog value."""
    table = {r["session_id"]: reference_changelog_value(r)
             for r in table_rows(config, spark, "sessions")}
    assert read_compacted(config, config.sessions_topic) == table


def records_and_offsets_since(config: Config, topic: str, since: dict[int, int]
                              ) -> tuple[int, int]:
    """(records, offsets) ``topic`` gained after ``since`` (partition: high watermark then):
    a transaction's commit marker takes an offset of each partition it wrote, no record."""
    after = {p: high for p, (_, high) in topic_watermarks(config, topic).items()}
    grown = {p: high for p, high in after.items() if high > since.get(p, 0)}
    consumer = make_consumer(config)
    consumer.assign([TopicPartition(topic, p, since.get(p, 0)) for p in grown])
    records, idle = 0, 0
    try:
        while grown and idle < 4:  # the last records are followed by markers only
            message = consumer.poll(0.5)
            idle = idle + 1 if message is None else 0
            records += message is not None and message.error() is None
    finally:
        consumer.close()
    return records, sum(high - since.get(p, 0) for p, high in grown.items())


def test_a_correction_publishes_its_sessions_and_attributions_in_one_kafka_transaction(
        stream_config: Config, spark: SparkSession) -> None:
    """Issue #3: Kafka transactions where the broker honours them. With
    CLICKSTREAM_KAFKA_TRANSACTIONS a correction's records of both topics go in one
    transaction (its commit marker takes an offset of each partition written), and the
    compacted views still equal the tables; a second run initialises the same transactional
    id again. The embedded broker does not hide open transactions from readers: what a
    read_committed reader sees mid-way is not verifiable here."""
    transactional = stream_config.replace(kafka_transactions=True)
    for step, rows in enumerate(([("p1", "c1", "u1", 0), ("p2", "c1", "u2", 5)],
                                 [("p3", "c1", "u1", 90)])):
        since = {topic: {p: high for p, (_, high) in
                         topic_watermarks(transactional, topic).items()}
                 for topic in (transactional.sessions_topic, transactional.attributions_topic)}
        late(stream_config, spark, rows)
        summary = run_recompute(transactional, spark=spark, progress=quiet)
        assert summary.corrections["c1"].sessions_created == len(rows), step
        records, offsets = records_and_offsets_since(
            transactional, transactional.sessions_topic, since[transactional.sessions_topic])
        assert records == len(rows) and offsets > records, (step, records, offsets)
        assert_topic_equals_table(stream_config, spark)
    plain = stream_config  # without: every offset a record
    since = {p: high for p, (_, high) in
             topic_watermarks(plain, plain.sessions_topic).items()}
    late(plain, spark, [("p4", "c1", "u3", 200)])
    run_recompute(plain, spark=spark, progress=quiet)
    assert records_and_offsets_since(plain, plain.sessions_topic, since) == (1, 1)


def test_rows_the_stream_queues_while_a_recompute_runs_stay_queued(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    stored_by_the_stream(stream_config, spark, [("p2", "c1", "u2", 5)])
    correct = recompute.correct

    def correct_while_the_stream_queues(*args, **kwargs):
        summary = correct(*args, **kwargs)
        queued_by_the_stream(stream_config, spark, [("p2", "c1", "u2", 5)])  # same client, day
        return summary

    monkeypatch.setattr(recompute, "correct", correct_while_the_stream_queues)
    run_recompute(stream_config, spark=spark, progress=quiet)
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == ["p2"]
    assert users_with_sessions(stream_config, spark) == {("c1", "u1")}

    monkeypatch.setattr(recompute, "correct", correct)
    run_recompute(stream_config, spark=spark, progress=quiet)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert users_with_sessions(stream_config, spark) == {("c1", "u1"), ("c1", "u2")}
    assert_topic_equals_table(stream_config, spark)


def test_a_run_names_the_tables_it_changed_for_the_dag_to_announce(
        stream_config: Config, spark: SparkSession) -> None:
    """``scheduled_recompute`` announces these as Asset events (it announced all four every
    night, whatever changed)."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    folded = run_recompute(stream_config, spark=spark, progress=quiet)
    assert folded.changed_tables() == ["corrections", "recompute_queue", "sessions"]
    recompute.save_result(stream_config, "night-1", folded)
    assert recompute.changed_tables_saved(stream_config, "night-1") == folded.changed_tables()
    assert run_recompute(stream_config, spark=spark, progress=quiet).changed_tables() == []
    assert recompute.changed_tables_saved(stream_config, "night-2") == []  # never started
    recompute.result_path(stream_config, "night-3").write_text('{"changed_tab')  # cut
    assert recompute.changed_tables_saved(stream_config, "night-3") == list(
        recompute.ANNOUNCED_TABLES)  # announced again rather than not at all
    recompute.save_result(stream_config, "night-3", folded)  # a retry saves over it


def test_a_client_whose_job_fails_with_any_error_does_not_stop_the_other_clients(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R10) An error of one client's Spark job reaches the driver as Spark's type, not the
    product's: only the product's own errors were kept per client, so c2 waited behind c1."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("q1", "c2", "v1", 0)])
    correct = recompute._correct

    def c1_fails(run, *args):
        if run.client_id == "c1":  # as Spark words a Python worker's failure: many lines
            raise ArithmeticError(
                "An exception was thrown from the Python worker. Please see the stack trace "
                "below.\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                "ArithmeticError: Decimal overflow in a c1 executor\n")
        return correct(run, *args)

    monkeypatch.setattr(recompute, "_correct", c1_fails)
    with pytest.raises(ClickstreamError, match=r"failed for 1 of 2 clients.*\(c1: "
                       r"ArithmeticError: Decimal overflow in a c1 executor\); the others") as e:
        run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    assert "\n" not in str(e.value)  # one line for the command's one-line reason
    assert users_with_sessions(stream_config, spark) == {("c2", "v1")}
    assert [r["client_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == ["c1"]
    # What c2 changed is saved for the DAG to announce, though the task fails (and its retry
    # changes only c1's): it was saved only by a run that ended well.
    assert recompute.changed_tables_saved(stream_config, "night") == [
        "corrections", "recompute_queue", "sessions"]


def test_a_client_whose_publish_failed_after_apply_has_its_tables_announced(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R15) c1's plan was applied, then its publish failed: the failed client had no
    summary, so the DAG announced none of the tables it changed."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])

    def delivery_failed(run, changes):
        raise DeliveryError("the broker stopped answering while publishing")

    monkeypatch.setattr(corrections, "publish_changes", delivery_failed)
    with pytest.raises(ClickstreamError, match="failed for 1 of 1 clients"):
        run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    assert users_with_sessions(stream_config, spark) == {("c1", "u1")}  # applied
    assert recompute.changed_tables_saved(stream_config, "night") == [
        "attributions", "corrections", "sessions"]


def test_a_client_that_failed_after_finishing_another_runs_plan_has_its_tables_announced(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R15) A backfill of c1 was killed after recording its plan; the recompute applied and
    published that plan (R4), then c1's own planning failed: no plan was left unpublished to
    tell, so the run announced nothing, although ``sessions`` changed."""
    path = write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1")], "parquet")
    killed_at(monkeypatch, corrections, "apply",  # its plan recorded, nothing applied
              lambda: run_backfill(stream_config, kind="pageviews", client_id="c1",
                                   spark=spark, progress=quiet, path=path))
    assert users_with_sessions(stream_config, spark) == set()
    late(stream_config, spark, [("p1", "c1", "u1", 0)])

    def gate_fails(run, *args, **kwargs):
        raise QualityGateFailedError(f"{run.run_id}: recomputed_sessions failed")

    monkeypatch.setattr(corrections, "gate_recomputed_sessions", gate_fails)
    with pytest.raises(QualityGateFailedError, match="failed for 1 of 1 clients"):
        run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    assert users_with_sessions(stream_config, spark) == {("c1", "u")}  # the backfill's plan
    assert recompute.changed_tables_saved(stream_config, "night") == [
        "attributions", "corrections", "sessions"]


def test_a_failed_recompute_whose_result_cannot_be_saved_fails_with_its_own_reason(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last save ran in a ``finally``: failing as well (a full disk), its ``OSError``
    replaced the recompute's own error, and its exit status: 1, which Airflow retries, for a
    failed gate's 3 (review, session 88). It is a note on that error now."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    save = recompute.save_result

    def gate_fails(run, *args, **kwargs):
        raise QualityGateFailedError(f"{run.run_id}: recomputed_sessions failed")

    def disk_full_at_the_end(*args, working_on=None, **kwargs):
        if working_on is None:
            raise OSError(28, "No space left on device")
        return save(*args, working_on=working_on, **kwargs)

    monkeypatch.setattr(corrections, "gate_recomputed_sessions", gate_fails)
    monkeypatch.setattr(recompute, "save_result", disk_full_at_the_end)
    with pytest.raises(QualityGateFailedError, match="failed for 1 of 1 clients") as raised:
        run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    assert raised.value.__notes__ == [
        "saving the tables it changed (--save-result-as night) failed as well: OSError: "
        "[Errno 28] No space left on device"]


def test_a_client_whose_rows_could_not_be_dequeued_is_not_described_as_folded_in(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R10) c1's corrections were applied, then removing its rows from the queue failed:
    the summary of the clients that succeeded listed c1 too, beside the error saying its
    rows stay queued. What it applied is still announced."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("q1", "c2", "v1", 0)])
    engine = type(open_tables(stream_config, spark))
    delete_rows = engine.delete_rows

    def c1_conflicts(self, name, rows, **kwargs):
        if kwargs["partition_filter"]["client_id"] == "c1":
            raise CommitConflictError("delete_rows on table 'recompute_queue': conflicts")
        return delete_rows(self, name, rows, **kwargs)

    monkeypatch.setattr(engine, "delete_rows", c1_conflicts)
    lines: list[str] = []
    with pytest.raises(ClickstreamError, match=r"failed for 1 of 2 clients, whose rows stay "
                       r"queued \(c1: delete_rows"):
        run_recompute(stream_config, spark=spark, progress=lines.append, result_name="night")
    described = [line for entry in lines for line in entry.splitlines()
                 if re.match(r"recompute c[12]: 1 queued records; ", line)]
    assert [line.split(":")[0] for line in described] == ["recompute c2"], lines
    assert "recompute c1: failed, its rows stay queued: delete_rows" in "\n".join(lines)
    assert recompute.changed_tables_saved(stream_config, "night") == [
        "corrections", "recompute_queue", "sessions"]


def test_an_attempt_killed_while_it_works_on_a_client_has_every_table_announced(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill -9 runs no ``finally``: the result was saved only there, so what the killed
    attempt changed for c1 was never announced (its retry found c1's rows gone from the
    queue). Saved before each client, naming it, the attempt that died on c2 counts as having
    changed every table it may."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("q1", "c2", "v1", 0)])
    correct, save = recompute._correct, recompute.save_result

    def killed_on_c2(run, *args):
        if run.client_id == "c2":
            raise Killed("kill -9 while c2 is recomputed")
        return correct(run, *args)

    def saved_unless_finally(*args, working_on=None, **kwargs):
        if working_on is not None:  # a killed process saves nothing on its way out
            return save(*args, working_on=working_on, **kwargs)

    monkeypatch.setattr(recompute, "_correct", killed_on_c2)
    monkeypatch.setattr(recompute, "save_result", saved_unless_finally)
    with pytest.raises(Killed):
        run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    monkeypatch.undo()
    assert users_with_sessions(stream_config, spark) == {("c1", "u1")}
    assert recompute.changed_tables_saved(stream_config, "night") == list(
        recompute.ANNOUNCED_TABLES)

    retried = run_recompute(stream_config, spark=spark, progress=quiet, result_name="night")
    assert retried.queued == {"c2": 1}  # c1's rows were removed by the killed attempt
    assert recompute.changed_tables_saved(stream_config, "night") == list(
        recompute.ANNOUNCED_TABLES)
    run_recompute(stream_config, spark=spark, progress=quiet, result_name="night-2")
    assert recompute.changed_tables_saved(stream_config, "night-2") == []  # nothing left


def test_a_client_whose_queue_rows_cannot_be_removed_does_not_stop_the_other_clients(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R10) c1's folded-in record is queued again before every commit attempt of its removal
    (a file holding one of its rows is added each time): c1 fails with its rows queued, c2 is
    still folded in, and the next run finishes c1. The removal's failure used to leave the run
    at c1, so c2 waited with it, run after run."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("q1", "c2", "v1", 0)])
    engine = type(open_tables(stream_config, spark))
    delete_rows = engine.delete_rows
    requeued = count(1)

    def p1_queued_again(table: str, attempt: int) -> None:
        next(requeued)
        queued_by_the_stream(stream_config, spark, [("p1", "c1", "u1", 0)])

    def delete_rows_while_p1_is_queued_again(self, name, df, **kwargs):
        if kwargs["partition_filter"]["client_id"] != "c1":
            return delete_rows(self, name, df, **kwargs)
        seam = self._before_commit, self._backoff, self._max_attempts
        self._before_commit, self._backoff, self._max_attempts = p1_queued_again, 0.0, 2
        try:
            return delete_rows(self, name, df, **kwargs)
        finally:
            self._before_commit, self._backoff, self._max_attempts = seam

    monkeypatch.setattr(engine, "delete_rows", delete_rows_while_p1_is_queued_again)
    with pytest.raises(ClickstreamError, match=r"failed for 1 of 2 clients.*\(c1: "
                       r"delete_rows on table 'recompute_queue': concurrent commits changed "
                       r"the rows it rewrites on each of 2 reads") as failed:
        run_recompute(stream_config, spark=spark, progress=quiet)
    assert not isinstance(failed.value, NOT_RETRYABLE)  # the next run may well get through
    queued = [(r["client_id"], r["record_id"]) for r in table_rows(
        stream_config, spark, "recompute_queue")]
    assert queued == [("c1", "p1")] * next(requeued)  # the first and every copy queued since
    assert users_with_sessions(stream_config, spark) == {("c1", "u1"), ("c2", "v1")}

    monkeypatch.setattr(engine, "delete_rows", delete_rows)
    run_recompute(stream_config, spark=spark, progress=quiet)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert users_with_sessions(stream_config, spark) == {("c1", "u1"), ("c2", "v1")}
    assert_topic_equals_table(stream_config, spark)


def test_a_recompute_killed_between_apply_and_publish_is_published_by_the_rerun(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rerun sees another queue version (client cA's rows were removed meanwhile), so it
    # is another run id: it must still publish what the killed run applied.
    late(stream_config, spark, [("a1", "cA", "u", 0), ("b1", "cB", "u", 0)])
    publish = corrections.publish_changes

    def killed_for_cb(run, changes):
        if run.client_id == "cB":
            raise Killed("after apply, before publish")
        return publish(run, changes)

    monkeypatch.setattr(corrections, "publish_changes", killed_for_cb)
    with pytest.raises(Killed):
        run_recompute(stream_config, spark=spark, progress=quiet)
    monkeypatch.setattr(corrections, "publish_changes", publish)
    assert users_with_sessions(stream_config, spark) == {("cA", "u"), ("cB", "u")}

    run_recompute(stream_config, spark=spark, progress=quiet)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)


def test_a_resumed_recompute_keeps_the_report_and_counts_of_the_plan_it_published(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between apply and publish, the rerun (the same queue version, so the same run)
    publishes the plan, then plans again to find the users it leaves to the stream. That
    second pass, which changes nothing, replaced the run's correction report and its counts
    with zeros."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("p2", "c1", "u1", 90)])
    killed_at(monkeypatch, corrections, "publish_changes",
              lambda: run_recompute(stream_config, spark=spark, progress=quiet))

    result = run_recompute(stream_config, spark=spark, progress=quiet).corrections["c1"]
    assert (result.resumed, result.sessions_created) == (True, 2)
    (report,) = [e for e in read_entries(reports_dir(stream_config)) if e.kind == "corrections"]
    assert report.summary.startswith("2 created, 0 updated"), report.summary
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)


def late_orders(config: Config, spark: SparkSession, client: str, user: str,
                orders: list[tuple[str, float]], amount: str = "10.0000") -> None:
    """Orders (id, minutes) as the sessionizer stores and queues them when their session is
    already closed."""
    at = {order_id: START + timedelta(minutes=minutes) for order_id, minutes in orders}
    tables = open_tables(config, spark)
    tables.append_once(ORDERS.name, spark.createDataFrame([{
        "order_id": order_id, "client_id": client, "user_id": user, "ts": ts,
        "amount": Decimal(amount), "currency": "EUR", "event_id": f"ev-{order_id}",
        "source": "events/0/9", "event_date": ts.date()} for order_id, ts in at.items()],
        ORDERS.schema),
        app_id="test-stream-orders", version=next(_steps), partition_by=ORDERS.partition_by,
        metadata={"run_id": "test", "cause": "test"})
    tables.append_once(RECOMPUTE_QUEUE.name, spark.createDataFrame([{
        "client_id": client, "user_id": user, "kind": "order", "record_id": order_id,
        "ts": ts, "queued_by": "sessionize batch 7", "event_date": ts.date()}
        for order_id, ts in at.items()],
        RECOMPUTE_QUEUE.schema), app_id="test-stream-queue", version=next(_steps),
        partition_by=RECOMPUTE_QUEUE.partition_by, metadata={"run_id": "test", "cause": "test"})


def test_a_session_revenue_past_its_largest_fails_the_recompute_as_not_retryable(
        stream_config: Config, spark: SparkSession) -> None:
    """The session semantics refuse it in Spark's Python worker; the client's failure was
    Spark's wrapper, so the run's error was retryable and the scheduled recompute retried a
    failure the same stored orders repeat (review, session 78). It keeps the product's type:
    not retryable (exit 3)."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    count = REVENUE_E4_MAX // (10**16 - 1) + 1  # 923 of the largest amount: past 64 bits
    late_orders(stream_config, spark, "c1", "u1", [(f"o{i}", 1 + i / 1000) for i in range(count)],
                amount="999999999999.9999")
    with pytest.raises(RevenueOverflowError, match=r"^recompute failed for 1 of 1 clients, "
                       r"whose rows stay queued \(c1: session [0-9a-f]+: its attributed orders "
                       r"add up to 922999999999999\.9077, above the largest revenue") as refused:
        run_recompute(stream_config, spark=spark, progress=quiet)
    assert "Traceback" in str(refused.value.__cause__)  # the worker's, for the CLI to keep


@pytest.mark.parametrize("killed", [False, True], ids=["uninterrupted", "resumed"])
def test_a_resumed_recompute_counts_the_orders_of_its_windows_once(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
        killed: bool) -> None:
    """Two late pageviews 90 minutes apart (two sessions) and one order in the first. Killed
    between apply and publish, the rerun finished the plan (its recorded totals: 1 order
    attributed), then planned again over the same queue rows, tallied the same order again,
    and the two passes' tallies were summed: "orders attributed 2" where the run's correction
    report said 1."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("p2", "c1", "u1", 90)])
    late_orders(stream_config, spark, "c1", "u1", [("o1", 5)])
    if killed:
        killed_at(monkeypatch, corrections, "publish_changes",
                  lambda: run_recompute(stream_config, spark=spark, progress=quiet))

    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    result = summary.corrections["c1"]
    assert result.resumed == killed
    assert (result.sessions_created, result.orders_attributed, result.orders_unattributed,
            result.deferred_users) == (2, 1, 0, 0), summary.describe()
    assert "orders attributed 1, unattributed 0" in summary.describe()
    assert table_rows(stream_config, spark, "recompute_queue") == []


def test_a_failure_the_product_did_not_foresee_in_one_client_is_named_with_its_traceback(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A damaged table (a data file of c1's pageviews gone) fails c1's recompute in Spark. The
    error for the failed clients (R10) carried only the failure's first line, without its
    type, and no traceback was kept (the CLI keeps one for an unexpected error only); c2,
    folded in, had no summary line (the CLI prints the summary of a run that succeeded)."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("q1", "c2", "v1", 0)])
    for file in (stream_config.warehouse / "pageviews" / "client_id=c1").rglob("*.parquet"):
        file.unlink()
    for name, variable in ENV_NAMES.items():
        if name not in ("kafka_options", "spark_kafka_options"):
            monkeypatch.setenv(variable, str(getattr(stream_config, name)))

    assert main(["recompute"]) == 1
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("recompute c2: 1 queued "
                                                                 "records; sessions created 1")]
    (line,) = err.strip().splitlines()
    assert line.startswith("clickstream recompute: error: recompute failed for 1 of 2 clients, "
                           "whose rows stay queued (c1: "), line
    unforeseen = line.split("(c1: ", 1)[1].split(":", 1)[0]
    assert unforeseen.isidentifier() and unforeseen[0].isupper(), line  # its type's name
    kept = line.rsplit("; traceback in ", 1)[1]
    assert unforeseen in Path(kept).read_text()
    assert {r["client_id"] for r in table_rows(stream_config, spark, "recompute_queue")} == {"c1"}


def test_a_plan_another_run_finishes_gets_its_correction_report(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between apply and publish, while the stream queues meanwhile: the retry reads
    another queue version, so it is another run, and finishes the plan as the killed run's
    (C6). That run never runs again, so its report (written after publishing) was never
    written: the quality reports showed the retry's "0 created" and nothing of the session
    the plan created."""
    late(stream_config, spark, [("p1", "c1", "u1", 0), ("p2", "c1", "u1", 90)])
    killed_at(monkeypatch, corrections, "publish_changes",
              lambda: run_recompute(stream_config, spark=spark, progress=quiet))
    queued_by_the_stream(stream_config, spark, [("z1", "c9", "z", 0)])  # the queue moves on

    result = run_recompute(stream_config, spark=spark, progress=quiet).corrections["c1"]
    assert (result.resumed, result.finished_sessions) == (False, 2)
    reports = {e.run_id: e.summary for e in read_entries(reports_dir(stream_config))
               if e.kind == "corrections" and e.client_id == "c1"}
    assert len(reports) == 2, reports
    (killed,) = [summary for run_id, summary in reports.items() if run_id.endswith("-q1")]
    assert killed.startswith("2 created, 0 updated"), reports
    assert table_rows(stream_config, spark, "recompute_queue") == [
        row for row in table_rows(stream_config, spark, "recompute_queue") if row["client_id"]
        == "c9"]
    assert_topic_equals_table(stream_config, spark)


def test_a_plan_whose_topics_do_not_answer_is_not_applied_and_the_rerun_publishes_it(
        stream_config: Config, spark: SparkSession) -> None:
    """The tables change only once the topics that mirror them answer: applied first, a
    plan left the tables ahead of the topics until someone reran it."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    missing = stream_config.replace(attributions_topic=f"{stream_config.attributions_topic}-x")
    sessions_version = open_tables(stream_config, spark).version(SESSIONS.name)

    with pytest.raises(ClickstreamError) as refused:
        run_recompute(missing, spark=spark, progress=quiet)
    assert f"topic '{missing.attributions_topic}' does not exist" in str(refused.value)
    assert "fix CLICKSTREAM_ATTRIBUTIONS_TOPIC" in str(refused.value)
    assert open_tables(stream_config, spark).version(SESSIONS.name) == sessions_version
    assert len(table_rows(stream_config, spark, "corrections")) == 1  # the plan, recorded
    assert read_compacted(stream_config, stream_config.sessions_topic) == {}
    # Readers of the read point see neither the plan nor anything it describes (C16).
    assert [g.client_id for g in read_point.open_groups(stream_config)] == ["c1"]
    point = read_point.current(stream_config)
    assert point is not None
    assert read_point.read_consistent(open_tables(stream_config, spark), point, "corrections",
                                      ["c1"]).count() == 0

    run_recompute(stream_config, spark=spark, progress=quiet)
    assert read_point.open_groups(stream_config) == []
    assert users_with_sessions(stream_config, spark) == {("c1", "u1")}
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)


def test_a_plan_interrupted_before_apply_goes_first_when_another_run_of_the_client_starts(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    killed_at(monkeypatch, corrections, "apply",  # after the plan was recorded
              lambda: run_recompute(stream_config, spark=spark, progress=quiet))
    assert users_with_sessions(stream_config, spark) == set()
    assert [g.client_id for g in read_point.open_groups(stream_config)] == ["c1"]

    messages: list[str] = []
    backfill = run_backfill(
        stream_config, kind="pageviews", client_id="c1", spark=spark, progress=messages.append,
        path=write_rows(stream_config, "p", [pv_row("x", "u9", 600, client="c1")], "parquet"))
    assert any("interrupted before publishing them: finishing them first" in m
               for m in messages), messages
    assert read_point.open_groups(stream_config) == []  # it closed the killed run's group
    finished = backfill.corrections  # the tables it changed, for the DAG to announce
    assert (finished.finished_sessions, finished.sessions_created) == (1, 1)
    assert users_with_sessions(stream_config, spark) == {("c1", "u1"), ("c1", "u9")}
    assert_topic_equals_table(stream_config, spark)

    summary = run_recompute(stream_config, spark=spark, progress=quiet)  # the killed run again
    rerun = summary.corrections["c1"]  # its plan, which the backfill finished as that run
    assert (rerun.sessions_created, rerun.published_earlier) == (1, True)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)
    plans = {(r["run_id"], r["run_seq"]) for r in table_rows(stream_config, spark, "corrections")}
    assert len(plans) == 2, plans  # the killed run's plan once, the backfill's once


def test_a_backfill_leaves_sessions_a_crashed_micro_batch_closed_to_its_replay(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # u's session closes in a micro-batch that commits it to the table and dies before the
    # topic and the checkpoint: the restart replays that micro-batch, publishing revision 1.
    produce(stream_config, [pageview("u", START, "e1"),
                            pageview("u", START + timedelta(minutes=5), "e2"),
                            pageview("v", START + timedelta(hours=3), "e3")])
    publish = sessionize.publish_sessions

    def killed(config, rows):  # an Exception: Spark's callback server must survive it
        raise RuntimeError("killed after the sessions commit, before the publish")

    monkeypatch.setattr(sessionize, "publish_sessions", killed)
    with pytest.raises(Exception, match="the sessionizer query failed"):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    monkeypatch.setattr(sessionize, "publish_sessions", publish)
    assert users_with_sessions(stream_config, spark) == {("client-00", "u")}

    # Meanwhile u's pageview at minute 2 arrives in a backfill: u's session is the replay's.
    summary = run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                           progress=quiet,
                           path=write_rows(stream_config, "p", [pv_row("bf", "u", 2)],
                                           "parquet"))
    assert summary.corrections.deferred_users == 1
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == ["bf"]

    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # replays the batch
    assert_topic_equals_table(stream_config, spark)
    run_recompute(stream_config, spark=spark, progress=quiet)  # the backfilled row, folded in
    sessions = table_rows(stream_config, spark, "sessions")
    assert [(r["user_id"], r["pageview_count"], r["revision"]) for r in sessions] == [
        ("u", 3, 2)]
    assert_topic_equals_table(stream_config, spark)


def stream_committed_a_batch_at(config: Config, watermark_minutes: int) -> None:
    """The sessionizer's checkpoint as Spark leaves it after a micro-batch with this watermark."""
    checkpoint = config.checkpoint_path("sessionize")
    for folder in ("offsets", "commits"):
        (checkpoint / folder).mkdir(parents=True, exist_ok=True)
    watermark = ms(START + timedelta(minutes=watermark_minutes))
    (checkpoint / "offsets" / "0").write_text(
        "v1\n" + json.dumps({"batchWatermarkMs": watermark, "batchTimestampMs": 0}) + "\n{}\n")
    (checkpoint / "commits" / "0").write_text("v1\n{}\n")


def test_a_late_pageview_inside_a_session_the_stream_holds_open_stays_queued(
        stream_config: Config, spark: SparkSession) -> None:
    # u's session (pageviews every 20 minutes, 0..120) is open in the stream: it ends within
    # one gap (30 minutes) of the watermark, 135. A pageview at minute 90 came after the
    # watermark had passed it: stored and queued. Its window [90, 90] ends before the open
    # tail (90 + 30 < 135), but it belongs to the open session, not to a session of its own.
    stored_by_the_stream(stream_config, spark,
                         [(f"s{m}", "c1", "u", m) for m in range(0, 121, 20)])
    late(stream_config, spark, [("late", "c1", "u", 90)])
    late(stream_config, spark, [("gone", "c1", "w", 10)])  # w: nothing open, folded in now
    stream_committed_a_batch_at(stream_config, 135)

    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    assert summary.corrections["c1"].deferred_users == 1
    assert users_with_sessions(stream_config, spark) == {("c1", "w")}
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "late"]
    assert_topic_equals_table(stream_config, spark)


def open_for_days(config: Config, spark: SparkSession, user: str, first_day: int,
                  last_day: int) -> int:
    """``user`` viewed a page every 20 minutes from ``first_day`` to ``last_day`` (days after
    START): one session. Returns its last pageview's minute."""
    minutes = range(first_day * 24 * 60, last_day * 24 * 60 + 1, 20)
    stored_by_the_stream(config, spark, [(f"{user}{m}", "c1", user, m) for m in minutes])
    return minutes[-1]


def test_a_session_the_stream_has_held_open_for_days_keeps_its_late_pageviews_queued(
        stream_config: Config, spark: SparkSession) -> None:
    # u's session has run for six days, v's for the last two: both still open in the stream.
    # A late pageview in u's first hour belongs to u's open session, however far before the
    # watermark it lies; v's late pageview, days before v's session began, is a session of
    # its own that the recompute stores now.
    last = open_for_days(stream_config, spark, "u", 0, 6)
    open_for_days(stream_config, spark, "v", 4, 6)
    late(stream_config, spark, [("late", "c1", "u", 50), ("early", "c1", "v", 10)])
    late(stream_config, spark, [("gone", "c1", "w", 10)])  # w: nothing open, folded in now
    stream_committed_a_batch_at(stream_config, last + 15)

    messages: list[str] = []
    summary = run_recompute(stream_config, spark=spark, progress=messages.append)
    assert summary.corrections["c1"].deferred_users == 1
    assert users_with_sessions(stream_config, spark) == {("c1", "v"), ("c1", "w")}
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "late"]
    # Both sessions reach back to the first day read (11-05); v's starts there, u's before.
    assert [m.strip() for m in messages if "open in the stream since" in m] == [
        "sessions open in the stream since before 2026-11-05 (2 users): reading their "
        "pageviews from 2026-11-03 on",
        "sessions open in the stream since before 2026-11-03 (1 users): reading their "
        "pageviews from 2026-10-30 on"]
    assert_topic_equals_table(stream_config, spark)


def test_a_session_open_longer_than_the_stream_is_followed_back_holds_all_its_users_rows(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # Followed back at most one day here (64 by default), u's six-day session is taken as open
    # since ever: even a pageview days before it, a session of its own, waits until it closes.
    monkeypatch.setattr(corrections, "OPEN_SESSION_MAX_DAYS", 1)
    last = open_for_days(stream_config, spark, "u", 2, 6)
    late(stream_config, spark, [("older", "c1", "u", 10)])
    stream_committed_a_batch_at(stream_config, last + 15)

    messages: list[str] = []
    summary = run_recompute(stream_config, spark=spark, progress=messages.append)
    assert summary.corrections["c1"].deferred_users == 1
    assert users_with_sessions(stream_config, spark) == set()
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "older"]
    assert [m.strip() for m in messages if "open in the stream since" in m] == [
        "sessions open in the stream since before 2026-11-05 (1 users): their corrections "
        "wait until they close"]

    monkeypatch.setattr(corrections, "OPEN_SESSION_MAX_DAYS", 64)  # followed to its start
    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    assert summary.corrections["c1"].deferred_users == 0
    assert users_with_sessions(stream_config, spark) == {("c1", "u")}
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)


def sessions_of(config: Config, spark: SparkSession, user: str
                ) -> list[tuple[int, int, int, int, int]]:
    """``user``'s stored sessions as (start, end in minutes after 10:00 of START, pageviews,
    orders, revision)."""
    ten = START + timedelta(hours=10)
    return sorted(((r["session_start"] - ten) // timedelta(minutes=1),
                   (r["session_end"] - ten) // timedelta(minutes=1), r["pageview_count"],
                   r["order_count"], r["revision"])
                  for r in table_rows(config, spark, "sessions") if r["user_id"] == user)


def test_the_real_sessionizers_open_tail_defers_a_user_until_it_lets_the_session_go(
        stream_config: Config, spark: SparkSession) -> None:
    """The deferral tests above build the sessionizer's checkpoint by hand; this one drives
    the real sessionizer. A late pageview (10:24) bridges u's closed session (10:00-10:20) and
    the one the stream has open (10:52, 32 minutes after 10:20, 28 after 10:24): over all
    events they are one session. The window the recompute would correct (10:00-10:25) ends
    more than a gap before the watermark (11:00), so only the open tail defers u: folded in
    then, the stream would later emit 10:52 as a session of its own, and the queue would be
    empty. Once the watermark reaches 10:52 + gap exactly, the stream has let u go and the
    recompute folds u in."""
    def at(minute: int) -> datetime:  # minutes after 10:00
        return START + timedelta(hours=10, minutes=minute)

    def stream(records: list[tuple[str, str]]) -> None:
        sent.extend(records)
        produce(stream_config, records)
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    sent: list[tuple[str, str]] = []
    stream([pageview("u", at(0), "u0"), pageview("u", at(20), "u20"),
            pageview("a", at(45), "a45")])  # the watermark: 10:35
    stream([pageview("u", at(24), "u24"), order("u", at(25), "o25")])  # late: stored, queued
    stream([pageview("u", at(52), "u52"), pageview("b", at(70), "b70")])  # watermark 11:00
    queued = sorted(r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue"))
    assert queued == ["o25", "u24"]
    assert sessions_of(stream_config, spark, "u") == [(0, 20, 2, 0, 1)]  # 10:52: in the state
    sessions = table_rows(stream_config, spark, "sessions")
    attributions = table_rows(stream_config, spark, "attributions")

    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    assert summary.corrections["client-00"].deferred_users == 1
    assert "1 users deferred to the stream" in summary.describe()
    assert summary.changed_tables() == []
    assert table_rows(stream_config, spark, "sessions") == sessions
    assert table_rows(stream_config, spark, "attributions") == attributions
    assert "o25" not in {r["order_id"] for r in attributions}
    assert sorted(r["record_id"] for r in table_rows(
        stream_config, spark, "recompute_queue")) == queued
    assert_topic_equals_table(stream_config, spark)

    stream([pageview("c", at(92), "c92")])  # the watermark: 11:22, 10:52 + gap
    assert sessions_of(stream_config, spark, "u") == [(0, 20, 2, 0, 1), (52, 52, 1, 0, 1)]
    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    assert summary.corrections["client-00"].deferred_users == 0
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert sessions_of(stream_config, spark, "u") == [(0, 52, 4, 1, 2)]
    assert_tables_equal_from_scratch(stream_config, spark, closed_before_ms=ms(at(82)),
                                     inputs=valid_events(sent))


def test_a_full_recompute_retracts_merged_sessions_and_leaves_open_ones_to_the_stream(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    run_backfill(stream_config, kind="pageviews", client_id="c1", spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1"),
                                                      pv_row("b", "u", 40, client="c1"),
                                                      pv_row("w0", "w", 0, client="c1")],
                                 "parquet"))
    assert len(table_rows(stream_config, spark, "sessions")) == 3
    stored_by_the_stream(stream_config, spark, [("between", "c1", "u", 20)])  # merges u's two
    # w has a session open in the stream (its last pageview is within a gap of the
    # watermark): the full recompute must not write it, the stream will; w's stored session
    # stays as it is.
    stored_by_the_stream(stream_config, spark, [("w1", "c1", "w", 100), ("w2", "c1", "w", 110)])
    stream_committed_a_batch_at(stream_config, 120)

    # Killed after the rewrite, before the new rows were published: the rerun no longer finds
    # the retracted session in the table, so its tombstone must have been sent already.
    def killed(*args):
        raise Killed("after the rewrite, before publishing")

    monkeypatch.setattr(recompute, "publish_rows", killed)
    with pytest.raises(Killed):
        run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    monkeypatch.undo()
    summary = run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert summary.users_left_to_the_stream == 1
    sessions = table_rows(stream_config, spark, "sessions")
    assert sorted((r["user_id"], r["pageview_count"]) for r in sessions) == [("u", 3), ("w", 1)]
    assert_topic_equals_table(stream_config, spark)


def test_a_plan_recorded_by_another_run_while_this_one_planned_stops_this_one(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # A run on another machine (outside the lock) records step 1 of c1 while this run plans
    # step 1 from tables that do not hold the other's changes: recording would lay a stale
    # plan over it.
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    gate = corrections.gate_recomputed_sessions

    def the_other_run_records_meanwhile(run, *args):
        gate(run, *args)
        open_tables(stream_config, spark).append_once(
            CORRECTIONS.name, spark.createDataFrame([], CORRECTIONS.schema), app_id=run.app_id,
            version=1, partition_by=CORRECTIONS.partition_by,
            metadata={"run_id": "elsewhere", "cause": "test"})

    monkeypatch.setattr(corrections, "gate_recomputed_sessions", the_other_run_records_meanwhile)
    with pytest.raises(ClickstreamError, match="recorded a plan while this one was planning"):
        run_recompute(stream_config, spark=spark, progress=quiet)
    assert users_with_sessions(stream_config, spark) == set()
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == ["p1"]


@pytest.mark.parametrize("put_back_fails", [False, True], ids=["sent back", "send fails"])
def test_a_full_recompute_refused_by_a_concurrent_commit_sends_back_what_it_retracted(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
        put_back_fails: bool) -> None:
    """Sending them back failing too replaced the refusal with a bare delivery error, which
    said nothing of the topic now lacking rows the table holds (review, session 88)."""
    run_backfill(stream_config, kind="pageviews", client_id="c1", spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1"),
                                                      pv_row("b", "u", 40, client="c1")],
                                 "parquet"))
    stored_by_the_stream(stream_config, spark, [("between", "c1", "u", 20)])  # merges u's two
    send = recompute.publish_pairs

    def tombstones_then_the_stream_commits(config, topic, pairs):
        sent = send(config, topic, pairs)
        if topic == stream_config.sessions_topic:  # the stream closes another user's session
            row = {"session_id": "s-other", "client_id": "c1", "user_id": "x",
                   "session_start": START, "session_end": START, "pageview_count": 1,
                   "landing_url": "/", "exit_url": "/", "order_count": 0, "revenue": Decimal(0),
                   "revision": 1, "session_date": START.date()}
            open_tables(stream_config, spark).append_once(
                SESSIONS.name, spark.createDataFrame([row], SESSIONS.schema),
                app_id="test-stream-sessions", version=next(_steps),
                partition_by=SESSIONS.partition_by, metadata={"run_id": "t", "cause": "t"})
        return sent

    monkeypatch.setattr(recompute, "publish_pairs", tombstones_then_the_stream_commits)
    if put_back_fails:
        def broker_gone(*_args, **_kwargs):
            raise DeliveryError("kafka delivery failed: the broker stopped answering")

        monkeypatch.setattr(recompute, "publish_rows", broker_gone)
    refused = "table 'sessions' changed while it ran"
    if put_back_fails:
        refused += (rf".*; sending back to {stream_config.sessions_topic} the rows its "
                    r"tombstones retracted failed as well \(DeliveryError: kafka delivery "
                    r"failed: .*\): until that run, the topic lacks rows table 'sessions' holds$")
    with pytest.raises(ClickstreamError, match=refused):
        run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)

    def u_sessions() -> tuple[dict, dict]:
        table = {r["session_id"]: r["revision"] for r in
                 table_rows(stream_config, spark, "sessions") if r["user_id"] == "u"}
        topic = {k: v["revision"] for k, v in
                 read_compacted(stream_config, stream_config.sessions_topic).items()
                 if v["user_id"] == "u"}
        return table, topic

    table, topic = u_sessions()
    assert len(table) == 2  # u's two sessions, not rewritten
    if not put_back_fails:
        assert topic == table  # still live
        return
    # u's second session, which "between" merges into the first, was tombstoned: the
    # topic lacks a row the table holds, as the message says.
    assert topic.items() < table.items(), (topic, table)
    monkeypatch.undo()  # the broker answers again: the client's next correction run
    run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    table, topic = u_sessions()
    assert len(table) == 1 and topic == table  # merged by "between", and on the topic


def test_a_client_with_nothing_queued_is_said_so(stream_config: Config,
                                                  spark: SparkSession) -> None:
    """A mistyped --client printed every count as 0 and a dangling '; ' after them."""
    late(stream_config, spark, [("p1", "c1", "u1", 0)])

    summary = run_recompute(stream_config, client_id="c9", spark=spark, progress=quiet)

    assert summary.describe() == "recompute c9: nothing queued for this client"
    assert len(table_rows(stream_config, spark, "recompute_queue")) == 1  # c1's, untouched
    assert corrections.CorrectionSummary().describe().endswith(
        "users deferred to the stream; no step ran")


def test_a_plan_that_fails_its_applied_check_stops_the_client_until_a_full_recompute(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # Killed after apply, before publish; then something outside the product deletes the
    # rows it applied. The next run of c1 must not publish a plan the tables do not hold.
    late(stream_config, spark, [("p1", "c1", "u1", 0)])
    killed_at(monkeypatch, corrections, "publish_changes",  # after apply
              lambda: run_recompute(stream_config, spark=spark, progress=quiet))
    open_tables(stream_config, spark).replace_partitions(
        SESSIONS.name, spark.createDataFrame([], SESSIONS.schema), predicate={"client_id": "c1"},
        app_id="someone", version=1, metadata={"run_id": "t", "cause": "manual delete"})

    backfill = write_rows(stream_config, "p", [pv_row("x", "u9", 600, client="c1")], "parquet")
    for _ in range(2):  # it stays blocked: nothing was published, nothing forgotten
        with pytest.raises(QualityGateFailedError, match=r"every correction run of client c1 "
                           r"stops here; `clickstream recompute --client c1 --full`"):
            run_backfill(stream_config, kind="pageviews", client_id="c1", spark=spark,
                         progress=quiet, path=backfill)
    assert read_compacted(stream_config, stream_config.sessions_topic) == {}

    run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert users_with_sessions(stream_config, spark) == {("c1", "u1"), ("c1", "u9")}
    assert_topic_equals_table(stream_config, spark)
    run_recompute(stream_config, spark=spark, progress=quiet)  # unblocked
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_topic_equals_table(stream_config, spark)


def test_a_full_recompute_superseding_a_plan_publishes_what_it_applied_for_a_held_user(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R7) The superseded plan applied u1's and u2's sessions and was killed before it
    published; u2's row was deleted outside the product, so the plan fails its applied check.
    By the full recompute u1 is back on the stream (held, R2): its stored row is kept, and was
    never sent, so the topic missed u1's session for good (later runs find it unchanged)."""
    config = stream_config
    late(config, spark, [("p1", "c1", "u1", 0), ("p2", "c1", "u2", 0)])
    killed_at(monkeypatch, corrections, "publish_changes",  # after apply
              lambda: run_recompute(config, spark=spark, progress=quiet))
    tables = open_tables(config, spark)
    tables.replace_partitions(
        SESSIONS.name, tables.read(SESSIONS.name, schema=SESSIONS.schema).where(
            F.col("user_id") != "u2"), predicate={"client_id": "c1"},
        partition_by=SESSIONS.partition_by, app_id="someone", version=1,
        metadata={"run_id": "t", "cause": "manual delete"})
    stored_by_the_stream(config, spark, [("back", "c1", "u1", 200)])
    stream_committed_a_batch_at(config, 215)  # u1's session at 200 is open

    summary = run_full_recompute(config, client_id="c1", spark=spark, progress=quiet)

    assert summary.users_left_to_the_stream == 1
    assert sorted(r["user_id"] for r in table_rows(config, spark, "sessions")) == ["u1", "u2"]
    assert_topic_equals_table(config, spark)


def test_a_dag_run_checked_after_another_run_published_and_changed_its_plan_passes(
        stream_config: Config, spark: SparkSession) -> None:
    """(backfill_steps S4) The DAG's tasks apply a plan creating u's sessions at 0 and 50;
    before its validate_corrections task (a race, a retry, a cleared run), the scheduled
    recompute finishes that plan (C6) and folds in a late pageview at 25 that merges both.
    The check failed the correct tables and said every run of the client was blocked."""
    path = write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1"),
                                            pv_row("b", "u", 50, client="c1")], "parquet")
    run_id = backfill_steps.locate_batch(stream_config, kind="pageviews", client_id="c1",
                                         path=path)["run_id"]

    def step(name: str) -> object:
        return backfill_steps.run_step(stream_config, name, kind="pageviews", client_id="c1",
                                       path=path, run_id=run_id, spark=spark, progress=quiet)

    for name in ("check", "merge", "recompute"):
        step(name)
    assert len(table_rows(stream_config, spark, "sessions")) == 2
    late(stream_config, spark, [("between", "c1", "u", 25)])
    run_recompute(stream_config, spark=spark, progress=quiet)
    assert len(table_rows(stream_config, spark, "sessions")) == 1

    assert step("check-applied") == {"sessions": 2, "attributions": 0, "run_seq": 1}
    assert step("publish") == {"published": 2}  # its 2 records, by the recompute already
    assert_topic_equals_table(stream_config, spark)


@pytest.mark.parametrize("step", [backfill_steps.check_applied,
                                  backfill_steps.publish_corrections],
                         ids=["check-applied", "publish"])
def test_the_dag_steps_after_apply_wait_for_another_correction_run_of_the_client(
        stream_config: Config, spark: SparkSession, step: Callable[..., object]) -> None:
    """(C6) The check read the plan, then the tables, without the client's lock: another run
    could publish the plan and apply a later one in between, and the check then failed on
    that run's changes. The other run has another home (an operator's shell beside Airflow):
    the lock is the warehouse's."""
    held, let_go = threading.Event(), threading.Event()
    elsewhere = stream_config.replace(home=stream_config.home.parent / "another-home")

    def another_run() -> None:
        with corrections.one_run_at_a_time(elsewhere, "c1"):
            held.set()
            let_go.wait(timeout=120)

    holder = threading.Thread(target=another_run)
    holder.start()
    said: list[str] = []

    def progress(message: str) -> None:
        said.append(message)
        if "waiting for another correction run of client c1" in message:
            let_go.set()

    try:
        assert held.wait(timeout=60)
        step(stream_config, client_id="c1", run_id="r1", spark=spark, progress=progress)
    finally:
        let_go.set()
        holder.join()
    assert any("waiting for another correction run of client c1" in m for m in said), said


def test_a_full_recompute_leaves_an_order_the_stream_holds_to_the_stream(
        stream_config: Config, spark: SparkSession) -> None:
    """(R2) z's order at 60 has no session: the stream holds it until its watermark passes
    it, then emits it unattributed. z has no stored pageview, so the full recompute wrote the
    order's attribution itself, and the stream appended it again: o1 held twice."""
    produce(stream_config, [pageview("v", START, "v0")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    produce(stream_config, [order("z", START + timedelta(minutes=60), "o1"),
                            pageview("v", START + timedelta(minutes=65), "v1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    watermark = sessionize.stream_watermark_ms(stream_config, "client-00")
    assert watermark is not None and ms(START) < watermark < ms(START + timedelta(minutes=60))
    assert table_rows(stream_config, spark, "attributions") == []  # o1 is in the state

    summary = run_full_recompute(stream_config, client_id="client-00", spark=spark,
                                 progress=quiet)
    assert summary.users_left_to_the_stream == 2  # v (an open session) and z
    produce(stream_config, [pageview("v", START + timedelta(hours=5), "v2")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # emits o1 now
    assert [r["order_id"] for r in table_rows(stream_config, spark, "attributions")] == ["o1"]
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(hours=4)))


def test_a_full_recompute_keeps_each_copy_of_a_reused_order_id_once_run_after_run(
        stream_config: Config, spark: SparkSession) -> None:
    """(Z12, C14) a and b of client-00 each hold a copy of order o. The rewrite paired stored
    and recomputed attributions by order_id alone: two copies on each side met 2x2, the
    table held o four times (then eight at the next --full), and the publish gate failed the
    plan, stopping every later correction of the client. Each copy now pairs with its own."""
    config = stream_config
    _order_id_reused_by_two_users(config, spark)
    for _ in range(2):  # a second --full changes nothing either
        run_full_recompute(config, client_id="client-00", spark=spark, progress=quiet)
        assert [(r["user_id"], r["revision"]) for r in _stored_copies_of_o(config, spark)] == [
            ("a", 1), ("b", 1)]


def assert_copies_of_o_agree(config: Config, spark: SparkSession,
                             expected: list[tuple[str, int]]) -> None:
    """o's copies (user, revision) as ``expected``; no (key, revision) recorded twice with
    different values; the attributions topic equals the table, o being one of its copies
    (the topic keeps one record per key, C14)."""
    copies = _stored_copies_of_o(config, spark)
    assert [(r["user_id"], r["revision"]) for r in copies] == expected
    values: dict[tuple[str, str, int], set[str]] = {}
    for r in table_rows(config, spark, "corrections"):
        if r["new_revision"] is not None:
            values.setdefault((r["entity"], r["key"], r["new_revision"]), set()).add(
                r["new_value"])
    assert {k: v for k, v in values.items() if len(v) > 1} == {}
    topic = read_compacted(config, config.attributions_topic)
    assert topic.pop("o") in [reference_changelog_value(r) for r in copies]
    assert topic == {r["order_id"]: reference_changelog_value(r)
                     for r in table_rows(config, spark, "attributions") if r["order_id"] != "o"}


def test_a_full_recompute_keeps_the_copy_of_a_reused_order_id_a_held_user_holds(
        stream_config: Config, spark: SparkSession) -> None:
    """(R14; Z12, C14, R2, R9) a and b each hold a copy of order o; a is back in the stream
    (held, R2), b is rewritten. The rewrite took a's stored copy for an order moved away from
    a (R9: the rewrite writes o, b's copy): the table lost a's copy though a still holds o,
    the plan retracted it with no tombstone (o's other copy stays), and the publish gate
    failed the plan, stopping every later correction of the client. a's copy is kept; the
    recompute that folds a in once the stream lets it go revises it as any other."""
    config = stream_config
    _order_id_reused_by_two_users(config, spark)
    produce(config, [pageview("a", START + timedelta(hours=10, minutes=1), "a3")])
    run_sessionizer(config, until_caught_up=True, spark=spark)  # a's new session: open
    for _ in range(2):  # a second --full changes nothing either
        summary = run_full_recompute(config, client_id="client-00", spark=spark,
                                     progress=quiet)
        assert summary.users_left_to_the_stream == 2  # a and flush
        assert_copies_of_o_agree(config, spark, [("a", 1), ("b", 1)])
    assert [r["key"] for r in table_rows(config, spark, "corrections")
            if r["entity"] == "attribution"] == []

    produce(config, [pageview("flush", START + timedelta(hours=20), "flush2")])
    run_sessionizer(config, until_caught_up=True, spark=spark)  # a's session closed
    late(config, spark, [("a0", "client-00", "a", REUSED_AT - 5)])  # a's session: new id
    run_recompute(config, spark=spark, progress=quiet)
    assert table_rows(config, spark, "recompute_queue") == []
    assert_copies_of_o_agree(config, spark, [("a", 2), ("b", 1)])
    sessions = {r["session_id"]: r for r in table_rows(config, spark, "sessions")}
    for copy in _stored_copies_of_o(config, spark):  # each copy in its user's session
        assert (sessions[copy["session_id"]]["user_id"],
                sessions[copy["session_id"]]["order_count"]) == (copy["user_id"], 1)


def test_a_full_recompute_after_the_streams_first_micro_batch_leaves_every_user_to_it(
        stream_config: Config, spark: SparkSession) -> None:
    """(R2) After its first micro-batch the checkpoint's watermark is 0: every session is
    open in the stream. The full recompute looked for open sessions among the stored
    pageviews of the days around 1970-01-01, found none, and wrote w's session itself; the
    stream emits it again when it closes."""
    stored_by_the_stream(stream_config, spark, [("w1", "c1", "w", 100), ("w2", "c1", "w", 110)])
    stream_committed_a_batch_at(stream_config, 0)
    offsets = stream_config.checkpoint_path("sessionize") / "offsets" / "0"
    offsets.write_text("v1\n" + json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 0})
                       + "\n{}\n")
    summary = run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert summary.users_left_to_the_stream == 1
    assert table_rows(stream_config, spark, "sessions") == []


def test_a_full_recompute_records_its_changes_in_corrections(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R3) The brief: ``corrections`` holds each run's created / updated / retracted rows
    with old and new revision and cause. The full recompute merged u's two sessions (one to
    revision 2, one retracted with a tombstone) and recorded nothing. (R11) It passes the
    gates every correction passes; it ran none, so a semantics bug reached every session."""
    run_backfill(stream_config, kind="pageviews", client_id="c1", spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1"),
                                                      pv_row("b", "u", 40, client="c1")],
                                 "parquet"))
    before = {r["run_seq"] for r in table_rows(stream_config, spark, "corrections")}
    stored_by_the_stream(stream_config, spark, [("between", "c1", "u", 20)])  # merges u's two
    real_rows = recompute._session_rows
    monkeypatch.setattr(recompute, "_session_rows", lambda emitted: real_rows(emitted).withColumn(
        "revenue", (F.col("revenue") + 1).cast(SESSIONS.schema["revenue"].dataType)))
    versions = {n: open_tables(stream_config, spark).version(n) for n in ("sessions",
                                                                           "corrections")}
    with pytest.raises(QualityGateFailedError, match=r"quality gate recomputed_sessions failed "
                       r"for full-recompute c1: .*revenue_mismatch = 1, .*no correction was "
                       r"recorded"):
        run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert versions == {n: open_tables(stream_config, spark).version(n) for n in versions}
    monkeypatch.setattr(recompute, "_session_rows", real_rows)
    run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert {(e.title.split(" ")[0], e.status) for e in read_entries(reports_dir(stream_config))
            if e.kind == "validation" and e.job == "full-recompute"} >= {
        ("recomputed_sessions", "passed"), ("publish", "passed")}

    (session,) = table_rows(stream_config, spark, "sessions")
    assert (session["pageview_count"], session["revision"]) == (3, 2)
    recorded = [r for r in table_rows(stream_config, spark, "corrections")
                if r["run_seq"] not in before and r["entity"] == "session"]
    assert sorted((r["change"], r["old_revision"], r["new_revision"]) for r in recorded) == [
        ("retracted", 1, None), ("updated", 1, 2)]
    assert {r["cause"] for r in recorded} == {"full recompute of c1"}
    assert next(r for r in recorded if r["change"] == "updated")["key"] == session["session_id"]
    # Recorded as a plan of the client and marked published: the next run has nothing to finish.
    run = corrections.Run(spark, stream_config, open_tables(stream_config, spark), "c1", "t",
                          "t", quiet)
    assert corrections.unfinished_plan(run) is None
    assert_topic_equals_table(stream_config, spark)


def test_the_schedule_finishes_a_killed_backfills_plan_with_nothing_queued(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R4) A backfill killed between apply and publish leaves the topic behind the tables.
    The scheduled recompute visited only clients with queued rows, so until the client's
    next correction run the topic stayed behind, however many schedules ran."""
    path = write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1")], "parquet")
    killed_at(monkeypatch, corrections, "publish_changes",  # after apply
              lambda: run_backfill(stream_config, kind="pageviews", client_id="c1",
                                   spark=spark, progress=quiet, path=path))
    assert users_with_sessions(stream_config, spark) == {("c1", "u")}
    assert read_compacted(stream_config, stream_config.sessions_topic) == {}
    assert not open_tables(stream_config, spark).exists(RECOMPUTE_QUEUE.name)

    summary = run_recompute(stream_config, spark=spark, progress=quiet)
    assert summary.queued == {"c1": 0}
    assert_topic_equals_table(stream_config, spark)
    assert run_recompute(stream_config, spark=spark, progress=quiet).queued == {}


def u_merged_by_the_stream(stream_config: Config, spark: SparkSession) -> None:
    """u's two sessions of c1 backfilled, then a pageview between them stored by the stream,
    whose watermark is at 120 minutes: a full recompute merges u's sessions into one."""
    run_backfill(stream_config, kind="pageviews", client_id="c1", spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0, client="c1"),
                                                      pv_row("b", "u", 40, client="c1")],
                                 "parquet"))
    stored_by_the_stream(stream_config, spark, [("between", "c1", "u", 20)])
    stream_committed_a_batch_at(stream_config, 120)


def full_recompute_killed_after_its_tombstones(config: Config, spark: SparkSession,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``recompute --full`` of c1, killed once it sent its tombstones, before the rewrite."""
    send = recompute.publish_pairs

    def killed_after_the_tombstones(config, topic, pairs):
        sent = send(config, topic, pairs)
        raise Killed(f"after {sent} tombstones, before the rewrite")

    with monkeypatch.context() as killed:
        killed.setattr(recompute, "publish_pairs", killed_after_the_tombstones)
        with pytest.raises(Killed):
            run_full_recompute(config, client_id="c1", spark=spark, progress=quiet)


def test_a_full_recompute_killed_after_its_tombstones_is_finished_by_its_rerun(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R5) Killed after the tombstones of u's merged-away session, before the rewrite:
    the table still holds it, the topic has its tombstone, and the recorded plan is what
    retracts it. u then comes back (a new pageview, open in the stream), so the rerun leaves
    u's stored rows as they are. It took the killed plan for its own and did not finish it,
    then marked its own plan published (which hid the killed one for good): the retracted
    session stayed in the table with a tombstone on the topic."""
    u_merged_by_the_stream(stream_config, spark)
    full_recompute_killed_after_its_tombstones(stream_config, spark, monkeypatch)
    assert len(read_compacted(stream_config, stream_config.sessions_topic)) == 1

    stored_by_the_stream(stream_config, spark, [("back", "c1", "u", 200)])
    stream_committed_a_batch_at(stream_config, 215)  # u's session at 200 is open
    summary = run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert summary.users_left_to_the_stream == 1
    sessions = table_rows(stream_config, spark, "sessions")
    assert sorted((r["pageview_count"], r["revision"]) for r in sessions) == [(3, 2)]
    assert_topic_equals_table(stream_config, spark)


def test_a_full_recompute_plan_another_run_finishes_gets_no_correction_report(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--full`` writes no correction report (README), and all its runs of a client share
    one run id: finished by another run, a first plan's page was kept for every later one."""
    u_merged_by_the_stream(stream_config, spark)
    full_recompute_killed_after_its_tombstones(stream_config, spark, monkeypatch)
    result = run_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert result.corrections["c1"].finished_sessions > 0
    corrections_reports = [e.job for e in read_entries(reports_dir(stream_config))
                           if e.kind == "corrections"]
    assert corrections_reports and "full-recompute" not in corrections_reports
    assert_topic_equals_table(stream_config, spark)


def test_a_full_recompute_never_retracts_a_session_the_stream_closed_while_it_read(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """(R6) x's pageview at 125 arrives on time and the stream closes x's session while the
    full recompute reads: after it read the client's pageviews (without x's), before it read
    the sessions (with x's). x had no stored row later than watermark - gap, so x was not
    left to the stream, and its session, missing from the rewrite, was retracted: a tombstone
    and gone from the table, with x's pageview stored and never queued (it was on time)."""
    u_merged_by_the_stream(stream_config, spark)
    x_start = START + timedelta(minutes=125)
    x_session = {"session_id": session_id("c1", "x", ms(x_start)), "client_id": "c1",
                 "user_id": "x", "session_start": x_start, "session_end": x_start,
                 "pageview_count": 1, "landing_url": "/x1", "exit_url": "/x1", "order_count": 0,
                 "revenue": Decimal(0), "revision": 1, "session_date": x_start.date()}
    holds = recompute._users_the_stream_holds
    closed = []

    def the_stream_closes_a_session_meanwhile(*args):
        users = holds(*args)
        if not closed:  # one micro-batch: x's pageview, then its session (table, topic)
            closed.append(x_session["session_id"])
            stored_by_the_stream(stream_config, spark, [("x1", "c1", "x", 125)])
            rows = spark.createDataFrame([x_session], SESSIONS.schema)
            open_tables(stream_config, spark).append_once(
                SESSIONS.name, rows, app_id="test-stream-sessions", version=next(_steps),
                partition_by=SESSIONS.partition_by, metadata={"run_id": "t", "cause": "t"})
            publish_sessions(stream_config, rows)
            stream_committed_a_batch_at(stream_config, 160)
        return users

    monkeypatch.setattr(recompute, "_users_the_stream_holds",
                        the_stream_closes_a_session_meanwhile)
    try:
        run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    except ClickstreamError as refused:  # a commit it conflicts with: rerun (R3)
        assert "changed while it ran" in str(refused)
        run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    sessions = table_rows(stream_config, spark, "sessions")
    assert sorted((r["user_id"], r["pageview_count"]) for r in sessions) == [("u", 3), ("x", 1)]
    assert_topic_equals_table(stream_config, spark)


def test_a_full_recompute_keeps_an_order_moved_to_a_held_user_for_the_recompute_to_update(
        stream_config: Config, spark: SparkSession) -> None:
    """(R8) o1 moved (C7) from w to v, whose session is open in the stream: the full
    recompute leaves v's rows to the stream (R2) and keeps w's attribution of o1, as a
    targeted correction does (C8). It retracted it, and the recompute that folded o1 in once
    the stream let v go created it again at revision 1: (o1, revision 1) twice on the topic
    and in ``corrections``, with different values."""
    stored_by_the_stream(stream_config, spark, [("v1", "c1", "v", 100), ("v2", "c1", "v", 110)])
    stream_committed_a_batch_at(stream_config, 120)  # v's session is open
    for name, user, minutes in (("o1", "w", 1), ("o2", "v", 105)):
        run_backfill(stream_config, kind="orders", client_id="c1", spark=spark, progress=quiet,
                     path=write_rows(stream_config, name,
                                     [order_row("o1", user, minutes, client="c1")], "parquet"))
    stored = table_rows(stream_config, spark, "attributions")
    assert [(r["user_id"], r["revision"]) for r in stored] == [("w", 1)]
    published = read_compacted(stream_config, stream_config.attributions_topic)

    run_full_recompute(stream_config, client_id="c1", spark=spark, progress=quiet)
    assert table_rows(stream_config, spark, "attributions") == stored
    assert read_compacted(stream_config, stream_config.attributions_topic) == published
    assert [r["key"] for r in table_rows(stream_config, spark, "corrections")
            if r["cause"] == "full recompute of c1" and r["entity"] == "attribution"] == []

    stream_committed_a_batch_at(stream_config, 300)  # v's session closed: o1 is v's now
    run_recompute(stream_config, spark=spark, progress=quiet)
    assert [(r["user_id"], r["revision"]) for r in
            table_rows(stream_config, spark, "attributions")] == [("v", 2)]
    assert_attributions_topic_equals_table(stream_config, spark)
    revisions = sorted(r["new_revision"] for r in table_rows(stream_config, spark, "corrections")
                       if r["key"] == "o1")
    assert revisions == [1, 2]


def assert_attributions_topic_equals_table(config: Config, spark: SparkSession) -> None:
    table = {r["order_id"]: reference_changelog_value(r)
             for r in table_rows(config, spark, "attributions")}
    assert read_compacted(config, config.attributions_topic) == table


DAY = 24 * 60


def backfill_c0(config: Config, spark: SparkSession, kind: str, name: str,
                rows: list[dict], via: str = "one process") -> None:
    """Backfill ``rows`` of client-00 in one ``run_backfill``, or as the DAG does: each step
    (``backfill_steps.STEPS``) a call of its own, the recompute step after the merge committed."""
    path = write_rows(config, name, rows, "parquet")
    if via == "one process":
        run_backfill(config, kind=kind, client_id="client-00", spark=spark, progress=quiet,
                     path=path)
        return
    run_id = backfill_steps.locate_batch(config, kind=kind, client_id="client-00",
                                         path=path)["run_id"]
    for step in backfill_steps.STEPS:
        backfill_steps.run_step(config, step, kind=kind, client_id="client-00", path=path,
                                run_id=run_id, spark=spark, progress=quiet)


def test_an_order_moved_to_another_day_while_its_user_is_deferred_is_held_once(
        stream_config: Config, spark: SparkSession) -> None:
    """(C8) o1 is u's, attributed on day 0. A batch moves it into u's session of day 1,
    which the stream holds open: u is deferred and the moved row queued. The recompute that
    folded it in later planned from the queued row alone, the order's new place: its stored
    attribution on day 0 was outside the windows, so apply wrote o1 on day 1 and left it on
    day 0 too (the table held it twice, the topic once), and u's day-0 session kept it in its
    totals."""
    backfill_c0(stream_config, spark, "pageviews", "p", [pv_row("a", "u", 0)])
    backfill_c0(stream_config, spark, "orders", "o1", [order_row("o1", "u", 1)])
    produce(stream_config, [pageview("u", START + timedelta(days=1), "u1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # u's day 1: open

    backfill_c0(stream_config, spark, "orders", "o2", [order_row("o1", "u", DAY + 5)])
    assert [r["record_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "o1"]
    produce(stream_config, [pageview("y", START + timedelta(days=1, hours=5), "y1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # u's day 1 closed
    run_recompute(stream_config, spark=spark, progress=quiet)

    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert [r["order_date"] for r in table_rows(stream_config, spark, "attributions")] == [
        (START + timedelta(days=1)).date()]
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(days=1, hours=4)))


@pytest.mark.parametrize("via", ["one process", "airflow steps"])
def test_a_batch_moving_an_order_an_interrupted_plan_moved_reads_its_scope_after_finishing_it(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
        via: str) -> None:
    """(C6, C7) A first batch moves o1 from u to v and is killed after recording its plan. A
    second batch moves o1 to w: its run finishes the first plan (o1 attributed to v), then
    plans. Its scope, read before that, found o1 attributed to u, so v was not planned and
    v's session kept o1 in its order count and revenue."""
    backfill_c0(stream_config, spark, "pageviews", "p",
                [pv_row(f"p-{user}", user, 0) for user in ("u", "v", "w")])
    backfill_c0(stream_config, spark, "orders", "first", [order_row("o1", "u", 1)])
    killed_at(monkeypatch, corrections, "apply", lambda: backfill_c0(
        stream_config, spark, "orders", "to-v", [order_row("o1", "v", 1)]))
    assert [r["user_id"] for r in table_rows(stream_config, spark, "attributions")] == ["u"]

    backfill_c0(stream_config, spark, "orders", "to-w", [order_row("o1", "w", 1)], via)
    assert [(r["order_id"], r["user_id"]) for r in table_rows(
        stream_config, spark, "attributions")] == [("o1", "w")]
    assert {r["user_id"]: r["order_count"] for r in table_rows(
        stream_config, spark, "sessions")} == {"u": 0, "v": 0, "w": 1}
    assert_tables_equal_from_scratch(stream_config, spark)


def test_a_full_recompute_rewrites_an_order_a_held_user_lost_to_one_it_rewrites(
        stream_config: Config, spark: SparkSession) -> None:
    """(R9) o1 moved (C7) from w to v while the stream held v: v's row was queued and w's
    attribution stayed (a correction never retracts one). By the full recompute, v's session
    is closed and w is back in the stream. It kept the stored rows of w as they were, by
    user, and wrote o1 for v: the table held o1 twice, the topic once."""
    backfill_c0(stream_config, spark, "pageviews", "p", [pv_row("a", "w", 0)])
    backfill_c0(stream_config, spark, "orders", "o1", [order_row("o1", "w", 1)])
    produce(stream_config, [pageview("v", START + timedelta(days=1), "v1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # v's day 1: open
    backfill_c0(stream_config, spark, "orders", "o2", [order_row("o1", "v", DAY + 5)])
    assert [r["user_id"] for r in table_rows(stream_config, spark, "attributions")] == ["w"]
    assert [r["user_id"] for r in table_rows(stream_config, spark, "recompute_queue")] == [
        "v"]
    produce(stream_config, [pageview("w", START + timedelta(days=1, hours=5), "w1")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # v closed, w open

    summary = run_full_recompute(stream_config, client_id="client-00", spark=spark,
                                 progress=quiet)
    assert summary.users_left_to_the_stream == 1  # w
    assert [r["user_id"] for r in table_rows(stream_config, spark, "attributions")] == ["v"]
    assert_attributions_topic_equals_table(stream_config, spark)
    recorded = [(r["key"], r["change"], r["old_revision"], r["new_revision"]) for r in
                table_rows(stream_config, spark, "corrections")
                if r["cause"] == "full recompute of client-00" and r["entity"] == "attribution"]
    assert recorded == [("o1", "updated", 1, 2)]

    run_recompute(stream_config, spark=spark, progress=quiet)  # folds v's queued o1 in
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(days=1, hours=4)))


# Moved orders (C7), systematically: (old user, old minute, new user, new minute) of each
# order. The stream's watermark is at day 1 + 35 minutes when the orders move, so a place on
# day 1 (minute DAY + 20, in the user's session [DAY, DAY + 10]) is held by the stream (C4:
# its window ends within one gap of the watermark) and minute 1 of day 0 (in the user's
# session [0, 0]) is not. Every user has both sessions; each case has its own users, so one
# run covers them all.
MOVED_ORDERS = {
    "another user, both held": ("o", DAY + 20, "n", DAY + 20),
    "another user and day, old held": ("o", DAY + 20, "n", 1),
    "another user and day, new held": ("o", 1, "n", DAY + 20),
    "another day, old held": ("o", DAY + 20, "o", 1),
}
CLOCK = pageview("z", START + timedelta(minutes=DAY + 45), "z1")  # watermark DAY + 35


def users_with_two_sessions(users: set[str]) -> list[dict]:
    """Pageviews of sessions [0, 0] and [DAY, DAY + 10] for each user."""
    return [pv_row(f"{u}-{m}", u, m) for u in sorted(users) for m in (0, DAY, DAY + 10)]


def the_stream_lets_go_of_day_1(config: Config, spark: SparkSession) -> None:
    """A scheduled recompute while day 1 is held, then the stream moves on and the next
    scheduled recompute folds in what was queued."""
    run_recompute(config, spark=spark, progress=quiet)
    produce(config, [pageview("z", START + timedelta(days=1, hours=6), "z2")])
    run_sessionizer(config, until_caught_up=True, spark=spark)  # nothing held now
    run_recompute(config, spark=spark, progress=quiet)


def test_moved_orders_are_held_once_where_they_now_are_once_the_stream_lets_go(
        stream_config: Config, spark: SparkSession) -> None:
    """Orders stored by a backfill, then moved by a later backfill to another user and/or day
    while the stream holds the old place, the new one, or both (MOVED_ORDERS): each order is
    held once, where it now is, and sessions and attributions equal a from-scratch
    recomputation, on the topics too."""
    moves = {f"order-{i}": (f"{old}-{i}", old_at, f"{new}-{i}", new_at)
             for i, (old, old_at, new, new_at) in enumerate(MOVED_ORDERS.values())}
    users = {user for old, _, new, _ in moves.values() for user in (old, new)}
    backfill_c0(stream_config, spark, "pageviews", "p", users_with_two_sessions(users))
    backfill_c0(stream_config, spark, "orders", "first", [
        order_row(order_id, old, old_at) for order_id, (old, old_at, _, _) in moves.items()])
    produce(stream_config, [CLOCK])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    backfill_c0(stream_config, spark, "orders", "moved", [
        order_row(order_id, new, new_at) for order_id, (_, _, new, new_at) in moves.items()])
    the_stream_lets_go_of_day_1(stream_config, spark)

    assert table_rows(stream_config, spark, "recompute_queue") == []
    where = {order_id: (new, START + timedelta(minutes=new_at))
             for order_id, (_, _, new, new_at) in moves.items()}
    assert sorted((r["order_id"], r["user_id"]) for r in table_rows(
        stream_config, spark, "orders")) == sorted((k, user) for k, (user, _) in where.items())
    assert sorted((r["order_id"], r["user_id"], r["order_ts"]) for r in table_rows(
        stream_config, spark, "attributions")) == sorted((k, *v) for k, v in where.items())
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(days=1, hours=5)))


def test_a_batch_planning_where_a_queued_moved_order_now_is_moves_it_from_where_it_was(
        stream_config: Config, spark: SparkSession) -> None:
    """(C11) o1 moves from a (day 0) to b's day 1 while the stream holds b: queued there, still
    attributed to a. The stream lets go of b, and before the recompute folds o1 in, a batch
    with a pageview of b plans b's day 1. It found o1 stored there and no attribution of it in
    its windows: it attributed o1 to b at revision 1 beside a's row (held twice, the topic's
    revision going down), and the recompute met both rows."""
    backfill_c0(stream_config, spark, "pageviews", "p", users_with_two_sessions({"a", "b"}))
    backfill_c0(stream_config, spark, "orders", "first", [order_row("o1", "a", 1)])
    produce(stream_config, [CLOCK])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    backfill_c0(stream_config, spark, "orders", "moved", [order_row("o1", "b", DAY + 20)])
    produce(stream_config, [pageview("z", START + timedelta(days=1, hours=6), "z2")])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)  # b's day 1 closed
    assert [(r["record_id"], r["user_id"]) for r in table_rows(
        stream_config, spark, "recompute_queue")] == [("o1", "b")]

    backfill_c0(stream_config, spark, "pageviews", "b-more", [pv_row("b-x", "b", DAY + 15)])
    assert [(r["user_id"], r["revision"]) for r in table_rows(
        stream_config, spark, "attributions")] == [("b", 2)]
    assert_attributions_topic_equals_table(stream_config, spark)

    run_recompute(stream_config, spark=spark, progress=quiet)
    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert [(r["user_id"], r["revision"]) for r in table_rows(
        stream_config, spark, "attributions")] == [("b", 2)]
    assert_attributions_topic_equals_table(stream_config, spark)
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(days=1, hours=5)))


@pytest.mark.parametrize("moved_to, via", [
    ("n", "one process"), ("o", "one process"), ("n", "airflow steps")],
    ids=["to-another-user", "to-its-users-day-0", "to-another-user-by-the-dag-steps"])
def test_an_order_the_stream_holds_then_a_batch_moves_is_held_once_where_it_now_is(
        stream_config: Config, spark: SparkSession, moved_to: str, via: str) -> None:
    """o1 arrives on time in o's open session [DAY, DAY + 10]; a batch moves it to day 0 (of
    n, or of o) before the stream emits it (corrections C10). By the DAG's steps, the
    recompute finds the order's old place in ``orders`` as of before the merge step's commit."""
    backfill_c0(stream_config, spark, "pageviews", "p",
                [pv_row(f"{u}-0", u, 0) for u in ("n", "o")])
    produce(stream_config, [pageview(u, START + timedelta(minutes=m), f"{u}-{m}")
                            for u in ("n", "o") for m in (DAY, DAY + 10)]
            + [order("o", START + timedelta(minutes=DAY + 20), "o1"), CLOCK])
    run_sessionizer(stream_config, until_caught_up=True, spark=spark)

    backfill_c0(stream_config, spark, "orders", "moved", [order_row("o1", moved_to, 1)], via)
    the_stream_lets_go_of_day_1(stream_config, spark)

    assert table_rows(stream_config, spark, "recompute_queue") == []
    assert [(r["order_id"], r["user_id"]) for r in table_rows(stream_config, spark, "orders")
            ] == [("o1", moved_to)]
    assert [(r["order_id"], r["user_id"], r["order_ts"])
            for r in table_rows(stream_config, spark, "attributions")] == [
        ("o1", moved_to, START + timedelta(minutes=1))]
    assert_tables_equal_from_scratch(stream_config, spark,
                                     closed_before_ms=ms(START + timedelta(days=1, hours=5)))
