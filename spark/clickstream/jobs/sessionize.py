"""The streaming sessionizer: Kafka ``events`` -> Delta tables and the ``sessions`` topic.

One Structured Streaming query with two branches of the same source, unioned into one
``foreachBatch`` sink so that both see exactly the same records per micro-batch:

* the *session* branch: valid pageviews and orders -> event-time watermark ->
  ``transformWithStateInPandas`` (``sessions.stream_adapter``) -> sessions the watermark closed,
  their attributions, and ids of retried records the state already holds;
* the *record* branch: every parsed record, valid or not.

The sink (``write_micro_batch``) quarantines bad records, stores every valid pageview and
order exactly once, queues late ones for the recompute, and writes/publishes closed sessions.

Delivery guarantee: exactly once into the Delta tables. Source offsets and session state live
in the Spark checkpoint; every table write is ``append_once`` under (query id, batch id), so a
batch replayed after a crash commits nothing twice (a record a backfill queued ahead of its
merge is that backfill's to store: Z11, Z14). Kafka outputs are at least once with
idempotent keys (session_id at its revision), so a compacted reader sees each session once.

Known edge cases, cited inline as (Z1)..(Z21):
  Z1. Spark drops rows at or before the *previous* batch's watermark before the stateful
      operator (measured on Spark 4.2). The sink applies the same rule to the record branch, so
      a row is either sessionized by the stream or stored as late and queued, never neither.
  Z2. A late record may duplicate one already stored: it is anti-joined against the stored
      table, restricted to the partitions (client, day) of the late rows.
  Z3. On-time duplicates are recognised by the state (``duplicate`` rows) and within the batch.
      A duplicate row drops only rows of its own type and client: a pageview's event_id may
      equal an order's order_id, and a retried pageview dropped such a new order unseen. Ids
      are a client's (its tables are its own): within the batch and against stored rows,
      records are the same only with the same client too; one row per id across clients
      dropped one client's pageview unseen while the state sessionized it.
  Z4. The query id in the checkpoint names the Delta application transactions: a new
      checkpoint (a fresh query) never collides with the batch ids of an old one.
  Z5. Counts are the rows each write committed (file statistics, no count job): a replayed
      micro-batch reports 0 for what it had already committed, and still republishes.
  Z6. A micro-batch writes in waves, side by side within each (one thread per output): first
      what it stores of its records (quarantine, pageviews, orders, other events), then the
      recompute queue (Z9), then what it derived (sessions, attributions), each topic right
      after its own table. Each write is a few small Spark jobs and a Delta commit that mostly
      wait (py4j, planning, Python workers starting, the commit's file I/O), so a wave takes
      about as long as its largest write. The waves keep the order that matters to readers, a
      concurrent recompute included: a session visible in a table or topic has its pageviews
      and orders stored. Each write is idempotent on its own (``append_once`` per table), so a
      crash between them replays the batch as it did when they ran one after another.
  Z7. The raw_events gate's check job and the job that counts the outputs run side by side on
      the records as parsed. The gate only passes or marks: when it marked no record (the
      frame it returns is the one it got), the counts stand; otherwise they are taken again
      on the marked records. A micro-batch without bad data pays one job's wait, not two.
  Z8. A late record goes to the recompute queue only when no other delivery stored it: a late
      duplicate of a record an earlier micro-batch (or a backfill) stored has nothing left to
      fold in. Deliveries are told apart by ``source`` (topic/partition/offset), so a replayed
      micro-batch, whose own earlier attempt may have stored the record, still queues it.
  Z9. The recompute queue commits only after the micro-batch's pageviews and orders did, in a
      wave between the stored and the derived writes: a recompute (scheduled, or running
      while a crashed stream is down) that finds a queue row always finds its record stored.
      Committed side by side, the queue row could land first; a recompute in between folded
      nothing in and removed the row, and the replayed batch skipped its already committed
      queue write: the late record never reached a session. A crash after the records' wave
      replays the batch, which still queues them (Z8: the stored rows carry its own source).
      The extra wave costs only micro-batches with late records, or with on-time records
      while the queue holds a backfill's rows (Z11). (Rows a backfill queues ahead of its
      merge are the exception to the order: Z11.)
  Z10. The checkpoint's state holds open sessions merged with the session gap of its first
      start: a later start with another CLICKSTREAM_SESSION_GAP would mix two gaps silently.
      The first start records the gap (and the state's bucket count) in the checkpoint folder
      (``clickstream-settings.json``); a start with other values is refused with what to do.
      A checkpoint from before this record, or one whose first start never planned a
      micro-batch, takes the current values.
  Z11. A backfill stores its rows of users whose sessions the stream still holds open and
      queues them for the recompute (corrections C4). When the stream then receives the same
      record on time, it is not stored again: on-time rows whose id a backfill queued are
      dropped from the stored rows (they still reach the session state, which owns them).
      A copy at another place (user or time) than the backfill's row (the batch moved the
      record) is counted by the state there, where nothing is stored: its place is queued
      too (``queued_by`` ending in ``MOVED_AWAY``, counted in ``late_queued``), and the
      recompute takes the record out of that session once the stream let it go. Unqueued,
      a moved order's revenue stayed in its old session: counted twice.
      Once the recompute has folded such a record in and dequeued it, its session is closed,
      so a copy arriving after that is late and meets Z2. Nor does the stream write the
      attribution of an order a backfill queued: the recompute that folds the queued row in
      attributes it. The backfill may have moved it to another user or time while the stream
      held it where it was (``corrections`` C10); appended there, the order was held twice.
      The backfill queues its rows the stream could still receive on time (``ts`` after the
      watermark of the stream's last committed micro-batch) before it merges them (Z14):
      queued only after, a copy the stream received in between (tens of seconds, or until
      the rerun of a backfill killed after its merge) was stored twice, and the client's next
      backfill of that day failed its ``tables_after_merge`` gate (duplicate keys). Queued
      ahead, a row's record is stored only once the merge commits: a recompute that folds
      such a row in before (the stream let its user go meanwhile; it defers it until then)
      recomputes the session without the record, and the backfill's plan puts it back.
  Z12. Two copies of one id in a micro-batch that differ (a producer reusing an id, not a
      retry): the sink stores the copy the session state counts, chosen by the same rule
      (semantics E6: first by time, user, then url or amount and currency), not whichever
      Spark's dedupe met first. Copies of different users in different state buckets are each
      counted by their own bucket; the table keeps one, and a recompute of those users corrects
      the sessions (they are not queued: a correction reaching them, or ``recompute --full``).
      An on-time copy comes before a late one, whose time is always earlier: the state counts
      only on-time rows (Z1), so a late copy is stored (and queued) only when no on-time copy
      of its id is in the batch.
  Z13. A stop (SIGTERM, SIGINT) lets the micro-batches already planned (in the checkpoint's
      offsets log) finish and commit, and starts no other: the writer refuses a later batch
      before writing anything (``StopBeforeMicroBatch``; the next start replays it). Spark's
      own ``stop()`` mid-batch cancels the batch's jobs under the writer, which here ended in
      a ``StackOverflowError`` of the stream thread and a batch to redo. A second signal
      stops at once (the batch in flight is replayed at the next start, nothing doubled); a
      batch waiting for a backfill's merge (Z14) gives up its wait: Spark's ``stop()`` waits
      for the writer, which waited as long as the merge ran.
  Z14. A micro-batch holds the warehouse's records lock (``records_lock``) from the moment it
      reads which records backfills queued (Z11; after its gate's and counts' jobs, which
      compute the micro-batch) until its records' wave committed, and a backfill's merge
      holds it from its read of what is stored to its commit. So a
      micro-batch stores its records before the merge reads (the merge finds them and skips
      them), or reads the queue and the stored rows after the merge committed (it leaves the
      rows queued ahead to the backfill, and finds a late copy stored): no record is stored by
      both, on time or late. Without it, a micro-batch that read the queue just before the
      rows were queued stored its on-time copy while the merge ran, and a copy that turned
      late while the merge ran (the watermark passed it) was compared with the stored rows
      before the merge committed. The stream waits for a merge (seconds; as long as the
      backfill's ``merge:`` step), a merge for a micro-batch's records' wave; merges of
      several backfills (of any clients) take turns. ``flock`` does not queue waiters in
      order, and reaches one machine (``locks``).
  Z15. One sessionizer per checkpoint: a run holds ``sessionizer_lock`` (a file beside the
      checkpoint folder) from before it reads the checkpoint until it ends, and a second run
      is refused at once, naming the holder's pid. Spark guards a checkpoint only within one
      JVM: two processes (``clickstream sessionize`` while the ``sessionizer`` DAG streams)
      would plan and run the same micro-batches and write the same state versions, and only
      a clash on a log file stops one of them, whenever it happens.
      One sessionizer per warehouse too (a second lock, in the warehouse's locks folder):
      one with another home (another checkpoint) would sessionize the same events into the
      same tables and topics beside it.
  Z16. A replayed micro-batch whose attributions an earlier attempt committed publishes the
      rows that attempt stored for its orders, not what it computes again: a backfill may have
      queued one of its orders since (Z11), and the replay, leaving that order out, published
      nothing for it while the table held it; the recompute that folded the queued row in
      found the stored row unchanged, so the order never reached the topic.
  Z17. Correction runs read the stream's watermark and gap from its checkpoint under
      ``CLICKSTREAM_HOME``; one with another home (a shell beside Airflow's sessionizer, or
      the relative default ``var/home`` from another folder) saw no sessionizer, left it no
      open session and could store what the stream still held a second time. Each
      sessionizer start notes its checkpoint and topics in the warehouse
      (``STREAM_SETTINGS_FILE``), and a correction run with another home is refused, naming
      the home to use; so is one that would publish to other topics than the stream's (its
      corrections would never reach the stream's readers).
  Z18. What the tables hold when a checkpoint starts is history to it. A checkpoint's start
      before its first micro-batch pins, per client, the time of the latest pageview or order
      the tables hold plus one session gap (``HISTORY_FILE``, computed under the records
      lock). A record of that client at or before it is late, as one at or before the
      watermark is (Z1): compared with what is stored, stored and queued only if no other
      delivery stored it, never counted by the session state (it still moves the watermark,
      as it did when it was on time). Without it, history loaded
      by backfills before the stream ever ran (their sessions computed and published) met
      a first micro-batch with no watermark: every copy the topic held was on time, stored a
      second time and sessionized again, and a new checkpoint re-reading the topic did the
      same. The gap makes a record that could join a stored session late too: its user's
      session is recomputed from the tables by the recompute that folds it in, where the
      stream would have started a session of its own beside the stored one. A backfill that
      finds a sessionizer running before its first micro-batch takes the pinned time as the
      stream's watermark (``stream_watermark_ms``): it queues its rows after it ahead of its
      merge (Z11) and leaves their users to the stream (``corrections`` C4), as it does
      beside a stream that has run; the merge checks again under the records lock, so a
      sessionizer starting while the merge waited is seen. A sessionizer not running pins
      again when it starts, and then finds the backfill's rows stored. A new checkpoint
      (the old one deleted) queues what it reads again, stored by the same deliveries (Z8):
      the recompute that folds it in emits the sessions the old one held open, and changes
      nothing else.
  Z19. A micro-batch commits its tables one by one, for every client: it is a read point
      group of every client (``io.read_point``), opened before its first commit and closed
      after its last, so the read point never shows part of one (it stays where it was while
      one is open, and a backfill closing meanwhile is shown by the micro-batch's close). A
      batch that fails stays open until its replay at the next start closes it; a start
      closes the groups of other checkpoints (deleted: none will replay them). The close
      names the batch's watermark in the read point: a reader learns from it which sessions
      may still be open in the state (no row yet), and which pageviews are in no session.
  Z20. A quiet stream's clock tick (``io.stream_clock``) passes the session branch's
      watermark and stops there, and the record branch drops it: it moves the watermark and
      is neither stored, counted as a record, nor seen by the session state. The micro-batch
      that reads it says so in its progress line; the next one emits what it closed.
  Z21. A replayed micro-batch whose quarantine write an earlier attempt committed quarantines
      the records no attempt did: a validation setting changed since (a stricter
      ``CLICKSTREAM_MAX_TS_AHEAD``, the gates turned to ``enforce``) refuses records the first
      attempt passed, and the replay stores them nowhere else. Found by ``source`` (the Kafka
      position) and text, under a transaction of the batch's own, so a later replay adds
      only what is new again. Records the first attempt quarantined and the replay passes
      are stored too.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from functools import partial, reduce
from pathlib import Path
from typing import TypeVar

from pyspark.errors import StreamingQueryException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.util import inheritable_thread_target

from clickstream import errors
from clickstream.atomic_files import write_atomically
from clickstream.config import ENV_NAMES, Config
from clickstream.events import contract
from clickstream.events.parse import is_clock_tick, parse_kafka_records
from clickstream.io import read_point
from clickstream.io.delta_tables import AppendResult, DeltaTables, open_tables
from clickstream.io.kafka_changelog import (
    check_changelogs_answer,
    publish_attributions,
    publish_sessions,
)
from clickstream.io.kafka_source import PLANNED_FROM, TOPIC_ID, read_kafka_stream
from clickstream.io.kafka_topics import check_same_log, topic_id, topic_watermarks
from clickstream.io.spark_checkpoint import (
    LogEntry,
    has_log_entry,
    last_logged_batch,
    log_entry,
)
from clickstream.io.stream_clock import IdleClock, logged_tick_ms, planned_tick_ms
from clickstream.locks import (
    LOCKS_FOLDER,
    Holder,
    exclusive,
    exclusive_or_refuse,
    held,
    warehouse_sessionizer_lock,
)
from clickstream.progress import utc_text
from clickstream.quality.gates import gate_raw_events, raw_events_admitted, warm_up
from clickstream.quality.quarantine import quarantine_once
from clickstream.sessions.batch_adapter import amount_from_e4, no_amount, user_bucket
from clickstream.sessions.semantics import AMOUNT_SCALE, ORDER_COPY_ORDER, PAGEVIEW_COPY_ORDER
from clickstream.sessions.stream_adapter import OUTPUT_SCHEMA
from clickstream.sessions.stream_processor import SessionProcessor
from clickstream.spark_session import build_spark, driver_heap_mib
from clickstream.tables import (
    ATTRIBUTIONS,
    BACKFILL_QUEUED_BY,
    MOVED_AWAY,
    ORDERS,
    OTHER_EVENTS,
    PAGEVIEWS,
    QUARANTINE,
    RECOMPUTE_QUEUE,
    SESSIONS,
    TableSpec,
)

JOB = "sessionize"
T = TypeVar("T")
STATE_BUCKETS = 16  # part of the checkpoint's state layout: changing it needs a new checkpoint


@dataclass
class BatchCounts:
    """What one micro-batch (or a whole run, summed) did."""

    records: int = 0
    quarantined: int = 0
    pageviews: int = 0
    orders: int = 0
    other_events: int = 0
    duplicates: int = 0
    late_queued: int = 0
    sessions: int = 0
    attributions: int = 0
    # Of the records, those late for the stream (the rest of late_queued are places of
    # on-time copies a backfill moved, Z11): the progress line says what they were late for.
    late_records: int = field(default=0, metadata={"shown": False})

    def add(self, other: BatchCounts) -> None:
        for item in fields(self):
            setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    def describe(self) -> str:
        return ", ".join(f"{getattr(self, f.name)} {f.name.replace('_', ' ')}"
                         for f in fields(self) if f.metadata.get("shown", True))


@dataclass
class SessionizeSummary:
    """Totals of one ``clickstream sessionize`` run."""

    batches: int = 0
    totals: BatchCounts = field(default_factory=BatchCounts)
    seconds: float = 0.0
    stopped_by: int | None = None  # the signal that asked for the stop, if one did

    def describe(self) -> str:
        batches = f"{self.batches} micro-batch{'es' if self.batches != 1 else ''}"
        return (f"sessionize: {batches} in {self.seconds:.1f}s: "
                f"{self.totals.describe()}")


def _ms_to_ts(column: str | Column) -> Column:
    return F.timestamp_millis(F.col(column) if isinstance(column, str) else column)


def _amount_e4() -> Column:
    """An order's amount as the session state takes it: in 1/10000. Fits: the contract keeps
    amounts below 10**14 (events.parse.amount_error). Never null, so that pandas gets int64,
    not float64 (batch_adapter.no_amount)."""
    return F.coalesce((F.col("amount") * AMOUNT_SCALE).cast("long"), no_amount())


def _copy_order(names: list[str]) -> list[Column]:
    """semantics' copy order (E6) over the sink's columns (Z12)."""
    derived = {"ts_ms": F.unix_millis("ts"), "amount_e4": _amount_e4()}
    return [derived.get(name, F.col(name)) for name in names]


def _first_copies(rows: DataFrame, key: str, order: list[str], late: Column) -> DataFrame:
    """One row per (client, ``key``): the copy the session state keeps (Z12), which sees only
    the rows that are not ``late``. The rest of the columns break ties, so the table's choice
    does not depend on arrival either. One aggregate, as Spark's own dedupe (both
    sort-aggregate these string columns)."""
    ids = ["client_id", key]
    rest = [c for c in rows.columns if c not in ids]
    ranked = [c.alias(f"_copy_order_{i}")
              for i, c in enumerate([late, *_copy_order(order)])]  # on time first
    first = F.min(F.struct(*ranked, *rest)).alias("_first")
    return rows.groupBy(*ids).agg(first).select(
        *[F.col(c) if c in ids else F.col(f"_first.{c}").alias(c) for c in rows.columns])


def build_stream(spark: SparkSession, config: Config, *, share_reads: bool = True,
                 history: Mapping[str, int] | None = None) -> DataFrame:
    """The unioned stream the sink consumes: ``branch`` = 'emitted' | 'record'.

    Each branch scans the source; with ``share_reads`` the second scan of a micro-batch takes
    the first's records instead of fetching them again (kafka_source K6; off only to measure
    what that saves: ``bench/sessionizer_bench.py stages``). ``history``: what the checkpoint
    pinned (``history_until``), which the session state never counts (Z18).
    """
    idle_clock = IdleClock(config.idle_clock_after_ms, config.watermark_delay_ms,
                           config.session_gap_ms, config.checkpoint_path(JOB)
                           ) if config.idle_clock_after_ms else None
    records = parse_kafka_records(
        read_kafka_stream(spark, config, config.events_topic, share_reads=share_reads,
                          idle_clock=idle_clock),
        max_ts_ahead_ms=config.max_ts_ahead_ms)
    # One predicate, not a conjunction: Spark would push a conjunct on ``event_type`` alone
    # below the parse, where it parses every record's JSON a second time to read that field.
    is_session_input = F.coalesce(
        F.col("error").isNull()
        & F.col("event_type").isin(contract.PAGEVIEW, contract.ORDER)
        & raw_events_admitted(config),  # what the sink's gate quarantines
        F.lit(False)) | is_clock_tick()
    # Past the watermark, only records reach the state: a clock tick (the one row without an
    # event type here) moved the watermark and stops (Z20), and so does history (Z18, late as
    # the sink takes it). One predicate on ``ts``: Spark pushes a filter that
    # does not read the event time below the watermark, where the ticks would move nothing.
    reaches_state = F.when(F.col("event_type").isNull(), F.col("ts").isNull()).otherwise(
        ~is_history(history))
    session_input = (
        records.where(is_session_input)
        .select(
            user_bucket(STATE_BUCKETS).alias("bucket"),
            "client_id", "user_id", "event_type", "event_id", "ts",
            F.unix_millis("ts").alias("ts_ms"), "url", "order_id",
            _amount_e4().alias("amount_e4"), "currency",
        )
        .withWatermark("ts", f"{config.watermark_delay_ms} milliseconds")
        .where(reaches_state)
    )
    emitted = session_input.groupBy("bucket").transformWithStateInPandas(
        statefulProcessor=SessionProcessor(config.session_gap_ms),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Append",
        timeMode="EventTime",
    )
    record_type = records.schema
    return emitted.select(
        F.lit("emitted").alias("branch"),
        F.struct(*emitted.columns).alias("emitted"),
        F.lit(None).cast(record_type).alias("record"),
    ).unionByName(records.where(~is_clock_tick()).select(  # (Z20)
        F.lit("record").alias("branch"),
        F.lit(None).cast(OUTPUT_SCHEMA).alias("emitted"),
        F.struct(*records.columns).alias("record"),
    ))


def checkpoint_watermark_ms(checkpoint: Path, batch_id: int) -> int:
    """The event-time watermark Spark recorded for ``batch_id`` (0 before the first batch)."""
    return _watermark_ms(log_entry(checkpoint, "offsets", batch_id)) if batch_id >= 0 else 0


def _watermark_ms(offsets_entry: LogEntry) -> int:
    return int(offsets_entry.metadata.get("batchWatermarkMs", 0))


def stream_watermark_ms(config: Config, client_id: str) -> int | None:
    """The watermark of the sessionizer's last committed micro-batch; None if it never ran.

    Sessions ending within one gap of it may still be open in the stream's state, or closed
    by a micro-batch that has not finished (its sessions in the table but not yet on the
    topic, or to be replayed after a crash): batch corrections leave them to the stream.
    The latest micro-batch's own watermark would not do: the sessions it closes end within
    one gap of the previous watermark, not of its own.

    A sessionizer running before its first micro-batch takes as on time any record of
    ``client_id`` after what it pinned as history (Z18): that is its watermark here (0 for a
    client it pinned nothing of). One not running pins again when it starts, and finds
    stored whatever a correction stores meanwhile: None, as if none had run.
    """
    checkpoint = config.checkpoint_path(JOB)
    if not _planned_a_batch(checkpoint):
        history = history_until(checkpoint)
        if history is None or not held(sessionizer_lock_path(config)):
            return None
        return history.get(client_id, 0)
    return checkpoint_watermark_ms(checkpoint, last_logged_batch(checkpoint, "commits"))


@dataclass(frozen=True)
class CheckpointProgress:
    """Where the sessionizer's checkpoint stands, from Spark's offsets and commits logs."""

    committed: int  # the last committed micro-batch; -1 if none
    planned: int  # the last planned one (above ``committed``: in flight, or replayed next)
    committed_at_ms: int | None  # the committed micro-batch's trigger time
    watermark_ms: int  # a later record whose ts is at or before it is late (Z1)
    offsets: dict[int, int]  # per partition of the events topic, the next offset to read
    # (before the first commit: where the planned first micro-batch starts, if it was)
    topic_id: str | None = None  # of the log they name (``kafka_source`` K7); None: unknown


def checkpoint_progress(checkpoint: Path, topic: str) -> CheckpointProgress | None:
    """The checkpoint's progress through ``topic``; None before its first micro-batch. Reads
    both sources' offset layouts (this product's and Spark's native ``{topic: {p: o}}``) and
    takes, per partition, the lower of the query's two scans of the topic."""
    if not _planned_a_batch(checkpoint):
        return None
    committed = last_logged_batch(checkpoint, "commits")
    offsets: dict[int, int] = {}
    committed_at = read_id = None
    watermark = 0
    # Before the first commit, where the first micro-batch starts, as its source keeps it
    # (``kafka_source`` K9): its replay reads from there.
    if committed >= 0 or has_log_entry(checkpoint, "offsets", 0):
        entry = log_entry(checkpoint, "offsets", max(committed, 0))
        if committed >= 0:
            committed_at = entry.metadata.get("batchTimestampMs")
            watermark = _watermark_ms(entry)
        for source in entry.source_offsets:
            read_id = read_id or source.get(TOPIC_ID)
            by_partition = (source.get(PLANNED_FROM, {}) if committed < 0  # (K9)
                            else source.get(topic, source))  # native: {topic: {p: offset}}
            for partition, offset in by_partition.items():
                if partition.isdigit():
                    offsets[int(partition)] = min(offset, offsets.get(int(partition), offset))
    return CheckpointProgress(committed, last_logged_batch(checkpoint, "offsets"),
                              committed_at, watermark, offsets, read_id)


