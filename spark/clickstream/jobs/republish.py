"""Publish the ``sessions`` and ``attributions`` tables to their changelog topics as they are.

Every job publishes only what it changes, so a topic that lost its log (the embedded broker
restarted empty, the topic was created again) would never again hold what was published
before: jobs refuse such a topic (``kafka_changelog.check_changelogs_are_the_published_logs``),
and this command makes it the tables' again. The same for topics the warehouse meets first
(another Kafka, renamed topics, more partitions), which no job can tell from the tables' own.
Each table's every row goes out at its stored revision, keys the topic holds and the table
does not get a tombstone, the topic is read back and compared with the table, and its id is
recorded as the tables' log.

It runs with no sessionizer on the warehouse (it holds the sessionizer's lock: a stream's
newer revision could otherwise be followed by the older one read here) and the correction
lock of every client the tables hold (none of them plans, applies or publishes meanwhile); a
client new since is left to its own runs, which publish all they write.
"""

from __future__ import annotations

import json
import resource
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from clickstream.config import Config
from clickstream.errors import ClickstreamError
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_changelog import (
    changelog_topics,
    publish_pairs,
    publish_rows,
    record_changelog_ids,
)
from clickstream.io.kafka_read import read_compacted
from clickstream.io.kafka_topics import topic_ids
from clickstream.jobs.corrections import one_run_at_a_time
from clickstream.jobs.sessionize import warehouse_sessionizer_lock_path
from clickstream.locks import Holder, exclusive_or_refuse
from clickstream.progress import Progress
from clickstream.spark_session import build_spark, keep, release, releases_cache
from clickstream.tables import ATTRIBUTIONS, SESSIONS

REPUBLISH_ROLE = "a `clickstream republish`"  # written into the sessionizer's lock


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
    # Before the tables are read: a key the view holds and they do not is stale only if a
    # run published it before they were read (a new client's runs take no lock held here).
    topics = dict(zip((SESSIONS.name, ATTRIBUTIONS.name), changelog_topics(config), strict=True))
    before = {topic: _view(config, topic) for topic in topics.values()}

    def refuse(holder: Holder) -> ClickstreamError:
        if holder.role == REPUBLISH_ROLE:
            return ClickstreamError(
                f"another `clickstream republish` (pid {holder.pid}) is publishing the warehouse "
                f"{config.warehouse}'s tables to their topics; let it end (it records the "
                "topics when done) rather than run a second one beside it")
        return ClickstreamError(
            f"a sessionizer (pid {holder.pid}) runs on the warehouse {config.warehouse}: it "
            "publishes sessions as it goes, and an older revision republished beside it could "
            "follow its newer one; stop it, run `clickstream republish`, then start it again")

    spark = spark or build_spark(config, "clickstream-republish")
    tables = open_tables(config, spark)
    summary = RepublishSummary()
    with exclusive_or_refuse(warehouse_sessionizer_lock_path(config), refuse,
                             REPUBLISH_ROLE), \
            ExitStack() as corrections_held:
        specs = [spec for spec in (SESSIONS, ATTRIBUTIONS) if tables.exists(spec.name)]
        clients = sorted({row.client_id for spec in specs for row in tables.read(
            spec.name, ["client_id"]).distinct().collect()})
        locked = set(clients)  # looked up per key of the topics' views
        _allow_open_files(len(clients))
        for client in clients:  # in one order: two republishes never hold each other's
            corrections_held.enter_context(one_run_at_a_time(config, client, progress))
        for spec in specs:
            topic = topics[spec.name]
            (key,) = spec.key
            rows = keep(tables.read(spec.name).where(F.col("client_id").isin(clients)))
            try:
                progress(f"republish: {spec.name} -> topic {topic} ...")
                columns = rows.select(key, "revision").toArrow()
                stored = dict(zip(columns.column(0).to_pylist(), columns.column(1).to_pylist(),
                                  strict=True))
                stale = sorted(k for k, (client, _) in before[topic].items()
                               if client in locked and k not in stored)
                if stale:  # (a topic the tables once published to, with keys they lost since)
                    publish_pairs(config, topic, spark.createDataFrame(
                        [(k, None) for k in stale], "key string, value string"))
                summary.tombstones[topic] = len(stale)
                summary.published[topic] = publish_rows(config, topic, rows, spec)
                _check_read_back(config, topic, spec.name, key, stored, locked)
                progress(f"republish: {spec.name} -> topic {topic}: "
                         f"{summary.published[topic]} rows, {len(stale)} tombstones")
            finally:
                release(rows)
        summary.topic_ids = topic_ids(config, list(topics.values()))
        record_changelog_ids(config, {t: i for t, i in summary.topic_ids.items() if i})
    summary.seconds = time.monotonic() - started
    return summary


def _view(config: Config, topic: str) -> dict[str, tuple[str | None, int | None]]:
    """The topic's compacted view as (client, revision) per key: not every value as a dict on
    the driver (millions of sessions); a value that is not a row's (another producer's) has
    neither."""
    return read_compacted(config, topic, value_decoder=_client_and_revision)


def _client_and_revision(value: bytes) -> tuple[str | None, int | None]:
    try:
        row = json.loads(value)
    except ValueError:
        return None, None
    return (row.get("client_id"), row.get("revision")) if isinstance(row, dict) else (None, None)


def _allow_open_files(locks: int) -> None:
    """One lock file per client stays open while it runs: raise this process's soft limit on
    open files to fit them, or say it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = locks + 512  # Spark's, Kafka's and Python's own files besides
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ClickstreamError(
            f"republish holds one lock file per client ({locks}) and this process may open "
            f"{hard} files at most; raise the limit (ulimit -n {needed}), then rerun")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _check_read_back(config: Config, topic: str, table: str, key: str,
                     stored: dict[str, int], clients: set[str]) -> None:
    view = {k: revision for k, (client, revision) in _view(config, topic).items()
            if client in clients or k in stored}
    if view != stored:
        differing = sorted(k for k in set(view) | set(stored) if view.get(k) != stored.get(k))
        raise ClickstreamError(
            f"republish: topic {topic}'s compacted view is not the {table} table after the "
            f"publish ({len(differing)} {key}s differ, e.g. {', '.join(differing[:3])}): "
            "another writer sent to the topic meanwhile; rerun `clickstream republish`")
