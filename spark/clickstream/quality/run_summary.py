"""A backfill run's summary page in the quality reports: ``reports/backfills/<run>.html``.

One page per run, whatever its outcome and however it ran (``clickstream backfill`` or the
``late_batch_backfill`` DAG's steps, which share run ids): what each step did and, when one
failed, its reason. The index keeps the latest entry per page, so a run that ends well after
a failure (a retry, a cleared task, the CLI finishing it) replaces the red page.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from clickstream.config import Config
from clickstream.quality import reports

T = TypeVar("T")
SUMMARY_MAX_CHARS = 500
"""The index keeps this much of a run's summary (a link's tooltip); the page has it all."""
Lines = Sequence[tuple[str, str]]
"""(step, what it did) per step, in order."""


def failure_line(step: str, error: BaseException) -> tuple[str, str]:
    """The line naming the step that failed and its one-line reason."""
    text = str(error).strip()
    return f"{step}: failed", f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def write_run_summary(config: Config, *, run_id: str, client_id: str, kind: str, root: str,
                      lines: Lines, details: Mapping[str, Any] | None = None,
                      dry_run: bool = False, failed: bool = False) -> tuple[str, Path]:
    """Write the run's page and list it in the index (status ``failed``, else ``info``).

    Returns:
        (the summary in one paragraph, the page's path).
    """
    status = "failed" if failed else "info"
    title = f"Backfill {run_id}" + (" (dry run)" if dry_run else "")
    href = f"backfills/{reports.safe_name(run_id)}{'.dry-run' if dry_run else ''}.html"
    target = reports.reports_dir(config) / href
    rows = "".join(f"<tr><th>{html.escape(step)}</th><td>{html.escape(text)}</td></tr>"
                   for step, text in lines)
    shown = "" if details is None else (
        "<details><summary>validation details</summary><pre>"
        f"{html.escape(json.dumps(dict(details), indent=1, default=str))}</pre></details>")
    outcome = f"<p>{reports.status_badge(status)}</p>" if failed else ""
    reports.write_atomically(target, reports.page(title, (
        f"{outcome}<p>client <code>{html.escape(client_id)}</code>, {html.escape(kind)} from "
        f"<code>{html.escape(root)}</code></p><table>{rows}</table>{shown}"), depth=1))
    summary = " | ".join(f"{step}: {text}" for step, text in lines)
    reports.record(config, reports.ReportEntry(
        time=reports.now_utc().isoformat(), job="backfill", run_id=run_id, kind="report",
        title=reports.DRY_RUN if dry_run else reports.RUN_SUMMARY, status=status, href=href,
        summary=summary[:SUMMARY_MAX_CHARS], client_id=client_id))
    return summary, target


def write_failure_safely(error: BaseException, write: Callable[[], T]) -> T | None:
    """Call ``write()`` (a failure page's writer) while ``error`` propagates: the step's own
    error is the one to raise, so a failure to write the page becomes a note on it."""
    try:
        return write()
    except Exception as report_error:
        error.add_note(f"the run's failure report could not be written: {report_error}")
        return None
