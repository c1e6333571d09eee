"""Publish the ``sessions`` and ``attributions`` tables to their changelog topics as they are.

Every job publishes only what it changes, so a topic that lost its log (the embedded broker
restarted empty, the topic was created again) or a new topic (renamed, more partitions)
would never again hold what was published before: jobs refuse such a topic
(``kafka_changelog.check_changelogs_are_the_published_logs``), and this command makes it the
tables' again. Each table's every row goes out at its stored revision, keys the topic holds
and the table does not get a tombstone, the topic is read back and compared with the table,
and its id is recorded as the tables' log.

It runs with no sessionizer on the warehouse (it holds the sessionizer's lock: a stream's
newer revision could otherwise be followed by the older one read here) and every client's
correction lock (no correction plans, applies or publishes meanwhile).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.errors import ClickstreamError
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_changelog import (
    changelog_topics,
    publish_pairs,
    publish_rows,
    record_changelog_ids,
)
from clickstream.io.kafka_clients import read_compacted, topic_id, topic_watermarks
from clickstream.jobs.corrections import one_run_at_a_time
from clickstream.jobs.sessionize import warehouse_sessionizer_lock_path
from clickstream.locks import exclusive_or_refuse
from clickstream.progress import Progress
from clickstream.spark_session import build_spark, keep, release, releases_cache
from clickstream.tables import ATTRIBUTIONS, SESSIONS


@dataclass
class RepublishSummary:
    published: dict[str, int] = field(default_factory=dict)  # by topic: rows sent
    tombstones: dict[str, int] = field(default_factory=dict)  # by topic: stale keys retracted
    topic_ids: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0

    def describe(self) -> str:
        sent = "; ".join(f"{topic}: {rows} rows, {self.tombstones.get(topic, 0)} tombstones "
                         f"(topic id {self.topic_ids.get(topic)})"
                         for topic, rows in self.published.items())
        return f"republish: {sent or 'no table to publish'}; {self.seconds:.1f}s"


@releases_cache
def run_republish(config: Config, *, spark: SparkSession | None = None,
                  progress: Progress = print) -> RepublishSummary:
    """Publish both tables to their topics, check the topics' compacted views equal them,
    and record the topics as the tables' logs.

    Raises:
        ClickstreamError: a sessionizer runs on the warehouse; a topic's compacted view is
            not the table after the publish (another writer sent to it meanwhile).
        BrokerUnavailableError: Kafka does not answer.
    """
    started = time.monotonic()
    for topic in changelog_topics(config):  # before Spark starts: one line when Kafka is away
        topic_watermarks(config, topic)

    def refuse(holder: str) -> ClickstreamError:
        return ClickstreamError(
            f"a sessionizer (pid {holder}) runs on the warehouse {config.warehouse}: it "
            "publishes sessions as it goes, and an older revision republished beside it could "
            "follow its newer one; stop it, run `clickstream republish`, then start it again")

    spark = spark or build_spark(config, "clickstream-republish")
    tables = open_tables(config, spark)
    summary = RepublishSummary()
    with exclusive_or_refuse(warehouse_sessionizer_lock_path(config), refuse), \
            ExitStack() as corrections_held:
        specs = [(spec, topic) for spec, topic in zip((SESSIONS, ATTRIBUTIONS),
                                                      changelog_topics(config), strict=True)
                 if tables.exists(spec.name)]
        clients = sorted({row.client_id for spec, _ in specs for row in tables.read(
            spec.name, ["client_id"]).distinct().collect()})
        for client in clients:  # in one order: two republishes never hold each other's
            corrections_held.enter_context(one_run_at_a_time(config, client, progress))
        for spec, topic in specs:
            (key,) = spec.key
            rows = keep(tables.read(spec.name))
            try:
                progress(f"republish: {spec.name} -> topic {topic} ...")
                stored = {r[key]: r.revision for r in rows.select(key, "revision").collect()}
                stale = sorted(set(read_compacted(config, topic)) - set(stored))
                if stale:  # (a topic the tables once published to, with keys they lost since)
                    publish_pairs(config, topic, spark.createDataFrame(
                        [(k, None) for k in stale], "key string, value string"))
                summary.tombstones[topic] = len(stale)
                summary.published[topic] = publish_rows(config, topic, rows, spec)
                _check_read_back(config, topic, spec.name, key, stored)
                progress(f"republish: {spec.name} -> topic {topic}: "
                         f"{summary.published[topic]} rows, {len(stale)} tombstones")
            finally:
                release(rows)
        summary.topic_ids = {topic: topic_id(config, topic) for topic in changelog_topics(config)}
        record_changelog_ids(config, {t: i for t, i in summary.topic_ids.items() if i})
    summary.seconds = time.monotonic() - started
    return summary


def _check_read_back(config: Config, topic: str, table: str, key: str,
                     stored: dict[str, int]) -> None:
    view = {k: value.get("revision") for k, value in read_compacted(config, topic).items()}
    if view != stored:
        differing = sorted(k for k in set(view) | set(stored) if view.get(k) != stored.get(k))
        raise ClickstreamError(
            f"republish: topic {topic}'s compacted view is not the {table} table after the "
            f"publish ({len(differing)} {key}s differ, e.g. {', '.join(differing[:3])}): "
            "another writer sent to the topic meanwhile; rerun `clickstream republish`")