SETTINGS_FILE = "clickstream-settings.json"  # in the checkpoint folder, beside Spark's (Z10)
HISTORY_FILE = "clickstream-history.json"  # in the checkpoint folder too (Z18)
# In the warehouse, beside the tables: its sessionizer's checkpoint and topics (Z17). No table
# is named with a leading "_" (as ``locks.LOCKS_FOLDER``).
STREAM_SETTINGS_FILE = "_clickstream_sessionizer.json"


def _session_settings(config: Config) -> dict[str, int]:
    """The settings the checkpoint's session state is built with (Z10)."""
    return {"session_gap_ms": config.session_gap_ms, "state_buckets": STATE_BUCKETS}


def _minutes(ms: int) -> str:
    return f"{ms / 60_000:g} minute{'' if ms == 60_000 else 's'}"


def pin_session_settings(checkpoint: Path, config: Config) -> None:
    """Record the session settings at a checkpoint's first start; refuse to go on with others.

    Raises:
        ConfigError: the session gap (or the state layout) differs from the recorded one.
    """
    path = checkpoint / SETTINGS_FILE
    current = _session_settings(config)
    if path.exists() and _planned_a_batch(checkpoint):
        recorded = json.loads(path.read_text())
        _refuse_another_gap(checkpoint, recorded["session_gap_ms"], config,
                            "its open sessions were merged with that gap, and going on would "
                            "mix both")
        if recorded["state_buckets"] != current["state_buckets"]:
            raise errors.ConfigError(
                f"the sessionizer's checkpoint {checkpoint} holds its state in "
                f"{recorded['state_buckets']} buckets, this version in "
                f"{current['state_buckets']}: move the checkpoint folder away and run "
                "`clickstream recompute --full --client C` for every client")
        return
    write_atomically(path, json.dumps(current))  # whole or not at all


