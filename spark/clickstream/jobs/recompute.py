"""``clickstream recompute``: fold the recompute queue (events too late for the stream) in.

Per client: the queued records' users and times are the scope; ``corrections.correct``
recomputes the affected sessions exactly as a backfill does, then the processed queue rows are
removed in one commit. Users whose sessions the running stream still holds open are deferred:
their queue rows stay for the next run. Safe while the sessionizer runs: it only appends new
closed sessions, and a conflicting commit makes this run recompute, not overwrite.

Delivery guarantee: exactly once into the tables. Queue rows are removed only after their
corrections are applied and published, and only those rows (R1). A rerun after a crash
finishes the interrupted plan before planning again (``corrections`` C6), whatever the queue
holds by then.

Known edge cases, cited inline as (R1)..(R15):
  R1. The stream queues late rows while a run works, possibly on the same client and days:
      the removal deletes the folded-in rows by key (``DeltaTables.delete_rows``), rewriting
      only the files that hold them, so the stream's appends stay and do not conflict. It used
      to rewrite whole days from the queue as it was at that moment, and had to do it again
      whenever the stream committed into them first (R10).
  R2. ``--full`` leaves to the stream every user with a stored pageview or order later than
      ``watermark - gap`` (the rule targeted corrections defer by, ``corrections`` C4), read
      from the whole history it reads anyway: an order no session covers yet is in the
      stream's state too, and after the stream's first micro-batch the watermark is 0.
  R3. ``--full`` records what it changes in ``corrections`` like any run (created / updated /
      retracted, old and new revision, its cause), as the client's next plan, before it
      writes anything; it marks the plan published once both tables are rewritten and
      published. A crash, or a commit it conflicts with, leaves the plan unpublished: the
      client's next correction run finishes it (C6).
  R4. A plan interrupted before it reached Kafka (C6) is finished by the client's next
      correction run; a run of the schedule also finishes those of clients with nothing
      queued, so a killed backfill's changes reach the topics within one schedule.
  R5. A ``--full`` killed after recording its plan (R3) leaves it unpublished, and its rerun
      has the same run id, so ``resume`` hands the plan back as the rerun's own instead of
      finishing it. Planning again from the tables is not enough: a session whose tombstone
      went out before the kill is still in the table, and if its user has come back to the
      stream since (R2), the rerun keeps that user's stored rows as they are; marking its
      own plan published then hid the killed one for good. The rerun finishes it first.
  R6. ``--full`` reads the sessions and attributions it rewrites before the pageviews and
      orders it rewrites them from. The other way round, a session (or attribution) the stream
      closed in between was in what it rewrote but not in what it computed, and its user was
      not left to the stream (R2: the pageview was not in what it read): it was retracted,
      though its pageview is stored and was never queued. Read first, every stored session has
      its pageviews in the later read (the stream stores a micro-batch's records before the
      sessions it derives, Z6 of ``sessionize``), and a session committed after the read makes
      the rewrite's commit conflict (R3).
  R7. ``--full`` supersedes an unfinished plan only when the tables do not hold it (its
      applied check fails: ``PlanNotAppliedError``). A plan applied whose publish gate fails
      again is an error of this run too: superseded, its retractions would never reach the
      topic, since the rewrite finds nothing left to retract. A rerun publishes it. A
      superseded plan's own retractions of keys the tables no longer hold are sent first: a
      plan whose check failed was applied all the same (``finish`` applies, then checks), so
      its retracted rows are gone from the table and no rewrite finds them to retract; their
      rows stayed on the topic for good. A backfill's superseded plan gets a page saying so
      (``run_summary.write_plan_taken_over``), or its run stayed red in the quality index.
  R8. ``--full`` keeps the stored attribution of an order moved (C7) to a user left to the
      stream (R2), as targeted corrections do (C8): the recompute that folds the order in
      once the stream lets the user go updates it at the next revision. It retracted it
      (the stored row is another user's, the rewrite has none), and that recompute created
      it again at revision 1: the topic and ``corrections`` carried (key, revision 1) twice
      with different values. Retractions it still makes are in its plan, not only on the
      topic: killed after a tombstone, before the rewrite, it recorded no plan, so the
      client's next correction run had nothing to finish.
  R9. ``--full`` keeps a held user's (R2) stored attribution only if the rewrite has none of
      its order: an order moved (C7) from that user to one the rewrite recomputes is the
      rewrite's (an update, in the plan). Kept by user alone, the old row stayed beside the
      rewritten one: the order held twice, once on the topic. (The other way round is R8.)
  R10. A client whose queue rows could not be removed (commits kept rewriting the files that
      hold them through every attempt, R1) fails like a client whose correction failed:
      its corrections are applied and published, its rows stay queued, and the next run
      plans them again and changes nothing. The removal used to fail outside the per-client
      handling, so the clients after it in the run were not folded in at all, run after run
      while that client's late traffic lasted. Any exception counts, not only the product's
      own: an error of one client's Spark job reaches the driver as Spark's type.
  R11. ``--full`` passes the gates every correction passes: ``recomputed_sessions`` on all
      it rewrites, before it records, rewrites or publishes anything, and ``publish`` on its
      plan once published (failing, the plan stays unpublished for the next correction run
      to finish, C6). It ran none: the largest rewrite the product makes went unchecked.
  R12. The error standing for the failed clients (R10) names an unforeseen failure's type
      (``KeyError: 'x'``, not ``'x'``) and is raised from the first one, so the CLI keeps its
      traceback as for any unexpected error; the clients that succeeded are described before
      it is raised (the CLI prints a summary only for a run that succeeded).
  R13. ``--full`` pairs a key's stored and rewritten copies (an order id two users hold,
      ``sessionize`` Z12) as the diff does (``corrections`` C14): by key where each side
      holds one, else by user and order time. Paired by order_id alone, two copies on each
      side met 2x2: the table held the order four times, eight after the next ``--full``,
      and the publish gate failed the plan. Tombstones and kept rows stay by key: a key
      is retracted only when the rewrite has no copy of it.
  R14. A held user's (R2) stored copy of an order id a rewritten user holds too (Z12, C14) is
      kept when the held user still holds that order: only a copy whose order moved away is
      the rewrite's (R9). Taken for a moved order by key alone, the held user's copy was
      dropped from the table and retracted in the plan with no tombstone (the key's other
      copy stays), so the publish gate failed the plan and every later correction of the
      client. The rewrite's stored side leaves out the kept copies by copy, not by key, so
      the other copy still pairs with its own.
  R15. A client that failed (R10) with a plan recorded and not published may have applied
      it (its publish failed, or the publish gate): the run announces ``sessions``,
      ``attributions`` and ``corrections`` for it. The failed attempt announced none of them
      (the client had no summary), and no retry may follow. So does a client that had
      another run's plan to finish (R4): it applied and published that plan before its own
      work failed, and no plan is left unpublished to tell.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial, reduce
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream.atomic_files import write_atomically
from clickstream.config import Config
from clickstream.errors import (
    ClickstreamError,
    CommitConflictError,
    PlanNotAppliedError,
    carried_error,
    error_line,
    noted_on,
    one_error_for,
    typed_error_line,
)
from clickstream.io import read_point
from clickstream.io.delta_tables import TABLE_MISSING, DeltaTables, open_tables
from clickstream.io.kafka_changelog import publish_pairs, publish_rows
from clickstream.jobs.corrections import (
    BUCKETS,
    PLAN_TABLES,
    CorrectionSummary,
    Run,
    ScopeReader,
    Timer,
    _attribution_rows,
    _differs,
    _session_rows,
    correct,
    diff,
    finish,
    landing_scope,
    mark_published,
    next_plan_seq,
    one_run_at_a_time,
    plan_left_unpublished,
    plan_recorded,
    record_plan,
    resume,
    unfinished_plan,
    unfinished_plan_seq,
)
from clickstream.jobs.sessionize import check_stream_settings, stream_watermark_ms
from clickstream.key_copies import COPIES_BY, pair_copies
from clickstream.quality import reports
from clickstream.quality.gates import (
    FULL_RECOMPUTE_JOB,
    gate_publish,
    gate_recomputed_sessions,
    publish_started,
    warm_up,
)
from clickstream.quality.run_summary import write_plan_taken_over
from clickstream.sessions.batch_adapter import sessionize_frames
from clickstream.spark_session import build_spark, keep, release, releases_cache
from clickstream.tables import (
    ATTRIBUTIONS,
    CORRECTIONS,
    ORDERS,
    PAGEVIEWS,
    RECOMPUTE_QUEUE,
    SESSIONS,
    TableSpec,
)


@dataclass
class RecomputeSummary:
    """What one ``clickstream recompute`` did, per client."""

    queued: dict[str, int] = field(default_factory=dict)
    corrections: dict[str, CorrectionSummary] = field(default_factory=dict)
    dequeued: dict[str, int] = field(default_factory=dict)  # queue rows removed, per client
    failed: list[str] = field(default_factory=list)  # (R10) its rows stay queued
    # Clients that failed (R10) with their plan recorded and not published, or after
    # finishing another run's: it may be applied (R15).
    failed_after_planning: list[str] = field(default_factory=list)

    def changed_tables(self) -> list[str]:
        """The tables the run changed: what the ``scheduled_recompute`` DAG announces as
        Asset events (announced whatever happened, every night woke the DAGs scheduled on
        them for nothing); with the tables of a plan a failed client may have applied (R15).
        """
        changed = {t for c in self.corrections.values() for t in c.changed_tables()}
        if self.failed_after_planning:
            changed |= set(PLAN_TABLES)
        if any(self.dequeued.values()):
            changed.add(RECOMPUTE_QUEUE.name)
        return sorted(changed)

    def describe(self) -> str:
        if not self.queued:
            return "recompute: the queue is empty"
        return "\n".join(
            f"recompute {client}: " + (f"{self.queued[client]} queued records; "
                                       f"{self.corrections[client].describe()}"
                                       if self.queued[client] or client in self.dequeued
                                       else "nothing queued for this client")
            for client in self.queued  # a failed client is not (R10): its error says why
            if client in self.corrections and client not in self.failed)


@releases_cache
def run_recompute(
    config: Config, *, client_id: str | None = None, spark: SparkSession | None = None,
    progress: Callable[[str], None] = print, result_name: str | None = None,
) -> RecomputeSummary:
    """Fold queued late records into sessions for one client, or for every queued client;
    also finish an interrupted plan of a client with nothing queued (R4).

    ``result_name``: save the tables the run changed under it (``save_result``), also when
    a client fails (R10): the others' changes are made, and a retry will not make them. Saved
    before each client too, naming it: an attempt killed while it worked on one (kill -9,
    the out-of-memory killer) may have changed any table, and its retry finds that client's
    rows gone from the queue, so nothing else would tell what it changed."""
    summary = RecomputeSummary()
    if result_name is None:
        return _recompute(config, client_id, spark, progress, summary)
    earlier = changed_tables_saved(config, result_name)  # read before this attempt saves

    def save(working_on: str | None) -> None:
        save_result(config, result_name, summary, earlier=earlier, working_on=working_on)

    try:
        done = _recompute(config, client_id, spark, progress, summary, starting=save)
    except BaseException as error:
        with noted_on(error, f"saving the tables it changed (--save-result-as {result_name})"):
            save(None)
        raise
    save(None)
    return done


def _recompute(config: Config, client_id: str | None, spark: SparkSession | None,
               progress: Callable[[str], None], summary: RecomputeSummary,
               starting: Callable[[str], None] = lambda client: None) -> RecomputeSummary:
    check_stream_settings(config)
    spark = spark or build_spark(config, "clickstream-recompute")
    tables = open_tables(config, spark)
    unfinished = _clients_with_unfinished_plans(spark, config, tables, client_id)
    if not tables.exists(RECOMPUTE_QUEUE.name) and not unfinished:
        return summary
    warm_up(config)  # Great Expectations takes seconds to import; overlap it with the reads
    queue_version = tables.version(RECOMPUTE_QUEUE.name)
    queue = (tables.read(RECOMPUTE_QUEUE.name, version=queue_version) if queue_version >= 0
             else spark.createDataFrame([], RECOMPUTE_QUEUE.schema))
    clients = [client_id] if client_id else sorted(
        {r.client_id for r in queue.select("client_id").distinct().collect()} | unfinished)
    failed: dict[str, ClickstreamError] = {}
    for client in clients:
        mine = queue.where(F.col("client_id") == client).persist()
        summary.queued[client] = mine.count()
        if not summary.queued[client] and client not in unfinished:
            summary.corrections[client] = CorrectionSummary()
            continue
        progress(f"recompute {client}: {summary.queued[client]} queued records"
                 + ("; an interrupted plan to finish first" if client in unfinished else ""))
        starting(client)
        run = Run(spark, config, tables, client, f"recompute-{client}-q{queue_version}",
                  f"recompute queue version {queue_version}", progress)
        left = None
        try:  # one client's trouble does not stop the others (R10)
            result, left = _correct(run, partial(landing_scope, mine),
                                    stream_watermark_ms(config, client))
            summary.corrections[client] = result
            folded_in = mine if left is None else mine.join(left, ["client_id", "user_id"],
                                                            "left_anti")
            summary.dequeued[client] = dequeue(tables, run, folded_in, queue_version)  # (R1)
        except Exception as error:  # raised below, with every other client's failure (R10)
            error = carried_error(error) or error  # a worker raised it: its type, retryable or not
            progress(f"recompute {client}: failed, its rows stay queued: {error}")
            failed[client] = error
            summary.failed.append(client)
            # (R15) It may have finished another run's plan before its own failed, too.
            if client in unfinished or plan_left_unpublished(run):
                summary.failed_after_planning.append(client)
        finally:
            release(mine, left)
    if failed:
        if summary.corrections:  # what the others did: the CLI prints no summary now
            progress(summary.describe())
        # (R12) a bug's type and traceback: the CLI keeps the cause's traceback (of an error
        # a worker raised, the Spark error that carried it)
        unforeseen = next((cause for cause in (
            e.__cause__ if isinstance(e, ClickstreamError) else e for e in failed.values())
            if cause is not None and not isinstance(cause, ClickstreamError)), None)
        raise one_error_for(
            list(failed.values()),
            f"recompute failed for {len(failed)} of {len(clients)} clients, whose rows stay "
            f"queued ({'; '.join(f'{c}: {_named(e)}' for c, e in failed.items())}); "
            "the others were folded in") from unforeseen
    return summary


def _named(error: BaseException) -> str:
    """A client's failure in one line; an unforeseen one (not the product's) with its type
    (R12)."""
    return error_line(str(error)) if isinstance(error, ClickstreamError) else \
        typed_error_line(error)


def _clients_with_unfinished_plans(spark: SparkSession, config: Config, tables: DeltaTables,
                                   only: str | None) -> set[str]:
    """(R4) Clients (or client ``only``) whose latest plan never reached Kafka (C6): the
    clients are read from the ``corrections`` table's partitions (file statistics with
    delta-rs), each one's plan steps from the log's application versions."""
    clients = tables.largest_by_partition(
        CORRECTIONS.name, "run_seq", "client_id",
        partition_filter={"client_id": only} if only else None)
    return {client for client in clients if client is not None and unfinished_plan_seq(
        Run(spark, config, tables, client, "plan-lookup", "plan lookup")) is not None}


def _correct(run: Run, read_scope: ScopeReader, watermark: int | None
             ) -> tuple[CorrectionSummary, DataFrame | None]:
    """The run's corrections, and the users left to the stream (their rows stay queued)."""
    left: list[DataFrame] = []

    def defer(users: DataFrame) -> int:  # a plan that grew its scope calls it again (C13)
        release(*left)
        left[:] = [keep(users)]  # its lineage reads frames released after plan
        return 0  # their rows stay queued: nothing more is queued

    result = correct(run, read_scope, orders_only=False, stream_watermark_ms=watermark,
                     defer=defer)
    if result.resumed:  # an interrupted plan was finished: planning again names the deferred
        result = result.and_then(correct(run, read_scope, orders_only=False,
                                         stream_watermark_ms=watermark, defer=defer,
                                         first_pass=False))
    return result, (left[0] if left else None)


