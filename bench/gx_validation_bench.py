"""What Great Expectations takes to validate one gate's row of check results, per gate: the
product's way (``quality.suites.validate``: a copy of the suite without the expectations' notes,
``BASIC`` results; suites G6) against the whole suite with ``SUMMARY`` results (the way before
session 65), alternated in each round, in this process (no Spark: the gates' check results
are computed in Spark before GX sees them).

Every gate runs once per step of a backfill or recompute and once per micro-batch of the
stream (``raw_events``), so this is Python time added to each of them.

    .venv/bin/python bench/gx_validation_bench.py [--rounds 3] [--repeat 10]

Writes ``bench/results/gx-validation-<UTC stamp>.json`` and prints milliseconds per validation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import git_dirty, git_head, write_result

PARAMETERS = {"historical_batch": {"declared_client": ["client-00"]}}


def passing_row(gate: str) -> dict[str, Any]:
    """A row every expectation of ``gate`` passes: each value at its lower bound or the first
    of its set (the declared client for the suite parameter), equal pairs 0."""
    from clickstream.quality import suites

    row: dict[str, Any] = {}
    for expectation in suites.suite_json(gate)["expectations"]:
        kwargs = expectation["kwargs"]
        if "value_set" in kwargs:
            allowed = kwargs["value_set"]
            row[kwargs["column"]] = "client-00" if isinstance(allowed, dict) else allowed[0]
        elif "column" in kwargs:
            row[kwargs["column"]] = kwargs.get("min_value") or 0
        else:
            row[kwargs["column_A"]] = row[kwargs["column_B"]] = 0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10, help="validations per gate and way")
    args = parser.parse_args()

    import pandas as pd

    from clickstream.quality import suites

    engine = suites.engine()

    def product(gate: str) -> bool:
        return suites.validate(gate, passing_row(gate), PARAMETERS.get(gate)).success

    def whole_suite_summary(gate: str) -> bool:
        batch = engine.batches[gate].get_batch(
            batch_parameters={"dataframe": pd.DataFrame([passing_row(gate)])})
        return batch.validate(suites.gx_suite(gate), result_format="SUMMARY",
                              expectation_parameters=PARAMETERS.get(gate, {})).success

    ways = {"product": product, "whole suite, SUMMARY": whole_suite_summary}
    for way in ways.values():  # warm: imports, the metric registry
        for gate in suites.GATES:
            assert way(gate), f"{gate}: the passing row failed"
    ms: dict[str, dict[str, list[float]]] = {w: {g: [] for g in suites.GATES} for w in ways}
    for round_number in range(1, args.rounds + 1):
        for name, way in ways.items():
            for gate in suites.GATES:
                started = time.perf_counter()
                for _ in range(args.repeat):
                    way(gate)
                ms[name][gate].append(1000 * (time.perf_counter() - started) / args.repeat)
            print(f"round {round_number}, {name}: " + ", ".join(
                f"{gate} {ms[name][gate][-1]:.1f}" for gate in suites.GATES)
                + f" ms; five gates {sum(ms[name][g][-1] for g in suites.GATES):.0f} ms",
                flush=True)
    medians = {name: {gate: round(statistics.median(values), 1)
                      for gate, values in by_gate.items()} for name, by_gate in ms.items()}
    for name, by_gate in medians.items():
        print(f"median, {name}: {by_gate}; five gates {sum(by_gate.values()):.0f} ms")
    path = write_result("gx-validation", {
        "bench": "gx_validation", "git_head": git_head(), "uncommitted": git_dirty(),
        "rounds": args.rounds, "repeat": args.repeat, "ms_per_validation": ms,
        "median_ms": medians})
    print(f"result: {path}")


if __name__ == "__main__":
    main()
