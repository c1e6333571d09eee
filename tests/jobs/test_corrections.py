"""A correction run plans from a snapshot of the tables and applies from it (corrections C5)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream import spark_session
from clickstream.config import Config
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_read import read_compacted
from clickstream.jobs import backfill_steps, corrections, sessionize
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.backfill_steps import locate_batch, merge_batch
from clickstream.jobs.corrections import (
    CorrectionSummary,
    Run,
    Snapshot,
    Timer,
    _figures_before_apply,
    apply,
    plan,
)
from clickstream.jobs.sessionize import run_sessionizer
from clickstream.quality import reports
from clickstream.quality.correction_report import correction_figures
from clickstream.sessions.batch_adapter import user_bucket
from clickstream.spark_session import release
from clickstream.tables import ATTRIBUTIONS, CORRECTIONS, ORDERS, SESSIONS
from tests.jobs.test_backfill import (
    GAP_MS,
    START,
    all_events,
    located,
    ms,
    order_row,
    pv_row,
    write_rows,
)
from tests.jobs.test_sessionize import order, pageview, produce, table_rows
from tests.reference import reference_sessions
from tests.test_spark_session import stored_rdds


def quiet(_: str) -> None:
    """Progress lines are not what these tests check."""


def merged_orders_run(config: Config, spark: SparkSession,
                      progress: Callable[[str], None] = quiet) -> tuple[Run, DataFrame]:
    """Two pageviews of user ``u`` and an order at minute 5 merged but not yet corrected: the
    correction run and its scope."""
    run_backfill(config, kind="pageviews", client_id="client-00", spark=spark,
                 path=write_rows(config, "p", [pv_row("a", "u", 0), pv_row("b", "u", 3)],
                                 "parquet"))
    orders = write_rows(config, "o", [order_row("o1", "u", 5)], "parquet")
    batch = locate_batch(config, kind="orders", client_id="client-00", path=orders)
    merge_batch(config, kind="orders", client_id="client-00", path=orders,
                run_id=batch["run_id"], spark=spark, progress=quiet)
    run = Run(spark, config, open_tables(config, spark), "client-00", "test-run", "test",
              progress)
    order_ms = ms(START + timedelta(minutes=5))
    scope = spark.createDataFrame([("client-00", "u", order_ms, order_ms)],
                                  "client_id string, user_id string, lo_ms long, hi_ms long")
    return run, scope


def planned_orders_run(config: Config, spark: SparkSession,
                       progress: Callable[[str], None] = quiet) -> tuple[Run, DataFrame]:
    """The run of ``merged_orders_run``, planned: the run and its changes (one session
    updated)."""
    run, scope = merged_orders_run(config, spark, progress)
    summary = CorrectionSummary()
    changes = plan(run, scope, True, summary, Timer(summary, quiet), None)
    assert changes is not None and summary.sessions_updated == 1
    assert run.snapshots["sessions"].version == run.tables.version("sessions")
    return run, changes


def other_writer_stores_a_session(config: Config, spark: SparkSession, day_offset: int) -> None:
    """The stream commits a session of user ``w``, ``day_offset`` days after the run's day."""
    start = START + timedelta(days=day_offset, hours=2)
    other = {"session_id": "other", "client_id": "client-00", "user_id": "w",
             "session_start": start, "session_end": start, "pageview_count": 1,
             "landing_url": "/x", "exit_url": "/x", "order_count": 0,
             "revenue": Decimal("0.0000"), "revision": 1, "session_date": start.date()}
    open_tables(config, spark).append_once(
        SESSIONS.name, spark.createDataFrame([other], SESSIONS.schema), app_id="test-stream",
        version=1, partition_by=SESSIONS.partition_by,
        metadata={"run_id": "test-stream", "cause": "test"})


