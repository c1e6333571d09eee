"""The backfill's and recompute's gates on real runs: each fails on crafted bad data, stops its
step before anything is overwritten or published, quarantines the offending rows with the
failed expectation as the reason, and names the problem; good data passes."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from datetime import date, timedelta

import pyarrow as pa
import pyarrow.compute
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream.cli import main
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import EXIT_NOT_RETRYABLE, QualityGateFailedError
from clickstream.io import kafka_changelog
from clickstream.io.delta_tables import RECENT_COMMITS, open_tables
from clickstream.io.kafka_produce import encode_json, produce_records
from clickstream.io.kafka_read import read_compacted
from clickstream.jobs import backfill, backfill_steps, corrections
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.recompute import run_full_recompute
from clickstream.quality import gates
from clickstream.quality.checks import (
    Checks,
    run_commit_version,
    tables_after_merge_checks,
)
from clickstream.quality.reports import (
    ReportEntry,
    current_entries,
    read_entries,
    reports_dir,
    run_status,
)
from clickstream.tables import ORDERS, SESSIONS
from tests.jobs.test_backfill import (
    START,
    order_row,
    pv_row,
    run_summaries,
    versions,
    write_rows,
)
from tests.jobs.test_sessionize import table_rows
from tests.quality.test_reports import assert_every_link_resolves


def quarantined(config: Config, spark: SparkSession, gate: str) -> list[dict]:
    return [r for r in table_rows(config, spark, "quarantine") if f"quality gate {gate}"
            in r["reason"]]


def unchanged(before: dict, after: dict, *names: str) -> None:
    assert {n: after[n] for n in names} == {n: before[n] for n in names}


@pytest.mark.parametrize(("case", "message"), [
    ("negative amounts", r"negative_amount_fraction = 0\.75, expected at most 0\.5"),
    # (B12) each castable to a decimal, so only unparsable text used to count
    ("amounts the contract does not read", r"bad_amount_fraction = 0\.75, expected at most 0\.5"),
    ("another client", r"main_client_id = client-01, expected one of \[client-00\]"),
    # (suite v4) rows without a client were counted as another client's
    ("no client ids", r"blank_client_id_fraction = 0\.75, expected at most 0\.5"),
    ("dates as ts", r"ts_column_type = date, expected one of \[string, timestamp, integer\]"),
    # (suite v2) a reason no other fraction counts: every row bad, and it passed with a warning
    ("times ahead of the file's", r"other_problem_fraction = 1, expected at most 0\.5"),
])
def test_historical_batch_refuses_a_bad_batch_and_merges_nothing(
    stream_config: Config, spark: SparkSession, case: str, message: str
) -> None:
    rows = [order_row("o1", "u", 1), order_row("o2", "u", 2), order_row("o3", "u", 3),
            order_row("o4", "u", 4)]
    if case == "negative amounts":
        for row in rows[1:]:
            row["amount"] = "-3.00"
    elif case == "amounts the contract does not read":
        for row, amount in zip(rows[1:], ("1.23456", "12345678901234", "1e3"), strict=True):
            row["amount"] = amount
    elif case == "another client":
        rows = [{**row, "client_id": "client-01"} for row in rows]
    elif case == "no client ids":
        rows = [rows[0], *({**row, "client_id": ""} for row in rows[1:])]
    elif case == "dates as ts":
        rows = [{**row, "ts": row["ts"].date()} for row in rows]
    path = write_rows(stream_config, "o", rows, "parquet")
    if case == "times ahead of the file's":  # written a month before its orders' times
        written = (rows[0]["ts"] - timedelta(days=30)).timestamp()
        for file in (stream_config.landing / path).rglob("*.parquet"):
            os.utime(file, (written, written))
    before = versions(stream_config, spark)
    with pytest.raises(QualityGateFailedError, match=(
            r"^(most of the batch's rows \(100%\) are of client 'client-01': .*?\. )?"
            r"quality gate historical_batch failed for backfill orders-client-00-\w+: [1-3] of "
            rf"17 expectations failed: .*quality gate historical_batch: {message} .*the batch "
            r"was refused as a whole: nothing was merged")) as refused:
        run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                     path=path, progress=lambda _: None)
    # The likely fix first: the batch is another client's, sent under the wrong --client.
    assert str(refused.value).startswith(
        "most of the batch's rows (100%) are of client 'client-01': if the batch is that "
        "client's, run it with --client client-01 (the form's Client). quality gate "
    ) == (case == "another client")
    after = versions(stream_config, spark)
    unchanged(before, after, "pageviews", "orders", "sessions", "attributions", "corrections")
    assert after["quarantine"] > before["quarantine"]
    bad = quarantined(stream_config, spark, "historical_batch")
    expected = ({"o2", "o3", "o4"} if "amount" in case or case == "no client ids"
                else {"o1", "o2", "o3", "o4"})
    assert {json.loads(r["raw"])["order_id"] for r in bad} == expected
    assert all(message.split(",")[0].replace("\\", "") in r["reason"] for r in bad)


def test_a_refused_batch_is_one_line_and_exit_3_on_the_command_line(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    for name, variable in ENV_NAMES.items():
        if name not in ("kafka_options", "spark_kafka_options"):
            monkeypatch.setenv(variable, str(getattr(stream_config, name)))
    rows = [{**order_row(f"o{i}", "u", i), "currency": "XXX"} for i in range(3)]
    path = write_rows(stream_config, "cli", rows, "jsonl")
    command = ["backfill", "--kind", "orders", "--client", "client-00", "--path", path]
    assert main(command) == EXIT_NOT_RETRYABLE
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert error[0].startswith("clickstream backfill: error: quality gate historical_batch "
                               "failed for backfill orders-client-00-")
    assert "bad_currency_fraction = 1, expected at most 0.5" in error[0]


def test_a_batch_whose_every_row_is_bad_for_two_reasons_is_refused_with_exit_3(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Two pageviews, one with ts "never", one without a url: each problem is half the batch,
    at most half, so before suite v3 the gate passed with a warning, the run merged nothing
    and exited 0 ("2 rows read, 0 merged, ... 2 quarantined"). A batch with rows and not one
    good row is refused like any other: exit 3, nothing merged, both rows in quarantine with
    the refusing expectation and then their own reason."""
    for name, variable in ENV_NAMES.items():
        if name not in ("kafka_options", "spark_kafka_options"):
            monkeypatch.setenv(variable, str(getattr(stream_config, name)))
    good_ts = (START + timedelta(minutes=1)).isoformat()
    rows = [{**pv_row("q1", "u1", 0), "ts": "never"},
            {**pv_row("q2", "u1", 1), "ts": good_ts, "url": None}]
    folder = stream_config.landing / "all-bad"
    folder.mkdir(parents=True)
    (folder / "part.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = versions(stream_config, spark)
    command = ["backfill", "--kind", "pageviews", "--client", "client-00", "--path", "all-bad"]
    assert main(command) == EXIT_NOT_RETRYABLE
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1, error
    assert error[0].startswith("clickstream backfill: error: quality gate historical_batch "
                               "failed for backfill pageviews-client-00-")
    assert "every_row_refused = True, expected one of [False]" in error[0]
    assert "its 2 rows with problems are in quarantine; fix the batch and send it again" in (
        error[0])
    after = versions(stream_config, spark)
    unchanged(before, after, "pageviews", "orders", "sessions", "attributions", "corrections")
    bad = quarantined(stream_config, spark, "historical_batch")
    assert sorted(json.loads(r["raw"])["event_id"] for r in bad) == ["q1", "q2"]
    assert all(r["reason"].startswith("quality gate historical_batch: every_row_refused = True")
               and r["reason"].count("; ") >= 1 for r in bad), [r["reason"] for r in bad]


def test_tables_after_merge_stops_before_any_correction(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_merge = backfill.merge_pageviews

    def merge_twice(tables, valid: DataFrame, *args):  # a merge bug: every row stored twice
        return real_merge(tables, valid.unionByName(valid), *args)

    monkeypatch.setattr(backfill, "merge_pageviews", merge_twice)
    before = versions(stream_config, spark)
    path = write_rows(stream_config, "p", [pv_row("a", "u", 0), pv_row("b", "u", 5)], "parquet")
    with pytest.raises(QualityGateFailedError, match=(
            r"quality gate tables_after_merge failed for backfill pageviews-client-00-\w+: 2 of "
            r"2 expectations failed: quality gate tables_after_merge: rows_after = 4, expected "
            r"expected_rows_after \(2\) .*; quality gate tables_after_merge: duplicate_keys = 2, "
            r"expected 0 .*; 3 rows quarantined .*no session was recomputed")):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                     path=path, progress=lambda _: None)
    after = versions(stream_config, spark)
    unchanged(before, after, "sessions", "attributions", "corrections")
    rows = [json.loads(r["raw"]) for r in quarantined(stream_config, spark, "tables_after_merge")]
    assert sorted(r.get("event_id", "the check results") for r in rows) == [
        "a", "b", "the check results"]  # the duplicated rows, and why the counts disagree
    # What the DAG's announce_merge announces after such a merge (committed, then failed):
    # it announced neither table.
    run_id = backfill_steps.locate_batch(stream_config, kind="pageviews", client_id="client-00",
                                         path=path)["run_id"]
    assert backfill_steps.merged_tables(stream_config, kind="pageviews", run_id=run_id,
                                        dry_run=False) == {"pageviews": 4, "quarantine": 3}


def test_a_key_stored_twice_before_does_not_stop_a_later_backfill_of_its_day(
    stream_config: Config, spark: SparkSession
) -> None:
    """A key stored twice before (a new checkpoint's replay, Known limits) failed the
    ``tables_after_merge`` gate of every later backfill of its day, and of their reruns (they
    check the merge commit's snapshot again), even once a copy was deleted by hand: the gate
    counts only the keys its own merge stored twice."""
    quiet = lambda _: None  # noqa: E731
    run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                 path=write_rows(stream_config, "a", [pv_row("a", "u", 0), pv_row("b", "u", 5)],
                                 "parquet"), progress=quiet)
    location = str(stream_config.warehouse / "pageviews")
    stored = DeltaTable(location).to_pyarrow_table()
    copy = stored.filter(pa.compute.equal(stored["event_id"], "a"))
    write_deltalake(location, copy.set_column(copy.schema.get_field_index("source"), "source",
                                              pa.array(["kafka:events/0/7"])), mode="append")

    summary = run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                           path=write_rows(stream_config, "b", [pv_row("c", "u", 10)],
                                           "parquet"), progress=quiet)
    assert summary.rows_merged == 1
    assert sorted(r["event_id"] for r in table_rows(stream_config, spark, "pageviews")) == [
        "a", "a", "b", "c"]
    assert quarantined(stream_config, spark, "tables_after_merge") == []


