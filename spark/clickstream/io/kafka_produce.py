"""WHERE KAFKA IS WRITTEN: records sent by the product's producer, in a transaction or not.

Delivery guarantee: at-least-once. The idempotent producer (acks=all) never duplicates or
reorders records because of its own retries, and :func:`flush_or_raise` fails loudly if any
record was not acknowledged. A step rerun after a failure may send some records again;
consumers stay correct because records are keyed (event_id / session_id with a revision) and
applied idempotently.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from clickstream.config import ENV_NAMES, Config
from clickstream.errors import ConfigError, DeliveryError, KafkaRefusedError
from clickstream.io.kafka_clients import (
    KafkaConfig,
    TrackedProducer,
    gc_paused,
    make_producer,
    option_spellings,
)

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
    if set(option_spellings("linger.ms")) & set(config.kafka_options):
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
    for name in option_spellings("delivery.timeout.ms"):
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

