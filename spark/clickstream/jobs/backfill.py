"""``clickstream backfill``: merge a late historical batch, correct only what it affects.

validate -> quarantine bad rows -> merge into ``pageviews`` / ``orders`` exactly once ->
recompute the affected sessions and attributions -> record ``corrections`` -> apply ->
republish to Kafka. The run id is derived from (kind, client, the batch's files), so rerunning
the same batch after any crash resumes it, and rerunning it after success changes nothing.

Delivery guarantee: exactly once into the tables (pageviews insert-only by event_id, orders
upserted by order_id only when changed, every write under the run's application transaction);
Kafka corrections at least once, idempotent by key and revision. A run stopped after
queueing rows ahead of its merge must be rerun (``queue_ahead_of_the_merge``).
"""

from __future__ import annotations

import functools
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream.config import Config
from clickstream.errors import BatchRefusedError, noted_on
from clickstream.events import contract
from clickstream.io import read_point
from clickstream.io.delta_tables import DeltaTables, open_tables
from clickstream.io.kafka_changelog import check_changelogs_answer
from clickstream.jobs.batch_input import (
    KEY,
    BatchFiles,
    BatchKind,
    list_batch_files,
    read_batch,
    valid_rows,
    validate_batch,
)
from clickstream.jobs.corrections import (
    CorrectionSummary,
    Defer,
    Run,
    Snapshot,
    correct,
    landing_scope,
    old_places,
    stored_elsewhere,
    where_attributed,
)
from clickstream.jobs.sessionize import check_stream_settings, records_lock, stream_watermark_ms
from clickstream.quality.checks import (
    backfill_app_id,
    merged_source,
    quarantined_source_prefix,
    run_commit_version,
)
from clickstream.quality.gates import (
    GateResult,
    gate_historical_batch,
    gate_tables_after_merge,
    warm_up,
)
from clickstream.quality.gates import enabled as gates_enabled
from clickstream.quality.quarantine import quarantine_once
from clickstream.quality.run_summary import failure_line, write_failure_safely, write_run_summary
from clickstream.spark_session import build_spark, keep, release, releases_cache
from clickstream.tables import (
    BACKFILL_QUEUED_BY,
    MOVED_AWAY,
    ORDERS,
    PAGEVIEWS,
    RECOMPUTE_QUEUE,
)

RUN_STEPS = ("validate", "merge", "recompute and publish")
"""The steps of ``run_backfill``, in order (the DAG's are finer: ``backfill_steps.STEPS``)."""


def check_client_id(client_id: str) -> None:
    """Refuses a client id no table could hold (``contract.client_id_problem``): the CLI and
    the DAG's form check it too, but a step may be called with any text."""
    problem = contract.client_id_problem(client_id)
    if problem is not None:
        raise BatchRefusedError(f"client id {client_id[:80]!r} is refused: {problem}")


def backfill_run_id(kind: str, client_id: str, files: BatchFiles) -> str:
    """A batch's run id, the same for ``run_backfill`` and the DAG's steps (``backfill_steps``
    S2): rerunning the batch either way resumes or changes nothing."""
    return f"{kind}-{client_id}-{files.fingerprint}"


@dataclass
class BackfillSummary:
    """The end-of-run report of one backfill."""

    run_id: str
    rows_read: int = 0
    rows_merged: int = 0
    duplicates_skipped: int = 0
    quarantined: int = 0
    first_reasons: tuple[str, ...] = ()
    corrections: CorrectionSummary = field(default_factory=CorrectionSummary)
    seconds_by_step: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[tuple[str, str]]:
        """(step, what it did) per step done, for the run's summary page."""
        done = {
            "validate": f"{self.rows_read} rows read, {self.quarantined} quarantined"
                        + quarantine_reasons(self.run_id, self.first_reasons),
            "merge": f"{self.rows_merged} merged, {self.duplicates_skipped} duplicates skipped",
            "recompute and publish": self.corrections.describe()}
        return [(step, f"{done[step]} ({self.seconds_by_step[step]:.1f}s)") for step in RUN_STEPS
                if step in self.seconds_by_step]

    def describe(self) -> str:
        steps = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds_by_step.items())
        return (f"backfill {self.run_id}: {self.rows_read} rows read, {self.rows_merged} merged, "
                f"{self.duplicates_skipped} duplicates skipped, {self.quarantined} quarantined; "
                f"{self.corrections.describe()}; {steps}")


