"""Table maintenance: compact small files, vacuum old ones, checkpoint the log.

Every function walks the tables of ``clickstream.tables.ALL_TABLES`` that exist and returns
what it did per table. None of them changes data: compaction rewrites files with
``dataChange=false`` (streaming readers skip it), vacuum deletes only files no version within
the retention needs (and files no version ever named, such as a crashed writer's, once older
than the retention), a checkpoint only shortens log replay (application transactions stay in
it). Safe while the sessionizer, backfills and recomputes run: a compaction that conflicts
with them fails with ``CommitConflictError`` and is simply retried later. Two compactions of
one table never overlap: the second waits for the first (``delta_rs_engine`` edge case 15).

Known edge cases, cited inline as (M1)..(M5):
  M1. Vacuum retention below 168 hours is refused: writers put Parquet files in place before
      they commit them, and readers (and time travel) may still use files a newer version
      removed; Delta's own default retention is 7 days for these reasons. A backfill step
      that reads its tables as they were before its own commits (the merge's gate, an orders
      batch's old places, the report) therefore works within the retention of its merge;
      resumed later, it fails at once with ``VersionVacuumedError`` (not retried; the
      deltalake engine's read, delta-spark's fails on the missing path), which names the
      table, the version and ``recompute --full`` as the way forward.
  M2. One table's failure (a compaction conflicting with a backfill, an unreadable file) does
      not stop the others: every table is tried, each failure is reported as it happens, and
      the step then fails with one error naming every failed table and its reason. The first
      failure used to end the loop, so the tables after it went unmaintained that week.
  M3. Time travel needs a version's commit as well as its files, and Delta deletes commits
      older than ``delta.logRetentionDuration`` (30 days by default) at checkpoints. Vacuum
      first sets it to its own retention (30 days at least), so a longer retention keeps both
      and M1's limit is the one retention. Before, a retention above 30 days kept the files
      of versions whose commits were gone.
  M4. A checkpoint keeps the record of a removed file only ``delta.deletedFileRetentionDuration``
      (7 days by default), and vacuum deletes a file no record names by its age alone: with a
      longer retention, a file written long ago and removed 8 days ago went at the first
      vacuum after a checkpoint (the product's, or delta-rs' every 100 commits), and time
      travel within the retention failed. Vacuum first sets it to its own retention too.
  M5. Readers of the read point (``io.read_point``) read versions as old as its oldest open
      group's. Vacuum first moves the read point up to date, and leaves the read point's
      tables alone while a group older than the retention holds one (a backfill killed a
      week ago and never rerun), saying so: the files those versions name must stay.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from clickstream.config import Config
from clickstream.errors import ClickstreamError, ConfigError, one_error_for
from clickstream.io import read_point
from clickstream.io.delta_tables import (
    DEFAULT_LOG_RETENTION_HOURS,
    FILE_RETENTION,
    LOG_RETENTION,
    DeltaTables,
    open_tables,
)
from clickstream.progress import Progress
from clickstream.tables import ALL_TABLES

READ_POINT_NAMES = frozenset(spec.name for spec in read_point.READ_POINT_TABLES)
MIN_VACUUM_RETENTION_HOURS = 168
MAX_VACUUM_RETENTION_HOURS = 87_600  # ten years; delta-rs panics on ~2.5e12 h
_T = TypeVar("_T")


def _open(config: Config) -> DeltaTables:
    # deltalake maintains tables without Spark; delta-spark needs a session.
    spark = None
    if config.delta_engine == "delta-spark":
        from clickstream.spark_session import build_spark

        spark = build_spark(config, "clickstream-maintenance")
    return open_tables(config, spark)


def existing_tables(tables: DeltaTables) -> list[str]:
    """Names of the product's tables that have at least one commit."""
    return [name for name in ALL_TABLES if tables.exists(name)]


def each_table(tables: DeltaTables, step: str, work: Callable[[str], _T],
               progress: Progress) -> dict[str, _T]:
    """``work(name)`` for every existing table, even after one fails (M2); per table, its result.

    Raises:
        ClickstreamError: ``work`` failed on one or more tables (each named with its reason;
            the first failure is chained); every other table was done all the same. Of a
            non-retryable type when every failure is (``errors.one_error_for``).
    """
    done: dict[str, _T] = {}
    failed: dict[str, Exception] = {}
    names = existing_tables(tables)
    if not names:  # a new warehouse, or CLICKSTREAM_WAREHOUSE naming another folder here
        warehouse = Path(tables.table_path(next(iter(ALL_TABLES)))).parent
        progress(f"{step}: no table under {warehouse} (CLICKSTREAM_WAREHOUSE) yet: nothing "
                 "to do")
    for name in names:
        try:
            done[name] = work(name)
        except Exception as exc:  # raised below, together with every other table's failure
            failed[name] = exc
            progress(f"{step} {name}: failed: {type(exc).__name__}: {exc}")
    if failed:
        reasons = "; ".join(f"{name} ({type(exc).__name__}: {exc})" for name, exc in failed.items())
        raise one_error_for(
            list(failed.values()),
            f"{step} failed on {len(failed)} of {len(done) + len(failed)} tables: {reasons}; "
            f"done: {', '.join(done) or 'none'}. Data is unchanged and {step} is idempotent: "
            "run it again, as is after a conflict with a concurrent commit, else once the "
            "cause is fixed"
        ) from next(iter(failed.values()))
    return done


