"""A benchmark round's own warehouse and topics, so that rounds in one process and one
SparkSession (as a test worker runs them) never see each other's rows or records."""

from __future__ import annotations

import uuid
from pathlib import Path

from clickstream.config import Config
from clickstream.io.kafka_broker import EmbeddedBroker


def round_config(base: Config, broker: EmbeddedBroker, folder: Path, *,
                 events_topic: bool = False) -> Config:
    """``base`` with its home, warehouse and landing under ``folder`` and topics of its own
    on ``broker`` (created with 4 partitions): the changelog topics, and with
    ``events_topic`` the events topic too."""
    suffix = uuid.uuid4().hex[:8]
    topics = {"sessions_topic": f"sessions-{suffix}",
              "attributions_topic": f"attributions-{suffix}"}
    if events_topic:
        topics["events_topic"] = f"events-{suffix}"
    for name in topics.values():
        broker.create_topic(name, 4)
    return base.replace(home=folder / "home", warehouse=folder / "warehouse",
                        landing=folder / "landing",
                        kafka_bootstrap_servers=broker.bootstrap_servers, **topics)
