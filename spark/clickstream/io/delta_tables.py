"""The Delta table layer: one small interface, two engines, chosen by ``Config.delta_engine``.

Every job writes and reads Delta tables through :class:`DeltaTables`, never through an engine
directly, so the embedded profile (``deltalake``, the engine that runs on this machine) and the
cluster profile (``delta-spark``, which needs JVM jars) share one code path above this module.

Tables are addressed by name (a folder under ``Config.warehouse``) and partitioned by the
caller's columns, ``client_id`` first, so one client's write never rewrites another client's
files. Every write commits once, atomically, carries commit metadata (run id, cause) and an
application transaction ``(app_id, version)``: a replayed micro-batch or job step whose version
the table has already seen commits nothing (delta-rs ``CommitProperties.app_transactions``,
Delta's ``txn`` action).

This module imports neither ``deltalake`` nor the delta-spark Python package: the engine is
imported only when selected.
"""

from __future__ import annotations

import datetime as dt
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clickstream.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from clickstream.config import Config

PartitionValue = str | int | bool | dt.date | None
"""One partition column value: str, int, bool, date or None (Delta's null partition)."""

PartitionFilter = Mapping[str, PartitionValue | Sequence[PartitionValue]]
"""Partition columns to values: ``{"client_id": "c1", "event_date": [d1, d2]}``.

Entries are ANDed; a sequence value means IN.
"""

RECENT_COMMITS = 200  # newest_commit reads these first, then the whole log
TABLE_MISSING = -1  # version() of a table that does not exist; a replace's read_version too
# The table properties both engines honour: how long commits are kept, and how long a
# checkpoint keeps the record of a removed file (vacuum deletes an unrecorded file by its age).
LOG_RETENTION = "delta.logRetentionDuration"
FILE_RETENTION = "delta.deletedFileRetentionDuration"
DEFAULT_LOG_RETENTION_HOURS = 720  # Delta's default: 30 days


def created_schema(name: str, schema: StructType) -> StructType:
    """The schema a missing table is created with: the written frame's, with the columns the
    product's contract (``clickstream.tables``) declares NOT NULL made so. A frame's nullability
    is an accident of how it was computed (parsed JSON is nullable everywhere), and tables were
    created nullable throughout: outside tools saw another schema than the contract's, and
    non-null columns were never enforced (``delta_rs_engine`` edge case 8)."""
    from pyspark.sql.types import StructField, StructType

    from clickstream.tables import ALL_TABLES

    spec = ALL_TABLES.get(name)
    if spec is None:
        return schema
    required = {f.name for f in spec.schema.fields if not f.nullable}
    return StructType([StructField(f.name, f.dataType, f.nullable and f.name not in required,
                                   f.metadata) for f in schema.fields])


def retention_value(hours: int) -> str:
    """A retention property's value, as Delta writes intervals."""
    return f"interval {int(hours)} hours"


def retention_properties(log_hours: int, file_hours: int) -> dict[str, str]:
    """The table properties ``DeltaTables.set_retention`` sets."""
    return {LOG_RETENTION: retention_value(log_hours), FILE_RETENTION: retention_value(file_hours)}


ReplacePredicate = PartitionFilter | Sequence[PartitionFilter] | str
"""Which partitions :meth:`DeltaTables.replace_partitions` replaces: a :data:`PartitionFilter`,
a sequence of them (ORed), or a SQL predicate string over partition columns only
(``"client_id = 'c1' AND event_date >= '2024-01-01'"``), read as Spark SQL by both engines:
a backslash in a string literal escapes, as :func:`sql_literal` writes them."""


@dataclass(frozen=True)
class AppendResult:
    """Outcome of :meth:`DeltaTables.append_once`; true when this call committed.

    Attributes:
        committed: False when the (app_id, version) step was already committed, so nothing
            was written this time.
        rows: rows this call committed (from the written files' statistics: no extra Spark
            job counts them); 0 when nothing was committed.
    """

    committed: bool
    rows: int = 0

    def __bool__(self) -> bool:
        return self.committed


@dataclass(frozen=True)
class UpsertResult:
    """Outcome of :meth:`DeltaTables.upsert`.

    Attributes:
        inserted: rows whose key was new.
        updated: rows whose key existed and were overwritten by the source row.
        committed: False when the (app_id, version) step was already committed, so nothing
            was written this time.
    """

    inserted: int
    updated: int
    committed: bool = True


