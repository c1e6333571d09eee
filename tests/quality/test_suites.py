"""The suites themselves, through Great Expectations, without Spark: each gate passes on good
check results, fails on bad ones, and names the expectation."""

from __future__ import annotations

import json
import re

import pytest

from clickstream.config import Config
from clickstream.quality import checks, suites
from clickstream.quality.gates import run_gate

# recomputed_sessions v2: sessions without an id or bounds; historical_batch v2: rows
# refused for a reason no other fraction counts; v3: a batch of bad rows only
VERSIONS = {"recomputed_sessions": "2", "historical_batch": "4"}


def test_every_suite_file_is_a_gx_suite_over_documented_check_columns() -> None:
    for gate in suites.GATES:
        data = json.loads(suites.suite_path(gate).read_text())
        assert data["name"] == gate
        assert suites.suite_version(gate) == VERSIONS.get(gate, "1")
        columns = suites.check_descriptions(gate)
        suite = suites.gx_suite(gate)
        assert len(suite.expectations) == len(data["expectations"]) > 0
        for expectation in data["expectations"]:
            kwargs = expectation["kwargs"]
            for key in ("column", "column_A", "column_B"):
                if key in kwargs:
                    assert kwargs[key] in columns, (gate, kwargs[key])
            assert expectation["severity"] in ("critical", "warning")


def test_raw_events_checks_cover_every_column_the_suite_names(spark: object) -> None:
    named = {e["kwargs"]["column"] for e in suites.suite_json("raw_events")["expectations"]}
    assert named <= set(checks.RAW_EVENTS_ROW_CHECKS) | {"malformed_fraction"}
    assert set(checks.raw_events_predicates()) == set(checks.RAW_EVENTS_ROW_CHECKS)


GOOD = {
    "raw_events": {"records": 10, "malformed_records": 1, "malformed_fraction": 0.1,
                   "accepted_records": 9, **dict.fromkeys(checks.RAW_EVENTS_ROW_CHECKS, 0)},
    "historical_batch": {"rows_read": 100, "rows_accepted": 98, "rows_quarantined": 2,
                         "quarantined_fraction": 0.02, "every_row_refused": False,
                         "ts_column_type": "string",
                         "amount_column_type": "decimal", "main_client_id": "client-00",
                         "blank_key_fraction": 0.01, "blank_user_id_fraction": 0.0,
                         "blank_client_id_fraction": 0.0,
                         "bad_ts_fraction": 0.01, "other_client_fraction": 0.0,
                         "conflicting_duplicate_fraction": 0.0, "bad_amount_fraction": 0.0,
                         "negative_amount_fraction": 0.0, "bad_currency_fraction": 0.0,
                         "missing_url_fraction": None, "other_problem_fraction": 0.01},
    "tables_after_merge": {"rows_before": 5, "batch_keys": 4, "keys_already_stored": 1,
                           "copies_replaced": 0, "rows_after": 8, "expected_rows_after": 8,
                           "duplicate_keys": 0},
    "recomputed_sessions": {"sessions": 3, "sessions_without_id_or_bounds": 0,
                            "session_start_after_end": 0,
                            "pageview_count_below_one": 0, "duplicate_session_ids": 0,
                            "overlapping_sessions": 0, "sessions_within_gap": 0,
                            "revenue_mismatch": 0, "order_count_mismatch": 0,
                            "attributions_to_unknown_sessions": 0,
                            "sessions_with_orders_outside": 0},
    "publish": {"session_changes": 3, "attribution_changes": 2,
                "sessions_missing_at_revision": 0, "retractions_without_tombstone": 0,
                "attributions_missing_at_revision": 0},
}
BAD = {
    "raw_events": ({"accepted_invalid_event_type": 2}, "accepted_invalid_event_type = 2"),
    "historical_batch": ({"negative_amount_fraction": 0.75},
                         "negative_amount_fraction = 0.75, expected at most 0.5"),
    "tables_after_merge": ({"rows_after": 12},
                           "rows_after = 12, expected expected_rows_after \\(8\\)"),
    "recomputed_sessions": ({"overlapping_sessions": 1}, "overlapping_sessions = 1"),
    "publish": ({"retractions_without_tombstone": 3}, "retractions_without_tombstone = 3"),
}
PARAMETERS = {"historical_batch": {"declared_client": ["client-00"]}}


@pytest.mark.parametrize("gate", suites.GATES)
def test_gate_passes_good_check_results_and_fails_bad_ones(gate: str, config: Config) -> None:
    good = run_gate(gate, GOOD[gate], config=config, job="test", run_id="good",
                    parameters=PARAMETERS.get(gate), report=False)
    assert good.success and good.status == "passed", good.describe()
    # Each verdict carries its expectation's note from the suite file (GX validates a copy
    # without notes, suites G6).
    assert len(good.outcomes) == len(suites.suite_json(gate)["expectations"])
    assert all(outcome.note.strip() for outcome in good.outcomes), good.outcomes

    change, message = BAD[gate]
    bad = run_gate(gate, {**GOOD[gate], **change}, config=config, job="test", run_id="bad",
                   parameters=PARAMETERS.get(gate), report=False)
    assert not bad.success and bad.status == "failed"
    with pytest.raises(Exception, match=f"quality gate {gate} failed for test bad: 1 of "
                                        f"{len(bad.outcomes)} expectations failed: "
                                        f"quality gate {gate}: {message}"):
        bad.raise_if_failed("nothing was written")


def test_the_declared_client_is_a_suite_parameter(config: Config) -> None:
    values = {**GOOD["historical_batch"], "main_client_id": "client-01"}
    result = run_gate("historical_batch", values, config=config, job="test", run_id="x",
                      parameters={"declared_client": ["client-00"]}, report=False)
    (failure,) = result.failures
    assert (failure.column, failure.expected) == ("main_client_id", "one of [client-00]")


def test_warnings_are_reported_but_do_not_fail(config: Config) -> None:
    values = {**GOOD["raw_events"], "malformed_fraction": 0.9, "accepted_unknown_event_type": 4}
    result = run_gate("raw_events", values, config=config, job="test", run_id="w",
                      report=False)
    assert result.success and result.status == "warning"
    assert {o.column for o in result.warnings} == {"malformed_fraction",
                                                   "accepted_unknown_event_type"}
    result.raise_if_failed("unused")
    assert re.match(rf"quality gate raw_events \(suite v\d+\): warning, "
                    rf"{len(result.outcomes) - 2} of {len(result.outcomes)} expectations met, "
                    r"2 warnings in [\d.]+s; warning: quality gate raw_events: ",
                    result.describe())
    assert result.describe().count("; warning: ") == 2
    both = run_gate("raw_events", {**values, "accepted_invalid_event_type": 2}, config=config,
                    job="test", run_id="w", report=False)  # the counts add up to the total
    assert "expectations met, 1 failed, 2 warnings in " in both.describe()
    assert f"1 of {len(both.outcomes)} expectations failed: " in both.message("x")