@pytest.mark.parametrize("sent_again", [False, True], ids=["updated", "and-one-sent-as-stored"])
def test_an_order_stored_twice_before_is_updated_by_a_later_batch(
    stream_config: Config, spark: SparkSession, sent_again: bool
) -> None:
    """The orders upsert replaces every stored copy of an order the batch updates: the gate
    expected one row to stay, and failed that backfill at every rerun (its merge committed).
    An order the batch sends as stored is not written, so its copies stay: the gate took
    them for replaced too and failed it; and ``recomputed_sessions`` counted the attributed
    order once per copy, failing every correction of its user's window."""
    quiet = lambda _: None  # noqa: E731
    run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                 path=write_rows(stream_config, "p", [pv_row("p1", "u", 0)], "parquet"),
                 progress=quiet)
    run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                 path=write_rows(stream_config, "a", [order_row("o1", "u", 0),
                                                      order_row("o2", "u", 5)], "parquet"),
                 progress=quiet)
    location = str(stream_config.warehouse / "orders")
    stored = DeltaTable(location).to_pyarrow_table()
    write_deltalake(location, stored, mode="append")  # a new checkpoint's replay stored them

    batch = [order_row("o1", "u", 0, amount="12.50"), *([order_row("o2", "u", 5)]
                                                       if sent_again else [])]
    summary = run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                           path=write_rows(stream_config, "b", batch, "parquet"),
                           progress=quiet)
    assert summary.rows_merged == 1
    assert sorted((r["order_id"], str(r["amount"])) for r in table_rows(
        stream_config, spark, "orders")) == [("o1", "12.5000"), ("o2", "10.0000"),
                                             ("o2", "10.0000")]
    assert quarantined(stream_config, spark, "tables_after_merge") == []
    assert [(r["order_count"], str(r["revenue"])) for r in table_rows(
        stream_config, spark, "sessions")] == [(2, "22.5000")]


