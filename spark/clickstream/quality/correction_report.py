"""The correction report of a backfill or recompute run: what it changed, as an HTML page.

Sessions created / updated / retracted, orders re-attributed, and revenue moved per day (with
an inline SVG chart: no plotting library is installed here, and the page must stay one static
file). Written to ``reports/corrections/<job>-<run>.html`` and listed in the reports index
next to the run's gate validations.

The new values come from the run's plan (the ``corrections`` rows carry them). The old values
come from the rows the plan was diffed against: the run's snapshot of the tables when the
report's figures are computed before apply (a run that goes straight through: no second read),
else the ``sessions`` and ``attributions`` tables as they were just before the run's apply
commit (time travel: a resumed run, or the report as a later DAG step). Both are the same
rows, so the report does not depend on the path. If that commit is too far back in the
history, old values are reported as unknown.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from clickstream.atomic_files import write_atomically
from clickstream.key_copies import COPIES_BY, pair_copies
from clickstream.quality import reports
from clickstream.quality.checks import run_commit_version
from clickstream.quality.gates import enabled, split_run_id
from clickstream.tables import ATTRIBUTIONS, SESSIONS

if TYPE_CHECKING:
    from clickstream.jobs.corrections import CorrectionSummary, Run

DEPTH = 1  # corrections/<page>.html


@dataclass(frozen=True)
class CorrectionFigures:
    """What the report shows about a run's changes, computed from its plan and old values."""

    by_day: list[tuple[Any, Decimal, Decimal]] = field(default_factory=list)  # day, before, after
    moved: dict[str, int] = field(default_factory=dict)  # what happened to the orders -> count
    old_known: bool = True
    # The sessions whose revenue moved most (then by id), at most LISTED_SESSIONS of them.
    sessions: list[ChangedSession] = field(default_factory=list)


LISTED_SESSIONS = 25


@dataclass(frozen=True)
class ChangedSession:
    """One changed session as the report lists it (a reviewer's sample of what moved)."""

    session_id: str
    change: str
    user_id: str | None
    session_start: Any
    revenue_before: Decimal
    revenue_after: Decimal


def _old_rows(run: Run, spec: Any, date_column: str, changes: DataFrame, dates: list,
              columns: list[str], stored: Mapping[str, DataFrame] | None,
              carry: Sequence[Column] = ()) -> DataFrame | None:
    """Rows of ``spec`` for the changed keys as they were before the run's apply commit: from
    ``stored`` (the plan's snapshot, before apply) or else by time travel; with the
    ``carry`` columns of their change (the same join: no second one to pair them)."""
    key = spec.key[0]
    if stored is not None:
        rows = stored[spec.name].select(*columns)
    else:
        version = run_commit_version(run.tables, spec.name, run.run_id)
        if version is None or version < 1 or not dates:
            return None
        rows = run.tables.read(spec.name, columns,
                               {"client_id": run.client_id, date_column: dates},
                               version=version - 1)
    return rows.join(changes.select(F.col("key").alias(key), *carry), key,
                     "inner" if carry else "left_semi")


def revenue_by_day(run: Run, sessions: DataFrame, dates: list, updates: bool,
                   stored: Mapping[str, DataFrame] | None
                   ) -> tuple[tuple[list[tuple[Any, Decimal, Decimal]], list[ChangedSession]],
                              bool]:
    """[(day, revenue before, revenue after)] of the changed sessions, and the sessions whose
    revenue moved most; False if the before values are unknown (``updates``: some changes
    are not creations)."""
    money = "decimal(30,4)"
    needed = ("session_date date, user_id string, session_start timestamp, revenue "
              + SESSIONS.schema["revenue"].dataType.simpleString())
    new_revenue = F.from_json("new_value", needed)["revenue"].cast(money)
    created = F.col("change") == "created"
    # A created session has no old row: only the other changes meet (and parse) in the join.
    old = _old_rows(run, SESSIONS, "session_date", sessions.where(~created), dates,
                    ["session_id", "session_date", "user_id", "session_start", "revenue"],
                    stored, carry=[F.col("change"), new_revenue.alias("new")]
                    ) if updates else None
    # Each changed session once, before and after: an old row carries its change's new
    # revenue (none when retracted); a created session (or any, when the old rows are
    # unknown) has only its new row.
    fresh = sessions if old is None else sessions.where(created)
    per_session = fresh.where(F.col("new_value").isNotNull()).select(
        F.col("key").alias("session_id"), "change",
        F.from_json("new_value", needed).alias("v")).select(
        "session_id", "change", F.col("v.session_date").alias("day"), "v.user_id",
        "v.session_start", F.lit(0).cast(money).alias("old"),
        F.col("v.revenue").cast(money).alias("new"))
    if old is not None:
        per_session = per_session.unionByName(old.select(
            "session_id", "change", F.col("session_date").alias("day"), "user_id",
            "session_start", F.col("revenue").cast(money).alias("old"),
            F.coalesce("new", F.lit(0).cast(money)).alias("new")))
    per_session = per_session.persist()
    try:
        rows = per_session.groupBy("day").agg(F.sum("old").alias("old"),
                                              F.sum("new").alias("new")).orderBy("day").collect()
        listed = per_session.orderBy(F.abs(F.col("new") - F.col("old")).desc(),
                                     "session_id").limit(LISTED_SESSIONS).collect()
    finally:
        per_session.unpersist()
    return (([(r.day, r.old or Decimal(0), r.new or Decimal(0)) for r in rows],
             [ChangedSession(r.session_id, r.change, r.user_id, r.session_start,
                             r.old or Decimal(0), r.new or Decimal(0)) for r in listed]),
            old is not None or not updates)


