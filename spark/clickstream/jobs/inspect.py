"""``clickstream inspect``: what the tables and topics hold, without starting Spark."""

from __future__ import annotations

import json
from typing import Any

from clickstream.config import Config
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_clients import read_compacted
from clickstream.tables import ALL_TABLES


def describe_tables(config: Config, sample: int = 0) -> list[str]:
    """One line per table: version and row count; optionally ``sample`` of its rows. All three
    are of one version, so a writer committing meanwhile cannot make them disagree."""
    # Reading needs no Spark on either engine: the delta-rs reader reads delta-spark's tables.
    tables = open_tables(config.replace(delta_engine="deltalake"))
    lines = [f"warehouse {config.warehouse}"]
    for name in ALL_TABLES:
        version = tables.version(name)
        if version < 0:
            lines.append(f"  {name:<16} (not created yet)")
            continue
        # From the log: inspect stays quick on a large table.
        rows = tables.row_count(name, version=version)
        lines.append(f"  {name:<16} version {version:>5}  rows {rows:>10}")
        for row in (tables.head_arrow(name, sample, version=version).to_pylist()
                    if sample else []):
            lines.append("      " + json.dumps(row, default=str))
    return lines


def describe_topic(config: Config, topic: str, sample: int = 0) -> list[str]:
    """The topic's compacted view: live keys, and optionally a few values."""
    view: dict[str, Any] = read_compacted(config, topic)
    lines = [f"topic {topic} at {config.kafka_bootstrap_servers}: {len(view)} live keys "
             "(last value per key, tombstoned keys absent)"]
    for key in sorted(view)[:sample]:
        lines.append(f"  {key}: {json.dumps(view[key])}")
    return lines
