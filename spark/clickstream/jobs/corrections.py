"""Recompute only the affected sessions of one client, record the changes, apply, republish.

Shared by ``backfill`` and ``recompute``. The unit of work is a *scope*: per (client, user) a
time range that received new or changed pageviews/orders. Steps:

1. **windows** — each user's range grows to cover every stored session within one gap of it
   (found in the ``sessions`` table, read with partition pruning on client and day), so the
   window's sessions can be recomputed from the window's rows alone (C1);
2. **recompute** — pageview scopes re-sessionize the window's pageviews with the same
   ``semantics`` the stream uses; order-only scopes keep boundaries and only re-attribute (C2);
3. **plan** — diff against what is stored: created / updated (revision + 1) / retracted
   sessions and attributions, written to ``corrections`` first, each row carrying the new
   value, under the run's application transaction;
4. **apply** — one ``replace_partitions`` commit per table over the affected (client, day)
   partitions, so a reader sees all of the client's changes to that table or none;
5. **publish** — the plan's rows to Kafka: new revisions, tombstones for retractions.

A rerun of the same run id finds its plan in ``corrections`` and resumes at apply/publish, so a
crash anywhere leaves no duplicated corrections and the same final tables and topics (C3).
Plans of one client are applied and published one at a time, in order (C6).

Known edge cases, cited inline as (C1)..(C15):
  C1. Two sessions of a user are >= gap apart, so a session outside the grown window cannot
      merge with anything inside it: recomputing the window alone equals recomputing all.
      A session is stored under the day it starts, so one that began days before the range
      is found through the largest ``session_end`` of each earlier day (``_session_days``).
  C2. Orders never move boundaries: an orders-only correction reads no pageviews (beyond the
      few recent days C4 reads beside a running stream).
  C3. The plan is the ``corrections`` rows of the run. The run that records it goes on with
      the recorded frame itself; a resumed run (or a later step) reads it back.
  C4. Sessions the stream has not closed yet belong to the stream: scopes reaching them are
      deferred and stay queued. A scope reaches them when its window ends within one gap of
      the watermark of the stream's last committed micro-batch, or of the start of the user's
      (earliest) open session. Open sessions are not in ``sessions``; a user has one only if a
      stored pageview of it is later than ``watermark - gap``, and its start is found by
      sessionizing the user's stored pageviews, read back as many days as the session
      reaches (``open_session_starts``). A backfill queues its rows of the deferred
      users (``defer``) before the plan is recorded: a resumed run reads the plan back
      instead of planning, so queueing after it would be skipped for good. Its rows the
      stream could still receive on time were queued before its merge (``sessionize`` Z11).
  C5. The stored ``sessions`` and ``attributions`` a run plans from are a snapshot (one table
      version, the client's days in reach), kept until apply rewrites those days from it: each
      affected partition is read once. The replace names the version it was computed from, so
      if another writer committed into those days since, the table layer refuses it and
      apply reads the days again at the new version (commits to other days do not matter).
  C6. A plan interrupted before it was published must reach Kafka before any later plan of
      the client: a later plan is diffed against tables that may already hold the first
      one's changes, so it would never publish them, and re-publishing an old plan after a
      newer one would put older revisions back on the topic. Each client's plans are
      numbered (the run's step in ``corrections``) and a marker step records the last one
      published; a run starts by finishing the client's unpublished plan, its own (resumed)
      or another run's. A rerun of a finished run plans again (usually: nothing changes).
      A run reads its scope only after that (``ScopeReader``): read before, it missed where
      the plan it finished first had moved an order (C7), and that session kept the order
      in its totals. Finished as the run that planned it, a backfill's plan also gets that
      run's summary page saying who finished it (``run_summary.write_plan_taken_over``): the
      failed summary it wrote when its publish failed kept its row red in the quality index
      once all it planned was on the topics.
  C7. A later batch may move an order to another user or day (same ``order_id``). Its old
      attribution is in the plan's windows (``backfill.scope_of`` adds where it was), the
      user is part of the compared content, and a plan row's ``partition_date`` is the stored
      row's partition: apply removes the key there and writes the new row into its own
      partition, so the order is never held twice.
  C8. A moved order (C7) whose user's window is deferred (C4) is queued where it now is; the
      stored attribution stays where it was. The recompute that folds the queued row in adds
      where the order is attributed to its scope, as every plan does (C11): planned from the
      queued row alone, its window missed the stored row on another day, so apply wrote the
      order on its new day and left it on the old one (held twice, the topic once), and the
      old session kept it in its totals.
  C9. A moved order's new user waits while its old user (where it is attributed) is
      deferred (C4): ``with_moved_orders_users``, from the scope's ``moved_with`` (for where
      an order was, the user it moved to). Planned alone, the new user's window did not hold
      the stored attribution, another user's, so apply wrote the order in its new place and
      left it in the old one (held twice, the topic once), and the old session kept it in
      its totals; the order's row is the new user's, so nothing was queued for the old one
      and no recompute corrected it. Deferred too, its row is queued and the recompute that
      folds it in plans both users (C8). The other way round needs nothing: the old user is
      planned now (its session loses the order) and the attribution moves with the queued row.
  C10. An order the stream received on time is in ``orders`` but in no attribution while the
      stream holds it in an open session. A batch that moves it finds its old place in
      ``orders`` as it was before the batch's merge (``stored_elsewhere``), not in
      ``attributions``: from there only, its old user was planned as if the order had never
      been there, the new one was planned alone, and the stream later emitted the old
      session with the order in its totals and appended the order's attribution there (the
      stream only appends): held twice, counted in the old session. Now the old user is in
      the scope, so it is deferred while the stream holds it and the new user with it (C9);
      the old place is queued too (``queued_by`` ends in ``MOVED_AWAY``). The stream writes
      no attribution of an order a backfill queued (``sessionize`` Z11), and the recompute
      that folds the old place in takes the order out of the old session.
  C11. Until a recompute folds a C8 row in, the order is stored where it now is and
      attributed where it was. Another run whose windows reach its new place (a batch of
      that user once the stream let go) found it there with no stored attribution in its
      windows: it planned a new one at revision 1 beside the stored one, held twice and
      republished at a lower revision; a recompute that then met both rows could write it
      twice. Every plan now grows its scope to where the orders queued for its users are
      attributed (``with_queued_orders_places``, through those places' users too), so the
      first run to plan the new place moves the order, as C7 does.
  C12. An orders-only recompute passes the Python worker only the stored sessions an order
      of the windows could belong to, and those holding orders: a session holds an order with
      ``start <= ts < end + gap``, so the order's day is one of the days from the session's
      start to its end plus a gap (``_may_hold_orders``). That is a pruning, not the rule:
      which of them an order belongs to is still decided by ``semantics``. The others have
      no order before or after, so their totals cannot change.
  C13. Between a batch's merge and its plan (two tasks of the DAG, or a run killed after its
      merge), the batch's moved orders are stored where they now are and attributed where
      they were. Another run whose windows reach the new place found no attribution of the
      order there: it created one at revision 1 and left the old place out of its plan, so
      the old session kept the order in its totals for good (the batch's plan then found the
      order attributed where it now is, C7, and never planned the old place), and an old
      place on another day held the order a second time until then. A plan that would
      create an attribution the client holds elsewhere (``attributed_elsewhere``) is planned
      again with those places in its scope, as C11 does up front for the queued orders: only
      a plan creating attributions reads the client's attributions, and only one that finds
      such an order plans twice. A place ``orders`` still holds is not one: an id two users'
      copies share (``sessionize`` Z12) is attributed at each.
  C14. Those copies (an order id reused for two users, Z12) are two attributions of one key.
      Paired by key alone, the diff met each stored copy with each new one: a plan reaching
      both users recorded four updates and apply stored each copy twice, one reaching a user
      whose copy only the table kept (one micro-batch) stored that user's new row twice, and
      the applied check failed any plan of that day, about that order or not, on the key
      "held twice". An order id with one copy on each side still pairs by key (a later batch
      may move the order to another user, C7); with more, copies pair by user and time (a
      user's copy sent again under another time is one too). Apply removes the stored copies
      the plan writes (all of the key's copies when none is one of them: the move), and the
      applied check matches and counts copies by user and time, among the plan's keys only.
      The topic keeps one record per key, so the publish gate passes a key with several
      planned copies when its last record is at one of their revisions: it wanted each copy's
      revision last, and a plan whose copies were at different revisions (a 2 -> 3, b 1 -> 2)
      failed for good, stopping every later correction of the client. The copies are sent in
      no set order: which one the topic keeps is not defined (README's Known limits).
  C15. A plan a full recompute superseded (it failed its applied check, ``recompute`` R7) is
      marked published so no run finishes it, with the superseding run in the mark's commit
      (``superseded_by``). The plan's own steps, retried after it, said it was applied,
      checked and published, each record of it, and the run's page went green over the page
      that said it was superseded; they now say it was superseded, and publish nothing.
  C16. A client's changes are shown together (issue #3): a plan is recorded in
      ``corrections``, then apply commits ``sessions`` and ``attributions`` (and a backfill's
      merge ``pageviews`` or ``orders`` before all), so the plan's run is a read point group
      of the client (``io.read_point``), opened by the backfill's merge or by the plan's
      record (apply opens it too, for a plan recorded by an older release), and closed once
      apply committed both tables, or by a plan that found nothing to apply. Readers of the
      read point see the client as it was until then. A run killed after its plan was
      recorded leaves it open until a run of the client finishes the plan (C6); a backfill
      killed between its merge and its plan's record, until its own rerun.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, date, datetime, timedelta
from functools import reduce

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream.config import Config
from clickstream.errors import (
    ClickstreamError,
    CommitConflictError,
    PlanNotAppliedError,
    noted_on,
)
from clickstream.events import contract
from clickstream.io import read_point
from clickstream.io.delta_tables import TABLE_MISSING, DeltaTables
from clickstream.io.kafka_changelog import (
    check_changelogs_answer,
    publish_correction,
    spark_row_value,
)
from clickstream.key_copies import COPIES_BY, COPY_COUNT, count_copies, pair_copies, same_columns
from clickstream.locks import LOCKS_FOLDER, exclusive
from clickstream.quality.correction_report import (
    CorrectionFigures,
    correction_figures,
    write_correction_report,
)
from clickstream.quality.gates import (
    FULL_RECOMPUTE_JOB,
    gate_publish,
    gate_recomputed_sessions,
    publish_started,
)
from clickstream.quality.gates import enabled as gates_enabled
from clickstream.quality.reports import safe_name
from clickstream.quality.run_summary import write_plan_taken_over
from clickstream.sessions.batch_adapter import (
    amount_from_e4,
    reattribute_frames,
    sessionize_frames,
)
from clickstream.spark_session import broadcast_up_to_cap, keep, release
from clickstream.tables import (
    ATTRIBUTIONS,
    BACKFILL_QUEUED_BY,
    CORRECTIONS,
    MOVED_AWAY,
    ORDERS,
    PAGEVIEWS,
    RECOMPUTE_QUEUE,
    SESSIONS,
)

BUCKETS = 16
USER_KEY = ["client_id", "user_id"]
SESSION_CONTENT = ("session_start", "session_end", "pageview_count", "landing_url", "exit_url",
                   "order_count", "revenue")
# user_id too: a later batch may move an order to another user (C7).
ATTRIBUTION_CONTENT = ("user_id", "order_ts", "session_id")


@dataclass
class CorrectionSummary:
    """What one correction run changed (printed at the end of backfill and recompute)."""

    sessions_created: int = 0
    sessions_updated: int = 0
    sessions_retracted: int = 0
    orders_attributed: int = 0
    orders_unattributed: int = 0
    attributions_changed: int = 0
    deferred_users: int = 0
    # Rows of the deferred users a backfill queued for the stream (``defer``): it changed
    # ``recompute_queue`` (``changed_tables``).
    queued_for_the_stream: int = 0
    resumed: bool = False
    # A resumed plan's orders attributed / unattributed and users deferred, read back from
    # the commit that recorded it (``PLAN_TOTALS``); false for a plan recorded without them.
    totals_recorded: bool = False
    # An earlier attempt of the run (a backfill's run id is its batch's) recorded, applied and
    # published the counted plan; this one found nothing left to change (``count_earlier_plan``).
    published_earlier: bool = False
    # The full recompute that superseded the run's stored plan (C15): this attempt found
    # nothing left to change, and the plan's changes are neither applied nor published by it.
    superseded_by: str | None = None
    # Changes of another run's interrupted plan this run finished first (C6): not this run's
    # corrections, but tables it changed (``changed_tables``).
    finished_sessions: int = 0
    finished_attributions: int = 0
    seconds_by_step: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        steps = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds_by_step.items())
        if self.finished_sessions or self.finished_attributions:
            steps = (f"finished another run's interrupted plan first ({self.finished_sessions} "
                     f"session and {self.finished_attributions} attribution changes)"
                     + (f"; {steps}" if steps else ""))
        steps = steps or "no step ran"  # (nothing to do)
        changed = (f"sessions created {self.sessions_created}, updated "
                   f"{self.sessions_updated}, retracted {self.sessions_retracted}; ")
        if self.superseded_by:
            return (changed + f"{self.attributions_changed} attribution changes [nothing left "
                    f"to change: the run's plan was superseded by {self.superseded_by}, which "
                    f"rewrote and published the client's tables]; {steps}")
        if self.published_earlier:  # as below: the counts are the stored plan's
            return (changed + f"{self.attributions_changed} attribution changes [applied and "
                    "published by an earlier attempt of this run: nothing left to change]; "
                    f"{steps}")
        if self.resumed and not self.totals_recorded:  # a plan recorded before its totals were
            return (changed + f"{self.attributions_changed} attribution changes [resumed a "
                    "planned run: its orders attributed and users deferred were counted by the "
                    f"run that planned it]; {steps}")
        resumed = " [resumed a planned run: totals as it recorded them]" if self.resumed else ""
        return (changed + f"orders attributed {self.orders_attributed}, unattributed "
                f"{self.orders_unattributed} ({self.attributions_changed} attribution changes); "
                f"{self.deferred_users} users deferred to the stream{resumed}; {steps}")

    def changed_tables(self) -> list[str]:
        """The tables the run changed (the DAGs announce them as Asset events): with its own
        corrections, those of another run's plan it finished."""
        sessions = bool(self.sessions_created or self.sessions_updated
                        or self.sessions_retracted or self.finished_sessions)
        attributions = bool(self.attributions_changed or self.finished_attributions)
        return [table for table, changed in ((SESSIONS.name, sessions),
                                             (ATTRIBUTIONS.name, attributions),
                                             (CORRECTIONS.name, sessions or attributions),
                                             (RECOMPUTE_QUEUE.name, self.queued_for_the_stream))
                if changed]

    def and_then(self, later: CorrectionSummary) -> CorrectionSummary:
        """This pass followed by a later pass of the same run (``recompute`` plans again after
        finishing its resumed plan, to find the users it leaves to the stream)."""
        steps = dict(self.seconds_by_step)
        for step, seconds in later.seconds_by_step.items():
            steps[step] = steps.get(step, 0) + seconds
        counts = {f.name: getattr(self, f.name) + getattr(later, f.name) for f in fields(self)
                  if f.type == "int"}
        # The later pass plans the same queue rows again (the run id is the queue version's):
        # it tallies the same windows' orders and finds the resumed plan's users deferred
        # (PLAN_TOTALS, still queued) again, so these totals are its own, not a sum.
        for name in PLAN_TOTALS:
            counts[name] = getattr(later, name)
        return CorrectionSummary(**counts, resumed=self.resumed or later.resumed,
                                 totals_recorded=self.totals_recorded or later.totals_recorded,
                                 published_earlier=self.published_earlier
                                 or later.published_earlier,
                                 superseded_by=self.superseded_by or later.superseded_by,
                                 seconds_by_step=steps)