def _stored(tables: DeltaTables, spec, client_id: str, dates: list) -> DataFrame | None:
    if not tables.exists(spec.name) or not dates:
        return None
    return tables.read(spec.name, partition_filter={"client_id": client_id,
                                                    "event_date": dates})


# Batch-sized frames (the batch's rows, the rows merged, the client's orders) are persisted,
# not kept with ``spark_session.keep``: Spark caches a persisted frame as compressed columns,
# a kept one as rows. For a year of pageviews (10.5M rows), checking the batch took 202 s
# with them kept against 170 s persisted. Smaller frames (the scope, the moved orders, the
# corrections' steps) are kept (BENCHMARKS.md, session 35). The valid rows are a filter of
# the persisted batch and are not persisted again: for a year of pageviews that second copy
# took 35-40 s to build and saved the merge ~8 s (BENCHMARKS.md, session 41).


def merge_pageviews(tables: DeltaTables, valid: DataFrame, client_id: str, run_id: str,
                    dates: list) -> int:
    """Insert pageviews whose event_id is not stored yet; returns how many."""
    rows = valid.select("event_id", "client_id", "user_id", "ts", "url", "referrer",
                        F.lit(merged_source(run_id)).alias("source"),
                        F.to_date("ts").alias("event_date"))
    stored = _stored(tables, PAGEVIEWS, client_id, dates)
    if stored is not None:
        rows = rows.join(stored.select("event_id"), "event_id", "left_anti")
    rows = rows.persist()  # batch-sized: persisted, see above
    count = rows.count()
    if count:
        tables.append_once(PAGEVIEWS.name, rows, app_id=backfill_app_id(run_id), version=1,
                           partition_by=PAGEVIEWS.partition_by,
                           metadata=_merge_metadata(run_id, count))
    release(rows)
    return count


def merge_orders(tables: DeltaTables, valid: DataFrame, client_id: str, run_id: str) -> int:
    """Upsert orders that are new or differ from the stored version; returns how many.

    A merge of no row is committed too (no files, the run's transaction), when the table
    exists: a run is merged once (``merged_earlier``), and one that found all its orders
    stored, rerun after a later batch updated them, took those updates back. (Pageviews are
    only ever inserted: a rerun cannot undo anything there.)"""
    rows = valid.select("order_id", "client_id", "user_id", "ts", "amount", "currency",
                        F.lit(None).cast("string").alias("event_id"),
                        F.lit(merged_source(run_id)).alias("source"),
                        F.to_date("ts").alias("event_date"))
    if tables.exists(ORDERS.name):
        stored = tables.read(ORDERS.name, partition_filter={"client_id": client_id})
        same = ["order_id", "client_id", "user_id", "ts", "amount", "currency"]
        rows = rows.join(stored.select(*same), same, "left_anti")
    rows = rows.persist()  # batch-sized: persisted, see above
    count = rows.count()
    if count or tables.exists(ORDERS.name):
        tables.upsert(ORDERS.name, rows, keys=["order_id"], partition_by=ORDERS.partition_by,
                      partition_filter={"client_id": client_id},
                      app_id=backfill_app_id(run_id), version=1,
                      metadata=_merge_metadata(run_id, count))
    release(rows)
    return count


MERGED_ROWS = "merged_rows"  # in the merge commit's metadata: what the run merged


def _merge_metadata(run_id: str, rows: int) -> dict[str, object]:
    return {"run_id": run_id, "cause": f"backfill {run_id}", MERGED_ROWS: rows}


def merged_earlier(tables: DeltaTables, kind: BatchKind, run_id: str) -> int | None:
    """Rows an earlier attempt of the run merged (its merge committed: a step retried after
    its commit, or a batch rerun), from that commit; None when the run has not merged yet.
    Counted again, they were all stored already: the run would report "0 merged" and the
    DAG would announce no merge (its Asset event lost when the first attempt died after its
    commit)."""
    name = PAGEVIEWS.name if kind == "pageviews" else ORDERS.name
    if not tables.exists(name) or tables.app_version(name, backfill_app_id(run_id)) is None:
        return None
    entry = tables.newest_commit(
        name, lambda e: e.get("run_id") == run_id and e.get(MERGED_ROWS) is not None)
    return None if entry is None else int(entry[MERGED_ROWS])  # None: an older commit


