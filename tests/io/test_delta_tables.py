"""The Delta table layer against real tables in tmp folders and the real SparkSession."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import CommitProperties, DeltaTable, Field, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from clickstream.config import Config
from clickstream.errors import (
    NOT_RETRYABLE,
    ClickstreamError,
    CommitConflictError,
    ConfigError,
    TableRefusedError,
    VersionVacuumedError,
)
from clickstream.events.contract import CLIENT_ID_MAX_BYTES
from clickstream.io.delta_rs_engine import DeltaRsTables, _ActiveFile, _removes
from clickstream.io.delta_spark_engine import delta_jars_loadable
from clickstream.io.delta_tables import (
    TABLE_MISSING,
    AppendResult,
    DeleteResult,
    DeltaTables,
    UpsertResult,
    check_partition_predicate,
    filter_to_sql,
    open_tables,
    predicate_columns,
)
from clickstream.quality.checks import run_commit_version
from clickstream.tables import ORDERS, PAGEVIEWS

META = {"run_id": "run-1", "cause": "test"}
PARTS = list(ORDERS.partition_by)
D1, D2, D3 = dt.date(2024, 3, 1), dt.date(2024, 3, 2), dt.date(2024, 3, 3)


def orders(spark: SparkSession, *rows: tuple) -> DataFrame:
    """Rows ``(order_id, client_id, day, amount[, micros])`` in the ``orders`` contract."""
    out = []
    for order_id, client_id, day, amount, *micros in rows:
        ts = dt.datetime.combine(day, dt.time(12, 30, 15, micros[0] if micros else 0), dt.UTC)
        out.append((order_id, client_id, "u1", ts, Decimal(amount), "EUR", None, "test", day))
    return spark.createDataFrame(out, ORDERS.schema)


def files_of(tables: DeltaTables, name: str, client_id: str) -> set[str]:
    """Active files of one client's partitions, per the log."""
    path = tables.table_path(name)
    return {
        os.path.relpath(uri, path)
        for uri in DeltaTable(path).file_uris(file_pruning_predicate=f"client_id = '{client_id}'")
    }


def parquet_on_disk(tables: DeltaTables, name: str) -> set[str]:
    root = Path(tables.table_path(name))
    return {str(p.relative_to(root)) for p in root.rglob("*.parquet")}


def ids(df: DataFrame) -> list[str]:
    return sorted(row.order_id for row in df.select("order_id").collect())


@pytest.fixture
def tables(config: Config, spark: SparkSession) -> DeltaTables:
    return open_tables(config, spark, backoff_seconds=0.01)


def test_append_once_commits_each_app_version_exactly_once(tables, spark):
    batch = orders(spark, ("o1", "c1", D1, "1.50"), ("o2", "c2", D1, "2.00"))

    first = tables.append_once("orders", batch, app_id="ingest", version=1, partition_by=PARTS,
                               metadata=META)
    assert first and first.rows == 2  # counted from the written files' statistics
    after_first = tables.version("orders")
    replay = tables.append_once("orders", batch, app_id="ingest", version=1,
                                partition_by=PARTS, metadata=META)
    assert not replay and replay.rows == 0
    assert not tables.append_once("orders", batch, app_id="ingest", version=0,
                                  partition_by=PARTS, metadata=META)
    assert tables.version("orders") == after_first  # a replay commits nothing
    assert tables.read("orders").count() == 2

    assert tables.append_once("orders", orders(spark, ("o3", "c1", D2, "3")), app_id="ingest",
                              version=2, partition_by=PARTS, metadata=META)
    assert tables.append_once("orders", orders(spark, ("o4", "c1", D2, "4")), app_id="backfill",
                              version=1, partition_by=PARTS, metadata=META)
    assert tables.version("orders") == after_first + 2
    assert tables.app_version("orders", "ingest") == 2
    assert tables.app_version("orders", "backfill") == 1
    assert tables.app_version("orders", "never") is None
    assert ids(tables.read("orders")) == ["o1", "o2", "o3", "o4"]


def test_spark_and_deltalake_read_the_same_rows_and_time_travel(tables, spark):
    first = orders(spark, ("o1", "c1", D1, "1.2345", 123456), ("o2", "c2", D2, "99999.5", 1))
    tables.append_once("orders", first, app_id="a", version=1, partition_by=PARTS, metadata=META)
    v1 = tables.version("orders")
    tables.append_once("orders", orders(spark, ("o3", "c1", D3, "3")), app_id="a", version=2,
                       partition_by=PARTS, metadata=META)

    by_spark = tables.read("orders").toArrow().sort_by("order_id")
    by_deltalake = DeltaTable(tables.table_path("orders")).to_pyarrow_table().sort_by("order_id")
    assert by_spark.num_rows == by_deltalake.num_rows == 3
    assert by_spark.to_pylist() == by_deltalake.select(by_spark.column_names).to_pylist()
    assert by_deltalake.column("ts")[0].as_py() == dt.datetime(2024, 3, 1, 12, 30, 15, 123456,
                                                                 dt.UTC)
    assert str(by_deltalake.schema.field("ts").type) == "timestamp[us, tz=UTC]"

    assert DeltaTable(tables.table_path("orders"), version=v1).to_pyarrow_table().num_rows == 2
    assert ids(tables.read("orders", version=v1)) == ["o1", "o2"]
    assert ids(tables.read("orders", partition_filter={"client_id": "c1"})) == ["o1", "o3"]
    assert tables.read("orders", columns=["amount", "order_id"]).columns == ["amount", "order_id"]
    assert tables.read_arrow("orders", {"event_date": [D1, D3]}).num_rows == 2


def test_file_statistics_prune_exactly(tables, spark):
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1", 5), ("o2", "c1", D1, "2", 9)),
                       app_id="a", version=1, partition_by=PARTS, metadata=META)
    table = DeltaTable(tables.table_path("orders"))
    stats = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert stats[0]["num_records"] == 2
    assert stats[0]["null_count.event_id"] == 2
    assert stats[0]["min.order_id"] == "o1" and stats[0]["max.order_id"] == "o2"
    # Exact microsecond minimum: the file is skipped 1 µs below it and kept at it.
    assert table.file_uris(file_pruning_predicate="ts < '2024-03-01T12:30:15.000005Z'") == []
    assert len(table.file_uris(file_pruning_predicate="ts <= '2024-03-01T12:30:15.000005Z'")) == 1
    # delta-rs widens maxima by 1 ms (other writers truncate them), so test past that.
    assert table.file_uris(file_pruning_predicate="ts > '2024-03-01T12:30:15.002Z'") == []


def test_rows_spread_over_partitions_are_written_in_whole_row_groups(tables, spark, spark_conf):
    """Spark hands the writer small Arrow batches interleaving every partition; each
    partition's rows still land in one file with one row group (edge case 13)."""
    rows = [(f"o{i}", f"c{i % 2}", (D1, D2, D3)[i % 3], "1") for i in range(1200)]
    spark_conf("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    tables.append_once("orders", orders(spark, *rows), app_id="a", version=1,
                       partition_by=PARTS, metadata=META)

    root = Path(tables.table_path("orders"))
    files = files_of(tables, "orders", "c0") | files_of(tables, "orders", "c1")
    assert len(files) == 6  # one per (client, day)
    layout = [pq.ParquetFile(root / f).metadata for f in files]
    assert [m.num_row_groups for m in layout] == [1] * 6
    assert sum(m.num_rows for m in layout) == 1200
    assert tables.read("orders").count() == 1200


def test_empty_batch_records_the_step_so_a_replay_is_skipped(tables, spark):
    empty = spark.createDataFrame([], ORDERS.schema)

    result = tables.append_once("orders", empty, app_id="a", version=7, partition_by=PARTS,
                                metadata=META)
    assert result and result.rows == 0
    version = tables.version("orders")
    assert tables.app_version("orders", "a") == 7
    assert not tables.append_once("orders", empty, app_id="a", version=7, partition_by=PARTS,
                                  metadata=META)
    assert tables.version("orders") == version
    assert tables.read("orders").count() == 0


def test_upsert_inserts_then_updates_without_touching_other_clients(tables, spark):
    tables.append_once(
        "orders",
        orders(spark, ("o1", "c1", D1, "1"), ("o9", "c2", D1, "9"), ("o8", "c2", D2, "8")),
        app_id="stream", version=1, partition_by=PARTS, metadata=META,
    )
    other_client = files_of(tables, "orders", "c2")

    first = tables.upsert("orders", orders(spark, ("o2", "c1", D2, "2")), keys=["client_id",
                          "order_id"], app_id="backfill", version=1, metadata=META)
    # o1 moves to another day (its ts changed): it is updated, not duplicated.
    second = tables.upsert("orders", orders(spark, ("o1", "c1", D3, "10"), ("o3", "c1", D1, "3")),
                           keys=["client_id", "order_id"], app_id="backfill", version=2,
                           metadata=META)

    assert first == UpsertResult(inserted=1, updated=0)
    assert second == UpsertResult(inserted=1, updated=1)
    rows = {r.order_id: r for r in tables.read("orders").collect()}
    assert sorted(rows) == ["o1", "o2", "o3", "o8", "o9"]
    assert (rows["o1"].amount, rows["o1"].event_date) == (Decimal("10.0000"), D3)
    assert files_of(tables, "orders", "c2") == other_client  # not one file rewritten

    version = tables.version("orders")
    replay = tables.upsert("orders", orders(spark, ("o1", "c1", D3, "99")), keys=["client_id",
                           "order_id"], app_id="backfill", version=2, metadata=META)
    assert replay == UpsertResult(0, 0, committed=False)
    assert tables.version("orders") == version