@dataclass(frozen=True)
class Snapshot:
    """A client's rows of one table over some days at one table version, persisted (C5)."""

    version: int
    dates: frozenset[date] | None  # None: all of the client's days
    rows: DataFrame

    def covers(self, dates: list[date]) -> bool:
        return self.dates is None or self.dates.issuperset(dates)


@dataclass
class Run:
    """One correction run of one client."""

    spark: SparkSession
    config: Config
    tables: DeltaTables
    client_id: str
    run_id: str
    cause: str
    progress: Callable[[str], None] = print
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    # The step its plan will be, taken by resume() before it reads anything (C6).
    next_seq: int | None = None

    def release_snapshots(self) -> None:
        release(*(snapshot.rows for snapshot in self.snapshots.values()))
        self.snapshots.clear()

    @property
    def app_id(self) -> str:
        return f"corrections-{self.client_id}"

    @property
    def published_app_id(self) -> str:
        """Records, in ``corrections``, the last plan of the client that reached Kafka (C6)."""
        return f"published-corrections-{self.client_id}"  # no plan's app id starts so

    @property
    def gap_ms(self) -> int:
        return self.config.session_gap_ms


class Timer:
    """Prints progress per step and records its duration in the summary."""

    def __init__(self, summary: CorrectionSummary, progress: Callable[[str], None]) -> None:
        self.summary, self.progress = summary, progress

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self.progress(f"  {name} ...")
        yield
        elapsed = time.monotonic() - started
        self.summary.seconds_by_step[name] = self.summary.seconds_by_step.get(name, 0) + elapsed
        self.progress(f"  {name}: {elapsed:.1f}s")


def _ms(column: str | Column) -> Column:
    return F.unix_millis(F.col(column) if isinstance(column, str) else column)


def _dates(lo_ms: int, hi_ms: int, pad_days: int = 1) -> list[date]:
    """Calendar days (UTC) covering [lo, hi], padded, for partition pruning."""
    first = datetime.fromtimestamp(lo_ms / 1000, tz=UTC).date() - timedelta(days=pad_days)
    last = datetime.fromtimestamp(hi_ms / 1000, tz=UTC).date() + timedelta(days=pad_days)
    return _days(first, last)


def _days(first: date, last: date) -> list[date]:
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def _read_days(run: Run, spec, date_column: str, dates: list[date],
               version: int | None = None) -> DataFrame:
    """The client's rows of ``spec`` on ``dates`` (partition pruning on client and day)."""
    return run.tables.read(spec.name, partition_filter={"client_id": run.client_id,
                                                        date_column: dates},
                           schema=spec.schema, version=version)


def _snapshot(run: Run, spec, date_column: str, dates: list[date]) -> DataFrame:
    """The client's rows of ``spec`` on ``dates``, kept for apply (C5)."""
    version = run.tables.version(spec.name)
    rows = _read_days(run, spec, date_column, dates, version if version >= 0 else None)
    previous = run.snapshots.get(spec.name)
    if previous is not None:
        release(previous.rows)
    rows = keep(rows)  # one scan; two uses in one job would both scan the files
    run.snapshots[spec.name] = Snapshot(version, frozenset(dates), rows)
    return rows


