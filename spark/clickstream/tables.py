"""Names, schemas and partitioning of every Delta table the product writes (public contract).

Every table a client's recompute rewrites is partitioned by ``client_id`` first, so it never
rewrites another client's files, then by a date derived from the row's own event time for
pruning. Two are not: ``corrections`` is partitioned by ``client_id`` and ``run_id`` (a run
reads its own plan), and ``quarantine``, only ever appended to, by the day a row was
quarantined (a row may have no client).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

AMOUNT_TYPE = DecimalType(20, 4)


@dataclass(frozen=True)
class TableSpec:
    """One Delta table: its folder name under the warehouse, schema, partition columns, key."""

    name: str
    schema: StructType
    partition_by: tuple[str, ...]
    key: tuple[str, ...]


def _schema(*fields: tuple[str, object, bool]) -> StructType:
    return StructType([StructField(name, kind, nullable) for name, kind, nullable in fields])


PAGEVIEWS = TableSpec(
    "pageviews",
    _schema(
        ("event_id", StringType(), False),
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("ts", TimestampType(), False),
        ("url", StringType(), True),
        ("referrer", StringType(), True),
        ("source", StringType(), False),
        ("event_date", DateType(), False),
    ),
    ("client_id", "event_date"),
    ("event_id",),
)

ORDERS = TableSpec(
    "orders",
    _schema(
        ("order_id", StringType(), False),
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("ts", TimestampType(), False),
        ("amount", AMOUNT_TYPE, False),
        ("currency", StringType(), False),
        ("event_id", StringType(), True),
        ("source", StringType(), False),
        ("event_date", DateType(), False),
    ),
    ("client_id", "event_date"),
    ("order_id",),
)

OTHER_EVENTS = TableSpec(
    "other_events",
    _schema(
        ("event_id", StringType(), False),
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("event_type", StringType(), False),
        ("ts", TimestampType(), False),
        ("raw", StringType(), False),
        ("source", StringType(), False),
        ("event_date", DateType(), False),
    ),
    ("client_id", "event_date"),
    ("event_id",),
)

SESSIONS = TableSpec(
    "sessions",
    _schema(
        ("session_id", StringType(), False),
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("session_start", TimestampType(), False),
        ("session_end", TimestampType(), False),
        ("pageview_count", IntegerType(), False),
        ("landing_url", StringType(), True),
        ("exit_url", StringType(), True),
        ("order_count", IntegerType(), False),
        ("revenue", AMOUNT_TYPE, False),
        ("revision", IntegerType(), False),
        ("session_date", DateType(), False),
    ),
    ("client_id", "session_date"),
    ("session_id",),
)

ATTRIBUTIONS = TableSpec(
    "attributions",
    _schema(
        ("order_id", StringType(), False),
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("order_ts", TimestampType(), False),
        ("session_id", StringType(), True),
        ("revision", IntegerType(), False),
        ("order_date", DateType(), False),
    ),
    ("client_id", "order_date"),
    ("order_id",),
)

QUARANTINE = TableSpec(
    "quarantine",
    _schema(
        ("raw", StringType(), True),
        ("source", StringType(), False),
        ("reason", StringType(), False),
        ("client_id", StringType(), True),
        ("quarantined_at", TimestampType(), False),
        ("quarantine_date", DateType(), False),
    ),
    ("quarantine_date",),
    ("source",),
)

RECOMPUTE_QUEUE = TableSpec(
    "recompute_queue",
    _schema(
        ("client_id", StringType(), False),
        ("user_id", StringType(), False),
        ("kind", StringType(), False),
        ("record_id", StringType(), False),
        ("ts", TimestampType(), False),
        ("queued_by", StringType(), False),
        ("event_date", DateType(), False),
    ),
    ("client_id", "event_date"),
    ("kind", "record_id"),
)

# ``queued_by`` of the rows a backfill queues for the stream's users: "backfill <run id>".
BACKFILL_QUEUED_BY = "backfill "
# ... followed by this for the place an order was stored in before the backfill moved it
# (``corrections`` C10): that row is not where the order is now.
MOVED_AWAY = ": moved away"

CORRECTIONS = TableSpec(
    "corrections",
    _schema(
        ("run_id", StringType(), False),
        ("run_seq", LongType(), False),
        ("client_id", StringType(), False),
        ("entity", StringType(), False),  # session | attribution
        ("key", StringType(), False),  # session_id or order_id
        ("change", StringType(), False),  # created | updated | retracted
        ("old_revision", IntegerType(), True),
        ("new_revision", IntegerType(), True),
        ("cause", StringType(), False),
        ("new_value", StringType(), True),  # the row at new_revision as JSON; null if retracted
        ("partition_date", DateType(), False),  # session_date / order_date of the affected row
        ("corrected_at", TimestampType(), False),
    ),
    # run_id too: a run reads (and resumes from) its own plan without scanning the client's
    # whole correction history.
    ("client_id", "run_id"),
    ("run_id", "entity", "key"),
)

ALL_TABLES = {
    spec.name: spec
    for spec in (
        PAGEVIEWS, ORDERS, OTHER_EVENTS, SESSIONS, ATTRIBUTIONS, QUARANTINE, RECOMPUTE_QUEUE,
        CORRECTIONS,
    )
}

# Columns of the raw Kafka record (Spark's Kafka source layout); both sources produce them.
KAFKA_SCHEMA = _schema(
    ("key", BinaryType(), True),
    ("value", BinaryType(), True),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("offset", LongType(), False),
    ("timestamp", TimestampType(), False),
    ("timestampType", IntegerType(), False),
    (
        "headers",
        ArrayType(
            StructType([StructField("key", StringType()), StructField("value", BinaryType())])
        ),
        True,
    ),
)
