"""The thin confluent-kafka layer every other module uses (only this and kafka_broker import it).

Client settings are built here from :class:`~clickstream.config.Config` so the embedded
broker and a real Kafka cluster get the same code path: ``Config.kafka_bootstrap_servers``
picks the cluster and ``Config.kafka_options`` (``CLICKSTREAM_KAFKA_OPTIONS="k=v,..."``) passes
any librdkafka setting through (SASL/TLS for real clusters, tuning).

Delivery guarantees:

- Writers (:func:`make_producer`, :func:`produce_json`, :func:`flush_or_raise`): at-least-once.
  The idempotent producer (acks=all) never duplicates or reorders records because of its
  own retries, and :func:`flush_or_raise` fails loudly if any record was not acknowledged.
  A step rerun after a failure may send some records again; consumers stay correct because
  records are keyed (event_id / session_id with a revision) and applied idempotently.
- Readers (:func:`read_compacted`, :func:`topic_watermarks`): read-only snapshots up to the
  high watermarks seen at the start; they commit no offsets. A read never skips records
  silently: records dropped by the broker raise :class:`~clickstream.errors.DataLossError`
  (Spark's ``failOnDataLoss``), or, for a reader told to go on (:func:`read_offset_ranges` with
  ``fail_on_data_loss=False``), come out as one marker record per lost run of offsets
  (:func:`lost_offsets_marker`).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import date, datetime
from decimal import Decimal
from typing import Any, TypeVar

from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from clickstream.config import ENV_NAMES, Config, option_place
from clickstream.errors import (
    BrokerUnavailableError,
    ClickstreamError,
    ConfigError,
    DataLossError,
    DeliveryError,
    KafkaRefusedError,
)
from clickstream.events.contract import LOST_OFFSETS_HEADER
from clickstream.retry import retry_delay

KafkaConfig = dict[str, Any]
ClientT = TypeVar("ClientT")
T = TypeVar("T")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# librdkafka's log
# --------------------------------------------------------------------------------------------


class RepeatedLogFilter(logging.Filter):
    """Let one of each librdkafka message through per ``window_s``, counting the others.

    Without it, a broker that is down makes librdkafka log every reconnect attempt: a command
    printed ~630 identical "Connect ... failed" lines in the 30 s before it gave its one-line
    reason. Messages are told apart by facility and text, without the client's name (each
    client is ``consumer-<n>``) and the "(after 0ms in state ...)" timing.
    """

    _TIMING = re.compile(r"\s*\(after \d+ms in state \w+[^)]*\)")
    # Past this many messages, those whose window passed are forgotten: a sessionizer runs
    # for weeks, and messages naming offsets or brokers are each new.
    MAX_REMEMBERED = 1024

    def __init__(self, window_s: float = 60.0) -> None:
        super().__init__()
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (shown at, hidden)
        self._prune_at = self.MAX_REMEMBERED

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        facility, text = (str(args[0]), str(args[-1])) if len(args) == 3 else ("", record.msg)
        key = (facility, self._TIMING.sub("", str(text)))
        now = time.monotonic()
        with self._lock:
            shown_at, hidden = self._seen.get(key, (None, 0))
            if shown_at is not None and now - shown_at < self.window_s:
                self._seen[key] = (shown_at, hidden + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > self._prune_at:  # doubling: not a scan per message
                self._seen = {k: seen for k, seen in self._seen.items()
                              if now - seen[0] < self.window_s}
                self._prune_at = max(self.MAX_REMEMBERED, 2 * len(self._seen))
        if shown_at is None:
            record.msg = (f"{record.msg} (repeats of this message are shown once every "
                          f"{self.window_s:g} s)")
        elif hidden:
            record.msg = f"{record.msg} ({hidden} more like it since it was last shown)"
        return True


# librdkafka writes its log here, not to stderr; one logger for every client of the process.
LIBRDKAFKA_LOG = logging.getLogger("clickstream.librdkafka")
LIBRDKAFKA_LOG.addFilter(RepeatedLogFilter())


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a loop over up to millions of records.

    Such loops allocate a container object per record (Messages, Rows, tuples) and create no
    reference cycles, yet the collector runs every few hundred allocations, and as the loop's
    survivors pile up its full collections re-scan everything alive (in a Spark driver,
    millions of objects): reading back a million records took 7.0 s with it and 3.7-4.6 s
    without (against the embedded broker). Restored on exit; cycles made meanwhile are
    collected then."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Why each default: lz4 packs JSON ~3x (and the embedded broker's per-partition cap counts
# compressed bytes); a short linger batches without adding visible latency; acks=all plus
# idempotence gives ordered, duplicate-free retries.
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "compression.type": "lz4",
    "linger.ms": 5,
    "acks": "all",
    "enable.idempotence": True,
}
# Paced producers (live feeds at a target rate) wait this long to fill a batch. The embedded
# broker stores every produce request's batch as is and serves one stored batch per partition
# per fetch, found by a linear scan (kafka_broker, known limit 7): a trickle of one-record
# batches makes reading it quadratic. 50 ms gives ~8 records per batch at 2,500 events/s over
# 16 partitions, and costs a live event at most 50 ms of latency.
PACED_LINGER_MS = 50
# Bulk sends (a table's rows streamed from Spark: changelogs, corrections, replays) wait this
# long: fed at ~100k records/s over hundreds of partitions, 5 ms closed a batch after about
# one record, and reading 300k such records back took 8.4 s (27.6 s behind an earlier such
# publish) against 0.7 s (1.5 s) with 100 ms (bench/publish_readback_bench.py, BENCHMARKS.md
# session 31). It costs no latency: the final flush sends what is lingering at once.
BULK_LINGER_MS = 100
# librdkafka looks for timed-out records about once a second: the flush waits this much past
# the records' own delivery timeout for their reports.
TIMED_OUT_REPORT_GRACE_S = 5.0
# Offsets live with the outputs (Delta), so nothing is auto-committed. A small session timeout
# because classic groups wait session.timeout.ms on every rejoin (6 s is the brokers' minimum).
CONSUMER_DEFAULTS: Mapping[str, Any] = {
    "enable.auto.commit": False,
    "auto.offset.reset": "earliest",
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 500,
}

# Defaults of the classic group protocol: with ``group.protocol=consumer`` (KIP-848, the
# other cure for slow rejoins) the broker decides them, and a consumer given them fails.
CLASSIC_GROUP_ONLY = ("session.timeout.ms", "heartbeat.interval.ms")

_AVOID_LOSS = (
    "To avoid it, keep readers running: the embedded broker keeps only ~5 MiB per partition "
    "(give the topic more partitions or use a real Kafka cluster)"
)
# Records dropped before they were read: the offsets still name them, so a reader can go on.
_LOSS_ADVICE = (
    "the lost records must be re-sent (replay them from their source or load them with "
    "`clickstream backfill`); to accept the loss instead, run the sessionizer with "
    f"{ENV_NAMES['fail_on_data_loss']}=false: it keeps its checkpoint and session state, records "
    "each lost run of offsets as one row in the quarantine table and reads on (README, Known "
    f"limits). {_AVOID_LOSS}"
)
# A changelog read from offset 0 for its compacted view: no reader position to keep or go on
# from, and the sessionizer's setting does not apply.
_CHANGELOG_LOSS_ADVICE = (
    "a compacted view needs every record since offset 0, so this topic's view can no longer "
    "be read from this broker (the embedded broker does not compact and keeps only ~5 MiB per "
    "partition: give the topic more partitions, or use a real Kafka cluster with compaction); "
    "the Delta tables hold every session and attribution (`clickstream inspect`)"
)
# Records a publish just sent, gone before they could be read back (its publish gate).
PUBLISHED_LOSS_ADVICE = (
    "the records this publish sent were dropped before they were read back: more than the "
    "embedded broker keeps per partition (~5 MiB, no compaction) went to the topic; give it "
    "more partitions, or use a real Kafka cluster with compaction. The tables hold the "
    "corrections, and the plan stays unpublished for the client's next correction run"
)
# The log was replaced (K7 of io.kafka_source) or cut below the reader: its offsets name
# records of another log, so no reader can go on from them, whatever it accepts.
_OTHER_LOG_ADVICE = (
    f"the reader's offsets name records of another log, so {ENV_NAMES['fail_on_data_loss']}"
    "=false does not apply. To read the log from its start, delete the reader's checkpoint (the "
    "sessionizer then stores again what it had stored of the records in the log: README, Known "
    "limits); re-send the records that are gone, or load them with `clickstream backfill`. "
    f"{_AVOID_LOSS}"
)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _merge(config: Config, defaults: Mapping[str, Any], extra: Mapping[str, Any]) -> KafkaConfig:
    """Defaults < ``Config.kafka_options`` (operator) < ``extra`` (the calling code)."""
    merged: KafkaConfig = {"bootstrap.servers": config.kafka_bootstrap_servers,
                           "client.id": "clickstream", "logger": LIBRDKAFKA_LOG}
    merged.update(defaults)
    merged.update(config.kafka_options)
    merged.update(extra)
    return merged


def producer_config(config: Config, **extra: Any) -> KafkaConfig:
    """librdkafka settings for a producer.

    Args:
        config: Run settings (bootstrap servers, ``kafka_options`` passthrough).
        **extra: librdkafka settings that win over everything, e.g.
            ``producer_config(cfg, **{"linger.ms": 0, "transactional.id": "x"})``.

    Returns:
        A dict for ``confluent_kafka.Producer``: lz4, linger 5 ms, acks=all, idempotence.
    """
    return _merge(config, PRODUCER_DEFAULTS, extra)


def consumer_config(config: Config, group_id: str | None = None, **extra: Any) -> KafkaConfig:
    """librdkafka settings for a consumer.

    Args:
        config: Run settings (bootstrap servers, ``kafka_options`` passthrough).
        group_id: Consumer group; default a fresh ``clickstream-reader-<uuid>`` (readers that
            ``assign()`` partitions and keep offsets in their outputs need no shared group).
        **extra: librdkafka settings that win over everything (dotted names via ``**{}``).

    Returns:
        A dict for ``confluent_kafka.Consumer``: no auto-commit, earliest, 6 s session timeout.
    """
    merged = _merge(config, CONSUMER_DEFAULTS, extra)
    if str(merged.get("group.protocol", "")).strip().lower() == "consumer":
        for name in CLASSIC_GROUP_ONLY:  # the broker sets them; librdkafka refuses them
            if name not in config.kafka_options and name not in extra:
                del merged[name]
    if group_id is not None or "group.id" not in merged:
        merged["group.id"] = group_id or f"clickstream-reader-{uuid.uuid4().hex[:12]}"
    return merged


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class DeliveryCounts:
    """A producer's delivery reports, counted apart from it: the callback librdkafka holds
    must not hold the producer. A producer whose own bound method was its callback was a
    reference cycle, so a dropped producer kept its threads and connections (retrying a
    stopped broker's port) until Python's cyclic GC ran, not when its last user let go."""

    def __init__(self, user_on_delivery: Callable[..., None] | None) -> None:
        self._user_on_delivery = user_on_delivery
        self.reset()

    def reset(self) -> None:
        self.delivered = 0
        self.failed = 0
        self.first_error: str | None = None
        self.first_failure: KafkaError | None = None

    def on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            if self.first_error is None:
                self.first_error = f"topic {msg.topic()} [{msg.partition()}]: {err.str()}"
                self.first_failure = err
        if self._user_on_delivery is not None:
            self._user_on_delivery(err, msg)


class TrackedProducer(Producer):
    """A ``confluent_kafka.Producer`` that counts delivery reports for :func:`flush_or_raise`.

    Counts cover records produced without a per-record ``on_delivery`` callback (a per-record
    callback replaces the tracking one). Counters reset after each :func:`flush_or_raise`.
    """

    def __init__(self, conf: Mapping[str, Any]) -> None:
        settings = dict(conf)
        self.counts = DeliveryCounts(settings.pop("on_delivery", None))
        settings["on_delivery"] = self.counts.on_delivery
        self.bootstrap_servers = str(settings.get("bootstrap.servers", "?"))
        super().__init__(settings)

    @property
    def delivered(self) -> int:
        return self.counts.delivered

    @property
    def failed(self) -> int:
        return self.counts.failed

    @property
    def first_error(self) -> str | None:
        return self.counts.first_error

    def reset_counts(self) -> None:
        self.counts.reset()

    # confluent-kafka raises a fatal error (an idempotent producer's sequence broken by the
    # broker) from poll()/flush() with the delivery reports of that call still to run: each
    # report then failed with a bare SystemError, which no caller took for a failed send.
    # (A try costs nothing until it raises: a paced send polls once a record.)
    def poll(self, *args: Any, **kwargs: Any) -> int:
        return self._guarded(super().poll, *args, **kwargs)

    def flush(self, *args: Any, **kwargs: Any) -> int:
        return self._guarded(super().flush, *args, **kwargs)

    def _guarded(self, call: Callable[..., int], *args: Any, **kwargs: Any) -> int:
        """``call(...)``, its fatal error raised as the :class:`DeliveryError` it means."""
        try:
            return call(*args, **kwargs)
        except (KafkaException, SystemError) as exc:
            stopped = self._stopped(exc)
            if stopped is None:
                raise
            raise stopped from exc

    def _stopped(self, exc: Exception) -> DeliveryError | None:
        """A :class:`DeliveryError` for the fatal error ``exc`` carries, if it carries one.

        Under load confluent-kafka's ``SystemError`` sometimes carries no fatal error at all
        (seen once in CI, not reproducible alone): then the failed delivery report of that
        call names what stopped the producer, which a ``SystemError`` from a flush or poll
        always means (the handle crashed inside its callbacks)."""
        fatal = next((e.args[0] for e in (exc, exc.__cause__, exc.__context__)
                      if isinstance(e, KafkaException) and e.args
                      and isinstance(e.args[0], KafkaError) and e.args[0].fatal()), None)
        if fatal is None and isinstance(exc, SystemError):
            fatal = self.counts.first_failure
        if fatal is None:
            return None
        return DeliveryError(
            f"kafka delivery failed: the producer to {self.bootstrap_servers} stopped on a "
            f"fatal error: {fatal.str()} ({fatal.name()}); records it had not had "
            "acknowledged were not sent. Run the command (or step) again: it sends them "
            "again with a new producer")


_UNKNOWN_SETTING = "No such configuration property"
# Names librdkafka reports a setting by where it has an alias the operator may have used.
_REPORTED_AS = {"linger.ms": "queue.buffering.max.ms", "acks": "request.required.acks",
                "retries": "message.send.max.retries", "compression.type": "compression.codec",
                "delivery.timeout.ms": "message.timeout.ms",
                "max.in.flight": "max.in.flight.requests.per.connection"}


def _spellings(alias: str) -> tuple[str, str]:
    """A setting's two names in ``kafka_options``: librdkafka's own, then ``alias``."""
    return _REPORTED_AS[alias], alias


def _created(factory: Callable[[KafkaConfig], ClientT], settings: KafkaConfig,
             config: Config) -> ClientT:
    """``factory(settings)``, pointing at the operator's settings when librdkafka refuses one.
    A setting is quoted only where librdkafka knows its name: one it does not know, or one it
    did not name, may be part of a password cut at an unescaped comma (``p=ab,cd=ef``)."""
    try:
        return factory(settings)
    except KafkaException as exc:
        cause = exc.args[0] if exc.args else None
        if not (isinstance(cause, KafkaError) and cause.code() == KafkaError._INVALID_ARG
                and config.kafka_options):
            raise
        text = cause.str()
        keys = list(config.kafka_options)
        named = [place for place, key in enumerate(keys)
                 if any(f"{quote}{name}{quote}" in text for quote in '"`'
                        for name in (key, _REPORTED_AS.get(key, key)))]
        unquoted = "not named here: it may be part of a value cut at an unescaped comma"
        if not named:
            culprit = (f"one of items 1-{len(keys)} ({unquoted})" if len(keys) > 1
                       else f"item 1 ({unquoted})")
        elif _UNKNOWN_SETTING in text:
            place = named[0]
            culprit = f"{option_place(place + 1, keys[place - 1] if place else '')} ({unquoted})"
            text = _UNKNOWN_SETTING
        else:
            culprit = repr(keys[named[0]])
        raise ConfigError(
            f"{ENV_NAMES['kafka_options']}: librdkafka refused {culprit} ({text}); fix or remove "
            "it (settings: https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md"
            f"; the Java client's names, for Spark's native source, go in "
            f"{ENV_NAMES['spark_kafka_options']})") from None


def make_producer(config: Config, **extra: Any) -> TrackedProducer:
    """Create the product's producer (settings from :func:`producer_config`).

    Delivery guarantee: at-least-once, once :func:`flush_or_raise` returned without error.

    Raises:
        ConfigError: librdkafka refused a setting of ``CLICKSTREAM_KAFKA_OPTIONS``.
    """
    return _created(TrackedProducer, producer_config(config, **extra), config)


def make_consumer(config: Config, **extra: Any) -> Consumer:
    """Create a consumer (settings from :func:`consumer_config`; dotted names via ``**{}``).

    Raises:
        ConfigError: librdkafka refused a setting of ``CLICKSTREAM_KAFKA_OPTIONS``.
    """
    return _created(Consumer, consumer_config(config, **extra), config)


def _json_default(value: object) -> object:
    if isinstance(value, Decimal):
        return str(value)  # amounts are decimal strings in the contracts, never floats
    if isinstance(value, datetime | date):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable: {value!r}")


def encode_json(value: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON; Decimal becomes a string, datetime/date ISO-8601."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                      default=_json_default).encode()


def produce_waiting(producer: Producer, topic: str, **record: Any) -> None:
    """``producer.produce(topic, **record)``, waiting while the local queue is full.

    librdkafka raises BufferError when its queue is full; serving delivery reports lets it
    send, so bulk writers get back-pressure instead of an error.
    """
    while True:
        try:
            producer.produce(topic, **record)
            return
        except BufferError:
            producer.poll(0.05)


def produce_json(producer: Producer, topic: str, key: str | bytes | None,
                 value: Mapping[str, Any] | None, *, partition: int | None = None,
                 timestamp_ms: int | None = None,
                 headers: Mapping[str, str | bytes] | None = None) -> None:
    """Queue one record whose value is JSON; ``value=None`` sends a tombstone.

    Waits (serving delivery reports) while the local queue is full instead of failing, so
    bulk writers get back-pressure. Delivery is only known after :func:`flush_or_raise`.

    Args:
        producer: From :func:`make_producer` (a plain Producer works, with weaker reporting).
        topic: Target topic.
        key: Record key; str is UTF-8 encoded. Keys decide the partition and compaction.
        value: JSON-serialisable mapping, or None for a tombstone (delete this key).
        partition: Explicit partition; default: by key hash.
        timestamp_ms: Record timestamp (epoch ms); default: now.
        headers: Optional record headers.
    """
    kwargs: dict[str, Any] = {
        "key": key.encode() if isinstance(key, str) else key,
        "value": None if value is None else encode_json(value),
    }
    if partition is not None:
        kwargs["partition"] = partition
    if timestamp_ms is not None:
        kwargs["timestamp"] = timestamp_ms
    if headers:
        kwargs["headers"] = [(k, v.encode() if isinstance(v, str) else v)
                             for k, v in headers.items()]
    produce_waiting(producer, topic, **kwargs)
    producer.poll(0)


def send_linger(config: Config, *, paced: bool) -> KafkaConfig:
    """The ``linger.ms`` of a paced or a bulk send (:data:`PACED_LINGER_MS`,
    :data:`BULK_LINGER_MS`), unless ``kafka_options`` sets one: the user's choice wins."""
    if set(_spellings("linger.ms")) & set(config.kafka_options):
        return {}
    return {"linger.ms": PACED_LINGER_MS if paced else BULK_LINGER_MS}


def send_budget_s(config: Config, default_s: float) -> float:
    """How long a send waits for its records to be acknowledged: the delivery timeout
    ``kafka_options`` sets (``message.timeout.ms`` or its alias ``delivery.timeout.ms``; the
    user's choice wins, as for the linger), else ``default_s``.

    Raises:
        ConfigError: the option is not a positive number of milliseconds (librdkafka's 0,
            no timeout, would leave a failed send's records pending for good).
    """
    for name in _spellings("delivery.timeout.ms"):
        if name in config.kafka_options:
            value = str(config.kafka_options[name]).strip()
            if not value.isdigit() or int(value) == 0:
                raise ConfigError(
                    f"{ENV_NAMES['kafka_options']}: {name}={value!r} must be a positive number "
                    "of milliseconds (how long a send waits for Kafka to acknowledge its "
                    f"records); leave it out for the default, {default_s:g} s")
            return int(value) / 1000
    return default_s


Records = Iterable[tuple[str | bytes | None, str | bytes | None]]


def produce_records(config: Config, topic: str, records: Records, *,
                    rate_per_second: float | None = None, flush_timeout_s: float = 60.0) -> int:
    """Send already-serialised ``(key, value)`` records as they are (bad ones included).

    For generators and replays whose values must reach the topic byte for byte, e.g.
    deliberately malformed events. Delivery guarantee: at-least-once; returns only after every
    record was acknowledged.

    Args:
        config: Run settings.
        topic: Target topic.
        records: ``(key, value)`` pairs; str is UTF-8 encoded, a None value is a tombstone.
        rate_per_second: Pace sending to about this many records per second (batching for up
            to :data:`PACED_LINGER_MS`); None = as fast as possible (batching for up to
            :data:`BULK_LINGER_MS`, see :func:`send_linger`).
        flush_timeout_s: How long the records may take to be acknowledged, unless
            ``kafka_options`` sets a delivery timeout (:func:`send_budget_s`).

    Returns:
        How many records were sent.

    Raises:
        DeliveryError: Some records were not acknowledged (see :func:`flush_or_raise`). By
            then the producer has given up on every record (none is still queued or retried).
        KafkaRefusedError: librdkafka refused a record itself (one larger than the
            producer's ``message.max.bytes``): no retry sends it.
        Any error of ``records``: raised once the producer dropped what it still queued.
    """
    return produce_to_topics(config, [(topic, records)], rate_per_second=rate_per_second,
                             flush_timeout_s=flush_timeout_s)


# How long a transaction may stay open at most (librdkafka's default): while it is open,
# read_committed readers of its partitions stop at its first record, other clients' publish
# gates included, and a transaction left by a kill -9 stays open that long (or until the
# client's rerun fences it). Its records are computed before it begins (publish_correction).
# Brokers cap it at transaction.max.timeout.ms (15 minutes by default).
TRANSACTION_TIMEOUT_MS = 60_000
TRANSACTION_TIMEOUT_MAX_MS = 900_000


def produce_to_topics(config: Config, sends: Iterable[tuple[str, Records]], *,
                      rate_per_second: float | None = None, flush_timeout_s: float = 60.0,
                      transactional_id: str | None = None) -> int:
    """:func:`produce_records` for several topics in turn, by one producer.

    With ``transactional_id``, every record goes in one Kafka transaction: a ``read_committed``
    reader sees all of them or none, and a failure aborts them all. The id fences an earlier
    producer of the same id that is still sending (a run killed and rerun).

    Raises:
        DeliveryError: as :func:`produce_records`; for a transaction, also one a record of
            failed in (aborted), or one Kafka could not begin or commit.
        KafkaRefusedError: as :func:`produce_records`; also Kafka refusing the transactional
            id (its rights) or the producer for good.
    """
    # Each record's delivery timeout is the flush's budget, so when the flush gives up,
    # librdkafka has given up on every record too: none can reach the topic later, behind the
    # newer revisions a rerun sends. Its default (300 s) outlived the flush (60 s).
    budget_s = send_budget_s(config, flush_timeout_s)
    extra: dict[str, Any] = {}
    if transactional_id is not None:  # a record's timeout may not pass the transaction's
        chosen = config.kafka_options.get("transaction.timeout.ms")
        timeout_ms = int(chosen) if chosen and str(chosen).isdigit() else min(
            TRANSACTION_TIMEOUT_MAX_MS, max(TRANSACTION_TIMEOUT_MS, round(budget_s * 1000)))
        budget_s = min(budget_s, timeout_ms / 1000)
        extra = {"transactional.id": transactional_id, "transaction.timeout.ms": timeout_ms}
    extra["message.timeout.ms"] = round(budget_s * 1000)
    producer = make_producer(config, **send_linger(config, paced=bool(rate_per_second)),
                             **extra)
    if transactional_id is not None:
        _transaction_step(producer, "begin", lambda: (producer.init_transactions(budget_s),
                                                      producer.begin_transaction()))
    started = time.monotonic()
    sent = 0
    abortable = False  # a record of the transaction failed: it can only be aborted
    try:
        with gc_paused():
            for topic, records in sends:
                for key, value in records:
                    if rate_per_second:  # a poll returns at its first delivery report: wait
                        while (ahead := sent / rate_per_second
                               - (time.monotonic() - started)) > 0:
                            producer.poll(max(ahead, 0.001))  # reports served meanwhile; a
                            # wait under 1 ms is poll(0) to librdkafka, which would spin a core
                    if producer.failed:  # the broker is gone or refuses: the flush raises
                        producer.purge()  # stopped here, not after every record's own budget
                        break
                    raw_key = key.encode() if isinstance(key, str) else key
                    raw_value = value.encode() if isinstance(value, str) else value
                    try:
                        produce_waiting(producer, topic, key=raw_key, value=raw_value)
                    except KafkaException as exc:
                        if transactional_id is not None and (
                                exc.args[0].txn_requires_abort()
                                or exc.args[0].code() == KafkaError._STATE):
                            # A record failed (its report not served yet): the transaction
                            # must be aborted; flush_or_raise then names that failure.
                            producer.poll(0)
                            abortable = True
                            break
                        raise KafkaRefusedError(
                            f"record {sent + 1} to {topic} (key {raw_key!r:.80}, "
                            f"{len(raw_value or b'')} bytes) was refused by the producer: "
                            f"{exc.args[0].str()}; records before it may have been sent, none "
                            "after it. Fix the record or the producer's settings "
                            f"({ENV_NAMES['kafka_options']}, e.g. message.max.bytes), then "
                            "rerun") from exc
                    sent += 1
                    if sent % 1000 == 0:
                        producer.poll(0)
                if producer.failed or abortable:  # nor the next topic's
                    break
    except BaseException:
        # Queued records must not reach the topic after this call failed (a rerun may send
        # newer revisions of their keys); one already on the wire may still land (in a
        # transaction: aborted, so a read_committed reader never sees it).
        producer.purge()
        producer.flush(0)
        if transactional_id is not None:
            with suppress(KafkaException):  # the error raised is the one above
                producer.abort_transaction(budget_s)
        raise
    if transactional_id is not None and (producer.failed or abortable):
        with suppress(KafkaException):  # flush_or_raise says which record failed
            producer.abort_transaction(budget_s)
        flush_or_raise(producer, budget_s + TIMED_OUT_REPORT_GRACE_S)
        raise DeliveryError(
            f"kafka delivery failed: a record of the transaction to "
            f"{producer.bootstrap_servers} failed, and the transaction was aborted; run the "
            "command (or step) again: it sends them again")
    elif transactional_id is not None:
        _transaction_step(producer, "commit",
                          lambda: producer.commit_transaction(budget_s + TIMED_OUT_REPORT_GRACE_S))
    flush_or_raise(producer, budget_s + TIMED_OUT_REPORT_GRACE_S)
    return sent


# Kafka's answers no rerun gets past (the transactional id's rights, the cluster's).
_REFUSED_TRANSACTION = frozenset({KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                  KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def _transaction_step(producer: TrackedProducer, step: str, call: Callable[[], object]) -> None:
    """``call`` (begin or commit a transaction), or an error after aborting it.

    Raises:
        KafkaRefusedError: Kafka refuses the transactional id (its rights) or the producer
            for good (fatal): a rerun gets no further.
        DeliveryError: any other failure; a rerun sends the records again.
    """
    try:
        call()
    except KafkaException as exc:
        error = exc.args[0]
        text = error.str() if isinstance(error, KafkaError) else str(error)
        if isinstance(error, KafkaError) and (error.fatal()
                                              or error.code() in _REFUSED_TRANSACTION):
            raise KafkaRefusedError(
                f"kafka refused to {step} the transaction of {producer.bootstrap_servers}: "
                f"{text}; with ACLs the product's principal needs Write on the transactional "
                "ids starting with 'clickstream-' (or set CLICKSTREAM_KAFKA_TRANSACTIONS=false)"
            ) from exc
        if step == "commit":
            with suppress(KafkaException):  # refused while Kafka still commits it: its fate
                producer.abort_transaction(30)  # is Kafka's, hence the wording below
        raise DeliveryError(
            f"kafka could not {step} the transaction of {producer.bootstrap_servers}: {text}; "
            "it is aborted, unless Kafka finished committing it meanwhile; run the command (or "
            "step) again: it sends the records again (by key and revision, so a committed copy "
            "changes nothing)") from exc


def flush_or_raise(producer: Producer, timeout_s: float = 60.0) -> None:
    """Wait until every queued record is acknowledged, or raise.

    Raises:
        DeliveryError: Some records failed or are still queued after ``timeout_s``; says how
            many, the first error and the broker address. Rerunning the step resends them.
    """
    remaining = producer.flush(timeout_s)
    if not isinstance(producer, TrackedProducer):
        if remaining:
            raise DeliveryError(
                f"kafka delivery incomplete: {remaining} records still queued after "
                f"{timeout_s:g} s; check that the broker is reachable, then rerun the step"
            )
        return
    failed, delivered, first = producer.failed, producer.delivered, producer.first_error
    producer.reset_counts()
    if failed or remaining:
        total = failed + remaining + delivered
        raise DeliveryError(
            f"kafka delivery failed: {failed + remaining} of {total} records were not "
            f"acknowledged by {producer.bootstrap_servers} ({failed} failed, {remaining} still "
            f"queued after {timeout_s:g} s); first error: {first or 'timed out'}; check that "
            "the broker is up and the topic exists, then run the command (or step) again: it "
            "sends them again"
        )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _UnknownTopic(Exception):
    """The broker answers but does not know the topic (yet: it may be being created)."""


def _asked(config: Config, topic: str, ask: Callable[[], T], attempts: int, timeout_s: float
           ) -> T:
    """``ask()``, tried again with backoff (0.5 s, doubling, at most 5 s) while the broker
    cannot be reached or does not know the topic.

    Raises:
        BrokerUnavailableError: No answer after ``attempts`` tries.
        KafkaRefusedError: The broker refuses the client for good (authorization, TLS).
        ClickstreamError: The broker answers but does not know the topic.
    """
    last_error = "no answer"
    unknown_topic = False
    for attempt in range(1, attempts + 1):
        try:
            return ask()
        except _UnknownTopic as exc:
            unknown_topic, last_error = True, str(exc)
        except KafkaException as exc:
            unknown_topic = False
            cause = exc.args[0] if exc.args else None
            if isinstance(cause, KafkaError) and (
                    cause.fatal() or cause.code() in _PERMANENT_METADATA_ERRORS):
                raise KafkaRefusedError(  # no retry brings an answer; not "did not answer"
                    f"asking {config.kafka_bootstrap_servers} about topic {topic!r} failed: "
                    f"{cause.str()} ({cause.name()}); {_PERMANENT_FIX}") from exc
            last_error = cause.str() if isinstance(cause, KafkaError) else str(exc)
        if attempt < attempts:  # ~30 s in all: say what is being waited for meanwhile
            delay_s = retry_delay(attempt, 0.5, jitter=False)
            log.warning("kafka at %s, topic %r: %s (attempt %d of %d); asking again in %g s",
                        config.kafka_bootstrap_servers, topic, last_error, attempt, attempts,
                        delay_s)
            time.sleep(delay_s)
    if unknown_topic:
        names = {name: getattr(config, name)
                 for name in ("events_topic", "sessions_topic", "attributions_topic")}
        settings = [ENV_NAMES[name] for name, named in names.items() if named == topic]
        fix = (f"fix {' / '.join(settings)}" if settings else
               f"check its name (the product's topics: {', '.join(names.values())})")
        raise ClickstreamError(
            f"topic {topic!r} does not exist on {config.kafka_bootstrap_servers} "
            f"({last_error}); create it (the embedded broker creates events, sessions and "
            f"attributions at start) or {fix}"
        )
    raise BrokerUnavailableError(
        f"kafka at {config.kafka_bootstrap_servers} did not answer for topic {topic!r} after "
        f"{attempts} attempts ({timeout_s:g} s each): {last_error}; start the broker "
        f"(`clickstream broker`) or fix {ENV_NAMES['kafka_bootstrap_servers']} (or the "
        "command's --kafka-bootstrap-servers), then rerun"
    )


def topic_watermarks(config: Config, topic: str, *, attempts: int = 5, timeout_s: float = 5.0,
                     consumer: Consumer | None = None) -> dict[int, tuple[int, int]]:
    """Low and high watermark of every partition of ``topic``, asking the broker (not a cache).

    Retries with backoff when the broker cannot be reached or the topic is not yet known.

    Args:
        config: Run settings.
        topic: Topic name.
        attempts: Tries before giving up (backoff 0.5 s, doubling, at most 5 s).
        timeout_s: Per-request timeout.
        consumer: Reuse this consumer (saves a connection per call); default a temporary one.

    Returns:
        ``{partition: (low, high)}``: the log start offset and the next offset to be written.

    Raises:
        BrokerUnavailableError: No answer after ``attempts`` tries.
        KafkaRefusedError: The broker refuses the client for good (authorization, TLS).
        ClickstreamError: The broker answers but does not know the topic.
    """
    owned = consumer is None
    client = consumer if consumer is not None else make_consumer(config)

    def ask() -> dict[int, tuple[int, int]]:
        found = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is not None and found.error is not None and (
                found.error.code() in _PERMANENT_METADATA_ERRORS):
            raise KafkaException(found.error)  # not an unknown topic: an error of its own
        if found is None or found.error is not None or not found.partitions:
            raise _UnknownTopic(str(found.error) if found and found.error else "topic unknown")
        return {partition: client.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout_s, cached=False)
            for partition in sorted(found.partitions)}

    try:
        return _asked(config, topic, ask, attempts, timeout_s)
    finally:
        if owned:
            client.close()


def topic_id(config: Config, topic: str, *, attempts: int = 5, timeout_s: float = 5.0
             ) -> str | None:
    """The topic's id (KIP-516), which names one log: a topic created again gets a new one, and
    so does every topic of the embedded broker each time it starts (it keeps no data).

    Retries like :func:`topic_watermarks`.

    Returns:
        The id as text; None when the broker reports none (Kafka before 2.8).

    Raises:
        BrokerUnavailableError: No answer after ``attempts`` tries.
        KafkaRefusedError: The broker refuses the client for good (authorization, TLS).
        ClickstreamError: The broker answers but does not know the topic.
    """
    return topic_ids(config, [topic], attempts=attempts, timeout_s=timeout_s)[topic]


def topic_ids(config: Config, topics: Sequence[str], *, attempts: int = 5,
              timeout_s: float = 5.0) -> dict[str, str | None]:
    """:func:`topic_id` of each topic, asked through one client (a check of every changelog
    topic built a client per topic)."""
    admin = _created(AdminClient, _merge(config, {}, {}), config)
    return {topic: _asked(config, topic, functools.partial(_described_id, admin, topic,
                                                           timeout_s), attempts, timeout_s)
            for topic in topics}


def _described_id(admin: AdminClient, topic: str, timeout_s: float) -> str | None:
    try:
        described = admin.describe_topics(TopicCollection([topic]),
                                          request_timeout=timeout_s)[topic].result()
    except KafkaException as exc:
        cause = exc.args[0] if exc.args else None
        if isinstance(cause, KafkaError) and cause.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise _UnknownTopic(cause.str()) from exc
        raise
    found = described.topic_id
    if found is None or (found.get_most_significant_bits() == 0
                         and found.get_least_significant_bits() == 0):
        return None
    return str(found)


def check_same_log(topic: str, read_id: str | None, current_id: str | None) -> None:
    """Fail if offsets planned on the topic with id ``read_id`` are about to be used on another
    log (the broker restarted empty, or the topic was created again): they name other records,
    and reading on from them would skip every record of the new log below them, even once it
    has grown back past them. Either id None (unknown): nothing to compare.

    Raises:
        DataLossError: The ids differ.
    """
    if read_id is not None and current_id is not None and read_id != current_id:
        raise DataLossError(
            f"topic {topic} is not the log its stored offsets were read from (topic id "
            f"{read_id}, now {current_id}): the broker restarted empty (an embedded broker "
            "keeps data in memory only) or the topic was created again. Reading on from those "
            "offsets would skip the new log's records below them, and whatever the old log held "
            f"beyond them is gone; {ENV_NAMES['fail_on_data_loss']}=false does not apply (the "
            "offsets name records of another log). To read the new log from its start, delete "
            "the reader's checkpoint (the new log holds none of the records the old checkpoint "
            "read, unless producers sent them again; the sessions that were open in its state are "
            "rebuilt from the stored pageviews by `clickstream recompute --client C --full`); "
            "re-send the old log's unread records, if it had any, or load them with "
            "`clickstream backfill`"
        )


# Errors each reader handles itself: a partition's end, a fetch below the log start.
_READER_OWN_ERRORS = frozenset({KafkaError._PARTITION_EOF, KafkaError._AUTO_OFFSET_RESET})
# Out-of-range answers in a row at an offset the log holds before a read gives up (K11).
OUT_OF_RANGE_RETRIES = 5
# Fetch errors librdkafka does not get past by itself: the read stops at once with the cause.
# A batch it cannot decode (a failed CRC with check.crcs, a compression or message format it
# does not know) it skips after reporting it: read on, the gap looked like the offsets of
# transaction markers (the log start had not moved), and its records were lost unseen.
_PERMANENT_READ_ERRORS = frozenset({
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION, KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError._BAD_MSG, KafkaError._BAD_COMPRESSION, KafkaError._NOT_IMPLEMENTED,
})


# Metadata errors no retry gets past (an unknown topic may be being created: retried).
_PERMANENT_METADATA_ERRORS = _PERMANENT_READ_ERRORS - {KafkaError._UNKNOWN_TOPIC,
                                                       KafkaError._UNKNOWN_PARTITION}
_PERMANENT_FIX = (f"fix the cause (the topic, or the client's credentials and ACLs in "
                  f"{ENV_NAMES['kafka_options']}), then rerun")


class ReadErrors:
    """What a reader does with an error ``consume()`` hands it, other than the end of a
    partition and a fetch below the log start (each reader's own business).

    librdkafka reports fetch errors it goes on from, a broker's request timeout among them, as
    error messages (again at every fetch while they last), and marks none of them retriable: a
    fetch timeout of a real broker used to fail the sessionizer's micro-batch. Such errors are
    logged, once per partition and code, and the read goes on; the reader's own time limit,
    which they do not reset, bounds the wait and names the last one. A truncated log (an
    unclean leader election, KIP-320), an authorization or authentication error, an unknown
    topic or partition, an oversized record and a fatal error stop the read with the
    cause.
    """

    def __init__(self, config: Config, topic: str) -> None:
        self._config = config
        self._topic = topic
        self._logged: set[tuple[int | None, int]] = set()
        self._refusals: dict[int, int] = {}  # (K11) out-of-range answers in a row
        self.last: str | None = None

    def handle(self, error: KafkaError, partition: int | None, offset: int | None) -> None:
        """Raise for an error that ends the read; note and log any other.

        Raises:
            DataLossError: The broker truncated the log under the reader.
            KafkaRefusedError: A permanent or fatal error.
        """
        where = (f"topic {self._topic} partition {partition}" if partition is not None
                 and partition >= 0 else f"topic {self._topic}")
        at = f" at offset {offset}" if offset is not None and offset >= 0 else ""
        if error.code() == KafkaError._LOG_TRUNCATION:
            raise DataLossError(
                f"{where}: the broker truncated its log under the reader{at} (an unclean "
                f"leader election: records after that point were replaced or lost); "
                f"{_OTHER_LOG_ADVICE}"
            )
        if error.fatal() or error.code() in _PERMANENT_READ_ERRORS:
            raise KafkaRefusedError(
                f"reading {where}{at} from {self._config.kafka_bootstrap_servers} failed: "
                f"{error.str()} ({error.name()}); {_PERMANENT_FIX}: the read starts again "
                "from the same offsets"
            )
        self.last = f"{where}{at}: {error.str()}"
        if (partition, error.code()) not in self._logged:
            self._logged.add((partition, error.code()))
            log.warning("reading %s%s: %s; librdkafka retries it (shown once per partition "
                        "and error)", where, at, error.str())

    def read_again(self, error: KafkaError, partition: int, offset: int) -> None:
        """An out-of-range answer at an offset the log still holds (K11): transient (a leader
        moving), and librdkafka stops fetching the partition, so the reader fetches it again.
        Answers count until the partition's next record (``record_arrived``).

        Raises:
            BrokerUnavailableError: The broker answered so ``OUT_OF_RANGE_RETRIES`` times in a
                row without a record in between.
        """
        times = self._refusals[partition] = self._refusals.get(partition, 0) + 1
        where = f"topic {self._topic} partition {partition} at offset {offset}"
        if times > OUT_OF_RANGE_RETRIES:
            raise BrokerUnavailableError(
                f"reading {where} from {self._config.kafka_bootstrap_servers}: the broker "
                f"answered 'offset out of range' {times} times in a row although its log "
                f"holds that offset ({error.str()}); check the broker's health (a leader "
                "election that does not settle), then rerun: the read starts again from the "
                "same offsets"
            )
        self.last = f"{where}: {error.str()}, although the log holds it"
        log.warning("reading %s: the broker answered 'offset out of range' although its log "
                    "holds that offset (%s); fetching it again (%d of %d)", where, error.str(),
                    times, OUT_OF_RANGE_RETRIES)

    def record_arrived(self, partition: int) -> None:
        """A record came from the partition: its out-of-range answers are no longer in a row."""
        self._refusals.pop(partition, None)

    def since(self) -> str:
        """`` (last error: ...)`` for a time-limit message, or nothing."""
        return f" (last error: {self.last})" if self.last else ""


def _fetch_again(consumer: Consumer, topic: str, partition: int, offset: int) -> None:
    """Fetch the partition again from ``offset``: after an out-of-range answer librdkafka
    fetches it no more, and refuses a seek."""
    consumer.incremental_unassign([TopicPartition(topic, partition)])
    consumer.incremental_assign([TopicPartition(topic, partition, offset)])


def check_no_data_loss(topic: str, partition: int, wanted_offset: int, low_watermark: int,
                       high_watermark: int | None = None, *, fail_on_data_loss: bool = True,
                       advice: str = _LOSS_ADVICE) -> None:
    """Fail if records a reader still needs are gone (Spark's ``failOnDataLoss``).

    Args:
        topic: Topic name (for the message).
        partition: Partition number.
        wanted_offset: Next offset the reader must read (0 to read from the start).
        low_watermark: The partition's log start offset now.
        high_watermark: The partition's end offset now, if known: an offset beyond it means
            the broker lost acknowledged records (e.g. the in-memory broker restarted).
        fail_on_data_loss: False: records dropped below the log start are accepted (the
            caller records them as lost); an offset beyond the log end still fails, since it
            names records of another log.
        advice: What the message says to do about dropped records (the reader's).

    Raises:
        DataLossError: ``wanted_offset`` is below the log start (unless accepted) or beyond
            the log end.
    """
    if wanted_offset < 0:
        raise ValueError(f"wanted_offset must be an absolute offset >= 0, got {wanted_offset}")
    if wanted_offset < low_watermark and fail_on_data_loss:
        raise DataLossError(
            f"topic {topic} partition {partition}: records {wanted_offset}..{low_watermark - 1} "
            f"were dropped by the broker before they were consumed (log start offset is now "
            f"{low_watermark}); {advice}"
        )
    if high_watermark is not None and wanted_offset > high_watermark:
        raise DataLossError(
            f"topic {topic} partition {partition}: the reader is at offset {wanted_offset} but "
            f"the log ends at {high_watermark}, so acknowledged records are gone (an embedded "
            f"broker keeps data in memory only and was probably restarted); {_OTHER_LOG_ADVICE}"
        )


TOMBSTONE = object()  # read_compacted's value of a tombstoned key, with keep_tombstones


def read_compacted(config: Config, topic: str, *,
                   value_decoder: Callable[[bytes], Any] = json.loads,
                   timeout_s: float = 60.0, keep_tombstones: bool = False) -> dict[str, Any]:
    """Read a changelog topic as Kafka compaction would keep it: last value per key.

    Reads every partition from offset 0 to the high watermarks seen at the start (records
    written meanwhile are ignored), applies records in offset order, and drops keys whose last
    record is a tombstone. Keys are decoded as UTF-8 (bytes that are not, as ``\\x`` escapes:
    the events topic holds what clients sent); records without a key are skipped (Kafka
    rejects them on compacted topics). A key is assumed to live in one partition.

    Delivery guarantee: a complete snapshot or an exception, never a partial view.

    Args:
        config: Run settings.
        topic: Topic to read, e.g. ``config.sessions_topic``.
        value_decoder: Turns a value's bytes into the returned value (default JSON).
        timeout_s: Give up if the snapshot is not complete within this time, plus a second
            per 5,000 records the snapshot holds (a fixed limit ended a large read as a
            broker that does not answer).
        keep_tombstones: Keep a key whose last record is a tombstone, with the value
            ``TOMBSTONE`` (a JSON ``null`` value decodes to None).

    Returns:
        ``{key: decoded value}`` for every live key (and ``{key: TOMBSTONE}`` for each
        tombstoned one, with ``keep_tombstones``).

    Raises:
        DataLossError: Some partition no longer starts at offset 0, so the view would miss keys.
        BrokerUnavailableError: Kafka unreachable, or the read did not finish in time.
    """
    watermarks = topic_watermarks(config, topic)
    for partition, (low, high) in watermarks.items():
        check_no_data_loss(topic, partition, 0, low, high, advice=_CHANGELOG_LOSS_ADVICE)
    ends = {p: high for p, (_low, high) in watermarks.items() if high > 0}
    result: dict[str, Any] = {}
    if not ends:
        return result
    timeout_s += sum(ends.values()) / 5_000
    consumer = make_consumer(config, **{
        "auto.offset.reset": "error",  # a fetch below the log start must fail, not skip
        "enable.partition.eof": True,
    })
    errors = ReadErrors(config, topic)
    positions: dict[int, int] = {}  # the next offset of each partition, once a record came
    finished: set[int] = set()

    def done(partition: int) -> None:
        """Read up to the snapshot's end: fetched no more (a finished partition's later
        answers, such as a log start that moved on since, said nothing about the view)."""
        del ends[partition]
        finished.add(partition)
        consumer.pause([TopicPartition(topic, partition)])

    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                missing = ", ".join(f"{p}" for p in sorted(ends))
                raise BrokerUnavailableError(
                    f"reading topic {topic!r} from {config.kafka_bootstrap_servers} did not "
                    f"reach the high watermarks of partitions {missing} within {timeout_s:g} s"
                    f"{errors.since()}; check that the broker is up, then rerun"
                )
            for msg in consumer.consume(num_messages=10_000, timeout=0.5):
                partition, offset, err = msg.partition(), msg.offset(), msg.error()
                end = ends.get(partition)
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if end is not None and offset >= end:
                            done(partition)
                        continue
                    if partition in finished:  # (not a client-wide error: partition -1)
                        continue
                    if err.code() in (KafkaError._AUTO_OFFSET_RESET,
                                      KafkaError.OFFSET_OUT_OF_RANGE):
                        # Records dropped between the start check and the fetch fail here;
                        # else the log still holds them (K11): fetched again.
                        low, high = topic_watermarks(config, topic).get(partition, (0, 0))
                        at = positions.get(partition, 0)
                        for wanted in (0, at):
                            check_no_data_loss(topic, partition, wanted, low, high,
                                               advice=_CHANGELOG_LOSS_ADVICE)
                        errors.read_again(err, partition, at)
                        _fetch_again(consumer, topic, partition, at)
                        continue
                    errors.handle(err, partition, offset)
                    continue
                if end is None:
                    continue  # the partition was read to its end
                if offset >= end:  # written after the snapshot started: the snapshot's last
                    done(partition)  # offsets held control records (a commit marker), and
                    continue  # an end-of-partition could wait behind a writer going on
                positions[partition] = offset + 1
                errors.record_arrived(partition)
                raw_key = msg.key()
                if raw_key is not None:
                    key = (raw_key.decode("utf-8", "backslashreplace")
                           if isinstance(raw_key, bytes) else str(raw_key))
                    value = msg.value()
                    if value is None and keep_tombstones:
                        result[key] = TOMBSTONE
                    elif value is None:
                        result.pop(key, None)
                    else:
                        result[key] = value_decoder(value)
                if offset >= end - 1:
                    done(partition)
    finally:
        consumer.close()
    return result


def read_offset_range(
    config: Config, topic: str, partition: int, start: int, end: int, *,
    fail_on_data_loss: bool = True, idle_timeout_s: float = 60.0, batch_size: int = 20_000,
) -> Iterator[list[Message]]:
    """Yield the records of offsets ``[start, end)`` of one partition, in batches.

    Delivery guarantee: every record in the range exactly once, in order, or an exception:
    records dropped by the broker before they were read (the range starts below the log
    start, or the log start passes the read's position while it reads: the broker answers
    the next fetch with OFFSET_OUT_OF_RANGE) raise :class:`~clickstream.errors.DataLossError`.
    Offsets a fetch passes without a record are not a loss: a transaction's commit or abort
    marker (a control record, which no consumer sees) or a record compaction removed; the
    range may end with them. With ``fail_on_data_loss=False`` each run of dropped
    offsets comes out as one :func:`lost_offsets_marker` in its place, in offset order, and
    the read goes on (a range beyond the log end still fails: it names another log).

    Raises:
        DataLossError: Records of the range are gone (and not accepted).
        BrokerUnavailableError: No record arrived for ``idle_timeout_s``.
    """
    yield from read_offset_ranges(config, topic, {partition: (start, end)},
                                  fail_on_data_loss=fail_on_data_loss,
                                  idle_timeout_s=idle_timeout_s, batch_size=batch_size)


def lost_offsets_marker(topic: str, partition: int, first: int, last: int) -> Message:
    """The record a reader that accepts data loss puts in place of offsets ``first..last``,
    which the broker dropped before they were read: no key, no value, offset ``first``, and a
    :data:`~clickstream.events.contract.LOST_OFFSETS_HEADER` header ``b"<first>-<last>"``. Its
    timestamp is when the reader found the loss (CreateTime: the reader created it); the
    parser quarantines it (``events.parse.lost_offsets_error``), so the loss is recorded with
    the micro-batch that held those offsets, once. Logs a WARNING naming the run."""
    log.warning("topic %s partition %d: records %d..%d were dropped by the broker before they "
                "were read; going on without them (%s=false), recorded in quarantine",
                topic, partition, first, last, ENV_NAMES["fail_on_data_loss"])
    return Message(topic=topic, partition=partition, offset=first, key=None, value=None,
                   headers=[(LOST_OFFSETS_HEADER, f"{first}-{last}".encode())],
                   timestamp=(TIMESTAMP_CREATE_TIME, int(time.time() * 1000)))


def read_offset_ranges(
    config: Config, topic: str, ranges: Mapping[int, tuple[int, int]], *,
    fail_on_data_loss: bool = True, idle_timeout_s: float = 60.0,
    batch_size: int = 20_000, advice: str = _LOSS_ADVICE, start_may_move: bool = False,
) -> Iterator[list[Message]]:
    """:func:`read_offset_range` for several partitions of a topic with one consumer (a
    consumer per partition costs a connection and a metadata round trip each, which dominates
    reading back a topic of hundreds of partitions). Batches may mix partitions; each
    partition's records come in offset order.

    Args:
        ranges: partition -> ``(start, end)``; empty ranges are skipped.
        advice: What a data-loss error says to do (:func:`check_no_data_loss`).
        start_may_move: the starts are a log's start as a new reader found it: records the
            broker dropped below them since, before this read reached them, were never read
            and are skipped with a warning (``kafka_source`` K10).
    """
    expected = {p: start for p, (start, end) in ranges.items() if end > start}
    unread = dict(expected) if start_may_move else {}  # (K10) until a record is read
    ends = {p: ranges[p][1] for p in expected}
    if not expected:
        return
    consumer = make_consumer(config, **{"auto.offset.reset": "error",
                                        # the end of a range whose last offsets are control
                                        # records (no record after them to jump to)
                                        "enable.partition.eof": True,
                                        "fetch.max.bytes": 52_428_800,
                                        "max.partition.fetch.bytes": 10_485_760})

    def dropped_before_read(partition: int, upto: int) -> None:
        """(K10) Offsets ``expected..upto - 1``, never read, dropped since they were planned."""
        log.warning("topic %s partition %d: the broker dropped records %d..%d after the first "
                    "micro-batch of a new checkpoint was planned from the log's start, before "
                    "anyone read them; it reads on from offset %d", topic, partition,
                    expected[partition], upto - 1, upto)

    def watermarks(partition: int) -> tuple[int, int]:
        """The partition's log start and end, asked again while the broker cannot answer (a
        leader moving): a transaction's commit marker ends almost every range, and one
        failed lookup failed the micro-batch."""
        return _asked(config, topic, lambda: consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=10, cached=False), attempts=5,
            timeout_s=10)

    def done(partition: int) -> None:
        del expected[partition]
        consumer.pause([TopicPartition(topic, partition)])  # fetch no more

    def short_of_the_range(partition: int) -> None:
        """The log ended before the range: waiting for records (a transaction still open,
        a read behind the log's end) unless the log now ends below the range's end, which
        no wait brings back (a log truncated, another log under the same name)."""
        _low, high = watermarks(partition)
        if high < ends[partition]:
            raise DataLossError(
                f"topic {topic} partition {partition}: offsets {high}..{ends[partition] - 1} "
                f"were to be read, but the log now ends at {high}, so records it held are gone; "
                f"{_OTHER_LOG_ADVICE}")

    errors = ReadErrors(config, topic)
    try:
        consumer.assign([TopicPartition(topic, p, start) for p, start in expected.items()])
        # The last time a record, or a partition's end, arrived: an error librdkafka reports
        # again at every fetch (a broker timing out each one) is no progress, so it cannot
        # keep the read waiting past the time limit.
        heard_at = time.monotonic()
        while expected:
            if time.monotonic() - heard_at >= idle_timeout_s:
                waiting = ", ".join(f"{p} at {e}" for p, e in sorted(expected.items())[:5])
                raise BrokerUnavailableError(
                    f"no records from topic {topic} (partitions {waiting}) for "
                    f"{idle_timeout_s:g} s{errors.since()}; is Kafka reachable at "
                    f"{config.kafka_bootstrap_servers}? Rerunning retries the same offsets"
                )
            wanted = sum(ends[p] - e for p, e in expected.items())
            messages = consumer.consume(num_messages=min(batch_size, wanted), timeout=1.0)
            if any(m.error() is None or m.error().code() in _READER_OWN_ERRORS
                   for m in messages):
                heard_at = time.monotonic()
            if not messages:
                continue
            batch: list[Message] = []
            for message in messages:
                error = message.error()
                partition = message.partition()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        eof = message.offset()  # the log's end: nothing more to jump to
                        if partition in expected and eof >= ends[partition]:
                            done(partition)  # the range ends with offsets holding no records
                        elif partition in expected:
                            short_of_the_range(partition)
                        continue
                    if error.code() == KafkaError._AUTO_OFFSET_RESET:
                        low, high = watermarks(partition)
                        at = expected.get(partition, low)
                        moved = unread.get(partition) == at and at < low  # (K10)
                        if moved:
                            dropped_before_read(partition, min(low, ends[partition]))
                        else:
                            check_no_data_loss(topic, partition, at, low, high,
                                               fail_on_data_loss=fail_on_data_loss,
                                               advice=advice)
                        if at < low:  # accepted: record the loss, go on from the log start
                            if not moved:
                                batch.append(lost_offsets_marker(
                                    topic, partition, at, min(low, ends[partition]) - 1))
                            if low >= ends[partition]:
                                done(partition)
                            else:
                                expected[partition] = low
                                if moved:
                                    unread[partition] = low
                                _fetch_again(consumer, topic, partition, low)
                            continue
                        if partition in expected:  # (K11) the log holds ``at``
                            errors.read_again(error, partition, at)
                            _fetch_again(consumer, topic, partition, at)
                        continue
                    errors.handle(error, partition, message.offset())
                    continue
                if partition not in expected:
                    continue
                offset = message.offset()
                if offset < expected[partition]:
                    continue
                # A jump (also past the range's end) is never a loss: a fetch below the log's
                # start fails (OFFSET_OUT_OF_RANGE, above), so the offsets it passed held control
                # records or records compaction removed. Asked the log's start instead, a start
                # that moved past a commit marker since the fetch read as the marker lost.
                if offset >= ends[partition]:  # the range's last offsets hold no records
                    done(partition)
                    continue
                batch.append(message)
                unread.pop(partition, None)
                errors.record_arrived(partition)
                expected[partition] = offset + 1
                if expected[partition] >= ends[partition]:
                    done(partition)
            if batch:
                yield batch
    finally:
        consumer.close()
