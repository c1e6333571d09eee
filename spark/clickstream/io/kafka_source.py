"""Spark Structured Streaming source for Kafka built on confluent-kafka (Python Data Source API).

Produces Spark's Kafka column layout (key, value, topic, partition, offset, timestamp,
timestampType, headers), so downstream code is the same as with Spark's native ``kafka``
source, which ``read_kafka_stream`` selects instead when ``CLICKSTREAM_KAFKA_SOURCE=native``.

Delivery guarantee: exactly once into Spark. Offsets are per topic-partition, kept in Spark's
checkpoint (the offsets log is written before a batch runs), so a restarted query re-reads
exactly the ranges of unfinished batches; the consumer never commits to a consumer group.

Known edge cases, cited inline as (K1)..(K11):
  K1. The broker dropped records we have not read (retention, or the embedded broker's
      per-partition cap): the start offset is below the log start. Or it lost records we did
      read (the embedded broker restarted empty, the topic was recreated): the log now ends
      below the checkpoint's offset, and reading on from that offset once the log grows back
      would skip every new record below it. Both stop with DataLossError, like Spark's
      ``failOnDataLoss=true``, instead of skipping silently. A log that grew back past the
      checkpoint's offset while no query ran cannot be told from offsets alone (K7).
      With ``failOnDataLoss=false`` (CLICKSTREAM_FAIL_ON_DATA_LOSS) records dropped before we
      read them are accepted (also for K3): planning still starts the range at the old
      offset, and the read puts one marker record in place of each lost run of offsets
      (``kafka_read.lost_offsets_marker``: no key or value, offset = the first lost one, a
      ``clickstream-lost-offsets`` header ``<first>-<last>``), logs a warning and reads on
      from the log start. The parser quarantines the marker, so the loss reaches the
      quarantine table with the micro-batch that planned those offsets, and a replayed
      micro-batch does not record it again (the sink appends once per batch). Lost offsets do
      not count against ``ReadMaxRows`` (K4): the micro-batch planned from below the log start
      takes the whole lost run, one marker. A log that ends below the checkpoint's offset,
      and K7, still stop: those offsets name records of another log. Spark's native source,
      given ``failOnDataLoss=false``, skips the lost offsets with a log line, no marker.
  K2. Records the broker drops while a range is read (its log start passes the read's
      position) are found by the next fetch, which the broker refuses (OFFSET_OUT_OF_RANGE):
      DataLossError, or with ``failOnDataLoss=false`` a marker for them (K1). A gap a fetch
      passes (offsets jump, also past the range's end: its last offsets hold no records) is
      no loss: those offsets hold control records (the commit or abort markers of
      transactional producers, one per transaction and partition) or records compaction
      removed; no error, no marker. A range ending in control records ends at the
      partition's end of log, not at a record after it. (Gaps were checked against the log's
      start, asked after the jump: a start that moved past a commit marker since the fetch
      read as that marker lost, a false DataLossError or quarantine row.)
  K3. Partitions added to a topic while the query runs are read from offset 0, like Spark's
      own source: one whose log no longer starts at 0 when first seen lost records before
      anyone read them, and stops with DataLossError (K1) instead of starting at its log start
      (with ``failOnDataLoss=false``: a marker for offsets 0..log start - 1, K1). A
      partition one metadata answer leaves out (a broker's stale metadata) keeps its offset:
      dropped from the planned offsets, it was read again from offset 0 once it was back.
  K4. ``ReadMaxRows`` (rate limit per trigger) is split across partitions in proportion to
      their backlog, and every partition with a backlog gets at least one record, so no
      partition starves.
  K5. A micro-batch reads its partitions in at most ``readTasks`` Spark tasks (the session's
      default parallelism), each with one consumer for several partitions, balanced by rows.
      A task per partition cost every micro-batch a consumer start per partition, twice (the
      sessionizer's two branches each scan the source): a ~15k-record micro-batch took ~5.6 s
      with 16 tasks and ~3.5 s with 2 (BENCHMARKS.md).
  K6. A query that scans the source twice per micro-batch (the sessionizer's two branches)
      sets ``shareReads`` to a token of its own run: the first read of a task's offset ranges
      keeps its Arrow batches in a local file, and the second read of the same ranges takes
      them from there (and deletes the file) instead of fetching them again. Records at given
      offsets never change, and the token is new for every query run, so a file can only serve
      the ranges it was read for. When the second read runs on another host, or a file is
      missing, it reads Kafka as usual; files nobody took (a failed task) are deleted once
      older than ``SHARED_READ_MAX_AGE_S``. The files sit in a folder of the user's own
      (``$TMPDIR/clickstream-kafka-reads-<uid>``, mode 0700): in a shared folder another
      local user could read the events, or plant a file the second read would take. Where
      that folder is not the user's alone (made by someone else, a link, open to others),
      nothing is shared: both reads fetch from Kafka.
  K7. Offsets alone cannot tell a log that was replaced and grew back past the checkpoint's
      offsets while no query ran (K1): every offset the source plans carries the topic's id
      (KIP-516; new when a topic is created again, and at every start of the embedded
      broker), and every planning of a micro-batch (``latestOffset``, and ``partitions``,
      which a restart calls first to replay its last batch) checks the offsets it is given
      against the topic's id now (one metadata request, ~3 ms): a different id is
      DataLossError. Offsets without an id (older checkpoints, brokers before Kafka 2.8) are
      not checked. A checkpoint written with ids cannot be resumed by code before K7.
  K8. A new checkpoint starts each partition at its log's start, as Spark's own source does
      with ``earliest``: records a broker deleted before the query's first start (a real
      topic's retention, the embedded broker's cap while nothing read) were never this
      query's, and stopping on them would keep a new checkpoint from starting on any topic
      with retention. A warning names each such partition's first offset, once per query
      run (Spark asks for the initial offsets at every trigger until it plans a batch).
  K9. The first micro-batch's end offsets carry where it starts (``PLANNED_FROM``): Spark's
      offsets log holds only end offsets, so a restart before that batch committed took its
      start from ``initialOffset()`` again, the log's start as it then was. Records the
      broker dropped meanwhile (the cap, while the sessionizer was down) were skipped
      without an error or a quarantine row, and the first run's outputs already committed
      covered records the replay no longer read. The replay now reads the planned range,
      and a loss in it stops the query or is marked (K1). (Spark's own source writes its
      initial offsets to the checkpoint for the same reason.) When nothing new arrived,
      ``latestOffset`` returns its start as it is, so the batch after the first is planned
      only for new records.
  K10. Between ``initialOffset()`` and the first micro-batch's planning, and between that
      and its tasks' reads (seconds: Spark starts the tasks' Python workers), a broker may
      drop more of a log's oldest records: the embedded broker's cap drops a full
      partition's oldest batch at every write. Records below the log's start then were
      never read by anyone, as K8's were not: the planning starts the batch at the log's
      start (and records that start, K9), and a read of that first planning starts at the
      log's start when it begins, each with a warning, no error and no marker. Stopping on
      them stopped a new checkpoint on a full topic being written to, and every restart too
      (its replay reads the range it planned, K9). Only the read of the micro-batch the run
      itself planned does so, and only before it read a record of the partition: a replay
      of the first micro-batch after a crash (its first attempt may have stored what it
      read) and records dropped during a read still stop (K1, K2).
      The sessionizer's second scan of that micro-batch takes the first scan's records (K6);
      one that reads Kafka itself (on another host) could start later than the first if the
      broker dropped more between the two reads.
  K11. A broker may answer 'offset out of range' at an offset its log still holds (around a
      leader change); librdkafka then fetches that partition no more (``auto.offset.reset``
      is ``error``). When the log's start and end show the offset is held, the readers
      (``kafka_read.read_offset_ranges``, ``read_compacted``) fetch the partition again
      from it, up to ``OUT_OF_RANGE_RETRIES`` answers in a row. Taken for any other error,
      the range read waited out its time limit and said Kafka was unreachable, and the
      changelog read (``clickstream inspect``) reported data loss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa
from confluent_kafka import Message
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import (
    CaseInsensitiveDict,
    DataSource,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from clickstream.config import Config
from clickstream.events.contract import CLOCK_PARTITION
from clickstream.io.kafka_read import check_no_data_loss, read_offset_ranges
from clickstream.io.kafka_topics import check_same_log, topic_id, topic_watermarks
from clickstream.io.stream_clock import CLOCK_OFFSET, IdleClock, QuietTimer
from clickstream.tables import KAFKA_SCHEMA

log = logging.getLogger(__name__)

SOURCE_NAME = "clickstream_kafka"
SHARED_READ_MAX_AGE_S = 3600  # (K6) a kept read nobody took is deleted after this long
TOPIC_ID = "topicId"  # (K7) in every offset: the id of the topic the offsets were planned on
PLANNED_FROM = "from"  # (K9) in the first micro-batch's end offsets: its start offsets

_ARROW_SCHEMA = pa.schema([
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("timestampType", pa.int32(), nullable=False),
    pa.field("headers", pa.list_(pa.struct([pa.field("key", pa.string()),
                                            pa.field("value", pa.binary())]))),
])


class KafkaRange(InputPartition):
    """Offsets ``[start, end)`` of some topic-partitions, read with one consumer: one Spark task.
    ``from_log_start``: the starts are the log's as a new checkpoint found it, read for the
    first time (K10)."""

    def __init__(self, topic: str, ranges: Mapping[int, tuple[int, int]],
                 from_log_start: bool = False) -> None:
        super().__init__((topic, tuple(sorted(ranges.items())), from_log_start))
        self.topic = topic
        self.ranges = dict(ranges)
        self.from_log_start = from_log_start

    @property
    def rows(self) -> int:
        return sum(end - start for start, end in self.ranges.values())


class ClockTick(InputPartition):
    """A quiet stream's clock tick (``io.stream_clock``): one row, no key or value, in a
    partition no record has, timed at the event time the stream's clock moves on to."""

    def __init__(self, topic: str, event_time_ms: int) -> None:
        super().__init__((topic, CLOCK_OFFSET, event_time_ms))
        self.topic = topic
        self.event_time_ms = event_time_ms

    def record_batch(self) -> pa.RecordBatch:
        return pa.RecordBatch.from_pylist([{
            "key": None, "value": None, "topic": self.topic, "partition": CLOCK_PARTITION,
            "offset": 0, "timestamp": self.event_time_ms * 1000, "timestampType": 0,
            "headers": None}], schema=_ARROW_SCHEMA)