def pin_history(checkpoint: Path, config: Config, tables: DeltaTables,
                stop_now: threading.Event) -> None:
    """Pin what the tables hold as history, at each start before the checkpoint's first
    micro-batch (Z18); a checkpoint that planned one keeps what it pinned (or nothing, if it
    is older than this record). A second signal gives up waiting for a merge (Z13).

    Raises:
        StopBeforeMicroBatch: stopped at once while waiting for a backfill's merge.
    """
    if _planned_a_batch(checkpoint):
        return
    print("sessionize: before this checkpoint's first micro-batch: reading the latest stored "
          "pageview and order of each client (Z18) ...", flush=True)

    with records_lock(config, on_wait=lambda: print(
            "sessionize: waiting for a backfill's merge to commit before reading what the "
            f"tables hold ({records_lock_path(config)}) ...", flush=True),
            abandon=_stop_at_once(stop_now, "before its first micro-batch, and read nothing")):
        until = stored_history_until(tables, config.session_gap_ms)
        write_atomically(checkpoint / HISTORY_FILE, json.dumps(until, sort_keys=True))
    if until:
        print(f"sessionize: the tables hold {len(until)} clients' history; records up to one "
              "session gap after each client's latest stored pageview or order are late for "
              "this checkpoint (README, Run the sessionizer: history)", flush=True)


