"""Kafka fixtures for the io tests.

``broker`` (session-scoped EmbeddedBroker on a free port) and ``kafka_config`` (the per-test
Config pointing at it) live in tests/conftest.py because job tests use them too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from clickstream.io.kafka_broker import EmbeddedBroker


@pytest.fixture
def make_topic(broker: EmbeddedBroker) -> Callable[..., str]:
    """Create a uniquely named topic, so tests sharing the broker never see each other's data."""

    def create(partitions: int = 4, prefix: str = "test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        broker.create_topic(name, partitions)
        return name

    return create