def test_upsert_refuses_duplicate_keys_and_commits_nothing(tables, spark):
    batch = orders(spark, ("o1", "c1", D1, "1"), ("o1", "c1", D2, "2"))
    with pytest.raises(ClickstreamError, match=r"1 key\(s\) occur more than once.*'o1'"):
        tables.upsert("orders", batch, keys=["client_id", "order_id"], partition_by=PARTS,
                      app_id="b", version=1, metadata=META)
    assert tables.app_version("orders", "b") is None


def test_replace_partitions_swaps_only_the_range_in_one_commit(tables, spark):
    tables.append_once(
        "orders",
        orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D2, "2"), ("o3", "c1", D3, "3"),
               ("o4", "c2", D1, "4")),
        app_id="stream", version=1, partition_by=PARTS, metadata=META,
    )
    other_client = files_of(tables, "orders", "c2")
    before = tables.version("orders")

    replaced = tables.replace_partitions(
        "orders", orders(spark, ("o1", "c1", D1, "11"), ("o5", "c1", D2, "5")),
        predicate={"client_id": "c1", "event_date": [D1, D2]},
        app_id="recompute", version=1, metadata={**META, "cause": "late batch"},
    )

    assert replaced
    assert tables.version("orders") == before + 1  # one atomic commit
    assert ids(tables.read("orders")) == ["o1", "o3", "o4", "o5"]  # o2 gone, o3 kept
    assert files_of(tables, "orders", "c2") == other_client
    # The folder still holds the replaced files: only the log knows which rows are live.
    folder = spark.read.parquet(tables.table_path("orders"))
    assert folder.count() == 6 and tables.read("orders").count() == 4
    assert not tables.replace_partitions(
        "orders", orders(spark, ("o1", "c1", D1, "11")), predicate={"client_id": "c1"},
        app_id="recompute", version=1, metadata=META,
    )
    assert tables.version("orders") == before + 1


def test_replace_partitions_with_sql_predicate_and_empty_df_deletes_the_range(tables, spark):
    tables.append_once(
        "orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D3, "2")),
        app_id="stream", version=1, partition_by=PARTS, metadata=META,
    )
    late = "client_id = 'c1' AND event_date >= '2024-03-02'"
    with pytest.raises(ClickstreamError, match=r"outside the range.*'event_date': '2024-03-01'"):
        tables.replace_partitions("orders", orders(spark, ("o3", "c1", D1, "3")), predicate=late,
                                  app_id="recompute", version=1, metadata=META)
    tables.replace_partitions("orders", orders(spark, ("o4", "c1", D2, "4")), predicate=late,
                              app_id="recompute", version=1, metadata=META)
    assert ids(tables.read("orders")) == ["o1", "o4"]
    tables.replace_partitions("orders", spark.createDataFrame([], ORDERS.schema), predicate=late,
                              app_id="recompute", version=2, metadata=META)
    assert ids(tables.read("orders")) == ["o1"]


def test_a_sql_predicate_replaces_the_partitions_of_a_client_id_with_a_backslash(tables, spark):
    """The range is judged in one SQL dialect: delta-rs's own reads Spark's ``'a\\\\b'``
    as two backslashes, so the deltalake engine removed the files of the client ``a\\\\b``
    and kept ``a\\b``'s old rows beside its new ones."""
    one, two = "a\\b", "a\\\\b"  # a\b and a\\b: both valid client ids
    tables.append_once("orders", orders(spark, ("old", one, D1, "1"), ("other", two, D1, "2")),
                       app_id="stream", version=1, partition_by=PARTS, metadata=META)
    predicate = filter_to_sql({"client_id": one, "event_date": D1},
                              {"client_id": "string", "event_date": "date"})
    assert tables.replace_partitions("orders", orders(spark, ("new", one, D1, "3")),
                                     predicate=predicate, app_id="r", version=1, metadata=META)
    stored = {(row.order_id, row.client_id)
              for row in tables.read("orders").select("order_id", "client_id").collect()}
    assert stored == {("new", one), ("other", two)}


def test_replace_partitions_refuses_rows_outside_the_range(tables, spark):
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="s", version=1,
                       partition_by=PARTS, metadata=META)
    before, on_disk = tables.version("orders"), parquet_on_disk(tables, "orders")

    with pytest.raises(ClickstreamError, match=r"1 partition\(s\) of the new rows lie outside"):
        tables.replace_partitions(
            "orders", orders(spark, ("o2", "c1", D1, "2"), ("o3", "c2", D1, "3")),
            predicate={"client_id": "c1"}, app_id="r", version=1, metadata=META,
        )
    with pytest.raises(ConfigError, match="amount, which are not partition columns"):
        tables.replace_partitions("orders", orders(spark), predicate="amount > 1", app_id="r",
                                  version=1, metadata=META)
    assert tables.version("orders") == before
    assert parquet_on_disk(tables, "orders") == on_disk  # the refused files are gone


def test_history_carries_commit_metadata_and_app_transaction(tables, spark):
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="stream",
                       version=41, partition_by=PARTS, metadata={"run_id": "r-7", "cause": "batch"})
    latest = tables.history("orders", limit=1)[0]
    assert latest["operation"] == "WRITE"
    assert (latest["run_id"], latest["cause"]) == ("r-7", "batch")
    assert (latest["app_id"], latest["app_version"]) == ("stream", 41)
    assert DeltaTable(tables.table_path("orders")).transaction_version("stream") == 41


def test_history_flattens_the_metadata_delta_spark_keeps_in_user_metadata(config, tmp_path):
    """delta-spark's commits carry our metadata as one JSON string (``userMetadata``): read
    through this engine (the DAG's announcing tasks), a commit looked up by its app id was
    never found, and announce_merge counted no rows queued ahead of the stream."""
    from clickstream.io.delta_rs_engine import DeltaRsTables

    path = config.table_path("recompute_queue")
    write_deltalake(str(path), pa.table({"x": [1]}))  # as delta-spark records it:
    DeltaTable(str(path)).create_write_transaction(
        [], mode="append", schema=DeltaTable(str(path)).schema(),
        commit_properties=CommitProperties(custom_metadata={
            "userMetadata": '{"app_id": "backfill-ahead-r1", "app_version": 1}'}))
    latest = DeltaRsTables(config).history("recompute_queue", limit=1)[0]
    assert (latest["app_id"], latest["app_version"]) == ("backfill-ahead-r1", 1)