def grow_windows(run: Run, scope: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(windows per user [lo_ms, hi_ms], kept; stored sessions inside them) (C1).

    The sessions are a filter of the run's snapshot (C5), cheap to evaluate again: caching a
    second copy of most of a client's sessions would cost more memory than it saves."""
    scope = scope.groupBy("client_id", "user_id").agg(F.min("lo_ms").alias("lo_ms"),
                                                      F.max("hi_ms").alias("hi_ms"))
    bounds = scope.agg(F.min("lo_ms"), F.max("hi_ms")).first()
    if bounds is None or bounds[0] is None:
        return scope, run.spark.createDataFrame([], SESSIONS.schema)
    # The scope's users' stored sessions in the range, read once for both joins below (C5).
    sessions = _snapshot(run, SESSIONS, "session_date", _session_days(run, *bounds)).join(
        scope.select("client_id", "user_id"), ["client_id", "user_id"], "left_semi")
    near = sessions.join(scope, ["client_id", "user_id"]).where(
        (_ms("session_start") - run.gap_ms < F.col("hi_ms"))
        & (_ms("session_end") + run.gap_ms > F.col("lo_ms")))
    grown = near.groupBy("client_id", "user_id").agg(
        F.min(_ms("session_start")).alias("s_lo"), F.max(_ms("session_end")).alias("s_hi"))
    windows = keep(scope.join(grown, ["client_id", "user_id"], "left").select(
        "client_id", "user_id", F.least("lo_ms", F.coalesce("s_lo", "lo_ms")).alias("lo_ms"),
        F.greatest("hi_ms", F.coalesce("s_hi", "hi_ms")).alias("hi_ms")))
    inside = sessions.join(windows, ["client_id", "user_id"]).where(
        (_ms("session_start") >= F.col("lo_ms")) & (_ms("session_end") <= F.col("hi_ms"))
    ).select(*SESSIONS.schema.fieldNames())
    return windows, inside


def _session_days(run: Run, lo_ms: int, hi_ms: int) -> list[date]:
    """The days of the client's ``sessions`` partitions that may hold a session within one
    gap of [lo, hi] (C1): a session is stored under the day it starts, so besides the days
    around the range, an earlier day counts if one of its sessions ends after ``lo - gap``
    (a session longer than a day), known from the files' statistics where there are any."""
    days = _dates(lo_ms - run.gap_ms, hi_ms + run.gap_ms)
    ends = run.tables.largest_by_partition(SESSIONS.name, "session_end", "session_date",
                                           {"client_id": run.client_id})
    earlier = [day for day, end in ends.items() if day < days[0] and (
        end is None or int(end.timestamp() * 1000) + run.gap_ms > lo_ms)]
    return sorted(earlier) + days


def _in_windows(frame: DataFrame, windows: DataFrame, ts: str, end_pad_ms: int) -> DataFrame:
    """Rows with ``lo <= ts < hi + end_pad_ms`` of their user's window."""
    return frame.join(windows, ["client_id", "user_id"]).where(
        (F.col(ts) >= F.timestamp_millis("lo_ms"))
        & (F.col(ts) < F.timestamp_millis(F.col("hi_ms") + end_pad_ms))
    ).drop("lo_ms", "hi_ms")


def _session_rows(emitted: DataFrame) -> DataFrame:
    return emitted.where(F.col("kind") == "session").select(
        "session_id", "client_id", "user_id",
        F.timestamp_millis("start_ms").alias("session_start"),
        F.timestamp_millis("end_ms").alias("session_end"), "pageview_count", "landing_url",
        "exit_url", "order_count", amount_from_e4("revenue_e4").alias("revenue"),
        F.to_date(F.timestamp_millis("start_ms")).alias("session_date"))


def _attribution_rows(emitted: DataFrame) -> DataFrame:
    return emitted.where(F.col("kind") == "attribution").select(
        F.col("record_id").alias("order_id"), "client_id", "user_id",
        F.timestamp_millis("record_ts_ms").alias("order_ts"), "session_id",
        F.to_date(F.timestamp_millis("record_ts_ms")).alias("order_date"))


@dataclass(frozen=True)
class Windows:
    """Per user [lo_ms, hi_ms], and the range they span together (for partition pruning)."""

    per_user: DataFrame
    lo_ms: int | None
    hi_ms: int | None

    @classmethod
    def of(cls, per_user: DataFrame) -> Windows:
        """The range is None, None when there are no windows."""
        lo, hi = per_user.agg(F.min("lo_ms"), F.max("hi_ms")).first()
        return cls(per_user, lo, hi)

    def rows_of(self, run: Run, spec, date_column: str, ts: str, end_pad_ms: int,
                keep_for_apply: bool = False) -> DataFrame:
        """The client's stored rows of ``spec`` with ``lo <= ts < hi + end_pad_ms``; from the
        run's snapshot of ``spec`` if it holds those days at the table's current version."""
        dates = _dates(self.lo_ms, self.hi_ms + run.gap_ms)
        held = run.snapshots.get(spec.name)
        if keep_for_apply:
            stored = _snapshot(run, spec, date_column, dates)
        elif (held is not None and held.covers(dates)
              and held.version == run.tables.version(spec.name)):
            stored = held.rows.where(F.col(date_column).isin(dates))
        else:
            stored = _read_days(run, spec, date_column, dates)
        return _in_windows(stored, self.per_user, ts, end_pad_ms)


def window_orders(run: Run, windows: Windows) -> DataFrame:
    """The stored orders attributable to the windows' sessions: an order belongs to a session
    with ``start <= ts < end + gap``, so one at ``hi + gap`` is left to the session that may
    start there, outside the window (C1)."""
    return windows.rows_of(run, ORDERS, "event_date", "ts", run.gap_ms)


@dataclass(frozen=True)
class Recomputed:
    """What a recompute produced (no revisions yet)."""

    sessions: DataFrame  # the sessions as they now are that the gate checks (see _reattributed)
    before: DataFrame  # the stored sessions to diff ...
    after: DataFrame  # ... against these
    attributions: DataFrame  # every order of the windows and its session
    retract: bool  # whether a stored session missing from ``after`` is retracted
    held: tuple[DataFrame, ...]  # the kept frames all of the above are computed from

    def release(self) -> None:
        release(*self.held)


def recompute(run: Run, windows: Windows, old_sessions: DataFrame, orders: DataFrame,
              orders_only: bool) -> Recomputed:
    """New sessions and attributions inside the windows.

    Both come from one pass of the Python worker, kept (each would otherwise run it again)."""
    if orders_only:
        order_days = keep(_order_days(orders))
        # Kept: the Python worker's pass and _reattributed's join would each filter the
        # client's sessions again.
        old_sessions = keep(_may_hold_orders(old_sessions, order_days, run.gap_ms))  # (C12)
        emitted = reattribute_frames(old_sessions, orders, run.gap_ms, BUCKETS)  # (C2)
    else:
        pageviews = windows.rows_of(run, PAGEVIEWS, "event_date", "ts", 1)  # up to hi
        emitted = sessionize_frames(pageviews, orders, run.gap_ms, BUCKETS)
    emitted = keep(emitted)
    attributions = _attribution_rows(emitted)
    if orders_only:
        return _reattributed(_session_rows(emitted), old_sessions, attributions,
                             (emitted, order_days, old_sessions))
    sessions = _session_rows(emitted)
    return Recomputed(sessions, old_sessions, sessions, attributions, retract=True,
                      held=(emitted,))


def _order_days(orders: DataFrame) -> DataFrame:
    """Per user, the days (UTC, as ``session_date``) on which ``orders`` hold an order."""
    return orders.groupBy(*USER_KEY).agg(F.collect_set(F.to_date("ts")).alias("order_days"))


def _may_hold_orders(sessions: DataFrame, order_days: DataFrame, gap_ms: int) -> DataFrame:
    """The sessions an order on ``order_days`` may belong to, and those holding orders (C12).

    A year of orders reaches every day of most users, yet only the sessions of the days
    they ordered on can hold them: a third of a client's sessions in the benchmark, and the
    Python worker's pass and the join after it shrink with them. The days per user are
    sent to every task, as apply's keys are, up to the broadcast cap of (user, day) pairs:
    the sessions are then filtered where they are, without a shuffle."""
    pairs = order_days.select(F.sum(F.size("order_days"))).first()[0] or 0
    days = broadcast_up_to_cap(order_days, pairs)
    first = F.to_date("session_start")
    last = F.to_date(F.timestamp_millis(_ms("session_end") + gap_ms))
    reached = F.when(first == last, F.array_contains("order_days", first)).otherwise(
        F.arrays_overlap(F.sequence(first, last), "order_days"))  # most sessions: one day
    return sessions.join(days, USER_KEY, "left").where(
        (F.col("order_count") > 0) | reached).drop("order_days")


def _reattributed(changed: DataFrame, old_sessions: DataFrame, attributions: DataFrame,
                  held: tuple[DataFrame, ...]) -> Recomputed:
    """Orders only: the sessions whose totals changed are diffed, the rest keep their stored
    rows (C2).

    The gate sees every session the run's orders touch with its totals: the changed ones, the
    ones an order is attributed to, and the ones that held orders before. So a total the
    Python worker wrongly reported as unchanged still cannot pass (such a session has orders
    now or had some before), while sessions without orders before or after, whose boundaries
    and totals the run cannot change, are not checked again: the gate's work grows with the
    batch, not with the client's history. URLs are left out (not checked; most of a
    session's bytes).

    The stored sessions are joined to the new totals once: that one frame holds the checked
    sessions, and the changed ones both as stored (``before``) and as they now are
    (``after``). Each further join of the stored sessions would evaluate them again (a filter
    of the snapshot by the windows) and shuffle all of them."""
    totals = changed.select("session_id", F.col("order_count").alias("new_count"),
                            F.col("revenue").alias("new_revenue"))
    touched = totals.join(attributions.where(F.col("session_id").isNotNull())
                          .select("session_id").distinct(), "session_id", "full_outer"
                          ).withColumn("_touched", F.lit(True))
    joined = keep(old_sessions.join(touched, "session_id", "left").where(
        F.col("_touched") | (F.col("order_count") > 0)))
    stored = SESSIONS.schema.fieldNames()
    kept = {"order_count": F.coalesce("new_count", "order_count").cast("int"),
            "revenue": F.coalesce("new_revenue", "revenue")}
    now = {c: kept.get(c, F.col(c)).alias(c) for c in stored if c != "revision"}
    changed_rows = joined.where(F.col("new_count").isNotNull())
    return Recomputed(
        sessions=joined.select(*(v for c, v in now.items() if not c.endswith("_url"))),
        before=changed_rows.select(*stored), after=changed_rows.select(*now.values()),
        attributions=attributions, retract=False, held=(joined, *held))


def _differs(columns: tuple[str, ...]) -> Column:
    return ~F.expr(" AND ".join(f"(o.{c} <=> n.{c})" for c in columns))


def diff(old: DataFrame, new: DataFrame, spec, content: tuple[str, ...],
         date_column: str, entity: str, run: Run, run_seq: int,
         retract: bool = True, copies_by: tuple[str, ...] = ()) -> DataFrame:
    """Correction rows (CORRECTIONS layout) for every key whose content changed; a row's
    ``new_value`` is its changelog value, published as is. ``copies_by``: the columns that
    tell a key's copies apart, paired by them where a side holds more than one (C14)."""
    key = spec.key[0]
    new_columns = new.columns
    old, new, on = pair_copies(old, new, key, copies_by)
    joined = old.alias("o").join(new.alias("n"), on, "full_outer")
    change = (F.when(F.col(f"o.{key}").isNull(), F.lit("created"))
              .when(F.col(f"n.{key}").isNull(), F.lit("retracted") if retract else F.lit(None))
              .when(_differs(content), F.lit("updated")))
    new_revision = F.when(F.col(f"o.{key}").isNull(), F.lit(1)).when(
        F.col(f"n.{key}").isNotNull(), F.col("o.revision") + 1)
    new_value = F.when(F.col(f"n.{key}").isNotNull(), spark_row_value(
        {**{c: F.col(f"n.{c}") for c in new_columns}, "revision": new_revision}, spec.schema))
    return joined.select(
        F.lit(run.run_id).alias("run_id"), F.lit(run_seq).cast("long").alias("run_seq"),
        F.lit(run.client_id).alias("client_id"), F.lit(entity).alias("entity"),
        F.coalesce(f"n.{key}", f"o.{key}").alias("key"), change.alias("change"),
        F.col("o.revision").alias("old_revision"),
        new_revision.cast("int").alias("new_revision"), F.lit(run.cause).alias("cause"),
        new_value.alias("new_value"),
        # The stored row's partition, where apply removes it; the new row's is in new_value (C7).
        F.coalesce(f"o.{date_column}", f"n.{date_column}").alias("partition_date"),
        F.current_timestamp().alias("corrected_at"),
    ).where(F.col("change").isNotNull())


Defer = Callable[[DataFrame], int]  # with the (client_id, user_id) left to the stream: rows queued
# Reads a run's scope; called only when the run plans, after resume() (C6).
ScopeReader = Callable[[], DataFrame]
_NEVER_MS = 2**62


# An open session is followed back at most this many days, then taken as open since ever:
# every correction of its user waits until it closes (an uptime monitor would otherwise have
# each run read the client's whole history).
OPEN_SESSION_MAX_DAYS = 64


def _recent_pageviews(tables: DeltaTables, client_id: str, first: date, last: date
                      ) -> DataFrame:
    """The client's stored pageviews of days [first, last], as far as sessions need them."""
    return tables.read(PAGEVIEWS.name, ["client_id", "user_id", "event_id", "ts"],
                       {"client_id": client_id, "event_date": _days(first, last)},
                       schema=PAGEVIEWS.schema)


def _users_with_a_session_open(pageviews: DataFrame, cutoff_ms: int) -> DataFrame:
    """A session stays in the stream's state until the watermark reaches its end + gap (E7 of
    ``semantics``): its user has a stored pageview later than ``watermark - gap``."""
    return pageviews.groupBy(*USER_KEY).agg(F.max("ts").alias("last")).where(
        F.col("last") > F.timestamp_millis(F.lit(cutoff_ms))).select(*USER_KEY)


def _recent_days(watermark_ms: int, gap_ms: int) -> tuple[date, date]:
    cutoff = datetime.fromtimestamp((watermark_ms - gap_ms) / 1000, tz=UTC).date()
    return cutoff - timedelta(days=1), cutoff + timedelta(days=3)


def open_session_starts(tables: DeltaTables, client_id: str, gap_ms: int, watermark_ms: int,
                        among: DataFrame | None = None,
                        progress: Callable[[str], None] | None = None) -> DataFrame:
    """(client_id, user_id, open_from_ms) of the users (``among`` these, default all of the
    client's) with a session open in the stream (C4).

    ``open_from_ms`` is the start of the user's earliest open session, sessionized from the
    stored pageviews with the stream's semantics: they hold every pageview of the stream's
    state (the sink stores a micro-batch's pageviews before it commits, and the raw_events gate
    quarantines a record from both or neither), so it is never later than the stream's. Reads
    the client's few recent days; for the users whose open session reaches back to the first
    day read, twice as many days before that, until none does or OPEN_SESSION_MAX_DAYS.
    """
    cutoff_ms = watermark_ms - gap_ms
    since, last = _recent_days(watermark_ms, gap_ms)
    recent_since = since
    read: list[DataFrame] = []  # kept by this function, released before it returns
    settled: list[DataFrame] = []
    users = among  # None: all of the client's users
    days_back = 1

    def found(*more: DataFrame) -> DataFrame:
        result = keep(reduce(DataFrame.unionByName, [*settled, *more]))
        release(*read)
        return result

    while True:
        rows = _recent_pageviews(tables, client_id, since, last)
        if users is not None:
            rows = rows.join(users, USER_KEY, "left_semi")
        starts = keep(_open_starts(rows, cutoff_ms, gap_ms))
        read.append(starts)
        # Only a session that starts within one gap of the first day read can reach before it.
        reaching = F.col("open_from_ms") < F.lit(_day_start_ms(since) + gap_ms)
        settled.append(starts.where(~reaching))
        users = keep(starts.where(reaching).select(*USER_KEY))
        read.append(users)
        reaching_users = users.count()
        if not reaching_users:
            return found()
        days_back *= 2
        reached, since = since, since - timedelta(days=days_back)
        if (recent_since - since).days > OPEN_SESSION_MAX_DAYS:
            if progress is not None:
                progress(f"  sessions open in the stream since before {reached} "
                         f"({reaching_users} users): their corrections wait until they close")
            return found(users.withColumn("open_from_ms", F.lit(-_NEVER_MS)))
        if progress is not None:
            progress(f"  sessions open in the stream since before {reached} "
                     f"({reaching_users} users): reading their pageviews from {since} on")


def _day_start_ms(day: date) -> int:
    return int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp() * 1000)