def _version_before_merge(tables: DeltaTables, run_id: str) -> int | None:
    """The ``orders`` table's version just before the run's merge; the current one before
    the run merged (a dry run), or if it merged nothing; None before the table existed."""
    if not tables.exists(ORDERS.name):
        return None
    merged = run_commit_version(tables, ORDERS.name, run_id, app_id=backfill_app_id(run_id))
    if merged is None:
        return tables.version(ORDERS.name)
    return merged - 1 if merged > 0 else None


def moved_stored_orders(tables: DeltaTables, valid: DataFrame, kind: BatchKind,
                        client_id: str, run_id: str) -> DataFrame | None:
    """The batch's orders as they were stored before its merge, where they are no longer:
    (order_id, client_id, user_id, ts) of their previous place (``corrections`` C10); None if
    there are none. Rare, so looked for once, first, and kept (``keep``: the caller
    releases it) for both the scope and the queue: unioned into the scope whether empty or
    not, its reads reshaped the scope's plan and a year of orders took ~7% longer
    (BENCHMARKS.md, session 30)."""
    version = _version_before_merge(tables, run_id) if kind == "orders" else None
    if version is None:
        return None
    moved = keep(stored_elsewhere(tables, client_id, valid, version))
    if moved.isEmpty():
        release(moved)
        return None
    return moved


def scope_of(tables: DeltaTables, valid: DataFrame, kind: BatchKind, client_id: str,
             moved: DataFrame | None) -> DataFrame:
    """Where the batch lands, per user; for orders also where their previous version was
    attributed (an order whose ts changed leaves its old session) or stored before the merge
    (``moved``, from ``moved_stored_orders``: C10), and to which user an order moved from
    there (``corrections`` C9)."""
    if kind != "orders":
        return landing_scope(valid)
    now = valid.select("order_id", "user_id")
    places = [where_attributed(tables, client_id, now)]
    if moved is not None:
        places.append(old_places(moved, "ts", now))
    return landing_scope(valid, *places)


def first_reasons(bad: DataFrame, limit: int = 5) -> tuple[str, ...]:
    """A batch's most frequent quarantine reasons, with their counts, for its summary page."""
    reasons = bad.groupBy("error").count().orderBy(F.desc("count"), "error")
    return tuple(f"{r.error} ({r['count']})" for r in reasons.limit(limit).collect())


def quarantine_location(run_id: str) -> str:
    """Where a run's quarantined rows are, for its summary page (a reviewer had the count
    alone, and had to find the rows in the table)."""
    return f"the rows: `quarantine` where source starts with {quarantined_source_prefix(run_id)!r}"


def quarantine_reasons(run_id: str, reasons: tuple[str, ...]) -> str:
    """Why a run's rows were quarantined, and where they are, for its summary page."""
    if not reasons:
        return ""
    return f" (first reasons: {'; '.join(reasons)}; {quarantine_location(run_id)})"


