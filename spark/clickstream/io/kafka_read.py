"""Reading a topic by offsets: ranges of its partitions (the stream's Kafka source,
:mod:`clickstream.io.kafka_source`, reads its micro-batches through them, the publish gate
reads back what it sent) and its compacted view (the changelogs as a reader keeps them).

Delivery guarantee: read-only, no offsets committed. :func:`read_compacted` is a snapshot up
to the high watermarks seen at its start; the range readers give every record of their ranges
once, in offset order per partition. A read never skips records silently: records dropped by
the broker raise :class:`~clickstream.errors.DataLossError` (Spark's ``failOnDataLoss``), or,
for a reader told to go on (:func:`read_offset_ranges` with ``fail_on_data_loss=False``), come
out as one marker record per lost run of offsets (:func:`lost_offsets_marker`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    Consumer,
    KafkaError,
    Message,
    TopicPartition,
)

from clickstream.config import ENV_NAMES, Config
from clickstream.errors import BrokerUnavailableError, DataLossError, KafkaRefusedError
from clickstream.events.contract import LOST_OFFSETS_HEADER
from clickstream.io.kafka_clients import (
    PERMANENT_FIX,
    PERMANENT_READ_ERRORS,
    make_consumer,
)
from clickstream.io.kafka_topics import ask_broker, topic_watermarks

log = logging.getLogger(__name__)


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


# Errors each reader handles itself: a partition's end, a fetch below the log start.
_READER_OWN_ERRORS = frozenset({KafkaError._PARTITION_EOF, KafkaError._AUTO_OFFSET_RESET})
# Out-of-range answers in a row at an offset the log holds before a read gives up (K11).
OUT_OF_RANGE_RETRIES = 5


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
        if error.fatal() or error.code() in PERMANENT_READ_ERRORS:
            raise KafkaRefusedError(
                f"reading {where}{at} from {self._config.kafka_bootstrap_servers} failed: "
                f"{error.str()} ({error.name()}); {PERMANENT_FIX}: the read starts again "
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
        return ask_broker(config, topic, lambda: consumer.get_watermark_offsets(
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