def test_a_retried_merge_gate_finds_its_commit_behind_a_busy_stream(
    stream_config: Config, spark: SparkSession
) -> None:
    """K3: a retried merge step (another process) reads the merge commit from the log; the
    stream may have committed hundreds of times since."""
    path = write_rows(stream_config, "o", [order_row(f"o{i}", "u", i) for i in range(3)],
                      "parquet")
    run_id = run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                          path=path, progress=lambda _: None).run_id
    tables = open_tables(stream_config, spark)
    merged = run_commit_version(tables, ORDERS.name, run_id)
    assert merged is not None
    location = str(stream_config.warehouse / ORDERS.name)
    live = DeltaTable(location).to_pyarrow_table().slice(0, 1)
    live = live.set_column(live.schema.get_field_index("client_id"), "client_id",
                           pa.array(["client-01"]))
    for _ in range(RECENT_COMMITS + 5):  # the stream's live orders of another client
        write_deltalake(location, live, mode="append")

    assert run_commit_version(tables, ORDERS.name, run_id) == merged
    keys = spark.createDataFrame([(f"o{i}",) for i in range(3)], "order_id string")
    values = tables_after_merge_checks(tables, ORDERS, run_id=run_id, client_id="client-00",
                                       batch_keys=keys, scope={"client_id": "client-00"}).values
    assert (values["rows_before"], values["keys_already_stored"], values["rows_after"]) == \
        (0, 0, 3)  # not the table compared with itself