def group_ranges(topic: str, ranges: Mapping[int, tuple[int, int]], tasks: int,
                 from_log_start: bool = False) -> list[KafkaRange]:
    """At most ``tasks`` read tasks of about equal rows (largest range first, onto the task with
    the fewest rows) (K5)."""
    groups: list[dict[int, tuple[int, int]]] = [{} for _ in range(max(1, tasks))]
    load = [0] * len(groups)
    largest_first = sorted(ranges.items(), key=lambda item: (item[1][0] - item[1][1], item[0]))
    for partition, (start, end) in largest_first:
        target = load.index(min(load))
        groups[target][partition] = (start, end)
        load[target] += end - start
    return [KafkaRange(topic, group, from_log_start) for group in groups if group]


def _kafka_config(options: Mapping[str, str]) -> Config:
    """The Config the source's string options describe (they travel to executors as text)."""
    return Config(kafka_bootstrap_servers=options["bootstrap"],
                  kafka_options=json.loads(options.get("kafkaOptions", "{}")))


def _watermarks(options: Mapping[str, str], topic: str) -> dict[int, tuple[int, int]]:
    return topic_watermarks(_kafka_config(options), topic)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans per-partition offset ranges on the driver; executors read them with confluent-kafka."""

    def __init__(self, options: Mapping[str, str]) -> None:
        # Spark hands options over case-insensitive; a plain dict keeps them lowercased, so
        # camelCase look-ups (kafkaOptions, shareReads) on executors would find nothing.
        self.options = CaseInsensitiveDict(options)
        self.topic = options["topic"]
        self.max_rows = int(options.get("maxOffsetsPerTrigger", "0")) or None
        self.fail_on_data_loss = options.get("failOnDataLoss", "true").lower() == "true"  # (K1)
        self.read_tasks = int(options.get("readTasks", "0"))  # (K5); 0: one per partition
        self._target: dict[str, int] | None = None
        self._warned_log_starts: set[tuple[int, int]] = set()  # (K8) once each
        self._initial: dict | None = None  # what initialOffset() last answered (K9)
        self._first_planned: dict | None = None  # the first micro-batch this run planned (K10)
        clock = IdleClock.from_options(self.options)
        self._quiet = QuietTimer(clock) if clock is not None else None

    def _same_log(self, *planned: dict) -> str | None:
        """The topic's id now (asked before its offsets, so that offsets read from a new log
        never carry the old id), checked against the one ``planned`` offsets carry (K7)."""
        current = topic_id(_kafka_config(self.options), self.topic)
        for offsets in planned:
            check_same_log(self.topic, offsets.get(TOPIC_ID), current)
        return current

    def initialOffset(self) -> dict:
        """Each partition's log start (K8)."""
        current = self._same_log()
        marks = _watermarks(self.options, self.topic)
        for partition, (low, _high) in sorted(marks.items()):
            if low > 0 and (partition, low) not in self._warned_log_starts:  # (K8)
                self._warned_log_starts.add((partition, low))  # asked every trigger until
                log.warning("topic %s partition %d: a new checkpoint starts at the log's start, "
                            "offset %d: records 0..%d were deleted by the broker before (its "
                            "retention, or the embedded broker's cap) and are not read",
                            self.topic, partition, low, low - 1)  # the first batch is planned
        self._initial = _with_topic_id({str(p): low for p, (low, _high) in marks.items()},
                                       current)
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_rows) if self.max_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {str(p): high for p, (_low, high) in
                        _watermarks(self.options, self.topic).items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        current = self._same_log(start)
        marks = _watermarks(self.options, self.topic)
        latest: dict[str, int] = {}
        first = start == self._initial  # the first micro-batch (K9)
        planned_from = _partition_offsets(start)
        counted_from = dict(start)  # where the rate limit counts a partition's backlog from
        for partition, (low, high) in marks.items():
            key = str(partition)
            begin = int(start.get(key, 0))  # (K3) a partition added since: from its offset 0
            if first and key in start and begin < low:  # (K10) dropped since initialOffset()
                log.warning("topic %s partition %d: the broker dropped records %d..%d while "
                            "a new checkpoint planned its first micro-batch, before anyone "
                            "read them; it starts at offset %d", self.topic, partition, begin,
                            low - 1, low)
                begin = planned_from[key] = counted_from[key] = low
            check_no_data_loss(self.topic, partition, begin, low, high,  # (K1, K3)
                               fail_on_data_loss=self.fail_on_data_loss)
            if self._target is not None:
                high = min(high, self._target.get(key, begin))
            latest[key] = max(begin, high)
            if begin < low:  # accepted (K1): the read puts a marker in place of begin..low-1
                log.warning("topic %s partition %d: records %d..%d were dropped by the broker "
                            "before they were read; the micro-batch from offset %d records "
                            "them in quarantine and reads on (failOnDataLoss=false)",
                            self.topic, partition, begin, low - 1, begin)
                counted_from[key] = min(low, latest[key])
        for key, begin in _partition_offsets(start).items():  # (K3) missing from this answer
            latest.setdefault(key, int(begin))
        if isinstance(limit, ReadMaxRows):
            latest = _rate_limit(counted_from, latest, limit.max_rows)
        if all(stop == int(planned_from.get(key, 0)) for key, stop in latest.items()):
            tick = self._clock_tick(start)
            if tick is None:
                return start  # nothing new: no micro-batch (K9)
            # A quiet stream's clock ticks (T1): the records' ends as they are. Not where the
            # first micro-batch started (K9): ``partitions`` would read its records again.
            return {**{k: v for k, v in start.items() if k != PLANNED_FROM}, CLOCK_OFFSET: tick}
        if self._quiet is not None:
            self._quiet.moved()
        end = _with_topic_id(latest, current)
        if CLOCK_OFFSET in start:  # carried on (T1)
            end[CLOCK_OFFSET] = start[CLOCK_OFFSET]
        if first:  # its start goes with it (K9), as moved (K10)
            end[PLANNED_FROM] = planned_from
            self._first_planned = end
        return end

    def _clock_tick(self, start: dict) -> int | None:
        """The event time of a quiet stream's clock tick to plan now, or None (T3, T5, T6)."""
        if self._quiet is None or self._target is not None:
            return None
        return self._quiet.tick(start.get(CLOCK_OFFSET))

    def reportLatestOffset(self) -> dict | None:
        return {str(p): high for p, (_low, high) in _watermarks(self.options, self.topic).items()}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        self._same_log(start, end)  # a restart replays its last batch from here (K7)
        tick = end.get(CLOCK_OFFSET)
        ticks = [ClockTick(self.topic, tick)] if tick not in (None, start.get(CLOCK_OFFSET)) else []
        stops = _partition_offsets(end)
        # The first micro-batch's start as planned, not as initialOffset() now answers (K9).
        start = end.get(PLANNED_FROM, start)
        # A partition added since ``start`` was planned from its offset 0 (K3); if the broker
        # dropped records since, the read stops with DataLossError or marks them (K1, K2).
        ranges = {int(key): (int(start.get(key, 0)), int(stop)) for key, stop in stops.items()}
        ranges = {p: (begin, stop) for p, (begin, stop) in ranges.items() if stop > begin}
        # Planned by this run just now, not replayed from the checkpoint (K10).
        first_read = PLANNED_FROM in end and end == self._first_planned
        return [*group_ranges(self.topic, ranges, self.read_tasks or len(ranges), first_read),
                *ticks]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, ClockTick):
            yield partition.record_batch()
            return
        assert isinstance(partition, KafkaRange)
        yield from read_range(self.options, partition, fail_on_data_loss=self.fail_on_data_loss)

    def commit(self, end: dict) -> None:
        """Nothing to do: offsets live in Spark's checkpoint, not in a consumer group."""