def quarantine_or_refuse(tables: DeltaTables, batch: DataFrame, gate: GateResult | None,
                         client_id: str, run_id: str, progress: Callable[[str], None]) -> int:
    """Quarantine the batch's rows with an ``error`` once each, then refuse the whole batch
    if its ``historical_batch`` gate failed; when most of its rows are another client's than
    ``client_id``, the error names that client.

    A rerun quarantines only the rows no earlier attempt of the run did: those a validation
    setting changed since (a stricter ``CLICKSTREAM_MAX_TS_AHEAD``) now refuses. Skipping the
    write on a rerun, as before, left such rows out of both their table and ``quarantine``.

    Raises:
        QualityGateFailedError: the gate failed; nothing is merged, the rows are quarantined.
    """
    bad = batch.where(F.col("error").isNotNull())
    quarantined = bad.count()
    if quarantined:
        prefix = quarantined_source_prefix(run_id)
        rows = bad.select(
            "raw", F.concat(F.lit(prefix), "source").alias("source"),
            F.col("error").alias("reason"), "client_id",
            F.current_timestamp().alias("quarantined_at"),
            F.current_date().alias("quarantine_date"))
        quarantine_once(tables, rows, app_id=backfill_app_id(run_id), stored_under=prefix,
                        metadata={"run_id": run_id, "cause": f"backfill {run_id}"})
    if gate is not None:
        progress(f"  {gate.describe()}")
        main_client = gate.checks.get("main_client_id")
        share = gate.checks.get("main_client_fraction") or 0
        other_client = bool(main_client and main_client != client_id and share > 0.5
                            and contract.client_id_problem(main_client) is None)
        # The likely fix first: a batch sent under the wrong --client fails many checks.
        lead = (f"most of the batch's rows ({share:.0%}) are of client {main_client!r}: if "
                f"the batch is that client's, run it with --client {shlex.quote(main_client)} "
                "(the form's Client). " if other_client else "")
        gate.raise_if_failed(f"the batch was refused as a whole: nothing was merged, its "
                             f"{quarantined} rows with problems are in quarantine; "
                             f"{'otherwise ' if other_client else ''}fix the batch and send it "
                             "again", lead=lead)
    return quarantined


def merge_valid_rows(tables: DeltaTables, config: Config, valid: DataFrame, kind: BatchKind,
                     client_id: str, run_id: str, progress: Callable[[str], None],
                     snapshots: dict[str, Snapshot] | None = None) -> int:
    """Merge the batch's valid rows (one per key) exactly once, then check the tables with
    the ``tables_after_merge`` gate; returns the rows the run merged (by this attempt, or by
    an earlier one whose merge committed: ``merged_earlier``).

    ``snapshots``: the correction run's, when it follows in this process. The gate of an
    orders batch reads all of the client's orders; they are then read once, at the merge
    commit, and kept there for the recompute's windows (which would read them again).

    The merge holds the stream's records lock from its read of what is stored to its commit
    (``sessionize`` Z14): a micro-batch stores its records before the merge reads them, or
    reads them after it committed, so no record is stored by both."""
    stream_seen = queue_ahead_of_the_merge(tables, config, valid, kind, client_id, run_id,
                                           progress)
    dates = None
    if kind == "pageviews":
        dates = [r.d for r in valid.select(F.to_date("ts").alias("d")).distinct().collect()]
    with records_lock(config, on_wait=lambda: progress(
            "  waiting for the sessionizer's micro-batch in flight (or another merge) to "
            "store its records ...")):
        # Under the lock: another attempt of the run (the CLI beside the DAG, a retry beside
        # a killed attempt's live child) may have merged while this one waited; read before,
        # this one merged nothing, reported "0 merged" and overwrote the run's count.
        merged = merged_earlier(tables, kind, run_id)
        if merged is None and not stream_seen:  # (Z18) a sessionizer started meanwhile?
            queue_ahead_of_the_merge(tables, config, valid, kind, client_id, run_id, progress)
        if merged is not None:
            progress(f"  merged by an earlier attempt of this run: {merged} rows; nothing "
                     "merged again")
        else:
            merged = _merge_in_group(tables, config, valid, kind, client_id, run_id, dates)
    stored = None
    if kind == "orders" and snapshots is not None and gates_enabled(config):
        version = run_commit_version(tables, ORDERS.name, run_id,
                                     app_id=backfill_app_id(run_id))
        if version is not None:
            # Read here rather than inside the gate, which then times its checks alone (as
            # recomputed_sessions does): for a batch that spans the client's history, as a
            # year of orders does, the recompute's windows would read all these rows anyway.
            stored = Snapshot(version, None, tables.read(
                ORDERS.name, partition_filter={"client_id": client_id}, schema=ORDERS.schema,
                version=version).persist())  # batch-sized: see merge_pageviews
            stored.rows.count()
            snapshots[ORDERS.name] = stored
    gate = gate_tables_after_merge(tables, config, kind=kind, client_id=client_id,
                                   run_id=run_id, valid=valid, dates=dates, stored=stored)
    if gate is not None:
        progress(f"  {gate.describe()}")
    return merged