def stored_history_until(tables: DeltaTables, gap_ms: int) -> dict[str, int]:
    """Per client, the time (ms) up to which a record is history (Z18): its latest stored
    pageview or order, plus one gap. From the files' statistics where the table engine keeps
    them: no data read (reading the column of 11.5M pageviews took 8-16 s, under the records
    lock: BENCHMARKS.md, session 57); the clients of files without them are read."""
    latest: dict[str, int] = {}
    for _, _, spec, _ in RECORD_TABLES:
        highs = tables.largest_by_partition(spec.name, "ts", "client_id")
        unknown = sorted(client for client, high in highs.items()
                         if high is None and client is not None)
        if unknown:  # files without statistics (another engine's): the base class reads them
            highs |= DeltaTables.largest_by_partition(tables, spec.name, "ts", "client_id",
                                                      {"client_id": unknown})
        for client, high in highs.items():
            if client is not None and high is not None:
                high_ms = int(high.timestamp() * 1000)
                latest[client] = max(latest.get(client, high_ms), high_ms)
    return {client: high_ms + gap_ms for client, high_ms in latest.items()}


def history_until(checkpoint: Path) -> dict[str, int] | None:
    """What the checkpoint pinned as history (Z18); None if it pinned nothing (a checkpoint
    that never started, or one older than this record)."""
    path = checkpoint / HISTORY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def is_history(until: Mapping[str, int] | None) -> Column:
    """Whether a row (``client_id``, ``ts``) is history for the stream (Z18)."""
    if not until:
        return F.lit(False)
    latest = F.create_map(*(F.lit(value) for item in sorted(until.items()) for value in item))
    return F.coalesce(F.unix_millis("ts") <= F.try_element_at(latest, F.col("client_id")),
                      F.lit(False))


def record_stream_settings(config: Config) -> None:
    """Note in the warehouse which checkpoint its sessionizer runs on, and the topics it
    publishes to (Z17), at each start: the last one started is the warehouse's."""
    write_atomically(config.warehouse / STREAM_SETTINGS_FILE, json.dumps({
        "checkpoint": str(config.checkpoint_path(JOB).resolve()),
        "home": str(config.home.resolve()), "sessions_topic": config.sessions_topic,
        "attributions_topic": config.attributions_topic}))


def check_stream_settings(config: Config) -> None:
    """Refuse a batch correction (backfill, recompute) that would not see the warehouse's
    sessionizer as it runs, or would publish beside it: its checkpoint under another home,
    its changelogs on other topics (Z17), or another session gap than the one the checkpoint
    was started with (Z10): the batch would store sessions the stream's split or merge, each
    side retracting the other's.

    Raises:
        ConfigError: another sessionizer home, other topics, or another gap.
    """
    path = config.warehouse / STREAM_SETTINGS_FILE
    if path.exists():  # else no sessionizer has run on this warehouse
        recorded = _noted_stream(path)
        _refuse_another_home(config, recorded, path)
        _refuse_other_topics(config, recorded, path)
    checkpoint = config.checkpoint_path(JOB)
    settings = checkpoint / SETTINGS_FILE
    if settings.exists() and _planned_a_batch(checkpoint):
        _refuse_another_gap(checkpoint, json.loads(settings.read_text())["session_gap_ms"],
                            config, "sessions computed with another gap than the stream's "
                            "would split or merge the stream's")


def _noted_stream(path: Path) -> dict[str, str]:
    """The note ``record_stream_settings`` wrote (Z17); written whole, so a note that does
    not read was edited by hand."""
    def edited(read: object) -> errors.ConfigError:
        return errors.ConfigError(
            f"{path} is not the note a sessionizer writes (read: {read!r:.200}); each "
            "sessionizer start writes it whole, so it was edited by hand. Start the "
            "sessionizer once to write it again, or remove it if no sessionizer runs on this "
            "warehouse")

    try:
        recorded = json.loads(path.read_text())
    except ValueError as error:
        raise edited(error) from error
    if not (isinstance(recorded, dict) and {"checkpoint", "home"} <= recorded.keys()):
        raise edited(recorded)
    return recorded


def _refuse_another_home(config: Config, recorded: dict[str, str], path: Path) -> None:
    """(Z17) A run with another home sees no sessionizer: it would leave no session to the
    stream and could store what the stream still holds a second time."""
    if Path(recorded["checkpoint"]) == config.checkpoint_path(JOB).resolve():
        return
    home = ENV_NAMES["home"]
    raise errors.ConfigError(
        f"the sessionizer of warehouse {config.warehouse} runs on the checkpoint "
        f"{recorded['checkpoint']} ({home}={recorded['home']}), but this run's {home} is "
        f"{config.home}, where it would find no sessionizer: it would leave no open session "
        f"to the stream and could store what the stream still holds a second time. Run it "
        f"with {home}={recorded['home']}. If that sessionizer is gone for good (its "
        f"checkpoint moved away or deleted), start the sessionizer with this home once, or "
        f"remove {path}")


def _refuse_other_topics(config: Config, recorded: dict[str, str], path: Path) -> None:
    """(Z17) Corrections published to another topic than the stream's sessions never reach
    the readers of the stream's: its compacted view and the table part for good."""
    for field_name in ("sessions_topic", "attributions_topic"):
        theirs, ours = recorded.get(field_name), getattr(config, field_name)
        if theirs is None or theirs == ours:
            continue
        variable = ENV_NAMES[field_name]
        raise errors.ConfigError(
            f"the sessionizer of warehouse {config.warehouse} publishes to topic {theirs!r}, "
            f"but this run would publish its corrections to {ours!r} ({variable}): readers "
            f"of {theirs!r} would never see them, and the topic would no longer mirror the "
            f"table. Run it with {variable}={theirs}; to move to the new topic, start the "
            f"sessionizer with it once (or remove {path} if that sessionizer is gone for "
            "good)")


