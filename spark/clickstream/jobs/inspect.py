"""``clickstream inspect``: what the tables and topics hold, and where the sessionizer
stands, without starting Spark."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from clickstream.config import ENV_NAMES, Config
from clickstream.errors import DataLossError
from clickstream.io import read_point
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_changelog import (
    changelog_topics,
    recorded_changelog_ids,
    replaced_log_reason,
)
from clickstream.io.kafka_read import TOMBSTONE, check_no_data_loss, read_compacted
from clickstream.io.kafka_topics import check_same_log, topic_id, topic_watermarks
from clickstream.io.stream_clock import logged_tick_ms
from clickstream.jobs.sessionize import JOB, checkpoint_progress
from clickstream.progress import utc_text
from clickstream.tables import ALL_TABLES


def describe_tables(config: Config, sample: int = 0) -> list[str]:
    """One line per table: version and row count; optionally ``sample`` of its rows. All three
    are of one version, so a writer committing meanwhile cannot make them disagree."""
    # Reading needs no Spark on either engine: the delta-rs reader reads delta-spark's tables.
    tables = open_tables(config.replace(delta_engine="deltalake"))
    lines = [f"warehouse {config.warehouse}" + ("" if config.warehouse.is_dir() else
                                                 " (no such folder: nothing was written there "
                                                 "yet, or the setting names another one)")]
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


def describe_read_point(config: Config) -> list[str]:
    """Where the read point stands, and what holds a client back (``io.read_point``)."""
    point = read_point.current(config)
    if point is None:
        return ["read point: none yet (written by the first writer's commits)"]

    def listed(versions: Mapping[str, int]) -> str:
        return ", ".join(f"{name} {version}" for name, version in versions.items())

    lines = [f"read point (written {point.written_at}): {listed(point.versions)}"]
    if point.stream_watermark_ms is not None:
        lines.append(f"  sessionizer's watermark there {utc_text(point.stream_watermark_ms)}: "
                     "a session ending less than one gap before it may still be open")
    lines += [f"  client {client} read at {listed(versions)}"
              for client, versions in point.held.items()]
    lines += [f"  held by {text}" for text in read_point.describe_open_groups(config)]
    return lines


def describe_topic(config: Config, topic: str, sample: int = 0) -> list[str]:
    """The topic's compacted view: live keys, tombstoned ones (a retraction's), and
    optionally a few values."""
    last: dict[str, Any] = read_compacted(config, topic, value_decoder=_json_or_text,
                                          keep_tombstones=True)
    view = {key: value for key, value in last.items() if value is not TOMBSTONE}
    lines = [f"topic {topic} at {config.kafka_bootstrap_servers}: {len(view)} live keys "
             f"(last value per key), {len(last) - len(view)} tombstoned (their last record "
             "is a tombstone: retracted)"]
    if topic in changelog_topics(config):  # an empty view after a broker's restart says why
        replaced = replaced_log_reason(config, topic, recorded_changelog_ids(config).get(topic),
                                       topic_id(config, topic))
        lines += [f"  {replaced}"] if replaced else []
    for key in sorted(view)[:sample]:
        lines.append(f"  {key}: {json.dumps(view[key])}")
    return lines


def _json_or_text(value: bytes) -> Any:
    """A value as JSON, else as its text: the events topic holds what clients sent, malformed
    records too (the sessionizer quarantines them), and one of them failed the whole view."""
    text = value.decode("utf-8", "backslashreplace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def describe_sessionizer(config: Config) -> list[str]:
    """The sessionizer's checkpoint: its last committed micro-batch, the event-time watermark
    that makes records late, and the events topic's offsets it committed (no Kafka)."""
    checkpoint = config.checkpoint_path(JOB)
    progress = checkpoint_progress(checkpoint, config.events_topic)
    if progress is None:
        return [f"sessionizer checkpoint {checkpoint}: no micro-batch yet"]
    lines = [f"sessionizer checkpoint {checkpoint}"]
    if progress.committed < 0:
        lines.append("  no micro-batch committed yet")
    else:
        lines.append(f"  last committed micro-batch {progress.committed}, triggered "
                     f"{utc_text(progress.committed_at_ms)}")
    if progress.planned > progress.committed:
        lines.append(f"  micro-batch {progress.planned} planned, not committed: in flight, or "
                     "replayed at the next start")
    lines.append(f"  event-time watermark {utc_text(progress.watermark_ms)}: a record with a ts at "
                 "or before it is late (stored, and queued for `clickstream recompute`)")
    tick = logged_tick_ms(checkpoint, progress.committed)
    if tick is not None:
        lines.append(f"  the quiet stream's clock moved event time on to {utc_text(tick)} at its "
                     f"last tick ({ENV_NAMES['idle_clock_after_minutes']})")
    if progress.offsets:
        lines.append(f"  {config.events_topic}: next offsets " + ", ".join(
            f"p{p} {o}" for p, o in sorted(progress.offsets.items())))
    return lines


def describe_lag(config: Config) -> list[str]:
    """Records of the events topic past the sessionizer's committed offsets (asking Kafka),
    and why the sessionizer would stop on them, as its source would (reported, not raised:
    inspect only shows where things stand): offsets of another log (the broker restarted
    empty, the topic created again: no lag means anything then), or records dropped before
    they were read, one line per partition and the advice once."""
    topic = config.events_topic
    progress = checkpoint_progress(config.checkpoint_path(JOB), topic)
    if progress is None:  # every record the topic holds waits for the first micro-batch
        waiting = sum(max(high - low, 0) for low, high in topic_watermarks(config, topic).values())
        return [f"  lag: {waiting} records of {topic}, none read yet (no micro-batch "
                "committed)"]
    try:
        check_same_log(topic, progress.topic_id, topic_id(config, topic))
    except DataLossError as error:
        return [f"  lag: unknown: the committed offsets name records of another log than "
                f"{topic}'s", f"  {error}"]
    behind: dict[int, int] = {}
    facts: list[str] = []
    advice: dict[str, None] = {}  # in order, once each
    for partition, (low, high) in sorted(topic_watermarks(config, topic).items()):
        # Not in the committed offsets: read from 0 (K3), or, before the first commit, from
        # the log's start (the new checkpoint's, K8); a planned first micro-batch's start is
        # in the offsets then (K9).
        wanted = progress.offsets.get(partition, 0 if progress.committed >= 0 else low)
        try:
            check_no_data_loss(topic, partition, wanted, low, high)
        except DataLossError as error:
            fact, _, what_to_do = str(error).partition("; ")
            facts.append(f"  {fact}")
            advice[what_to_do] = None
        behind[partition] = max(high - max(wanted, low), 0)
    by_partition = ", ".join(f"p{p} {n}" for p, n in behind.items() if n)
    return [f"  lag: {sum(behind.values())} records of {topic} not yet committed"
            + (f" ({by_partition})" if by_partition else ""), *facts,
            *(f"  {text}" for text in advice if text)]