def test_an_empty_pageview_batch_is_reconciled_without_reading_the_clients_pageviews(
    stream_config: Config, spark: SparkSession
) -> None:
    """An empty pageview batch has no day, so its merge touches no partition. The gate
    scoped it by client alone: it read every stored pageview of the client (``rows_before``
    counted them all) to reconcile nothing."""
    path = write_rows(stream_config, "p", [pv_row(f"p{i}", "u", i) for i in range(3)],
                      "parquet")
    run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                 path=path, progress=lambda _: None)
    empty = spark.createDataFrame([], "event_id string, ts timestamp")
    result = gates.gate_tables_after_merge(
        open_tables(stream_config, spark), stream_config, kind="pageviews",
        client_id="client-00", run_id="an-empty-batch", valid=empty, dates=[])
    assert result is not None and result.success, result
    assert (result.checks["rows_before"], result.checks["rows_after"],
            result.checks["expected_rows_after"]) == (0, 0, 0)


def test_recomputed_sessions_records_applies_and_publishes_nothing_then_a_rerun_succeeds(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_recompute = corrections.recompute
    v_off_by = [1]

    def wrong_revenue(*args, **kwargs):  # a semantics bug: revenue off by one (v: v_off_by)
        result = real_recompute(*args, **kwargs)
        off = F.when(F.col("user_id") == "v", v_off_by[0]).otherwise(1)
        wrong = result.sessions.withColumn("revenue", (F.col("revenue") + off).cast(
            SESSIONS.schema["revenue"].dataType))
        return dataclasses.replace(result, sessions=wrong, after=wrong)

    monkeypatch.setattr(corrections, "recompute", wrong_revenue)
    path = write_rows(stream_config, "p", [pv_row("a", "u", 0), pv_row("b", "v", 1)], "parquet")
    before = versions(stream_config, spark)
    with pytest.raises(QualityGateFailedError, match=(
            r"quality gate recomputed_sessions failed for backfill pageviews-client-00-\w+: 1 of"
            r" 10 expectations failed: quality gate recomputed_sessions: revenue_mismatch = 2, "
            r"expected 0 .*; 2 rows quarantined .*no correction was recorded")):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                     path=path, progress=lambda _: None)
    after = versions(stream_config, spark)
    unchanged(before, after, "sessions", "attributions", "corrections")
    assert read_compacted(stream_config, stream_config.sessions_topic) == {}
    assert len(quarantined(stream_config, spark, "recomputed_sessions")) == 2
    ((failed, page),) = run_summaries(stream_config)  # what was done, and what failed
    assert failed.status == "failed"
    assert "<th>merge</th><td>2 merged, 0 duplicates skipped" in page
    assert "<th>recompute and publish: failed</th><td>QualityGateFailedError: quality gate " \
        "recomputed_sessions failed" in page

    v_off_by[0] = 2  # (Q2) a rerun failing on one row stored already and one new row
    with pytest.raises(QualityGateFailedError, match=r"revenue_mismatch = 2, .*; 2 rows "):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                     path=path, progress=lambda _: None)
    rows = [json.loads(r["raw"]) for r in quarantined(stream_config, spark,
                                                       "recomputed_sessions")]
    assert sorted((r["user_id"], r["revenue"]) for r in rows) == [
        ("u", 1), ("v", 1), ("v", 2)]  # u's row once; before, v's second was never stored

    monkeypatch.setattr(corrections, "recompute", real_recompute)
    summary = run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                           path=path, progress=lambda _: None)
    assert summary.corrections.sessions_created == 2
    assert len(read_compacted(stream_config, stream_config.sessions_topic)) == 2
    ((succeeded, page),) = run_summaries(stream_config)  # the run's page, no longer red
    assert (succeeded.href, succeeded.status) == (failed.href, "info")
    assert "sessions created 2" in page and ": failed" not in page


