"""The expectation suites (``expectations/<gate>.json``) and the Great Expectations engine.

Each gate's suite is a GX Core 1.x ``ExpectationSuite`` saved as JSON, one file per gate,
versioned by the file (``meta.clickstream.version``). A suite validates the gate's *check
results*: one row of numbers (and a few strings) that ``quality.checks`` computes in Spark in
one pass over the step's data. GX decides pass or fail from them; the library never does.

Why a row of check results instead of GX on the Spark DataFrame itself: measured here, GX's
Spark engine spends 1-3 s on ~10 expectations even for 1,000 rows (one Spark job per metric)
and ~11 s on 1M rows, far over the stream's budget of a few hundred ms per micro-batch and the
backfill's 15%. The same suites on one pandas row take ~50-90 ms, and several of the checks
(row-count reconciliation, overlapping sessions, what Kafka received) are cross-row or
cross-table anyway, which GX has no built-in expectations for.

Known edge cases, cited inline as (G1)..(G6):
  G1. ``import great_expectations`` takes 8-12 s here (pandas, scipy, altair, sqlalchemy):
      it is imported lazily, once per process, and :func:`warm_up` can start it in a
      background thread while Spark starts.
  G2. One ephemeral GX context per process, built on first use under a lock (the stream's
      ``foreachBatch`` runs in another thread than the driver's main thread). Ephemeral: the
      product's runs (stream, backfills, Airflow tasks) write reports concurrently, and a file
      context would rewrite ``great_expectations.yml`` and its stores from several processes.
  G3. ``Batch.validate`` is used, not ``ValidationDefinition.run``: the latter also stores
      every result in the context's store, which grows without bound in a long-running stream.
  G4. GX prints progress bars per validation unless they are switched off in the context.
  G5. On import GX logs one INFO line per public function it documents (hundreds); under
      Airflow's INFO logging they buried task logs and test failures, so that logger is
      raised to WARNING when this module (the only way the product reaches GX) is imported.
  G6. GX rebuilds an expectation's whole configuration, meta included, dozens of times while
      it plans one validation, and its ``SUMMARY`` format adds metrics that say nothing more
      about one row (the counts of each unexpected value, their row numbers). So a gate
      validates a copy of its suite without the expectations' notes, in ``BASIC`` format:
      the five gates took 361 ms instead of 646 ms (raw_events, once per micro-batch: 97
      instead of 168 ms; ``bench/gx_validation_bench.py``, BENCHMARKS.md session 65). The
      validation pages read the same (one row's unexpected value is listed either way; they
      never showed the notes); the notes stay in the suite pages and in the gates' messages
      (:func:`expectation_note`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clickstream.config import REPO_ROOT
from clickstream.errors import ConfigError

logging.getLogger("great_expectations._docs_decorators").setLevel(logging.WARNING)  # (G5)

if TYPE_CHECKING:
    from great_expectations.core import ExpectationSuiteValidationResult

SUITES_DIR = REPO_ROOT / "expectations"
GATES = ("raw_events", "historical_batch", "tables_after_merge", "recomputed_sessions", "publish")
"""Every gate, in the order a backfill meets them (the stream has only ``raw_events``)."""


def suite_path(gate: str) -> Path:
    """The JSON file of ``gate``'s suite.

    Raises:
        ConfigError: ``gate`` is not a known gate.
    """
    if gate not in GATES:
        raise ConfigError(f"unknown quality gate {gate!r}; known: {', '.join(GATES)}")
    return SUITES_DIR / f"{gate}.json"


@cache
def suite_json(gate: str) -> dict[str, Any]:
    """The suite file of ``gate`` as a dict (read once per process)."""
    path = suite_path(gate)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"expectation suite {path} cannot be read: {error}") from error
    if data.get("name") != gate:
        raise ConfigError(f"expectation suite {path} is named {data.get('name')!r}, not {gate!r}")
    return data


def suite_version(gate: str) -> str:
    """The version the suite file declares (``meta.clickstream.version``)."""
    return str(suite_json(gate).get("meta", {}).get("clickstream", {}).get("version", "?"))


def check_descriptions(gate: str) -> dict[str, str]:
    """What each check-results column means, from the suite file."""
    return dict(suite_json(gate).get("meta", {}).get("clickstream", {}).get("columns", {}))


class _Engine:
    """The process's GX context with one pandas asset per gate (G2)."""

    def __init__(self) -> None:
        import great_expectations as gx
        from great_expectations.data_context.types.base import (
            DataContextConfig,
            InMemoryStoreBackendDefaults,
            ProgressBarsConfig,
        )

        self.gx = gx
        # No Data Docs site: pages are rendered by quality.reports; no usage statistics.
        self.context = gx.get_context(mode="ephemeral", project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            analytics_enabled=False))
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False)  # (G4)
        source = self.context.data_sources.add_pandas(name="clickstream_check_results")
        self.batches = {
            gate: source.add_dataframe_asset(name=gate).add_batch_definition_whole_dataframe(
                "one_row_of_check_results")
            for gate in GATES
        }
        self.suites = {gate: gx.ExpectationSuite(**_suite_arguments(gate)) for gate in GATES}
        self._validated = {gate: gx.ExpectationSuite(**_suite_arguments(gate, notes=False))
                           for gate in GATES}  # (G6)

    def validate(self, gate: str, checks: Mapping[str, Any],
                 parameters: Mapping[str, Any]) -> ExpectationSuiteValidationResult:
        import pandas as pd

        frame = pd.DataFrame([dict(checks)])
        batch = self.batches[gate].get_batch(batch_parameters={"dataframe": frame})
        return batch.validate(self._validated[gate], expectation_parameters=dict(parameters),
                              result_format="BASIC")  # (G3, G6)


