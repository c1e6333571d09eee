"""Quality reports under ``$CLICKSTREAM_HOME/reports``: GX Data Docs pages, correction
reports, and the index that lists every run.

Layout (static files, relative links only, so any web server or the Airflow UI plugin can
serve the folder as it is, and a browser can open ``index.html`` from disk)::

    reports/
      index.html                                   every run, newest first, pass/fail, links
      index-failed.html, index-client-<client>.html   the index filtered (static: R3)
      runs.jsonl                                   the index's entries, one JSON per line
      expectations/<gate>.html                     each suite rendered by GX (what it checks)
      validations/<gate>/<job>-<run>/<time>/result.html   GX Data Docs page of one validation
      validations/<gate>/<job>-<run>/<time>/result.json   the GX validation result
      corrections/<job>-<run>.html                 what a backfill / recompute changed
      backfills/<run>.html                         a backfill run's summary (or why it failed)
      backfills/<run>.finished.html                who published its plan, if another run did
      static/images/favicon.ico

Known edge cases, cited inline as (R1)..(R5):
  R1. Several processes write reports at once (the stream, a backfill, Airflow tasks): an
      entry is appended and the index rebuilt under an exclusive file lock, and the index is
      replaced atomically, so a reader never sees half a page.
  R2. Validation pages sit four folders deep, the depth GX's page template assumes for its
      "Home" link (``../../../../index.html``), which therefore lands on this index; GX's
      favicon link is one level short of that depth and is corrected here.
  R3. GX pages load Bootstrap and jQuery from public CDNs; offline they still show every
      result (GX inlines its own styles), only less styled. Our pages are self-contained.
      Airflow's Quality reports view runs none of these scripts (``script-src 'none'``,
      ``plugins/quality_reports.py`` Q4): same results and styles, no sorting or filtering.
  R4. Values on a page are text, never markup: they come from data (a batch's client_id) and
      from the backfill form (the client, in the run id), and the Airflow UI serves these
      pages on its own origin, so a ``<script>`` among them would run as the logged-in user.
      GX escapes only its string templates' parameters, not table cells or the page header,
      so every other string of a GX document is escaped here before GX renders it.
  R5. A new entry changes the index, the failed runs' page and the pages of its run's
      clients, and only those while the clients stay the same (every filtered page links to
      every client's): the rest are left as they were. Rewritten at every entry, a
      sessionizer's reports (its failures, every micro-batch with bad data) rewrote a page per
      client each time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import html
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clickstream.atomic_files import write_atomically
from clickstream.config import Config
from clickstream.locks import exclusive
from clickstream.quality import suites

if TYPE_CHECKING:
    from clickstream.quality.gates import GateResult

INDEX = "index.html"
ENTRIES = "runs.jsonl"
STATUS_ORDER = {"failed": 3, "warning": 2, "passed": 1, "info": 0}

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em 2em;color:#1d1d1f}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}th,td{padding:.3em .7em;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}th{background:#f5f5f7}td.num{text-align:right;
font-variant-numeric:tabular-nums}code{background:#f3f3f3;padding:0 .2em}
.status{display:inline-block;padding:.05em .5em;border-radius:.7em;font-size:.85em;color:#fff}
.failed{background:#c62828}.warning{background:#b26a00}.passed{background:#2e7d32}
.info{background:#546e7a}a.gate{margin-right:.6em;white-space:nowrap}
a.gate.failed,a.gate.warning,a.gate.passed,a.gate.info{background:none;font-weight:600}
a.gate.failed{color:#c62828}a.gate.warning{color:#b26a00}a.gate.passed{color:#2e7d32}
a.gate.info{color:#37474f}a.gate.superseded{opacity:.55;text-decoration:line-through}
.muted{color:#666;font-size:.9em}
"""


def reports_dir(config: Config) -> Path:
    """``$CLICKSTREAM_HOME/reports``."""
    return config.home / "reports"