def _refuse_another_gap(checkpoint: Path, recorded_ms: int, config: Config, why: str) -> None:
    if recorded_ms == config.session_gap_ms:
        return
    raise errors.ConfigError(
        f"the session gap is {_minutes(config.session_gap_ms)} "
        f"({ENV_NAMES['session_gap_minutes']} or --session-gap) but the sessionizer's "
        f"checkpoint {checkpoint} was started with {_minutes(recorded_ms)}: {why}. Set the gap "
        f"back to {_minutes(recorded_ms)}, or, to change it: stop the sessionizer, move the "
        "checkpoint folder away (or use a new CLICKSTREAM_HOME), start the sessionizer "
        "again and run `clickstream recompute --full --client C` for every client (a "
        "new checkpoint reads the topic from its start: see README, Known limits)")


def _planned_a_batch(checkpoint: Path) -> bool:
    return last_logged_batch(checkpoint, "offsets") >= 0


def checkpoint_query_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "metadata").read_text())["id"]


def _stored_where(tables: DeltaTables, spec: TableSpec, late: DataFrame,
                  columns: list[str]) -> DataFrame | None:
    """The stored ``client_id`` and ``columns`` of the (client, day) partitions of ``late``;
    None if none."""
    if not tables.exists(spec.name):
        return None
    parts = late.select("client_id", "event_date").distinct().collect()
    if not parts:
        return None
    return tables.read(
        spec.name, [*columns, "client_id", "event_date"],
        partition_filter={"client_id": sorted({p.client_id for p in parts}),
                          "event_date": sorted({p.event_date for p in parts})},
    ).select("client_id", *columns)


def _late_anti_join(tables: DeltaTables, spec: TableSpec, late: DataFrame, key: str) -> DataFrame:
    """Drop late rows already stored (Z2), reading only their (client, day) partitions."""
    stored = _stored_where(tables, spec, late, [key])
    return late if stored is None else late.join(stored, on=["client_id", key], how="left_anti")


# The records the sink stores in a table of their own: (event type, key, table, the order
# that picks one of an id's copies: semantics E6, Z12).
RECORD_TABLES = ((contract.PAGEVIEW, "event_id", PAGEVIEWS, PAGEVIEW_COPY_ORDER),
                 (contract.ORDER, "order_id", ORDERS, ORDER_COPY_ORDER))


def _not_stored_by_another_delivery(tables: DeltaTables, late: Mapping[str, DataFrame],
                                    deliveries: DataFrame) -> DataFrame:
    """The late records (``late``: one of each id, by event type) minus those a delivery
    outside ``deliveries`` (every late copy the micro-batch holds) stored (Z8). Any copy's: an
    earlier attempt of the batch may have kept another copy of an id than this one (Z12)."""
    kept = []
    for kind, key, spec, _ in RECORD_TABLES:
        if kind not in late:
            continue
        rows = late[kind]
        stored = _stored_where(tables, spec, rows, [key, "source"])
        if stored is not None:
            same = ["client_id", key]  # (Z3)
            own = deliveries.where(F.col("event_type") == kind).select(*same, "source")
            elsewhere = stored.join(own, [*same, "source"], "left_anti")
            rows = rows.join(elsewhere.select(*same), on=same, how="left_anti")
        kept.append(rows)
    return reduce(DataFrame.unionByName, kept)


def _queued_by_backfills(tables: DeltaTables) -> DataFrame | None:
    """(client_id, kind, record_id, user_id, ts) a backfill stored and queued for the stream
    (Z11): where the record is now, and where it moved an order from (C10); None when there
    are none (most micro-batches: their joins and the queue wave are skipped)."""
    if not tables.exists(RECOMPUTE_QUEUE.name):
        return None
    rows = tables.read(RECOMPUTE_QUEUE.name, ["client_id", "kind", "record_id", "user_id", "ts",
                                              "queued_by"]
                       ).where(F.col("queued_by").startswith(BACKFILL_QUEUED_BY)).drop(
        "queued_by")
    return None if rows.isEmpty() else rows


def _moved_by_backfills(copies: DataFrame, backfilled: DataFrame) -> DataFrame:
    """(Z11) The on-time ``copies`` (queue rows' columns) of records a backfill queued, at a
    place (user, time) other than the backfill's: the session state counts them there."""
    ids = ["client_id", "kind", "record_id"]
    return copies.join(F.broadcast(backfilled.select(*ids)), ids, "left_semi").join(
        F.broadcast(backfilled), [*ids, "user_id", "ts"], "left_anti")


def _stop_at_once(stop_now: threading.Event, where: str
                  ) -> Callable[[], StopBeforeMicroBatch | None]:
    """The ``abandon`` of a wait for a backfill's merge: a second signal gives it up (Z13)."""
    def stopping() -> StopBeforeMicroBatch | None:
        if not stop_now.is_set():
            return None
        return StopBeforeMicroBatch("the sessionizer is stopping at once: it gave up waiting for "
                                    f"a backfill's merge {where}")
    return stopping


def records_lock_path(config: Config) -> Path:
    """In the warehouse, as the correction runs' locks."""
    return config.warehouse / LOCKS_FOLDER / "stream-records.lock"


def records_lock(config: Config, on_wait: Callable[[], None] | None = None,
                 abandon: Callable[[], Exception | None] | None = None
                 ) -> AbstractContextManager[None]:
    """Held by a micro-batch from its snapshot of the backfills' queue rows until its records
    are stored, and by a backfill's merge from its read of what is stored to its commit
    (Z14). ``abandon``: see ``locks.exclusive`` (a stop at once, Z13)."""
    return exclusive(records_lock_path(config), on_wait, abandon)


def _shape(df: DataFrame, spec: TableSpec) -> DataFrame:
    return df.select(*(F.col(f.name).cast(f.dataType).alias(f.name) for f in spec.schema.fields))