def test_concurrent_commit_between_write_and_commit_is_retried(config, spark):
    other = open_tables(config, spark)
    attempts: list[int] = []

    def concurrent_writer(table: str, attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:  # another job commits after our files are written, before our commit
            other.append_once(table, orders(spark, ("x1", "c2", D1, "1")), app_id="other",
                              version=1, partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, backoff_seconds=0.01, before_commit=concurrent_writer)
    other.append_once("orders", orders(spark, ("o0", "c1", D1, "1")), app_id="seed", version=1,
                      partition_by=PARTS, metadata=META)

    assert tables.append_once("orders", orders(spark, ("o1", "c1", D2, "1")), app_id="mine",
                              version=1, partition_by=PARTS, metadata=META)
    assert attempts == [1, 2]
    assert ids(tables.read("orders")) == ["o0", "o1", "x1"]
    ops = [(h.get("app_id"), h["version"]) for h in tables.history("orders", limit=2)]
    assert [app for app, _ in ops] == ["mine", "other"]


def test_replayed_step_racing_its_original_writes_nothing(config, spark):
    original = open_tables(config, spark)
    attempts: list[int] = []

    def original_commits_first(table: str, attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:
            original.append_once(table, orders(spark, ("o1", "c1", D1, "1")), app_id="stream",
                                 version=5, partition_by=PARTS, metadata=META)

    replay = DeltaRsTables(config, spark, backoff_seconds=0.01,
                           before_commit=original_commits_first)
    original.append_once("orders", orders(spark), app_id="seed", version=1, partition_by=PARTS,
                         metadata=META)

    assert not replay.append_once("orders", orders(spark, ("o1", "c1", D1, "1")),
                                  app_id="stream", version=5, partition_by=PARTS, metadata=META)
    assert attempts == [1, 2]  # lost the race, then saw the step committed
    assert ids(replay.read("orders")) == ["o1"]
    assert len(parquet_on_disk(replay, "orders")) == 1  # the loser's file was deleted


def land_then_raise_once(monkeypatch: pytest.MonkeyPatch, error: Exception,
                         before_raising: Callable[[], object] = lambda: None) -> list[int]:
    """Fault injection at one call: the first ``DeltaTable.create_write_transaction`` commits
    for real, runs ``before_raising``, then raises ``error``. Returns the version each call
    started from."""
    real = DeltaTable.create_write_transaction
    calls: list[int] = []

    def lands_then_raises(self: DeltaTable, *args, **kwargs) -> None:
        calls.append(self.version())
        real(self, *args, **kwargs)
        if len(calls) == 1:
            before_raising()
            raise error

    monkeypatch.setattr(DeltaTable, "create_write_transaction", lands_then_raises)
    return calls


@pytest.mark.parametrize("error", [
    DeltaError("post-commit hook failed: could not write the checkpoint"),
    CommitFailedError("the commit's acknowledgement was lost: version 2 already exists"),
], ids=["post-commit-error", "lost-acknowledgement"])
def test_a_commit_that_landed_while_its_call_raised_keeps_its_files_after_a_compaction(
        config, spark, monkeypatch, error):
    """An ambiguous commit's cleanup must not delete files a version names (edge case 17).

    Fault injection at one call: ``DeltaTable.create_write_transaction`` runs for real (the
    append lands as version 2), then a real compaction commits version 3, removing the file,
    and the call raises ``error`` as a failing post-commit hook (DeltaError, raised at once)
    or a lost acknowledgement (CommitFailedError: the retry finds the step done) would. A real
    crash cannot be timed between the two. The cleanup used to ask whether the file was still
    active in the latest version and deleted it: version 2 then named a missing file.
    """
    tables = DeltaRsTables(config, spark, backoff_seconds=0.01)
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="seed",
                       version=1, partition_by=PARTS, metadata=META)
    compactor = DeltaRsTables(config)
    land_then_raise_once(monkeypatch, error, lambda: compactor.optimize("orders"))
    try:
        result = tables.append_once("orders", orders(spark, ("o2", "c1", D1, "1")),
                                    app_id="mine", version=1, partition_by=PARTS, metadata=META)
    except ClickstreamError as exc:  # the post-commit error is passed on
        assert isinstance(error, DeltaError) and not isinstance(error, CommitFailedError), exc
        assert "unless the error came after the commit" in str(exc)  # not "nothing landed"
    else:  # the retry found the step done by its own commit: this call committed
        assert isinstance(error, CommitFailedError)
        assert result == AppendResult(committed=True, rows=1)

    path = tables.table_path("orders")
    assert [h["operation"] for h in tables.history("orders", limit=2)] == ["OPTIMIZE", "WRITE"]
    assert tables.app_version("orders", "mine") == 1
    named = [uri.removeprefix("file://") for uri in DeltaTable(path, version=2).file_uris()]
    assert [f for f in named if not os.path.exists(f)] == []  # time travel to version 2 works
    assert sorted(tables.read_arrow("orders", version=2).column("order_id").to_pylist()) == [
        "o1", "o2"]
    assert ids(tables.read("orders")) == ["o1", "o2"]


@pytest.mark.parametrize("step", ["upsert", "replace_partitions", "empty append",
                                  "step record", "delete emptying its file"])
def test_a_call_whose_acknowledgement_was_lost_reports_its_commit(config, spark, monkeypatch,
                                                                   step):
    """The first commit lands and its call raises CommitFailedError; the retry finds the step
    done by its own commit and reports what it wrote, not "already done" (which made a
    correction's plan look recorded by another run). A commit adding no file (an empty
    micro-batch or plan, a delete emptying every file it rewrites) was told by its files, and
    still read as another run's. Fault injection as above."""
    tables = DeltaRsTables(config, spark, backoff_seconds=0.01)
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="seed",
                       version=1, partition_by=PARTS, metadata=META)
    calls = land_then_raise_once(monkeypatch,
                                 CommitFailedError("the commit's acknowledgement was lost"))
    before = tables.version("orders")
    rows = orders(spark, ("o1", "c1", D1, "5"), ("o2", "c1", D1, "2"))
    keys = ["client_id", "order_id"]
    steps: dict[str, tuple[Callable[[], object], object, list[tuple[str, str]]]] = {
        "upsert": (lambda: tables.upsert("orders", rows, keys=keys, app_id="mine", version=1,
                                         metadata=META),
                   UpsertResult(inserted=1, updated=1, committed=True),
                   [("o1", "5.0000"), ("o2", "2.0000")]),
        "replace_partitions": (lambda: tables.replace_partitions(
            "orders", rows, predicate={"client_id": "c1"}, app_id="mine", version=1,
            metadata=META), True, [("o1", "5.0000"), ("o2", "2.0000")]),
        "empty append": (lambda: tables.append_once(
            "orders", orders(spark), app_id="mine", version=1, partition_by=PARTS,
            metadata=META), AppendResult(committed=True, rows=0), [("o1", "1.0000")]),
        "step record": (lambda: tables.upsert("orders", orders(spark), keys=keys,
                                              app_id="mine", version=1, metadata=META),
                        UpsertResult(0, 0), [("o1", "1.0000")]),
        "delete emptying its file": (lambda: tables.delete_rows(
            "orders", orders(spark, ("o1", "c1", D1, "0")).select(*keys), keys=keys,
            partition_filter={"client_id": "c1"}, app_id="mine", version=1, metadata=META),
            DeleteResult(1, True), []),
    }
    call, reported, stored = steps[step]
    assert call() == reported
    assert calls == [before]  # one commit: the retry saw the step done, wrote nothing
    assert tables.version("orders") == before + 1
    assert [h.get("app_id") for h in tables.history("orders", limit=1)] == ["mine"]
    assert sorted((r.order_id, r.amount) for r in tables.read("orders").collect()) == [
        (order_id, Decimal(amount)) for order_id, amount in stored]


@pytest.mark.parametrize("refusal", ["a writer feature", "append-only"])
def test_a_commit_delta_refuses_for_good_is_not_retried_as_a_conflict(config, spark, refusal):
    """(Edge case 20) deltalake raises CommitFailedError for a refusal too: it was tried six
    times, rewriting the files each time, and reported "still conflicted" (retried by
    Airflow). The table did not move between the attempts: refused at once, with the reason."""
    tables = DeltaRsTables(config, spark, backoff_seconds=0.01)
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="seed",
                       version=1, partition_by=PARTS, metadata=META)
    path = tables.table_path("orders")
    if refusal == "append-only":
        DeltaTable(path).alter.set_table_properties({"delta.appendOnly": "true"})
        write = functools.partial(tables.upsert, "orders", orders(spark, ("o1", "c1", D1, "2")),
                                  keys=["client_id", "order_id"])
        reason = "append-only"
    else:  # as delta-spark upgrades a table on the cluster profile (liquid clustering)
        version = DeltaTable(path).version() + 1
        (Path(path) / "_delta_log" / f"{version:020d}.json").write_text(json.dumps({
            "protocol": {"minReaderVersion": 3, "minWriterVersion": 7,
                         "readerFeatures": ["v2Checkpoint"],
                         "writerFeatures": ["v2Checkpoint", "clustering", "domainMetadata"]}}
        ) + "\n")
        write = functools.partial(tables.append_once, "orders",
                                  orders(spark, ("o2", "c1", D1, "2")), partition_by=PARTS)
        reason = "Unsupported table features"
    before = tables.version("orders")
    with pytest.raises(TableRefusedError, match=rf"on table 'orders' was refused: .*{reason}"):
        write(app_id="mine", version=1, metadata=META)
    assert TableRefusedError in NOT_RETRYABLE  # Airflow does not retry the step
    assert tables.version("orders") == before
    assert len(parquet_on_disk(tables, "orders")) == 1  # its files deleted, not six sets


@pytest.mark.parametrize("reader", ["read", "read_arrow", "row_count", "head_arrow",
                                    "largest_by_partition", "upsert"])
def test_a_table_with_deletion_vectors_is_refused_by_every_reader(config, spark, reader):
    """(Edge case 9) A file-list read cannot apply deletion vectors (delta-spark writes them on
    the cluster profile): each reader refuses, naming the engine that reads them. Statistics
    maxima counted deleted rows, and ``read_arrow`` raised deltalake's own error."""
    tables = DeltaRsTables(config, spark, backoff_seconds=0.01)
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="seed",
                       version=1, partition_by=PARTS, metadata=META)
    path = Path(tables.table_path("orders"))
    version = DeltaTable(str(path)).version() + 1
    (path / "_delta_log" / f"{version:020d}.json").write_text(json.dumps({"protocol": {
        "minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors"]}}) + "\n")
    calls = {
        "read": lambda: tables.read("orders"),
        "read_arrow": lambda: tables.read_arrow("orders"),
        "row_count": lambda: tables.row_count("orders"),
        "head_arrow": lambda: tables.head_arrow("orders", 1),
        "largest_by_partition": lambda: tables.largest_by_partition(
            "orders", "ts", "client_id"),
        "upsert": lambda: tables.upsert("orders", orders(spark, ("o1", "c1", D1, "2")),
                                        keys=["client_id", "order_id"], app_id="mine",
                                        version=1, metadata=META),
    }
    with pytest.raises(ClickstreamError, match=r"table 'orders' uses deletion vectors or column "
                       r"mapping, .* CLICKSTREAM_DELTA_ENGINE=delta-spark"):
        calls[reader]()