@dataclass(frozen=True)
class DeleteResult:
    """Outcome of :meth:`DeltaTables.delete_rows`.

    Attributes:
        deleted: stored rows removed.
        committed: False when the (app_id, version) step was already committed.
    """

    deleted: int
    committed: bool = True


class DeltaTables(ABC):
    """Delta tables under one warehouse, read and written through one engine.

    Writers are atomic (one commit each: readers see the old or the new table, never half) and
    idempotent per ``(app_id, version)``: together with a source that replays from its last
    committed position, they give **exactly-once** results in the table.
    """

    @abstractmethod
    def table_path(self, name: str) -> str:
        """Absolute location of table ``name`` (``Config.table_path``)."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """True when table ``name`` has at least one commit."""

    @abstractmethod
    def version(self, name: str) -> int:
        """Latest committed version of ``name``; -1 when the table does not exist yet."""

    @abstractmethod
    def app_version(self, name: str, app_id: str) -> int | None:
        """Highest version committed under ``app_id`` to ``name``; None if never (or no table)."""

    @abstractmethod
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
        """Append ``df`` to ``name`` unless step ``(app_id, version)`` is already committed.

        Delivery guarantee: exactly once per ``(app_id, version)``. If the table already records
        ``version`` (or a later one) for ``app_id``, nothing is written and False is returned;
        a crash before the commit leaves only unreferenced files (removed by :meth:`vacuum`).
        The table is created on the first write with ``df``'s schema and ``partition_by``.
        An empty ``df`` still commits the application transaction, so the step is recorded
        and versions stay monotonic.

        Args:
            name: table name under the warehouse.
            df: rows to append; its schema must equal the table's (nullability may be looser).
            app_id: stable id of the writer (e.g. ``"sessionize/pageviews"``).
            version: monotonically increasing step number (e.g. the micro-batch id).
            partition_by: partition columns; must equal the table's once it exists.
            metadata: commit metadata, JSON-serialisable (at least ``run_id`` and ``cause``).

        Returns:
            Whether this call committed (false when the step was already committed) and how
            many rows it committed.

        Raises:
            CommitConflictError: concurrent commits kept conflicting after every retry.
            ClickstreamError: schema or partitioning differs from the table's.
        """

    @abstractmethod
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
        """Insert rows of ``df`` with new ``keys`` and overwrite rows whose ``keys`` exist.

        Delivery guarantee: exactly once per ``(app_id, version)``; upserting the same rows
        again under a new version is harmless too (idempotent by key). Only files of the
        partitions named by ``partition_filter`` are read or rewritten; when it is None, the
        key columns that are partition columns (e.g. ``client_id``) restrict the merge to the
        source's values. A key may move between partitions (an order whose ``ts`` changed).
        On the delta-rs engine, other writers' commits meanwhile (the stream's appends) make it
        read again only when they change a file it rewrites or add one of its keys.

        Args:
            name: table name under the warehouse.
            df: source rows, at most one per key and no null keys; collected to the driver,
                so keep it to a batch (thousands to a few million rows).
            keys: columns identifying a row (e.g. ``["client_id", "order_id"]``).
            partition_by: partition columns, needed only to create a missing table; must
                equal the table's when given.
            partition_filter: partitions the merge may touch; see above when None.
            app_id: stable id of the writer.
            version: step number.
            metadata: commit metadata (``run_id``, ``cause``).

        Raises:
            CommitConflictError: concurrent commits kept conflicting after every retry.
            ClickstreamError: duplicate or null keys in ``df``, or a schema mismatch.
        """

    @abstractmethod
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
        """Remove every stored row whose ``keys`` equal one of ``df``'s rows.

        Delivery guarantee: exactly once per ``(app_id, version)``. Unlike
        :meth:`replace_partitions`, other writers' appends into the same partitions meanwhile
        (the stream's) neither conflict nor are removed: only files holding one of the keys
        are rewritten. On the delta-rs engine a commit meanwhile that removed such a file, or
        added one of the keys, makes it read again.

        Args:
            name: table name under the warehouse (it must exist).
            df: the keys to remove (other columns are ignored), at most one row per key and
                no null keys; collected to the driver like :meth:`upsert`'s source.
            keys: the columns that identify a row; all of the table's to remove exact rows.
            partition_filter: the partitions that may hold the keys; only their files are read.
            app_id: stable id of the writer.
            version: step number.
            metadata: commit metadata (``run_id``, ``cause``).

        Raises:
            CommitConflictError: concurrent commits kept conflicting after every retry.
            ClickstreamError: the table is missing, or duplicate or null keys in ``df``.
        """

    @abstractmethod
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
        """Atomically replace every row in the partitions matching ``predicate`` with ``df``.

        Delivery guarantee: exactly once per ``(app_id, version)``; one commit removes the old
        files and adds the new ones, so readers see the old rows or the new rows, never a mix.
        An empty ``df`` deletes the range. Every row of ``df`` must fall inside ``predicate``.
        If a commit after ``read_version`` (or, without it, during the call) added or removed
        rows inside the range (on the ``deltalake`` engine a compaction does not count), the
        replace is refused (:class:`~clickstream.errors.CommitConflictError`):
        ``df`` was computed from rows that are no longer the whole range, so the caller must
        recompute, not retry blindly. Commits outside the range do not matter.

        Args:
            name: table name under the warehouse.
            df: the complete new content of the range.
            predicate: the range; see :data:`ReplacePredicate`. Partition columns only.
            partition_by: partition columns, needed only to create a missing table.
            app_id: stable id of the writer.
            version: step number.
            metadata: commit metadata (``run_id``, ``cause``).
            read_version: the table version ``df`` was computed from (a snapshot read earlier);
                ``TABLE_MISSING`` when it was computed before the table existed, so that rows
                another writer committed into the range since (creating the table) conflict.

        Returns:
            Whether this call committed (false when the step was already committed) and how
            many rows it committed.
        """

    @abstractmethod
    def read(
        self,
        name: str,
        columns: Sequence[str] | None = None,
        partition_filter: PartitionFilter | None = None,
        *,
        schema: StructType | None = None,
        version: int | None = None,
    ) -> DataFrame:
        """Spark DataFrame of the table's active rows (optionally at an older ``version``).

        Reads only the files the Delta log says are active; reading the folder instead would
        also return rows that were replaced or merged away.

        Args:
            name: table name under the warehouse.
            columns: columns to keep, in this order; all when None.
            partition_filter: read only these partitions.
            schema: schema to use when the table does not exist yet (an empty DataFrame is
                returned); without it a missing table raises.
            version: time travel to this committed version.

        Raises:
            ClickstreamError: the table does not exist and no ``schema`` was given.
        """

    def largest_by_partition(
        self, name: str, column: str, partition_column: str,
        partition_filter: PartitionFilter | None = None,
    ) -> dict[PartitionValue, Any]:
        """Per value of ``partition_column`` (inside ``partition_filter``), the largest value
        of ``column`` (timestamps as UTC-aware datetimes); None where it is not known (read
        that partition to know).

        This default reads the two columns; an engine whose log holds file statistics
        answers from them without reading any data."""
        from pyspark.sql import functions as F

        if not self.exists(name):
            return {}
        rows = self.read(name, [partition_column, column], partition_filter).groupBy(
            partition_column).agg(F.max(column).alias("largest")).collect()
        return {row[partition_column]: _aware(row["largest"]) for row in rows}

    def row_count(self, name: str, *, version: int | None = None) -> int:
        """The table's active rows (at ``version``, else the latest). This default counts
        them with Spark; an engine whose log holds ``numRecords`` for every file answers from
        the log without reading data."""
        return self.read(name, [], version=version).count()

    def head_arrow(self, name: str, rows: int, *, version: int | None = None) -> pa.Table:
        """Up to ``rows`` of the table's active rows (at ``version``, else the latest), in no
        particular order (a look at what a table holds: ``clickstream inspect --sample``)."""
        return self.read(name, version=version).limit(rows).toArrow()

    @abstractmethod
    def read_arrow(
        self,
        name: str,
        partition_filter: PartitionFilter | None = None,
        columns: Sequence[str] | None = None,
        *,
        version: int | None = None,
    ) -> pa.Table:
        """Small driver-side read into Arrow (tests, tools, publishing modest results)."""

    @abstractmethod
    def history(self, name: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Commit infos, newest first, each with ``version``, ``operation`` and our metadata."""

    def newest_commit(self, name: str, matches: Callable[[Mapping[str, Any]], bool]
                      ) -> dict[str, Any] | None:
        """The newest commit info of :meth:`history` that ``matches``, or None. The recent
        commits first, then the whole log: beside a running stream (a commit every
        micro-batch) the commit looked for may be far behind."""
        for limit in (RECENT_COMMITS, None):
            entries = self.history(name, limit)
            for entry in entries:
                if matches(entry):
                    return entry
            if limit is not None and len(entries) < limit:
                break  # that was the whole log
        return None

    @abstractmethod
    def optimize(
        self, name: str, partition_filter: PartitionFilter | None = None
    ) -> dict[str, Any]:
        """Compact small files (data unchanged, ``dataChange=false``); returns the metrics,
        with ``numFilesAdded`` and ``numFilesRemoved`` over the whole call."""

    @abstractmethod
    def vacuum(
        self, name: str, retention_hours: int, *, enforce_retention_duration: bool = True
    ) -> list[str]:
        """Delete files unreferenced for longer than ``retention_hours``; returns them.

        Retention must exceed the longest write (files are written before they are committed)
        and the longest reader or time travel that may still need old files.
        """

    @abstractmethod
    def checkpoint(self, name: str) -> None:
        """Write a log checkpoint at the current version so readers replay less log."""

    @abstractmethod
    def set_retention(self, name: str, log_hours: int, file_hours: int) -> bool:
        """Keep the table's commits ``log_hours`` (``delta.logRetentionDuration``) and the
        record of each removed file ``file_hours`` (``delta.deletedFileRetentionDuration``);
        True if that changed them (a commit of its own). Time travel to a version needs its
        commit as much as its files, so the log should be kept at least as long as vacuum
        keeps files; and a checkpoint forgets a file removed longer ago than ``file_hours``,
        which vacuum then deletes by its age alone, so that must be vacuum's retention."""


def open_tables(config: Config, spark: SparkSession | None = None, **options: Any) -> DeltaTables:
    """Build the engine ``config.delta_engine`` names.

    Args:
        config: the run's configuration; tables live under ``config.warehouse``.
        spark: the session used for Spark reads and writes (required by both engines'
            DataFrame methods; Arrow-only use may pass None).
        **options: engine tuning (e.g. ``max_commit_attempts`` for deltalake).

    Raises:
        ConfigError: the engine cannot run here (delta-spark without its jars).
    """
    if config.delta_engine == "deltalake":
        from clickstream.io.delta_rs_engine import DeltaRsTables

        return DeltaRsTables(config, spark, **options)
    if config.delta_engine == "delta-spark":
        from clickstream.io.delta_spark_engine import DeltaSparkTables

        return DeltaSparkTables(config, spark, **options)
    raise ConfigError(  # Config validates too; kept for callers that bypass it.
        f"CLICKSTREAM_DELTA_ENGINE={config.delta_engine!r} is not accepted; "
        "use one of: deltalake, delta-spark"
    )


# ---------------------------------------------------------------------------------------------
# Engine-neutral helpers for partition predicates (pure Python, shared by both engines).

_SQL_WORDS = frozenset({
    "and", "or", "not", "in", "is", "null", "true", "false", "between", "like", "date",
    "timestamp", "cast", "as", "string", "int", "integer", "bigint", "smallint", "tinyint",
    "boolean",
})
_SQL_STRING = re.compile(r"'(?:[^']|'')*'")
_SQL_IDENT = re.compile(r'`([^`]+)`|"([^"]+)"|\b([A-Za-z_][A-Za-z0-9_]*)\b')


def _aware(value: Any) -> Any:
    """PySpark collects a timestamp as a naive datetime in the process's local time."""
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.astimezone(dt.UTC)
    return value


def partition_string(value: PartitionValue) -> str | None:
    """Delta's string form of a partition value (``partitionValues`` in the log).

    Empty strings become None: Delta, Hive and Spark all store them as the null partition.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        raise ConfigError(f"partition value {value!r}: timestamps are not supported as partitions")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, int | str):
        return str(value)
    raise ConfigError(
        f"partition value {value!r} has type {type(value).__name__}; use str, int, bool or date"
    )


def filter_alternatives(predicate: PartitionFilter | Sequence[PartitionFilter]) -> list[dict]:
    """Normalise a filter (or an OR of filters) to a list of ``{column: [strings]}``."""
    filters = [predicate] if isinstance(predicate, Mapping) else list(predicate)
    if not filters:
        raise ConfigError("partition predicate is empty; name at least one partition")
    out = []
    for one in filters:
        if not one:
            raise ConfigError("partition predicate has an empty alternative; name its columns")
        empty = [column for column, values in one.items() if _is_sequence(values) and not values]
        if empty:
            raise ConfigError(f"partition predicate lists no values for {', '.join(empty)}")
        out.append(
            {
                column: [
                    partition_string(v)
                    for v in (values if _is_sequence(values) else [values])
                ]
                for column, values in one.items()
            }
        )
    return out


def filter_matches(
    alternatives: list[dict], partition_values: Mapping[str, str | None]
) -> bool:
    """True when a file's partition values (Delta strings) satisfy the normalised filter."""
    return any(
        all(partition_values.get(column) in values for column, values in alt.items())
        for alt in alternatives
    )


def filter_to_sql(
    predicate: PartitionFilter | Sequence[PartitionFilter],
    types: Mapping[str, str],
    alias: str | None = None,
) -> str:
    """SQL text for a filter, typed by ``types`` (Delta type names), for merge/replaceWhere."""
    prefix = f"{alias}." if alias else ""
    ors = []
    for alt in filter_alternatives(predicate):
        ands = []
        for column, values in alt.items():
            ref = prefix + quote_ident(column)
            present = [v for v in values if v is not None]
            parts = []
            if present:
                literals = ", ".join(sql_literal(v, types.get(column, "string")) for v in present)
                parts.append(f"{ref} IN ({literals})")
            if len(present) < len(values):
                parts.append(f"{ref} IS NULL")
            ands.append(parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")")
        ors.append(" AND ".join(ands))
    return ors[0] if len(ors) == 1 else " OR ".join(f"({o})" for o in ors)


def sql_literal(value: str, delta_type: str) -> str:
    """A typed Spark SQL literal (the delta-spark engine's merge and replaceWhere).

    Values are data (a client id comes from the backfill form or an event), and Spark reads
    a backslash in a literal as an escape: doubling only the quote let ``x\\') OR true --``
    end the literal and widen a replaceWhere to every client. Both are escaped here.
    """
    if delta_type in ("integer", "long", "short", "byte"):
        return str(int(value))
    if delta_type == "boolean":
        return "true" if value == "true" else "false"
    text = "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    return f"CAST({text} AS DATE)" if delta_type == "date" else text


def quote_ident(name: str) -> str:
    """Quote a column name for DataFusion/Spark SQL when it is not a plain lowercase word."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_]*", name) else f"`{name}`"


def predicate_columns(predicate: str) -> set[str]:
    """Column names a SQL predicate refers to (string literals and SQL words excluded)."""
    columns = set()
    for match in _SQL_IDENT.finditer(_SQL_STRING.sub("''", predicate)):
        quoted = match.group(1) or match.group(2)
        word = match.group(3)
        if quoted:
            columns.add(quoted)
        elif word and word.lower() not in _SQL_WORDS:
            columns.add(word)
    return columns


def check_partition_predicate(predicate: ReplacePredicate, partition_by: Sequence[str]) -> None:
    """Refuse predicates on non-partition columns: they would select whole files, not rows."""
    if isinstance(predicate, str):
        used = predicate_columns(predicate)
        if not used:
            raise ConfigError(f"replace predicate {predicate!r} names no partition column")
    else:
        used = {column for alt in filter_alternatives(predicate) for column in alt}
    unknown = sorted(used - set(partition_by))
    if unknown:
        raise ConfigError(
            f"replace predicate uses {', '.join(unknown)}, which are not partition columns; "
            f"use only: {', '.join(partition_by) or '(table is not partitioned)'}"
        )


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence | set | frozenset) and not isinstance(value, str | bytes)
