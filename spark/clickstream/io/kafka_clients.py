"""The confluent-kafka clients every other Kafka module builds on: their settings, their
construction, their log and the errors no retry gets past.

Only the ``io/kafka_*`` modules import confluent-kafka. Client settings are built here from
:class:`~clickstream.config.Config` so the embedded broker and a real Kafka cluster get the
same code path: ``Config.kafka_bootstrap_servers`` picks the cluster and
``Config.kafka_options`` (``CLICKSTREAM_KAFKA_OPTIONS="k=v,..."``) passes any librdkafka
setting through (SASL/TLS for real clusters, tuning). What the clients do lives beside it:
writing in :mod:`clickstream.io.kafka_produce`, topic metadata in
:mod:`clickstream.io.kafka_topics`, reading in :mod:`clickstream.io.kafka_read`.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from clickstream.config import ENV_NAMES, Config, option_place
from clickstream.errors import ConfigError, DeliveryError

KafkaConfig = dict[str, Any]
ClientT = TypeVar("ClientT")


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
# Clients
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
    """A ``confluent_kafka.Producer`` that counts delivery reports for
    :func:`~clickstream.io.kafka_produce.flush_or_raise`.

    Counts cover records produced without a per-record ``on_delivery`` callback (a per-record
    callback replaces the tracking one). Counters reset after each ``flush_or_raise``.
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


def option_spellings(alias: str) -> tuple[str, str]:
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

    Delivery guarantee: at-least-once, once
    :func:`~clickstream.io.kafka_produce.flush_or_raise` returned without error.

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


def make_admin(config: Config) -> AdminClient:
    """Create an admin client (the address and ``kafka_options``, none of the producers' or
    consumers' defaults).

    Raises:
        ConfigError: librdkafka refused a setting of ``CLICKSTREAM_KAFKA_OPTIONS``.
    """
    return _created(AdminClient, _merge(config, {}, {}), config)


# --------------------------------------------------------------------------------------------
# Errors no retry gets past
# --------------------------------------------------------------------------------------------


# Fetch errors librdkafka does not get past by itself: the read stops at once with the cause.
# A batch it cannot decode (a failed CRC with check.crcs, a compression or message format it
# does not know) it skips after reporting it: read on, the gap looked like the offsets of
# transaction markers (the log start had not moved), and its records were lost unseen.
PERMANENT_READ_ERRORS = frozenset({
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION, KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError._BAD_MSG, KafkaError._BAD_COMPRESSION, KafkaError._NOT_IMPLEMENTED,
})


# Metadata errors no retry gets past (an unknown topic may be being created: retried).
PERMANENT_METADATA_ERRORS = PERMANENT_READ_ERRORS - {KafkaError._UNKNOWN_TOPIC,
                                                     KafkaError._UNKNOWN_PARTITION}
PERMANENT_FIX = (f"fix the cause (the topic, or the client's credentials and ACLs in "
                  f"{ENV_NAMES['kafka_options']}), then rerun")