def _merge_in_group(tables: DeltaTables, config: Config, valid: DataFrame, kind: BatchKind,
                    client_id: str, run_id: str, dates: list | None) -> int:
    """The merge opens the run's read point group: the client is read as it was until the
    run's plan is applied (``read_point``; closed by ``corrections``). A merge that failed
    without committing closes it again."""
    group = backfill_app_id(run_id)  # the correction run's id, which closes it
    read_point.open_group(config, tables, group, client_id)
    try:
        if kind == "pageviews":
            return merge_pageviews(tables, valid, client_id, run_id, dates)
        return merge_orders(tables, valid, client_id, run_id)
    except BaseException as error:
        with noted_on(error, "closing its read point group"):
            if merged_earlier(tables, kind, run_id) is None:
                read_point.close_group(config, tables, group)
        raise


def gate_committed_merge(tables: DeltaTables, config: Config, kind: BatchKind, client_id: str,
                         run_id: str, progress: Callable[[str], None]) -> None:
    """The ``tables_after_merge`` gate of the run's merge committed by an earlier attempt,
    for a retry that can no longer read the batch (its files changed or are gone:
    ``backfill_steps`` S5), with the keys that commit wrote in place of the batch's. A key
    the merge skipped (stored before, unchanged) changes no count either way. Those rows
    are found among all of the client's rows at the commit: a rare path, not a pruned one."""
    spec = PAGEVIEWS if kind == "pageviews" else ORDERS
    version = run_commit_version(tables, spec.name, run_id, app_id=backfill_app_id(run_id))
    if version is None:  # merged nothing: the checks have nothing to reconcile
        return
    written = tables.read(spec.name, [spec.key[0], "ts", "source"], {"client_id": client_id},
                          version=version).where(F.col("source") == merged_source(run_id))
    dates = None
    if kind == "pageviews":
        dates = [r.d for r in written.select(F.to_date("ts").alias("d")).distinct().collect()]
    gate = gate_tables_after_merge(tables, config, kind=kind, client_id=client_id,
                                   run_id=run_id, valid=written, dates=dates)
    if gate is not None:
        progress(f"  {gate.describe()} (with the keys the merge wrote)")


@releases_cache
def run_backfill(
    config: Config, *, kind: BatchKind, client_id: str, path: str,
    spark: SparkSession | None = None, progress: Callable[[str], None] = print,
) -> BackfillSummary:
    """Merge the batch at ``path`` (inside the landing folder) and correct what it affects;
    the run's summary page (``quality.run_summary``) says what it did, or why it failed."""
    check_stream_settings(config)
    check_client_id(client_id)
    files = list_batch_files(config, path)
    summary = BackfillSummary(backfill_run_id(kind, client_id, files))
    page = functools.partial(write_run_summary, config, run_id=summary.run_id,
                             client_id=client_id, kind=kind, root=str(files.root))
    try:
        _merge_and_correct(config, files, kind, client_id, summary, spark, progress)
    except Exception as error:
        failed = next((s for s in RUN_STEPS if s not in summary.seconds_by_step),
                      RUN_STEPS[-1])
        held = read_point.still_holding(config, backfill_app_id(summary.run_id))
        if held:
            progress(f"  {held}")
        write_failure_safely(error, functools.partial(
            page, lines=[*summary.lines(), failure_line(failed, error)], failed=True))
        raise
    _, target = page(lines=summary.lines())
    progress(f"  run summary: {target}")
    return summary