def test_conflicts_on_every_attempt_raise_and_commit_nothing(config, spark):
    other = open_tables(config, spark)

    def always_conflict(table: str, attempt: int) -> None:
        other.append_once(table, orders(spark), app_id="other", version=attempt,
                          partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, max_commit_attempts=2, backoff_seconds=0.01,
                           before_commit=always_conflict)
    other.append_once("orders", orders(spark), app_id="seed", version=1, partition_by=PARTS,
                      metadata=META)

    with pytest.raises(CommitConflictError, match=r"append on table 'orders' still conflicted "
                       r"after 2 commit attempts; nothing was committed"):
        tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="mine",
                           version=1, partition_by=PARTS, metadata=META)
    assert tables.app_version("orders", "mine") is None
    assert parquet_on_disk(tables, "orders") == set()


def test_replace_refuses_when_a_concurrent_commit_changed_the_range(config, spark):
    other = open_tables(config, spark)

    def late_append_into_range(table: str, attempt: int) -> None:
        if attempt == 1:
            other.append_once(table, orders(spark, ("late", "c1", D1, "1")), app_id="stream",
                              version=2, partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, backoff_seconds=0.01,
                           before_commit=late_append_into_range)
    other.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="stream",
                      version=1, partition_by=PARTS, metadata=META)

    with pytest.raises(CommitConflictError, match="Recompute the range"):
        tables.replace_partitions("orders", orders(spark, ("o2", "c1", D1, "2")),
                                  predicate={"client_id": "c1"}, app_id="recompute", version=1,
                                  metadata=META)
    assert ids(tables.read("orders")) == ["late", "o1"]
    assert tables.app_version("orders", "recompute") is None


@pytest.mark.parametrize("read", ["at an older version", "before the table existed"])
def test_replace_computed_from_an_older_read_is_refused_only_if_its_range_changed(
        tables, spark, read):
    """``read_version``: the rows were computed from that version (``TABLE_MISSING``: from no
    table, which another writer created since, the stream's first session beside a first
    backfill); a commit into the range since then refuses the replace, a commit elsewhere does
    not."""
    stored, read_at = [], TABLE_MISSING
    if read == "at an older version":
        stored = ["o1", "o2"]
        tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D2, "1")),
                           app_id="stream", version=1, partition_by=PARTS, metadata=META)
        read_at = tables.version("orders")
    tables.append_once("orders", orders(spark, ("late", "c1", D1, "1")), app_id="stream",
                       version=2, partition_by=PARTS, metadata=META)

    with pytest.raises(CommitConflictError, match="Recompute the range"):
        tables.replace_partitions("orders", orders(spark, ("o1b", "c1", D1, "2")),
                                  predicate={"client_id": "c1", "event_date": [D1]},
                                  app_id="recompute", version=1, metadata=META,
                                  read_version=read_at)
    assert ids(tables.read("orders")) == sorted(["late", *stored])
    assert tables.app_version("orders", "recompute") is None

    assert tables.replace_partitions("orders", orders(spark, ("o2b", "c1", D2, "2")),
                                     predicate={"client_id": "c1", "event_date": [D2]},
                                     app_id="recompute", version=1, metadata=META,
                                     read_version=read_at)
    assert ids(tables.read("orders")) == sorted(["late", "o2b", *set(stored) - {"o2"}])


def test_a_product_table_is_created_with_the_contracts_not_null_columns(tables, spark):
    """A frame's nullability is how it was computed (parsed JSON: nullable everywhere): tables
    were created nullable throughout, so a null id was committed and outside tools saw another
    schema than the contract's."""
    nullable = StructType([StructField(f.name, f.dataType, True) for f in PAGEVIEWS.schema])
    row = ("e1", "c1", "u1", dt.datetime(2024, 3, 1, tzinfo=dt.UTC), "/a", None, "test", D1)
    tables.append_once("pageviews", spark.createDataFrame([row], nullable), app_id="stream",
                       version=1, partition_by=PAGEVIEWS.partition_by, metadata=META)
    created = {f.name: f.nullable for f in DeltaTable(tables.table_path("pageviews")).schema(
        ).fields}
    assert created == {f.name: f.nullable for f in PAGEVIEWS.schema}
    with pytest.raises(ClickstreamError, match="null in non-nullable column 'event_id'"):
        tables.append_once("pageviews", spark.createDataFrame([(None, *row[1:])], nullable),
                           app_id="stream", version=2, partition_by=PAGEVIEWS.partition_by,
                           metadata=META)
    assert tables.read("pageviews").count() == 1


def test_a_compaction_since_the_read_does_not_refuse_a_replace(tables, spark):
    """Edge case 16: a compaction of the range changed its files, not its rows, so the
    replace goes through; a data change in the range, even one compacted since, still
    refuses it."""
    for version, order in enumerate(("o1", "o2"), start=1):
        tables.append_once("orders", orders(spark, (order, "c1", D1, "1")), app_id="stream",
                           version=version, partition_by=PARTS, metadata=META)
    read_at = tables.version("orders")
    assert tables.optimize("orders")["numFilesRemoved"] == 2

    day_one = {"client_id": "c1", "event_date": [D1]}
    assert tables.replace_partitions("orders", orders(spark, ("o1b", "c1", D1, "2")),
                                     predicate=day_one, app_id="recompute", version=1,
                                     metadata=META, read_version=read_at)
    assert ids(tables.read("orders")) == ["o1b"]

    read_at = tables.version("orders")
    for version, order in enumerate(("late", "later"), start=3):
        tables.append_once("orders", orders(spark, (order, "c1", D1, "1")), app_id="stream",
                           version=version, partition_by=PARTS, metadata=META)
    tables.optimize("orders")
    with pytest.raises(CommitConflictError, match="Recompute the range"):
        tables.replace_partitions("orders", orders(spark, ("o1c", "c1", D1, "3")),
                                  predicate="client_id = 'c1'", app_id="recompute",
                                  version=2, metadata=META, read_version=read_at)
    assert ids(tables.read("orders")) == ["late", "later", "o1b"]


def order_rows(spark: SparkSession, ids_: range, client: str, amount: str) -> DataFrame:
    """Orders ``o<i>`` spread over three days, all of ``amount``."""
    day = F.date_add(F.lit(D1), (F.col("id") % 3).cast("int"))
    return spark.range(ids_.start, ids_.stop, ids_.step).select(
        F.concat(F.lit("o"), F.col("id").cast("string")).alias("order_id"),
        F.lit(client).alias("client_id"), F.lit("u1").alias("user_id"),
        F.to_utc_timestamp(F.timestamp_add("HOUR", F.lit(12), day.cast("timestamp")), "UTC")
        .alias("ts"),
        F.lit(amount).cast(ORDERS.schema["amount"].dataType).alias("amount"),
        F.lit("EUR").alias("currency"), F.lit(None).cast("string").alias("event_id"),
        F.lit("test").alias("source"), day.alias("event_date"))


LIVE_ORDERS = """
import datetime as dt, sys, time
from decimal import Decimal
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

path, out = sys.argv[1], sys.argv[2]
schema = pa.schema(DeltaTable(path).schema().to_arrow())
day = dt.date(2024, 3, 1)
ts = dt.datetime(2024, 3, 1, 12, tzinfo=dt.UTC)
for i in range(600):
    row = {"order_id": [f"live{i}"], "client_id": ["c1"], "user_id": ["u1"], "ts": [ts],
           "amount": [Decimal(7)], "currency": ["EUR"], "event_id": [None],
           "source": ["stream"], "event_date": [day]}
    while True:
        try:
            write_deltalake(path, pa.table(row, schema=schema), mode="append")
            break
        except CommitFailedError:
            time.sleep(0.01)
    with open(out, "a") as f:
        f.write(f"live{i}\\n")
    time.sleep(0.1)
"""


