"""Table maintenance: compact small files, vacuum old ones, checkpoint the log.

Every function walks the tables of ``clickstream.tables.ALL_TABLES`` that exist and returns
what it did per table. None of them changes data: compaction rewrites files with
``dataChange=false`` (streaming readers skip it), vacuum deletes only files no version within
the retention needs (and files no version ever named, such as a crashed writer's, once older
than the retention), a checkpoint only shortens log replay (application transactions stay in
it). Safe while the sessionizer, backfills and recomputes run: a compaction that conflicts
with them fails with ``CommitConflictError`` and is simply retried later. Two compactions of
one table never overlap: the second waits for the first (``delta_rs_engine`` edge case 15).

Known edge cases, cited inline as (M1):
  M1. Vacuum retention below 168 hours is refused: writers put Parquet files in place before
      they commit them, and readers (and time travel) may still use files a newer version
      removed; Delta's own default retention is 7 days for these reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clickstream.config import Config
from clickstream.errors import ConfigError
from clickstream.io.delta_tables import DeltaTables, open_tables
from clickstream.tables import ALL_TABLES

MIN_VACUUM_RETENTION_HOURS = 168
Progress = Callable[[str], None]


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


def compact_tables(config: Config, *, progress: Progress = print) -> dict[str, dict[str, Any]]:
    """Compact small files of every existing table; per table, files added and removed."""
    tables = _open(config)
    done: dict[str, dict[str, Any]] = {}
    for name in existing_tables(tables):
        metrics = tables.optimize(name)
        done[name] = {"files_added": int(metrics.get("numFilesAdded", 0) or 0),
                      "files_removed": int(metrics.get("numFilesRemoved", 0) or 0)}
        progress(f"compact {name}: {done[name]['files_removed']} files into "
                 f"{done[name]['files_added']}")
    return done


def vacuum_tables(config: Config, *, retention_hours: int = MIN_VACUUM_RETENTION_HOURS,
                  progress: Progress = print) -> dict[str, int]:
    """Delete files unreferenced for longer than ``retention_hours``; per table, how many.

    Raises:
        ConfigError: ``retention_hours`` is below the safe minimum (M1).
    """
    if retention_hours < MIN_VACUUM_RETENTION_HOURS:
        raise ConfigError(
            f"vacuum retention {retention_hours} h is below the safe minimum of "
            f"{MIN_VACUUM_RETENTION_HOURS} h: writers place files before committing them and "
            "readers or time travel may still need removed files; use at least "
            f"{MIN_VACUUM_RETENTION_HOURS}")
    tables = _open(config)
    done: dict[str, int] = {}
    for name in existing_tables(tables):
        done[name] = len(tables.vacuum(name, retention_hours))
        progress(f"vacuum {name}: {done[name]} files older than {retention_hours} h deleted")
    return done


def checkpoint_tables(config: Config, *, progress: Progress = print) -> dict[str, int]:
    """Write a log checkpoint of every existing table; per table, the version checkpointed."""
    tables = _open(config)
    done: dict[str, int] = {}
    for name in existing_tables(tables):
        tables.checkpoint(name)
        done[name] = tables.version(name)
        progress(f"checkpoint {name}: version {done[name]}")
    return done