def _with_topic_id(offsets: dict[str, int], current: str | None) -> dict:
    return offsets if current is None else {**offsets, TOPIC_ID: current}


def _partition_offsets(offsets: dict) -> dict[str, int]:
    return {key: value for key, value in offsets.items() if key.isdigit()}


def _rate_limit(start: dict, latest: dict[str, int], max_rows: int) -> dict[str, int]:
    backlog = {k: v - int(start.get(k, 0)) for k, v in latest.items()}  # (K3) from 0
    total = sum(backlog.values())
    if total <= max_rows:
        return latest
    limited = {}
    for key, stop in latest.items():
        begin = stop - backlog[key]
        share = max(1, int(max_rows * backlog[key] / total)) if backlog[key] else 0  # (K4)
        limited[key] = begin + min(backlog[key], share)
    return limited


def read_range(
    options: Mapping[str, str], kafka_range: KafkaRange, *, fail_on_data_loss: bool = True,
) -> Iterator[pa.RecordBatch]:
    """Read one task's offset ranges as Arrow batches; raises DataLossError on dropped records
    (K2), or with ``fail_on_data_loss=False`` puts a marker record in their place (K1). With
    ``shareReads`` set, the second read of the same ranges takes the first's (K6)."""
    shared = _shared_read_path(options, kafka_range)
    if shared is not None:
        kept = _take_shared_read(shared)
        if kept is not None:
            yield from kept
            return
    batches = (_to_arrow(kafka_range.topic, messages) for messages in read_offset_ranges(
        _kafka_config(options), kafka_range.topic, kafka_range.ranges,
        fail_on_data_loss=fail_on_data_loss,
        idle_timeout_s=float(options.get("readTimeoutSeconds", "60")),
        start_may_move=kafka_range.from_log_start,
    ))
    if shared is None:
        yield from batches
    else:
        yield from _keep_shared_read(shared, batches)