def test_upsert_commits_while_another_writer_keeps_appending(config, spark, tmp_path, caplog):
    """A stream committing live orders of the same client and day every tenth of a second
    (another process) does not stop a backfill's upsert: only a file it rewrites or one of
    its keys appearing would. delta-rs ``merge`` restarted on any commit: it failed here."""
    log_of_live = tmp_path / "live.txt"
    log_of_live.touch()
    attempts: list[int] = []

    def a_live_commit_lands_first(table: str, attempt: int) -> None:
        # The race, forced: the upsert has read its snapshot; it commits only after the live
        # writer committed on top of that snapshot. A log line follows its commit, so of two
        # new lines the second's commit came after the snapshot for sure.
        attempts.append(attempt)
        if attempt > 1:
            return
        committed = len(log_of_live.read_text().split())
        deadline = time.monotonic() + 60
        while len(log_of_live.read_text().split()) < committed + 2:
            assert time.monotonic() < deadline, "the live-orders writer committed nothing"
            time.sleep(0.02)

    open_tables(config, spark).append_once(
        "orders", order_rows(spark, range(0, 200_000, 2), "c1", "1"), app_id="seed", version=1,
        partition_by=PARTS, metadata=META)
    tables = DeltaRsTables(config, spark, backoff_seconds=0.01,
                           before_commit=a_live_commit_lands_first)
    stream = subprocess.Popen([sys.executable, "-c", LIVE_ORDERS, tables.table_path("orders"),
                               str(log_of_live)])
    try:
        while len(log_of_live.read_text().split()) < 3:  # it commits before the upsert starts
            assert stream.poll() is None, "the live-orders writer stopped"
            time.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="clickstream.io.delta_rs_engine"):
            result = tables.upsert("orders", order_rows(spark, range(200_000), "c1", "2"),
                                   keys=["client_id", "order_id"], app_id="backfill",
                                   version=1, metadata=META)
        assert stream.poll() is None, "the live-orders writer stopped"
    finally:
        stream.terminate()
        stream.wait()

    appended = log_of_live.read_text().split()
    # The live commit made the first attempt's commit conflict; the next committed over it
    # without reading the rows again (only the files added since were checked for its keys).
    assert attempts[:2] == [1, 2]
    assert not any("changed under it" in m for m in caplog.messages)
    assert result == UpsertResult(inserted=100_000, updated=100_000)
    rows = tables.read("orders").groupBy("order_id").agg(
        F.count("*").alias("n"), F.max("amount").alias("amount")).collect()
    by_id = {r.order_id: (r.n, r.amount) for r in rows}
    assert {by_id[f"o{i}"] for i in range(200_000)} == {(1, Decimal(2))}
    assert {by_id[i] for i in appended} == {(1, Decimal(7))}
    assert len(by_id) - 200_000 >= len(appended)  # one more may be committed, not yet logged


def test_upsert_reads_again_when_another_writer_adds_one_of_its_keys(config, spark, caplog):
    other = open_tables(config, spark)
    seen: list[int] = []

    def stream_stores_o2(table: str, attempt: int) -> None:
        seen.append(attempt)
        if len(seen) == 1:  # the same order arrives live between the read and the commit
            other.append_once(table, orders(spark, ("o2", "c1", D1, "5")), app_id="stream",
                              version=2, partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, backoff_seconds=0.01, before_commit=stream_stores_o2)
    other.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="stream",
                      version=1, partition_by=PARTS, metadata=META)

    with caplog.at_level(logging.INFO, logger="clickstream.io.delta_rs_engine"):
        result = tables.upsert("orders",
                               orders(spark, ("o1", "c1", D2, "3"), ("o2", "c1", D2, "4")),
                               keys=["client_id", "order_id"], app_id="backfill", version=1,
                               metadata=META)

    assert result == UpsertResult(inserted=0, updated=2)  # o2 existed when it read again
    assert any("added with rows of its keys" in m for m in caplog.messages)
    rows = sorted((r.order_id, r.amount, r.event_date) for r in tables.read("orders").collect())
    assert rows == [("o1", Decimal(3), D2), ("o2", Decimal(4), D2)]


def test_upsert_reads_again_when_a_file_it_rewrites_is_compacted(config, spark, caplog):
    other = open_tables(config, spark)
    seen: list[int] = []

    def compact(table: str, attempt: int) -> None:
        seen.append(attempt)
        if len(seen) == 1:
            other.optimize(table, partition_filter={"client_id": "c1"})

    tables = DeltaRsTables(config, spark, backoff_seconds=0.01, before_commit=compact)
    for version, order_id in enumerate(("o1", "o2"), start=1):
        other.append_once("orders", orders(spark, (order_id, "c1", D1, "1")), app_id="stream",
                          version=version, partition_by=PARTS, metadata=META)

    with caplog.at_level(logging.INFO, logger="clickstream.io.delta_rs_engine"):
        result = tables.upsert("orders", orders(spark, ("o1", "c1", D1, "9")),
                               keys=["client_id", "order_id"], app_id="backfill", version=1,
                               metadata=META)

    assert result == UpsertResult(inserted=0, updated=1)
    assert any("it rewrites were removed" in m for m in caplog.messages)
    rows = sorted((r.order_id, r.amount) for r in tables.read("orders").collect())
    assert rows == [("o1", Decimal(9)), ("o2", Decimal(1))]


def test_upsert_whose_keys_keep_arriving_gives_up_and_commits_nothing(config, spark):
    other = open_tables(config, spark)

    arrivals: list[int] = []

    def always_o1(table: str, attempt: int) -> None:  # before every commit, o1 arrives again
        arrivals.append(attempt)
        other.append_once(table, orders(spark, ("o1", "c1", D1, "5")), app_id="stream",
                          version=len(arrivals), partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, max_commit_attempts=2, backoff_seconds=0.01,
                           before_commit=always_o1)
    other.append_once("orders", orders(spark), app_id="seed", version=1, partition_by=PARTS,
                      metadata=META)

    with pytest.raises(CommitConflictError, match=r"upsert on table 'orders': concurrent commits "
                       r"changed the rows it rewrites on each of 2 reads; nothing was committed"):
        tables.upsert("orders", orders(spark, ("o1", "c1", D2, "3")),
                      keys=["client_id", "order_id"], app_id="backfill", version=1, metadata=META)
    # Per read: the first attempt loses the commit race, the second sees o1 added and reads again.
    assert arrivals == [1, 2, 1, 2]
    assert tables.app_version("orders", "backfill") is None
    assert [r.order_id for r in tables.read("orders").collect()] == ["o1"] * 4

def test_delete_rows_removes_its_keys_rewriting_only_the_files_that_hold_them(tables, spark):
    for version, rows in enumerate([[("o1", "c1", D1, "1"), ("o2", "c1", D1, "2")],
                                    [("o3", "c1", D1, "3")], [("o4", "c1", D2, "4")],
                                    [("o9", "c2", D1, "9")]], start=1):
        tables.append_once("orders", orders(spark, *rows), app_id="stream", version=version,
                           partition_by=PARTS, metadata=META)
    before = files_of(tables, "orders", "c1")
    other_client = files_of(tables, "orders", "c2")

    gone = orders(spark, ("o2", "c1", D1, "0"), ("o9", "c1", D1, "0")).select(
        "client_id", "order_id")  # o9 is c2's, so no stored row has this key
    result = tables.delete_rows("orders", gone, keys=["client_id", "order_id"],
                                partition_filter={"client_id": "c1", "event_date": [D1]},
                                app_id="dequeue", version=1, metadata=META)

    assert result == DeleteResult(deleted=1)
    assert ids(tables.read("orders")) == ["o1", "o3", "o4", "o9"]
    after = files_of(tables, "orders", "c1")
    assert len(before - after) == 1  # the file of o1 and o2 alone, rewritten with o1
    assert files_of(tables, "orders", "c2") == other_client
    version = tables.version("orders")
    replay = tables.delete_rows("orders", gone, keys=["client_id", "order_id"],
                                partition_filter={"client_id": "c1", "event_date": [D1]},
                                app_id="dequeue", version=1, metadata=META)
    assert replay == DeleteResult(0, committed=False)
    assert tables.version("orders") == version


def test_row_count_and_head_follow_the_log_after_rewrites(tables, spark):
    """inspect's count comes from the log's ``numRecords``: rows a delete rewrote away and
    files the log removed are not counted, nor read for a sample. Both can be of an older
    version: inspect takes all of a table's line from one."""
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D1, "2"),
                                        ("o3", "c2", D2, "3")),
                       app_id="stream", version=1, partition_by=PARTS, metadata=META)
    appended = tables.version("orders")
    tables.delete_rows("orders", orders(spark, ("o2", "c1", D1, "0")).select(
        "client_id", "order_id"), keys=["client_id", "order_id"],
        partition_filter={"client_id": "c1"}, app_id="dequeue", version=1, metadata=META)

    assert len(parquet_on_disk(tables, "orders")) > len(DeltaTable(
        tables.table_path("orders")).file_uris())  # the removed file is still on disk
    assert tables.row_count("orders") == tables.read("orders").count() == 2
    sample = tables.head_arrow("orders", 1)
    assert sample.num_rows == 1 and sample.column("order_id")[0].as_py() in {"o1", "o3"}
    assert set(sample.column_names) == set(ORDERS.schema.fieldNames())  # partitions too
    assert sorted(tables.head_arrow("orders", 10).column("order_id").to_pylist()) == ["o1", "o3"]
    assert tables.row_count("orders", version=appended) == 3
    assert sorted(tables.head_arrow("orders", 10, version=appended).column(
        "order_id").to_pylist()) == ["o1", "o2", "o3"]


