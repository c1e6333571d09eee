"""The ``deltalake`` (delta-rs) engine: Spark writes the Parquet files, delta-rs commits them.

How a write works: Spark executors write Parquet files straight into the table folder (unique
names, Hive-style partition folders, statistics gathered while writing: ``delta_rs_files``)
and return one small row per file; the driver turns those rows into Delta ``add`` actions
and commits them with ``DeltaTable.create_write_transaction``, together with an application
transaction and commit metadata. Upserts collect the (modest) batch to Arrow and rewrite, on
the driver, only the files that hold its keys (edge case 14). Reads go through the log's
active files, never through a folder listing.

Known edge cases (cited inline as "edge case N"):

1. A crash between writing files and committing leaves unreferenced files. They are invisible
   (readers only see files named by the log) and :meth:`DeltaRsTables.vacuum` deletes them once
   older than the retention: it runs delta-rs' ``full`` mode, as delta-spark's VACUUM does; the
   default (lite) mode deletes only files a remove action names, so leftovers stayed for good.
   Files of a refused or skipped commit are deleted at once.
2. A replayed step races its original (a zombie task, a retried Airflow task): both write
   files; the first commit wins; the loser sees ``app_version >= version`` on retry, deletes its
   files and returns False (nothing is written twice).
3. delta-rs retries commits internally and would silently rebase a partition overwrite over a
   concurrent append into the same partition (measured with 1.6.6: both rows survive). Every
   commit here therefore runs with ``max_commit_retries=0`` and this module owns the retry loop,
   re-validating idempotency (append), re-checking what other writers added (upsert, 14), or
   refusing when the replaced range changed (replace_partitions).
4. Spark derives partition values from folder names (Hive escaping, ``%XX``), delta-rs from the
   log. Our writer escapes like Spark; folders written by delta-rs percent-encode more (spaces,
   non-ASCII) or hold empty values (``k=``). ``read`` checks every file's folder against the log
   and reads mismatching partitions separately with the log's values as literals.
5. ``""`` and null partition values are the same partition (Delta, Hive and Spark all store
   ``""`` as null); an empty-string ``client_id`` reads back as null.
6. Partition columns may be string, integer, boolean or date. Timestamp, decimal and float
   partitions are refused (their string forms differ between engines).
7. Column statistics: ``numRecords`` and ``nullCount`` for every top-level column; exact
   ``minValues``/``maxValues`` only for integers, dates, timestamps (microseconds, UTC) and
   strings up to 64 characters. Wrong statistics would make readers skip files that hold
   matching rows, so anything ambiguous (decimals, floats with NaN, long strings) is left out.
   A file deltalake's compaction writes has its own statistics, timestamps cut to the
   millisecond (a maximum may then be below a row's time): nothing here prunes by time
   statistics, and ``largest_by_partition``'s callers read whole milliseconds.
8. Non-nullable columns are enforced from the written files' null counts: a violation deletes
   the files and commits nothing.
9. Tables written by other engines with deletion vectors or column mapping are refused by
   every reader and by the writers that rewrite files: a file-list read cannot apply them,
   and a file's statistics (``largest_by_partition``, ``row_count``) count its deleted rows.
10. An empty DataFrame still commits the application transaction (a commit without files), so
    the step is recorded and versions stay monotonic; the first write to a missing table
    creates it in its own commit (version 0), even when that write is skipped or empty.
11. Files are written with the local (or mounted shared) file system; object-store URIs are not
    supported by this engine.
12. delta-rs takes ``AddAction``/``RemoveAction`` paths as named on disk and URI-encodes them into
    the log itself; an already-encoded path double-encodes, and a remove then silently matches
    no file. ``get_add_actions()`` returns the encoded form, so paths are decoded first. A log
    path with raw non-ASCII characters or spaces (another engine's) cannot be removed exactly:
    rewriting that file is refused rather than leaving its rows stored twice.
13. Spark hands a write task its rows in Arrow batches of ~10k rows spread over every table
    partition of the task; writing each batch's slice as it comes made row groups of ~100 rows
    (poor compression, slow scans for every reader). Rows are therefore sorted by the partition
    columns within each task (as Spark's own partitioned writer does) and buffered into row
    groups of up to ``ROW_GROUP_ROWS`` rows / ``ROW_GROUP_BYTES``; a file is closed as soon as
    its partition's rows end, so a task holds one buffer at a time.
14. An upsert reads the key columns of every file in its scope once, rewrites the files that
    hold one of its keys (without those rows) and writes the source rows as new files; its
    commit removes exactly the rewritten files. delta-rs ``merge`` was used before and
    restarted on any commit by another writer during its run (even into other partitions), so
    a year of orders never got through beside a stream committing orders every few seconds.
    Now each commit attempt re-checks only what changed since the read: a rewritten file that
    is gone (compacted, replaced) or an added file holding one of the source's keys sends the
    upsert back to read again; anything else (the stream's appends of other orders) is left in
    place and the commit goes through. An attempt must fit between two of the other writer's
    commits: a retry loads only the commits since its snapshot, and the key check hashes the
    few added files, not the batch's keys (hashing 200,000 keys at each attempt took ~0.1 s
    under load, a live writer's commit interval, and six attempts in a row lost in CI).
15. Two compactions of one table at once (a retried maintenance task beside its zombie, a
    manual run beside the weekly one) both commit: delta-rs' conflict check ignores removes
    with ``dataChange=false``, so the second rebases over the first and every row it compacted
    is stored twice (measured with 1.6.6). :meth:`DeltaRsTables.optimize` therefore holds an
    exclusive lock on ``OPTIMIZE_LOCK`` in the table folder (Delta ignores names starting with
    ``_``) and loads the snapshot it compacts only once it holds it. Other writers commit with
    ``dataChange=true`` (a compaction that read their removed files fails) or never rebase (3).
16. A compaction inside a replaced range between the read and the replace changes its files,
    not its rows: every commit since ``read_version`` whose adds and removes in the range all
    say ``dataChange=false`` leaves ``df`` valid, so the replace removes the range's files as
    they are now and commits. Any data change in the range (or an action without partition
    values) is still refused. Without this, ``recompute --full`` beside the weekly compaction
    failed, and a correction's apply read its days again for nothing.
17. A commit can land while its call raises (a post-commit hook failing, a lost
    acknowledgement the retry then sees as "step done", a signal right after it). The cleanup
    of edge cases 1 and 2 therefore keeps every file that any commit since the write began
    adds, not only the files still active: a compaction (or another writer's rewrite) that
    removed them in between made them look uncommitted, and deleting them broke the version
    that added them for time travel, pinned reads (a correction's ``read_version``, the
    recompute queue's version) and readers still on it. When the retry within the call finds
    the step done by its own commit, the call reports that it committed. It reported
    "already done", so a correction run took its own recorded plan for another run's
    (``corrections`` C6) and failed, and the sessionizer counted 0 rows written. Its own
    commit is the one carrying the call's ``write_id`` (commit metadata, one per call): told
    by its files, a commit with none (an empty micro-batch or plan, a delete emptying every
    file it rewrites) was still "already done".
18. delta-rs deletes commits older than the table's ``delta.logRetentionDuration`` (30 days
    unless set) once a later checkpoint exists (its own every 100 commits, or maintenance's).
    Their versions can no longer be read: time travel to one raises ``VersionVacuumedError``,
    like a version whose files a vacuum deleted. It used to return "table does not exist",
    and a commit gone from ``history`` looked like one never made (``quality.checks``
    ``run_commit_version``). ``table_maintenance`` keeps the log as long as its vacuum
    keeps files (``set_retention``), so a retention above 30 days extends both.
19. deltalake 1.6.6 writes a ``~`` raw in a partition folder's name, but its compaction looks
    for the file under ``%7E`` and fails for the whole table ("File selection contains N
    missing files"), every run. This engine's writer escapes ``~``, which Spark reads back;
    deltalake's compaction of an escaped folder wrote its file under a raw ``~`` again, so a
    client compacted once was left out of every later compaction. Partitions whose values
    hold a ``~`` are compacted by this engine's own writer instead (``_compact_here``), as
    are null partitions a filter names (deltalake's filters cannot name a null partition:
    such a compaction did nothing and reported success).
20. deltalake raises ``CommitFailedError`` for a lost race and for a refusal alike (a table
    feature delta-rs cannot write, e.g. one delta-spark enabled on the cluster profile; an
    append-only table asked to remove rows). A failed attempt after which the table did not
    move lost no race: it raises ``TableRefusedError`` (no retry of the step fixes it) with
    deltalake's reason. Taken for a conflict, it was tried six times, rewriting the batch's
    files each time, and reported as "still conflicted", which Airflow retried.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.schema import Schema as DeltaSchema
from deltalake.transaction import AddAction, RemoveAction

from clickstream.config import ENV_NAMES
from clickstream.errors import (
    VACUUMED_WAY_FORWARD,
    ClickstreamError,
    CommitConflictError,
    ConfigError,
    TableRefusedError,
    VersionVacuumedError,
)
from clickstream.io.delta_rs_files import HIVE_NULL, WRITTEN_FILE_ROWS, spark_unescape, write_task
from clickstream.io.delta_tables import (
    LOG_RETENTION,
    TABLE_MISSING,
    AppendResult,
    DeleteResult,
    DeltaTables,
    PartitionFilter,
    PartitionValue,
    ReplacePredicate,
    UpsertResult,
    check_partition_predicate,
    created_schema,
    filter_alternatives,
    filter_matches,
    partition_string,
    retention_properties,
)
from clickstream.locks import exclusive
from clickstream.retry import wait_before_retry

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from clickstream.config import Config

log = logging.getLogger(__name__)

_T = TypeVar("_T")
WRITE_ID = "write_id"  # commit metadata: the call that made the commit (edge case 17)
_SKIPPED = object()  # an attempt's result when the (app_id, version) step was already committed
_PARTITION_TYPES = {"string", "integer", "long", "short", "byte", "boolean", "date"}
OPTIMIZE_LOCK = "_clickstream_optimize.lock"  # in the table folder: one compaction at a time (15)
COMPACTED_HERE_BYTES = 128 * 2**20  # files the driver compacts per commit (edge case 19)


_FILE = "__clickstream_file"  # a column of _read_files: which file a row came from


class _ReadChanged(Exception):
    """An upsert's read is stale: another writer changed rows it rewrites (edge case 14)."""