def publishing_without_tombstones(stream_config: Config, spark: SparkSession,
                                  monkeypatch: pytest.MonkeyPatch) -> tuple[str, Callable]:
    """u's two sessions stored, and a publishing bug that drops tombstones; returns the batch
    that merges the two sessions (one retraction) and the real publisher, to restore."""
    run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                 progress=lambda _: None,
                 path=write_rows(stream_config, "p1", [pv_row("a", "u", 0), pv_row("c", "u", 50)],
                                 "parquet"))
    real_publish = kafka_changelog.publish_pairs

    def without_tombstones(config, topic, pairs):
        return real_publish(config, topic, pairs.where(F.col(pairs.columns[1]).isNotNull()))

    monkeypatch.setattr(kafka_changelog, "publish_pairs", without_tombstones)
    return write_rows(stream_config, "p2", [pv_row("b", "u", 25)], "parquet"), real_publish


def test_publish_gate_finds_a_missing_tombstone_and_a_rerun_republishes(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet = {"progress": lambda _: None, "spark": spark}
    merge, real_publish = publishing_without_tombstones(stream_config, spark, monkeypatch)
    with pytest.raises(QualityGateFailedError, match=(
            r"quality gate publish failed for backfill pageviews-client-00-\w+: 1 of 3 "
            r"expectations failed: quality gate publish: retractions_without_tombstone = 1, "
            r"expected 0 .*; 1 rows quarantined .*rerunning the run republishes")):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", path=merge, **quiet)
    (retraction,) = quarantined(stream_config, spark, "publish")
    assert json.loads(retraction["raw"])["change"] == "retracted"
    assert len(read_compacted(stream_config, stream_config.sessions_topic)) == 2  # stale view

    monkeypatch.setattr(kafka_changelog, "publish_pairs", real_publish)
    run_backfill(stream_config, kind="pageviews", client_id="client-00", path=merge, **quiet)
    (session,) = table_rows(stream_config, spark, "sessions")
    topic = read_compacted(stream_config, stream_config.sessions_topic)
    assert set(topic) == {session["session_id"]}
    assert topic[session["session_id"]]["revision"] == session["revision"] == 2


def test_a_full_recompute_does_not_supersede_a_plan_whose_publish_failed(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a plan the tables do not hold is superseded by --full (PlanNotAppliedError). A
    plan applied but failing its publish gate is rerun: superseded, its tombstone was lost,
    as the rewrite finds nothing left to retract."""
    quiet = {"progress": lambda _: None, "spark": spark}
    merge, real_publish = publishing_without_tombstones(stream_config, spark, monkeypatch)
    with pytest.raises(QualityGateFailedError, match="quality gate publish failed"):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", path=merge, **quiet)
    with pytest.raises(QualityGateFailedError, match="quality gate publish failed"):
        run_full_recompute(stream_config, client_id="client-00", **quiet)

    monkeypatch.setattr(kafka_changelog, "publish_pairs", real_publish)
    run_full_recompute(stream_config, client_id="client-00", **quiet)
    (session,) = table_rows(stream_config, spark, "sessions")
    topic = read_compacted(stream_config, stream_config.sessions_topic)
    assert set(topic) == {session["session_id"]}

    # The recompute finished the backfill's plan as the backfill: the backfill's red publish
    # gate is superseded in the index, and the recompute's own row shows no failure.
    runs: dict[tuple[str, str], list[ReportEntry]] = {}
    for entry in read_entries(reports_dir(stream_config)):
        if entry.kind == "validation":
            runs.setdefault((entry.job, entry.run_id), []).append(entry)
    statuses = {run: run_status(items, current_entries(items)) for run, items in runs.items()}
    assert sorted(job for job, _ in statuses) == ["backfill", "backfill", "full-recompute"]
    assert set(statuses.values()) == {"passed"}, statuses
    (merge_run,) = [items for (job, _), items in runs.items()
                    if job == "backfill" and any(e.status == "failed" for e in items)]
    assert [e.status for e in sorted(merge_run, key=lambda e: e.time)
            if e.title.startswith("publish")] == [
        "failed", "failed", "passed"]  # its own attempt, then the recompute's two
    (recompute_run,) = [items for (job, _), items in runs.items() if job == "full-recompute"]
    assert {e.status for e in recompute_run} == {"passed"}


def test_publish_gate_finds_an_older_revision_written_after_the_new_one(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of u's session at revision 1 (a replayed micro-batch, a run outside the
    lock) lands after the run's revision 2, in the range the gate reads back: the compacted
    view holds revision 1 and the table revision 2. The gate looked for (key, revision)
    anywhere in the range, found revision 2 and passed."""
    quiet = {"progress": lambda _: None, "spark": spark}
    run_backfill(stream_config, kind="pageviews", client_id="client-00", **quiet,
                 path=write_rows(stream_config, "p1", [pv_row("a", "u", 0)], "parquet"))
    ((key, first),) = read_compacted(stream_config, stream_config.sessions_topic).items()
    real_publish = kafka_changelog.publish_pairs

    def then_an_older_revision(config, topic, pairs):
        sent = real_publish(config, topic, pairs)
        if topic == config.sessions_topic:
            produce_records(config, topic, [(key, encode_json(first))])
        return sent

    monkeypatch.setattr(kafka_changelog, "publish_pairs", then_an_older_revision)
    merge = write_rows(stream_config, "p2", [pv_row("b", "u", 10)], "parquet")
    with pytest.raises(QualityGateFailedError, match=(
            r"quality gate publish failed for backfill pageviews-client-00-\w+: 1 of 3 "
            r"expectations failed: quality gate publish: sessions_missing_at_revision = 1")):
        run_backfill(stream_config, kind="pageviews", client_id="client-00", path=merge, **quiet)
    assert read_compacted(stream_config, stream_config.sessions_topic)[key]["revision"] == 1

    monkeypatch.setattr(kafka_changelog, "publish_pairs", real_publish)
    run_backfill(stream_config, kind="pageviews", client_id="client-00", path=merge, **quiet)
    (session,) = table_rows(stream_config, spark, "sessions")
    assert read_compacted(stream_config, stream_config.sessions_topic)[key]["revision"] == (
        session["revision"]) == 2


def test_good_batches_and_a_recompute_pass_every_gate(stream_config: Config,
                                                      spark: SparkSession) -> None:
    from clickstream.io.delta_tables import open_tables
    from clickstream.jobs.recompute import run_recompute
    from clickstream.tables import PAGEVIEWS, RECOMPUTE_QUEUE

    quiet = {"progress": lambda _: None, "spark": spark}
    run_backfill(stream_config, kind="pageviews", client_id="client-00", **quiet,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0), pv_row("b", "u", 10),
                                                  pv_row("c", "v", 60 * 26)], "parquet"))
    run_backfill(stream_config, kind="orders", client_id="client-00", **quiet,
                 path=write_rows(stream_config, "o", [order_row("o1", "u", 11, "12.50"),
                                                  order_row("o2", "v", 60 * 26, "4.00")],
                                 "jsonl"))
    # A late pageview the stream queued: the recompute folds it in (and extends u's session).
    tables = open_tables(stream_config, spark)
    late = START + timedelta(minutes=20)
    tables.append_once(PAGEVIEWS.name, spark.createDataFrame(
        [("late", "client-00", "u", late, "/late", "", "stream", late.date())],
        PAGEVIEWS.schema), app_id="test", version=1, partition_by=PAGEVIEWS.partition_by,
        metadata={"run_id": "test", "cause": "test"})
    tables.append_once(RECOMPUTE_QUEUE.name, spark.createDataFrame(
        [("client-00", "u", "pageview", "late", late, "test", late.date())],
        RECOMPUTE_QUEUE.schema), app_id="test", version=1,
        partition_by=RECOMPUTE_QUEUE.partition_by, metadata={"run_id": "test", "cause": "test"})
    summary = run_recompute(stream_config, **quiet)
    assert summary.corrections["client-00"].sessions_updated == 1

    entries = read_entries(reports_dir(stream_config))
    gates = {(e.job, e.title.split(" ")[0]) for e in entries if e.kind == "validation"}
    assert gates >= {("backfill", g) for g in ("historical_batch", "tables_after_merge",
                                                 "recomputed_sessions", "publish")}
    assert gates >= {("recompute", "recomputed_sessions"), ("recompute", "publish")}
    assert {e.status for e in entries if e.kind == "validation"} == {"passed"}
    reports = {(e.job, e.run_id): e for e in entries if e.kind == "corrections"}
    assert len(reports) == 3
    orders_report = next(e for (job, run), e in reports.items() if run.startswith("orders"))
    text = (reports_dir(stream_config) / orders_report.href).read_text()
    assert "<svg" in text and "+12.5000" in text and "+4.0000" in text
    assert str(date(2026, 11, 2)) in text
    assert "attributed to a session</td><td class=num>2" in text
    assert assert_every_link_resolves(reports_dir(stream_config)) > 0


