"""Publish session and attribution changes to their Kafka changelog topics.

Delivery guarantee: at least once, idempotent by key. The key is the session_id (order_id for
attributions) and the value carries the row at its ``revision``; a retraction is a tombstone
(null value). Publishing the same change twice leaves a compacted reader with the same view,
so a batch replayed after a crash may simply publish again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, StructType

from clickstream.atomic_files import write_atomically
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import ConfigError, DataLossError
from clickstream.io.kafka_clients import make_consumer
from clickstream.io.kafka_produce import produce_records, produce_to_topics
from clickstream.io.kafka_topics import topic_ids, topic_watermarks
from clickstream.locks import LOCKS_FOLDER, exclusive
from clickstream.tables import ATTRIBUTIONS, SESSIONS, TableSpec

# In the warehouse, beside the tables the topics mirror (as the sessionizer's settings file):
# by Kafka address, each changelog topic's id when the tables were last published to it.
CHANGELOG_LOGS_FILE = "_clickstream_changelogs.json"


def changelog_topics(config: Config) -> tuple[str, str]:
    return config.sessions_topic, config.attributions_topic


def check_changelogs_answer(config: Config) -> None:
    """Fail unless the broker answers for the ``sessions`` and ``attributions`` topics, and
    each is the log the tables were published to: asked before a correction changes the
    tables those topics mirror, so that a broker out of reach leaves both as they were (a
    rerun resumes the recorded plan) rather than the tables ahead of the topics until then.

    Raises:
        BrokerUnavailableError: no answer (after ``topic_watermarks``' retries, ~30 s).
        ClickstreamError: the broker answers but lacks one of the topics.
        DataLossError: a topic is another log than the one the tables were published to
            (:func:`check_changelogs_are_the_published_logs`).
    """
    consumer = make_consumer(config)
    try:
        for topic in changelog_topics(config):
            topic_watermarks(config, topic, consumer=consumer)
    finally:
        consumer.close()
    check_changelogs_are_the_published_logs(config)


def check_changelogs_are_the_published_logs(config: Config) -> None:
    """Fail if a changelog topic is not the log the tables were published to: the embedded
    broker restarted (it keeps its data in memory only) or the topic was created again, so
    its compacted view lacks every session and attribution published before, and a job
    publishing its own changes only would leave it so for good. The first time a warehouse
    meets a topic at a Kafka address, its id is recorded unchecked (a broker without topic
    ids: nothing to compare): a warehouse meeting a topic first (another Kafka, a renamed
    topic, this check's first run on older tables) cannot tell whether the tables are on it
    (README: run ``clickstream republish`` after such a move).

    Raises:
        DataLossError: a topic's id is not the recorded one; ``clickstream republish``
            publishes the tables to the topics as they are and records them.
    """
    recorded = recorded_changelog_ids(config)
    current = topic_ids(config, changelog_topics(config))
    for topic, now in current.items():
        replaced = replaced_log_reason(config, topic, recorded.get(topic), now)
        if replaced:
            raise DataLossError(replaced)
    unknown = {topic: now for topic, now in current.items()
               if now is not None and topic not in recorded}
    if unknown:
        record_changelog_ids(config, unknown)


def replaced_log_reason(config: Config, topic: str, recorded_id: str | None,
                        current_id: str | None) -> str | None:
    """Why ``topic`` is not the log the tables were published to, or None (either id
    unknown: nothing to compare)."""
    if recorded_id is None or current_id is None or recorded_id == current_id:
        return None
    return (f"topic {topic} is not the log this warehouse's tables were published to (topic "
            f"id {recorded_id}, now {current_id}): the broker restarted empty (the embedded "
            "broker keeps its data in memory only) or the topic was created again, so its "
            "compacted view lacks the sessions and attributions published before. Run "
            f"`clickstream republish` (with the sessionizer stopped) to publish "
            f"{config.warehouse}'s tables to it as they are, then rerun; to use the new topic "
            f"for other tables, point {ENV_NAMES['warehouse']} elsewhere")


def _logs_file(config: Config) -> Path:
    return config.warehouse / CHANGELOG_LOGS_FILE


def kafka_address(config: Config) -> str:
    """The Kafka a record is kept for: the bootstrap servers, sorted, ``localhost`` as
    ``127.0.0.1`` (an Airflow task and a shell naming one broker both ways saw two Kafkas:
    ``republish`` run from one left the other refusing)."""
    servers = (server.strip().lower() for server in config.kafka_bootstrap_servers.split(","))
    return ",".join(sorted(re.sub(r"^localhost:", "127.0.0.1:", server)
                           for server in servers if server))


def _recorded(config: Config) -> dict[str, dict[str, str]]:
    path = _logs_file(config)
    if not path.exists():
        return {}
    try:
        recorded = json.loads(path.read_text())
        problem = None if isinstance(recorded, dict) and all(
            isinstance(ids, dict) and all(isinstance(i, str) for i in ids.values())
            for ids in recorded.values()) else "not {address: {topic: id}}"
    except ValueError as error:
        problem = str(error)
    if problem is not None:
        raise ConfigError(
            f"{path} is not the JSON this product writes ({problem}); delete it and run "
            "`clickstream republish` (with the sessionizer stopped): it publishes the tables "
            "to their topics and records them again")
    return recorded


def recorded_changelog_ids(config: Config) -> dict[str, str]:
    """The recorded id of each changelog topic, at this Kafka address, the warehouse's
    tables were published to."""
    return _recorded(config).get(kafka_address(config), {})


def record_changelog_ids(config: Config, ids: Mapping[str, str]) -> None:
    """Record ``ids`` (topic -> id, at this Kafka address) over what is recorded, in one
    rename, one writer at a time (two jobs recording at once kept only the later's)."""
    path = _logs_file(config)
    with exclusive(config.warehouse / LOCKS_FOLDER / "changelogs.lock"):
        recorded = _recorded(config)
        address = kafka_address(config)
        recorded[address] = {**recorded.get(address, {}), **ids}
        write_atomically(path, json.dumps(recorded, indent=1, sort_keys=True) + "\n")


# Spark's ``to_json`` options for the changelog value (the session time zone is UTC, so XXX is
# a Z): ISO-8601 timestamps with milliseconds, null fields kept.
SPARK_JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSXXX",
                      "ignoreNullFields": "false"}


def spark_row_value(columns: Mapping[str, Column], schema: StructType) -> Column:
    """The changelog value of a row as a JSON string computed in Spark: the table's columns in
    its order, nulls included, timestamps ISO-8601 UTC with milliseconds, decimals as strings.
    Every job publishes through it (a correction plan stores it and publishes it as is), so
    consumers see one shape whichever job published a row.

    Args:
        columns: an expression for every column of ``schema``, by name.
        schema: the table's schema (``TableSpec.schema``).
    """
    return F.to_json(F.struct(*[
        (columns[f.name].cast("string") if isinstance(f.dataType, DecimalType)
         else columns[f.name]).alias(f.name) for f in schema.fields]), SPARK_JSON_OPTIONS)


_CHUNK_SCHEMA = "chunk binary"


def _arrow_chunks(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """On an executor: each Arrow batch of (key, value) as one Arrow IPC stream in one row."""
    for batch in batches:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        yield pa.RecordBatch.from_pydict({"chunk": [sink.getvalue().to_pybytes()]})


def local_pairs(pairs: DataFrame) -> Iterator[tuple[str | None, str | None]]:
    """The rows of a two-column ``(key, value)`` frame on the driver, a partition at a time.

    Each partition travels as Arrow batches, and the next partition is computed while this
    one is sent. ``toLocalIterator`` would unpickle one ``Row`` per record and compute the
    partitions one after the other: ~10 µs a record against ~3.5 (session 40).
    """
    packed = pairs.mapInArrow(_arrow_chunks, _CHUNK_SCHEMA)
    for row in packed.toLocalIterator(prefetchPartitions=True):
        batch = pa.ipc.open_stream(row.chunk).read_all()
        yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


def publish_pairs(config: Config, topic: str, pairs: DataFrame) -> int:
    """Publish a frame of ``(key, value)`` string columns as it is (a null value is a
    tombstone), in the frame's order within each partition; returns how many records."""
    return produce_records(config, topic, local_pairs(pairs))


def publish_correction(config: Config, client_id: str,
                       pairs_by_topic: Sequence[tuple[str, DataFrame]]) -> int:
    """Publish one correction's ``(key, value)`` frames, topic after topic; with
    ``CLICKSTREAM_KAFKA_TRANSACTIONS`` in one Kafka transaction, so that a ``read_committed``
    reader sees the correction's sessions and attributions together or not at all (mid-way,
    a retracted session and its replacement were both live). The transactional id is the
    client's within these topics: a client's corrections run one at a time, and a rerun
    fences the producer of a run killed while it sent."""
    if not config.kafka_transactions:  # each topic acknowledged before the next is sent
        return sum(publish_pairs(config, topic, pairs) for topic, pairs in pairs_by_topic)
    digest = hashlib.sha256("\x1f".join(
        (config.sessions_topic, config.attributions_topic, client_id)).encode()).hexdigest()
    # Computed before the transaction begins: while it is open, read_committed readers of its
    # partitions (other clients' publish gates too) wait at its first record.
    sends = [(topic, list(local_pairs(pairs))) for topic, pairs in pairs_by_topic]
    return produce_to_topics(config, sends,
                             transactional_id=f"clickstream-corrections-{digest[:24]}")


def publish_rows(config: Config, topic: str, rows: DataFrame, spec: TableSpec) -> int:
    """Publish rows shaped like ``spec``'s table, keyed by its key; returns how many.

    The value is made in Spark and only ``(key, value)`` strings travel to the driver: a
    Python ``Row`` per record with its timestamps and decimals cost ~3x more (40 µs a
    session).
    """
    (key,) = spec.key
    return publish_pairs(config, topic, rows.select(
        F.col(key).alias("key"),
        spark_row_value({name: F.col(name) for name in spec.schema.fieldNames()}, spec.schema)
        .alias("value")))


def publish_sessions(config: Config, rows: DataFrame) -> int:
    """Publish rows of the ``sessions`` table, keyed by session_id."""
    return publish_rows(config, config.sessions_topic, rows, SESSIONS)


def publish_attributions(config: Config, rows: DataFrame) -> int:
    """Publish rows of the ``attributions`` table, keyed by order_id."""
    return publish_rows(config, config.attributions_topic, rows, ATTRIBUTIONS)
