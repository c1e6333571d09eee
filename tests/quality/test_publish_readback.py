"""The publish gate reads each record's revision from the bytes without parsing the JSON; it
must agree with parsing for every value the producer can write."""

from __future__ import annotations

import json

import pytest

from clickstream.io.kafka_clients import encode_json
from clickstream.quality.checks import _revision

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
