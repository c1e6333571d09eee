"""What the broker says of a topic: its partitions' offsets and its id (the log it names),
asked again with backoff while the broker cannot be reached.

Read-only: nothing here commits offsets or changes a topic.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient

from clickstream.config import ENV_NAMES, Config
from clickstream.errors import (
    BrokerUnavailableError,
    ClickstreamError,
    DataLossError,
    KafkaRefusedError,
)
from clickstream.io.kafka_clients import (
    PERMANENT_FIX,
    PERMANENT_METADATA_ERRORS,
    make_admin,
    make_consumer,
)
from clickstream.retry import retry_delay

T = TypeVar("T")

log = logging.getLogger(__name__)


class _UnknownTopic(Exception):
    """The broker answers but does not know the topic (yet: it may be being created)."""


def ask_broker(config: Config, topic: str, ask: Callable[[], T], attempts: int,
               timeout_s: float) -> T:
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
                    cause.fatal() or cause.code() in PERMANENT_METADATA_ERRORS):
                raise KafkaRefusedError(  # no retry brings an answer; not "did not answer"
                    f"asking {config.kafka_bootstrap_servers} about topic {topic!r} failed: "
                    f"{cause.str()} ({cause.name()}); {PERMANENT_FIX}") from exc
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
                found.error.code() in PERMANENT_METADATA_ERRORS):
            raise KafkaException(found.error)  # not an unknown topic: an error of its own
        if found is None or found.error is not None or not found.partitions:
            raise _UnknownTopic(str(found.error) if found and found.error else "topic unknown")
        return {partition: client.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout_s, cached=False)
            for partition in sorted(found.partitions)}

    try:
        return ask_broker(config, topic, ask, attempts, timeout_s)
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
    admin = make_admin(config)
    return {topic: ask_broker(config, topic, functools.partial(_described_id, admin, topic,
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