@dataclass(frozen=True)
class ReportEntry:
    """One line of the index: a validation, a correction report, or another run report.

    Attributes:
        time: ISO-8601 UTC time of the report.
        job: ``sessionize``, ``backfill``, ``recompute`` (or another job's name).
        run_id: the job's run id; entries of one run are shown together.
        kind: ``validation``, ``corrections`` or ``report``.
        title: link text (a gate name, "corrections", ...).
        status: ``passed``, ``warning``, ``failed`` or ``info``.
        href: the page, relative to the reports folder.
        summary: one line shown as the link's tooltip.
        client_id: the run's client, if any.
    """

    time: str
    job: str
    run_id: str
    kind: str
    title: str
    status: str
    href: str
    summary: str = ""
    client_id: str | None = None


def safe_name(text: str) -> str:
    """A file or folder name made of ``[A-Za-z0-9._-]`` only, one per ``text``: a name that
    had to change (other characters, or over 120) ends with a digest of ``text``, since
    ``a b``, ``a/b`` and ``a_b`` (or two long client ids alike in their first 120
    characters) overwrote each other's reports and step results."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")
    if clean and clean == text and len(clean) <= 120:
        return clean
    return f"{clean[:100] or 'run'}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _locked(root: Path) -> contextlib.AbstractContextManager[None]:
    return exclusive(root / ".lock")  # (R1)


def record(config: Config, entry: ReportEntry) -> Path:
    """Add ``entry`` to the index and rebuild ``index.html``; returns the index's path."""
    root = reports_dir(config)
    with _locked(root):
        with (root / ENTRIES).open("a+b") as handle:  # appends go to the end, read or not
            end = handle.seek(0, os.SEEK_END)
            cut = False
            if end:  # a line an earlier append left cut (a full disk, a kill): this entry
                handle.seek(end - 1)  # starts a line of its own, or the two were glued into
                cut = handle.read(1) != b"\n"  # one that does not parse, both lost
            line = json.dumps(asdict(entry)) + "\n"
            handle.write((("\n" if cut else "") + line).encode())
        return _rebuild_index(root, touched=(entry.job, entry.run_id))


def rebuild_index(config: Config) -> Path:
    """Rebuild ``index.html`` from ``runs.jsonl`` (e.g. after deleting old reports)."""
    root = reports_dir(config)
    with _locked(root):
        return _rebuild_index(root)


def read_entries(root: Path) -> list[ReportEntry]:
    """The index's entries, the latest one per page."""
    return _entries_and_unreadable(root)[0]


def _entries_and_unreadable(root: Path) -> tuple[list[ReportEntry], list[int]]:
    """The index's entries, the latest one per page; and the numbers of the lines of
    ``runs.jsonl`` that are no entry (cut by a full disk or a kill, or written by another
    release of the product), which the index names rather than leaving their runs out
    without a word."""
    path = root / ENTRIES
    if not path.exists():
        return [], []
    by_href: dict[str, ReportEntry] = {}
    unreadable: list[int] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = ReportEntry(**json.loads(line))
        except (ValueError, TypeError):
            unreadable.append(number)
            continue
        if (root / entry.href).exists():
            by_href[entry.href] = entry
    return list(by_href.values()), unreadable


def page(title: str, body: str, *, depth: int = 0) -> str:
    """A self-contained page; ``depth`` = folders below the reports folder (for the home link)."""
    home = "../" * depth + INDEX
    return ("<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<p class='muted'><a href='{home}'>&larr; all quality reports</a></p>"
            f"<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def status_badge(status: str) -> str:
    return f"<span class='status {html.escape(status)}'>{html.escape(status)}</span>"


def _worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=lambda s: STATUS_ORDER.get(s, 0))


RUN_SUMMARY = "run summary"  # the title of a backfill run's summary page (run_summary)
DRY_RUN = "dry run"  # and of a dry run's, which shares the run id


def current_entries(items: Iterable[ReportEntry]) -> set[int]:
    """The ids of a run's entries that stand: the latest of each title (a gate, a report)
    and client; a dry run's summary stands until the run's real summary is written.

    A rerun of the same run id (a retry, a cleared task, the CLI finishing a DAG run) passes
    the gate that failed before: the run's status is its latest attempt's, and the earlier
    failure stays linked, marked superseded. A dry run that failed (a setting, a transient
    error) and the real run of its batch that then succeeded share the run id: the run was
    red for good."""
    latest: dict[tuple[str, str | None], ReportEntry] = {}
    for entry in sorted(items, key=lambda e: e.time):
        latest[entry.title, entry.client_id] = entry
    for (title, client), entry in list(latest.items()):
        real = latest.get((RUN_SUMMARY, client))
        if title == DRY_RUN and real is not None and real.time > entry.time:
            del latest[title, client]
    return {id(entry) for entry in latest.values()}