class MicroBatchWriter:
    """The ``foreachBatch`` sink; one instance per query run."""

    def __init__(self, config: Config, tables: DeltaTables, checkpoint: Path,
                 summary: SessionizeSummary, stop_now: threading.Event | None = None) -> None:
        self.config = config
        self.tables = tables
        self.checkpoint = checkpoint
        self.summary = summary
        self.run_id = uuid.uuid4().hex
        self.history = history_until(checkpoint)  # (Z18)
        self.last_batch: int | None = None  # set by a stop: the last batch it may write (Z13)
        self._started = -1  # the last batch it began writing
        self._bound = threading.Lock()  # between a batch's start and a stop's bound
        self.stop_now = stop_now or threading.Event()  # a second signal: stop at once (Z13)
        self._groups_checked = False  # stale read point groups closed (Z19)
        warm_up(config)  # Great Expectations takes seconds to import; overlap it with Spark

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        with self._bound:
            if self.last_batch is not None and batch_id > self.last_batch:
                raise StopBeforeMicroBatch(
                    f"the sessionizer is stopping: micro-batch {batch_id} was not started, "
                    "nothing of it was written; the next start processes it")
            self._started = batch_id
        started = time.monotonic()
        late_before = checkpoint_watermark_ms(self.checkpoint, batch_id - 1)  # (Z1)
        counts = self.write_micro_batch(batch, batch_id, late_before)
        self.summary.batches += 1
        self.summary.totals.add(counts)
        tick = planned_tick_ms(self.checkpoint, batch_id)
        print(f"sessionize batch {batch_id}: {counts.describe()}"
              f"{self._why_late(late_before, batch_id) if counts.late_records else ''}"
              f"{'' if tick is None else self._clock_moved(tick)} "
              f"({time.monotonic() - started:.1f}s)", flush=True)

    def _clock_moved(self, tick_ms: int) -> str:
        return (f" (no new events for {self.config.idle_clock_after_ms / 1000:g}s or more: "
                f"the quiet stream's clock moved on to {utc_text(tick_ms)}, closing the "
                "sessions it passes in the next micro-batch)")

    def _why_late(self, late_before_ms: int, batch_id: int) -> str:
        """What made records late, for an operator who sees only the count: one producer's
        clock ahead carries the watermark with it (README, CLICKSTREAM_MAX_TS_AHEAD), or the
        quiet stream's clock did (io.stream_clock T4)."""
        why = [f"ts at or before the watermark {utc_text(late_before_ms)}"] * (late_before_ms > 0)
        # The watermark of micro-batch N - 1 (Z1) is what N - 2 and the batches before it
        # saw: a tick among them set it when the watermark is that tick less the delay.
        tick = logged_tick_ms(self.checkpoint, batch_id - 2)
        if why and tick is not None and tick - self.config.watermark_delay_ms == late_before_ms:
            why[0] += (", where the quiet stream's clock moved it "
                       f"({ENV_NAMES['idle_clock_after_minutes']})")
        if self.history:
            why.append("within the history the tables held at start (Z18)")
        return f" (late: {' or '.join(why)})"

    def stop_after(self, planned: int) -> int:
        """Refuse every micro-batch after ``planned`` (the offsets log's last) or after the
        one it began writing, whichever is later; returns that last batch (Z13)."""
        with self._bound:
            self.last_batch = max(planned, self._started)
            return self.last_batch

    def _append(self, spec: TableSpec, df: DataFrame, batch_id: int, app_id: str) -> int:
        """Rows committed (0 when a replayed batch had committed them already)."""
        return self._append_once(spec, df, batch_id, app_id).rows

    def _append_once(self, spec: TableSpec, df: DataFrame, batch_id: int, app_id: str
                     ) -> AppendResult:
        return self.tables.append_once(
            spec.name, _shape(df, spec), app_id=app_id, version=batch_id,
            partition_by=spec.partition_by,
            metadata={"run_id": self.run_id, "cause": f"{JOB} batch {batch_id}"})

    def _stored_attributions(self, emitted: DataFrame) -> DataFrame:
        """The stored rows of the orders of ``emitted`` (the batch's attributions), read from
        their clients' days only (Z16)."""
        keys = emitted.select("client_id", "order_id", "order_date").distinct()
        places = keys.select("client_id", "order_date").distinct().collect()
        return self.tables.read(ATTRIBUTIONS.name, partition_filter={
            "client_id": sorted({p.client_id for p in places}),
            "order_date": sorted({p.order_date for p in places})}).join(
            keys.drop("order_date"), ["client_id", "order_id"], "left_semi")

    def write_micro_batch(self, batch: DataFrame, batch_id: int, late_before: int) -> BatchCounts:
        app_id = f"{JOB}-{checkpoint_query_id(self.checkpoint)}"  # (Z4)
        batch = batch.persist()
        # (Z19) A read point group of every client: it spans clients, and commits its tables
        # one by one. Left open by a failure (replayed at the next start, which closes it).
        if not self._groups_checked:
            for stale in read_point.close_stale_stream_groups(self.config, self.tables, app_id):
                print(f"sessionize: closed the read point group {stale} of a checkpoint "
                      "deleted since (Z19)", flush=True)
            self._groups_checked = True
        opened = read_point.open_group(self.config, self.tables, app_id,
                                       read_point.EVERY_CLIENT)
        try:
            with ExitStack() as records_lock_held:  # (Z14) _write takes it, and lets it go
                counts = self._write(batch, batch_id, app_id, late_before, records_lock_held)
        except StopBeforeMicroBatch:  # raised before this attempt's first commit (Z13)
            if opened:  # else a failed attempt's, which may have committed part of the batch
                read_point.close_group(self.config, self.tables, app_id)
            raise
        finally:
            batch.unpersist()
        read_point.close_group(self.config, self.tables, app_id, stream_watermark_ms=(
            checkpoint_watermark_ms(self.checkpoint, batch_id)))
        return counts

    def _write(self, batch: DataFrame, batch_id: int, app_id: str, late_before_ms: int,
               records_lock_held: ExitStack) -> BatchCounts:
        counts = BatchCounts()
        records = batch.where(F.col("branch") == "record").select("record.*")
        emitted = batch.where(F.col("branch") == "emitted").select("emitted.*")
        is_late = (F.col("ts") <= _ms_to_ts(F.lit(late_before_ms))) | is_history(self.history)
        # The raw_events gate marks offending records as errors: quarantined below, with the
        # failed expectation as the reason, and never stored; the stream goes on.
        # Every Spark job costs a fixed ~0.1-0.3 s here: one job finds which outputs have rows
        # at all, so empty ones cost nothing, and each table costs one write job (Z5). It runs
        # beside the gate's job (Z7).
        checked = _side_by_side(batch.sparkSession, {
            "gate": lambda: gate_raw_events(records, self.config, batch_id=batch_id,
                                            run_id=self.run_id),
            "present": lambda: _outputs_present(records, emitted, is_late)})
        marked, gate = checked["gate"]
        present = checked["present"]
        if marked is not records:  # the gate made errors of some records: count them again
            records = marked
            present = _outputs_present(records, emitted, is_late)
        if gate is not None and (gate.failures or gate.report):
            print(f"  micro-batch {batch_id}: {gate.describe()}", flush=True)
        counts.records = sum(v for k, v in present.items() if k.startswith("record:"))
        counts.late_records = sum(present.get(f"record:{kind}:late", 0)
                                  for kind in (contract.PAGEVIEW, contract.ORDER))
        counts.duplicates = present.get("emitted:duplicate", 0)
        replayed: list[str] = []  # tables an earlier attempt of this micro-batch wrote

        def store(spec: TableSpec, rows: DataFrame) -> int:
            result = self._append_once(spec, rows, batch_id, app_id)
            if not result.committed:
                replayed.append(spec.name)
            return result.rows

        stored: dict[str, Callable[[], int]] = {}  # BatchCounts field -> its write (Z6)
        if present.get("record:error"):
            def quarantine() -> int:
                rows = records.where(F.col("error").isNotNull()).select(
                    "raw", "source", F.col("error").alias("reason"), "client_id",
                    F.current_timestamp().alias("quarantined_at"),
                    F.current_date().alias("quarantine_date"))
                result = self._append_once(QUARANTINE, rows, batch_id, app_id)
                if result.committed:
                    return result.rows
                replayed.append(QUARANTINE.name)
                return quarantine_once(  # (Z21)
                    self.tables, _shape(rows, QUARANTINE), app_id=f"{app_id}-replay-{batch_id}",
                    after_an_attempt=True, metadata={
                        "run_id": self.run_id,
                        "cause": f"{JOB} batch {batch_id}, replayed (Z21)"})

            stored["quarantined"] = quarantine

        valid = records.where(F.col("error").isNull()).withColumn(
            "event_date", F.to_date("ts"))
        duplicates = emitted.where(F.col("kind") == "duplicate")
        # (Z14) From the read of the backfills' queue rows until the records' wave committed,
        # not before: the gate's and the counts' jobs above did the micro-batch's work (the
        # source, the session state) without holding a backfill's merge back.
        records_lock_held.enter_context(records_lock(self.config, on_wait=lambda: print(
            f"  micro-batch {batch_id}: waiting for a backfill's merge to commit "
            f"({records_lock_path(self.config)}) ...", flush=True), abandon=_stop_at_once(
            self.stop_now, f"in micro-batch {batch_id}, which wrote nothing; the next start "
            "processes it")))
        # (Z11) One snapshot: the delta-rs engine's read lists the version's files now, so the
        # records' wave and the attributions below see the same queue even if a recompute
        # dequeues in between. (delta-spark's unpinned read may take a later version at each
        # job, unverified here: the attributions may then leave out orders queued since, which
        # the recompute that folds those rows in attributes.)
        backfilled = _queued_by_backfills(self.tables)

        # (Z12) The copy of each id the state counts: stored, and queued when late.
        kept = {kind: _first_copies(valid.where(F.col("event_type") == kind), key, order,
                                    is_late)
                for kind, key, _, order in RECORD_TABLES}

        def counted_on_time(kind: str, key: str) -> DataFrame:
            """The on-time copies the state counted: not its retries of ids it held (Z3)."""
            on_time = kept[kind].where(~is_late)
            if counts.duplicates:  # (Z3) this type's ids only: ids of types may be equal
                held = duplicates.where(F.col("record_type") == kind).select(
                    "client_id", F.col("record_id").alias(key))
                on_time = on_time.join(held, ["client_id", key], "left_anti")
            return on_time

        def on_time_and_late(kind: str, key: str, spec: TableSpec) -> int:
            rows = kept[kind]
            parts = []
            if present.get(f"record:{kind}"):
                on_time = counted_on_time(kind, key)
                if backfilled is not None:  # (Z11)
                    stored_by_backfill = backfilled.where(F.col("kind") == kind).select(
                        "client_id", F.col("record_id").alias(key))
                    on_time = on_time.join(F.broadcast(stored_by_backfill), ["client_id", key],
                                           "left_anti")
                parts.append(on_time)
            if present.get(f"record:{kind}:late"):
                parts.append(_late_anti_join(self.tables, spec, rows.where(is_late), key))
            both = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
            return store(spec, both)

        for kind, key, spec, _ in RECORD_TABLES:
            if present.get(f"record:{kind}") or present.get(f"record:{kind}:late"):
                stored[spec.name] = partial(on_time_and_late, kind, key, spec)

        if present.get("record:other") or present.get("record:other:late"):
            others = valid.where(~F.col("event_type").isin(contract.PAGEVIEW, contract.ORDER))
            stored["other_events"] = lambda: store(
                OTHER_EVENTS, _late_anti_join(self.tables, OTHER_EVENTS,
                                              others.dropDuplicates(["client_id", "event_id"]),
                                              "event_id"))

        # A wave of its own after the records' (Z9): what it queues is already stored.
        queued: dict[str, Callable[[], int]] = {}
        late_kinds = {kind for kind, *_ in RECORD_TABLES if present.get(f"record:{kind}:late")}
        on_time_kinds = {kind: key for kind, key, *_ in RECORD_TABLES
                         if present.get(f"record:{kind}")}

        def as_queue_rows(rows: DataFrame, queued_by: str) -> DataFrame:
            return rows.select(
                "client_id", "user_id", F.col("event_type").alias("kind"),
                F.when(F.col("event_type") == contract.ORDER, F.col("order_id"))
                .otherwise(F.col("event_id")).alias("record_id"),
                "ts", F.lit(queued_by).alias("queued_by"), "event_date",
            ).dropDuplicates(["client_id", "kind", "record_id"])

        if late_kinds or (on_time_kinds and backfilled is not None):
            def queue_late() -> int:
                parts = []
                if late_kinds:
                    late = {kind: kept[kind].where(is_late) for kind in late_kinds}
                    parts.append(as_queue_rows(_not_stored_by_another_delivery(
                        self.tables, late, valid.where(is_late)), f"{JOB} batch {batch_id}"))
                if on_time_kinds and backfilled is not None:  # (Z11) their places
                    moved = _moved_by_backfills(as_queue_rows(reduce(
                        DataFrame.unionByName, (counted_on_time(kind, key)
                                                for kind, key in on_time_kinds.items())),
                        f"{JOB} batch {batch_id}{MOVED_AWAY}"), backfilled)
                    if parts or not moved.isEmpty():  # no empty commit per micro-batch
                        parts.append(moved)
                if not parts:
                    return 0
                return self._append(RECOMPUTE_QUEUE, reduce(DataFrame.unionByName, parts),
                                    batch_id, app_id)

            queued["late_queued"] = queue_late

        sessions = emitted.where(F.col("kind") == "session").select(
            "session_id", "client_id", "user_id",
            _ms_to_ts("start_ms").alias("session_start"),
            _ms_to_ts("end_ms").alias("session_end"), "pageview_count", "landing_url",
            "exit_url", "order_count", amount_from_e4("revenue_e4").alias("revenue"),
            F.lit(1).alias("revision"), F.to_date(_ms_to_ts("start_ms")).alias("session_date"),
        )
        attributions = emitted.where(F.col("kind") == "attribution").select(
            F.col("record_id").alias("order_id"), "client_id", "user_id",
            _ms_to_ts("record_ts_ms").alias("order_ts"), "session_id",
            F.lit(1).alias("revision"), F.to_date(_ms_to_ts("record_ts_ms")).alias("order_date"),
        )
        all_attributions = attributions  # a replay's published rows are found by these (Z16)
        if backfilled is not None:  # (Z11) the recompute attributes these orders
            attributions = attributions.join(F.broadcast(backfilled.where(
                F.col("kind") == contract.ORDER).select(
                "client_id", F.col("record_id").alias("order_id"))), ["client_id", "order_id"],
                "left_anti")

        def table_then_topic(spec: TableSpec, rows: DataFrame,
                             publish: Callable[[Config, DataFrame], int],
                             replayed_from: DataFrame | None = None) -> int:
            # The topic after its table, and decided by what the batch holds, not by what this
            # attempt committed: a crash before the publish replays the batch, which commits
            # nothing new but re-publishes the same keys at the same revisions (idempotent for
            # a compacted reader). One partition: the publish streams partitions to the driver
            # one Spark job each, and the persisted batch has one per branch task, most of
            # them empty here (~0.1 s a job, sequential); a micro-batch's output fits one.
            result = self._append_once(spec, rows, batch_id, app_id)
            if not result.committed and replayed_from is not None:  # (Z16)
                rows = self._stored_attributions(replayed_from)
            publish(self.config, _shape(rows, spec).coalesce(1))
            return result.rows

        derived: dict[str, Callable[[], int]] = {}
        if present.get("emitted:session"):
            derived["sessions"] = partial(table_then_topic, SESSIONS, sessions, publish_sessions)
        if present.get("emitted:attribution"):
            derived["attributions"] = partial(table_then_topic, ATTRIBUTIONS, attributions,
                                              publish_attributions, all_attributions)
        for wave in (stored, queued, derived):  # (Z6, Z9)
            for field_name, rows in _side_by_side(batch.sparkSession, wave).items():
                setattr(counts, field_name, rows)
            if wave is stored:
                records_lock_held.close()  # (Z14)
                if not replayed:  # every record stored, quarantined or dropped as a copy:
                    # also copies within the micro-batch, late copies of stored records and
                    # records a backfill stored (Z3, Z11), which the state never sees
                    counts.duplicates = counts.records - sum(
                        getattr(counts, name) for name in stored)
        return counts