def _open_starts(pageviews: DataFrame, cutoff_ms: int, gap_ms: int) -> DataFrame:
    """Per user of ``pageviews`` with a session ending after ``cutoff_ms``, the earliest such
    session's start (``semantics``, through the batch adapter; only those users' rows)."""
    active = _users_with_a_session_open(pageviews, cutoff_ms)
    no_orders = pageviews.sparkSession.createDataFrame([], ORDERS.schema)
    sessions = sessionize_frames(  # boundaries only: no URLs
        pageviews.join(active, USER_KEY, "left_semi").withColumn("url", F.lit("")), no_orders,
        gap_ms, BUCKETS)
    return sessions.where((F.col("kind") == "session") & (F.col("end_ms") > cutoff_ms)).groupBy(
        *USER_KEY).agg(F.min("start_ms").alias("open_from_ms"))


def old_places(stored: DataFrame, ts_column: str, orders: DataFrame) -> DataFrame:
    """(client_id, user_id, ts_ms, moved_with) of the ``stored`` rows of ``orders`` (a frame
    with ``order_id`` and ``user_id``, where the orders are now): ``moved_with`` is the user an
    order moved to if it is another one, else null (C9)."""
    now = orders.select("order_id", F.col("user_id").alias("now_user_id"))
    return stored.join(now, "order_id").select(
        "client_id", "user_id", F.unix_millis(ts_column).alias("ts_ms"),
        F.when(F.col("now_user_id") != F.col("user_id"), F.col("now_user_id")
               ).alias("moved_with"))


def where_attributed(tables: DeltaTables, client_id: str, orders: DataFrame) -> DataFrame:
    """The places (``old_places``) of the client's stored attributions of ``orders``: where
    those orders were before a later batch moved them (C7, C8). All of the client's days are
    read (``order_id`` alone tells no day)."""
    if not tables.exists(ATTRIBUTIONS.name):
        return orders.sparkSession.createDataFrame(
            [], "client_id string, user_id string, ts_ms long, moved_with string")
    return old_places(_client_attributions(tables, client_id), "order_ts", orders)


def _client_attributions(tables: DeltaTables, client_id: str) -> DataFrame:
    return tables.read(ATTRIBUTIONS.name, ["order_id", "client_id", "user_id", "order_ts"],
                       partition_filter={"client_id": client_id})