def compact_tables(config: Config, *, progress: Progress = print) -> dict[str, dict[str, Any]]:
    """Compact small files of every existing table; per table, files added and removed.

    Raises:
        ClickstreamError: compaction failed on some tables; the others were compacted (M2).
    """
    tables = _open(config)

    def compact(name: str) -> dict[str, Any]:
        metrics = tables.optimize(name)
        done = {"files_added": int(metrics["numFilesAdded"]),
                "files_removed": int(metrics["numFilesRemoved"])}
        line = f"compact {name}: {done['files_removed']} files into {done['files_added']}"
        progress(line)
        return done

    return each_table(tables, "compact", compact, progress)


def vacuum_tables(config: Config, *, retention_hours: int = MIN_VACUUM_RETENTION_HOURS,
                  progress: Progress = print) -> dict[str, int]:
    """Delete files unreferenced for longer than ``retention_hours``; per table, how many.

    Raises:
        ConfigError: ``retention_hours`` is below the safe minimum (M1) or above ten years.
        ClickstreamError: vacuum failed on some tables; the others were vacuumed (M2).
    """
    check_retention(retention_hours)
    tables = _open(config)

    log_hours = max(retention_hours, DEFAULT_LOG_RETENTION_HOURS)

    kept_by = _read_point_older_than(config, tables, retention_hours)  # (M5)

    def vacuum(name: str) -> int:
        if kept_by is not None and name in READ_POINT_NAMES:
            progress(f"vacuum {name}: skipped: {kept_by}")
            return 0
        if tables.set_retention(name, log_hours, retention_hours):  # (M3, M4)
            progress(f"vacuum {name}: commits now kept {log_hours} h ({LOG_RETENTION}), "
                     f"removed files {retention_hours} h ({FILE_RETENTION})")
        deleted = len(tables.vacuum(name, retention_hours))
        progress(f"vacuum {name}: {deleted} files older than {retention_hours} h deleted")
        return deleted

    return each_table(tables, "vacuum", vacuum, progress)


def _read_point_older_than(config: Config, tables: DeltaTables, retention_hours: int
                           ) -> str | None:
    """Why the read point's tables are not vacuumed now (M5), or None."""
    read_point.publish(config, tables)  # up to date first: only an open group holds it back
    oldest = read_point.oldest_read(config)
    if oldest is None:
        return None
    written, what = oldest
    if written > dt.datetime.now(dt.UTC) - dt.timedelta(hours=retention_hours):
        return None
    return (f"readers of the read point are sent to versions of {written:%Y-%m-%d %H:%M} UTC "
            f"({what}), older than the {retention_hours} h retention; vacuumed once the "
            "read point moves past them (`clickstream read-point` names what holds it: rerun "
            "it, or `--release` its group)")


def check_retention(retention_hours: int) -> None:
    """Raises ``ConfigError`` for a vacuum retention below the safe minimum (M1) or above ten
    years."""
    if retention_hours < MIN_VACUUM_RETENTION_HOURS:
        raise ConfigError(
            f"vacuum retention {retention_hours} h is below the safe minimum of "
            f"{MIN_VACUUM_RETENTION_HOURS} h: writers place files before committing them and "
            "readers or time travel may still need removed files; use at least "
            f"{MIN_VACUUM_RETENTION_HOURS}")
    if retention_hours > MAX_VACUUM_RETENTION_HOURS:
        raise ConfigError(
            f"vacuum retention {retention_hours} h is above {MAX_VACUUM_RETENTION_HOURS} h (ten "
            "years); a longer one keeps every file anyway")


def checkpoint_tables(config: Config, *, progress: Progress = print) -> dict[str, int]:
    """Write a log checkpoint of every existing table; per table, the version checkpointed.

    Raises:
        ClickstreamError: a checkpoint failed on some tables; the others got theirs (M2).
    """
    tables = _open(config)

    def checkpoint(name: str) -> int:
        tables.checkpoint(name)
        version = tables.version(name)
        progress(f"checkpoint {name}: version {version}")
        return version

    return each_table(tables, "checkpoint", checkpoint, progress)


def maintain_tables(config: Config, *, retention_hours: int = MIN_VACUUM_RETENTION_HOURS,
                    progress: Progress = print) -> dict[str, dict[str, Any]]:
    """Compact, vacuum and checkpoint every existing table, as the weekly DAG does: vacuum and
    checkpoint run whatever compaction did (they do not depend on it); per step, its result.

    Raises:
        ConfigError: ``retention_hours`` is out of range (nothing was done).
        ClickstreamError: a step failed on some tables (each step's failures named, the
            first chained); every other table of every step was done (M2).
    """
    check_retention(retention_hours)  # before compaction: nothing done then
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "compact": lambda: compact_tables(config, progress=progress),
        "vacuum": lambda: vacuum_tables(config, retention_hours=retention_hours,
                                        progress=progress),
        "checkpoint": lambda: checkpoint_tables(config, progress=progress),
    }
    done: dict[str, dict[str, Any]] = {}
    failed: list[Exception] = []
    for name, step in steps.items():
        try:
            done[name] = step()
        except ClickstreamError as exc:  # raised below with the other steps' failures
            failed.append(exc)
    if failed:
        raise one_error_for(failed, " ".join(str(exc) for exc in failed)) from failed[0]
    return done