def _side_by_side(spark: SparkSession, writes: Mapping[str, Callable[[], T]]) -> dict[str, T]:
    """Run every write (or job) at once, one thread each; wait for all, then raise the first
    failure (Z6, Z7), the others' reasons added to it as notes (its trace shows them). The
    threads inherit the batch's Spark local properties and tags."""
    if len(writes) < 2:
        return {name: write() for name, write in writes.items()}
    with ThreadPoolExecutor(max_workers=len(writes), thread_name_prefix="sink") as pool:
        futures = {name: pool.submit(inheritable_thread_target(spark)(write))
                   for name, write in writes.items()}
    failures = [(name, error) for name, future in futures.items()
                if (error := future.exception()) is not None]
    if failures:
        first = failures[0][1]
        for name, error in failures[1:]:
            first.add_note(f"{name} failed as well: {errors.error_line(str(error))}")
        raise first
    return {name: future.result() for name, future in futures.items()}


def _outputs_present(records: DataFrame, emitted: DataFrame, is_late: Column) -> dict[str, int]:
    """Rows per output of one micro-batch, in one Spark job: ``record:error``,
    ``record:<event type>[:late]`` (``other`` for the rest), ``emitted:<kind>``."""
    event = (F.when(F.col("event_type").isin(contract.PAGEVIEW, contract.ORDER),
                    F.col("event_type")).otherwise(F.lit("other")))
    record_output = F.when(F.col("error").isNotNull(), F.lit("record:error")).otherwise(
        F.concat(F.lit("record:"), event,
                 F.when(is_late, F.lit(":late")).otherwise(F.lit(""))))
    outputs = records.select(record_output.alias("output")).unionByName(
        emitted.select(F.concat(F.lit("emitted:"), F.col("kind")).alias("output")))
    return {r.output: r["count"] for r in outputs.groupBy("output").count().collect()}


def _reraise_product_error(error: Exception, checkpoint: Path) -> None:
    """Surface our own error (raised in the source or a task) instead of Spark's wrapper, or
    the Python error under Spark's wrapper. A data loss names the checkpoint: its remedies
    (start on a new checkpoint, or skip) are about that folder."""
    carried = errors.carried_error(error)
    if carried is not None:
        message = str(carried)
        if isinstance(carried, errors.DataLossError):
            message += f" (the sessionizer's checkpoint: {checkpoint})"
        elif isinstance(carried, errors.RevenueOverflowError):  # the state holds its orders
            message += ("; the sessionizer's state holds those orders, so it stops so again "
                        "at every restart (README, Known limits: a new checkpoint)")
        raise type(carried)(message) from None
    cause = errors.error_line(str(error))
    raise errors.QueryFailedError(
        f"the sessionizer query failed: {cause}; it resumes from its checkpoint when restarted"
    ) from error