@dataclass(frozen=True)
class _WrittenFile:
    """One Parquet file an executor wrote; ``path`` is relative to the table root, on disk."""

    path: str
    size: int
    partition_values: dict[str, str | None]
    modification_time: int
    stats: str

    @property
    def rows(self) -> int:
        return int(json.loads(self.stats)["numRecords"])

    def add_action(self, *, data_change: bool = True) -> AddAction:
        # delta-rs takes the path as named on disk and URI-encodes it into the log itself.
        return AddAction(
            self.path, self.size, self.partition_values,
            self.modification_time, data_change, self.stats,
        )


@dataclass(frozen=True)
class _ActiveFile:
    """One active file: its path as in the log (URI-encoded), on disk, and partition values."""

    log_path: str
    path: str
    size: int
    partition_values: dict[str, str | None]


class DeltaRsTables(DeltaTables):
    """Delta tables written by Spark executors and committed by delta-rs (``deltalake``).

    Args:
        config: tables live under ``config.warehouse``.
        spark: session for DataFrame reads and writes.
        max_commit_attempts: commit attempts before :class:`CommitConflictError`.
        backoff_seconds: first retry delay; doubles per attempt (with jitter), capped at 5 s.
        before_commit: called as ``before_commit(table, attempt)`` after the files are written
            and the snapshot is loaded, right before each commit attempt. A seam for tests and
            diagnostics (e.g. to inject a concurrent commit); None in production.
    """

    def __init__(
        self,
        config: Config,
        spark: SparkSession | None = None,
        *,
        max_commit_attempts: int = 6,
        backoff_seconds: float = 0.1,
        before_commit: Callable[[str, int], None] | None = None,
    ) -> None:
        if max_commit_attempts < 1:
            raise ConfigError(f"max_commit_attempts must be at least 1, got {max_commit_attempts}")
        self._config = config
        self._spark = spark
        self._max_attempts = max_commit_attempts
        self._backoff = backoff_seconds
        self._before_commit = before_commit

    # -- lookups ---------------------------------------------------------------------------

    def table_path(self, name: str) -> str:
        if not name or "/" in name or name.startswith((".", "_")):
            raise ConfigError(f"table name {name!r} must be a plain folder name (e.g. 'orders')")
        return str(self._config.table_path(name))

    def exists(self, name: str) -> bool:
        return DeltaTable.is_deltatable(self.table_path(name))

    def version(self, name: str) -> int:
        table = self._load(name)
        return TABLE_MISSING if table is None else table.version()

    def app_version(self, name: str, app_id: str) -> int | None:
        table = self._load(name)
        return None if table is None else table.transaction_version(app_id)

    def history(self, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Our metadata at the top of each entry, as deltalake writes it; a delta-spark
        commit's is in ``userMetadata``, flattened as ``DeltaSparkTables.history`` does (a
        table one engine wrote is read by the other: the DAG's announcing tasks read with
        this one)."""
        table = self._load(name)
        entries = [] if table is None else table.history(limit)
        for entry in entries:
            metadata = entry.get("userMetadata")
            if isinstance(metadata, str):
                with contextlib.suppress(ValueError):
                    flattened = json.loads(metadata)
                    if isinstance(flattened, dict):
                        entry.update(flattened)
        return entries

    # -- writers ---------------------------------------------------------------------------

    def append_once(
        self,
        name: str,
        df: DataFrame,
        *,
        app_id: str,
        version: int,
        partition_by: Sequence[str],
        metadata: Mapping[str, Any],
    ) -> AppendResult:
        """See :meth:`DeltaTables.append_once`. Delivery: exactly once per (app_id, version)."""
        properties = _commit_properties(metadata, app_id, version, "append_once")
        table = self._ensure_table(name, df.schema, partition_by, metadata)
        if _done(table, app_id, version):
            return AppendResult(committed=False)
        df = _conform(df, table, name)
        files = self._write_files(name, df, table)

        def attempt(current: DeltaTable) -> object:
            if _done(current, app_id, version):  # edge case 2
                return _SKIPPED
            current.create_write_transaction(
                [f.add_action() for f in files], mode="append", schema=current.schema(),
                partition_by=_partition_columns(current), commit_properties=properties,
            )
            return True

        outcome = self._commit_files(name, "append", files, attempt, since=table.version(),
                                     landed=True, properties=properties)
        if outcome is _SKIPPED:
            return AppendResult(committed=False)
        return AppendResult(committed=True, rows=sum(f.rows for f in files))

    def upsert(
        self,
        name: str,
        df: DataFrame,
        *,
        keys: Sequence[str],
        partition_by: Sequence[str] | None = None,
        partition_filter: PartitionFilter | None = None,
        app_id: str,
        version: int,
        metadata: Mapping[str, Any],
    ) -> UpsertResult:
        """See :meth:`DeltaTables.upsert`. Delivery: exactly once per (app_id, version).

        Copy-on-write by file, not delta-rs ``merge``: a merge restarts on any concurrent
        commit, so a long one never got through beside a stream committing every few seconds.
        Here the rows are read and written once; a commit attempt only checks what other
        writers committed since (edge case 14).
        """
        _check_key_columns(keys, df, name, "upsert")  # before a missing table is created
        table = self._ensure_table(name, df.schema, partition_by, metadata)
        return self._rewrite_by_keys(name, table, df, keys, partition_filter, app_id, version,
                                     metadata, insert=True)

    def delete_rows(
        self,
        name: str,
        df: DataFrame,
        *,
        keys: Sequence[str],
        partition_filter: PartitionFilter,
        app_id: str,
        version: int,
        metadata: Mapping[str, Any],
    ) -> DeleteResult:
        """See :meth:`DeltaTables.delete_rows`: the upsert's copy-on-write by file (edge case
        14) without the source's rows, so the stream's appends meanwhile do not conflict."""
        _check_key_columns(keys, df, name, "delete_rows")
        table = self._require(name)
        outcome = self._rewrite_by_keys(name, table, df.select(*keys), keys, partition_filter,
                                        app_id, version, metadata, insert=False)
        return DeleteResult(outcome.updated, outcome.committed)

    def _rewrite_by_keys(
        self, name: str, table: DeltaTable, df: DataFrame, keys: Sequence[str],
        partition_filter: PartitionFilter | None, app_id: str, version: int,
        metadata: Mapping[str, Any], *, insert: bool,
    ) -> UpsertResult:
        """Upsert (``insert``) or delete the keys of ``df``; for a delete, ``updated`` counts
        the rows removed."""
        operation = "upsert" if insert else "delete_rows"
        properties = _commit_properties(metadata, app_id, version, operation)
        if _done(table, app_id, version):
            return UpsertResult(0, 0, committed=False)
        if insert:
            source = _cast_to_table(_conform(df, table, name).toArrow(), table)
        else:
            source = _cast_to_columns(df.toArrow(), table, name)
        _check_keys(source, list(keys), name, operation)
        scope = partition_filter
        if scope is None:  # restrict by the key columns that are partition columns
            key_parts = [k for k in keys if k in _partition_columns(table)]
            if key_parts and source.num_rows:
                values = source.select(key_parts).group_by(key_parts).aggregate([])
                scope = {k: values.column(k).to_pylist() for k in key_parts}
        if scope is not None:
            _check_filter_columns(scope, _partition_columns(table), name)
        _check_partition_keys(source, [k for k in keys if k in _partition_columns(table)], name)
        if source.num_rows == 0:  # edge case 10: record the step all the same
            return self._record_step(name, operation, properties, app_id, version,
                                     since=table.version())
        source_keys = source.select(list(keys))
        first: _ReadChanged | None = None
        for number in range(1, self._max_attempts + 1):
            try:
                outcome = self._upsert_once(name, source if insert else None, source_keys,
                                            scope, properties, app_id, version)
            except _ReadChanged as exc:
                first = first or exc
                log.info("%s on %s: read %d of %d changed under it: %s", operation, name,
                         number, self._max_attempts, exc)
                continue
            if isinstance(outcome, UpsertResult):
                return outcome
            return UpsertResult(0, 0, committed=False)  # edge case 2: a racing replay won
        raise CommitConflictError(
            f"{operation} on table {name!r}: concurrent commits changed the rows it rewrites on "
            f"each of {self._max_attempts} reads; nothing was committed (first: {first}). "
            "Retrying the step is safe: it commits at most once per (app_id, version)."
        )

    def _upsert_once(
        self,
        name: str,
        source: pa.Table | None,
        source_keys: pa.Table,
        scope: PartitionFilter | None,
        properties: CommitProperties,
        app_id: str,
        version: int,
    ) -> object:
        """One read-write-commit pass of :meth:`upsert` (edge case 14); without a ``source``,
        of :meth:`delete_rows`.

        Raises:
            _ReadChanged: another writer removed a file this pass rewrites, or added rows with
                one of the source's keys; nothing was committed, read again.
        """
        read = self._require(name)
        if _done(read, app_id, version):
            return _SKIPPED
        _check_readable(read, name)  # edge case 9: a deletion vector would be undone
        keys = source_keys.column_names
        seen = _within(self._active_files(read), scope)
        # One join over all files, not one per file: each join hashes the whole batch's keys.
        matched = self._keys_in_files(name, read, seen, source_keys)
        holders = [seen[i] for i in sorted(set(matched.column(_FILE).to_pylist()))]
        kept = _cast_to_table(self._read_files(name, read, holders, None).join(
            source_keys, keys, join_type="left anti"), read)
        if source is None:  # a delete: every stored row of its keys goes
            result = UpsertResult(0, matched.num_rows)
        else:
            updated = matched.select(keys).group_by(keys).aggregate([]).num_rows
            result = UpsertResult(source.num_rows - updated, updated)
            kept = pa.concat_tables([source, kept])
        files = self._write_arrow(name, kept, read) if kept.num_rows else []
        rewritten = {f.log_path for f in holders}
        checked = {f.log_path for f in seen}

        def attempt(current: DeltaTable) -> object:
            if _done(current, app_id, version):
                return _SKIPPED
            _check_readable(current, name)
            active = self._active_files(current)
            gone = rewritten - {f.log_path for f in active}
            if gone:
                raise _ReadChanged(f"{len(gone)} file(s) it rewrites were removed, first "
                                   f"{sorted(gone)[0]} (now version {current.version()})")
            added = [f for f in _within(active, scope) if f.log_path not in checked]
            clashing = self._keys_in_files(name, current, added, source_keys)
            if clashing.num_rows:
                first = added[clashing.column(_FILE)[0].as_py()].log_path
                raise _ReadChanged(f"{first} was added with rows of its keys "
                                   f"(now version {current.version()})")
            checked.update(f.log_path for f in added)
            removes = _removes(holders, name)
            current.create_write_transaction(
                [*removes, *(f.add_action() for f in files)], mode="append",
                schema=current.schema(), partition_by=_partition_columns(current),
                commit_properties=properties,
            )
            return result

        operation = "upsert" if source is not None else "delete_rows"
        return self._commit_files(name, operation, files, attempt, since=read.version(),
                                  landed=result, properties=properties)

    def _keys_in_files(
        self, name: str, table: DeltaTable, files: list[_ActiveFile], keys: pa.Table
    ) -> pa.Table:
        """The rows of ``keys`` the files hold (only their key columns are read), each with
        the index of its file in ``files`` as column ``_FILE``."""
        stored = self._read_files(name, table, files, keys.column_names)
        # Acero hashes the right input: at commit time, the few files added since the read,
        # not the batch's keys (edge case 14). The keys are unique (_check_keys), so the inner
        # join holds exactly the files' rows that match one.
        return keys.join(stored, keys.column_names, join_type="inner")

    def _read_files(
        self, name: str, table: DeltaTable, files: list[_ActiveFile],
        columns: Sequence[str] | None,
    ) -> pa.Table:
        """The files' rows in one table, with the index of each row's file as ``_FILE``."""
        schema = pa.schema(table.schema().to_arrow())
        parts = set(_partition_columns(table))
        wanted = list(columns) if columns is not None else schema.names
        target = pa.schema([schema.field(c).with_nullable(True) for c in wanted])
        read = [
            (stored := _read_file(os.path.join(self.table_path(name), f.path), f, parts,
                                  target)).append_column(
                _FILE, pa.array([i] * stored.num_rows, pa.int32()))
            for i, f in enumerate(files)
        ]
        return pa.concat_tables(read) if read else target.append(
            pa.field(_FILE, pa.int32())).empty_table()

    def _record_step(self, name: str, operation: str, properties: CommitProperties,
                     app_id: str, version: int, since: int) -> UpsertResult:
        """A commit with no files, so a replay of the step is skipped (edge case 10)."""
        def attempt(current: DeltaTable) -> object:
            if _done(current, app_id, version):
                return _SKIPPED
            current.create_write_transaction(
                [], mode="append", schema=current.schema(),
                partition_by=_partition_columns(current), commit_properties=properties,
            )
            return UpsertResult(0, 0)

        outcome = self._commit_loop(name, operation, attempt)
        if outcome is _SKIPPED and self._committed_since(name, since, properties):  # (17)
            return UpsertResult(0, 0)
        return outcome if isinstance(outcome, UpsertResult) else UpsertResult(0, 0, False)

    def replace_partitions(
        self,
        name: str,
        df: DataFrame,
        *,
        predicate: ReplacePredicate,
        partition_by: Sequence[str] | None = None,
        app_id: str,
        version: int,
        metadata: Mapping[str, Any],
        read_version: int | None = None,
    ) -> bool:
        """See :meth:`DeltaTables.replace_partitions`. Delivery: exactly once per step."""
        properties = _commit_properties(metadata, app_id, version, "replace_partitions")
        table = self._ensure_table(name, df.schema, partition_by, metadata)
        columns = _partition_columns(table)
        check_partition_predicate(predicate, columns)
        if _done(table, app_id, version):
            return False
        df = _conform(df, table, name)
        files = self._write_files(name, df, table)
        try:
            self._check_inside(name, files, predicate, table)
        except BaseException:
            self._discard(name, files)
            raise
        if read_version == TABLE_MISSING:  # computed from no rows: any row in range conflicts
            in_range_before: set[str] = set()
            since = TABLE_MISSING
        else:
            read = table if read_version is None else self._load(name, read_version)
            if read is None:
                raise ClickstreamError(f"replace_partitions on table {name!r}: version "
                                       f"{read_version} is not in the table's history")
            in_range_before = {f.log_path for f in self._files_in(name, read, predicate)}
            since = read.version()

        def attempt(current: DeltaTable) -> object:
            if _done(current, app_id, version):
                return _SKIPPED
            removed = self._files_in(name, current, predicate)
            if {f.log_path for f in removed} != in_range_before and self._data_changed_in(
                    name, predicate, current, since=since):  # edge case 16
                raise CommitConflictError(
                    f"replace_partitions on table {name!r}: a concurrent commit changed files in "
                    f"the range {predicate!r} (now version {current.version()}); nothing was "
                    "committed. Recompute the range from the new snapshot, then retry the step."
                )
            removes = _removes(removed, name)
            current.create_write_transaction(
                [*removes, *(f.add_action() for f in files)], mode="append",
                schema=current.schema(), partition_by=columns, commit_properties=properties,
            )
            return True

        outcome = self._commit_files(name, "replace_partitions", files, attempt,
                                     since=table.version(), landed=True,
                                     properties=properties)
        return outcome is not _SKIPPED

    # -- readers ---------------------------------------------------------------------------

    def read(
        self,
        name: str,
        columns: Sequence[str] | None = None,
        partition_filter: PartitionFilter | None = None,
        *,
        schema: StructType | None = None,
        version: int | None = None,
    ) -> DataFrame:
        """See :meth:`DeltaTables.read`. Reads exactly the active rows of one snapshot."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        spark = self._need_spark("read")
        path = self.table_path(name)
        table = self._load(name, version)
        if table is None:
            if schema is None:
                raise ClickstreamError(
                    f"table {name!r} does not exist at {path}; write to it first, or pass "
                    "schema= to read a missing table as empty"
                )
            return _project(spark.createDataFrame([], schema), columns, name)
        _check_readable(table, name)
        full = StructType.fromJson(json.loads(table.schema().to_json()))
        parts = _partition_columns(table)
        files = self._active_files(table)
        if partition_filter:
            _check_filter_columns(partition_filter, parts, name)
            wanted = filter_alternatives(partition_filter)
            files = [f for f in files if filter_matches(wanted, f.partition_values)]
        if not files:
            return _project(spark.createDataFrame([], full), columns, name)
        if version is not None:
            _check_not_vacuumed(path, files, name, version, lambda: self.version(name))
        fast: list[str] = []
        slow: dict[tuple, list[str]] = {}
        for f in files:
            if _spark_reads_same(f, parts):
                fast.append(os.path.join(path, f.path))
            else:  # edge case 4: partition values as literals from the log
                key = tuple(f.partition_values.get(c) for c in parts)
                slow.setdefault(key, []).append(os.path.join(path, f.path))
        frames = []
        if fast:  # one scan; Spark takes partition values from the (checked) folder names
            frames.append(spark.read.schema(full).option("basePath", path).parquet(*fast))
        data = StructType([field for field in full.fields if field.name not in parts])
        for key, group in slow.items():
            scan = spark.read.schema(data).parquet(*group)
            literals = [
                F.lit(value).cast(full[c].dataType).alias(c)
                for c, value in zip(parts, key, strict=True)
            ]
            frames.append(scan.select(*data.names, *literals))
        result = functools.reduce(lambda a, b: a.unionByName(b), frames).select(*full.names)
        return _project(result, columns, name)

    def largest_by_partition(
        self, name: str, column: str, partition_column: str,
        partition_filter: PartitionFilter | None = None,
    ) -> dict[PartitionValue, Any]:
        """From the files' ``maxValues`` statistics in the log: no data is read (7)."""
        table = self._load(name)
        if table is None:
            return {}
        _check_readable(table, name)  # a file's maximum may be a deleted row's
        actions = pa.table(table.get_add_actions(flatten=True))
        parts = _partition_columns(table)
        values = {c: actions.column(f"partition.{c}").to_pylist() for c in parts}
        stat = f"max.{column}"
        highs = (actions.column(stat).to_pylist() if stat in actions.column_names
                 else [None] * actions.num_rows)
        alternatives = filter_alternatives(partition_filter) if partition_filter else None
        largest: dict[PartitionValue, Any] = {}
        for i, high in enumerate(highs):
            strings = {c: partition_string(values[c][i]) for c in parts}
            if alternatives is not None and not filter_matches(alternatives, strings):
                continue
            key = values[partition_column][i]
            known = largest.get(key, high)
            largest[key] = None if high is None or known is None else max(high, known)
        return largest

    def row_count(self, name: str, *, version: int | None = None) -> int:
        """From each file's ``numRecords`` in the log (7); a table written by another engine
        without it is counted from the Parquet footers. No rows are read either way."""
        table = self._require(name, version)
        _check_readable(table, name)  # deletion vectors would make numRecords too many
        actions = pa.table(table.get_add_actions(flatten=True))
        if "num_records" in actions.column_names and not actions.column("num_records").null_count:
            return int(pc.sum(actions.column("num_records")).as_py() or 0)
        return table.to_pyarrow_dataset().count_rows()

    def head_arrow(self, name: str, rows: int, *, version: int | None = None) -> pa.Table:
        """Reads only as many files as the rows need."""
        table = self._require(name, version)
        _check_readable(table, name)
        return table.to_pyarrow_dataset().head(rows)

    def read_arrow(
        self,
        name: str,
        partition_filter: PartitionFilter | None = None,
        columns: Sequence[str] | None = None,
        *,
        version: int | None = None,
    ) -> pa.Table:
        table = self._load(name, version)
        if table is None:
            raise ClickstreamError(
                f"table {name!r} does not exist at {self.table_path(name)}; nothing to read"
            )
        _check_readable(table, name)  # deltalake's own refusal named no way forward
        expression = None
        if partition_filter:
            _check_filter_columns(partition_filter, _partition_columns(table), name)
            expression = _arrow_filter(partition_filter)
        return table.to_pyarrow_table(
            columns=list(columns) if columns else None, filters=expression
        )

    # -- maintenance -----------------------------------------------------------------------

    def optimize(
        self, name: str, partition_filter: PartitionFilter | None = None
    ) -> dict[str, Any]:
        self._require(name)  # a missing table raises before its folder gets a lock file
        with exclusive(Path(self.table_path(name)) / OPTIMIZE_LOCK):  # edge case 15
            return self._optimize(name, partition_filter)

    def _optimize(self, name: str, partition_filter: PartitionFilter | None) -> dict[str, Any]:
        table = self._require(name)  # loaded under the lock: after any other compaction
        alternatives: list[list[tuple[str, str, list[str]]] | None] = [None]
        named: set[str] = set()
        if partition_filter:
            _check_filter_columns(partition_filter, _partition_columns(table), name)
            conjunctions = [  # null partitions are compacted here (edge case 19)
                [(c, "in", [v for v in values if v is not None]) for c, values in alt.items()]
                for alt in filter_alternatives(partition_filter)]
            alternatives = [c for c in conjunctions if all(values for *_, values in c)]
            named = {column for conjunction in conjunctions for column, *_ in conjunction}
        here = [f for f in _within(self._active_files(table), partition_filter)
                if _compacted_here(f.partition_values, named)]
        metrics = self._compact_here(name, table, here)
        tildes: dict[str, set[str]] = {}
        for f in here:
            for column, value in f.partition_values.items():
                if value is not None and "~" in value:
                    tildes.setdefault(column, set()).add(value)
        left_out = [(column, "not in", sorted(values)) for column, values in tildes.items()]
        properties = CommitProperties(custom_metadata={"cause": "maintenance: optimize"})
        try:
            for conjunction in alternatives:
                done = table.optimize.compact(
                    partition_filters=[*(conjunction or []), *left_out] or None,
                    commit_properties=properties,
                )
                table.update_incremental()
                for counter in ("numFilesAdded", "numFilesRemoved"):  # of every alternative
                    metrics[counter] += done[counter]
        except CommitFailedError as exc:
            raise CommitConflictError(
                f"optimize on table {name!r} conflicted with a concurrent commit ({exc}); data "
                "is unchanged. Compaction is idempotent: run it again later."
            ) from exc
        return metrics

    def _compact_here(self, name: str, table: DeltaTable, files: list[_ActiveFile]
                      ) -> dict[str, Any]:
        """Each partition's files into one, written by this engine (edge case 19); a commit
        per ``COMPACTED_HERE_BYTES`` of files, so the driver holds that much at a time."""
        by_partition: dict[tuple[tuple[str, str | None], ...], list[_ActiveFile]] = {}
        for f in files:
            by_partition.setdefault(_partition_key(f.partition_values), []).append(f)
        chunks: list[list[_ActiveFile]] = [[]]
        for group in (g for g in by_partition.values() if len(g) > 1):
            if chunks[-1] and sum(f.size for f in chunks[-1]) >= COMPACTED_HERE_BYTES:
                chunks.append([])
            chunks[-1].extend(group)
        metrics = {"numFilesAdded": 0, "numFilesRemoved": 0}
        properties = CommitProperties(custom_metadata={"cause": "maintenance: optimize"},
                                      max_commit_retries=0)  # _commit_loop retries
        if chunks[0]:
            _check_readable(table, name)  # edge case 9: a deletion vector would be undone
        for chunk in filter(None, chunks):
            rows = self._read_files(name, table, chunk, None).drop_columns([_FILE])
            written = self._write_arrow(name, _cast_to_table(rows, table), table)
            compacted = {f.log_path for f in chunk}

            def attempt(current: DeltaTable, chunk: list[_ActiveFile] = chunk,
                        written: list[_WrittenFile] = written,
                        compacted: set[str] = compacted) -> object:
                gone = compacted - {f.log_path for f in self._active_files(current)}
                if gone:
                    raise CommitConflictError(
                        f"optimize on table {name!r}: {len(gone)} file(s) it compacts were "
                        f"rewritten by a concurrent commit, first {sorted(gone)[0]}; data is "
                        "unchanged. Compaction is idempotent: run it again later.")
                current.create_write_transaction(
                    [*_removes(chunk, name, data_change=False),
                     *(f.add_action(data_change=False) for f in written)], mode="append",
                    schema=current.schema(), partition_by=_partition_columns(current),
                    commit_properties=properties,
                )
                return None

            self._commit_files(name, "optimize", written, attempt, since=table.version(),
                               landed=None, properties=properties)
            metrics["numFilesAdded"] += len(written)
            metrics["numFilesRemoved"] += len(chunk)
        if metrics["numFilesRemoved"]:
            table.update_incremental()
        return metrics

    def vacuum(
        self, name: str, retention_hours: int, *, enforce_retention_duration: bool = True
    ) -> list[str]:
        if retention_hours < 0:
            raise ConfigError(f"retention_hours must be >= 0, got {retention_hours}")
        table = self._require(name)
        try:
            return table.vacuum(
                retention_hours=retention_hours, dry_run=False, full=True,  # edge case 1
                enforce_retention_duration=enforce_retention_duration,
                commit_properties=CommitProperties(
                    custom_metadata={"cause": "maintenance: vacuum"}
                ),
            )
        except DeltaError as exc:
            raise ClickstreamError(f"vacuum of table {name!r} refused: {exc}") from exc

    def checkpoint(self, name: str) -> None:
        self._require(name).create_checkpoint()

    def set_retention(self, name: str, log_hours: int, file_hours: int) -> bool:
        wanted = retention_properties(log_hours, file_hours)

        def attempt(table: DeltaTable) -> bool:
            configuration = table.metadata().configuration
            if all(configuration.get(key) == value for key, value in wanted.items()):
                return False
            table.alter.set_table_properties(
                wanted, commit_properties=CommitProperties(
                    max_commit_retries=0,  # edge case 3
                    custom_metadata={"cause": "maintenance: retention"}))
            return True

        return self._commit_loop(name, "set retention", attempt)

    # -- internals -------------------------------------------------------------------------

    def _need_spark(self, what: str) -> SparkSession:
        if self._spark is None:
            raise ConfigError(f"{what} needs a SparkSession; pass spark= to open_tables()")
        return self._spark

    def _load(self, name: str, version: int | None = None) -> DeltaTable | None:
        path = self.table_path(name)
        try:
            return DeltaTable(path, version=version)
        except TableNotFoundError as exc:
            if version is None or not DeltaTable.is_deltatable(path):
                return None
            raise VersionVacuumedError(  # an older commit than the log keeps (edge case 18)
                f"table {name!r} as of version {version} cannot be read: its log no longer "
                f"holds that commit (latest: {self.version(name)}; Delta deletes commits older "
                f"than the table's {LOG_RETENTION} at a checkpoint). {VACUUMED_WAY_FORWARD}"
            ) from exc
        except DeltaError as exc:
            if version is None or not DeltaTable.is_deltatable(path):
                raise
            raise ClickstreamError(
                f"table {name!r} has no version {version}; latest is {self.version(name)} "
                "(or the log of that version was cleaned up)"
            ) from exc

    def _require(self, name: str, version: int | None = None) -> DeltaTable:
        table = self._load(name, version)
        if table is None:
            raise ClickstreamError(f"table {name!r} does not exist at {self.table_path(name)}")
        return table

    def _ensure_table(
        self,
        name: str,
        schema: StructType,
        partition_by: Sequence[str] | None,
        metadata: Mapping[str, Any],
    ) -> DeltaTable:
        """Load the table, creating it (its own commit, edge case 10) on the first write."""
        table = self._load(name)
        if table is None:
            if partition_by is None:
                raise ConfigError(
                    f"table {name!r} does not exist yet; pass partition_by= so it can be created"
                )
            _check_partition_types(schema, partition_by, name)
            try:
                delta_schema = DeltaSchema.from_json(created_schema(name, schema).json())
            except Exception as exc:  # unsupported Spark type (void, interval, ...)
                raise ClickstreamError(
                    f"cannot create table {name!r}: schema not representable in Delta: {exc}"
                ) from exc
            try:
                DeltaTable.create(
                    self.table_path(name), delta_schema, mode="ignore",
                    partition_by=list(partition_by),
                    commit_properties=CommitProperties(
                        custom_metadata={**metadata, "cause": "create table"}
                    ),
                )
            except DeltaError:
                if not self.exists(name):  # lost a creation race: the winner's table is fine
                    raise
            table = self._require(name)
        if partition_by is not None and list(partition_by) != _partition_columns(table):
            raise ClickstreamError(
                f"table {name!r} is partitioned by {_partition_columns(table)}, "
                f"not {list(partition_by)}; nothing was written"
            )
        return table

    def _write_files(self, name: str, df: DataFrame, table: DeltaTable) -> list[_WrittenFile]:
        """Executors write Parquet files into the table folder; returns what they wrote."""
        parts = _partition_columns(table)
        task = functools.partial(
            write_task, root=self.table_path(name), partition_by=parts,
            file_schema=_file_schema(table),
        )
        # Sorted by partition within each task: one open file at a time, whole row groups (13).
        spark_df = df.repartition(*parts).sortWithinPartitions(*parts) if parts else df
        return self._written(name, table, spark_df.mapInArrow(task, WRITTEN_FILE_ROWS).collect())

    def _write_arrow(self, name: str, rows: pa.Table, table: DeltaTable) -> list[_WrittenFile]:
        """The driver writes rows it holds, as one Spark task would (edge case 13)."""
        parts = _partition_columns(table)
        if parts:
            rows = rows.sort_by([(c, "ascending") for c in parts])
        out = pa.Table.from_batches(list(write_task(
            iter(rows.to_batches(max_chunksize=65_536)), root=self.table_path(name),
            partition_by=parts, file_schema=_file_schema(table),
        )))
        return self._written(name, table, [SimpleNamespace(**r) for r in out.to_pylist()])

    def _written(self, name: str, table: DeltaTable, rows: Sequence[Any]) -> list[_WrittenFile]:
        files = [
            _WrittenFile(
                r.path, r.size, json.loads(r.partition_values), r.modification_time, r.stats
            )
            for r in rows
        ]
        try:
            _check_not_null(files, table, name)  # edge case 8
        except BaseException:
            self._discard(name, files)
            raise
        return files

    def _commit_files(
        self,
        name: str,
        operation: str,
        files: list[_WrittenFile],
        attempt: Callable[[DeltaTable], object],
        *,
        since: int,
        landed: object,
        properties: CommitProperties,
    ) -> object:
        """Commit loop for written files; deletes them when they end up uncommitted.

        ``since`` is a version loaded before the files were written: a commit of theirs, even
        one whose call raised, comes after it (edge case 17). ``landed`` is the outcome when an
        attempt finds the step done by a commit of these very files: an earlier attempt's,
        whose call raised (a lost acknowledgement), so this call committed after all.
        """
        try:
            outcome = self._commit_loop(name, operation, attempt)
        except BaseException:
            self._discard(name, files, since=since)  # edge case 1
            raise
        if outcome is _SKIPPED:
            if self._committed_since(name, since, properties):  # edge case 17
                return landed
            self._discard(name, files, since=since)  # edge case 2
        return outcome

    def _committed_since(self, name: str, since: int, properties: CommitProperties) -> bool:
        """Whether a commit after version ``since`` is this call's own (its ``write_id``),
        one that landed while its call raised (edge case 17)."""
        table = self._load(name)
        write_id = (properties.custom_metadata or {}).get(WRITE_ID)
        if table is None or write_id is None:
            return False
        try:
            return any(action.get("commitInfo", {}).get(WRITE_ID) == write_id
                       for action in self._commit_actions(name, since, table.version()))
        except OSError as exc:  # a commit gone from the log (edge case 18): cannot tell
            log.warning("table %r: a commit after version %d is unreadable (%s); the step "
                        "is taken for another run's", name, since, exc)
            return False

    def _commit_loop(
        self, name: str, operation: str, attempt: Callable[[DeltaTable], _T]
    ) -> _T:
        """Run ``attempt`` on a fresh snapshot until it commits (edge case 3)."""
        first: Exception | None = None
        table: DeltaTable | None = None
        for number in range(1, self._max_attempts + 1):
            if table is None:
                table = self._require(name)
            if self._before_commit is not None:
                self._before_commit(name, number)
            tried = table.version()
            try:
                return attempt(table)
            except CommitFailedError as exc:
                first = first or exc
                table.update_incremental()  # a retry reads only the commits it lost to (14)
                if table.version() == tried:  # edge case 20: no race lost, a refusal
                    raise TableRefusedError(
                        f"{operation} on table {name!r} was refused: {exc}. Nothing was "
                        "committed, and a retry would be refused alike: the table must change "
                        f"first (a feature this engine cannot write: the delta-spark engine, "
                        f"{ENV_NAMES['delta_engine']}=delta-spark, writes it)") from exc
                log.info("%s on %s: commit attempt %d conflicted: %s", operation, name, number, exc)
            except DeltaError as exc:  # not a conflict: retrying would fail the same way
                raise ClickstreamError(
                    f"{operation} on table {name!r} failed: {exc}. Nothing was committed "
                    "unless the error came after the commit (a post-commit step such as a "
                    "checkpoint, edge case 17): the table's history then shows it"
                ) from exc
            if number < self._max_attempts:
                wait_before_retry(number, self._backoff)
        raise CommitConflictError(
            f"{operation} on table {name!r} still conflicted after {self._max_attempts} commit "
            f"attempts; nothing was committed (first cause: {first}). Retrying the step is safe: "
            "it commits at most once per (app_id, version)."
        )

    def _discard(self, name: str, files: list[_WrittenFile], *, since: int | None = None) -> None:
        """Delete written files unless a commit references them (an ambiguous commit).

        With ``since`` (files offered to commits), a file any commit after that version adds
        is kept even if a later commit removed it again (edge case 17).
        """
        if not files:
            return
        try:
            table = self._load(name)
            active = {f.path for f in self._active_files(table)} if table is not None else set()
        except (DeltaError, OSError) as exc:  # often beside the error being raised: not
            # its place to replace it. Unreferenced, the files are invisible (edge case 1).
            log.warning("could not tell which of the %d files written to table %r a commit "
                        "references (%s); uncommitted ones stay until a vacuum deletes them",
                        len(files), name, exc)
            return
        if since is not None and table is not None:
            added = self._added_since(name, since, table.version())
            if added is None:  # cannot tell: vacuum deletes them once old (edge case 1)
                return
            active |= added
        root = self.table_path(name)
        for f in files:
            if f.path not in active:
                try:
                    os.remove(os.path.join(root, f.path))
                except OSError as exc:  # vacuum removes it later (edge case 1)
                    log.warning("could not delete uncommitted file %s: %s", f.path, exc)

    def _added_since(self, name: str, since: int, latest: int) -> set[str] | None:
        """Paths on disk (decoded, edge case 12) the commits ``since + 1 .. latest`` add; None
        if one cannot be read."""
        try:
            return {unquote(action["add"]["path"])
                    for action in self._commit_actions(name, since, latest) if "add" in action}
        except OSError as exc:
            log.warning("table %r: a commit after version %d is unreadable (%s); its writer's "
                        "files are kept for vacuum", name, since, exc)
            return None

    def _commit_actions(self, name: str, since: int, latest: int) -> Iterator[dict]:
        """The actions of commits ``since + 1 .. latest``, read from their log entries (local
        file system, edge case 11)."""
        log_dir = Path(self.table_path(name)) / "_delta_log"
        for version in range(since + 1, latest + 1):
            with open(log_dir / f"{version:020d}.json") as commit:
                for line in commit:
                    if line.strip():
                        yield json.loads(line)

    def _active_files(self, table: DeltaTable) -> list[_ActiveFile]:
        actions = pa.table(table.get_add_actions(flatten=True))
        parts = _partition_columns(table)
        paths = actions.column("path").to_pylist()
        sizes = actions.column("size_bytes").to_pylist()
        values = [actions.column(f"partition.{c}").to_pylist() for c in parts]
        return [
            _ActiveFile(
                log_path, unquote(log_path), size,
                {c: partition_string(v[i]) for c, v in zip(parts, values, strict=True)},
            )
            for i, (log_path, size) in enumerate(zip(paths, sizes, strict=True))
        ]

    def _files_in(
        self, name: str, table: DeltaTable, predicate: ReplacePredicate
    ) -> list[_ActiveFile]:
        """Active files inside a partition range (exact: the predicate is partition-only)."""
        files = self._active_files(table)
        if isinstance(predicate, str):
            # Judged in Spark SQL, as _check_inside judges the new rows: delta-rs's own SQL
            # reads a string literal's backslash as itself, so for a client id holding one
            # ('a\\b' in Spark's literal) it chose no file, and the replace kept the old rows
            # beside the new ones.
            keys = {_partition_key(f.partition_values) for f in files}
            outside = set(self._outside_sql(keys, predicate, table))
            return [f for f in files if _partition_key(f.partition_values) not in outside]
        return _within(files, predicate)

    def _data_changed_in(self, name: str, predicate: ReplacePredicate, current: DeltaTable,
                         *, since: int) -> bool:
        """Whether a commit after version ``since`` added or removed rows inside the range
        (edge case 16): an add or remove with ``dataChange`` true (the default) there, or one
        whose partition is unknown."""
        touched: set[tuple] = set()
        for action in self._commit_actions(name, since, current.version()):
            change = action.get("add") or action.get("remove")
            if change is None or change.get("dataChange") is False:
                continue
            if change.get("partitionValues") is None:
                return True
            touched.add(_partition_key(change["partitionValues"]))
        return len(self._outside(touched, predicate, current)) < len(touched)

    def _outside(self, values: set[tuple], predicate: ReplacePredicate,
                 table: DeltaTable) -> list[tuple]:
        """The partitions of ``values`` (sorted ``(column, value)`` tuples) outside the range."""
        if isinstance(predicate, str):
            return self._outside_sql(values, predicate, table)
        alternatives = filter_alternatives(predicate)
        return [v for v in values if not filter_matches(alternatives, dict(v))]

    def _check_inside(
        self,
        name: str,
        files: list[_WrittenFile],
        predicate: ReplacePredicate,
        table: DeltaTable,
    ) -> None:
        """Every new row must lie in the replaced range, or it would duplicate rows outside."""
        outside = self._outside({_partition_key(f.partition_values) for f in files},
                                predicate, table)
        if outside:
            raise ClickstreamError(
                f"replace_partitions on table {name!r}: {len(outside)} partition(s) of the new "
                f"rows lie outside the range {predicate!r}, first {dict(sorted(outside)[0])}; "
                "nothing was committed. Filter the DataFrame to the range or widen the range."
            )

    def _outside_sql(self, values: set[tuple], predicate: str, table: DeltaTable) -> list[tuple]:
        if not values:
            return []
        from pyspark.sql import functions as F
        from pyspark.sql.types import IntegerType, StringType, StructField, StructType

        spark = self._need_spark("replace_partitions")
        parts = _partition_columns(table)
        types = StructType.fromJson(json.loads(table.schema().to_json()))
        listed = list(values)
        raw = spark.createDataFrame(
            [(i, *(dict(v).get(c) for c in parts)) for i, v in enumerate(listed)],
            StructType([StructField("_i", IntegerType()),
                        *(StructField(c, StringType()) for c in parts)]),
        )
        typed = raw.select("_i", *(F.col(c).cast(types[c].dataType).alias(c) for c in parts))
        outside = typed.where(~F.coalesce(F.expr(predicate), F.lit(False))).select("_i")
        return [listed[row["_i"]] for row in outside.collect()]  # the values as given