def dequeue(tables: DeltaTables, run: Run, folded_in: DataFrame, queue_version: int) -> int:
    """Remove exactly the rows the run folded in from the queue (R1); returns how many.

    The stream may queue more rows of the same days while the run works: only the files that
    hold folded-in rows are rewritten, so its appends meanwhile neither conflict with the
    removal nor are removed by it.
    """
    folded_in = folded_in.distinct().persist()
    try:
        dates = sorted({r.event_date for r in folded_in.select("event_date").distinct().collect()})
        if not dates:
            return 0
        return tables.delete_rows(
            RECOMPUTE_QUEUE.name, folded_in, keys=RECOMPUTE_QUEUE.schema.fieldNames(),
            partition_filter={"client_id": run.client_id, "event_date": dates},
            app_id=f"recompute-queue-{run.client_id}", version=queue_version,
            metadata={"run_id": run.run_id, "cause": run.cause}).deleted
    finally:
        folded_in.unpersist()


def result_path(config: Config, name: str) -> Path:
    """Where ``recompute --save-result-as NAME`` leaves the tables it changed, for the DAG task
    that announces them (the job runs in spark-submit's process)."""
    return config.home / "runs" / "recompute" / f"{reports.safe_name(name)}.json"


# Every table a run may change (``RecomputeSummary.changed_tables``), sorted as it sorts them.
ANNOUNCED_TABLES = tuple(sorted(
    (SESSIONS.name, ATTRIBUTIONS.name, CORRECTIONS.name, RECOMPUTE_QUEUE.name)))