def reattributions(run: Run, attributions: DataFrame, dates: list, updates: bool,
                   stored: Mapping[str, DataFrame] | None) -> tuple[dict[str, int], bool]:
    """How the run's attribution changes moved orders between sessions. An order id's copies
    (another user's order with the same id, ``corrections`` C14) are paired as the plan's
    diff paired them: by key alone, each new copy met every old one."""
    # The key from the plan's row: a retraction (``recompute --full``, R8) has no new value.
    new = attributions.select(F.col("key").alias("order_id"), "change", F.from_json(
        "new_value", ATTRIBUTIONS.schema).alias("v")).select(
        "order_id", "change", "v.user_id", "v.order_ts",
        F.col("v.session_id").alias("new_session"))
    old = _old_rows(run, ATTRIBUTIONS, "order_date", attributions, dates,
                    ["order_id", "user_id", "order_ts", "session_id"], stored) if updates else None
    if old is not None:
        old, new, on = pair_copies(old, new, "order_id", COPIES_BY["attribution"])
        # A created copy had no old row (the diff counted copies over all new rows, not only
        # the plan's): paired by key alone here, it would look moved.
        on = on & (F.col("n.change") != "created")
        new = new.alias("n").join(old.alias("o"), on, "left").select(
            "n.new_session", F.col("o.session_id").alias("old_session"))
    else:
        new = new.withColumn("old_session", F.lit(None).cast("string"))
    kind = (F.when(F.col("old_session").isNull() & F.col("new_session").isNotNull(),
                   "attributed to a session")
            .when(F.col("old_session").isNotNull() & F.col("new_session").isNull(),
                  "no longer attributed (kept, unattributed)")
            .when(F.col("old_session").isNull() & F.col("new_session").isNull(),
                  "still unattributed")
            .when(F.col("old_session") != F.col("new_session"), "moved to another session")
            .otherwise("same session (order changed)"))
    counts = {r.kind: r["count"] for r in new.groupBy(kind.alias("kind")).count().collect()}
    return counts, old is not None or not updates


def correction_figures(run: Run, plan: DataFrame,
                       stored: Mapping[str, DataFrame] | None = None) -> CorrectionFigures:
    """The report's figures of a plan. ``stored``: the snapshot the plan was diffed against
    (table name -> rows), given before apply; without it, old values come by time travel."""
    shape = {r.entity: r for r in plan.groupBy("entity").agg(
        F.sort_array(F.collect_set("partition_date")).alias("dates"),
        F.count_if(F.col("change") != "created").alias("updates")).collect()}
    figures: dict[str, Any] = {}
    known = []
    if "session" in shape:
        (figures["by_day"], figures["sessions"]), ok = revenue_by_day(
            run, plan.where(F.col("entity") == "session"), list(shape["session"].dates),
            shape["session"].updates > 0, stored)
        known.append(ok)
    if "attribution" in shape:
        figures["moved"], ok = reattributions(
            run, plan.where(F.col("entity") == "attribution"),
            list(shape["attribution"].dates), shape["attribution"].updates > 0, stored)
        known.append(ok)
    return CorrectionFigures(**figures, old_known=all(known))


def _changed_sessions(listed: list[ChangedSession], summary: CorrectionSummary,
                      run_id: str) -> str:
    """A sample a reviewer can check by hand, and where every changed session is."""
    changed = summary.sessions_created + summary.sessions_updated + summary.sessions_retracted
    if not changed:
        return ""
    rows = [[s.session_id, s.change, s.user_id or "", str(s.session_start or "")[:19],
             f"{s.revenue_before:,.4f}", f"{s.revenue_after:,.4f}",
             f"{s.revenue_after - s.revenue_before:+,.4f}"] for s in listed]
    return (f"<h2>Sessions changed</h2><p class='muted'>{len(listed)} of the {changed:,} "
            "changed sessions, largest revenue change first. Every one is a row of the "
            "<code>corrections</code> table with <code>entity = 'session'</code> and "
            f"<code>run_id = '{html.escape(run_id)}'</code> (its new value as JSON; "
            "<code>null</code> for a retraction).</p>"
            + reports.table(["session", "change", "user", "start (UTC)", "revenue before",
                             "revenue after", "change of revenue"], rows, {4, 5, 6}))