@pytest.mark.parametrize("day_offset", [0, 5], ids=["same day", "another day"])
def test_apply_reads_again_only_the_days_another_writer_changed_after_the_plan(
    stream_config: Config, spark: SparkSession, day_offset: int
) -> None:
    """The plan's snapshot does not hold the other writer's session: on the same day apply
    must not rewrite the day from the snapshot; on another day the snapshot still serves."""
    lines: list[str] = []
    run, changes = planned_orders_run(stream_config, spark, lines.append)
    other_writer_stores_a_session(stream_config, spark, day_offset)
    apply(run, changes)
    changes.unpersist()

    sessions = {r["user_id"]: r for r in table_rows(stream_config, spark, "sessions")}
    assert sessions.keys() == {"u", "w"}
    assert (sessions["u"]["order_count"], sessions["u"]["revision"]) == (1, 2)
    read_again = [line for line in lines if "changed under the run" in line]
    assert len(read_again) == (1 if day_offset == 0 else 0)
    assert run.snapshots == {}  # released once applied


def test_a_resumed_recompute_counts_the_users_it_leaves_to_the_stream_once() -> None:
    """The resumed plan's users deferred (read back from its commit) are still queued, and the
    pass planning after it finds them again: summed, they were counted twice. So are its
    orders: that pass tallies every order of the same queue rows' windows (here one more the
    stream stored meanwhile), changed or not, and the sum counted them twice too."""
    resumed = CorrectionSummary(sessions_created=2, orders_attributed=3, orders_unattributed=1,
                                deferred_users=4, resumed=True, totals_recorded=True)
    later = CorrectionSummary(sessions_updated=1, orders_attributed=4, orders_unattributed=1,
                              deferred_users=4)
    both = resumed.and_then(later)
    assert (both.sessions_created, both.sessions_updated, both.orders_attributed,
            both.orders_unattributed, both.deferred_users, both.resumed) == (2, 1, 4, 1, 4, True)


@pytest.mark.parametrize("entity", ["session", "attribution"])
def test_apply_keeps_what_another_writer_stored_in_a_table_missing_when_the_run_planned(
    stream_config: Config, spark: SparkSession, entity: str
) -> None:
    """A first backfill beside a starting stream: the table did not exist at the plan, the
    stream created it with a row in the run's days before apply, and apply replaced those
    days from its empty snapshot, dropping the stream's row (on the topic, not in the table)."""
    config = stream_config.replace(quality_gates="off")
    kind, rows = (("pageviews", [pv_row("a", "u", 0), pv_row("b", "u", 3)]) if entity == "session"
                  else ("orders", [order_row("o1", "u", 5)]))
    path = write_rows(config, "batch", rows, "parquet")
    batch = locate_batch(config, kind=kind, client_id="client-00", path=path)
    merge_batch(config, kind=kind, client_id="client-00", path=path, run_id=batch["run_id"],
                spark=spark, progress=quiet)
    run = Run(spark, config, open_tables(config, spark), "client-00", "test-run", "test", quiet)
    assert not run.tables.exists("sessions") and not run.tables.exists("attributions")
    lo, hi = ms(START), ms(START + timedelta(minutes=5))
    scope = spark.createDataFrame([("client-00", "u", lo, hi)],
                                  "client_id string, user_id string, lo_ms long, hi_ms long")
    summary = CorrectionSummary()
    changes = plan(run, scope, entity == "attribution", summary, Timer(summary, quiet), None)
    assert changes is not None
    if entity == "session":
        other_writer_stores_a_session(config, spark, 0)
    else:
        at = START + timedelta(hours=3)
        other = {"order_id": "other", "client_id": "client-00", "user_id": "w",
                 "order_ts": at, "session_id": None, "revision": 1, "order_date": at.date()}
        open_tables(config, spark).append_once(
            ATTRIBUTIONS.name, spark.createDataFrame([other], ATTRIBUTIONS.schema),
            app_id="test-stream", version=1, partition_by=ATTRIBUTIONS.partition_by,
            metadata={"run_id": "test-stream", "cause": "test"})
    apply(run, changes)
    changes.unpersist()

    key = "user_id" if entity == "session" else "order_id"
    stored = sorted(r[key] for r in table_rows(config, spark, f"{entity}s"))
    assert stored == (["u", "w"] if entity == "session" else ["o1", "other"])