def _shared_read_path(options: Mapping[str, str], kafka_range: KafkaRange) -> Path | None:
    """Where the read of these ranges in this query run is kept (K6), or None: not shared."""
    token = options.get("shareReads")
    if not token:
        return None
    ranges = sorted(kafka_range.ranges.items())
    name = hashlib.sha256(f"{token}|{kafka_range.topic}|{ranges}".encode()).hexdigest()
    folder = _shared_reads_folder()
    return None if folder is None else folder / f"{name}.arrow"


def _shared_reads_folder() -> Path | None:
    """This user's folder of kept reads (K6), or None when it is not private to the user:
    another local user must neither read the events kept there nor plant a read."""
    uid = os.geteuid()
    folder = Path(tempfile.gettempdir()) / f"clickstream-kafka-reads-{uid}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = folder.lstat()
    except OSError as exc:
        log.warning("not sharing Kafka reads between the two scans (%s): %s", folder, exc)
        return None
    if (not stat.S_ISDIR(found.st_mode) or found.st_uid != uid
            or stat.S_IMODE(found.st_mode) & 0o077):
        log.warning("not sharing Kafka reads between the two scans: %s is not a folder of "
                    "user %d's alone (mode %o, owner %d); remove it, or let this user "
                    "create it", folder, uid, stat.S_IMODE(found.st_mode), found.st_uid)
        return None
    return folder


