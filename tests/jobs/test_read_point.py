"""The read point (issue #3: "a reader never sees half a backfill"): readers at the read point
see a client's backfill whole or not at all, while every other client moves on."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable

import pytest
from pyspark.sql import SparkSession

from clickstream.cli import main
from clickstream.config import Config
from clickstream.errors import ClickstreamError
from clickstream.io import read_point
from clickstream.io.delta_tables import open_tables
from clickstream.jobs import backfill as backfill_module
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.inspect import describe_read_point
from clickstream.jobs.maintenance import vacuum_tables
from clickstream.tables import PAGEVIEWS
from tests.jobs.test_backfill import located, order_row, pv_row, write_rows

CLIENT, OTHER = "client-00", "client-01"


def consistent(config: Config, spark: SparkSession, name: str,
               clients: Iterable[str] | None = None,
               point: read_point.ReadPoint | None = None) -> list[dict]:
    point = point or read_point.current(config)
    assert point is not None
    frame = read_point.read_consistent(open_tables(config, spark), point, name, clients)
    return [row.asDict() for row in frame.collect()]


def latest(config: Config, spark: SparkSession, name: str, client: str) -> list[dict]:
    return [row.asDict() for row in open_tables(config, spark).read(
        name, partition_filter={"client_id": client}).collect()]


def ids(rows: list[dict], key: str) -> set[str]:
    return {row[key] for row in rows}


def assert_agree(config: Config, spark: SparkSession, client: str,
                 point: read_point.ReadPoint | None = None) -> None:
    """What the concurrent-reader review found broken between a backfill's commits: every
    pageview at the read point lies in one of its user's sessions there, and every
    attribution names a session that is there, with the session's order count."""
    sessions = consistent(config, spark, "sessions", [client], point)
    for pageview in consistent(config, spark, "pageviews", [client], point):
        assert any(s["user_id"] == pageview["user_id"]
                   and s["session_start"] <= pageview["ts"] <= s["session_end"]
                   for s in sessions), pageview
    attributed: dict[str, int] = {}
    live = ids(sessions, "session_id")
    for attribution in consistent(config, spark, "attributions", [client], point):
        if attribution["session_id"] is not None:
            assert attribution["session_id"] in live, attribution
            attributed[attribution["session_id"]] = attributed.get(
                attribution["session_id"], 0) + 1
    assert {s["session_id"]: s["order_count"] for s in sessions if s["order_count"]} \
        == attributed


def test_a_reader_of_the_read_point_never_sees_half_a_backfill(
        stream_config: Config, spark: SparkSession) -> None:
    """The DAG's merge and recompute are two tasks: between them the tables hold the merged
    pageviews in no session (and then sessions whose attributions are not written yet). The
    read point holds the client where it was, while another client's backfill is shown."""
    quiet = lambda _: None  # noqa: E731
    # Sessions 40 minutes apart (gap 30): each pageview its own session, an order in each.
    first = [pv_row(f"a{i}", f"u{i % 2}", i * 40) for i in range(6)]
    run_backfill(stream_config, kind="pageviews", client_id=CLIENT, spark=spark,
                 path=write_rows(stream_config, "p1", first, "parquet"), progress=quiet)
    run_backfill(stream_config, kind="orders", client_id=CLIENT, spark=spark, progress=quiet,
                 path=write_rows(stream_config, "o1", [order_row(f"o{i}", f"u{i % 2}", i * 40 + 1)
                                                       for i in range(6)], "parquet"))
    assert_agree(stream_config, spark, CLIENT)
    before = {name: consistent(stream_config, spark, name, [CLIENT])
              for name in ("pageviews", "sessions", "attributions")}

    # Pageviews between them: one session per user from now on, every order moves there.
    between = [pv_row(f"b{user}-{minute}", user, minute)
               for user in ("u0", "u1") for minute in range(10, 200, 20)]
    _, run_id, step = located(stream_config, spark, between, name="p2")
    step("check")
    step("merge")
    assert ids(between, "event_id") <= ids(latest(stream_config, spark, "pageviews", CLIENT),
                                           "event_id")  # committed, not shown
    point = read_point.current(stream_config)
    assert point is not None and CLIENT in point.held
    assert [g.group for g in read_point.open_groups(stream_config)] == [f"backfill-{run_id}"]
    for name, rows in before.items():
        assert consistent(stream_config, spark, name, [CLIENT]) == rows, name

    # Another client's backfill meanwhile is shown at once, client-00 still as it was.
    run_backfill(stream_config, kind="pageviews", client_id=OTHER, spark=spark, progress=quiet,
                 path=write_rows(stream_config, "q1", [pv_row("c0", "v", 5, client=OTHER)],
                                 "parquet"))
    everyone = consistent(stream_config, spark, "pageviews")
    assert ids(everyone, "event_id") == ids(before["pageviews"], "event_id") | {"c0"}
    assert consistent(stream_config, spark, "sessions", [CLIENT]) == before["sessions"]

    step("recompute")
    assert read_point.open_groups(stream_config) == []
    point = read_point.current(stream_config)
    assert point is not None and point.held == {}
    assert dict(point.versions) == {spec.name: open_tables(stream_config, spark).version(
        spec.name) for spec in read_point.READ_POINT_TABLES}
    assert len(consistent(stream_config, spark, "sessions", [CLIENT])) == 2
    assert_agree(stream_config, spark, CLIENT)
    assert ids(consistent(stream_config, spark, "pageviews", [OTHER]), "event_id") == {"c0"}