def run_status(items: Sequence[ReportEntry], standing: set[int]) -> str:
    """A run's status in the index: the worst of its entries that stand."""
    return _worst(e.status for e in items if id(e) in standing)


FILTERED_PREFIX = "index-"  # index-failed.html, index-client-<client>.html: the index filtered


@dataclass(frozen=True)
class _RunRow:
    run: tuple[str, str]  # job, run id
    time: str
    status: str
    clients: tuple[str, ...]
    html: str


def _run_label(job: str, items: Sequence[ReportEntry]) -> str:
    """The job, and whether the row is a dry run's (which shares its batch's run id)."""
    titles = {e.title for e in items}
    if DRY_RUN not in titles:
        return job
    return f"{job} (and a dry run)" if RUN_SUMMARY in titles else f"{job} (dry run)"


def _run_rows(entries: Sequence[ReportEntry]) -> list[_RunRow]:
    runs: dict[tuple[str, str], list[ReportEntry]] = {}
    for entry in entries:
        runs.setdefault((entry.job, entry.run_id), []).append(entry)
    rows = []
    for (job, run_id), items in runs.items():
        items.sort(key=lambda e: e.time)
        standing = current_entries(items)
        status = run_status(items, standing)
        clients = tuple(sorted({e.client_id for e in items if e.client_id}))
        links = " ".join(
            f"<a class='gate {html.escape(e.status)}"
            f"{'' if id(e) in standing else ' superseded'}' href='{html.escape(e.href)}' "
            f"title='{html.escape(e.summary or e.status)}"
            f"{'' if id(e) in standing else ' (superseded by a later attempt)'}'>"
            f"{html.escape(e.title)}</a>"
            for e in items)
        time = max(e.time for e in items)
        rows.append(_RunRow((job, run_id), time, status, clients, (
            f"<tr><td>{html.escape(time[:19].replace('T', ' '))}</td>"
            f"<td>{html.escape(_run_label(job, items))}</td><td><code>{html.escape(run_id)}"
            f"</code></td><td>{html.escape(', '.join(clients))}</td>"
            f"<td>{status_badge(status)}</td><td>{links}</td></tr>")))
    return sorted(rows, key=lambda row: row.time, reverse=True)


def client_index_name(client_id: str) -> str:
    return f"{FILTERED_PREFIX}client-{safe_name(client_id)}.html"


def _filters(clients: Sequence[str], shown: str) -> str:
    """Links to the index filtered (static pages: no script runs in the Airflow view, R3)."""
    choices = [("all runs", INDEX), ("failed or with warnings", f"{FILTERED_PREFIX}failed.html"),
               *((f"client {c}", client_index_name(c)) for c in clients)]
    return "<p>Show: " + " · ".join(
        f"<b>{html.escape(label)}</b>" if href == shown
        else f"<a href='{html.escape(href)}'>{html.escape(label)}</a>"
        for label, href in choices) + "</p>"


def _runs_table(rows: Sequence[_RunRow]) -> str:
    statuses = [row.status for row in rows]
    counts = {s: statuses.count(s) for s in ("failed", "warning", "passed", "info")}
    return (  # "info": a run with no gate's result (gates off, a summary page alone)
        f"<p>{len(rows)} runs: {counts['failed']} failed, {counts['warning']} with warnings, "
        f"{counts['passed']} passed, {counts['info']} without a gate's result. Newest "
        "first; updated "
        f"{html.escape(now_utc().strftime('%Y-%m-%d %H:%M:%S UTC'))}. Each link opens a "
        "Great Expectations Data Docs page of one gate's validation, or a run's correction "
        "report; colour = result.</p>"
        "<table><tr><th>time (UTC)</th><th>job</th><th>run</th><th>client</th><th>status</th>"
        f"<th>reports</th></tr>"
        f"{''.join(row.html for row in rows) or '<tr><td colspan=6>no runs yet</td></tr>'}"
        "</table>")