def _take_shared_read(path: Path) -> list[pa.RecordBatch] | None:
    """The batches a first read kept at ``path`` (the file is deleted), or None."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
    except FileNotFoundError:  # not kept (yet), or kept on another host
        return None
    except OSError as exc:
        log.warning("reading Kafka instead of a kept read (%s): %s", path, exc)
        return None
    # Views of the mapping, which they keep alive: still valid once the file is unlinked.
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    path.unlink(missing_ok=True)
    return batches


def _keep_shared_read(path: Path, batches: Iterator[pa.RecordBatch]
                      ) -> Iterator[pa.RecordBatch]:
    """Yield ``batches`` while writing them to ``path``, published whole (rename) at the end.

    Keeping is only a saving: when the file cannot be written (a full disk), the read goes on
    and keeps nothing, and the second read fetches from Kafka."""
    kept = _KeptRead.open(path)
    try:
        for batch in batches:
            if kept is not None and not kept.write(batch):
                kept = None
            yield batch
        if kept is not None:
            kept.publish()
            kept = None
    finally:
        if kept is not None:  # a failed or abandoned read keeps nothing
            kept.discard()


class _KeptRead:
    """A read being kept for the second scan (K6): a partial file until it is complete."""

    def __init__(self, path: Path, partial: Path, sink: pa.NativeFile,
                 writer: pa.ipc.RecordBatchFileWriter) -> None:
        self.path, self.partial, self.sink, self.writer = path, partial, sink, writer

    @classmethod
    def open(cls, path: Path) -> _KeptRead | None:
        partial = path.with_suffix(f".{uuid.uuid4().hex}.partial")
        try:  # the folder is _shared_reads_folder's, made and checked private just before
            _sweep_shared_reads(path.parent)
            sink = pa.OSFile(str(partial), "wb")
        except OSError as exc:  # nothing was created
            _warn_not_kept(path, exc)
            return None
        try:
            return cls(path, partial, sink, pa.ipc.new_file(sink, _ARROW_SCHEMA))
        except OSError as exc:
            _warn_not_kept(path, exc)
            sink.close()
            partial.unlink(missing_ok=True)
            return None

    def write(self, batch: pa.RecordBatch) -> bool:
        """False when the batch could not be written; the partial file is gone then."""
        try:
            self.writer.write_batch(batch)
            return True
        except OSError as exc:
            _warn_not_kept(self.path, exc)
            self.discard()
            return False

    def publish(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
            os.replace(self.partial, self.path)
        except OSError as exc:
            _warn_not_kept(self.path, exc)
            self.discard()

    def discard(self) -> None:
        """Drop the partial file. Only cleanup after a failure already logged, or after an
        abandoned read: closing may fail again (a full disk, a writer already closed)."""
        for close in (self.writer.close, self.sink.close):
            with contextlib.suppress(OSError, pa.ArrowInvalid):
                close()
        self.partial.unlink(missing_ok=True)


def _warn_not_kept(path: Path, exc: OSError) -> None:
    log.warning("not keeping a Kafka read for its second scan (%s): %s", path, exc)


def _sweep_shared_reads(folder: Path) -> None:
    """Delete kept reads older than SHARED_READ_MAX_AGE_S: their second read never came (K6)."""
    oldest = time.time() - SHARED_READ_MAX_AGE_S
    for entry in os.scandir(folder):
        try:
            if entry.stat().st_mtime < oldest:
                os.unlink(entry.path)
        except FileNotFoundError:  # taken or swept meanwhile
            continue


# Spark's timestamps are microseconds in an int64: a producer's CreateTime may be any int64
# of milliseconds, and one past this range is no time Spark can hold.
_MAX_TIMESTAMP_MS = (2**63 - 1) // 1000


def _to_arrow(topic: str, messages: list[Message]) -> pa.RecordBatch:
    """Kafka's column layout, built column by column (~4x faster than row by row)."""
    stamps = [message.timestamp() for message in messages]
    # A time out of Spark's range is read as Kafka's "none" (-1): the parser then judges the
    # record by the micro-batch's time, as any record without a timestamp.
    millis = pa.array([ms if abs(ms) <= _MAX_TIMESTAMP_MS else -1 for _kind, ms in stamps],
                      pa.int64())
    return pa.RecordBatch.from_arrays([
        pa.array([message.key() for message in messages], pa.binary()),
        pa.array([message.value() for message in messages], pa.binary()),
        pa.array([topic] * len(messages), pa.string()),
        pa.array([message.partition() for message in messages], pa.int32()),
        pa.array([message.offset() for message in messages], pa.int64()),
        millis.cast(pa.timestamp("ms", tz="UTC")).cast(_ARROW_SCHEMA.field("timestamp").type),
        pa.array([max(kind - 1, 0) for kind, _ms in stamps], pa.int32()),
        pa.array([[{"key": k, "value": v} for k, v in headers] if headers else None
                  for headers in (message.headers() for message in messages)],
                 _ARROW_SCHEMA.field("headers").type),
    ], schema=_ARROW_SCHEMA)


