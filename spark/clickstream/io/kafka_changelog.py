"""Publish session and attribution changes to their Kafka changelog topics.

Delivery guarantee: at least once, idempotent by key. The key is the session_id (order_id for
attributions) and the value carries the row at its ``revision``; a retraction is a tombstone
(null value). Publishing the same change twice leaves a compacted reader with the same view,
so a batch replayed after a crash may simply publish again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from clickstream.config import Config
from clickstream.io.kafka_clients import flush_or_raise, gc_paused, make_producer, produce_json

if TYPE_CHECKING:
    from pyspark.sql import Column
    from pyspark.sql.types import StructType

FLUSH_TIMEOUT_SECONDS = 60.0
# Spark's ``to_json`` options that write a row as ``row_value`` does (the session time zone is
# UTC, so XXX is a Z): ISO-8601 timestamps with milliseconds, null fields kept.
SPARK_JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSXXX",
                      "ignoreNullFields": "false"}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return moment.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    return value


def row_value(row: Any) -> dict[str, Any]:
    """JSON-ready dict of a Spark Row or mapping (timestamps ISO-8601 UTC, decimals as text)."""
    data = row.asDict() if hasattr(row, "asDict") else dict(row)
    return {key: _jsonable(value) for key, value in data.items()}


def spark_row_value(columns: Mapping[str, Column], schema: StructType) -> Column:
    """The changelog value of a row as a JSON string computed in Spark: the same value
    :func:`row_value` gives the row (the table's columns in its order, nulls included,
    timestamps ISO-8601 UTC with milliseconds, decimals as strings), so a plan can store it and
    publish it as is, and consumers see one shape whichever job published a row.

    Args:
        columns: an expression for every column of ``schema``, by name.
        schema: the table's schema (``TableSpec.schema``).
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import DecimalType

    return F.to_json(F.struct(*[
        (columns[f.name].cast("string") if isinstance(f.dataType, DecimalType)
         else columns[f.name]).alias(f.name) for f in schema.fields]), SPARK_JSON_OPTIONS)


def publish(
    config: Config, topic: str, changes: Iterable[tuple[str, Mapping[str, Any] | None]]
) -> int:
    """Send (key, value-or-None) pairs and wait for every delivery; returns how many."""
    producer = make_producer(config)
    sent = 0
    with gc_paused():
        for key, value in changes:
            produce_json(producer, topic, key, None if value is None else dict(value))
            sent += 1
    flush_or_raise(producer, FLUSH_TIMEOUT_SECONDS)
    return sent


def publish_sessions(config: Config, rows: Iterable[Any]) -> int:
    """Publish session rows (as in the ``sessions`` table) keyed by session_id."""
    return publish(config, config.sessions_topic,
                   ((value["session_id"], value) for value in map(row_value, rows)))


def publish_attributions(config: Config, rows: Iterable[Any]) -> int:
    """Publish attribution rows keyed by order_id."""
    return publish(config, config.attributions_topic,
                   ((value["order_id"], value) for value in map(row_value, rows)))