def queued_backfilled_orders(queued: DataFrame) -> DataFrame:
    """(client_id, order_id, user_id) of the ``recompute_queue`` rows a backfill queued where
    its orders now are, for users the stream held (C8); a row it queued where an order was
    (``MOVED_AWAY``, C10) is not where the order is."""
    return queued.where(
        (F.col("kind") == contract.ORDER) & F.col("queued_by").startswith(BACKFILL_QUEUED_BY)
        & ~F.col("queued_by").endswith(MOVED_AWAY)
    ).select("client_id", F.col("record_id").alias("order_id"), "user_id")


def with_queued_orders_places(run: Run, scope: DataFrame) -> DataFrame:
    """``scope`` grown to where the orders a backfill queued for its users are attributed
    (C11), and, through those places' users, to where theirs are, and so on. Every other
    order is attributed where it is stored (C7), so only the queue (small) is read, and the
    client's attributions when it holds such orders of the scope's users."""
    if not run.tables.exists(RECOMPUTE_QUEUE.name) or not run.tables.exists(ATTRIBUTIONS.name):
        return scope
    queued = queued_backfilled_orders(run.tables.read(
        RECOMPUTE_QUEUE.name, partition_filter={"client_id": run.client_id}))
    reached = {r.user_id for r in queued.join(scope.select(*USER_KEY), USER_KEY, "left_semi")
               .select("user_id").distinct().collect()}
    if not reached:
        return scope
    places: dict[str, list[tuple[str, int]]] = {}  # user queued -> (attributed user, ts)
    for row in queued.select("order_id", F.col("user_id").alias("now_user_id")).join(
            _client_attributions(run.tables, run.client_id), "order_id").select(
            "now_user_id", "user_id", F.unix_millis("order_ts").alias("ts_ms")).collect():
        places.setdefault(row.now_user_id, []).append((row.user_id, row.ts_ms))
    added: list[tuple[str, str, int, int, list[str]]] = []
    done: set[str] = set()
    while reached:
        user = reached.pop()
        done.add(user)
        for place_user, ts_ms in places.get(user, ()):
            added.append((run.client_id, place_user, ts_ms, ts_ms,
                          [user] if place_user != user else []))  # (C9)
            if place_user in places and place_user not in done:
                reached.add(place_user)
    return _with_places(run, scope, added)


def _with_places(run: Run, scope: DataFrame,
                 places: list[tuple[str, str, int, int, list[str]]]) -> DataFrame:
    """``scope`` and the scope rows ``places`` (client_id, user_id, lo_ms, hi_ms,
    moved_with)."""
    if not places:
        return scope
    return scope.unionByName(run.spark.createDataFrame(
        places, "client_id string, user_id string, lo_ms long, hi_ms long, "
        "moved_with array<string>"), allowMissingColumns=True)


def attributed_elsewhere(run: Run, changes: DataFrame
                         ) -> list[tuple[str, str, int, int, list[str]]]:
    """Scope rows of where the client's stored attributions hold the orders the plan
    (``changes``) would create an attribution of, and ``orders`` no longer does, with the
    user each order is now stored under (the created row's) if another (C9): places outside
    the windows, as only a stored attribution outside them is not in the diff (C13). A place
    ``orders`` still holds is another user's copy of the id (a producer reusing it,
    ``sessionize`` Z12), attributed there as it should be.

    Read from ``changes`` alone, which the run keeps until it is published: a query on the
    plan's other frames, released right after, left a job of its own (Spark's, unawaited)
    that failed on their freed blocks (BENCHMARKS.md, session 58)."""
    if not run.tables.exists(ATTRIBUTIONS.name):
        return []
    now = changes.where((F.col("entity") == "attribution") & (F.col("change") == "created")
                        ).select(F.col("key").alias("order_id"),
                                 F.get_json_object("new_value", "$.user_id").alias(
                                     "now_user_id"))
    places = _client_attributions(run.tables, run.client_id).join(now, "order_id").select(
        "order_id", "client_id", "user_id", F.unix_millis("order_ts").alias("ts_ms"),
        F.to_date("order_ts").alias("day"), "now_user_id").distinct().collect()
    if not places:
        return []
    held = {(r.order_id, r.user_id, r.ts_ms) for r in run.tables.read(
        ORDERS.name, ["order_id", "user_id", "ts"], partition_filter={
            "client_id": run.client_id, "event_date": sorted({p.day for p in places})}).where(
        F.col("order_id").isin(sorted({p.order_id for p in places}))).select(
        "order_id", "user_id", F.unix_millis("ts").alias("ts_ms")).collect()}
    return [(p.client_id, p.user_id, p.ts_ms, p.ts_ms,
             [p.now_user_id] if p.now_user_id != p.user_id else [])
            for p in places if (p.order_id, p.user_id, p.ts_ms) not in held]


def stored_elsewhere(tables: DeltaTables, client_id: str, orders: DataFrame,
                     version: int) -> DataFrame:
    """(order_id, client_id, user_id, ts) of the rows of ``orders`` (a frame with
    ``order_id``, ``user_id``, ``ts``: where the orders are now) that ``orders`` held at
    ``version`` in another place (user or ts) and that no attribution holds. Before a batch's
    merge, that is where the batch moves them from while the stream holds them in an open
    session (C10); an attributed order's old place is its attribution (``where_attributed``)."""
    stored = tables.read(ORDERS.name, ["order_id", "client_id", "user_id", "ts"],
                         partition_filter={"client_id": client_id}, version=version)
    now = orders.select("order_id", F.col("user_id").alias("now_user_id"),
                        F.col("ts").alias("now_ts"))
    moved = stored.join(now, "order_id").where(
        (F.col("user_id") != F.col("now_user_id")) | (F.col("ts") != F.col("now_ts")))
    if tables.exists(ATTRIBUTIONS.name):
        moved = moved.join(tables.read(ATTRIBUTIONS.name, ["order_id"], partition_filter={
            "client_id": client_id}), "order_id", "left_anti")
    return moved.select("order_id", "client_id", "user_id", "ts")


def landing_scope(landed: DataFrame, *moved_from: DataFrame) -> DataFrame:
    """Scope rows (client_id, user_id, lo_ms, hi_ms, moved_with): per user, the range the
    ``landed`` rows (client_id, user_id, ts) fall in, grown to the places orders moved from
    (``old_places``; C7, C8, C10), with the users an order moved to from there (C9)."""
    rows = landed.select("client_id", "user_id", F.unix_millis("ts").alias("ts_ms"),
                         F.lit(None).cast("string").alias("moved_with"))
    for places in moved_from:
        rows = rows.unionByName(places)
    return rows.groupBy("client_id", "user_id").agg(
        F.min("ts_ms").alias("lo_ms"), F.max("ts_ms").alias("hi_ms"),
        F.collect_set("moved_with").alias("moved_with"))


def with_moved_orders_users(deferred: DataFrame, scope: DataFrame) -> DataFrame:
    """``deferred`` (client_id, user_id) and the users orders moved to from one of them,
    through chains of moves too (C9)."""
    if "moved_with" not in scope.columns:
        return deferred
    moves = keep(scope.select("client_id", F.col("user_id").alias("from_user_id"),
                              F.explode("moved_with").alias("user_id")))
    if moves.isEmpty():
        release(moves)
        return deferred
    deferred = keep(deferred.distinct())
    known = deferred.count()
    while True:
        moved_to = moves.join(deferred.withColumnRenamed("user_id", "from_user_id"),
                              ["client_id", "from_user_id"], "left_semi").select(*USER_KEY)
        grown = keep(deferred.unionByName(moved_to).distinct())
        release(deferred)  # superseded: grown holds its rows
        count = grown.count()
        if count == known:
            release(moves)
            return grown
        deferred, known = grown, count


_ORDERS_TALLY = "order"  # plan()'s tally of the orders by outcome, beside the changes'