def test_row_count_of_files_without_statistics_reads_the_footers(tables):
    """Another engine's table may leave ``numRecords`` out of an add action."""
    path = tables.table_path("pageviews")
    write_deltalake(path, pa.table({"client_id": ["c1"], "n": [1]}), partition_by=["client_id"])
    table = DeltaTable(path)
    extra = Path(path) / "client_id=c2" / "no-stats.parquet"
    extra.parent.mkdir()
    pq.write_table(pa.table({"n": [1, 2, 3]}), extra)
    add = AddAction(path="client_id=c2/no-stats.parquet", size=extra.stat().st_size,
                    partition_values={"client_id": "c2"},
                    modification_time=int(time.time() * 1000), data_change=True, stats="")
    table.create_write_transaction([add], mode="append", schema=table.schema(),
                                   partition_by=["client_id"])

    assert pa.table(DeltaTable(path).get_add_actions(flatten=True)).column(
        "num_records").null_count == 1
    assert tables.row_count("pageviews") == 4


def test_time_travel_to_a_version_a_vacuum_deleted_fails_naming_it(tables, spark):
    """A backfill step resumed after table_maintenance vacuumed the files its old version
    needs: one clear, not-retryable error instead of Spark's missing path."""
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D1, "2")),
                       app_id="stream", version=1, partition_by=PARTS, metadata=META)
    old = tables.version("orders")
    tables.delete_rows("orders", orders(spark, ("o2", "c1", D1, "0")).select(
        "client_id", "order_id"), keys=["client_id", "order_id"],
        partition_filter={"client_id": "c1"}, app_id="dequeue", version=1, metadata=META)
    assert ids(tables.read("orders", version=old)) == ["o1", "o2"]  # not vacuumed yet

    DeltaTable(tables.table_path("orders")).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True)

    with pytest.raises(VersionVacuumedError) as error:
        tables.read("orders", ["order_id"], {"client_id": "c1"}, version=old)
    assert isinstance(error.value, NOT_RETRYABLE)
    message = str(error.value)
    assert f"'orders' as of version {old}" in message and "needs 1 of its 1 files" in message
    assert "recompute --full --client C" in message
    assert ids(tables.read("orders")) == ["o1"]  # the current version is whole
    # Its latest version pinned by its reader: a file missing there was not vacuumed.
    latest = tables.version("orders")
    (active,) = DeltaTable(tables.table_path("orders")).file_uris()
    os.remove(active)
    with pytest.raises(ClickstreamError, match=f"at version {latest}, its latest, names 1 "
                       "files that are gone") as damaged:
        tables.read("orders", version=latest)
    assert not isinstance(damaged.value, VersionVacuumedError)


def age_the_log(table_path: str | Path, days: int) -> None:
    """Every commit of the table ``days`` older, as Delta's log cleanup judges age."""
    old = time.time() - days * 86_400
    for commit in (Path(table_path) / "_delta_log").glob("*.json"):
        os.utime(commit, (old, old))


def test_a_commit_the_log_no_longer_holds_fails_naming_it(tables, spark):
    """Edge case 18: a backfill's merge commit older than the log retention, with a checkpoint
    since, is deleted from the log. Its run looked like one that never merged (the gate then
    compared the table with itself) and its version like a table that does not exist."""
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1")), app_id="backfill-r1",
                       version=1, partition_by=PARTS, metadata={"run_id": "r1", "cause": "r1"})
    merged = tables.version("orders")
    tables.append_once("orders", orders(spark, ("o2", "c1", D1, "2")), app_id="stream",
                       version=1, partition_by=PARTS, metadata=META)
    assert run_commit_version(tables, "orders", "r1", app_id="backfill-r1") == merged

    age_the_log(tables.table_path("orders"), 31)  # Delta's default retention: 30 days
    tables.checkpoint("orders")
    tables.append_once("orders", orders(spark, ("o3", "c1", D1, "3")), app_id="stream",
                       version=2, partition_by=PARTS, metadata=META)  # its commit cleans up

    with pytest.raises(VersionVacuumedError) as gone:
        run_commit_version(tables, "orders", "r1", app_id="backfill-r1")
    assert isinstance(gone.value, NOT_RETRYABLE)
    assert "run r1 committed to it (backfill-r1), but its log no longer holds" in str(gone.value)
    assert "recompute --full --client C" in str(gone.value)
    assert run_commit_version(tables, "orders", "r9", app_id="backfill-r9") is None  # no merge
    with pytest.raises(VersionVacuumedError, match=f"'orders' as of version {merged} cannot be "
                       "read: its log no longer holds that commit"):
        tables.read("orders", version=merged)
    assert ids(tables.read("orders")) == ["o1", "o2", "o3"]


def test_delete_rows_commits_beside_appends_into_its_partition_and_keeps_them(config, spark,
                                                                               caplog):
    """The recompute's removal of queued rows beside the stream queuing more of the same day:
    a replace of the day was refused by such an append and had to read it again."""
    other = open_tables(config, spark)

    def stream_appends(table: str, attempt: int) -> None:
        if attempt == 1:  # between the removal's read and its first commit
            other.append_once(table, orders(spark, ("live", "c1", D1, "5")), app_id="stream",
                              version=2, partition_by=PARTS, metadata=META)

    tables = DeltaRsTables(config, spark, backoff_seconds=0.01, before_commit=stream_appends)
    other.append_once("orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D1, "2")),
                      app_id="stream", version=1, partition_by=PARTS, metadata=META)

    with caplog.at_level(logging.INFO, logger="clickstream.io.delta_rs_engine"):
        result = tables.delete_rows(
            "orders", orders(spark, ("o1", "c1", D1, "1")).select("client_id", "order_id"),
            keys=["client_id", "order_id"], partition_filter={"client_id": "c1"},
            app_id="dequeue", version=1, metadata=META)

    assert result == DeleteResult(deleted=1)
    assert any("commit attempt 1 conflicted" in m for m in caplog.messages)
    assert not any("changed under it" in m for m in caplog.messages)  # not read again
    assert ids(other.read("orders")) == ["live", "o2"]

def test_upsert_rewrites_files_written_before_a_column_was_added(tables, spark):
    tables.append_once("orders", orders(spark, ("o1", "c1", D1, "1"), ("o2", "c1", D1, "2")),
                       app_id="a", version=1, partition_by=PARTS, metadata=META)
    DeltaTable(tables.table_path("orders")).alter.add_columns(Field("note", "string"))
    batch = orders(spark, ("o1", "c1", D1, "9")).withColumn("note", F.lit("fixed"))

    assert tables.upsert("orders", batch, keys=["client_id", "order_id"], app_id="b", version=1,
                         metadata=META) == UpsertResult(inserted=0, updated=1)
    rows = sorted((r.order_id, r.amount, r.note) for r in tables.read("orders").collect())
    assert rows == [("o1", Decimal(9), "fixed"), ("o2", Decimal(2), None)]


def test_upsert_refuses_empty_strings_in_a_partition_key(tables, spark):
    # Stored as the null partition (edge case 5), such a row could never be matched again.
    with pytest.raises(ClickstreamError, match="key column 'client_id' is a partition column "
                       "and holds empty strings"):
        tables.upsert("orders", orders(spark, ("o1", "", D1, "1")),
                      keys=["client_id", "order_id"], partition_by=PARTS, app_id="b",
                      version=1, metadata=META)
    assert tables.app_version("orders", "b") is None


def test_files_named_raw_in_the_log_are_refused_rather_than_removed_inexactly():
    # delta-rs encodes a remove's path itself: a raw non-ASCII log path (another engine's)
    # would be encoded into a path that matches no file, and its rows would stay twice.
    raw = _ActiveFile("client_id=café/p.parquet", "client_id=café/p.parquet", 1,
                      {"client_id": "café"})
    with pytest.raises(ClickstreamError, match=r"unencoded characters, first "
                       r"'client_id=café/p\.parquet'.*nothing was committed"):
        _removes([raw], "orders")
    encoded = _ActiveFile("client_id=caf%C3%A9/p.parquet", "client_id=café/p.parquet", 1,
                          {"client_id": "café"})
    assert [r.path for r in _removes([encoded], "orders")] == ["client_id=café/p.parquet"]

def test_missing_table_read_needs_a_schema(tables):
    with pytest.raises(ClickstreamError, match=r"table 'orders' does not exist.*pass schema="):
        tables.read("orders")
    empty = tables.read("orders", schema=ORDERS.schema)
    assert empty.count() == 0 and empty.columns == ORDERS.schema.names
    assert (tables.exists("orders"), tables.version("orders"), tables.history("orders")) == (
        False, -1, [])


