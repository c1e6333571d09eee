"""The publish gate: each record's revision is read from the bytes without parsing the JSON
(it must agree with parsing for every value the producer can write), and every kind of
missing record is found and traced to its plan row."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.io.kafka_produce import encode_json
from clickstream.quality.checks import _revision, publish_checks

VALUES = [
    {"session_id": "s", "revision": 12},
    {"revision": 3, "exit_url": "/x"},
    {"revision": -1},
    {"landing_url": '/a?q="revision":5,', "revision": 7},  # the key's bytes inside a string
    {"revision": 2, "exit_url": '/"revision":9}'},
    {"session_id": "no revision at all"},
]


@pytest.mark.parametrize("value", VALUES)
def test_revision_from_bytes_equals_parsing(value: dict) -> None:
    raw = encode_json(value)
    assert _revision(raw) == json.loads(raw).get("revision")


def test_a_tombstone_has_no_revision_and_odd_json_is_parsed() -> None:
    assert _revision(None) is None
    assert _revision(b'{"revision": 4, "x": 1}') == 4  # not compact: falls back to parsing


def test_publish_checks_find_each_kind_of_missing_record(spark: SparkSession,
                                                          config: Config) -> None:
    plan = spark.createDataFrame([
        ("session", "s-ok", "updated", 2), ("session", "s-old", "updated", 2),
        ("session", "s-gone", "retracted", None), ("session", "s-kept", "retracted", None),
        ("attribution", "o-ok", "created", 1), ("attribution", "o-lost", "updated", 3),
    ], "entity string, key string, change string, new_revision int")
    published = {
        config.sessions_topic: {("s-ok", 2), ("s-old", 1),  # s-old: a stale revision
                                ("s-gone", 1),  # s-gone: a value, not a tombstone
                                ("s-kept", None), ("o-lost", 3)},  # o-lost: on the wrong topic
        config.attributions_topic: {("o-ok", 1)},
    }
    checks = publish_checks(plan, config, published)
    assert checks.values == {"session_changes": 4, "attribution_changes": 2,
                             "sessions_missing_at_revision": 1,
                             "retractions_without_tombstone": 1,
                             "attributions_missing_at_revision": 1}
    behind = {name: sorted(r.key for r in frame.where(rows).collect())
              for name, (frame, rows) in checks.rows.items()}
    assert behind == {"sessions_missing_at_revision": ["s-old"],
                      "retractions_without_tombstone": ["s-gone"],
                      "attributions_missing_at_revision": ["o-lost"]}