def _merge_and_correct(config: Config, files: BatchFiles, kind: BatchKind, client_id: str,
                       summary: BackfillSummary, spark: SparkSession | None,
                       progress: Callable[[str], None]) -> None:
    run_id = summary.run_id
    spark = spark or build_spark(config, "clickstream-backfill")
    tables = open_tables(config, spark)
    warm_up(config)  # Great Expectations takes seconds to import; overlap it with the reads
    progress(f"backfill {run_id}: {len(files.files)} {files.file_format} files under "
             f"{files.root}")
    if (hidden := files.hidden_line()) is not None:
        progress(f"  {hidden}")

    def start(name: str) -> float:
        progress(f"  {name} ...")  # a long step's liveness lines follow it (cli's heartbeat)
        return time.monotonic()

    def step(name: str, started: float) -> None:
        summary.seconds_by_step[name] = time.monotonic() - started
        progress(f"  {name}: {summary.seconds_by_step[name]:.1f}s")

    started = start("validate")
    raw = read_batch(spark, files, kind)
    # Batch-sized: persisted (see the comment above merge_pageviews).
    batch = validate_batch(raw, kind, client_id, config.max_ts_ahead_ms).persist()
    summary.rows_read = batch.count()
    # The historical_batch gate judges the batch as a whole: it marks the rows it implicates
    # (quarantined below, once) and refuses the batch, after quarantining, when too many are bad.
    validated = batch
    batch, gate = gate_historical_batch(batch, raw.schema, kind=kind, key=KEY[kind],
                                        client_id=client_id, config=config, run_id=run_id)
    summary.quarantined = quarantine_or_refuse(tables, batch, gate, client_id, run_id, progress)
    if summary.quarantined:
        summary.first_reasons = first_reasons(batch.where(F.col("error").isNotNull()))
    valid = valid_rows(batch, kind)  # a filter of the persisted batch: see merge_pageviews
    valid_count = valid.count()
    step("validate", started)
    if valid_count:  # Kafka out of reach fails before the merge, not after it and the plan
        check_changelogs_answer(config)

    started = start("merge")
    run = Run(spark, config, tables, client_id, f"backfill-{run_id}", f"backfill {run_id}",
              progress)
    summary.rows_merged = merge_valid_rows(tables, config, valid, kind, client_id, run_id,
                                           progress, run.snapshots)
    summary.duplicates_skipped = summary.rows_read - summary.quarantined - summary.rows_merged
    step("merge", started)

    started = start("recompute and publish")
    scope = BatchScope(tables, valid, kind, client_id, run_id)
    summary.corrections = correct(run, scope.read, orders_only=kind == "orders",
                                  stream_watermark_ms=stream_watermark_ms(config, client_id),
                                  defer=scope.defer)
    step("recompute and publish", started)
    scope.release()
    release(validated)
    if valid_count == 0:
        progress("  the batch has no valid rows")


def _queue_rows(rows: DataFrame, kind: BatchKind, queued_by: str) -> DataFrame:
    """The batch's ``rows`` as ``recompute_queue`` rows."""
    return rows.select("client_id", "user_id", F.lit(kind.rstrip("s")).alias("kind"),
                       F.col(KEY[kind]).alias("record_id"), "ts",
                       F.lit(queued_by).alias("queued_by"), F.to_date("ts").alias("event_date"))


def queued_by_mark(run_id: str) -> str:
    """``queued_by`` of the run's rows, ahead of the merge or deferred (C4): one mark, so
    that the C4 queueing recognises the rows queued ahead. The stream knows these rows are
    the backfill's to store (``sessionize`` Z11)."""
    return f"{BACKFILL_QUEUED_BY}{run_id}"


def ahead_app_id(run_id: str) -> str:
    return f"backfill-ahead-{run_id}"


def queue_ahead_of_the_merge(tables: DeltaTables, config: Config, valid: DataFrame,
                             kind: BatchKind, client_id: str, run_id: str,
                             progress: Callable[[str], None]) -> bool:
    """Queue the batch's rows the stream could still receive on time, before they are merged
    (``sessionize`` Z11, Z14): the stream stores no on-time copy of a record a backfill
    queued (an on-time row is not compared with what is stored), so the merge is the only
    writer of these records from then on. Only rows after the watermark of the stream's last
    committed micro-batch: any other copy is late for the stream, which compares it with
    what is stored. They are queued as the rows of the users the plan leaves to the stream
    are (C4, whose queue skips them); a row whose user the stream let go meanwhile is folded
    in by the next recompute, which changes nothing once the merge stored it. Killed before
    the merge, the run must be rerun: a copy the stream receives on time meanwhile is in its
    sessions but not in ``pageviews`` / ``orders`` (README, Known limits).

    Before its first micro-batch, a running sessionizer's watermark is what it pinned as
    history (``sessionize`` Z18); with none running, nothing is queued: the next start will
    find the rows stored. Returns whether it found a stream: if not, the merge asks again
    under the records lock."""
    watermark = stream_watermark_ms(config, client_id)
    if watermark is None:  # no stream runs or has run: nothing is on time for it yet
        return False
    ahead = valid.where(F.col("ts") > F.timestamp_millis(F.lit(watermark)))
    queued = tables.append_once(
        RECOMPUTE_QUEUE.name, _queue_rows(ahead, kind, queued_by_mark(run_id)),
        app_id=ahead_app_id(run_id), version=1, partition_by=RECOMPUTE_QUEUE.partition_by,
        metadata={"run_id": run_id, "cause": queued_by_mark(run_id)})
    if queued.rows:
        progress(f"  queued ahead of the merge: {queued.rows} rows the stream could still "
                 "receive on time, whose copies it leaves to this run (if it stops before "
                 "its merge, rerun it)")
    return True


