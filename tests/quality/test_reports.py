"""The reports folder: GX Data Docs pages, suite pages and the index; every relative link of
every page resolves inside the folder."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

from clickstream.config import Config
from clickstream.jobs.corrections import CorrectionSummary
from clickstream.quality.correction_report import CorrectionFigures, write_correction_report
from clickstream.quality.gates import run_gate
from clickstream.quality.reports import (
    DRY_RUN,
    RUN_SUMMARY,
    ReportEntry,
    client_index_name,
    read_entries,
    rebuild_index,
    record,
    reports_dir,
    svg_bar_chart,
)
from tests.quality.test_suites import BAD, GOOD, PARAMETERS


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.rows: list[list[str]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [v for k, v in attrs if k in ("href", "src") and v]
        if tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def relative_links(path: Path) -> list[str]:
    out = []
    for link in parse(path).links:
        parts = urlsplit(link)
        if parts.scheme or parts.netloc or link.startswith(("#", "javascript:", "data:")):
            continue
        out.append(unquote(parts.path))
    return out


def assert_every_link_resolves(root: Path) -> int:
    """Every relative href/src of every page under ``root`` names a file inside ``root``."""
    checked = 0
    for page in root.rglob("*.html"):
        for link in relative_links(page):
            target = (page.parent / link).resolve()
            assert target.is_relative_to(root.resolve()), f"{page}: {link} leaves the folder"
            assert target.is_file(), f"{page.relative_to(root)}: broken link {link}"
            checked += 1
    return checked


def test_validations_are_rendered_indexed_and_every_link_resolves(config: Config) -> None:
    for gate in GOOD:
        run_gate(gate, GOOD[gate], config=config, job="backfill", run_id="run-1",
                 parameters=PARAMETERS.get(gate), client_id="client-00")
    change, _ = BAD["publish"]
    failed = run_gate("publish", {**GOOD["publish"], **change}, config=config,
                      job="recompute", run_id="run-2", client_id="client-01")
    root = reports_dir(config)
    assert failed.report is not None and failed.report.is_file()
    parts = failed.report.relative_to(root).parts  # four folders deep: GX's "Home" link
    assert (parts[0], parts[1], len(parts)) == ("validations", "publish", 5)
    assert (failed.report.parent / "result.json").is_file()
    text = failed.report.read_text()
    assert "retractions_without_tombstone" in text and "publish" in text
    assert (f"clickstream verdict: <b>failed</b>: {len(failed.failures)} of "
            f"{len(failed.outcomes)} expectations failed: the step refused its data") in text
    # GX says "Failed" when a warning alone is unmet, where the step went on: the product's
    # verdict tops the page (review, session 78).
    warned = run_gate("raw_events", {**GOOD["raw_events"], "malformed_fraction": 0.9},
                      config=config, job="sessionize", run_id="run-3")
    assert warned.status == "warning" and warned.report is not None
    page_text = warned.report.read_text()
    assert (f"clickstream verdict: <b>warning</b>: 1 of {len(warned.outcomes)} expectations "
            "unmet, all warnings: the step went on (GX&#x27;s status below counts them as "
            "failures)<ul><li>warning: quality gate raw_events: "
            "malformed_fraction = 0.9") in page_text
    # Every figure judged is on the page, not only those GX's expectations name.
    assert f"the {len(warned.checks)} figures the gate judged" in page_text
    for name, value in warned.checks.items():
        assert (f"<code>{html.escape(name)}</code></td><td style='text-align:right'>"
                f"{html.escape(value if isinstance(value, str) else json.dumps(value))}"
                ) in page_text

    index = root / "index.html"
    rows = [r for r in parse(index).rows if len(r) == 6]
    assert [(r[1], r[2], r[4]) for r in rows] == [("sessionize", "run-3", "warning"),
                                                   ("recompute", "run-2", "failed"),
                                                   ("backfill", "run-1", "passed")]
    assert rows[0][0] >= rows[1][0]  # newest first
    # The index filtered, as static pages (no script runs in Airflow's view): by client, and
    # the runs a reviewer must look at; each links to the others.
    assert "index-failed.html" in relative_links(index)
    failing = [(r[2], r[4]) for r in parse(root / "index-failed.html").rows if len(r) == 6]
    assert failing == [("run-3", "warning"), ("run-2", "failed")]
    for client, runs in (("client-00", ["run-1"]), ("client-01", ["run-2"])):
        name = client_index_name(client)
        assert name in relative_links(index) and name in relative_links(root / "index-failed.html")
        assert [r[2] for r in parse(root / name).rows if len(r) == 6] == runs
    linked = set(relative_links(index))
    assert {e.href for e in read_entries(root)} <= linked
    assert {f"expectations/{gate}.html" for gate in GOOD} <= linked
    assert assert_every_link_resolves(root) >= 20


def test_a_rerun_that_passes_the_failed_gate_turns_its_run_green(config: Config) -> None:
    change, _ = BAD["publish"]
    failed = run_gate("publish", {**GOOD["publish"], **change}, config=config,
                      job="backfill", run_id="rerun", client_id="client-00")
    other = run_gate("publish", {**GOOD["publish"], **change}, config=config,
                     job="backfill", run_id="other", client_id="client-00")
    passed = run_gate("publish", GOOD["publish"], config=config, job="backfill",
                      run_id="rerun", client_id="client-00")
    assert (failed.status, other.status, passed.status) == ("failed", "failed", "passed")
    root = reports_dir(config)
    index = (root / "index.html").read_text()
    rows = {r[2]: r[4] for r in parse(root / "index.html").rows if len(r) == 6}
    assert rows == {"rerun": "passed", "other": "failed"}
    assert "2 runs: 1 failed, 0 with warnings, 1 passed, 0 without a gate's result" in index
    # the earlier failure stays linked, marked superseded; the later attempt is not
    assert failed.report is not None and passed.report is not None
    for report, superseded in ((failed.report, True), (passed.report, False)):
        href = report.relative_to(root).as_posix()
        link = re.search(rf"<a class='([^']*)' href='{re.escape(href)}'", index)
        assert link is not None and ("superseded" in link.group(1).split()) is superseded
    # The run's correction report says so too: it listed a red 'failed' beside the green.
    run = SimpleNamespace(config=config, run_id="backfill-rerun", client_id="client-00",
                          cause="backfill rerun", progress=lambda _: None)
    page = write_correction_report(run, CorrectionSummary(sessions_updated=1),  # type: ignore[arg-type]
                                   CorrectionFigures())
    assert page is not None
    gates = re.findall(r"<li>(.*?)</li>", page.read_text().split("Quality gates of this run")[1])
    assert [("failed" in g, "superseded by a later attempt" in g) for g in gates] == [
        (True, True), (False, False)]
    recorded = re.search(r"<summary>summary as recorded</summary><pre>(.*?)</pre>",
                         page.read_text(), re.S)
    assert recorded is not None  # JSON a reviewer can read (it was a Python dict's repr)
    assert json.loads(html.unescape(recorded.group(1)))["sessions_updated"] == 1


def test_a_real_run_supersedes_the_failed_dry_run_of_its_batch_not_the_converse(
        config: Config) -> None:
    """A dry run and the real run of a batch share its run id: a dry run that failed (a
    setting fixed later, a transient error) kept the run red after its real run succeeded."""
    def entry(run_id: str, minute: int, title: str, status: str) -> None:
        page = reports_dir(config) / "backfills" / f"{run_id}-{minute}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text("<p>a run summary</p>")
        record(config, ReportEntry(
            time=f"2026-11-29T10:{minute:02d}:00+00:00", job="backfill", run_id=run_id,
            kind="report", title=title, status=status, href=f"backfills/{run_id}-{minute}.html",
            client_id="client-00"))

    entry("fixed", 1, DRY_RUN, "failed")
    entry("fixed", 2, RUN_SUMMARY, "info")
    entry("dry-after", 1, RUN_SUMMARY, "info")
    entry("dry-after", 2, DRY_RUN, "failed")
    index = reports_dir(config) / "index.html"
    rows = {r[2]: r[4] for r in parse(index).rows if len(r) == 6}
    assert rows == {"fixed": "info", "dry-after": "failed"}
    # counted: a run with no gate's result (gates off) was in the total only
    assert ("2 runs: 1 failed, 0 with warnings, 0 passed, 1 without a gate's result"
            in index.read_text())
    # A dry run shares its batch's run id: the index says which rows are (or hold) one.
    entry("only-dry", 3, DRY_RUN, "passed")
    jobs = {r[2]: r[1] for r in parse(index).rows if len(r) == 6}
    assert jobs == {"fixed": "backfill (and a dry run)", "dry-after": "backfill (and a dry run)",
                    "only-dry": "backfill (dry run)"}


def test_the_index_survives_deleted_reports_and_lists_other_jobs_pages(config: Config) -> None:
    """A report deleted by hand (or by a cleanup) leaves the index without a broken link; the
    pages of the other jobs and runs stay listed (an index of nothing passed here before)."""
    result = run_gate("tables_after_merge", GOOD["tables_after_merge"], config=config,
                      job="backfill", run_id="gone")
    kept = run_gate("publish", GOOD["publish"], config=config, job="recompute",
                    run_id="kept", client_id="client-01")
    assert result.report is not None and kept.report is not None
    result.report.unlink()
    rebuild_index(config)
    root = reports_dir(config)
    index = root / "index.html"
    assert "gone" not in index.read_text()
    assert [(r[1], r[2], r[4]) for r in parse(index).rows if len(r) == 6] == [
        ("recompute", "kept", "passed")]
    assert kept.report.relative_to(root).as_posix() in relative_links(index)
    assert assert_every_link_resolves(root) > 0


def test_a_cut_line_of_the_index_is_named_and_the_next_entry_is_kept(config: Config) -> None:
    """An append cut by a full disk or a kill left a line without its end: the next entry was
    glued to it, and the index left both runs out without a word (review, session 88)."""
    first = run_gate("publish", GOOD["publish"], config=config, job="recompute", run_id="first")
    assert first.report is not None
    entries = reports_dir(config) / "runs.jsonl"
    with entries.open("a", encoding="utf-8") as handle:
        handle.write('{"time": "2026-12-07T00:00:00+00:00", "job": "backf')  # cut here
    run_gate("publish", GOOD["publish"], config=config, job="recompute", run_id="after")
    index = (reports_dir(config) / "index.html").read_text()
    assert sorted(r[2] for r in parse(reports_dir(config) / "index.html").rows
                  if len(r) == 6) == ["after", "first"]
    cut = len(entries.read_text().splitlines()) - 1  # the line before the last entry's
    assert re.search(rf"1 line\(s\) of <code>runs\.jsonl</code> could not be read \(line "
                     rf"{cut}\): the runs they record are not listed", index), index


def test_an_entry_rewrites_only_the_filtered_pages_it_changes(config: Config) -> None:
    """(R5) A run of one client leaves every other client's page as it was, unless a new
    client joins the filter bar every page carries."""
    root = reports_dir(config)

    def run_page(run_id: str, client: str, status: str = "passed") -> ReportEntry:
        href = f"backfills/{run_id}.html"
        (root / "backfills").mkdir(parents=True, exist_ok=True)
        (root / href).write_text(f"<p>{run_id}</p>")
        return ReportEntry(time=f"2026-12-06T10:00:0{len(read_entries(root))}+00:00",
                           job="backfill", run_id=run_id, kind="report", title=RUN_SUMMARY,
                           status=status, href=href, client_id=client)

    def written(client: str) -> tuple[int, int]:
        found = (root / client_index_name(client)).stat()
        return found.st_ino, found.st_mtime_ns

    record(config, run_page("run-a", "client-a"))
    record(config, run_page("run-b", "client-b"))
    b_page = written("client-b")
    record(config, run_page("run-a2", "client-a", status="failed"))
    assert written("client-b") == b_page
    assert [r[2] for r in parse(root / client_index_name("client-a")).rows if len(r) == 6] == [
        "run-a2", "run-a"]
    assert [r[2] for r in parse(root / "index-failed.html").rows if len(r) == 6] == ["run-a2"]
    record(config, run_page("run-c", "client-c"))
    assert written("client-b") != b_page
    assert client_index_name("client-c") in relative_links(root / client_index_name("client-b"))
    assert assert_every_link_resolves(root) > 0


def test_bar_chart_is_inline_svg_with_one_bar_per_day() -> None:
    svg = svg_bar_chart([("2026-11-01", 12.5), ("2026-11-02", -4.0), ("2026-11-03", 0.0)])
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<rect") == 3
    assert "2026-11-02: -4.00" in svg and "#c62828" in svg


def test_data_and_form_values_are_shown_as_text_in_data_docs(config: Config) -> None:
    """The most common client_id of a batch is data and the run id holds the form's client:
    GX escapes only its template parameters, so both reached the page as markup (stored XSS
    in the Airflow UI, which serves the reports on its own origin)."""
    script = "<script>alert('data')</script>"
    result = run_gate("historical_batch", {**GOOD["historical_batch"], "main_client_id": script},
                      config=config, job="backfill", run_id="orders-<svg onload=alert(1)>-1f2e",
                      parameters={"declared_client": ["<img src=x onerror=alert(2)>"]},
                      label="<i>label</i>")
    assert result.report is not None and result.status == "failed"
    text = result.report.read_text(encoding="utf-8")
    for markup in (script, "<svg onload", "<img src=x", "<i>label"):
        assert markup not in text, markup
    assert "&lt;script&gt;alert(&#x27;data&#x27;)&lt;/script&gt;" in text
    assert "orders-&lt;svg onload=alert(1)&gt;-1f2e" in text
    assert_every_link_resolves(reports_dir(config))


def test_safe_names_keep_plain_run_ids_and_never_merge_two_others() -> None:
    from clickstream.quality.reports import safe_name

    assert safe_name("orders-client-00-3f2a.v1") == "orders-client-00-3f2a.v1"  # as it was
    merged_before = ["recompute-acme eu-q17", "recompute-acme/eu-q17", "recompute-acme_eu-q17",
                     "backfill-" + "c" * 120 + "-q17", "backfill-" + "c" * 120 + "-q18", "", ".."]
    names = [safe_name(text) for text in merged_before]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]{1,120}", name) for name in names)