def _suite_arguments(gate: str, *, notes: bool = True) -> dict[str, Any]:
    data = suite_json(gate)
    arguments = {key: data[key] for key in ("name", "expectations", "meta", "notes")
                 if key in data}
    if not notes:
        arguments["expectations"] = [{key: value for key, value in expectation.items()
                                      if key not in ("meta", "notes")}
                                     for expectation in data["expectations"]]
    return arguments


def _expectation_key(expectation_type: str, kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """What tells a suite's expectations apart: each checks its own column(s) of the row."""
    return (expectation_type, *(str(kwargs.get(name) or "")
                                for name in ("column", "column_A", "column_B")))


@cache
def _notes(gate: str) -> dict[tuple[str, ...], str]:
    notes = {}
    for expectation in suite_json(gate)["expectations"]:
        key = _expectation_key(expectation["type"], expectation["kwargs"])
        if key in notes:
            raise ConfigError(f"expectation suite {suite_path(gate)} has two "
                              f"{expectation['type']} expectations on the same column(s) {key[1:]}")
        content = expectation.get("meta", {}).get("notes", {}).get("content") or [""]
        notes[key] = " ".join(content)
    return notes


def expectation_note(gate: str, expectation_type: str, kwargs: Mapping[str, Any]) -> str:
    """The note of the expectation of ``gate``'s suite file with this type and column(s),
    markdown included ("" without one): validations carry none (G6)."""
    return _notes(gate).get(_expectation_key(expectation_type, kwargs), "")


_engine_lock = threading.Lock()
_engine_instance: _Engine | None = None


def engine() -> _Engine:
    """The process's GX engine, built on first use (G1, G2)."""
    global _engine_instance
    with _engine_lock:
        if _engine_instance is None:
            _engine_instance = _Engine()
        return _engine_instance


def gx_suite(gate: str) -> Any:
    """The ``great_expectations.ExpectationSuite`` of ``gate`` (for rendering its page)."""
    return engine().suites[gate]


def validate(gate: str, checks: Mapping[str, Any],
             parameters: Mapping[str, Any] | None = None) -> ExpectationSuiteValidationResult:
    """Validate one row of check results against ``gate``'s suite with GX."""
    return engine().validate(gate, checks, parameters or {})


def warm_up() -> None:
    """Import GX and build the engine in a background thread (G1); returns at once."""
    if _engine_instance is None:
        threading.Thread(target=engine, name="gx-warm-up", daemon=True).start()