def _rebuild_index(root: Path, touched: tuple[str, str] | None = None) -> Path:
    """Write the index and its filtered pages; with ``touched`` (the job and run id of a new
    entry), only the filtered pages it changed (R5)."""
    entries, unreadable = _entries_and_unreadable(root)
    rows = _run_rows(entries)
    clients = sorted({client for row in rows for client in row.clients})
    suites_rows = []
    for gate in suites.GATES:
        meta = suites.suite_json(gate).get("meta", {}).get("clickstream", {})
        target = f"expectations/{gate}.html"
        name = (f"<a href='{target}'>{gate}</a>" if (root / target).exists()
                else html.escape(gate))
        suites_rows.append(
            f"<tr><td>{name}</td><td class='num'>{html.escape(str(meta.get('version', '?')))}"
            f"</td><td>{html.escape(str(meta.get('step', '')))}</td>"
            f"<td>{html.escape(str(meta.get('on_failure', '')))}</td></tr>")
    body = (
        _unreadable_note(unreadable) + _filters(clients, INDEX) + _runs_table(rows) +
        "<h2>Gates</h2><p>Each gate's expectation suite (versioned JSON in "
        "<code>expectations/</code>), rendered by Great Expectations.</p>"
        "<table><tr><th>gate</th><th>version</th><th>runs in</th><th>on failure</th></tr>"
        f"{''.join(suites_rows)}</table>")
    filtered = {f"{FILTERED_PREFIX}failed.html": ("Quality reports: runs failed or with warnings",
                                                  [r for r in rows
                                                   if r.status in ("failed", "warning")])}
    filtered.update({client_index_name(c): (f"Quality reports: client {c}",
                                            [r for r in rows if c in r.clients])
                     for c in clients})
    written = {path.name for path in root.glob(f"{FILTERED_PREFIX}*.html")}
    for stale in written - set(filtered):  # a client whose reports were deleted
        (root / stale).unlink(missing_ok=True)
    if touched is not None and written == set(filtered):  # the same clients (R5)
        unchanged = {client_index_name(c) for c in clients} - {
            client_index_name(c) for row in rows if row.run == touched for c in row.clients}
        filtered = {name: shown for name, shown in filtered.items() if name not in unchanged}
    for name, (title, shown) in filtered.items():
        write_atomically(root / name, page(title, _filters(clients, name) + _runs_table(shown)))
    target = root / INDEX
    write_atomically(target, page("Quality reports", body).replace(
        f"<p class='muted'><a href='{INDEX}'>&larr; all quality reports</a></p>", ""))
    return target


def _unreadable_note(numbers: list[int]) -> str:
    if not numbers:
        return ""
    shown = ", ".join(map(str, numbers[:10])) + (" and more" if len(numbers) > 10 else "")
    return (f"<p>{status_badge('warning')} {len(numbers)} line(s) of <code>{ENTRIES}</code> "
            f"could not be read (line {shown}): the runs they record are not listed. A line "
            "cut by a full disk or a kill, or one another release wrote; fix or delete it: "
            "the next run's report rebuilds this page.</p>")


# --- Great Expectations Data Docs ------------------------------------------------------------

_suite_pages_written: set[tuple[str, str]] = set()


def _gx_static(root: Path) -> None:
    favicon = root / "static" / "images" / "favicon.ico"
    if not favicon.exists():
        from great_expectations.render import view

        source = Path(view.__file__).parent / "static" / "images" / "favicon.ico"
        favicon.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, favicon)


def write_suite_page(config: Config, gate: str) -> Path:
    """Render ``gate``'s expectation suite with GX at ``expectations/<gate>.html``."""
    root = reports_dir(config)
    target = root / "expectations" / f"{gate}.html"
    key = (str(root), gate)
    if key not in _suite_pages_written or not target.exists():
        _gx_static(root)
        write_atomically(target, _suite_page_html(gate))
        _suite_pages_written.add(key)
    return target


