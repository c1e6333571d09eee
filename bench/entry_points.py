"""Which product runs a test's time goes to: a pytest plugin timing, per test, the calls of the
product's entry points (a backfill, a recompute, a sessionizer run, ...) the test makes in its
own process, outermost calls only (a recompute inside a backfill counts as the backfill's, and
so does a run a test's other thread makes meanwhile).

The scenario tests are sequences of product runs on a few rows, so the suite's time is what
those runs cost at that size; this says which runs, and how many of each.

    PYTHONPATH=bench .venv/bin/python -m pytest -p entry_points -n 2 --dist loadfile tests/jobs

writes one ``entry-points-<worker>.tsv`` per worker in ``ENTRY_POINTS_OUT`` (default: the
system temp folder): test id, wall seconds, then ``name=seconds/calls`` per entry point.
Summarise them with ``python bench/entry_points.py <folder>``. Runs in child processes (the
crash tests' CLI runs, the DAGs' spark-submit steps) are not seen.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ENTRY_POINTS = (
    ("clickstream.jobs.backfill", "run_backfill"),
    ("clickstream.jobs.recompute", "run_recompute"),
    ("clickstream.jobs.recompute", "run_full_recompute"),
    ("clickstream.jobs.sessionize", "run_sessionizer"),
    ("clickstream.cli", "main"),
    ("clickstream.io.kafka_read", "read_compacted"),
    ("tests.jobs.test_backfill", "assert_tables_equal_from_scratch"),
)

_seconds: defaultdict[str, float] = defaultdict(float)
_calls: Counter[str] = Counter()
_depth = 0
_rows: list[tuple[str, float, dict[str, float], dict[str, int]]] = []


def _timed(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        global _depth
        if _depth:  # inside another entry point, or beside it in another thread: its time
            # is the outer one's
            return function(*args, **kwargs)
        _depth += 1
        started = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            _depth -= 1
            _seconds[name] += time.monotonic() - started
            _calls[name] += 1
    return timed


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the test modules are imported: every module-level name bound to an entry point
    (``from ... import run_backfill`` included) is rebound to its timed version."""
    for module_name, name in ENTRY_POINTS:
        original = getattr(importlib.import_module(module_name), name)
        timed = _timed(original, name)
        for module in list(sys.modules.values()):
            if getattr(module, name, None) is original:
                setattr(module, name, timed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _seconds.clear()
    _calls.clear()
    started = time.monotonic()
    yield
    _rows.append((item.nodeid, time.monotonic() - started, dict(_seconds), dict(_calls)))


def pytest_unconfigure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    folder = Path(os.environ.get("ENTRY_POINTS_OUT", tempfile.gettempdir()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"entry-points-{worker}.tsv").write_text("".join(
        f"{nodeid}\t{wall:.2f}\t"
        + " ".join(f"{name}={seconds[name]:.2f}/{calls[name]}" for name in sorted(seconds))
        + "\n" for nodeid, wall, seconds, calls in _rows))


def summarise(folder: Path) -> None:
    wall_s, seconds, calls = 0.0, defaultdict(float), Counter()
    for path in sorted(folder.glob("entry-points-*.tsv")):
        for line in path.read_text().splitlines():
            _, wall, *timed = line.split("\t")
            wall_s += float(wall)
            for entry in filter(None, " ".join(timed).split()):
                name, _, figures = entry.partition("=")
                spent, _, count = figures.partition("/")
                seconds[name] += float(spent)
                calls[name] += int(count)
    print(f"tests' wall time: {wall_s:.0f} s")
    for name in sorted(seconds, key=seconds.__getitem__, reverse=True):
        print(f"  {name}: {seconds[name]:.0f} s ({seconds[name] / wall_s:.0%}), {calls[name]} "
              f"calls, {seconds[name] / calls[name]:.2f} s each")
    outside = wall_s - sum(seconds.values())
    print(f"  outside them (the tests' own setup and checks): {outside:.0f} s "
          f"({outside / wall_s:.0%})")


if __name__ == "__main__":
    summarise(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()))