def test_non_nullable_column_violation_commits_nothing(tables, spark):
    spark_rows = [("e1", "c1", "u1", None, None, None, "test", D1)]
    nullable = StructType([StructField(f.name, f.dataType, True) for f in PAGEVIEWS.schema])
    loose = spark.createDataFrame(spark_rows, nullable)
    tables.append_once("pageviews", spark.createDataFrame([], PAGEVIEWS.schema), app_id="s",
                       version=1, partition_by=list(PAGEVIEWS.partition_by), metadata=META)
    with pytest.raises(ClickstreamError, match=r"1 row\(s\) have null in non-nullable column 'ts'"):
        tables.append_once("pageviews", loose, app_id="s", version=2,
                           partition_by=list(PAGEVIEWS.partition_by), metadata=META)
    assert tables.app_version("pageviews", "s") == 1
    assert parquet_on_disk(tables, "pageviews") == set()


def test_partition_values_with_special_characters_read_back_exactly(tables, spark):
    odd = "shop a/b:ü%20"
    tables.append_once("orders", orders(spark, ("o1", odd, D1, "1"), ("o2", "c1", D1, "2")),
                       app_id="a", version=1, partition_by=PARTS, metadata=META)
    # Another engine (delta-rs' own writer) names folders its way, percent-encoding more.
    write_deltalake(tables.table_path("orders"), orders(spark, ("o3", odd, D2, "3")).toArrow(),
                    mode="append")
    # The upsert rewrites the file in delta-rs' folder (o3) and adds one in its own (o4).
    assert tables.upsert("orders", orders(spark, ("o3", odd, D2, "33"), ("o4", odd, D2, "4")),
                         keys=["client_id", "order_id"], app_id="b", version=1,
                         metadata=META) == UpsertResult(inserted=1, updated=1)

    folders = {Path(f).parts[0] for f in parquet_on_disk(tables, "orders")}
    assert {"client_id=shop a%2Fb%3Aü%2520", "client_id=shop%20a%2Fb%3A%C3%BC%2520"} < folders
    rows = {r.order_id: (r.client_id, r.amount) for r in tables.read("orders").collect()}
    assert rows == {"o1": (odd, Decimal(1)), "o2": ("c1", Decimal(2)), "o3": (odd, Decimal(33)),
                    "o4": (odd, Decimal(4))}
    assert ids(tables.read("orders", partition_filter={"client_id": odd})) == ["o1", "o3", "o4"]
    assert tables.read_arrow("orders", {"client_id": odd}).num_rows == 3


def test_the_longest_client_id_names_a_folder_in_either_engine(tables, spark):
    """``contract.CLIENT_ID_MAX_BYTES``: every byte escaped (``/`` by the product's writer,
    non-ASCII too by delta-rs'), the folder name still fits the file system's 255 bytes; a
    longer id failed every write of its micro-batch (Errno 36)."""
    longest = "/" * 32 + "\u00fc" * 16
    assert len(longest.encode()) == CLIENT_ID_MAX_BYTES
    tables.append_once("orders", orders(spark, ("o1", longest, D1, "1")), app_id="a",
                       version=1, partition_by=PARTS, metadata=META)
    write_deltalake(tables.table_path("orders"), orders(spark, ("o2", longest, D2, "2")).toArrow(),
                    mode="append")
    folders = {Path(f).parts[0] for f in parquet_on_disk(tables, "orders")}
    assert max(len(folder.encode()) for folder in folders) > 200  # escaped, near the limit
    assert ids(tables.read("orders", partition_filter={"client_id": longest})) == ["o1", "o2"]


def test_maintenance_compacts_vacuums_and_checkpoints_without_changing_rows(tables, spark):
    for version in (1, 2, 3):
        tables.append_once("orders", orders(spark, (f"o{version}", "c1", D1, "1")), app_id="a",
                           version=version, partition_by=PARTS, metadata=META)
    assert len(files_of(tables, "orders", "c1")) == 3

    metrics = tables.optimize("orders", partition_filter={"client_id": "c1"})
    tables.checkpoint("orders")
    removed = tables.vacuum("orders", retention_hours=0, enforce_retention_duration=False)

    assert metrics["numFilesRemoved"] == 3 and metrics["numFilesAdded"] == 1
    assert len(removed) == 3
    assert len(files_of(tables, "orders", "c1")) == 1
    assert ids(tables.read("orders")) == ["o1", "o2", "o3"]
    assert spark.read.parquet(tables.table_path("orders")).count() == 3
    assert tables.app_version("orders", "a") == 3


def test_a_client_id_with_a_tilde_is_compacted_week_after_week(tables, spark):
    """(Edge case 19) deltalake writes '~' raw in a folder's name, and its compaction then
    looks for the files under '%7E': one such client failed the compaction of the whole table,
    every week. Once the product's writer escaped '~', deltalake's compaction of the escaped
    folder wrote its file under a raw '~' again, and the client was left out of every later
    compaction (its small files piling up). This engine compacts those partitions itself,
    raw folders (another writer's) included, into escaped ones."""
    for version in (1, 2):
        tables.append_once("orders", orders(spark, (f"o{version}", "a~b", D1, "1"),
                                            (f"c{version}", "c1", D1, "1")),
                           app_id="a", version=version, partition_by=PARTS, metadata=META)
    for order_id in ("x1", "x2"):  # deltalake's own writer: a raw '~'
        write_deltalake(tables.table_path("orders"),
                        orders(spark, (order_id, "x~y", D1, "2")).toArrow(), mode="append")
    folders = {Path(f).parts[0] for f in parquet_on_disk(tables, "orders")}
    assert folders == {"client_id=a%7Eb", "client_id=c1", "client_id=x~y"}
    before = sorted(tuple(r) for r in tables.read("orders").collect())

    assert tables.optimize("orders") == {"numFilesAdded": 3, "numFilesRemoved": 6}
    assert [len(files_of(tables, "orders", c)) for c in ("a~b", "c1", "x~y")] == [1, 1, 1]
    assert {Path(f).parts[0] for c in ("a~b", "x~y") for f in files_of(tables, "orders", c)} \
        == {"client_id=a%7Eb", "client_id=x%7Ey"}
    assert sorted(tuple(r) for r in tables.read("orders").collect()) == before

    for version in (3, 4):  # the next week's micro-batches
        tables.append_once("orders", orders(spark, (f"o{version}", "a~b", D1, "1")),
                           app_id="a", version=version, partition_by=PARTS, metadata=META)
    assert tables.optimize("orders") == {"numFilesAdded": 1, "numFilesRemoved": 3}
    assert len(files_of(tables, "orders", "a~b")) == 1
    assert ids(tables.read("orders", partition_filter={"client_id": "a~b"})) == [
        "o1", "o2", "o3", "o4"]
    assert tables.row_count("orders") == 8
    last = DeltaTable(tables.table_path("orders")).history(1)[0]
    assert (last["operation"], last.get("cause")) == ("WRITE", "maintenance: optimize")


def test_a_compaction_filtered_to_a_null_partition_compacts_it(tables, spark):
    """deltalake's filters cannot name a null partition: the compaction did nothing and
    reported success. ``read_arrow`` reads '' as the null partition, as ``read`` does (it
    read nothing)."""
    for version in (1, 2, 3):
        tables.append_once("probe", spark.createDataFrame(
            [(f"k{version}", None, version), (f"j{version}", "x", version)],
            "k string, c string, v long"), app_id="a", version=version, partition_by=["c"],
            metadata=META)

    metrics = tables.optimize("probe", partition_filter={"c": None})

    assert (metrics["numFilesRemoved"], metrics["numFilesAdded"]) == (3, 1)
    assert len(DeltaTable(tables.table_path("probe")).file_uris()) == 4  # x's three stay
    assert sorted(tables.read_arrow("probe", {"c": ""}).column("k").to_pylist()) == sorted(
        r.k for r in tables.read("probe", partition_filter={"c": ""}).collect()) == [
        "k1", "k2", "k3"]


def test_a_compaction_of_several_alternatives_counts_the_files_of_each(tables, spark):
    for version in (1, 2, 3):
        tables.append_once("orders", orders(spark, (f"o{version}", "c1", D1, "1"),
                                            (f"p{version}", "c2", D1, "1")),
                           app_id="a", version=version, partition_by=PARTS, metadata=META)

    metrics = tables.optimize("orders", partition_filter=[{"client_id": "c1"},
                                                          {"client_id": "c2"}])

    assert (metrics["numFilesRemoved"], metrics["numFilesAdded"]) == (6, 2)