def write_correction_report(run: Run, summary: CorrectionSummary,
                            figures: CorrectionFigures | None = None) -> Path | None:
    """Write the run's correction report and list it in the reports index.

    Args:
        run: the correction run (backfill or recompute of one client).
        summary: what the run did.
        figures: the plan's figures, computed before apply from the run's snapshot; when
            None they are computed from the ``corrections`` table (none there: nothing
            changed) and time travel.

    Returns:
        The page's path (None when ``CLICKSTREAM_QUALITY_GATES=off``).
    """
    if not enabled(run.config):
        return None
    config = run.config
    job, run_id = split_run_id(run.run_id)
    target = (reports.reports_dir(config) / "corrections"
              / f"{reports.safe_name(f'{job}-{run_id}')}.html")
    if summary.published_earlier and target.exists():  # written by the attempt that did it
        return target
    moment = reports.now_utc()
    if figures is None:
        from clickstream.jobs.corrections import stored_plan

        plan = stored_plan(run)
        figures = CorrectionFigures()
        if plan is not None:
            figures = correction_figures(run, plan)
            plan.unpersist()
    by_day, moved, old_known = figures.by_day, figures.moved, figures.old_known
    reattributed = sum(v for k, v in moved.items()
                       if k in ("attributed to a session", "moved to another session",
                                "no longer attributed (kept, unattributed)"))
    net = sum((new - old for _, old, new in by_day), Decimal(0))
    gross = sum((abs(new - old) for _, old, new in by_day), Decimal(0))
    facts = {
        "client": run.client_id, "cause": run.cause, "run": run.run_id,
        "written": moment.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "sessions created": summary.sessions_created,
        "sessions updated": summary.sessions_updated,
        "sessions retracted": summary.sessions_retracted,
        "attribution changes": summary.attributions_changed,
        "orders re-attributed": reattributed,
        "revenue moved (sum of |change| per day)": f"{gross:,.4f}",
        "net revenue change": f"{net:+,.4f}",
        "users left to the running stream": summary.deferred_users,
        "resumed a planned run": "yes" if summary.resumed else "no",
        **({"plan superseded by": summary.superseded_by} if summary.superseded_by else {}),
    }
    days = [(str(day), float(new - old)) for day, old, new in by_day if new != old]
    gates = reports.validations_of(config, job, run_id)
    standing = reports.current_entries(gates)  # a gate failed, then passed on a rerun
    gate_links = "".join(
        f"<li><a href='{html.escape(reports.relative(e.href, DEPTH))}'>{html.escape(e.title)}"
        f"</a> {reports.status_badge(e.status)}"
        f"{'' if id(e) in standing else ' <span class=muted>superseded by a later attempt</span>'}"
        "</li>" for e in gates) or "<li class='muted'>none recorded</li>"
    day_rows = [[str(day), f"{old:,.4f}", f"{new:,.4f}", f"{new - old:+,.4f}"]
                for day, old, new in by_day]
    day_table = reports.table(["day", "revenue before", "revenue after", "change"], day_rows,
                              {1, 2, 3})
    if len(day_rows) > 31:
        day_table = f"<details><summary>{len(day_rows)} days</summary>{day_table}</details>"
    body = (
        reports.table(["", ""], reports.mapping_rows(facts), {1})
        + ("" if old_known else "<p class='muted'>The run's apply commit is beyond the "
           "searched table history: values before the run are unknown, so 'before' shows 0."
           "</p>")
        + "<h2>Revenue moved by day</h2><p class='muted'>Change of the affected sessions' "
        "revenue per session day (green up, red down; hover a bar for its value).</p>"
        + reports.svg_bar_chart(days)
        + (day_table if day_rows else "<p>No session revenue changed.</p>")
        + _changed_sessions(figures.sessions, summary, run.run_id)
        + "<h2>Orders re-attributed</h2>"
        + (reports.table(["what happened to the order", "orders"],
                         [[k, v] for k, v in sorted(moved.items())], {1})
           if moved else "<p>No attribution changed.</p>")
        + f"<h2>Quality gates of this run</h2><ul>{gate_links}</ul>"
        + "<details><summary>summary as recorded</summary><pre>"
        + html.escape(json.dumps(asdict(summary), indent=1, sort_keys=True, default=str))
        + "</pre></details>")
    write_atomically(target, reports.page(f"Corrections of {job} {run_id}", body,
                                                  depth=DEPTH))
    reports.record(config, reports.ReportEntry(
        time=moment.isoformat(), job=job, run_id=run_id, kind="corrections",
        title="corrections", status="info",
        href=target.relative_to(reports.reports_dir(config)).as_posix(),
        summary=(f"{summary.sessions_created} created, {summary.sessions_updated} updated, "
                 f"{summary.sessions_retracted} retracted sessions; {reattributed} orders "
                 f"re-attributed; net revenue {net:+,.2f}"), client_id=run.client_id))
    run.progress(f"  correction report written: {target}")
    return target
