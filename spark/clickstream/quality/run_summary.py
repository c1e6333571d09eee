"""A backfill run's summary page in the quality reports: ``reports/backfills/<run>.html``.

One page per run, whatever its outcome and however it ran (``clickstream backfill`` or the
``late_batch_backfill`` DAG's steps, which share run ids): what each step did and, when one
failed, its reason. The index keeps the latest entry per page, so a run that ends well after
a failure (a retry, a cleared task, the CLI finishing it) replaces the red page. A run whose
plan another correction run of the client finished (``corrections`` C6), or a full recompute
superseded (``recompute`` R7), gets a second page, ``backfills/<run>.finished.html`` or
``.superseded.html`` (``write_plan_taken_over``), which supersedes the red one.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from clickstream.atomic_files import write_atomically
from clickstream.config import Config
from clickstream.errors import noted_on, typed_error_line
from clickstream.quality import reports
from clickstream.quality.gates import split_run_id

T = TypeVar("T")
SUMMARY_MAX_CHARS = 500
"""The index keeps this much of a run's summary (a link's tooltip); the page has it all."""
Lines = Sequence[tuple[str, str]]
"""(step, what it did) per step, in order."""


def failure_line(step: str, error: BaseException) -> tuple[str, str]:
    """The line naming the step that failed and its one-line reason: for an error in Spark's
    Python worker, the Python error it carries (Spark's first line says only where it was)."""
    return f"{step}: failed", typed_error_line(error)


def write_run_summary(config: Config, *, run_id: str, client_id: str, kind: str, root: str,
                      lines: Lines, details: Mapping[str, Any] | None = None,
                      dry_run: bool = False, failed: bool = False) -> tuple[str, Path]:
    """Write the run's page and list it in the index (status ``failed``, else ``info``).

    Returns:
        (the summary in one paragraph, the page's path).
    """
    shown = "" if details is None else (
        "<details><summary>validation details</summary><pre>"
        f"{html.escape(json.dumps(dict(details), indent=1, default=str))}</pre></details>")
    return _write(
        config, run_id=run_id, client_id=client_id, lines=lines, failed=failed,
        title=f"Backfill {run_id}" + (" (dry run)" if dry_run else ""),
        name=f"{reports.safe_name(run_id)}{'.dry-run' if dry_run else ''}",
        entry_title=reports.DRY_RUN if dry_run else reports.RUN_SUMMARY,
        about=(f"client <code>{html.escape(client_id)}</code>, {html.escape(kind)} from "
               f"<code>{html.escape(root)}</code>"), details=shown)


# What became of a backfill run's plan that another run took over: the page's name and title
# word, and what it says happened (``by``: that run's id, as HTML).
_TAKEN_OVER = {
    "finished": ("the run recorded its corrections and stopped before publishing them; the "
                 "client's next correction run, {by}, applied and published them as this "
                 "run's"),
    "superseded": ("the run's recorded corrections failed their applied check and were never "
                   "published; {by} rewrote the client's sessions and attributions from its "
                   "pageviews and orders (the batch's merged rows among them) and published "
                   "them instead"),
}


def write_plan_taken_over(config: Config, *, planned_by: str, client_id: str,
                          how: Literal["finished", "superseded"], by: str, lines: Lines
                          ) -> tuple[str, Path] | None:
    """The page of the backfill run whose plan (``planned_by``, its corrections run id)
    another run took over (``by``); None, and no page, for a plan of another job (a
    recompute's run has no summary page). ``finished``,
    the client's next correction run applied and published it as the run's (``corrections``
    C6); ``superseded``, it failed its applied check and a full recompute of the client
    rewrote and published all it could change instead (``recompute`` R7, the remedy the
    check's error names). A run summary of its own (status ``info``), which supersedes the
    failed one in the index (the latest per title stands) while that page, with the reason
    it failed, stays linked. Without it the run stayed red once the client's tables and topics
    held its batch. ``info`` as a run's own success is: its gates say whether a plan passed."""
    job, run_id = split_run_id(planned_by)
    if job != "backfill":
        return None
    return _write(
        config, run_id=run_id, client_id=client_id, lines=lines, failed=False,
        title=f"Backfill {run_id}: plan {how} by {by}",
        name=f"{reports.safe_name(run_id)}.{how}", entry_title=reports.RUN_SUMMARY,
        about=(f"client <code>{html.escape(client_id)}</code>: "
               + _TAKEN_OVER[how].format(by=f"<code>{html.escape(by)}</code>")
               + ". A summary the run wrote when it stopped (with its reason) stays linked in "
               "the index, marked superseded."))


def _write(config: Config, *, run_id: str, client_id: str, lines: Lines, failed: bool,
           title: str, name: str, entry_title: str, about: str, details: str = ""
           ) -> tuple[str, Path]:
    status = "failed" if failed else "info"
    href = f"backfills/{name}.html"
    target = reports.reports_dir(config) / href
    rows = "".join(f"<tr><th>{html.escape(step)}</th><td>{html.escape(text)}</td></tr>"
                   for step, text in lines)
    outcome = f"<p>{reports.status_badge(status)}</p>" if failed else ""
    write_atomically(target, reports.page(
        title, f"{outcome}<p>{about}</p><table>{rows}</table>{details}", depth=1))
    summary = " | ".join(f"{step}: {text}" for step, text in lines)
    reports.record(config, reports.ReportEntry(
        time=reports.now_utc().isoformat(), job="backfill", run_id=run_id, kind="report",
        title=entry_title, status=status, href=href, summary=summary[:SUMMARY_MAX_CHARS],
        client_id=client_id))
    return summary, target


def write_failure_safely(error: BaseException, write: Callable[[], T]) -> T | None:
    """Call ``write()`` (a failure page's writer) while ``error`` propagates: the step's own
    error is the one to raise, so a failure to write the page becomes a note on it."""
    with noted_on(error, "writing the run's failure report"):
        return write()
    return None