def test_report_figures_from_the_snapshot_equal_those_by_time_travel(
    stream_config: Config, spark: SparkSession
) -> None:
    """A run that goes straight through reports old values from its snapshot; a resumed run
    (or the report as a later DAG step) reads them by time travel: the same figures."""
    config = stream_config
    run_backfill(config, kind="pageviews", client_id="client-00", spark=spark,
                 path=write_rows(config, "p1", [pv_row("a", "u", 0), pv_row("b", "u", 3),
                                                pv_row("c", "u", 100)], "parquet"))
    run_backfill(config, kind="orders", client_id="client-00", spark=spark,
                 path=write_rows(config, "o", [order_row("o1", "u", 5, "10.00"),
                                               order_row("o2", "u", 101, "7.50")], "parquet"))
    # Pageviews filling the gap merge the two sessions: one updated, one retracted, o2 moves.
    late = write_rows(config, "p2", [pv_row(e, "u", m) for e, m in
                                     (("d", 25), ("e", 50), ("f", 75))], "parquet")
    batch = locate_batch(config, kind="pageviews", client_id="client-00", path=late)
    merge_batch(config, kind="pageviews", client_id="client-00", path=late,
                run_id=batch["run_id"], spark=spark, progress=quiet)
    run = Run(spark, config, open_tables(config, spark), "client-00", "test-run", "test", quiet)
    scope = spark.createDataFrame(
        [("client-00", "u", ms(START + timedelta(minutes=25)), ms(START + timedelta(minutes=75)))],
        "client_id string, user_id string, lo_ms long, hi_ms long")
    summary = CorrectionSummary()
    changes = plan(run, scope, False, summary, Timer(summary, quiet), None)
    assert changes is not None
    assert (summary.sessions_updated, summary.sessions_retracted) == (1, 1)

    from_snapshot = _figures_before_apply(run, changes)
    apply(run, changes)
    by_time_travel = correction_figures(run, changes)
    changes.unpersist()

    assert from_snapshot == by_time_travel
    assert from_snapshot.old_known
    assert from_snapshot.by_day == [(START.date(), Decimal("17.5000"), Decimal("17.5000"))]
    assert from_snapshot.moved == {"moved to another session": 1}
    # The report's sample of changed sessions: the merged one took o2's revenue, the one it
    # swallowed was retracted with it; each with its user and start.
    assert sorted((s.change, s.user_id, s.revenue_before, s.revenue_after)
                  for s in from_snapshot.sessions) == [
        ("retracted", "u", Decimal("7.5000"), Decimal(0)),
        ("updated", "u", Decimal("10.0000"), Decimal("17.5000"))]
    starts = {s.change: s.session_start for s in from_snapshot.sessions}
    assert starts["updated"] == START.replace(tzinfo=None)


def test_windows_read_orders_again_when_the_table_moved_after_the_merge_read(
    stream_config: Config, spark: SparkSession
) -> None:
    """The orders read once at the merge commit (for its gate) serve the recompute only while
    the table is still at that version: an order the stream stored since is attributed too."""
    config = stream_config
    run, scope = merged_orders_run(config, spark)
    tables = run.tables
    merged_at = tables.version(ORDERS.name)
    run.snapshots[ORDERS.name] = Snapshot(merged_at, None, tables.read(
        ORDERS.name, partition_filter={"client_id": "client-00"}, schema=ORDERS.schema,
        version=merged_at).persist())
    live = {"order_id": "o2", "event_id": None, "client_id": "client-00", "user_id": "u",
            "ts": START + timedelta(minutes=6), "amount": Decimal("2.5000"),
            "currency": "EUR", "source": "test", "event_date": START.date()}
    tables.append_once(ORDERS.name, spark.createDataFrame([live], ORDERS.schema),
                       app_id="test-stream", version=1, partition_by=ORDERS.partition_by,
                       metadata={"run_id": "test-stream", "cause": "test"})

    summary = CorrectionSummary()
    changes = plan(run, scope, True, summary, Timer(summary, quiet), None)
    assert changes is not None
    apply(run, changes)
    changes.unpersist()
    (session,) = table_rows(config, spark, "sessions")
    assert (session["order_count"], session["revenue"]) == (2, Decimal("12.5000"))


@pytest.mark.parametrize("broadcast_max", [spark_session.BROADCAST_KEYS_MAX, 0],
                         ids=["keys broadcast", "keys shuffled"])
