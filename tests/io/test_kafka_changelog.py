"""A row's changelog value, computed in Spark by every job that publishes, is the row as an
independent Python encoding gives it, and reads back into the same row."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from clickstream.config import Config
from clickstream.errors import ConfigError
from clickstream.io.kafka_changelog import (
    CHANGELOG_LOGS_FILE,
    check_changelogs_are_the_published_logs,
    publish_pairs,
    record_changelog_ids,
    recorded_changelog_ids,
    spark_row_value,
)
from clickstream.io.kafka_read import read_offset_ranges
from clickstream.quality.checks import topic_ends
from clickstream.tables import ATTRIBUTIONS, SESSIONS, TableSpec
from tests.reference import reference_changelog_value

SESSION = {"session_id": "s", "client_id": "c", "user_id": "u",
           "session_start": datetime(2026, 11, 1, 8, 30, tzinfo=UTC),
           "session_end": datetime(2026, 11, 1, 8, 45, 0, 125_000, tzinfo=UTC),
           "pageview_count": 3, "landing_url": "/a?q=\"x\"", "exit_url": None,
           "order_count": 1, "revenue": Decimal("12.5000"), "revision": 2,
           "session_date": date(2026, 11, 1)}
UNATTRIBUTED = {"order_id": "o", "client_id": "c", "user_id": "u",
                "order_ts": datetime(2026, 11, 1, 8, 30, tzinfo=UTC), "session_id": None,
                "revision": 1, "order_date": date(2026, 11, 1)}


def spark_value(spark: SparkSession, spec: TableSpec, row: dict) -> str:
    frame = spark.createDataFrame([tuple(row[f.name] for f in spec.schema.fields)],
                                  spec.schema)
    columns = {name: F.col(name) for name in spec.schema.fieldNames()}
    return frame.select(spark_row_value(columns, spec.schema)).first()[0]


def test_a_session_reads_like_its_reference_encoding_and_back(spark: SparkSession) -> None:
    value = spark_value(spark, SESSIONS, SESSION)
    parsed = json.loads(value)
    assert parsed == reference_changelog_value(SESSION)
    assert list(parsed) == SESSIONS.schema.fieldNames()
    assert parsed["revenue"] == "12.5000" and parsed["exit_url"] is None
    assert parsed["session_end"] == "2026-11-01T08:45:00.125Z"
    # The apply step reads a plan's values back into rows with the table's schema.
    back = spark.createDataFrame([(value,)], "v string").select(
        F.from_json("v", SESSIONS.schema).alias("r")).select("r.*").first().asDict()
    assert back == {**SESSION, "session_start": SESSION["session_start"].replace(tzinfo=None),
                    "session_end": SESSION["session_end"].replace(tzinfo=None)}


def test_an_unattributed_order_keeps_its_null_session(spark: SparkSession) -> None:
    parsed = json.loads(spark_value(spark, ATTRIBUTIONS, UNATTRIBUTED))
    assert parsed == reference_changelog_value(UNATTRIBUTED)
    assert "session_id" in parsed and parsed["session_id"] is None


def test_published_pairs_reach_the_topic_in_the_frames_order(
        spark: SparkSession, spark_conf, kafka_config, make_topic) -> None:
    """Several Arrow batches per partition, an empty partition, tombstones and non-ASCII text:
    a one-partition topic holds the records exactly as ``collect`` returns the frame."""
    spark_conf("spark.sql.execution.arrow.maxRecordsPerBatch", "700")
    rows = [(f"k{i:05d}", None if i % 97 == 0 else f'{{"n":{i},"u":"/é/{i % 13}"}}')
            for i in range(5_000)]
    schema = "key string, value string"
    empty = spark.createDataFrame(spark.sparkContext.parallelize([], 2), schema)
    frame = empty.unionByName(spark.createDataFrame(rows, schema).repartition(3, "key"))
    expected = [tuple(r) for r in frame.collect()]
    assert frame.rdd.getNumPartitions() == 5
    topic = make_topic(partitions=1)

    assert publish_pairs(kafka_config, topic, frame) == len(rows)

    end = topic_ends(kafka_config, [topic])[topic][0]
    read = [(m.key().decode(), None if m.value() is None else m.value().decode())
            for batch in read_offset_ranges(kafka_config, topic, {0: (0, end)})
            for m in batch]
    assert read == expected
    assert expected != sorted(expected)  # the frame's order, not the keys' order, is checked


def test_the_changelog_logs_are_recorded_per_kafka_address_and_a_damaged_file_is_named(
        config: Config) -> None:
    """One address's record is another's first meeting (README: move, then republish); a file
    that is not JSON failed every publishing job with a bare JSONDecodeError."""
    record_changelog_ids(config, {"sessions": "id-1"})
    record_changelog_ids(config.replace(kafka_bootstrap_servers="10.0.0.1:9092"),
                         {"sessions": "id-2"})
    record_changelog_ids(config, {"attributions": "id-3"})
    assert recorded_changelog_ids(config) == {"sessions": "id-1", "attributions": "id-3"}
    # One broker named two ways (an Airflow task, a shell) is one Kafka
    shell = config.replace(kafka_bootstrap_servers="localhost:9092,10.0.0.2:9092")
    record_changelog_ids(shell, {"sessions": "id-4"})
    assert recorded_changelog_ids(config.replace(
        kafka_bootstrap_servers="10.0.0.2:9092, 127.0.0.1:9092")) == {"sessions": "id-4"}
    for damaged in ("{not json", "[]", '{"127.0.0.1:9092": "id-1"}'):
        (config.warehouse / CHANGELOG_LOGS_FILE).write_text(damaged)
        with pytest.raises(ConfigError, match=r"_clickstream_changelogs\.json is not the JSON "
                                              r"this product writes .*; delete it and run "
                                              r"`clickstream republish`"):
            check_changelogs_are_the_published_logs(config)
