"""Data-quality gates: validate a step's check results with Great Expectations, report, and
quarantine or stop.

A gate is a suite in ``expectations/<gate>.json`` plus the Spark computation of its check
results (``quality.checks``). :func:`run_gate` validates the check results with GX and writes
the Data Docs page; the ``gate_*`` functions below are what the jobs call, one per step:

=====================  ======================================  ==============================
gate                   where                                   on a failed critical expectation
=====================  ======================================  ==============================
raw_events             sessionize, each micro-batch            offending records quarantined,
                                                               the rest goes on (never stops)
historical_batch       backfill, before the merge              batch refused; offending rows
                                                               quarantined; nothing merged
tables_after_merge     backfill, after the merge               stops before any correction
recomputed_sessions    backfill + recompute, before recording  stops: nothing recorded,
                       the corrections plan                    applied or published
publish                backfill + recompute, after publishing  run fails; rerun republishes
=====================  ======================================  ==============================

Failures raise :class:`~clickstream.errors.QualityGateFailedError` with a one-line message
naming the gate, the expectation and the counts (the CLI prints it and exits non-zero).
Warnings (expectations with ``"severity": "warning"``) are reported and never stop anything.
``CLICKSTREAM_QUALITY_GATES=off`` skips every gate.

Known edge cases, cited inline as (Q1)..(Q5):
  Q1. Rows are "marked" rather than written when the step already has a quarantine write of
      its own (the stream's micro-batch, the backfill's batch): the gate sets ``error`` on
      the offending rows, so the step's single, idempotent quarantine commit carries them
      and no row is quarantined twice.
  Q2. Gates that stop a step after its own writes quarantine the offending rows themselves
      under the application transaction ``gate-<gate>-<run id>``, one version per failed
      attempt that found rows the run's earlier attempts did not store (``quarantine_once``):
      a rerun that fails the same way quarantines nothing twice and commits nothing, and one
      that fails on other rows (the tables changed meanwhile) quarantines those. With one
      fixed version, the second attempt's rows were skipped while its message said they were
      quarantined.
  Q3. A check without rows (a count that does not reconcile) quarantines one record: the
      check results themselves, so the quarantine table says why the step stopped.
  Q4. The stream writes a Data Docs page only for micro-batches with a failed expectation,
      for the first validated micro-batch of each run, and for warnings at most every 10
      minutes: a page every 2 s would bury the index. Every micro-batch is validated.
  Q5. The stream feeds its session state before its sink runs the gate, so the state's input
      is filtered by the same row predicates (:func:`raw_events_admitted`): a record the
      gate quarantines never reaches a session either.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from clickstream.config import Config
from clickstream.errors import QualityGateFailedError
from clickstream.quality import checks as C
from clickstream.quality import suites
from clickstream.quality.quarantine import quarantine_once
from clickstream.tables import ORDERS, PAGEVIEWS

if TYPE_CHECKING:
    from clickstream.io.delta_tables import DeltaTables
    from clickstream.jobs.corrections import Run, Snapshot

STREAM_WARNING_REPORT_SECONDS = 600.0  # (Q4)


def enabled(config: Config) -> bool:
    """True unless ``CLICKSTREAM_QUALITY_GATES=off``."""
    return config.quality_gates == "enforce"


def warm_up(config: Config) -> None:
    """Start importing Great Expectations in the background (it takes seconds)."""
    if enabled(config):
        suites.warm_up()


@dataclass(frozen=True)
class Outcome:
    """One expectation's verdict on one gate's check results."""

    gate: str
    expectation: str
    column: str
    severity: str
    success: bool
    observed: Any
    expected: str
    note: str

    @property
    def reason(self) -> str:
        """The quarantine reason and message part: what failed, observed vs expected."""
        return (f"quality gate {self.gate}: {self.column} = {_show(self.observed)}, expected "
                f"{self.expected} ({self.expectation}: {self.note})")


@dataclass(frozen=True)
class GateResult:
    """What one gate decided about one step of one run."""

    gate: str
    job: str
    run_id: str
    suite_version: str
    checks: Mapping[str, Any]
    outcomes: tuple[Outcome, ...]
    seconds: float
    label: str = ""
    report: Path | None = None
    quarantined: int = 0

    @property
    def failures(self) -> tuple[Outcome, ...]:
        """Failed critical expectations: the step must not go on."""
        return tuple(o for o in self.outcomes if not o.success and o.severity == "critical")

    @property
    def warnings(self) -> tuple[Outcome, ...]:
        """Failed expectations of lower severity: reported only."""
        return tuple(o for o in self.outcomes if not o.success and o.severity != "critical")

    @property
    def success(self) -> bool:
        return not self.failures

    @property
    def status(self) -> str:
        """``failed``, ``warning`` or ``passed``."""
        return "failed" if self.failures else "warning" if self.warnings else "passed"

    def describe(self) -> str:
        """One line for progress output: the failed and the warning expectations counted
        apart and told apart, as the error line counts only the failed ones."""
        failed = f", {len(self.failures)} failed" if self.failures else ""
        warned = (f", {len(self.warnings)} warning{'s' if len(self.warnings) > 1 else ''}"
                  if self.warnings else "")
        text = (f"quality gate {self.gate} (suite v{self.suite_version}): {self.status}, "
                f"{len(self.outcomes) - len(self.failures) - len(self.warnings)} of "
                f"{len(self.outcomes)} expectations met{failed}{warned} in {self.seconds:.2f}s")
        if self.failures or self.warnings:
            text += "; " + "; ".join([*(o.reason for o in self.failures),
                                      *(f"warning: {o.reason}" for o in self.warnings)])
        return text

    def message(self, consequence: str, lead: str = "") -> str:
        """The one-line error message: ``lead`` (the likely fix, if known), gate, run,
        expectations, counts, consequence, report."""
        first = "; ".join(o.reason for o in self.failures[:3])
        more = f" (and {len(self.failures) - 3} more)" if len(self.failures) > 3 else ""
        quarantined = (f"{self.quarantined} rows quarantined with the expectation as the "
                       "reason; " if self.quarantined else "")
        report = f"; report: {self.report}" if self.report else ""
        return (f"{lead}quality gate {self.gate} failed for {self.job} {self.run_id}: "
                f"{len(self.failures)} of {len(self.outcomes)} expectations failed: {first}{more}"
                f"; {quarantined}{consequence}{report}")

    def raise_if_failed(self, consequence: str, lead: str = "") -> None:
        """Raise :class:`QualityGateFailedError` when a critical expectation failed."""
        if self.failures:
            raise QualityGateFailedError(self.message(consequence, lead))


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "null" if value is None else str(value)


def _expected(kwargs: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    if "value_set" in kwargs:
        items = list(kwargs["value_set"] or [])
        shown = ", ".join(map(str, items[:6])) + (", ..." if len(items) > 6 else "")
        return f"one of [{shown}]"
    if "column_B" in kwargs:
        return f"{kwargs['column_B']} ({_show(values.get(kwargs['column_B']))})"
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    if low is not None and high is not None:
        return _show(low) if low == high else f"between {_show(low)} and {_show(high)}"
    return f"at most {_show(high)}" if high is not None else f"at least {_show(low)}"


def _outcome(gate: str, result: Any, values: Mapping[str, Any]) -> Outcome:
    config = result.expectation_config
    kwargs = dict(config.kwargs)
    column = kwargs.get("column") or kwargs.get("column_A") or ""
    note = suites.expectation_note(gate, config.type, kwargs)
    severity = getattr(config.severity, "value", config.severity) or "critical"
    return Outcome(gate=gate, expectation=config.type, column=column, severity=str(severity),
                   success=bool(result.success), observed=values.get(column),
                   expected=_expected(kwargs, values),
                   note=note.replace("`", "").replace("**", ""))


def run_gate(
    name: str, frame: C.Checks | Mapping[str, Any], *, config: Config, job: str, run_id: str,
    parameters: Mapping[str, Any] | None = None, client_id: str | None = None,
    label: str = "", report: bool | Callable[[GateResult], bool] = True,
    started: float | None = None,
) -> GateResult:
    """Validate one row of check results against gate ``name``'s suite and report it.

    Args:
        name: the gate (``suites.GATES``).
        frame: the check results: :class:`~clickstream.quality.checks.Checks` or a mapping
            ``{column: value}`` (one row).
        config: the run's settings (the report goes under ``config.home / "reports"``).
        job: ``sessionize``, ``backfill`` or ``recompute`` (groups the report index).
        run_id: the job's run id.
        parameters: values of the suite's ``$PARAMETER`` s (e.g. ``declared_client``).
        client_id: shown in the report index.
        label: distinguishes several validations of one gate in one run (``batch 12``).
        report: write the Data Docs page and an index entry; or a function of the verdict
            that says whether to.
        started: ``time.monotonic()`` when the gate began computing its check results, so
            ``seconds`` covers them too (default: now).

    Returns:
        The verdict; nothing is quarantined or raised here (see the ``gate_*`` functions).
    """
    started = time.monotonic() if started is None else started
    values = dict(frame.values if isinstance(frame, C.Checks) else frame)
    validation = suites.validate(name, values, parameters)
    outcomes = tuple(_outcome(name, r, values) for r in validation.results)
    result = GateResult(name, job, run_id, suites.suite_version(name), values, outcomes,
                        time.monotonic() - started, label)
    if report(result) if callable(report) else report:
        from clickstream.quality.reports import write_validation

        page = write_validation(config, result, validation, client_id=client_id)
        result = replace(result, report=page, seconds=time.monotonic() - started)
    return result


# --- marking and quarantining ----------------------------------------------------------------

def _implicated(checks: C.Checks, result: GateResult) -> list[tuple[Outcome, DataFrame, Column]]:
    """Critical checks with rows behind them: failed ones, and passed ones that still count
    rows (a fraction under its threshold)."""
    out = []
    for outcome in result.outcomes:
        if outcome.severity != "critical" or outcome.column not in checks.rows:
            continue
        value = outcome.observed
        counts_rows = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if not outcome.success or counts_rows:
            frame, predicate = checks.rows[outcome.column]
            out.append((outcome, frame, predicate))
    return out


def mark(frame: DataFrame, checks: C.Checks, result: GateResult) -> DataFrame:
    """``frame`` with ``error`` set on the rows the gate implicates (Q1).

    Rows of a failed expectation get its reason (before any reason they already had); rows a
    passing check still counts keep their own reason, or get the check's if they had none.
    """
    implicated = [(o, p) for o, f, p in _implicated(checks, result) if f is frame]
    failed = [(o, p) for o, p in implicated if not o.success]
    counted = [(o, p) for o, p in implicated if o.success]
    if not failed and not counted:
        return frame
    error = F.col("error")
    for outcome, predicate in reversed(failed):
        error = F.when(predicate, F.concat_ws("; ", F.lit(outcome.reason), F.col("error"))
                       ).otherwise(error)
    for outcome, predicate in counted:
        error = F.coalesce(error, F.when(predicate, F.lit(
            f"quality gate {outcome.gate}: {outcome.note}")))
    return frame.withColumn("error", error)


def gate_source_prefix(gate: str, job: str, run_id: str) -> str:
    """How ``source`` begins in the ``quarantine`` rows a gate's failure wrote for a run
    (followed by ``:`` and what the row is)."""
    return f"gate:{gate}:{job}:{run_id}"


def quarantine(tables: DeltaTables, checks: C.Checks, result: GateResult,
               client_id: str | None) -> int:
    """Copy the rows behind every failed critical expectation to ``quarantine`` (Q2, Q3)."""
    parts = []
    prefix = gate_source_prefix(result.gate, result.job, result.run_id)
    for outcome in result.failures:
        reason = F.lit(outcome.reason)
        if outcome.column in checks.rows:
            frame, predicate = checks.rows[outcome.column]
            key = checks.keys.get(id(frame))
            raw = F.to_json(F.struct(*[F.col(c) for c in frame.columns]))
            # key + content hash: deterministic, and distinct rows never share a source
            ident = F.concat_ws(":", F.col(key).cast("string") if key else F.lit(""),
                                F.substring(F.sha1(raw), 1, 12))
            client = F.col("client_id") if "client_id" in frame.columns else F.lit(client_id)
            parts.append(frame.where(predicate).select(
                raw.alias("raw"),
                F.concat_ws(":", F.lit(prefix), F.lit(outcome.column), ident).alias("source"),
                reason.alias("reason"), client.cast("string").alias("client_id"),
            ).dropDuplicates(["source"]))
        else:  # the check's figures, their digest in the source as for rows: a rerun
            # that fails with other figures (the tables changed meanwhile) stores them too
            values = json.dumps(dict(checks.values), default=str, sort_keys=True)
            digest = hashlib.sha1(values.encode()).hexdigest()[:12]
            parts.append(SparkSession.active().createDataFrame(
                [(values, f"{prefix}:{outcome.column}::{digest}", outcome.reason, client_id)],
                "raw string, source string, reason string, client_id string"))
    if not parts:
        return 0
    rows = parts[0]
    for part in parts[1:]:
        rows = rows.unionByName(part)
    rows = rows.select("*", F.current_timestamp().alias("quarantined_at"),
                       F.current_date().alias("quarantine_date")).persist()
    try:
        count = rows.count()  # all of them are in quarantine once this returns
        quarantine_once(tables, rows, app_id=f"gate-{result.gate}-{result.run_id}",  # (Q2)
                        stored_under=prefix, metadata={
                            "run_id": result.run_id,
                            "cause": f"quality gate {result.gate} failed"})
        return count
    finally:
        rows.unpersist()


def _fail(tables: DeltaTables, checks: C.Checks, result: GateResult, client_id: str | None,
          consequence: str) -> None:
    if result.success:
        return
    result = replace(result, quarantined=quarantine(tables, checks, result, client_id))
    result.raise_if_failed(consequence)


FULL_RECOMPUTE_JOB = "full-recompute"  # its run ids: full-recompute-<client>


def split_run_id(run_id: str) -> tuple[str, str]:
    """``backfill-<id>`` / ``recompute-<id>`` / ``full-recompute-<client>`` (a corrections
    run id) -> (job, id)."""
    if run_id.startswith(f"{FULL_RECOMPUTE_JOB}-"):
        return FULL_RECOMPUTE_JOB, run_id.removeprefix(f"{FULL_RECOMPUTE_JOB}-")
    job, _, rest = run_id.partition("-")
    return (job, rest) if rest else ("corrections", run_id)


# --- the gates, one per step -----------------------------------------------------------------

@dataclass
class _StreamReports:
    last: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def due(self, run_id: str, result: GateResult) -> bool:  # (Q4)
        now = time.monotonic()
        with self.lock:
            last = self.last.get(run_id)
            due = (last is None or bool(result.failures)
                   or (bool(result.warnings) and now - last >= STREAM_WARNING_REPORT_SECONDS))
            if due:
                self.last[run_id] = now
            return due


_stream_reports = _StreamReports()


def raw_events_admitted(config: Config) -> Column:
    """True for parsed records the ``raw_events`` gate lets through (Q5).

    The stream feeds its session state before its sink runs the gate, so the state's input is
    filtered with the same row predicates: every critical expectation of the suite that
    tolerates no row (``max_value`` 0) fails for any record it counts, so such a record is
    quarantined by the sink's gate and must never reach a session.
    """
    if not enabled(config):
        return F.lit(True)
    predicates = C.raw_events_predicates()
    zero_tolerance = [
        predicates[e["kwargs"]["column"]] for e in suites.suite_json("raw_events")["expectations"]
        if e.get("severity", "critical") == "critical" and e["kwargs"].get("max_value") == 0
        and e["kwargs"].get("column") in predicates]
    if not zero_tolerance:
        return F.lit(True)
    rejected = zero_tolerance[0]
    for predicate in zero_tolerance[1:]:
        rejected = rejected | predicate
    return ~F.coalesce(rejected, F.lit(False))


def gate_raw_events(records: DataFrame, config: Config, *, batch_id: int, run_id: str
                    ) -> tuple[DataFrame, GateResult | None]:
    """The ``raw_events`` gate on one micro-batch of parsed records (never stops the stream).

    Returns:
        ``records`` with the offending ones marked as errors (so the micro-batch's quarantine
        write takes them, Q1), and the verdict (None when gates are off or the batch is empty).
    """
    if not enabled(config):
        return records, None
    started = time.monotonic()
    checks = C.raw_events_checks(records)
    if not checks.values["records"]:
        return records, None
    result = run_gate("raw_events", checks, config=config, job="sessionize", run_id=run_id,
                      label=f"batch {batch_id}",
                      report=lambda verdict: _stream_reports.due(run_id, verdict),
                      started=started)
    # ``quarantined`` stays 0: the marked records are quarantined and counted by the
    # micro-batch's own write (its progress line), once each however many checks they fail.
    return mark(records, checks, result), result


def gate_historical_batch(batch: DataFrame, raw_schema: StructType, *, kind: str, key: str,
                          client_id: str, config: Config, run_id: str
                          ) -> tuple[DataFrame, GateResult | None]:
    """The ``historical_batch`` gate on a validated batch, before it is merged.

    Returns:
        ``batch`` with ``error`` set on the rows the gate implicates (Q1) and the verdict.
        The caller quarantines the error rows as usual, then calls
        ``result.raise_if_failed(...)`` so a refused batch merges nothing.
    """
    if not enabled(config):
        return batch, None
    started = time.monotonic()
    checks = C.historical_batch_checks(batch, raw_schema, kind, key, client_id)
    result = run_gate("historical_batch", checks, config=config, job="backfill", run_id=run_id,
                      parameters={"declared_client": [client_id]}, client_id=client_id,
                      started=started)
    return mark(batch, checks, result), result


def gate_tables_after_merge(tables: DeltaTables, config: Config, *, kind: str, client_id: str,
                            run_id: str, valid: DataFrame, dates: Sequence[Any] | None,
                            stored: Snapshot | None = None) -> GateResult | None:
    """The ``tables_after_merge`` gate: row counts reconcile and keys stay unique.

    ``valid`` is the batch's accepted rows, one per key (as merged); ``stored`` the merged
    table's rows of the client at the merge commit if already read (see
    ``tables_after_merge_checks``).

    Raises:
        QualityGateFailedError: before any session is recomputed; the merge stays committed.
    """
    if not enabled(config):
        return None
    started = time.monotonic()
    spec = PAGEVIEWS if kind == "pageviews" else ORDERS
    scope: dict[str, Any] | None = {"client_id": client_id}
    if kind == "pageviews" and dates is not None:
        # No day: an empty batch, whose merge touched no partition. Scoped to the client
        # alone, the gate read every pageview the client has, to reconcile nothing.
        scope = {"client_id": client_id, "event_date": list(dates)} if dates else None
    checks = C.tables_after_merge_checks(
        tables, spec, run_id=run_id, client_id=client_id,
        batch_keys=valid.select(spec.key[0]), scope=scope, stored=stored)
    result = run_gate("tables_after_merge", checks, config=config, job="backfill",
                      run_id=run_id, client_id=client_id, label=spec.name,
                      started=started)
    _fail(tables, checks, result, client_id,
          f"the merge into {spec.name} is committed, but no session was recomputed, recorded, "
          "applied or published; rerunning the backfill repeats this check")
    return result


def gate_recomputed_sessions(run: Run, sessions: DataFrame, attributions: DataFrame,
                             orders: DataFrame) -> GateResult | None:
    """The ``recomputed_sessions`` gate on a run's recomputed windows, before the plan is
    recorded. ``orders`` are the stored orders inside the windows (their amounts). The
    recompute hands ``sessions`` and ``attributions`` over materialised, so the gate's time is
    its checks alone.

    Raises:
        QualityGateFailedError: nothing recorded, applied or published.
    """
    if not enabled(run.config):
        return None
    started = time.monotonic()
    job, run_id = split_run_id(run.run_id)
    checks = C.recomputed_sessions_checks(gap_ms=run.gap_ms, sessions=sessions,
                                          attributions=attributions, orders=orders)
    result = run_gate("recomputed_sessions", checks, config=run.config, job=job,
                      run_id=run_id, client_id=run.client_id,
                      started=started)
    run.progress(f"  {result.describe()}")
    _fail(run.tables, checks, result, run.client_id,
          "no correction was recorded, no table was overwritten and nothing was published; "
          "rerunning recomputes and repeats this check")
    return result


def publish_started(config: Config) -> dict[str, dict[int, int]] | None:
    """Snapshot the changelog topics' end offsets before publishing (None when gates are
    off); pass it to :func:`gate_publish` afterwards."""
    if not enabled(config):
        return None
    return C.topic_ends(config, [config.sessions_topic, config.attributions_topic])


def gate_publish(run: Run, changes: DataFrame, since: Mapping[str, Mapping[int, int]] | None
                 ) -> GateResult | None:
    """The ``publish`` gate: every change of the plan is on its topic at its revision, and
    every retraction has a tombstone.

    Raises:
        QualityGateFailedError: the tables are corrected; rerunning republishes the plan.
    """
    if since is None or not enabled(run.config):
        return None
    started = time.monotonic()
    job, run_id = split_run_id(run.run_id)
    published = C.read_published(run.config, since)
    keys = sum(map(len, published.values()))
    run.progress(f"  publish gate: read back the last record of {keys:,} keys in "
                 f"{time.monotonic() - started:.1f}s")
    checks = C.publish_checks(changes, run.config, published)
    result = run_gate("publish", checks, config=run.config, job=job, run_id=run_id,
                      client_id=run.client_id,
                      started=started)
    run.progress(f"  {result.describe()}")
    _fail(run.tables, checks, result, run.client_id,
          f"the tables hold the corrections but topics {run.config.sessions_topic} / "
          f"{run.config.attributions_topic} lack some; rerunning the run republishes its plan "
          "(idempotent by key and revision)")
    return result