def plan(run: Run, scope: DataFrame, orders_only: bool, summary: CorrectionSummary,
         timer: Timer, stream_watermark_ms: int | None,
         defer: Defer | None = None, run_seq: int | None = None,
         grown_by: frozenset[tuple[str, str, int]] = frozenset()) -> DataFrame | None:
    """Compute and store the run's corrections (the plan); None when nothing changes.
    ``run_seq``, ``grown_by``: the step the first pass took, and the places earlier passes
    added to the scope (C13)."""
    # The step this plan will be, taken before anything was read (by resume()), so that a
    # plan another run recorded meanwhile (from tables this one did not see) is noticed (C6).
    run_seq = run_seq or run.next_seq or next_plan_seq(run)
    with timer.step("find affected sessions"):
        scope = with_queued_orders_places(run, scope)  # (C11)
        windows, old_sessions = grow_windows(run, scope)
        grown = (windows,)  # kept: released once the plan is computed
        if stream_watermark_ms is not None:  # (C4)
            open_from = open_session_starts(run.tables, run.client_id, run.gap_ms,
                                            stream_watermark_ms, windows.select(*USER_KEY),
                                            run.progress)
            windows = windows.join(open_from, ["client_id", "user_id"], "left")
            open_tail = ((F.col("hi_ms") + run.gap_ms > F.lit(stream_watermark_ms))
                         | (F.col("hi_ms") + run.gap_ms > F.coalesce("open_from_ms", F.lit(
                             _NEVER_MS))))
            windows = keep(windows)
            release(open_from)
            deferred = with_moved_orders_users(  # (C9)
                windows.where(open_tail).select("client_id", "user_id"), scope)
            grown = (*grown, windows, deferred)
            summary.deferred_users = deferred.count()
            if summary.deferred_users and defer is not None:
                summary.queued_for_the_stream = defer(deferred)  # before the plan's record (C4)
            windows = windows.join(deferred, USER_KEY, "left_anti").drop("open_from_ms")
            old_sessions = old_sessions.join(windows.select("client_id", "user_id"),
                                             ["client_id", "user_id"], "left_semi")
        windows = Windows.of(windows)
        if windows.lo_ms is None:  # an empty scope, or every user left to the stream
            release(*grown)
            run.release_snapshots()
            return None
    with timer.step("recompute sessions and attributions"):
        orders = keep(window_orders(run, windows))
        grown = (*grown, orders)
        # Computed here, so that the gate reading them is timed for its own checks alone.
        new = recompute(run, windows, old_sessions, orders, orders_only)
        # Before anything is recorded: a failing gate leaves no plan to resume (C3).
        gate_recomputed_sessions(run, new.sessions, new.attributions, orders)
        old_attributions = windows.rows_of(run, ATTRIBUTIONS, "order_date", "order_ts",
                                           run.gap_ms, keep_for_apply=True)
        changes = keep(diff(new.before, new.after, SESSIONS, SESSION_CONTENT, "session_date",
                            "session", run, run_seq, retract=new.retract).unionByName(
            diff(old_attributions, new.attributions, ATTRIBUTIONS, ATTRIBUTION_CONTENT,
                 "order_date", "attribution", run, run_seq, retract=False,
                 copies_by=COPIES_BY["attribution"])
        ))  # computed once; every later use plans a scan, not its lineage
        # The changes by kind and the orders by outcome, in one job (not one each).
        outcome = F.when(F.col("session_id").isNotNull(), "attributed").otherwise(
            "unattributed")
        tallies = {(r.entity, r.change): r["count"] for r in changes.groupBy(
            "entity", "change").count().unionByName(new.attributions.groupBy(
                F.lit(_ORDERS_TALLY).alias("entity"), outcome.alias("change")).count()
        ).collect()}
        elsewhere = (attributed_elsewhere(run, changes)
                     if tallies.get(("attribution", "created")) else [])
    if elsewhere:  # (C13) planned again with those places: rare, so not done up front
        new.release()
        release(*grown, changes)
        run.release_snapshots()
        places = {(p[0], p[1], p[2]) for p in elsewhere}
        if places <= grown_by:
            raise ClickstreamError(
                f"{run.run_id}: the plan would create attributions the client's "
                f"{ATTRIBUTIONS.name} table holds at places its scope already has "
                f"({elsewhere[:3]}); this is a bug in clickstream: nothing was recorded or "
                "applied, report it with this message")
        run.progress(f"  orders of the windows are attributed where they no longer are "
                     f"({len(elsewhere)} place(s): a batch moved them and has not planned "
                     "yet): planning with those places too")
        return plan(run, _with_places(run, scope, elsewhere), orders_only, summary, timer,
                    stream_watermark_ms, defer, run_seq, grown_by | places)
    summary.orders_attributed = tallies.pop((_ORDERS_TALLY, "attributed"), 0)
    summary.orders_unattributed = tallies.pop((_ORDERS_TALLY, "unattributed"), 0)
    counts = tallies  # what is left: the plan's changes by (entity, change)
    _count_changes(counts, summary)
    new.release()
    release(*grown)
    if not counts:
        release(changes)
        run.release_snapshots()
        return None
    with timer.step("record corrections"):
        record_plan(run, changes, run_seq, summary)
    return changes  # what was recorded: no need to read the plan back (C3)


def plan_scope(run: Run, read_scope: ScopeReader, orders_only: bool,
               summary: CorrectionSummary, timer: Timer, stream_watermark_ms: int | None,
               defer: Defer | None = None) -> DataFrame | None:
    """``plan`` of the scope ``read_scope`` reads now, released once planned. Called only
    after ``resume()`` found nothing to resume, under the client's lock (C6)."""
    scope = read_scope()
    try:
        changes = plan(run, scope, orders_only, summary, timer, stream_watermark_ms, defer)
    finally:
        release(scope)
    if changes is None:  # nothing to apply: a backfill's merge is all its group holds (C16)
        read_point.close_group(run.config, run.tables, run.run_id)
    return changes


# The plan's totals the changes alone cannot give back, kept in the commit that records it,
# so that a run resuming the plan after a crash still reports them (``resume``).
PLAN_TOTALS = ("orders_attributed", "orders_unattributed", "deferred_users")


def record_plan(run: Run, changes: DataFrame, run_seq: int,
                summary: CorrectionSummary | None = None) -> None:
    """Store ``changes`` as the client's plan number ``run_seq`` (C3), with the summary's
    ``PLAN_TOTALS`` if given, unless another run recorded one since ``run_seq`` was taken
    (C6): then nothing is recorded, and it raises."""
    unchanged = next_plan_seq(run) == run_seq
    totals = {} if summary is None else {name: getattr(summary, name) for name in PLAN_TOTALS}
    # The plan's rows are the first commit of its group (C16): readers see them with the
    # tables they describe, once apply committed those.
    opened = read_point.open_group(run.config, run.tables, run.run_id, run.client_id)
    try:
        recorded = unchanged and run.tables.append_once(
            CORRECTIONS.name, changes, app_id=run.app_id, version=run_seq,
            partition_by=CORRECTIONS.partition_by,
            metadata={"run_id": run.run_id, "cause": run.cause, **totals})
    except BaseException as error:
        with noted_on(error, "closing its read point group"):
            if opened and not plan_recorded(run, run_seq):  # nothing of the group committed
                read_point.close_group(run.config, run.tables, run.run_id)
        raise
    if not recorded:  # (C6)
        if opened:
            read_point.close_group(run.config, run.tables, run.run_id)
        release(changes)
        raise ClickstreamError(
            f"{run.run_id}: another correction run of client {run.client_id} recorded a plan "
            "while this one was planning (a process outside this machine's lock, C6); "
            "corrections of one client must run one at a time. Nothing of this run was "
            "recorded or applied: rerun it")


def plan_recorded(run: Run, run_seq: int) -> bool:
    """Whether the client's plan number ``run_seq`` is committed (by any run)."""
    return next_plan_seq(run) > run_seq


def _count_changes(counts: dict[tuple[str, str], int], summary: CorrectionSummary) -> None:
    summary.sessions_created = counts.get(("session", "created"), 0)
    summary.sessions_updated = counts.get(("session", "updated"), 0)
    summary.sessions_retracted = counts.get(("session", "retracted"), 0)
    summary.attributions_changed = sum(v for (e, _), v in counts.items() if e == "attribution")


def count_plan(changes: DataFrame, summary: CorrectionSummary) -> None:
    """Fill the summary's change counts from a stored plan (a resumed run)."""
    _count_changes({(r.entity, r.change): r["count"] for r in
                    changes.groupBy("entity", "change").count().collect()}, summary)


def restore_plan_totals(run: Run, run_seq: int, summary: CorrectionSummary) -> None:
    """Fill the summary's ``PLAN_TOTALS`` from the commit that recorded plan ``run_seq``;
    left at zero for a plan recorded without them (by an older version) or whose commit
    left the log."""
    entry = run.tables.newest_commit(CORRECTIONS.name, lambda e: e.get("app_id") == run.app_id
                                     and e.get("app_version") == run_seq)
    if entry is None or any(entry.get(name) is None for name in PLAN_TOTALS):
        return
    for name in PLAN_TOTALS:
        setattr(summary, name, int(entry[name]))
    summary.totals_recorded = True


def count_earlier_plan(run: Run, summary: CorrectionSummary) -> bool:
    """For a run that found nothing to change: count the plan an earlier attempt of it
    published (a backfill rerun, or retried, after its publish), so that the run's summary and
    correction report keep saying what the run changed instead of turning to zeros. False
    when the run recorded no plan. Called once its own unpublished plan would have been
    resumed (``resume``): a plan of the run found here was published, or superseded (C15:
    not counted, as the run's check and publish steps say)."""
    earlier = stored_plan(run)
    if earlier is None:
        return False
    summary.superseded_by = superseded_by(run, earlier.select("run_seq").first()[0])
    if summary.superseded_by:
        release(earlier)
        run.progress(f"  nothing left to change: {run.run_id}'s plan was superseded by "
                     f"{summary.superseded_by}, which rewrote and published the client's "
                     "tables")
        return True
    count_plan(earlier, summary)
    release(earlier)
    summary.published_earlier = True
    run.progress(f"  nothing left to change: an earlier attempt of {run.run_id} recorded, "
                 "applied and published its corrections (counted below; its correction "
                 "report shows them)")
    return True


def stored_plan(run: Run) -> DataFrame | None:
    """The run's latest recorded plan (a rerun that found more to change records another)."""
    if not run.tables.exists(CORRECTIONS.name):
        return None
    rows = run.tables.read(CORRECTIONS.name, partition_filter={
        "client_id": run.client_id, "run_id": run.run_id})
    latest = rows.agg(F.max("run_seq")).first()[0]
    if latest is None:
        return None
    return rows.where(F.col("run_seq") == latest).persist()


def next_plan_seq(run: Run) -> int:
    return (run.tables.app_version(CORRECTIONS.name, run.app_id) or 0) + 1


def unfinished_plan_seq(run: Run) -> int | None:
    """The step of the client's latest plan if it never reached Kafka, else None (C6)."""
    if not run.tables.exists(CORRECTIONS.name):
        return None
    latest = run.tables.app_version(CORRECTIONS.name, run.app_id)
    return None if latest is None or latest <= published_through(run) else latest


PLAN_TABLES = tuple(sorted((SESSIONS.name, ATTRIBUTIONS.name, CORRECTIONS.name)))
"""The tables a plan's apply may change: announced for a run that failed with its plan
recorded and not published (recompute R15)."""