@functools.cache
def _suite_page_html(gate: str) -> str:
    """GX's page of ``gate``'s suite, rendered once per process: the suites are the process's
    (``suites.engine``), and rendering all five took ~0.4 s, paid again by every new reports
    folder (each test's warehouse)."""
    from great_expectations.render.renderer import ExpectationSuitePageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    document = ExpectationSuitePageRenderer().render(suites.gx_suite(gate))
    return DefaultJinjaPageView().render(document)


def _as_text(node: Any) -> Any:
    """A rendered GX document (as JSON) with every string HTML-escaped, except inside string
    templates, whose parameters GX escapes itself (R4)."""
    if isinstance(node, dict):
        return {key: value if key == "string_template" else _as_text(value)
                for key, value in node.items()}
    if isinstance(node, list):
        return [_as_text(value) for value in node]
    return html.escape(node) if isinstance(node, str) else node


@functools.cache
def _text_only_page_view() -> Any:
    """One view per process: its jinja environment keeps the templates it compiled (a new
    view compiles them again, ~0.1 s of every gate's page)."""
    from great_expectations.render.view import DefaultJinjaPageView

    class TextOnlyPageView(DefaultJinjaPageView):
        def _validate_document(self, document: Any) -> None:  # the escaped JSON of one
            assert isinstance(document, dict)

    return TextOnlyPageView()


def _render_as_text(document: Any) -> str:
    """GX's HTML page of ``document`` (a ``RenderedDocumentContent``), values as text (R4)."""
    return _text_only_page_view().render(_as_text(document.to_json_dict()))


_BODY_TAG = re.compile(r"<body[^>]*>")
_VERDICT_COLOURS = {"failed": "#f8d7da", "warning": "#fff3cd", "passed": "#d4edda"}


def _verdict_banner(result: GateResult) -> str:
    """The product's verdict at the top of GX's page: GX says "Failed" whenever one
    expectation is unmet, a warning's too, where the step went on (review, session 78)."""
    if result.status == "failed":
        what = (f"{len(result.failures)} of {len(result.outcomes)} expectations failed: the "
                "step refused its data")
    elif result.status == "warning":
        what = (f"{len(result.warnings)} of {len(result.outcomes)} expectations unmet, all "
                "warnings: the step went on (GX's status below counts them as failures)")
    else:
        what = f"all {len(result.outcomes)} expectations met"
    unmet = "".join(f"<li>{html.escape(o.severity)}: {html.escape(o.reason)}</li>"
                    for o in (*result.failures, *result.warnings))
    return (f'<div style="background:{_VERDICT_COLOURS[result.status]};padding:8px 16px;'
            f'font-family:sans-serif">clickstream verdict: <b>{result.status}</b>: '
            f"{html.escape(what)}{f'<ul>{unmet}</ul>' if unmet else ''}"
            f"{_judged_figures(result.checks)}</div>")


def _judged_figures(checks: Mapping[str, Any]) -> str:
    """Every figure the gate judged, on the page a reviewer opens (they were in
    ``result.json`` only: GX's page shows only those an expectation names)."""
    cells = "".join(
        f"<tr><td><code>{html.escape(str(name))}</code></td><td style='text-align:right'>"
        f"{html.escape(value if isinstance(value, str) else json.dumps(value, default=str))}"
        "</td></tr>" for name, value in checks.items())
    return (f"<details><summary>the {len(checks)} figures the gate judged</summary>"
            f"<table style='border-collapse:collapse'>{cells}</table></details>")