def save_result(config: Config, name: str, summary: RecomputeSummary, *,
                earlier: Iterable[str] | None = None, working_on: str | None = None) -> Path:
    """Save the tables the run changed under ``name``, with ``earlier``: those earlier
    attempts saved under it (read from the file when not given; a retry of a run that failed
    for a client changes only what is left). ``working_on``: the client the attempt starts
    on; killed before it saves again, the attempt is taken to have changed every table it may
    (``changed_tables_saved``). Written whole or not at all: a file cut by a kill would fail
    every later attempt's save."""
    path = result_path(config, name)
    changed = set(summary.changed_tables())
    changed |= set(changed_tables_saved(config, name) if earlier is None else earlier)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"changed_tables": sorted(changed),
                                               "working_on": working_on}))
    return path


def changed_tables_saved(config: Config, name: str) -> list[str]:
    """The tables the runs saved as ``name`` changed: none when no run saved it (the job
    failed before it started); all it may change when an attempt died while it worked on a
    client, or the file cannot be read (announced again rather than not at all)."""
    path = result_path(config, name)
    if not path.exists():
        return []
    try:
        saved = json.loads(path.read_text())
        if saved.get("working_on") is not None:
            return list(ANNOUNCED_TABLES)
        return list(saved["changed_tables"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return list(ANNOUNCED_TABLES)


@dataclass
class FullRecomputeSummary:
    client_id: str
    sessions: int
    attributions: int
    seconds: float
    retracted: int = 0
    users_left_to_the_stream: int = 0

    def describe(self) -> str:
        return (f"full recompute {self.client_id}: {self.sessions} sessions and "
                f"{self.attributions} attributions rewritten and republished, {self.retracted} "
                f"sessions retracted (tombstones), {self.users_left_to_the_stream} users with "
                f"a session open in the stream left as they are, in {self.seconds:.1f}s")


@releases_cache
def run_full_recompute(
    config: Config, *, client_id: str, spark: SparkSession | None = None,
    progress: Callable[[str], None] = print,
) -> FullRecomputeSummary:
    """Delete-and-rewrite every session and attribution of one client from all its data.

    The baseline that targeted corrections are measured against (BENCHMARKS.md), and a
    repair tool: it reads the client's whole history, so it is slow by design. Revisions are
    carried over (+1 where content changed) and sessions that no longer exist are retracted
    with tombstones, so compacted readers end with the table's view. Users with a session open
    in the stream keep their rows (``corrections`` C4): the stream will emit that session.
    If another writer (the sessionizer, or a correction run on another machine) commits into
    the client's rows meanwhile, the rewrite of that table is refused, the rows its
    tombstones had retracted are sent again, and the error says to rerun. It runs as one of
    the client's correction runs (C6): an unpublished plan goes first, or, if that plan fails
    its applied check, is superseded (this rewrite republishes every row it writes, those
    of users the stream holds too, which that plan may have applied).
    Tombstones are sent before the rows they retract are replaced: a rerun after a crash
    finds those rows gone and could not tell them any more.
    """
    check_stream_settings(config)
    started = time.monotonic()
    spark = spark or build_spark(config, "clickstream-full-recompute")
    tables = open_tables(config, spark)
    with one_run_at_a_time(config, client_id, progress):
        run = Run(spark, config, tables, client_id, f"{FULL_RECOMPUTE_JOB}-{client_id}",
                  f"full recompute of {client_id}", progress)
        timer = Timer(CorrectionSummary(), progress)
        try:
            # A killed --full's own plan comes back from resume() unfinished (its run id is
            # the same each time): finished first like another run's (R5).
            own = resume(run, CorrectionSummary(), timer)
            if own is not None:
                finish(run, own, timer, step="finish the interrupted full recompute",
                       check_applied=True)
                own.unpersist()
        except PlanNotAppliedError as failed:  # (R7)
            progress(f"  the unpublished plan fails its applied check ({failed}); the full "
                     "recompute supersedes it")
            superseded = unfinished_plan(run)
            if superseded is not None:
                _retract_what_the_tables_lost(run, superseded)  # killed after: sent again
                _note_superseded(run, superseded.select("run_id").first()[0])  # (idem)
                mark_published(run, superseded, superseded=True)
                superseded.unpersist()
        return _rewrite_client(run, started)


def _note_superseded(run: Run, planned_by: str) -> None:
    """(R7) A backfill's superseded plan: the run's page says so, over its failed summary."""
    write_plan_taken_over(run.config, planned_by=planned_by, client_id=run.client_id,
                          how="superseded", by=run.run_id, lines=[(
                              "recompute and publish", "plan superseded (its applied check "
                              f"failed): {run.run_id} rewrote and published the client's "
                              "sessions and attributions")])


def _retract_what_the_tables_lost(run: Run, superseded: DataFrame) -> None:
    """(R7) Tombstones for the keys a superseded plan retracted that the tables no longer
    hold: it was applied (``finish`` applies, then checks), and the rewrite cannot retract
    what it does not find. Sent before the plan is marked published, so a run killed in
    between sends them again."""
    for spec, topic, entity in ((SESSIONS, run.config.sessions_topic, "session"),
                                (ATTRIBUTIONS, run.config.attributions_topic, "attribution")):
        (key,) = spec.key
        gone = superseded.where((F.col("entity") == entity) & (F.col("change") == "retracted"))
        if run.tables.exists(spec.name):
            gone = gone.join(run.tables.read(spec.name, [key], partition_filter={
                "client_id": run.client_id}).select(F.col(key).alias("key")), "key", "left_anti")
        publish_pairs(run.config, topic, gone.select("key", F.lit(None).cast("string")))


def _users_the_stream_holds(pageviews: DataFrame, orders: DataFrame, cutoff_ms: int
                            ) -> DataFrame:
    """(R2) Users with a stored pageview or order later than ``watermark - gap``: the rule
    targeted corrections defer by (``corrections`` C4). A session of theirs may be open in the
    stream's state, or an order no session covers yet, which the stream emits as unattributed
    once the watermark passes it; rewritten here, either would be stored twice. Read from the
    whole history the rewrite reads anyway: after the stream's first micro-batch its watermark
    is 0 and every stored row is later (reading only the days around the watermark, as it
    did, found none of them)."""
    cutoff = F.timestamp_millis(F.lit(cutoff_ms))
    # The day first: partitions before it are not read a second time (the rewrite reads all).
    later = (F.col("event_date") >= F.to_date(cutoff)) & (F.col("ts") > cutoff)
    return keep(pageviews.where(later).select("client_id", "user_id")
                .unionByName(orders.where(later).select("client_id", "user_id"))
                .distinct())


@dataclass
class _Rewrite:
    """One table's part of a full recompute, computed before anything is written (R3)."""

    spec: TableSpec
    topic: str
    stored: DataFrame
    kept: DataFrame  # the stored rows left to the stream (R2, R9, R14)
    fresh: DataFrame  # the client's rows as rewritten, with their revisions
    retracted: DataFrame  # keys of ``stored`` that ``fresh`` no longer has
    read_version: int


def _rewrite_client(run: Run, started: float) -> FullRecomputeSummary:
    config, tables, spark, client_id = run.config, run.tables, run.spark, run.client_id
    mine = {"client_id": client_id}
    watermark = stream_watermark_ms(config, client_id)
    users = ["client_id", "user_id"]
    # What it rewrites is read before what it rewrites it from (R6).
    stored_of: dict[str, tuple[DataFrame, int]] = {}
    for spec in (SESSIONS, ATTRIBUTIONS):
        version = tables.version(spec.name)  # TABLE_MISSING (-1): a table created since conflicts
        stored_of[spec.name] = (tables.read(
            spec.name, partition_filter=mine, schema=spec.schema,
            version=None if version == TABLE_MISSING else version), version)
    pageviews = tables.read(PAGEVIEWS.name, partition_filter=mine, schema=PAGEVIEWS.schema)
    orders = tables.read(ORDERS.name, partition_filter=mine, schema=ORDERS.schema)
    active = (_users_the_stream_holds(pageviews, orders, watermark - config.session_gap_ms)
              if watermark is not None
              else spark.createDataFrame([], "client_id string, user_id string"))
    rewritten_orders = orders.join(active, users, "left_anti")
    held_orders = orders.join(active, users, "left_semi")
    # Keys kept whoever's they are stored as: an order a held user has now (R8).
    held_keys = {ATTRIBUTIONS.name: held_orders.select("order_id")}
    # A held user's own copy of an order id a rewritten user holds too (C14) stays (R14).
    own_copies = {ATTRIBUTIONS.name: held_orders.select("order_id", *users)}
    emitted = keep(sessionize_frames(pageviews.join(active, users, "left_anti"),
                                     rewritten_orders, config.session_gap_ms, BUCKETS))
    session_rows, attribution_rows = _session_rows(emitted), _attribution_rows(emitted)
    # Before anything is recorded, rewritten or published, as for every correction (R11).
    gate_recomputed_sessions(run, session_rows, attribution_rows, rewritten_orders)
    run_seq = next_plan_seq(run)
    rewrites: list[_Rewrite] = []
    changes: list[DataFrame] = []
    for spec, rows, topic, date_column, entity in (
            (SESSIONS, session_rows, config.sessions_topic, "session_date", "session"),
            (ATTRIBUTIONS, attribution_rows, config.attributions_topic, "order_date",
             "attribution")):
        (key,) = spec.key
        stored, read_version = stored_of[spec.name]
        held = stored.join(active, users, "left_semi").select(key)
        if spec.name in held_keys:  # (R8)
            held = held.unionByName(held_keys[spec.name]).distinct()
        # A held user's row of a key the rewrite writes is an order moved away from it (R9),
        # unless the user still holds that order: then it is the user's copy of it (R14).
        kept = stored.join(held, key, "left_semi").join(rows.select(key), key, "left_anti")
        if spec.name in own_copies:
            kept = kept.unionByName(stored.join(own_copies[spec.name], [key, *users], "left_semi")
                                    .join(rows.select(key), key, "left_semi"))
        # Read by the diff, the replace and the publish: once, not a scan of the client each.
        kept = kept.persist()
        # A key's copies (an order id two users hold, C14) pair as the diff pairs them (R13): by
        # key alone, each stored copy met each new one and the rewrite multiplied them.
        copies_by = COPIES_BY[entity]
        old = stored.join(kept.select(key, *copies_by), [key, *copies_by], "left_anti")
        content = [c for c in rows.columns if c not in (key, "revision")]
        same = ~_differs(tuple(content))  # the comparison diff() makes
        old_side, new_side, on = pair_copies(old, rows, key, copies_by)
        fresh = new_side.alias("n").join(old_side.alias("o"), on, "left").select(
            *[F.col(f"n.{c}").alias(c) for c in rows.columns],
            F.when(F.col("o.revision").isNull(), F.lit(1))
            .when(same, F.col("o.revision"))
            .otherwise(F.col("o.revision") + 1).cast("int").alias("revision"),
        ).select(*spec.schema.fieldNames()).persist()
        retracted = old.join(fresh.select(key), key, "left_anti").select(
            F.col(key).alias("key")).persist()
        # The same changes as corrections rows: the audit trail of every run (R3).
        # Retracted attributions too, as their tombstones below are (R8).
        changes.append(diff(old, rows, spec, tuple(content), date_column, entity, run, run_seq,
                            copies_by=copies_by))
        rewrites.append(_Rewrite(spec, topic, stored, kept, fresh, retracted, read_version))
    plan = keep(reduce(DataFrame.unionByName, changes))
    planned = not plan.isEmpty()
    # The plan's record and both tables' rewrites are one read point group (corrections
    # C16); one whose plan is recorded is closed by the run that finishes the plan, if this
    # one stops part way (killed with an empty plan: by its own rerun).
    read_point.open_group(config, tables, run.run_id, client_id)
    try:
        if planned:
            record_plan(run, plan, run_seq)  # a crash from here on leaves it to be finished (C6)
        since = publish_started(config)
        _replace_rewritten(run, rewrites)
    except BaseException as error:
        # An empty plan: the rewrite changes nothing, a part of it is not half of a change.
        with noted_on(error, "closing its read point group"):
            if not planned or not plan_recorded(run, run_seq):
                read_point.close_group(config, tables, run.run_id)
        raise
    read_point.close_group(config, tables, run.run_id)
    if planned:
        gate_publish(run, plan, since)  # (R11) failing, the plan stays to be finished (C6)
        mark_published(run, plan)
    counts = {r.spec.name: r.fresh.count() for r in rewrites}
    gone = next(r.retracted.count() for r in rewrites if r.spec is SESSIONS)
    held = active.count()
    release(emitted, plan, active,
            *(f for r in rewrites for f in (r.fresh, r.retracted, r.kept)))
    return FullRecomputeSummary(client_id, counts[SESSIONS.name], counts[ATTRIBUTIONS.name],
                                time.monotonic() - started, gone, held)


def _replace_rewritten(run: Run, rewrites: list[_Rewrite]) -> None:
    """Each table's rewrite: tombstones, the replace, then its rows on the topic."""
    config, tables, client_id = run.config, run.tables, run.client_id
    mine = {"client_id": client_id}
    for rewrite in rewrites:
        spec, topic, stored, fresh, retracted = (rewrite.spec, rewrite.topic, rewrite.stored,
                                                 rewrite.fresh, rewrite.retracted)
        (key,) = spec.key
        # Sent before the replace: a rerun would no longer find these rows to retract.
        publish_pairs(config, topic, retracted.select("key", F.lit(None).cast("string")))
        version = (tables.app_version(spec.name, f"full-recompute-{client_id}") or 0) + 1
        try:
            tables.replace_partitions(
                spec.name, fresh.unionByName(rewrite.kept),
                predicate=mine, partition_by=spec.partition_by,
                app_id=f"full-recompute-{client_id}", version=version,
                read_version=rewrite.read_version,
                metadata={"run_id": f"full-{version}", "cause": f"full recompute of {client_id}"})
        except CommitConflictError as exc:
            refused = (
                f"full recompute of {client_id}: table {spec.name!r} changed while it ran (the "
                "sessionizer or a correction run on another machine committed into the "
                f"client's rows); it was not rewritten"
                f"{' (sessions were, and published)' if spec is ATTRIBUTIONS else ''}. Its "
                "changes are recorded as the client's unpublished plan: the next correction "
                "run of the client (a rerun of this one too) applies and publishes them")
            # The table keeps the rows the tombstones retracted: the topic gets them back.
            try:
                publish_rows(config, topic, stored.join(
                    retracted.select(F.col("key").alias(key)), key, "left_semi"), spec)
            except Exception as put_back:
                raise ClickstreamError(
                    f"{refused}; sending back to {topic} the rows its tombstones retracted "
                    f"failed as well ({typed_error_line(put_back)}): until that run, the "
                    f"topic lacks rows table {spec.name!r} holds") from put_back
            raise ClickstreamError(refused) from exc
        # Each table's view once it is committed; with the rows it left to the stream too: a
        # superseded plan (R7) may have applied some unpublished. A key fresh also has (an
        # order id's other copy, R14) goes out with fresh's revision, as planned.
        publish_rows(config, topic, fresh.unionByName(
            rewrite.kept.join(fresh.select(key), key, "left_anti")), spec)