def plan_left_unpublished(run: Run) -> bool:
    """Whether the client has a plan recorded and not published (recompute R15): it may be
    applied. True when that cannot be read either: announced again rather than not at all."""
    try:
        return unfinished_plan_seq(run) is not None
    except Exception as error:  # the run's own failure is the one raised (recompute R10)
        run.progress(f"client {run.client_id} ({run.cause}): could not tell whether its plan was "
                     f"applied ({error}); its tables are announced as changed")
        return True


def unfinished_plan(run: Run) -> DataFrame | None:
    """The client's latest plan if it never reached Kafka, whichever run recorded it (C6)."""
    latest = unfinished_plan_seq(run)
    if latest is None:
        return None
    rows = run.tables.read(CORRECTIONS.name, partition_filter={"client_id": run.client_id}
                           ).where(F.col("run_seq") == latest).persist()
    if rows.isEmpty():  # recorded with no rows: nothing to apply or publish
        rows.unpersist()
        return None
    return rows


def published_through(run: Run) -> int:
    """The client's last plan (``run_seq``) that reached Kafka; 0 for none (C6)."""
    return run.tables.app_version(CORRECTIONS.name, run.published_app_id) or 0


def mark_published(run: Run, changes: DataFrame, *, superseded: bool = False) -> None:
    """Record that the plan's changes are in the tables and on Kafka (C6); ``superseded``:
    the plan failed its applied check and ``run`` (a full recompute, R7) rewrote and
    published the client instead, which the plan's own steps then say (C15)."""
    run_seq = changes.select("run_seq").first()[0]
    metadata = {"run_id": run.run_id, "cause": f"published step {run_seq}"}
    if superseded:
        metadata = {**metadata, "cause": f"superseded step {run_seq}",
                    "superseded_by": run.run_id}
    run.tables.append_once(
        CORRECTIONS.name, run.spark.createDataFrame([], CORRECTIONS.schema),
        app_id=run.published_app_id, version=run_seq, partition_by=CORRECTIONS.partition_by,
        metadata=metadata)
    read_point.publish(run.config, run.tables)  # no rows: the read point keeps up with it


def superseded_by(run: Run, run_seq: int) -> str | None:
    """The run that superseded the client's published plan ``run_seq`` (C15); None if the
    plan was published as planned."""
    marked = run.tables.newest_commit(CORRECTIONS.name, lambda commit: (
        commit.get("app_id") == run.published_app_id and commit.get("app_version") == run_seq))
    return None if marked is None else marked.get("superseded_by")


APPLY_ATTEMPTS = 5


@dataclass(frozen=True)
class PlanPartitions:
    """What applying a plan needs to know before it writes (C7), from one scan of the plan
    (three small jobs before: on a few rows each Spark action costs 0.1-0.3 s)."""
    run_seq: int
    dates: dict[str, list[date]]  # by entity: the partitions its rows touch
    rows: dict[str, int]  # by entity: how many rows the plan has

    def of(self, entity: str) -> tuple[list[date], int]:
        return self.dates.get(entity, []), self.rows.get(entity, 0)


def plan_partitions(changes: DataFrame) -> PlanPartitions:
    """The plan's step and, per entity, the partitions its rows touch: each stored row's
    partition (``partition_date``) and, for attributions, each new row's (an order moved to
    another day leaves one partition for another). A session never moves: its id is a
    function of its start, and so is its date."""
    new_order_date = F.when(F.col("entity") == "attribution", F.to_date(
        F.get_json_object("new_value", "$.order_date")))
    found = changes.groupBy("entity").agg(
        F.max("run_seq").alias("run_seq"), F.collect_set("partition_date").alias("stored"),
        F.collect_set(new_order_date).alias("new"), F.count(F.lit(1)).alias("rows")).collect()
    if not found:
        raise ValueError("an empty plan has nothing to apply: a plan with no change is "
                         "never recorded (corrections.plan)")
    return PlanPartitions(run_seq=max(r.run_seq for r in found),
                          dates={r.entity: sorted({*r.stored, *r.new}) for r in found},
                          rows={r.entity: r.rows for r in found})


def _apply_table(run: Run, changes: DataFrame, entity: str, spec, date_column: str,
                 partitions: PlanPartitions) -> None:
    mine = changes.where(F.col("entity") == entity)
    dates, planned = partitions.of(entity)
    run_seq = partitions.run_seq
    if not dates:
        return
    # A year of orders changes ~0.5M sessions of 2.57M: shuffling the affected partitions'
    # rows to meet the keys took about a quarter of apply.
    keys = broadcast_up_to_cap(mine.select(F.col("key").alias(spec.key[0])), planned)
    copies_by = COPIES_BY[entity]
    new_rows = mine.where(F.col("new_value").isNotNull())
    fresh = new_rows.select(F.from_json("new_value", spec.schema).alias("v")).select("v.*")
    for attempt in range(1, APPLY_ATTEMPTS + 1):
        snapshot = run.snapshots.get(spec.name)
        held = snapshot is not None and snapshot.covers(dates)  # (C5)
        # -1 (TABLE_MISSING): the rows were read before the table existed; a writer that
        # created it since (the stream's first session) is a conflict, not the range's rows.
        read_version = snapshot.version if held else run.tables.version(spec.name)
        current = (snapshot.rows.where(F.col(date_column).isin(dates)) if held
                   else _read_days(run, spec, date_column, dates,
                                   None if read_version == TABLE_MISSING else read_version))
        replacement = _kept_rows(current, keys, new_rows, spec, copies_by,
                                 planned).unionByName(fresh.select(*spec.schema.fieldNames()))
        try:
            run.tables.replace_partitions(
                spec.name, replacement,
                predicate={"client_id": run.client_id, date_column: dates},
                partition_by=spec.partition_by, app_id=run.app_id, version=run_seq,
                metadata={"run_id": run.run_id, "cause": run.cause},
                read_version=read_version)
            return
        except CommitConflictError:
            if attempt == APPLY_ATTEMPTS:
                raise
            # Another writer (the stream) committed into these days since they were read:
            # read them again at the new version; the plan's changes still apply (C5).
            if snapshot is not None:
                release(run.snapshots.pop(spec.name).rows)
            run.progress(f"  apply: {spec.name} changed under the run (attempt {attempt}); "
                         "reading its days again")


def _kept_rows(current: DataFrame, keys: DataFrame, new_rows: DataFrame, spec,
               copies_by: tuple[str, ...], planned: int) -> DataFrame:
    """The stored rows the plan leaves: none of its keys'; where a key has copies (C14), the
    copies it does not write, unless no stored copy is one it writes (the order moved: C7).

    Copies are looked up only for the plan's keys these days hold: a year of orders writes
    525k new attributions where the days hold the live orders' few, and parsing every
    written row's copy columns again, to meet them in two joins, added ~5.6 s to apply
    (BENCHMARKS.md, sessions 61 and 68)."""
    key = spec.key[0]
    if not copies_by:
        return current.join(keys, key, "left_anti")
    held_keys = current.join(keys, key, "left_semi").select(key).distinct()
    # Met on the plan's own key column before parsing (not taken from the parsed rows, whose
    # key comes out of the parse): only the held rows' values are parsed.
    written = new_rows.join(held_keys.withColumnRenamed(key, "key"), "key", "left_semi").select(
        F.from_json("new_value", spec.schema).alias("v")).select(f"v.{key}",
                                                                *(f"v.{c}" for c in copies_by))
    matched = current.join(written, [key, *copies_by], "left_semi").select(key).distinct()
    moved = broadcast_up_to_cap(held_keys.join(matched, key, "left_anti"), planned)
    return current.join(written, [key, *copies_by], "left_anti").join(moved, key, "left_anti")


def apply(run: Run, changes: DataFrame) -> None:
    """One commit per table over the affected partitions; skipped if already applied. The
    plan's run is a read point group (a backfill's opened at its merge): readers see the
    client as it was until both tables are committed (C16)."""
    partitions = plan_partitions(changes)
    read_point.open_group(run.config, run.tables, run.run_id, run.client_id)
    _apply_table(run, changes, "session", SESSIONS, "session_date", partitions)
    _apply_table(run, changes, "attribution", ATTRIBUTIONS, "order_date", partitions)
    read_point.close_group(run.config, run.tables, run.run_id)
    run.release_snapshots()


def publish_changes(run: Run, changes: DataFrame) -> int:
    """New revisions and tombstones, from the plan (idempotent by key and revision); then the
    publish gate reads them back from the topics."""
    since = publish_started(run.config)
    sent = publish_correction(run.config, run.client_id, [
        (topic, changes.where(F.col("entity") == entity).select("key", "new_value"))
        for entity, topic in (("session", run.config.sessions_topic),
                              ("attribution", run.config.attributions_topic))])
    gate_publish(run, changes, since)
    return sent


def _figures_before_apply(run: Run, changes: DataFrame) -> CorrectionFigures | None:
    """The correction report's figures from the snapshot the plan was diffed against, while
    it is still held (C5): the report then reads no table again. None when the report is off
    or a snapshot is missing (the report then travels back in the tables' history)."""
    names = (SESSIONS.name, ATTRIBUTIONS.name)
    if not gates_enabled(run.config) or not all(n in run.snapshots for n in names):
        return None
    return correction_figures(run, changes, {n: run.snapshots[n].rows for n in names})