# ---------------------------------------------------------------------------------------------
# Executor side: runs inside Spark tasks (mapInArrow), so it imports only pyarrow.


def _spark_reads_same(f: _ActiveFile, parts: list[str]) -> bool:
    """Would Spark's partition discovery give this file the log's partition values?"""
    folders = f.path.split("/")[:-1]
    if len(folders) != len(parts):
        return False
    for folder, column in zip(folders, parts, strict=True):
        name, sep, raw = folder.partition("=")
        if not sep or not raw or spark_unescape(name) != column:
            return False
        parsed = None if raw == HIVE_NULL else spark_unescape(raw)
        if parsed != f.partition_values.get(column):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Driver-side helpers.


def _commit_properties(
    metadata: Mapping[str, Any], app_id: str, version: int, operation: str
) -> CommitProperties:
    if not app_id or not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ConfigError(
            f"{operation}: app_id must be non-empty and version a non-negative int, "
            f"got app_id={app_id!r}, version={version!r}"
        )
    custom = {**metadata, "app_id": app_id, "app_version": version,
              WRITE_ID: uuid.uuid4().hex}  # edge case 17: tells this call's commit
    try:
        json.dumps(custom, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{operation}: commit metadata must be JSON-serialisable: {exc}") from exc
    # max_commit_retries=0: this module owns the retry loop (edge case 3).
    return CommitProperties(
        custom_metadata=custom,
        max_commit_retries=0,
        app_transactions=[Transaction(app_id, version, int(time.time() * 1000))],
    )


def _file_schema(table: DeltaTable) -> pa.Schema:
    """Columns stored in a data file: all but the partition columns, nullable."""
    parts = _partition_columns(table)
    return pa.schema(
        [f.with_nullable(True) for f in pa.schema(table.schema().to_arrow()) if f.name not in parts]
    )


def _partition_key(values: Mapping[str, str | None]) -> tuple[tuple[str, str | None], ...]:
    """Partition values (Delta strings) as the sorted pairs the range checks compare."""
    return tuple(sorted(values.items()))


def _within(files: list[_ActiveFile], scope: PartitionFilter | None) -> list[_ActiveFile]:
    if scope is None:
        return files
    alternatives = filter_alternatives(scope)
    return [f for f in files if filter_matches(alternatives, f.partition_values)]


def _compacted_here(values: Mapping[str, str | None], named: set[str]) -> bool:
    """Whether this engine compacts a partition itself, not deltalake (edge case 19): a value
    holding a ``~``, or null in a column the filter names (``named``)."""
    if any(value is not None and "~" in value for value in values.values()):
        return True
    return any(values.get(column) is None for column in named)


def _removes(files: list[_ActiveFile], name: str, *, data_change: bool = True
             ) -> list[RemoveAction]:
    """Remove actions for active files (decoded paths, edge case 12).

    Raises:
        ClickstreamError: a file's log path holds characters delta-rs would encode again (a
            raw non-ASCII path, as other engines may write): its remove would match no file
            and the rows would end up stored twice; nothing is committed.
    """
    raw = [f.log_path for f in files if not f.log_path.isascii() or " " in f.log_path]
    if raw:
        raise ClickstreamError(
            f"table {name!r}: {len(raw)} file(s) to rewrite are named in the log with "
            f"unencoded characters, first {raw[0]!r} (written by another engine); delta-rs "
            "cannot remove them exactly, so nothing was committed. Compact those partitions "
            "with the engine that wrote them, or use CLICKSTREAM_DELTA_ENGINE=delta-spark."
        )
    now = int(time.time() * 1000)
    return [RemoveAction(f.path, data_change, now, f.size, f.partition_values)
            for f in files]


def _done(table: DeltaTable, app_id: str, version: int) -> bool:
    committed = table.transaction_version(app_id)
    return committed is not None and committed >= version


def _partition_columns(table: DeltaTable) -> list[str]:
    return list(table.metadata().partition_columns)


def _check_partition_types(schema: StructType, partition_by: Sequence[str], name: str) -> None:
    fields = {f.name: f for f in schema.fields}
    for column in partition_by:
        if column not in fields:
            raise ConfigError(
                f"table {name!r}: partition column {column!r} is not in the DataFrame "
                f"(columns: {', '.join(fields)})"
            )
        kind = fields[column].dataType.typeName()
        if kind not in _PARTITION_TYPES:  # edge case 6
            raise ConfigError(
                f"table {name!r}: partition column {column!r} has type {kind}; use one of: "
                f"{', '.join(sorted(_PARTITION_TYPES))}"
            )


def _check_not_vacuumed(path: str, files: Sequence[_ActiveFile], name: str, version: int,
                        latest: Callable[[], int]) -> None:
    """An old version's log outlives its files: Spark would fail on the first missing path
    with no word of why. Reads of the current version are not checked (a vacuum keeps their
    files): a version pinned by its reader that is still the latest is checked, but a file
    missing there was not vacuumed. ``latest`` loads the log again: only asked once a file is
    missing."""
    gone = [f.path for f in files if not os.path.exists(os.path.join(path, f.path))]
    if gone and version >= latest():
        raise ClickstreamError(
            f"table {name!r} at version {version}, its latest, names {len(gone)} files that "
            f"are gone from {path}, e.g. {gone[0]!r}: deleted outside Delta (a vacuum keeps "
            "the latest version's files); restore them from a backup of the table folder")
    if gone:
        raise VersionVacuumedError(
            f"table {name!r} as of version {version} (read by time travel) needs {len(gone)} "
            f"of its {len(files)} files that are gone from {path}, e.g. {gone[0]!r}: a vacuum "
            "deleted them (table_maintenance deletes files removed longer ago than its "
            f"retention, 168 h by default). {VACUUMED_WAY_FORWARD}")


def _check_filter_columns(
    partition_filter: PartitionFilter | Sequence[PartitionFilter], parts: list[str], name: str
) -> None:
    used = {c for alt in filter_alternatives(partition_filter) for c in alt}
    unknown = sorted(used - set(parts))
    if unknown:
        raise ConfigError(
            f"table {name!r}: partition filter uses {', '.join(unknown)}, which are not partition "
            f"columns; use only: {', '.join(parts) or '(table is not partitioned)'}"
        )


def _without_nullability(kind: Any) -> Any:
    if isinstance(kind, dict):
        return {
            k: _without_nullability(v)
            for k, v in kind.items()
            if k not in ("nullable", "containsNull", "valueContainsNull", "metadata")
        }
    if isinstance(kind, list):
        return [_without_nullability(v) for v in kind]
    return kind


def _conform(df: DataFrame, table: DeltaTable, name: str) -> DataFrame:
    """Check ``df`` against the table schema (names, types; not nullability) and order it."""
    table_fields = json.loads(table.schema().to_json())["fields"]
    df_fields = {f["name"]: f for f in json.loads(df.schema.json())["fields"]}
    wanted = [f["name"] for f in table_fields]
    problems = []
    missing = [n for n in wanted if n not in df_fields]
    extra = [n for n in df_fields if n not in wanted]
    if missing:
        problems.append(f"missing columns {missing}")
    if extra:
        problems.append(f"unexpected columns {extra}")
    for field in table_fields:
        other = df_fields.get(field["name"])
        if other and _without_nullability(other["type"]) != _without_nullability(field["type"]):
            problems.append(f"{field['name']} is {other['type']}, table has {field['type']}")
    if problems:
        raise ClickstreamError(
            f"DataFrame does not match the schema of table {name!r}: {'; '.join(problems)}; "
            "nothing was written"
        )
    return df.select(*wanted)


def _read_file(path: str, f: _ActiveFile, partition_columns: set[str], target: pa.Schema
               ) -> pa.Table:
    """One active file's rows as ``target`` (nullable fields of the table's schema), partition
    columns filled in from the log (edge case 4)."""
    in_file = set(pq.read_schema(path).names)
    stored = pq.read_table(path, columns=[c for c in target.names
                                          if c in in_file and c not in partition_columns])
    for field in target:
        if field.name in partition_columns:
            value = f.partition_values.get(field.name)
            stored = stored.append_column(
                field.name, pa.array([value] * stored.num_rows, pa.string()).cast(field.type))
        elif field.name not in in_file:  # an older file, from before the column was added
            stored = stored.append_column(field.name, pa.nulls(stored.num_rows, field.type))
    return stored.select(target.names).cast(target)


def _cast_to_table(source: pa.Table, table: DeltaTable) -> pa.Table:
    target = pa.schema(table.schema().to_arrow())
    nullable = pa.schema([f.with_nullable(True) for f in target])
    return source.select(target.names).cast(nullable)


def _check_key_columns(keys: Sequence[str], df: DataFrame, name: str, operation: str) -> None:
    if not keys or set(keys) - set(df.columns):
        raise ConfigError(
            f"{operation} on {name!r}: keys {list(keys)} must be non-empty columns of the "
            f"DataFrame; its columns are {', '.join(df.columns)}"
        )


def _cast_to_columns(source: pa.Table, table: DeltaTable, name: str) -> pa.Table:
    """``source``'s columns (a subset of the table's) as the table types them."""
    target = pa.schema(table.schema().to_arrow())
    unknown = [c for c in source.column_names if c not in target.names]
    if unknown:
        raise ConfigError(f"{name!r} has no columns {unknown}; its columns are "
                          f"{', '.join(target.names)}")
    return source.cast(pa.schema([target.field(c).with_nullable(True)
                                  for c in source.column_names]))


def _check_keys(source: pa.Table, keys: list[str], name: str, operation: str = "upsert"
                ) -> None:
    for key in keys:
        nulls = source.column(key).null_count
        if nulls:
            raise ClickstreamError(
                f"{operation} on {name!r}: {nulls} row(s) have a null key {key!r}; nothing was "
                "written. Quarantine or fix them first."
            )
    if source.num_rows:
        counts = source.select(keys).group_by(keys).aggregate([([], "count_all")])
        dupes = counts.filter(pc.greater(counts.column("count_all"), 1))
        if dupes.num_rows:
            first = {k: dupes.column(k)[0].as_py() for k in keys}
            raise ClickstreamError(
                f"{operation} on {name!r}: {dupes.num_rows} key(s) occur more than once in the "
                f"batch, first {first}; nothing was written. Deduplicate the batch first."
            )


def _check_partition_keys(source: pa.Table, keys: list[str], name: str) -> None:
    """An empty string in a partition column is stored as null (edge case 5), which no key
    matches: every upsert of that row would insert it again."""
    for key in keys:
        column = source.column(key)
        if pa.types.is_string(column.type) and pc.any(pc.equal(column, "")).as_py():
            raise ClickstreamError(
                f"upsert into {name!r}: key column {key!r} is a partition column and holds "
                "empty strings, which Delta stores as null and no upsert can match again; "
                "nothing was written. Quarantine or fix those rows first."
            )


def _check_not_null(files: list[_WrittenFile], table: DeltaTable, name: str) -> None:
    required = [f["name"] for f in json.loads(table.schema().to_json())["fields"]
                if not f.get("nullable", True)]
    parts = set(_partition_columns(table))
    for column in required:
        if column in parts:
            nulls = sum(1 for f in files if f.partition_values.get(column) is None)
        else:
            nulls = sum(json.loads(f.stats)["nullCount"].get(column, 0) for f in files)
        if nulls:
            raise ClickstreamError(
                f"table {name!r}: {nulls} {'file(s)' if column in parts else 'row(s)'} have null "
                f"in non-nullable column {column!r}; nothing was committed"
            )


def _check_readable(table: DeltaTable, name: str) -> None:
    protocol = table.protocol()
    features = set(protocol.reader_features or [])
    mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if "deletionVectors" in features or mapping != "none":  # edge case 9
        raise ClickstreamError(
            f"table {name!r} uses deletion vectors or column mapping, which a file-list Spark "
            "read cannot apply; read it with CLICKSTREAM_DELTA_ENGINE=delta-spark"
        )


def _arrow_filter(partition_filter: PartitionFilter) -> Any:
    import pyarrow.dataset as ds

    filter_alternatives(partition_filter)  # its checks: a column listing no values, ...
    expression = None
    for column, values in partition_filter.items():
        items = list(values) if isinstance(values, list | tuple | set | frozenset) else [values]
        items = [None if v == "" else v for v in items]  # the null partition, as read's (5)
        present = [v for v in items if v is not None]
        test = ds.field(column).isin(present) if present else None
        if len(present) < len(items):
            test = ds.field(column).is_null() if test is None else test | ds.field(column).is_null()
        expression = test if expression is None else expression & test
    return expression


def _project(df: DataFrame, columns: Sequence[str] | None, name: str) -> DataFrame:
    if not columns:
        return df
    unknown = [c for c in columns if c not in df.columns]
    if unknown:
        raise ConfigError(
            f"table {name!r} has no column(s) {unknown}; columns: {', '.join(df.columns)}"
        )
    return df.select(*columns)