def test_vacuum_deletes_files_a_crash_left_uncommitted_once_older_than_the_retention(
        tables, spark):
    # Edge case 1: a writer killed between writing its files and committing them leaves
    # files no version names. Vacuum's default (lite) mode only deleted files a remove action
    # names, so every crash's leftovers stayed on disk for good.
    for version in (1, 2):
        tables.append_once("orders", orders(spark, (f"o{version}", "c1", D1, "1")), app_id="a",
                           version=version, partition_by=PARTS, metadata=META)
    tables.optimize("orders")  # the two files are removed now, and kept for time travel
    root = Path(tables.table_path("orders"))
    eight_days_ago = time.time() - 8 * 24 * 3600
    for path in root.rglob("*"):  # every file on disk is older than the retention ...
        os.utime(path, (eight_days_ago, eight_days_ago))
    crashed = root / "client_id=c1" / "part-00000-crashed.c000.snappy.parquet"
    writing = root / "client_id=c1" / "part-00000-still-writing.c000.snappy.parquet"
    for leftover in (crashed, writing):
        pq.write_table(pa.table({"order_id": ["o9"]}), leftover)
    os.utime(crashed, (eight_days_ago, eight_days_ago))  # ... and so is one leftover

    removed = tables.vacuum("orders", retention_hours=168)

    assert [Path(p).name for p in removed] == [crashed.name]
    assert not crashed.exists() and writing.exists()  # a write in progress keeps its files
    assert ids(tables.read("orders", version=2)) == ["o1", "o2"]  # removed < 168 h ago
    assert ids(tables.read("orders")) == ["o1", "o2"]


class CompactionsMeetFirst(DeltaRsTables):
    """Each compaction, once past the table's lock, waits up to ``patience`` seconds for the
    other to get there too: without the lock both read the same snapshot, so the race the
    lock prevents happens on every run instead of by chance."""

    def __init__(self, config: Config, spark: SparkSession, parties: int, patience: float):
        super().__init__(config, spark, backoff_seconds=0.01)
        self._arrivals = threading.Condition()
        self._arrived, self._parties, self._patience = 0, parties, patience
        self.waited_out = 0

    def _optimize(self, name, partition_filter):
        with self._arrivals:
            self._arrived += 1
            self._arrivals.notify_all()
            if not self._arrivals.wait_for(lambda: self._arrived >= self._parties,
                                           self._patience):
                self.waited_out += 1
        return super()._optimize(name, partition_filter)


def test_two_compactions_at_once_do_not_store_the_rows_twice(config, spark):
    # delta-rs rebases a compaction over a concurrent one (its conflict check ignores removes
    # with dataChange=false): both commits landed and every row was stored twice (edge case 15).
    tables = CompactionsMeetFirst(config, spark, parties=2, patience=2.0)
    rows = order_rows(spark, range(24_000), "c1", "1").toArrow()
    for start in range(0, rows.num_rows, 2_000):  # 12 small files of one client
        write_deltalake(tables.table_path("orders"), rows.slice(start, 2_000),
                        partition_by=PARTS, mode="append")
    start = threading.Barrier(2)
    failures: list[BaseException] = []

    def compact() -> None:
        start.wait()
        try:
            tables.optimize("orders")
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    workers = [threading.Thread(target=compact) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert failures == []
    assert tables.waited_out == 1  # the lock kept the second out while the first compacted
    stored = DeltaTable(tables.table_path("orders")).to_pyarrow_table(columns=["order_id"])
    assert stored.num_rows == 24_000
    assert len(files_of(tables, "orders", "c1")) == 3  # one per day


def test_delta_spark_engine_without_jars_says_what_to_set(config, spark):
    if delta_jars_loadable(spark):
        pytest.skip("io.delta jars are on the classpath; the missing-jars message cannot show")
    with pytest.raises(ConfigError, match=r"delta-spark JVM jars .* are not loadable in this "
                       r"Spark session \(java\.lang\.ClassNotFoundException: "
                       r"io\.delta\.tables\.DeltaTable\)\. .*CLICKSTREAM_DELTA_ENGINE=deltalake"):
        open_tables(config.replace(delta_engine="delta-spark"), spark)


@pytest.mark.needs_jars
def test_delta_spark_engine_round_trip(config, spark, monkeypatch):
    if not delta_jars_loadable(spark):
        pytest.skip("io.delta jars are not on the Spark classpath (Maven unreachable here); "
                    "run with the delta-spark jars and CLICKSTREAM_DELTA_ENGINE=delta-spark")
    tables = open_tables(config.replace(delta_engine="delta-spark"), spark)
    batch = orders(spark, ("o1", "c1", D1, "1"), ("o2", "c2", D1, "2"))
    assert tables.append_once("orders", batch, app_id="a", version=1, partition_by=PARTS,
                              metadata=META) == AppendResult(committed=True, rows=2)
    assert not tables.append_once("orders", batch, app_id="a", version=1, partition_by=PARTS,
                                  metadata=META)
    with monkeypatch.context() as race:  # a replay that passed the check before "a" committed
        race.setattr(tables, "app_version", lambda name, app_id: None)
        assert tables.append_once("orders", batch, app_id="a", version=1, partition_by=PARTS,
                                  metadata=META) == AppendResult(committed=False)  # edge case 3
    assert tables.set_retention("orders", 1000, 1000)
    assert not tables.set_retention("orders", 1000, 1000)
    result = tables.upsert("orders", orders(spark, ("o1", "c1", D2, "5")),
                           keys=["client_id", "order_id"], app_id="u", version=1, metadata=META)
    assert result == UpsertResult(inserted=0, updated=1)
    assert tables.replace_partitions("orders", orders(spark, ("o3", "c2", D1, "3")),
                                     predicate={"client_id": "c2"}, app_id="r", version=1,
                                     metadata=META)
    assert ids(tables.read("orders")) == ["o1", "o3"]
    assert tables.history("orders", limit=1)[0]["app_id"] == "r"
    gone = orders(spark, ("o3", "c2", D1, "3")).select("client_id", "order_id")
    for committed, deleted in ((True, 1), (False, 0)):  # then a replay of the step
        assert tables.delete_rows("orders", gone, keys=["client_id", "order_id"],
                                  partition_filter={"client_id": "c2"}, app_id="d", version=1,
                                  metadata=META) == DeleteResult(deleted, committed)
    assert ids(tables.read("orders")) == ["o1"]


def test_partition_predicates_hold_any_client_id_as_one_value(spark: SparkSession):
    """A client id is data (the backfill form's free text, an event's client_id): Spark SQL
    reads a backslash in a literal as an escape, so ``x\\') OR true --`` closed the literal
    and the delta-spark engine's replaceWhere matched every client's partitions."""
    ids = ["x\\') OR true --", "a\\b", "it's", "c\\'1", "plain"]
    frame = spark.createDataFrame([(i,) for i in ids], "client_id string")
    for client in ids:
        where = filter_to_sql({"client_id": client}, {"client_id": "string"})
        assert [r.client_id for r in frame.where(where).collect()] == [client], where


def test_partition_predicates_render_and_refuse_without_spark():
    types = {"client_id": "string", "event_date": "date"}
    assert filter_to_sql({"client_id": "c'1", "event_date": [D1, None]}, types, alias="t") == (
        "t.client_id IN ('c''1') AND "
        "(t.event_date IN (CAST('2024-03-01' AS DATE)) OR t.event_date IS NULL)"
    )
    assert filter_to_sql([{"client_id": "a"}, {"client_id": "b"}], types) == (
        "(client_id IN ('a')) OR (client_id IN ('b'))"
    )
    text = "client_id = 'x AND amount' AND `event date` IN (DATE '2024-01-01') OR ts IS NULL"
    assert predicate_columns(text) == {"client_id", "event date", "ts"}
    with pytest.raises(ConfigError, match="uses ts, which are not partition columns"):
        check_partition_predicate("client_id = 'c1' AND ts > '2024-01-01'", PARTS)
    with pytest.raises(ConfigError, match="lists no values for event_date"):
        check_partition_predicate({"client_id": "c1", "event_date": []}, PARTS)


def test_largest_by_partition_from_file_statistics_equals_reading_the_rows(tables, spark):
    """The delta-rs answer comes from the log's statistics; the base class reads the rows."""
    first = orders(spark, ("o1", "c1", D1, "1.00", 5), ("o2", "c1", D2, "2.00"),
                   ("o3", "c2", D1, "3.00", 9))
    tables.append_once("orders", first, app_id="a", version=1, partition_by=PARTS, metadata=META)
    tables.append_once("orders", orders(spark, ("o4", "c1", D1, "4.00", 7)),  # a second file
                       app_id="a", version=2, partition_by=PARTS, metadata=META)
    for scope in ({"client_id": "c1"}, None):
        from_stats = tables.largest_by_partition("orders", "ts", "event_date", scope)
        from_rows = DeltaTables.largest_by_partition(tables, "orders", "ts", "event_date", scope)
        assert from_stats == from_rows
    assert tables.largest_by_partition("orders", "ts", "event_date", {"client_id": "c1"}) == {
        D1: dt.datetime.combine(D1, dt.time(12, 30, 15, 7), dt.UTC),
        D2: dt.datetime.combine(D2, dt.time(12, 30, 15), dt.UTC)}
    # No statistics for decimals (edge case 7): unknown, not a wrong bound.
    assert tables.largest_by_partition("orders", "amount", "event_date", {"client_id": "c1"}) == {
        D1: None, D2: None}
    assert tables.largest_by_partition("missing", "ts", "event_date") == {}