def test_between_any_two_commits_of_a_backfill_the_read_point_agrees(
        stream_config: Config, spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's backfill, checked before each of its commits (the tables' hook): the read
    point's tables agree every time, where the latest versions do not (merged pageviews in no
    session; sessions whose attributions are not written yet)."""
    quiet = lambda _: None  # noqa: E731
    run_backfill(stream_config, kind="pageviews", client_id=CLIENT, spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p1", [pv_row(f"a{i}", "u", i * 40)
                                                       for i in range(4)], "parquet"))
    run_backfill(stream_config, kind="orders", client_id=CLIENT, spark=spark, progress=quiet,
                 path=write_rows(stream_config, "o1", [order_row(f"o{i}", "u", i * 40 + 1)
                                                       for i in range(4)], "parquet"))
    checked: list[str] = []
    latest_disagreed: list[str] = []

    def check(table: str, attempt: int) -> None:
        assert_agree(stream_config, spark, CLIENT)  # raised: the commit fails, and the run
        checked.append(table)
        latest = read_point.ReadPoint(
            {spec.name: open_tables(stream_config, spark).version(spec.name)
             for spec in read_point.READ_POINT_TABLES}, {}, [], "now")
        try:
            assert_agree(stream_config, spark, CLIENT, latest)
        except AssertionError:
            latest_disagreed.append(table)

    monkeypatch.setattr(backfill_module, "open_tables", lambda config, spark: open_tables(
        config, spark, before_commit=check))
    run_backfill(stream_config, kind="pageviews", client_id=CLIENT, spark=spark, progress=quiet,
                 path=write_rows(stream_config, "p2", [pv_row(f"b{i}", "u", i * 40 + 20)
                                                       for i in range(3)], "parquet"))
    assert {"pageviews", "sessions", "attributions"} <= set(checked)
    assert {"sessions", "attributions"} <= set(latest_disagreed)  # before their commits
    assert_agree(stream_config, spark, CLIENT)
    assert len(consistent(stream_config, spark, "sessions", [CLIENT])) == 1


def test_an_abandoned_group_holds_its_client_until_released(
        stream_config: Config, spark: SparkSession, capsys: pytest.CaptureFixture[str]) -> None:
    """A backfill whose merge committed and that is never rerun keeps its client where it was,
    says so in ``read-point`` and ``inspect``, and keeps vacuum off the versions readers are
    sent to once it is older than the retention; ``--release`` shows what it committed."""
    _, run_id, step = located(stream_config, spark, [pv_row("a", "u", 0)], name="p")
    step("check")
    step("merge")
    group = f"backfill-{run_id}"
    assert consistent(stream_config, spark, "pageviews", [CLIENT]) == []

    assert main(["read-point", "--warehouse", str(stream_config.warehouse)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["read_point"]["held"][CLIENT]["pageviews"] == -1  # before the table existed
    assert shown["open_groups"] == [read_point.open_groups(stream_config)[0].describe()]
    assert group in shown["open_groups"][0] and CLIENT in shown["open_groups"][0]
    assert describe_read_point(stream_config)[1:] == [
        f"  client {CLIENT} read at pageviews -1, orders -1, other_events -1, sessions -1, "
        "attributions -1, corrections -1", f"  held by {shown['open_groups'][0]}"]

    # A week and a day later: vacuum leaves the read point's tables alone, and says why.
    marker = next((read_point.folder(stream_config) / read_point.GROUPS_FOLDER).glob("*.json"))
    opened = json.loads(marker.read_text())
    week_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=8)
    marker.write_text(json.dumps({**opened, "as_of": f"{week_ago:%Y-%m-%d %H:%M:%S} UTC"}))
    lines: list[str] = []
    vacuum_tables(stream_config, progress=lines.append)
    assert f"vacuum pageviews: skipped: readers of the read point are sent to versions of " \
           f"{week_ago:%Y-%m-%d %H:%M} UTC (open group {group}" in "\n".join(lines)
    assert not [line for line in lines if line.startswith("vacuum pageviews: ")
                and "skipped" not in line]

    # A failed run's handler asks what its group means: a marker it cannot read is said, not
    # raised over the run's own error.
    assert "until a rerun finishes it" in read_point.still_holding(stream_config, group)
    marker_text = marker.read_text()
    marker.write_text(marker_text[:20])
    assert "has a marker that cannot be read" in read_point.still_holding(stream_config, group)
    marker.write_text(marker_text)

    with pytest.raises(ClickstreamError, match="no open group 'backfill-nope' to release"):
        read_point.release(stream_config, open_tables(stream_config, spark), "backfill-nope")
    assert main(["read-point", "--release", group,
                 "--warehouse", str(stream_config.warehouse)]) == 0
    assert json.loads(capsys.readouterr().out)["open_groups"] == []
    assert describe_read_point(stream_config)[1:] == []
    assert ids(consistent(stream_config, spark, "pageviews", [CLIENT]), "event_id") == {"a"}


def test_a_group_of_every_client_stops_the_read_point_and_a_client_keeps_its_oldest(
        config: Config, spark: SparkSession) -> None:
    """The sessionizer's micro-batch holds every client; two groups of one client hold it at
    the older versions; a stale group of every client (a deleted checkpoint's) is closed."""
    tables = open_tables(config, spark)

    def append(event_id: str, client: str) -> None:
        tables.append_once(PAGEVIEWS.name, spark.createDataFrame([(
            event_id, client, "u", dt.datetime(2026, 11, 1), None, None, "test",
            dt.date(2026, 11, 1))], PAGEVIEWS.schema), app_id=event_id, version=1,
            partition_by=PAGEVIEWS.partition_by, metadata={"cause": "test"})

    def shown(client: str) -> set[str]:
        return ids(consistent(config, spark, "pageviews", [client]), "event_id")

    append("a0", CLIENT)
    read_point.publish(config, tables)
    assert read_point.open_group(config, tables, "first", CLIENT)
    append("a1", CLIENT)
    # Opened two days ago: a group opened while it holds the client holds it as long (vacuum).
    (marker,) = (read_point.folder(config) / read_point.GROUPS_FOLDER).glob("*.json")
    two_days_ago = f"{dt.datetime.now(dt.UTC) - dt.timedelta(days=2):%Y-%m-%d %H:%M:%S} UTC"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "as_of": two_days_ago}))
    read_point.publish(config, tables)
    assert read_point.open_group(config, tables, "second", CLIENT)
    append("a2", CLIENT)
    read_point.close_group(config, tables, "first")
    assert shown(CLIENT) == {"a0"}  # "second" holds it where "first" did
    assert read_point.oldest_read(config)[0].strftime("%Y-%m-%d %H:%M:%S UTC") == two_days_ago
    # A rerun of an open group keeps its versions, and says it opened nothing.
    assert not read_point.open_group(config, tables, "second", CLIENT)
    assert shown(CLIENT) == {"a0"}

    read_point.open_group(config, tables, "stream", read_point.EVERY_CLIENT)
    append("b0", OTHER)
    read_point.close_group(config, tables, "second")  # closed while the micro-batch is open
    assert shown(CLIENT) == {"a0"} and shown(OTHER) == set()
    assert read_point.oldest_read(config)[1].startswith(f"client {CLIENT}, held by a group")
    read_point.close_group(config, tables, "stream")
    assert shown(CLIENT) == {"a0", "a1", "a2"} and shown(OTHER) == {"b0"}
    assert read_point.oldest_read(config)[1].startswith("the read point itself")

    read_point.open_group(config, tables, "sessionize-deleted", read_point.EVERY_CLIENT)
    append("b1", OTHER)
    read_point.publish(config, tables)
    assert shown(OTHER) == {"b0"}
    assert read_point.close_stale_stream_groups(config, tables, keep="sessionize-new") == [
        "sessionize-deleted"]
    assert shown(OTHER) == {"b0", "b1"}
    with pytest.raises(ClickstreamError, match="covers pageviews, orders"):
        read_point.read_consistent(tables, read_point.current(config), "quarantine")


