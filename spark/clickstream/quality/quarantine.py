"""Writes to ``quarantine`` that a step's rerun repeats without losing or doubling a row.

A step's quarantine write is one application transaction. A rerun of a step that crashed after
that write may judge its rows anew: a stricter setting since (``CLICKSTREAM_MAX_TS_AHEAD``,
gates turned to ``enforce``) or tables changed since (a gate's other figures) refuse rows the
first attempt did not. Skipping the write on a rerun left those rows in neither their table
nor ``quarantine``; repeating it stored the others twice. So a rerun appends the rows no
attempt stored, as the transaction's next version, and nothing when there are none.
Used by the gates that stop a step after its writes (``gates`` Q2), the backfill's batch and
the stream's replayed micro-batch (``sessionize`` Z21).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from clickstream.io.delta_tables import DeltaTables
from clickstream.tables import QUARANTINE


def _not_yet_quarantined(rows: DataFrame, stored: DataFrame) -> DataFrame:
    """``rows`` to quarantine less those ``stored`` (``quarantine`` rows) holds, found by
    ``source`` and text: a backfill's source is the row's file, and a Kafka position comes
    back when its topic is created again."""
    return rows.alias("row").join(stored.select("source", "raw").alias("stored"), (
        F.col("row.source") == F.col("stored.source")) & F.col("row.raw").eqNullSafe(
        F.col("stored.raw")), "left_anti")


def quarantine_once(tables: DeltaTables, rows: DataFrame, *, app_id: str,
                    metadata: Mapping[str, Any], stored_under: str | None = None,
                    after_an_attempt: bool = False) -> int:
    """Append ``rows`` to ``quarantine`` as the next version of transaction ``app_id``, less
    those an earlier attempt stored; the number of rows appended.

    An earlier attempt is a committed version of ``app_id``, or the caller's own write under
    another transaction (``after_an_attempt``: the stream's micro-batch writes under its
    batch's). ``stored_under`` is how the sources of the step's rows begin: the rows compared
    with are read from those alone. Reads ``quarantine``'s ``source`` and ``raw`` on a rerun only.
    """
    attempts = tables.app_version(QUARANTINE.name, app_id)
    if attempts is not None or after_an_attempt:
        stored = tables.read(QUARANTINE.name, ["source", "raw"])
        if stored_under is not None:
            stored = stored.where(F.col("source").startswith(stored_under))
        rows = _not_yet_quarantined(rows, stored)
        if rows.isEmpty():  # a rerun with nothing new commits nothing
            return 0
    return tables.append_once(QUARANTINE.name, rows, app_id=app_id,
                              version=(attempts or 0) + 1, partition_by=QUARANTINE.partition_by,
                              metadata=metadata).rows