class StopBeforeMicroBatch(RuntimeError):
    """Raised by the writer for a micro-batch planned after a stop was asked (Z13)."""


@dataclass
class _Stop:
    asked: threading.Event = field(default_factory=threading.Event)
    now: threading.Event = field(default_factory=threading.Event)
    signal: int | None = None  # the first one


@contextmanager
def _stop_on_signal(stop: _Stop) -> Iterator[None]:
    """The first SIGTERM / SIGINT asks for a stop after the planned micro-batches, a second
    one for a stop at once (Z13)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        stop.signal = stop.signal or signum
        (stop.now if stop.asked.is_set() else stop.asked).set()

    if threading.current_thread() is threading.main_thread():
        for sig in previous:
            signal.signal(sig, handler)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, old in previous.items():
                signal.signal(sig, old)


def sessionizer_lock_path(config: Config) -> Path:
    """Beside the checkpoint folder (Z15): moving that folder away does not free it."""
    checkpoint = config.checkpoint_path(JOB)
    return checkpoint.with_name(f"{checkpoint.name}.lock")


def warehouse_sessionizer_lock_path(config: Config) -> Path:
    """In the warehouse, as the correction runs' locks: one sessionizer per warehouse (Z15)."""
    return warehouse_sessionizer_lock(config.warehouse)


SESSIONIZER_ROLE = "a sessionizer"  # written into its locks (``locks.Holder``)


@contextmanager
def sessionizer_lock(config: Config) -> Iterator[None]:
    """Held for a whole run; a second run on the checkpoint, or on the warehouse with another
    checkpoint, is refused at once (Z15)."""
    checkpoint = config.checkpoint_path(JOB)
    let_it_run = ("Stop that one first, or let it run: the `sessionizer` DAG starts one "
                  "whenever it is unpaused, and `--until-caught-up` ends once it caught up")

    def refuse(holder: Holder) -> errors.ClickstreamError:
        return errors.ClickstreamError(
            f"another sessionizer (pid {holder.pid}) is running on the checkpoint {checkpoint} "
            f"(it holds {sessionizer_lock_path(config)}): two would run the same micro-batches "
            f"at once. {let_it_run}")

    def refuse_beside(holder: Holder) -> errors.ClickstreamError:
        if holder.role not in (None, SESSIONIZER_ROLE):  # `republish`, which also takes it
            return errors.ClickstreamError(
                f"{holder} holds {warehouse_sessionizer_lock_path(config)}: it publishes the "
                f"warehouse {config.warehouse}'s tables to their topics, and the stream's "
                "sessions published beside it could be overtaken by older revisions; start "
                "the sessionizer once it has ended")
        noted = config.warehouse / STREAM_SETTINGS_FILE  # the running one's (Z17)
        theirs = (f" on the checkpoint {_noted_stream(noted)['checkpoint']}"
                  if noted.exists() else "")
        return errors.ClickstreamError(
            f"another sessionizer (pid {holder.pid}) is running{theirs} into the warehouse "
            f"{config.warehouse} (it holds {warehouse_sessionizer_lock_path(config)}): this "
            f"one, on the checkpoint {checkpoint}, would sessionize the same events into the "
            f"same tables and topics beside it. {let_it_run}. To move the stream to this "
            f"{ENV_NAMES['home']}, stop that one first (a new checkpoint reads the events "
            "topic from its start: README, Known limits)")

    with (exclusive_or_refuse(sessionizer_lock_path(config), refuse, SESSIONIZER_ROLE),
          exclusive_or_refuse(warehouse_sessionizer_lock_path(config), refuse_beside,
                              SESSIONIZER_ROLE)):
        yield


def run_sessionizer(
    config: Config, *, until_caught_up: bool = False, spark: SparkSession | None = None
) -> SessionizeSummary:
    """Run the streaming sessionizer until stopped (SIGTERM/SIGINT) or, with
    ``until_caught_up``, until everything available at start is processed and committed."""
    # Kafka missing fails here, in one line, before Spark starts and its read tasks retry; so
    # does a changelog topic that is not the log the tables were published to: the stream
    # would publish its own sessions only to a topic that lost the others.
    topic_watermarks(config, config.events_topic)
    check_changelogs_answer(config)
    _check_events_log(config)
    with sessionizer_lock(config):  # (Z15)
        return _run_sessionizer(config, until_caught_up, spark)


def _check_events_log(config: Config) -> None:
    """(``kafka_source`` K7) Fail if the events topic is not the log the checkpoint's offsets
    were read from (the embedded broker restarted empty), before Spark starts: the source
    finds it too, but only once the query ran, ~15 s in, after Spark's own error log and a
    Java and a Python traceback. (Spark's native source records no topic id: not checked.)"""
    progress = checkpoint_progress(config.checkpoint_path(JOB), config.events_topic)
    if progress is not None and progress.topic_id is not None:
        check_same_log(config.events_topic, progress.topic_id,
                       topic_id(config, config.events_topic))


def _run_sessionizer(config: Config, until_caught_up: bool, spark: SparkSession | None
                     ) -> SessionizeSummary:
    checkpoint = config.checkpoint_path(JOB)
    pin_session_settings(checkpoint, config)  # (Z10)
    record_stream_settings(config)  # (Z17)
    spark = spark or build_spark(config, "clickstream-sessionize", long_running=True)
    tables = open_tables(config, spark)
    print(f"sessionize: {config.events_topic} -> {config.warehouse}, checkpoint {checkpoint}, "
          f"driver heap {driver_heap_mib(spark)} MiB", flush=True)
    checkpoint.mkdir(parents=True, exist_ok=True)
    summary = SessionizeSummary()
    started = time.monotonic()
    stop = _Stop()
    try:
        with _stop_on_signal(stop):
            pin_history(checkpoint, config, tables, stop.now)  # (Z18)
            if stop.asked.is_set():  # while it pinned: nothing is planned, start none (Z13)
                print("sessionize: stopped before its first micro-batch", flush=True)
                return summary
            writer = MicroBatchWriter(config, tables, checkpoint, summary, stop.now)
            query = _start_query(spark, config, writer, checkpoint, until_caught_up)
            while query.isActive and not stop.asked.is_set():
                query.awaitTermination(1.0)
            if stop.asked.is_set():
                _stop_after_planned_micro_batches(query, writer, checkpoint, stop.now)
        query.awaitTermination()
    except StopBeforeMicroBatch as stopped:  # the pin gave up its wait (Z13)
        print(f"sessionize: stopped: {stopped}", flush=True)
    except StreamingQueryException as error:
        if not (stop.asked.is_set() and StopBeforeMicroBatch.__name__ in str(error)):
            _reraise_product_error(error, checkpoint)
    finally:
        summary.seconds = time.monotonic() - started
        summary.stopped_by = stop.signal
    return summary


def _start_query(spark: SparkSession, config: Config, writer: MicroBatchWriter,
                 checkpoint: Path, until_caught_up: bool) -> StreamingQuery:
    stream = (build_stream(spark, config, history=writer.history).writeStream
              .foreachBatch(writer).queryName(JOB)
              .option("checkpointLocation", str(checkpoint)))
    if until_caught_up:
        return stream.trigger(availableNow=True).start()
    return stream.trigger(processingTime=f"{config.trigger_interval_seconds} seconds").start()


def _stop_after_planned_micro_batches(query: StreamingQuery, writer: MicroBatchWriter,
                                      checkpoint: Path, now: threading.Event) -> None:
    """Let the micro-batches planned so far commit, then stop the query (Z13)."""
    last = writer.stop_after(last_logged_batch(checkpoint, "offsets"))
    if last > last_logged_batch(checkpoint, "commits"):
        print(f"sessionize: stopping after micro-batch {last} (signal again to stop at once)",
              flush=True)
    while (query.isActive and not now.is_set()
           and last_logged_batch(checkpoint, "commits") < last):
        now.wait(0.2)
    query.stop()
    committed = last_logged_batch(checkpoint, "commits")
    print("sessionize: stopped; " + (f"micro-batches up to {committed} are committed"
                                     if committed >= 0 else "no micro-batch committed yet"),
          flush=True)
