"""The backfill as separate, retryable steps (the ``late_batch_backfill`` DAG's tasks).

``jobs.backfill.run_backfill`` does everything in one call (the CLI). Here each step is its
own function, so Airflow can show, retry and skip them one by one:

    check_batch -> merge_batch -> recompute_affected -> check_applied -> publish_corrections
    -> write_report

``check_batch`` writes nothing: it is the whole of a dry run, and reports what a real run
would change. Results are small JSON-serialisable dicts (Airflow XComs), never DataFrames.

Delivery guarantee: the same as ``run_backfill`` — exactly once into the tables, corrections
to Kafka at least once, idempotent by key and revision.

Known edge cases, cited inline as (S1)..(S8):
  S1. Every step re-reads the batch from the landing folder (the path check included) and
      refuses to continue if its fingerprint is no longer the one ``check_batch`` saw: no step
      ever works on files that changed since they were validated (after the merge, S5).
  S2. Run ids are the ones ``run_backfill`` uses, so a DAG run and a CLI run of the same
      batch are the same run: whichever comes second resumes or changes nothing.
  S3. Every write happens under the run's application transactions, and the recompute's
      plan is stored in ``corrections`` before it is applied, so any step can be retried
      after a crash (or a kill) and resumes instead of doubling.
  S4. ``publish_corrections`` publishes the stored plan only after ``check_applied`` has
      confirmed the tables hold it, so Kafka never announces a revision the tables lack. A
      plan already published (a retried or cleared task, or another run of the client that
      finished it, C6) is not checked again: later runs may have changed or retracted its
      rows since, and it has nothing left to announce.
  S5. Once the run's merge committed, ``recompute_affected`` works from the rows the merge
      wrote (``source`` = ``backfill:<run id>``) if the batch's files changed or are gone
      (a client replacing its upload, removing it once sent): refused (S1) as before the
      merge, the merged rows were never sessionized, and a new run for the files as they now
      are covered only their rows. A ``merge`` step rerun then (its earlier attempt killed
      after the commit, before it saved its result) reports the committed merge from the
      tables (the duplicates it skipped are not known then: counted as none) and runs its
      ``tables_after_merge`` gate with the keys the merge wrote in place of the batch's.
  S6. A writing step runs only once the step before it succeeded for the run (``AFTER``),
      and a step that starts removes its own saved result and those of the steps after it
      (a second round of the run's steps does not lean on the first round's results):
      ``publish`` after a failed ``check-applied`` published a plan the tables did not hold
      and marked it published, so the client's later runs no longer stopped on it;
      ``recompute`` before ``merge`` planned nothing and the run reported success.
  S7. A batch the ``historical_batch`` gate refuses changes ``quarantine`` (its rows with
      problems) although ``merge`` fails: ``quarantined_by_run`` counts them from the table,
      so the DAG announces that change too (it announced nothing: the merge saved no result).
  S8. ``check_applied`` saves the step (``run_seq``) of the plan it checked, and ``publish``
      applies and checks any other plan of the run before publishing it: a CLI run of the
      same batch (S2) between the two could publish the checked plan, plan again (a late
      record had come into the window meanwhile) and stop before applying; ``publish`` sent
      that plan unapplied and marked it published, so the topic stayed ahead of the table
      and no later run finished the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream.atomic_files import write_atomically
from clickstream.config import Config
from clickstream.errors import BatchRefusedError, ConfigError
from clickstream.io import read_point
from clickstream.io.delta_tables import DeltaTables, open_tables
from clickstream.io.kafka_changelog import check_changelogs_answer
from clickstream.jobs.backfill import (
    BatchScope,
    ahead_app_id,
    backfill_run_id,
    check_client_id,
    first_reasons,
    gate_committed_merge,
    merge_valid_rows,
    merged_earlier,
    merged_source,
    quarantine_location,
    quarantine_or_refuse,
)
from clickstream.jobs.batch_input import (
    KEY,
    REQUIRED,
    BatchKind,
    list_batch_files,
    read_batch,
    valid_rows,
    validate_batch,
)
from clickstream.jobs.corrections import (
    PLAN_TABLES,
    CorrectionSummary,
    Run,
    Timer,
    apply,
    check_plan_applied,
    count_earlier_plan,
    grow_windows,
    mark_published,
    one_run_at_a_time,
    plan_left_unpublished,
    plan_scope,
    publish_changes,
    published_through,
    resume,
    stored_plan,
    superseded_by,
    unfinished_plan,
)
from clickstream.jobs.sessionize import check_stream_settings, stream_watermark_ms
from clickstream.progress import Progress
from clickstream.quality import reports
from clickstream.quality.checks import backfill_app_id, quarantined_source_prefix
from clickstream.quality.correction_report import write_correction_report
from clickstream.quality.gates import gate_historical_batch, gate_source_prefix, warm_up
from clickstream.quality.run_summary import (
    failure_line,
    write_failure_safely,
    write_run_summary,
)
from clickstream.spark_session import build_spark, release, releases_cache
from clickstream.tables import ORDERS, PAGEVIEWS, QUARANTINE, RECOMPUTE_QUEUE, SESSIONS

if TYPE_CHECKING:
    from clickstream.quality.gates import GateResult


@dataclass(frozen=True)
class BatchCheck:
    """What ``check_batch`` found, and what a real run would change."""

    run_id: str
    kind: str
    client_id: str
    path: str
    root: str
    file_count: int
    file_format: str
    rows_read: int
    valid_rows: int
    quarantined: int
    first_reasons: tuple[str, ...]
    new_or_changed: int
    users_affected: int
    stored_sessions_in_reach: int
    quality_gate: str = ""

    def describe(self) -> str:
        reasons = "; ".join(self.first_reasons) or "none"
        return (f"batch {self.root} ({self.file_count} {self.file_format} files, run "
                f"{self.run_id}): {self.rows_read} rows, {self.valid_rows} valid, "
                f"{self.quarantined} to quarantine (first reasons: {reasons}); "
                f"{self.new_or_changed} {self.kind} new or changed, "
                f"{self.valid_rows - self.new_or_changed} already stored; "
                f"{self.users_affected} users affected, {self.stored_sessions_in_reach} stored "
                "sessions within one gap to recompute"
                + (f"; {self.quality_gate}" if self.quality_gate else ""))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "first_reasons": list(self.first_reasons)}


@dataclass(frozen=True)
class MergeResult:
    """What ``merge_batch`` wrote."""

    run_id: str
    rows_read: int
    rows_merged: int
    duplicates_skipped: int
    quarantined: int

    def describe(self) -> str:
        return (f"merge {self.run_id}: {self.rows_read} rows read, {self.rows_merged} merged, "
                f"{self.duplicates_skipped} duplicates skipped, {self.quarantined} quarantined")


class _Batch:
    """One batch opened for a step: its files, tables and validated rows (S1)."""

    def __init__(self, config: Config, kind: BatchKind, client_id: str, path: str,
                 spark: SparkSession | None, expected_run_id: str | None) -> None:
        self.files = list_batch_files(config, path)
        self.run_id = backfill_run_id(kind, client_id, self.files)
        if expected_run_id is not None and self.run_id != expected_run_id:
            raise BatchRefusedError(
                f"batch {self.files.root} changed since it was validated (validated as run "
                f"{expected_run_id}, now {self.run_id}); this step wrote nothing. Trigger a new "
                "run for the batch as it is now")
        self.config, self.kind, self.client_id = config, kind, client_id
        self.spark = spark or build_spark(config, "clickstream-backfill")
        self.tables: DeltaTables = open_tables(config, self.spark)
        self._raw = read_batch(self.spark, self.files, kind)
        self.raw_schema = self._raw.schema

    @classmethod
    def as_merged(cls, config: Config, kind: BatchKind, client_id: str, run_id: str,
                  spark: SparkSession | None, refused: BatchRefusedError,
                  progress: Progress) -> _Batch:
        """The run's batch as its merge stored it (S5); ``refused`` is raised again when the
        run has not merged."""
        spark, tables, _ = _committed_merge(config, kind, run_id, spark, refused, progress)
        spec = PAGEVIEWS if kind == "pageviews" else ORDERS
        stored = tables.read(spec.name, partition_filter={"client_id": client_id}).where(
            F.col("source") == merged_source(run_id))
        batch = cls.__new__(cls)
        batch.config, batch.kind, batch.client_id, batch.run_id = config, kind, client_id, run_id
        batch.spark, batch.tables = spark, tables
        batch.rows = stored.select(*REQUIRED[kind], F.lit(None).cast("string").alias("error"),
                                   F.lit(None).cast("int").alias("copies")).persist()
        return batch

    @functools.cached_property
    def rows(self) -> DataFrame:
        """Every row of the batch, validated; read on first use (validating runs a job, and a
        step that resumes its plan reads no row). Batch-sized: persisted, not kept
        (``backfill``, the comment above merge_pageviews)."""
        return validate_batch(self._raw, self.kind, self.client_id,
                              self.config.max_ts_ahead_ms).persist()

    def gate(self) -> GateResult | None:
        """The ``historical_batch`` quality gate (as ``run_backfill`` runs it): marks the rows
        it implicates in ``rows`` and returns its verdict (None when gates are off)."""
        marked, result = gate_historical_batch(
            self.rows, self.raw_schema, kind=self.kind, key=KEY[self.kind],
            client_id=self.client_id, config=self.config, run_id=self.run_id)
        if marked is not self.rows:
            marked = marked.persist()
            release(self.rows)
            self.rows = marked
        return result

    def valid(self) -> DataFrame:
        """The rows a merge takes: a filter of the persisted ``rows``, not persisted again
        (``backfill``, the comment above merge_pageviews)."""
        return valid_rows(self.rows, self.kind)

    def bad(self) -> DataFrame:
        return self.rows.where(F.col("error").isNotNull())

    def correction_run(self, progress: Progress) -> Run:
        return Run(self.spark, self.config, self.tables, self.client_id,
                   f"backfill-{self.run_id}", f"backfill {self.run_id}", progress)

    def close(self) -> None:
        release(self.__dict__.get("rows"))  # None when no row was read


def _would_merge(batch: _Batch, valid: DataFrame) -> int:
    """Rows a merge would write: pageviews not stored yet, orders new or changed."""
    tables, client = batch.tables, batch.client_id
    if batch.kind == "pageviews":
        if not tables.exists(PAGEVIEWS.name):
            return valid.count()
        dates = [r.d for r in valid.select(F.to_date("ts").alias("d")).distinct().collect()]
        if not dates:
            return 0
        stored = tables.read(PAGEVIEWS.name, ["event_id"], {"client_id": client,
                                                            "event_date": dates})
        return valid.join(stored, "event_id", "left_anti").count()
    if not tables.exists(ORDERS.name):
        return valid.count()
    same = ["order_id", "client_id", "user_id", "ts", "amount", "currency"]
    stored = tables.read(ORDERS.name, same, {"client_id": client})
    return valid.select(*same).join(stored, same, "left_anti").count()


@releases_cache
def check_batch(config: Config, *, kind: BatchKind, client_id: str, path: str,
                quality_gate: bool = False, spark: SparkSession | None = None,
                progress: Progress = print) -> BatchCheck:
    """Validate the batch and report what a backfill would change, writing nothing.

    With ``quality_gate`` (a dry run), the ``historical_batch`` gate is run too and its verdict
    reported (its Data Docs page is written); a real run leaves the gate to ``merge_batch``,
    where a failure quarantines the implicated rows and refuses the batch.

    Raises:
        BatchRefusedError: the path is outside the landing folder (the message names it),
            missing, empty, mixes formats, or lacks required columns.
    """
    batch = _Batch(config, kind, client_id, path, spark, None)
    try:
        progress(f"check {batch.run_id}: {len(batch.files.files)} {batch.files.file_format} "
                 f"files under {batch.files.root}")
        verdict = ""
        if quality_gate:
            gate = batch.gate()
            if gate is not None:
                verdict = gate.describe() + ("" if gate.success else
                                             " — a real run would refuse this batch")
        rows_read = batch.rows.count()
        first = first_reasons(batch.bad())
        valid = batch.valid()
        valid_rows = valid.count()
        batch_scope = BatchScope(batch.tables, valid, kind, client_id, batch.run_id)
        scope = batch_scope.read()
        in_reach = 0
        if valid_rows and batch.tables.exists(SESSIONS.name):
            run = batch.correction_run(progress)
            windows, inside = grow_windows(run, scope)
            in_reach = inside.count()
            release(windows, inside)
            run.release_snapshots()
        check = BatchCheck(
            run_id=batch.run_id, kind=kind, client_id=client_id, path=path,
            root=str(batch.files.root), file_count=len(batch.files.files),
            file_format=batch.files.file_format, rows_read=rows_read, valid_rows=valid_rows,
            quarantined=batch.bad().count(),
            first_reasons=first, new_or_changed=_would_merge(batch, valid),
            users_affected=scope.count(), stored_sessions_in_reach=in_reach,
            quality_gate=verdict)
        batch_scope.release()
        release(scope)
        progress(check.describe())
        return check
    finally:
        batch.close()


@releases_cache
def merge_batch(config: Config, *, kind: BatchKind, client_id: str, path: str, run_id: str,
                spark: SparkSession | None = None, progress: Progress = print) -> MergeResult:
    """Quarantine bad rows and merge the rest into ``pageviews`` / ``orders`` exactly once (S3),
    with the ``historical_batch`` gate before and the ``tables_after_merge`` gate after.

    Raises:
        BatchRefusedError: the batch is refused, or changed since ``check_batch`` (S1).
        QualityGateFailedError: a gate failed; before the merge, the implicated rows are
            quarantined and nothing is merged.
    """
    try:
        batch = _Batch(config, kind, client_id, path, spark, run_id)
    except BatchRefusedError as refused:  # changed or gone since the merge committed (S5)
        _, tables, merged = _committed_merge(config, kind, run_id, spark, refused, progress)
        gate_committed_merge(tables, config, kind, client_id, run_id, progress)
        result = _merged_earlier_result(tables, run_id, merged)
        progress(result.describe())
        return result
    try:
        tables = batch.tables
        gate = batch.gate()
        rows_read = batch.rows.count()
        # The same rows and transactions as run_backfill (S2).
        quarantined = quarantine_or_refuse(tables, batch.rows, gate, client_id, run_id,
                                           progress)
        merged = merge_valid_rows(tables, config, batch.valid(), kind, client_id, run_id,
                                  progress)
        result = MergeResult(run_id, rows_read, merged, rows_read - quarantined - merged,
                             quarantined)
        progress(result.describe())
        return result
    finally:
        batch.close()


def _committed_merge(config: Config, kind: BatchKind, run_id: str,
                     spark: SparkSession | None, refused: BatchRefusedError,
                     progress: Progress) -> tuple[SparkSession, DeltaTables, int]:
    """(S5) The session, the tables and the rows the run's committed merge wrote, for a step
    whose batch ``refused``; ``refused`` is raised again when the run has not merged."""
    spark = spark or build_spark(config, "clickstream-backfill")
    tables = open_tables(config, spark)
    merged = merged_earlier(tables, kind, run_id)
    if merged is None:
        raise refused
    progress(f"{run_id}: {str(refused).split('; ')[0]}, after its merge committed: "
             "working from what the merge stored (S5)")
    return spark, tables, merged


def _merged_earlier_result(tables: DeltaTables, run_id: str, merged: int) -> MergeResult:
    """What the run's committed merge did (S5): its ``merged`` rows, from the merge commit,
    and its rows quarantined, from ``quarantine``; the rest of what it read were duplicates."""
    quarantined = quarantined_by_run(tables, run_id)
    return MergeResult(run_id, rows_read=merged + quarantined, rows_merged=merged,
                       duplicates_skipped=0, quarantined=quarantined)


@releases_cache
def recompute_affected(config: Config, *, kind: BatchKind, client_id: str, path: str,
                       run_id: str, spark: SparkSession | None = None,
                       progress: Progress = print) -> CorrectionSummary:
    """Recompute the sessions and attributions the merged batch affects, record the plan in
    ``corrections`` and apply it to the tables; publishing is a later step (S4).

    A rerun finds its unpublished plan and only (re)applies it (S3); an unpublished plan of
    another run of the client is applied and published first (C6). Users whose sessions the
    running sessionizer still holds open are queued for the scheduled recompute.
    """
    try:
        batch = _Batch(config, kind, client_id, path, spark, run_id)
    except BatchRefusedError as refused:  # changed or gone since: what the merge stored (S5)
        batch = _Batch.as_merged(config, kind, client_id, run_id, spark, refused, progress)
    try:
        run = batch.correction_run(progress)
        summary = CorrectionSummary()
        timer = Timer(summary, progress)
        with one_run_at_a_time(config, client_id, progress):  # (C6)
            changes = resume(run, summary, timer)
            if changes is None:
                changes = _plan_batch(batch, run, summary, timer)
                if changes is None:
                    count_earlier_plan(run, summary)
            if changes is not None:
                # As every correction: with Kafka out of reach the tables stay as the topics
                # show them, and the retried step applies the recorded plan (S3).
                check_changelogs_answer(config)
                with timer.step("apply to tables"):
                    apply(run, changes)
                release(changes)
        progress(f"recompute {run_id}: {summary.describe()}")
        return summary
    finally:
        batch.close()


def _plan_batch(batch: _Batch, run: Run, summary: CorrectionSummary, timer: Timer
                ) -> DataFrame | None:
    """Plan the batch's corrections; called only when ``resume()`` found no plan of the run
    (``BatchScope``)."""
    scope = BatchScope(batch.tables, batch.valid(), batch.kind, batch.client_id, batch.run_id)
    try:
        return plan_scope(run, scope.read, batch.kind == "orders", summary, timer,
                          stream_watermark_ms(batch.config, batch.client_id), scope.defer)
    finally:
        scope.release()


@releases_cache
def check_applied(config: Config, *, client_id: str, run_id: str,
                  spark: SparkSession | None = None, progress: Progress = print
                  ) -> dict[str, Any]:
    """The quality gate between apply and publish: the tables hold the run's plan (S4).

    Every planned session and attribution must be stored at (at least) its new revision,
    retracted sessions must be gone, and keys must be unique in the affected partitions.

    Returns:
        ``{"sessions": planned session rows, "attributions": planned attribution rows,
        "run_seq": the plan's step, None without one}`` (S8); with ``"superseded_by"``, the
        full recompute that superseded the plan, and no rows (C15).

    Raises:
        QualityGateFailedError: some planned rows are not reflected; nothing was published.
    """
    spark = spark or build_spark(config, "clickstream-backfill")
    tables = open_tables(config, spark)
    run = Run(spark, config, tables, client_id, f"backfill-{run_id}", f"backfill {run_id}",
              progress)
    # (C6) Under the lock: unlocked, another run could publish this plan and apply a later
    # one between the two reads below, and the check would fail on that run's changes.
    with one_run_at_a_time(config, client_id, progress):
        changes = stored_plan(run)
        if changes is None:
            progress(f"check-applied {run_id}: no corrections planned, nothing to check")
            return {"sessions": 0, "attributions": 0, "run_seq": None}
        try:
            run_seq = changes.select("run_seq").first()[0]
            published = run_seq <= published_through(run)
            by = superseded_by(run, run_seq) if published else None
            if by is not None:  # (C15)
                progress(f"check-applied {run_id}: its plan {run_seq} was superseded by {by} "
                         f"(it failed its applied check; {by} rewrote and published the client's "
                         "sessions and attributions), nothing to check")
                return {"sessions": 0, "attributions": 0, "run_seq": run_seq,
                        "superseded_by": by}
            if published:  # (S4)
                counts = {entity: changes.where(F.col("entity") == entity[:-1]).count()
                          for entity in ("sessions", "attributions")}
                progress(f"check-applied {run_id}: its {counts['sessions']} session and "
                         f"{counts['attributions']} attribution corrections were applied and "
                         "published already (later runs of the client may have changed them "
                         "since), nothing to check")
                return {**counts, "run_seq": run_seq}
            counts = check_plan_applied(run, changes)
        finally:
            release(changes)
    progress(f"check-applied {run_id}: tables hold all {counts['sessions']} session and "
             f"{counts['attributions']} attribution corrections")
    return {**counts, "run_seq": run_seq}


@releases_cache
def publish_corrections(config: Config, *, client_id: str, run_id: str,
                        checked_seq: int | None = None, spark: SparkSession | None = None,
                        progress: Progress = print) -> int:
    """Publish the run's stored corrections (new revisions and tombstones) to Kafka.

    Delivery guarantee: at least once, idempotent by key and revision: a retry republishes
    the same records, and a compacted reader sees the same final state. ``checked_seq``: the
    plan ``check_applied`` checked; another plan of the run is applied and checked first (S8).

    Returns:
        Records sent to the sessions and attributions topics.
    """
    spark = spark or build_spark(config, "clickstream-backfill")
    tables = open_tables(config, spark)
    run = Run(spark, config, tables, client_id, f"backfill-{run_id}", f"backfill {run_id}",
              progress)
    with one_run_at_a_time(config, client_id, progress):  # (C6)
        changes = unfinished_plan(run)
        if changes is not None and changes.select("run_id").first()[0] != run.run_id:
            release(changes)  # a later run plans only once this one was published
            changes = None
        if changes is None:
            earlier = stored_plan(run)  # not the client's unpublished plan: published (C6)
            by = None if earlier is None else superseded_by(
                run, earlier.select("run_seq").first()[0])
            sent = 0 if earlier is None or by is not None else earlier.count()
            release(earlier)
            if by is not None:  # (C15)
                progress(f"publish {run_id}: nothing to publish: its plan was superseded by "
                         f"{by}, which published the client's rewrite")
                return 0
            progress(f"publish {run_id}: nothing left to publish" + (
                f" (its {sent} records were published already: by an earlier attempt, or by "
                "another correction run of the client that finished its plan)" if sent
                else " (no corrections)"))
            return sent
        run_seq = changes.select("run_seq").first()[0]
        if run_seq != checked_seq:  # (S8)
            checked = "none" if checked_seq is None else f"plan {checked_seq}"
            progress(f"publish {run_id}: its plan {run_seq} was recorded after check-applied "
                     f"checked {checked} (another process of the run planned again): "
                     "applying and checking it first")
            check_changelogs_answer(config)  # Kafka out of reach: the tables stay as announced
            apply(run, changes)
            check_plan_applied(run, changes)
        sent = publish_changes(run, changes)
        mark_published(run, changes)
        release(changes)
    progress(f"publish {run_id}: {sent} records to {config.sessions_topic} and "
             f"{config.attributions_topic} at {config.kafka_bootstrap_servers}")
    return sent


def write_report(config: Config, *, check: Mapping[str, Any], dry_run: bool,
                 merged: Mapping[str, Any] | None = None,
                 corrections: Mapping[str, Any] | None = None,
                 applied: Mapping[str, Any] | None = None, published: int | None = None,
                 spark: SparkSession | None = None, progress: Progress = print
                 ) -> dict[str, str]:
    """Summarise one backfill run as text and as a page in the quality reports.

    Writes ``reports/backfills/<run>.html`` (``.dry-run.html`` for a dry run) and lists it in
    the reports index next to the run's quality gates; after a real run with corrections it
    also writes the run's correction report (``quality.correction_report``).

    Returns:
        ``{"summary": one paragraph, "report": path of the run's page}``.
    """
    run_id = str(check["run_id"])
    lines, summary_of_corrections = _summary_lines(
        config, check=check, dry_run=dry_run, merged=merged, corrections=corrections,
        applied=applied, published=published)
    if summary_of_corrections is not None and published is not None:
        spark = spark or build_spark(config, "clickstream-backfill")
        run = Run(spark, config, open_tables(config, spark), str(check["client_id"]),
                  f"backfill-{run_id}", f"backfill {run_id}", progress)
        corrections_page = write_correction_report(run, summary_of_corrections)
        if corrections_page is not None:
            lines.append(("corrections", f"report {corrections_page}"))
    summary, target = write_run_summary(
        config, run_id=run_id, client_id=str(check["client_id"]), kind=str(check["kind"]),
        root=str(check["root"]), lines=lines, details=check, dry_run=dry_run)
    progress(summary)
    progress(f"report: {target}")
    return {"summary": summary, "report": str(target)}


def write_failure_report(config: Config, *, failed_step: str, error: BaseException,
                         run_id: str, kind: BatchKind, client_id: str, path: str,
                         dry_run: bool = False) -> Path:
    """The run's summary page when one of its steps failed: what the steps before it did, and
    the failed step's reason. A run that ends well later (a retry, a cleared task) writes its
    summary to the same page, which replaces this one in the index.

    Returns:
        The page's path.
    """
    ran = STEPS[:STEPS.index(failed_step)]  # before it, so this attempt's (a dry run: check)
    saved = _saved_results(config, run_id, dry_run, ran)
    check = saved.get("check")
    lines = _saved_lines(config, saved, dry_run)
    lines.append(failure_line(failed_step, error))
    _, target = write_run_summary(
        config, run_id=run_id, client_id=client_id, kind=kind,
        root=str(check["root"]) if check else path, lines=lines, details=check,
        dry_run=dry_run, failed=True)
    return target


def saved_summary_lines(config: Config, run_id: str, *, dry_run: bool = False,
                        steps: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(step, what it did) for each of ``steps`` (all) the run saved a result of, in full:
    the reports index keeps only a summary's start. Nothing before its check."""
    return _saved_lines(config, _saved_results(config, run_id, dry_run,
                                               STEPS if steps is None else steps), dry_run)


def _saved_results(config: Config, run_id: str, dry_run: bool, steps: Sequence[str]
                   ) -> dict[str, Any]:
    return {name: load_step_result(config, run_id, name, dry_run)
            for name in steps if not dry_run or name == "check"}


def _saved_lines(config: Config, saved: Mapping[str, Any], dry_run: bool
                 ) -> list[tuple[str, str]]:
    if saved.get("check") is None:
        return []
    published = saved.get("publish")
    lines, _ = _summary_lines(
        config, check=saved["check"], dry_run=dry_run, merged=saved.get("merge"),
        corrections=saved.get("recompute"), applied=saved.get("check-applied"),
        published=None if published is None else published["published"])
    return lines


def _summary_lines(config: Config, *, check: Mapping[str, Any], dry_run: bool,
                   merged: Mapping[str, Any] | None, corrections: Mapping[str, Any] | None,
                   applied: Mapping[str, Any] | None, published: int | None
                   ) -> tuple[list[tuple[str, str]], CorrectionSummary | None]:
    """(step, what it did) per step that ran, and the recompute's summary if it ran; with
    each step's time when it ran as a step of its own (``run_step``)."""
    timed = load_step_result(config, str(check["run_id"]), SECONDS, dry_run) or {}

    def took(step: str) -> str:
        return f" ({timed[step]:.1f}s)" if step in timed else ""

    where = f"; {quarantine_location(str(check['run_id']))}" if check.get("quarantined") else ""
    lines = [("validate", BatchCheck(**{**check, "first_reasons": tuple(
        check.get("first_reasons", ()))}).describe() + where + took("check"))]
    if dry_run:
        lines.append(("dry run", "nothing was written: merge, recompute and publish were "
                                 "skipped"))
    if merged:
        lines.append(("merge", MergeResult(**merged).describe() + took("merge")))
    summary_of_corrections = None
    if corrections:
        summary_of_corrections = _correction_summary(corrections)
        lines.append(("recompute", summary_of_corrections.describe() + took("recompute")))
    if applied is not None and applied.get("superseded_by"):  # (C15)
        by = applied["superseded_by"]
        lines.append(("check", f"plan superseded by {by}: it failed its applied check, and "
                               f"{by} rewrote and published the client's sessions and "
                               "attributions" + took("check-applied")))
    elif applied is not None:
        lines.append(("check", f"tables hold {applied.get('sessions', 0)} session and "
                               f"{applied.get('attributions', 0)} attribution corrections"
                               + took("check-applied")))
    if published is not None:
        lines.append(("publish", f"{published} records to {config.sessions_topic} / "
                                 f"{config.attributions_topic}" + took("publish")))
    return lines, summary_of_corrections


# --- steps as separate processes (the DAG's spark-submit tasks) ------------------------------

STEPS = ("check", "merge", "recompute", "check-applied", "publish", "report")
SECONDS = "seconds"  # saved beside the steps' results: each step's time, for the run's page
# The step each writing step needs to have succeeded for its run (S6); report needs check.
AFTER = dict(zip(STEPS[1:5], STEPS[:4], strict=True))
GATED_STEPS = ("merge", "recompute", "publish")  # and check, in a dry run


def locate_batch(config: Config, *, kind: BatchKind, client_id: str, path: str
                 ) -> dict[str, Any]:
    """The batch's files and run id, without Spark: the path check (inside the landing
    folder, no traversal, no symlinks out), formats, and the fingerprint that pins every
    later step to these exact files (S1). ``not_read`` names the hidden files of an
    accepted format the batch leaves out (``BatchFiles.hidden``), or is None.

    Raises:
        BatchRefusedError: the path leaves the landing folder, is missing or empty, or mixes
            formats.
    """
    check_client_id(client_id)
    files = list_batch_files(config, path)
    return {"run_id": backfill_run_id(kind, client_id, files), "root": str(files.root),
            "file_count": len(files.files), "file_format": files.file_format,
            "not_read": files.hidden_line()}


def step_result_path(config: Config, run_id: str, step: str, dry_run: bool = False) -> Path:
    """Where a step run in its own process leaves its result for the steps after it. A dry
    run of a batch keeps its own (its run id is the batch's): it must not remove what a real
    run of the batch saved (S6), which that run's retried steps and report read."""
    folder = reports.safe_name(f"{run_id}.dry-run" if dry_run else run_id)
    return config.home / "runs" / "backfill" / folder / f"{step}.json"


def load_step_result(config: Config, run_id: str, step: str, dry_run: bool = False
                     ) -> dict[str, Any] | None:
    """A step's saved result; None if the step has not run for this batch (in this kind of
    run: real, or dry)."""
    path = step_result_path(config, run_id, step, dry_run)
    return json.loads(path.read_text()) if path.exists() else None


MERGE_GATES = ("historical_batch", "tables_after_merge")


def quarantined_by_run(tables: DeltaTables, run_id: str, *, with_gates: bool = False) -> int:
    """Rows the run's merge step put in ``quarantine`` (S7), counted from the table: a refused
    batch's ``merge`` quarantines its rows, then fails and saves no result. ``with_gates``:
    the rows of its gates' failures too (a merge the ``tables_after_merge`` gate failed after
    its commit)."""
    import pyarrow.compute as pc

    if not tables.exists(QUARANTINE.name) or (not with_gates and tables.app_version(
            QUARANTINE.name, backfill_app_id(run_id)) is None):
        return 0  # no table, or nothing of this run's in it
    sources = tables.read_arrow(QUARANTINE.name, columns=["source"]).column("source")
    prefixes = [quarantined_source_prefix(run_id)] + [
        f"{gate_source_prefix(gate, 'backfill', run_id)}:" for gate in MERGE_GATES
        if with_gates]
    found = [pc.starts_with(sources, prefix) for prefix in prefixes]
    return int(pc.sum(functools.reduce(pc.or_, found)).as_py() or 0)


def queued_ahead_by_run(tables: DeltaTables, run_id: str) -> int:
    """Rows in ``recompute_queue`` the run's merge queued ahead of the stream (``backfill``
    ``queue_ahead_of_the_merge``): the rows its commit added, from the log's counts. Not the
    rows with the run's mark: those its recompute queues for users the stream holds carry
    it too, and the DAG's ``announce_merge`` may run after the recompute."""
    if tables.app_version(RECOMPUTE_QUEUE.name, ahead_app_id(run_id)) is None:
        return 0
    commit = tables.newest_commit(RECOMPUTE_QUEUE.name,
                                  lambda entry: entry.get("app_id") == ahead_app_id(run_id))
    if commit is None:  # left the log (weeks later): its rows are no longer known
        return 0
    version = int(commit["version"])
    before = tables.row_count(RECOMPUTE_QUEUE.name, version=version - 1) if version else 0
    return tables.row_count(RECOMPUTE_QUEUE.name, version=version) - before


def merged_tables(config: Config, *, kind: BatchKind, run_id: str, dry_run: bool
                  ) -> dict[str, int]:
    """The tables the run's merge changed, with its rows in each: what the DAG announces as
    Asset events. From the merge's saved result, else (a merge that failed: a refused batch
    quarantines its rows, a merge the ``tables_after_merge`` gate fails is committed) from
    the tables; with the rows it queued ahead of the stream. A dry run changed none,
    whatever a real run of its batch (the same run id, S2) merged before: its own steps can
    fail before they reach merge."""
    if dry_run:
        return {}
    from clickstream.io.delta_rs_engine import DeltaRsTables

    tables = DeltaRsTables(config)  # whichever engine wrote them: this task starts no Spark
    merged = load_step_result(config, run_id, "merge")
    if merged is not None:
        rows, quarantined = merged.get("rows_merged", 0), merged.get("quarantined", 0)
    else:
        rows = merged_earlier(tables, kind, run_id) or 0
        quarantined = quarantined_by_run(tables, run_id, with_gates=True)
    changed = {kind: rows, QUARANTINE.name: quarantined,
               RECOMPUTE_QUEUE.name: queued_ahead_by_run(tables, run_id)}
    return {table: count for table, count in changed.items() if count}


def recompute_result(config: Config, run_id: str) -> CorrectionSummary | None:
    """The ``recompute`` step's saved summary; None if it has not run for this batch."""
    saved = load_step_result(config, run_id, "recompute")
    return None if saved is None else _correction_summary(saved)


def recomputed_tables(config: Config, *, client_id: str, run_id: str) -> list[str]:
    """The tables the run's ``recompute`` step changed: what the DAG announces as Asset
    events. From the step's saved summary; else (the step failed, every attempt) the tables
    of a plan of the client recorded and not published, which its apply may have committed
    (recompute R15). Read with delta-rs: the Airflow task that asks starts no Spark."""
    summary = recompute_result(config, run_id)
    if summary is not None:
        return summary.changed_tables()
    from clickstream.io.delta_rs_engine import DeltaRsTables

    run = Run(None, config, DeltaRsTables(config),  # type: ignore[arg-type]  # logs only
              client_id, f"backfill-{run_id}", f"backfill {run_id}")
    return list(PLAN_TABLES) if plan_left_unpublished(run) else []


def _correction_summary(saved: Mapping[str, Any]) -> CorrectionSummary:
    fields = {f.name for f in dataclasses.fields(CorrectionSummary)}
    return CorrectionSummary(**{k: v for k, v in saved.items() if k in fields})


def _check_same_batch(config: Config, run_id: str, dry_run: bool, **arguments: str) -> None:
    """A step after ``check`` runs on the batch ``check`` validated: given another client, a
    step found nothing of the run's (publish 'succeeded' with 0, the plan left unpublished),
    and another kind misread the batch as changed."""
    check = load_step_result(config, run_id, "check", dry_run)
    if check is None:
        raise ConfigError(f"backfill {run_id}: no result of step 'check' under "
                          f"{step_result_path(config, run_id, 'check', dry_run).parent}; run the "
                          "steps in order, under the run id `check` ran with (a mistyped run "
                          "id is a run no step has seen)")
    differing = [f"--{name.removesuffix('_id')} {value!r} (its check ran with {check[name]!r})"
                 for name, value in arguments.items() if check.get(name) != value]
    if differing:
        raise ConfigError(f"backfill {run_id}: {'; '.join(differing)}; give every step of a "
                          "run the batch's arguments its check ran with")


@releases_cache
def run_step(config: Config, step: str, *, kind: BatchKind, client_id: str, path: str,
             run_id: str, dry_run: bool = False, spark: SparkSession | None = None,
             progress: Progress = print) -> dict[str, Any]:
    """Run one backfill step for a batch located by :func:`locate_batch` and save its result.

    Each step reads what earlier steps saved (the results are keyed by the run id, so a
    rerun of the same batch overwrites them); ``report`` ignores the writing steps' results
    in a dry run.

    Raises:
        ConfigError: an unknown step, or a step other than ``check`` of a run whose ``check``
            has not run (a run id mistyped, or steps out of order): refused before it writes
            anything, its failure page included.
        BatchRefusedError, QualityGateFailedError: as the step functions above.
    """
    if step not in STEPS:
        raise ConfigError(f"unknown backfill step {step!r}; one of: {', '.join(STEPS)}")
    if step != "check":
        _check_same_batch(config, run_id, dry_run, kind=kind, client_id=client_id)
    needed = AFTER.get(step)
    if needed and load_step_result(config, run_id, needed) is None:  # (S6)
        raise ConfigError(f"backfill {run_id}: step {step!r} comes after {needed!r}, which has "
                          "not succeeded for this run; run the steps in order "
                          f"({' -> '.join(STEPS)})")
    for later in STEPS[STEPS.index(step):]:  # this round's, from here on (S6)
        step_result_path(config, run_id, later, dry_run).unlink(missing_ok=True)
    started = time.monotonic()
    try:
        result = _run_step(config, step, kind=kind, client_id=client_id, path=path,
                           run_id=run_id, dry_run=dry_run, spark=spark, progress=progress)
    except Exception as error:
        page = write_failure_safely(error, functools.partial(
            write_failure_report, config, failed_step=step, error=error, run_id=run_id,
            kind=kind, client_id=client_id, path=path, dry_run=dry_run))
        if page is not None:
            progress(f"report: {page}")
        held = None if dry_run else read_point.still_holding(config, backfill_app_id(run_id))
        if held:
            progress(held)
        raise
    target = step_result_path(config, run_id, step, dry_run)
    write_atomically(target, json.dumps(result, indent=1, default=str))
    seconds = {**(load_step_result(config, run_id, SECONDS, dry_run) or {}),
               step: round(time.monotonic() - started, 1)}
    write_atomically(step_result_path(config, run_id, SECONDS, dry_run),
                             json.dumps(seconds))
    return result


def _run_step(config: Config, step: str, *, kind: BatchKind, client_id: str, path: str,
              run_id: str, dry_run: bool, spark: SparkSession | None, progress: Progress
              ) -> dict[str, Any]:
    check_stream_settings(config)
    if step in GATED_STEPS or (step == "check" and dry_run):
        warm_up(config)  # Great Expectations takes seconds to import; overlap it with Spark's
    batch = {"kind": kind, "client_id": client_id, "path": path, "spark": spark,
             "progress": progress}
    if step == "check":
        check = check_batch(config, quality_gate=dry_run, **batch)
        if check.run_id != run_id:  # (S1)
            raise BatchRefusedError(
                f"batch {check.root} changed since it was located (run {run_id}, now "
                f"{check.run_id}); nothing was written. Trigger a new run for it")
        result: dict[str, Any] = check.as_dict()
    elif step == "merge":
        result = dataclasses.asdict(merge_batch(config, run_id=run_id, **batch))
    elif step == "recompute":
        result = dataclasses.asdict(recompute_affected(config, run_id=run_id, **batch))
    elif step == "check-applied":
        result = check_applied(config, client_id=client_id, run_id=run_id, spark=spark,
                               progress=progress)
    elif step == "publish":
        checked = load_step_result(config, run_id, "check-applied") or {}  # run_step: saved
        result = {"published": publish_corrections(
            config, client_id=client_id, run_id=run_id, checked_seq=checked.get("run_seq"),
            spark=spark, progress=progress)}
    else:
        check = load_step_result(config, run_id, "check", dry_run)
        assert check is not None  # run_step refused the run otherwise
        earlier = {} if dry_run else {
            name: load_step_result(config, run_id, name)
            for name in ("merge", "recompute", "check-applied", "publish")}
        published = earlier.get("publish")
        result = write_report(
            config, check=check, dry_run=dry_run, merged=earlier.get("merge"),
            corrections=earlier.get("recompute"), applied=earlier.get("check-applied"),
            published=None if published is None else published["published"], spark=spark,
            progress=progress)
    return result