def test_apply_rewrites_only_the_changed_keys_whether_broadcast_or_shuffled(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
    spark_conf: Callable[[str, str], None], broadcast_max: int
) -> None:
    """Apply replaces the changed sessions of the affected days and keeps the others, with
    the changed keys sent to every task (the usual case) or shuffled (above the cap). The
    orders' days that pick the sessions an order may belong to (C12) take the same path:
    the order is attributed either way."""
    monkeypatch.setattr(spark_session, "BROADCAST_KEYS_MAX", broadcast_max)
    # Test tables are small enough for Spark to broadcast them unasked.
    spark_conf("spark.sql.autoBroadcastJoinThreshold", "-1")
    applied: list[tuple[int, int]] = []  # the SQL executions of each apply: its own joins
    real_apply = corrections.apply

    def apply_seen(run: Run, changes: DataFrame) -> None:
        first = last_sql_execution(spark)
        real_apply(run, changes)
        applied.append((first, last_sql_execution(spark)))

    monkeypatch.setattr(corrections, "apply", apply_seen)
    kept: list[DataFrame] = []  # the stored rows each apply keeps, as planned
    real_kept_rows = corrections._kept_rows

    def kept_rows_seen(*args, **kwargs) -> DataFrame:
        kept.append(real_kept_rows(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(corrections, "_kept_rows", kept_rows_seen)
    sessions = _three_backfills_of_two_users(stream_config, spark)
    assert sessions == [("u", 5, 1, 2), ("v", 1, 0, 1)]
    assert len(applied) == 3
    joins = set().union(*(joins_planned(spark, after, through) for after, through in applied))
    assert ("BroadcastHashJoin" in joins) == (broadcast_max > 0)  # the path the cap chose
    assert broadcast_max > 0 or "SortMergeJoin" in joins
    # Sessions' rows in each apply, attributions' (by their copies, C14) in the two after the
    # order; no hint Spark drops, with a warning on the console, for naming the side of a
    # join it cannot send.
    assert len(kept) == 5
    assert not [hint for frame in kept for hint in hints_spark_drops(frame)]


def hints_spark_drops(frame: DataFrame) -> list[str]:
    """The joins of ``frame``'s plan hinted to send the side Spark cannot build (the left of
    a left outer, semi or anti join, the right of a right outer join)."""
    plan = frame._jdf.queryExecution().optimizedPlan().toString()
    return re.findall(r"Join (?:LeftOuter|LeftSemi|LeftAnti), .*leftHint=\(strategy=broadcast\)"
                      r"|Join RightOuter, .*rightHint=\(strategy=broadcast\)", plan)


def _sql_executions(spark: SparkSession) -> list:
    """Spark's own record of each SQL execution and its final plan (UI off or on)."""
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    store = spark._jsparkSession.sharedState().statusStore()
    executions, iterator = [], store.executionsList().iterator()
    while iterator.hasNext():
        executions.append(iterator.next())
    return executions


def last_sql_execution(spark: SparkSession) -> int:
    return max((int(e.executionId()) for e in _sql_executions(spark)), default=-1)


def joins_planned(spark: SparkSession, after: int, through: int) -> set[str]:
    """The join operators of the plans of the SQL executions after ``after`` up to
    ``through``."""
    return {join for e in _sql_executions(spark) if after < int(e.executionId()) <= through
            for join in re.findall(r"\b(BroadcastHashJoin|SortMergeJoin|ShuffledHashJoin)\b",
                                   e.physicalPlanDescription())}


def _three_backfills_of_two_users(config: Config, spark: SparkSession
                                  ) -> list[tuple[str, int, int, int]]:
    """(user, pageviews, orders, revision) of each session after: two users' pageviews, an
    order of ``u``'s second session, then pageviews that merge ``u``'s two sessions."""
    run_backfill(config, kind="pageviews", client_id="client-00", spark=spark, progress=quiet,
                 path=write_rows(config, "p1", [pv_row("a", "u", 0), pv_row("b", "u", 100),
                                                pv_row("c", "v", 0)], "parquet"))
    run_backfill(config, kind="orders", client_id="client-00", spark=spark, progress=quiet,
                 path=write_rows(config, "o", [order_row("o1", "u", 101, "7.50")], "parquet"))
    # Pageviews filling u's gap merge its two sessions: one updated, one retracted.
    run_backfill(config, kind="pageviews", client_id="client-00", spark=spark, progress=quiet,
                 path=write_rows(config, "p2", [pv_row(e, "u", m) for e, m in
                                                (("d", 25), ("e", 50), ("f", 75))], "parquet"))
    return sorted((r["user_id"], r["pageview_count"], r["order_count"], r["revision"])
                  for r in table_rows(config, spark, "sessions"))


def test_users_orders_moved_to_are_followed_along_a_chain_and_only_the_answer_stays_kept(
        spark: SparkSession) -> None:
    """(C9) An order moved from u1 to u2 and one from u2 to u3: deferring u1 defers both. Each
    round's frame is released once the next one holds its rows."""
    scope = spark.createDataFrame(
        [("client-00", "u1", ["u2"]), ("client-00", "u2", ["u3"]), ("client-00", "u4", ["u5"])],
        "client_id string, user_id string, moved_with array<string>")
    deferred = spark.createDataFrame([("client-00", "u1")], "client_id string, user_id string")
    before = stored_rdds(spark)

    grown = corrections.with_moved_orders_users(deferred, scope)

    assert sorted(r.user_id for r in grown.collect()) == ["u1", "u2", "u3"]
    assert len(stored_rdds(spark) - before) == 1  # the answer's blocks, nothing else
    release(grown)
    assert stored_rdds(spark) == before


REUSED_AT = 60  # minutes after START: a's and b's sessions, each with an order "o"


def _order_id_reused_by_two_users(config: Config, spark: SparkSession) -> dict[str, dict]:
    """(``sessionize`` Z12, README's Known limits) Users a and b of client-00, their session
    state in different buckets, each send an order with id ``o`` inside their on-time session,
    in two micro-batches: ``attributions`` holds a row for each. User w has a session that
    day too, and a flush pageview hours later closes them all. Returns o's rows by user."""
    users = spark.createDataFrame([("client-00", "a"), ("client-00", "b")],
                                  "client_id string, user_id string")
    buckets = users.select(user_bucket(sessionize.STATE_BUCKETS)).collect()
    assert len({r[0] for r in buckets}) == 2, "a and b must be kept in different buckets"
    base = START + timedelta(minutes=REUSED_AT)

    def at(minutes: int) -> timedelta:
        return timedelta(minutes=minutes)

    produce(config, [pageview("a", base, "a1"), pageview("a", base + at(5), "a2"),
                     order("a", base + at(6), "o", "10.00", event_id="oa")])
    run_sessionizer(config, until_caught_up=True, spark=spark)
    produce(config, [pageview("b", base, "b1"), pageview("b", base + at(5), "b2"),
                     order("b", base + at(6), "o", "3.00", event_id="ob"),
                     pageview("w", base + at(60), "w1"), pageview("w", base + at(65), "w2"),
                     pageview("flush", START + timedelta(hours=10), "flush")])
    run_sessionizer(config, until_caught_up=True, spark=spark)

    sessions = {r["session_id"]: r["user_id"] for r in table_rows(config, spark, "sessions")}
    assert sorted(sessions.values()) == ["a", "b", "w"]
    reused = [r for r in table_rows(config, spark, "attributions") if r["order_id"] == "o"]
    assert sorted((r["user_id"], sessions[r["session_id"]], r["revision"]) for r in reused) == [
        ("a", "a", 1), ("b", "b", 1)]  # the documented Z12 state: the table holds both
    return {r["user_id"]: r for r in reused}


def _stored_copies_of_o(config: Config, spark: SparkSession) -> list[dict]:
    return sorted((r for r in table_rows(config, spark, "attributions") if r["order_id"] == "o"),
                  key=lambda r: r["user_id"])


def test_an_unrelated_correction_of_the_day_keeps_both_copies_of_a_reused_order_id(
        stream_config: Config, spark: SparkSession) -> None:
    """(Z12) The stream stored o's attribution for a and for b. A backfill of another order
    of that day (w's ``ow``) plans nothing of o, yet the DAG's check-applied step failed:
    checking that the day's attributions hold one row per order_id, it took o's two copies
    for a plan not applied ("... not what table 'attributions' holds (first: o)"), and every
    later correction run of the client stopped on the unpublished plan."""
    config = stream_config
    before = _order_id_reused_by_two_users(config, spark)
    _, run_id, step = located(config, spark, [order_row("ow", "w", REUSED_AT + 61)],
                              kind="orders", name="ow")
    for name in backfill_steps.STEPS:
        step(name)

    sessions = {r["session_id"]: r["user_id"] for r in table_rows(config, spark, "sessions")}
    (ow,) = [r for r in table_rows(config, spark, "attributions") if r["order_id"] == "ow"]
    assert (ow["user_id"], sessions.get(ow["session_id"]), ow["revision"]) == ("w", "w", 1)
    assert _stored_copies_of_o(config, spark) == [before["a"], before["b"]]  # unchanged
    assert backfill_steps.load_step_result(config, run_id, "check-applied") == {
        "sessions": 1, "attributions": 1, "run_seq": 1}


def test_a_correction_reaching_copies_of_a_reused_order_id_at_different_revisions_publishes(
        stream_config: Config, spark: SparkSession) -> None:
    """(Z12, C14) A first correction reaches a's copy of o only (a at revision 2, b at 1); a
    second reaches both (a 2 -> 3, b 1 -> 2). The publish gate expected each planned (o,
    revision) to be the last record of o on the topic, which keeps one record per key: one
    of the two always failed, so the plan never became published and every later
    correction of the client (its rerun included) stopped on it."""
    config = stream_config
    _order_id_reused_by_two_users(config, spark)
    run_backfill(config, kind="pageviews", client_id="client-00", spark=spark, progress=quiet,
                 path=write_rows(config, "early1", [pv_row("a0", "a", REUSED_AT - 5)],
                                 "parquet"))
    assert [(r["user_id"], r["revision"]) for r in _stored_copies_of_o(config, spark)] == [
        ("a", 2), ("b", 1)]

    summary = run_backfill(
        config, kind="pageviews", client_id="client-00", spark=spark, progress=quiet,
        path=write_rows(config, "early2", [pv_row("a00", "a", REUSED_AT - 8),
                                           pv_row("b0", "b", REUSED_AT - 10)], "parquet"))

    assert [(r["user_id"], r["revision"]) for r in _stored_copies_of_o(config, spark)] == [
        ("a", 3), ("b", 2)]
    assert sorted(r["new_revision"] for r in table_rows(config, spark, "corrections")
                  if r["run_id"] == f"backfill-{summary.run_id}" and r["key"] == "o") == [2, 3]
    assert read_compacted(config, config.attributions_topic)["o"]["revision"] in (2, 3)


@pytest.mark.parametrize("changed", [("a", "b"), ("a",)], ids=["both users", "user a only"])
def test_a_correction_reaching_copies_of_a_reused_order_id_revises_each_once(
        stream_config: Config, spark: SparkSession, changed: tuple[str, ...]) -> None:
    """(Z12) o is attributed to a's session and to b's. Late pageviews before a's (and b's)
    session start give the session a new id, so each affected copy of o moves to its user's
    new session: one row per (o, user), the affected ones at revision 2, the other kept at
    revision 1, one attribution correction per affected copy. The correction engine keyed
    its diff, apply and check by order_id alone, so the two copies met as one order: a plan
    reaching both stored each copy twice (four updates), and one reaching a's copy only
    replaced both copies with a's row, losing b's attribution."""
    config = stream_config
    _order_id_reused_by_two_users(config, spark)
    early = {"a": pv_row("a0", "a", REUSED_AT - 5), "b": pv_row("b0", "b", REUSED_AT - 10)}
    summary = run_backfill(config, kind="pageviews", client_id="client-00", spark=spark,
                           progress=quiet, path=write_rows(
                               config, "early", [early[user] for user in changed], "parquet"))

    sessions = table_rows(config, spark, "sessions")
    owner = {r["session_id"]: (r["user_id"], ms(r["session_start"])) for r in sessions}
    copies = _stored_copies_of_o(config, spark)
    assert [(r["user_id"], owner[r["session_id"]][0], r["revision"]) for r in copies] == [
        (user, user, 2 if user in changed else 1) for user in ("a", "b")]
    for row in copies:  # each copy is in its user's session as it now starts
        starts = ms(early[row["user_id"]]["ts"]) if row["user_id"] in changed else ms(
            START + timedelta(minutes=REUSED_AT))
        assert owner[row["session_id"]][1] == starts

    # Sessions equal the from-scratch reference (the flush pageview's session is still open
    # in the stream). The reference's order_id -> session map cannot hold two copies of o;
    # its sessions count each copy in its own user's session, which the rows above check.
    expected, _ = reference_sessions(all_events(config, spark), GAP_MS)
    closed_before = ms(START + timedelta(hours=10)) - config.watermark_delay_ms
    want = {sid: (s["user_id"], s["start_ms"], s["end_ms"], s["pageview_count"],
                  s["order_count"], Decimal(s["revenue"]).quantize(Decimal("0.0001")))
            for sid, s in expected.items() if s["end_ms"] + GAP_MS <= closed_before}
    assert {r["session_id"]: (r["user_id"], ms(r["session_start"]), ms(r["session_end"]),
                              r["pageview_count"], r["order_count"], r["revenue"])
            for r in sessions} == want
    assert {s[0]: s[4:] for s in want.values()} == {
        "a": (1, Decimal("10.0000")), "b": (1, Decimal("3.0000")), "w": (0, Decimal("0.0000"))}

    attribution_corrections = [
        r for r in table_rows(config, spark, "corrections")
        if r["run_id"] == f"backfill-{summary.run_id}" and r["entity"] == "attribution"]
    assert len(attribution_corrections) == len(changed)

    # The correction report pairs o's copies as the plan did: each affected copy moved once,
    # in the page written from the run's snapshot and in figures read back by time travel.
    # By order_id alone, each new copy met both old ones: 4 moves for two, 2 for one.
    (entry,) = [e for e in reports.read_entries(reports.reports_dir(config))
                if e.kind == "corrections" and e.run_id == summary.run_id]
    assert f"; {len(changed)} orders re-attributed;" in entry.summary
    run = Run(spark, config, open_tables(config, spark), "client-00",
              f"backfill-{summary.run_id}", "test", quiet)
    planned = open_tables(config, spark).read(CORRECTIONS.name).where(
        F.col("run_id") == run.run_id)
    assert correction_figures(run, planned).moved == {"moved to another session": len(changed)}


def test_report_figures_count_a_retracted_attribution_by_its_key(spark: SparkSession) -> None:
    """``recompute --full`` retracts attributions (R8): such a plan row has no new value, so
    its order id comes from the row's key, not from the value."""
    day = START.date()
    plan = spark.createDataFrame(
        [("attribution", "o1", "retracted", 1, None, None, day)],
        "entity string, key string, change string, old_revision int, new_revision int, "
        "new_value string, partition_date date")
    stored = spark.createDataFrame([("o1", "client-00", "u", START, "s1", 1, day)],
                                   ATTRIBUTIONS.schema)

    figures = correction_figures(None, plan, {ATTRIBUTIONS.name: stored})

    assert figures.moved == {"no longer attributed (kept, unattributed)": 1}


def test_report_figures_count_a_created_copy_of_a_stored_order_id_as_attributed(
        spark: SparkSession) -> None:
    """(C14) The plan creates a's copy of o beside b's stored one: it had no old row, so it
    is attributed now; paired with b's copy by key, it looked moved."""
    day = START.date()

    def value(order_id: str, user_id: str, session_id: str, revision: int) -> str:
        return json.dumps({"order_id": order_id, "client_id": "client-00", "user_id": user_id,
                           "order_ts": START.isoformat(), "session_id": session_id,
                           "revision": revision, "order_date": str(day)})

    plan = spark.createDataFrame(  # with an update: the old rows are read (p moves)
        [("attribution", "o", "created", None, 1, value("o", "a", "sa", 1), day),
         ("attribution", "p", "updated", 1, 2, value("p", "c", "sc2", 2), day)],
        "entity string, key string, change string, old_revision int, new_revision int, "
        "new_value string, partition_date date")
    stored = spark.createDataFrame([("o", "client-00", "b", START, "sb", 1, day),
                                    ("p", "client-00", "c", START, "sc", 1, day)],
                                   ATTRIBUTIONS.schema)

    figures = correction_figures(None, plan, {ATTRIBUTIONS.name: stored})

    assert figures.moved == {"attributed to a session": 1, "moved to another session": 1}