def queue_for_the_stream(tables: DeltaTables, valid: DataFrame, kind: BatchKind,
                         client_id: str, run_id: str, moved: DataFrame | None) -> Defer:
    """How the batch's rows of users the stream still owns go to the recompute queue (C4),
    with the places the batch moved orders away from (``moved``, from
    ``moved_stored_orders``), where the stream may hold them in an open session (C10).

    Each attempt that plans queues the rows no earlier attempt of the run queued: an attempt
    that died before recording its plan is planned again, and by then the stream may own
    more of the batch's users."""
    queued_by = queued_by_mark(run_id)
    app_id = f"backfill-queue-{run_id}"

    def queue(users: DataFrame) -> int:
        rows = _queue_rows(valid.join(users, ["client_id", "user_id"], "left_semi"), kind,
                           queued_by)
        if moved is not None:  # (C10)
            rows = rows.unionByName(_queue_rows(
                moved.join(users, ["client_id", "user_id"], "left_semi"), "orders",
                queued_by + MOVED_AWAY))
        attempt = (tables.app_version(RECOMPUTE_QUEUE.name, app_id) or 0) + 1
        if attempt > 1 or tables.app_version(RECOMPUTE_QUEUE.name, ahead_app_id(run_id)):
            # Not what an earlier attempt, or the queue ahead of the merge, queued. A
            # recompute may have folded some in since: queued again, harmless.
            earlier = tables.read(RECOMPUTE_QUEUE.name, ["kind", "record_id", "queued_by"],
                                  partition_filter={"client_id": client_id})
            rows = rows.join(earlier.where(F.col("queued_by").startswith(queued_by)).select(
                "kind", "record_id", "queued_by"), ["kind", "record_id", "queued_by"],
                "left_anti")
        return tables.append_once(RECOMPUTE_QUEUE.name, rows, app_id=app_id, version=attempt,
                                  partition_by=RECOMPUTE_QUEUE.partition_by,
                                  metadata={"run_id": run_id, "cause": queued_by}).rows

    return queue


class BatchScope:
    """A merged batch's scope (``scope_of``) and its queue for the stream
    (``queue_for_the_stream``), read only when its run plans: after ``resume()`` took the
    plan's step, under the client's lock, so that nothing it reads is older than a plan
    another run recorded (``corrections`` C6); a run that resumes its own plan reads nothing.
    """

    def __init__(self, tables: DeltaTables, valid: DataFrame, kind: BatchKind, client_id: str,
                 run_id: str) -> None:
        self.tables, self.valid, self.kind = tables, valid, kind
        self.client_id, self.run_id = client_id, run_id
        self._moved: DataFrame | None = None

    def read(self) -> DataFrame:
        """The scope, kept: the caller releases it (``corrections.ScopeReader``)."""
        release(self._moved)
        self._moved = moved_stored_orders(self.tables, self.valid, self.kind, self.client_id,
                                          self.run_id)
        return keep(scope_of(self.tables, self.valid, self.kind, self.client_id, self._moved))

    def defer(self, users: DataFrame) -> int:
        """Queue the batch's rows of ``users``, whom the stream holds (``corrections.Defer``);
        returns the rows queued."""
        return queue_for_the_stream(self.tables, self.valid, self.kind, self.client_id,
                                    self.run_id, self._moved)(users)

    def release(self) -> None:
        release(self._moved)
        self._moved = None