def _not_applied(tables: DeltaTables, changes: DataFrame, client_id: str, entity: str, spec,
                 date_column: str, partitions: PlanPartitions) -> tuple[int, int, list[str]]:
    """(planned rows, rows the table does not reflect, first such keys) of one entity."""
    mine = changes.where(F.col("entity") == entity)
    dates, planned = partitions.of(entity)
    if not dates:
        return 0, 0, []
    key = spec.key[0]
    copies_by = COPIES_BY[entity]  # a key's copies are matched and counted by these (C14)
    current = tables.read(spec.name, [key, "revision", *copies_by],
                          {"client_id": client_id, date_column: dates},
                          schema=spec.schema).select(
        F.col(key).alias("key"), F.col("revision").alias("stored"), *copies_by)
    planned_rows = mine.select(
        "key", "old_revision", "new_revision", F.col("new_value").isNull().alias("retracted"),
        F.from_json("new_value", spec.schema).alias("v")).select(
        "key", "old_revision", "new_revision", "retracted", *(f"v.{c}" for c in copies_by))
    on = F.col("p.key") == F.col("c.key")
    if copies_by:  # a key held once is matched by key alone: a later run may have moved it
        current = count_copies(current, "key")
        on = on & (same_columns(copies_by, "p", "c") | (F.col(f"c.{COPY_COUNT}") == 1))
    joined = planned_rows.alias("p").join(current.alias("c"), on, "left").select(
        "p.*", "c.stored")
    # A later run may have moved a row further on: only an older revision is a miss.
    missing = joined.where(
        (~F.col("retracted") & (F.col("stored").isNull()
                                | (F.col("stored") < F.col("new_revision"))))
        | (F.col("retracted") & F.col("stored").isNotNull()
           & (F.col("stored") <= F.col("old_revision"))))
    # Only the plan's keys: copies another run left (C14) are not this plan's to answer for.
    duplicated = current.join(planned_rows.select("key").distinct(), "key", "left_semi").groupBy(
        "key", *copies_by).count().where(F.col("count") > 1).select("key")
    bad = missing.select("key").unionByName(duplicated).distinct()
    first = sorted(r.key for r in bad.limit(3).collect())
    return planned, bad.count(), first


def check_plan_applied(run: Run, changes: DataFrame) -> dict[str, int]:
    """The gate between apply and publish: the tables hold the plan (S4 of backfill_steps).

    Every planned session and attribution must be stored at (at least) its new revision,
    retracted sessions must be gone, and the plan's keys must be stored once in the affected
    partitions (an attribution: once per copy of its order id, C14).

    Returns:
        ``{"sessions": planned session rows, "attributions": planned attribution rows}``.

    Raises:
        PlanNotAppliedError: some planned rows are not reflected; publish nothing.
    """
    counts = {}
    partitions = plan_partitions(changes)
    for entity, label, spec, date_column in (
            ("session", "sessions", SESSIONS, "session_date"),
            ("attribution", "attributions", ATTRIBUTIONS, "order_date")):
        planned, bad, first = _not_applied(run.tables, changes, run.client_id, entity, spec,
                                           date_column, partitions)
        counts[label] = planned
        if bad:
            raise PlanNotAppliedError(
                f"{run.run_id}: {bad} of {planned} planned {label} are not what table "
                f"{spec.name!r} holds (first: {', '.join(first)}); nothing was published to "
                f"Kafka. Inspect corrections where run_id = '{run.run_id}'. Until this plan "
                f"is published, every correction run of client {run.client_id} stops here; "
                f"`clickstream recompute --client {run.client_id} --full` rewrites the client "
                "from its pageviews and orders and supersedes it")
    return counts


def one_run_at_a_time(config: Config, client_id: str,
                      progress: Callable[[str], None] = print) -> AbstractContextManager[None]:
    """Held by every step that plans, applies or publishes corrections of the client (C6).
    Beside the tables it guards, not under the home: two processes with one warehouse and
    different homes (an operator's shell beside Airflow) still exclude each other."""
    digest = hashlib.sha256(client_id.encode()).hexdigest()[:12]  # safe_name may merge ids
    path = (config.warehouse / LOCKS_FOLDER
            / f"corrections-{safe_name(client_id)[:60]}-{digest}.lock")
    return exclusive(path, on_wait=lambda: progress(
        f"  waiting for another correction run of client {client_id} to finish ({path}) ..."))


def resume(run: Run, summary: CorrectionSummary, timer: Timer) -> DataFrame | None:
    """Before planning: this run's own plan if it was interrupted (resumed from here, C3);
    another run's interrupted plan is applied and published first, with that run's correction
    report and, for a backfill, a run summary saying so, then forgotten (C6)."""
    run.next_seq = next_plan_seq(run)  # finishing another plan records no new step
    changes = unfinished_plan(run)
    if changes is None:
        return None
    planned_by, run_seq = changes.select("run_id", "run_seq").first()
    if planned_by == run.run_id:
        summary.resumed = True
        count_plan(changes, summary)
        restore_plan_totals(run, run_seq, summary)
        return changes
    run.progress(f"  {planned_by} recorded corrections and was interrupted before publishing "
                 "them: finishing them first ...")
    finished = CorrectionSummary()  # the plan's counts: this summary's, and its report's
    count_plan(changes, finished)
    sessions = (finished.sessions_created + finished.sessions_updated
                + finished.sessions_retracted)
    summary.finished_sessions += sessions
    summary.finished_attributions += finished.attributions_changed
    # As that run: its commits, its gates' index entries (a publish gate that failed it
    # before is superseded there) and the run id a failure names are the plan's.
    planned = replace(run, run_id=planned_by, cause=f"{planned_by}, finished by {run.run_id}")
    finish(planned, changes, timer, step="finish an interrupted run", check_applied=True)
    # And its correction report, which it would have written once published: that run may
    # never run again (a recompute's retry is another run once the queue moved on). Of this
    # plan, over any page an earlier plan of the run id left; `--full` writes none.
    report = None
    if not planned_by.startswith(f"{FULL_RECOMPUTE_JOB}-") and gates_enabled(run.config):
        with timer.step("finish an interrupted run: correction report"):
            report = write_correction_report(planned, finished,
                                             correction_figures(planned, changes))
    release(changes)
    lines = [("recompute and publish", f"{sessions} session and "
              f"{finished.attributions_changed} attribution changes applied and published by "
              f"{run.run_id}")]
    if report is not None:
        lines.append(("corrections", f"report {report}"))
    # A backfill's summary page says it failed (or it has none: killed).
    write_plan_taken_over(run.config, planned_by=planned_by, client_id=run.client_id,
                          how="finished", by=run.run_id, lines=lines)
    return None


def finish(run: Run, changes: DataFrame, timer: Timer, step: str = "",
           check_applied: bool = False) -> None:
    """Apply a recorded plan, publish it, and record that it was published (C6).

    ``check_applied``: pass the gate the backfill DAG runs between apply and publish (another
    run's plan: its own check may have failed, and then it must not be published either).
    The plan is applied only once the topics it is published to answer: with Kafka out of
    reach the tables stay as the topics show them, and the recorded plan waits for a rerun."""
    prefix = f"{step}: " if step else ""
    check_changelogs_answer(run.config)
    with timer.step(f"{prefix}apply to tables"):
        apply(run, changes)
        if check_applied:
            check_plan_applied(run, changes)
    with timer.step(f"{prefix}publish to Kafka"):
        publish_changes(run, changes)
        mark_published(run, changes)


def _correct_locked(run: Run, read_scope: ScopeReader, orders_only: bool,
                    stream_watermark_ms: int | None, summary: CorrectionSummary,
                    defer: Defer | None, first_pass: bool) -> None:
    timer = Timer(summary, run.progress)
    figures = None
    changes = resume(run, summary, timer)
    if changes is None:
        changes = plan_scope(run, read_scope, orders_only, summary, timer, stream_watermark_ms,
                             defer)
        if changes is not None:
            with timer.step("correction report"):
                figures = _figures_before_apply(run, changes)
        elif first_pass:
            count_earlier_plan(run, summary)
    if changes is not None:
        finish(run, changes, timer)
    if changes is not None or first_pass:
        with timer.step("correction report"):
            if figures is None and changes is not None and gates_enabled(run.config):
                figures = correction_figures(run, changes)  # old values by time travel
            if figures is None and not summary.published_earlier:
                figures = CorrectionFigures()  # nothing changed
            # Published earlier: the page that attempt wrote, or (it stopped before writing
            # one, or another run finished its plan) the figures of its stored plan.
            write_correction_report(run, summary, figures)
    if changes is not None:
        release(changes)


def correct(run: Run, read_scope: ScopeReader, *, orders_only: bool,
            stream_watermark_ms: int | None = None,
            summary: CorrectionSummary | None = None,
            defer: Defer | None = None, first_pass: bool = True) -> CorrectionSummary:
    """Plan (or resume), apply and publish the corrections of a scope for ``run.client_id``.

    ``read_scope`` returns the scope (client_id, user_id, lo_ms, hi_ms: where new or changed
    rows landed), which is released after planning. It is called only if the run plans, under
    the client's lock and after ``resume()`` took the plan's step, so that what it reads is
    not older than a plan another run recorded meanwhile (C6); a resumed run reads nothing.
    ``stream_watermark_ms``: the watermark of the sessionizer's last committed micro-batch;
    users whose window reaches the stream's open sessions are left to it (C4), counted in
    ``deferred_users`` and handed to ``defer``. Runs of one client wait for each other, and
    an unpublished plan of the client is finished first (C6). A first pass that changes
    nothing counts the plan an earlier attempt of the run published, if any (its report then
    stays), else writes an empty report; a later pass in the same process (``first_pass``
    false: ``recompute`` plans again after finishing its resumed plan) that changes nothing
    does neither, since its first pass counted and reported that plan.
    """
    summary = summary or CorrectionSummary()
    with one_run_at_a_time(run.config, run.client_id, run.progress):
        _correct_locked(run, read_scope, orders_only, stream_watermark_ms, summary, defer,
                        first_pass)
    return summary