def test_a_backfill_failing_after_its_merge_says_readers_see_its_client_as_it_was(
        stream_config: Config, spark: SparkSession) -> None:
    """A run stopped between its merge and its correction leaves its group open: its failure
    says what that means to readers and how it ends; its rerun ends it."""
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        if line == "  recompute and publish ...":
            raise RuntimeError("stopped between the merge and the correction")

    path = write_rows(stream_config, "p", [pv_row("a", "u", 0)], "parquet")
    with pytest.raises(RuntimeError, match="stopped between"):
        run_backfill(stream_config, kind="pageviews", client_id=CLIENT, path=path, spark=spark,
                     progress=progress)
    (group,) = [g.group for g in read_point.open_groups(stream_config)]
    assert lines[-1] == (
        f"  readers of the read point see client {CLIENT} as it was before {group} until a "
        f"rerun finishes it (or `clickstream read-point --release {group}`, which shows what "
        "it committed as it is)")
    assert consistent(stream_config, spark, "pageviews", [CLIENT]) == []

    run_backfill(stream_config, kind="pageviews", client_id=CLIENT, path=path, spark=spark,
                 progress=lambda _: None)
    assert read_point.open_groups(stream_config) == []
    assert ids(consistent(stream_config, spark, "pageviews", [CLIENT]), "event_id") == {"a"}
    assert_agree(stream_config, spark, CLIENT)