class KafkaDataSource(DataSource):
    """``spark.readStream.format("clickstream_kafka")``: options bootstrap, topic, ..."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return KAFKA_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(self.options)


def native_client_options(config: Config) -> dict[str, str]:
    """The Java client's settings, as Spark's native source takes them (``kafka.`` prefixed):
    ``kafka_options`` with ``spark_kafka_options`` over them. A librdkafka-only name left in
    (``sasl.username``) is logged by the Java client as unused, not refused."""
    merged = {**config.kafka_options, **config.spark_kafka_options}
    return {f"kafka.{key}": value for key, value in merged.items()}


def read_kafka_stream(spark: SparkSession, config: Config, topic: str, *,
                      share_reads: bool = False, idle_clock: IdleClock | None = None
                      ) -> DataFrame:
    """The events stream in Kafka layout, from the source the configuration selects.

    Args:
        share_reads: the query scans each micro-batch twice (the sessionizer's two branches):
            the second read takes the first's batches (K6). The native source reads Kafka.
        idle_clock: a quiet stream's clock ticks (``io.stream_clock``); not with the native
            source (T6).
    """
    if config.kafka_source == "native":
        reader = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", config.kafka_bootstrap_servers)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .option("failOnDataLoss", str(config.fail_on_data_loss).lower())  # (K1)
            .option("includeHeaders", "true")
            .option("maxOffsetsPerTrigger", str(config.max_events_per_trigger))
        )
        return reader.options(**native_client_options(config)).load().select(
            *KAFKA_SCHEMA.fieldNames())
    spark.dataSource.register(KafkaDataSource)
    return (
        spark.readStream.format(SOURCE_NAME)
        .option("bootstrap", config.kafka_bootstrap_servers)
        .option("topic", topic)
        .option("maxOffsetsPerTrigger", str(config.max_events_per_trigger))
        .option("failOnDataLoss", str(config.fail_on_data_loss).lower())  # (K1)
        .option("kafkaOptions", json.dumps(dict(config.kafka_options)))
        .option("readTasks", str(spark.sparkContext.defaultParallelism))  # (K5)
        .option("shareReads", uuid.uuid4().hex if share_reads else "")  # (K6)
        .options(**(idle_clock.options() if idle_clock is not None else {}))
        .load()
    )