def _without_session_totals(real):
    """A semantics bug: the Python worker reports no session total as changed (the
    attributions are still right)."""
    def broken(*args, **kwargs):
        emitted = real(*args, **kwargs)
        return emitted.where(F.col("kind") != "session")
    return broken


def test_recomputed_sessions_catches_totals_wrongly_reported_unchanged_in_orders_runs(
    stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Orders-only runs check the sessions their orders touch: one an order is attributed to
    now, and one that held an order before, even when the worker says neither changed."""
    real = corrections.reattribute_frames
    run_backfill(stream_config, kind="pageviews", client_id="client-00", spark=spark,
                 path=write_rows(stream_config, "p", [pv_row("a", "u", 0), pv_row("b", "u", 3),
                                                      pv_row("c", "v", 0)], "parquet"),
                 progress=lambda _: None)
    run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                 path=write_rows(stream_config, "o1", [order_row("o1", "u", 5)], "parquet"),
                 progress=lambda _: None)
    monkeypatch.setattr(corrections, "reattribute_frames", _without_session_totals(real))
    # o1 moves out of u's session (to no session); o2 lands in v's session.
    path = write_rows(stream_config, "o2", [order_row("o1", "u", 300), order_row("o2", "v", 1)],
                      "parquet")
    before = versions(stream_config, spark)
    with pytest.raises(QualityGateFailedError, match=(
            r"quality gate recomputed_sessions failed .*revenue_mismatch = 2.*"
            r"order_count_mismatch = 2")):
        run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                     path=path, progress=lambda _: None)
    unchanged(before, versions(stream_config, spark), "sessions", "attributions", "corrections")

    monkeypatch.setattr(corrections, "reattribute_frames", real)
    summary = run_backfill(stream_config, kind="orders", client_id="client-00", spark=spark,
                           path=path, progress=lambda _: None)
    assert summary.corrections.sessions_updated == 2


def test_a_rerun_failing_with_other_figures_quarantines_them_too(
    stream_config: Config, spark: SparkSession
) -> None:
    """A check with no offending rows stores its figures as the row: under a source without
    their digest, a rerun that failed with other figures (the tables changed meanwhile) was
    taken for the first attempt's row and stored nothing."""
    tables = open_tables(stream_config, spark)

    def failed_with(rows_after: int) -> int:
        values = {"rows_after": rows_after, "expected_rows_after": 2}
        outcome = gates.Outcome("tables_after_merge", "expect_column_pair_values_to_be_equal",
                                "rows_after", "critical", False, rows_after,
                                "expected_rows_after (2)", "rows reconcile")
        result = gates.GateResult("tables_after_merge", "backfill", "r1", "v1", values,
                                  (outcome,), 0.1)
        return gates.quarantine(tables, Checks(values), result, "client-00")

    assert failed_with(4) == 1 and failed_with(4) == 1  # the same figures: stored once
    assert failed_with(5) == 1
    stored = sorted(json.loads(r["raw"])["rows_after"]
                    for r in quarantined(stream_config, spark, "tables_after_merge"))
    assert stored == [4, 5]