def write_validation(config: Config, result: GateResult, validation: Any, *,
                     client_id: str | None = None) -> Path:
    """Write the Data Docs page (and JSON) of one gate validation; add it to the index.

    Args:
        config: the run's settings.
        result: the gate's verdict (names, status, label).
        validation: GX's ``ExpectationSuiteValidationResult`` for it.
        client_id: shown in the index.

    Returns:
        The HTML page's path.
    """
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.render.renderer import ValidationResultsPageRenderer

    root = reports_dir(config)
    moment = now_utc()
    stamp = moment.strftime("%Y%m%dT%H%M%S.%fZ")
    folder = (root / "validations" / result.gate / safe_name(f"{result.job}-{result.run_id}")
              / stamp)  # four folders deep (R2)
    run_name = " ".join(filter(None, (result.job, result.run_id, result.label)))
    validation.meta["run_id"] = RunIdentifier(run_name=run_name, run_time=moment)
    spec = validation.meta.get("batch_spec")
    if isinstance(spec, dict):  # GX's page header takes the data asset from the batch spec
        spec["data_asset_name"] = f"{result.gate} check results"
    validation.meta["clickstream"] = {"gate": result.gate, "job": result.job,
                                      "run_id": result.run_id, "label": result.label,
                                      "status": result.status,
                                      "suite_version": result.suite_version,
                                      "check_results": dict(result.checks)}
    for gate in suites.GATES:  # once per process: the index links every gate's suite
        write_suite_page(config, gate)
    document = ValidationResultsPageRenderer().render(validation)
    text = _render_as_text(document).replace(
        'href="../../../static/images/favicon.ico"',
        'href="../../../../static/images/favicon.ico"')  # (R2)
    text = _BODY_TAG.sub(lambda tag: tag.group(0) + _verdict_banner(result), text, count=1)
    target = folder / "result.html"
    write_atomically(target, text)
    write_atomically(folder / "result.json", json.dumps(
        validation.to_json_dict(), indent=1, default=str))
    title = result.gate + (f" ({result.label})" if result.label else "")
    summary = "; ".join(o.reason for o in (*result.failures, *result.warnings)) or (
        f"all {len(result.outcomes)} expectations met")
    record(config, ReportEntry(
        time=moment.isoformat(), job=result.job, run_id=result.run_id, kind="validation",
        title=title, status=result.status, href=target.relative_to(root).as_posix(),
        summary=summary, client_id=client_id))
    return target


def svg_bar_chart(points: list[tuple[str, float]], *, width: int = 900, height: int = 260,
                  unit: str = "") -> str:
    """An inline SVG bar chart of (label, value); negative values point down."""
    if not points:
        return "<p class='muted'>nothing to chart</p>"
    left, right, top, bottom = 70, 10, 10, 40
    inner_w, inner_h = width - left - right, height - top - bottom
    high = max(0.0, *(v for _, v in points))
    low = min(0.0, *(v for _, v in points))
    span = (high - low) or 1.0

    def y(value: float) -> float:
        return top + (high - value) / span * inner_h

    step = inner_w / len(points)
    bar = max(1.0, step * 0.8)
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' role='img' aria-label='bar chart'>",
             f"<line x1='{left}' y1='{y(0):.1f}' x2='{width - right}' y2='{y(0):.1f}' "
             "stroke='#333' stroke-width='1'/>"]
    for value in sorted({high, low, 0.0}):
        parts.append(f"<text x='{left - 6}' y='{y(value) + 4:.1f}' font-size='11' "
                     f"text-anchor='end'>{value:,.2f}</text>")
    every = max(1, len(points) // 12)
    for i, (label, value) in enumerate(points):
        x = left + i * step + (step - bar) / 2
        y0, y1 = sorted((y(0), y(value)))
        colour = "#2e7d32" if value >= 0 else "#c62828"
        parts.append(f"<rect x='{x:.1f}' y='{y0:.1f}' width='{bar:.1f}' "
                     f"height='{max(y1 - y0, 0.5):.1f}' fill='{colour}'><title>"
                     f"{html.escape(label)}: {value:+,.2f}{html.escape(unit)}</title></rect>")
        if i % every == 0:
            parts.append(f"<text x='{x + bar / 2:.1f}' y='{height - bottom + 16}' "
                         f"font-size='10' text-anchor='middle'>{html.escape(label)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def table(headers: list[str], rows: list[list[Any]], numeric: set[int] | None = None) -> str:
    """An HTML table; columns in ``numeric`` are right-aligned."""
    numeric = numeric or set()
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(
            f"<td{' class=num' if i in numeric else ''}>{html.escape(str(c))}</td>"
            for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def validations_of(config: Config, job: str, run_id: str) -> list[ReportEntry]:
    """The index entries of one run (to link a correction report to its gates)."""
    return [e for e in read_entries(reports_dir(config))
            if e.job == job and e.run_id == run_id and e.kind == "validation"]


def relative(target: str, depth: int) -> str:
    return "../" * depth + target


def mapping_rows(values: Mapping[str, Any]) -> list[list[Any]]:
    return [[k, v] for k, v in values.items()]
