"""Which tests wait rather than work: a pytest plugin recording, per test (setup, call and
teardown), its wall time and the CPU its worker's whole process tree spent meanwhile (the
worker's Python, its Spark JVM, the child processes the test started).

The suite runs on two workers that keep both cores busy, so a test's CPU is what it costs
the other worker; a test whose wall time is much more than its CPU waits (sleeps, retries,
timeouts, another process) and holds its worker without using the machine.

    PYTHONPATH=bench .venv/bin/python -m pytest -p test_cpu -n 2 --dist loadfile

writes one ``test-cpu-<worker>.tsv`` per worker in ``TEST_CPU_OUT`` (default: the system
temp folder): test id, wall seconds, CPU seconds. Summarise them with
``python bench/test_cpu.py <folder>``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import process_tree

_rows: list[tuple[str, float, float]] = []


def _tree_cpu_s() -> dict[tuple[int, int], float]:
    """CPU seconds of this process and its live descendants, each with the children it
    reaped: a test's ended subprocesses, the Python workers Spark's daemon forked."""
    return {key: cpu_s for key, (_, cpu_s) in process_tree(os.getpid(), reaped=True).items()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before, started = _tree_cpu_s(), time.monotonic()
    yield
    after, wall = _tree_cpu_s(), time.monotonic() - started
    cpu = sum(cpu_s - before.get(key, 0.0) for key, cpu_s in after.items())
    _rows.append((item.nodeid, wall, cpu))


def pytest_unconfigure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    folder = Path(os.environ.get("TEST_CPU_OUT", tempfile.gettempdir()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"test-cpu-{worker}.tsv").write_text(
        "".join(f"{nodeid}\t{wall:.2f}\t{cpu:.2f}\n" for nodeid, wall, cpu in _rows))


def summarise(folder: Path, top: int = 40) -> None:
    rows = [line.split("\t") for path in sorted(folder.glob("test-cpu-*.tsv"))
            for line in path.read_text().splitlines()]
    tests = [(nodeid, float(wall), float(cpu)) for nodeid, wall, cpu in rows]
    wall_s, cpu_s = sum(t[1] for t in tests), sum(t[2] for t in tests)
    print(f"{len(tests)} tests: wall {wall_s:,.0f} s, CPU {cpu_s:,.0f} s "
          f"(waiting: {wall_s - cpu_s:,.0f} s)")
    print(f"\n{'wall':>7} {'CPU':>7} {'wait':>7}  the tests waiting longest")
    for nodeid, wall, cpu in sorted(tests, key=lambda t: t[2] - t[1])[:top]:
        print(f"{wall:7.1f} {cpu:7.1f} {wall - cpu:7.1f}  {nodeid}")


if __name__ == "__main__":
    summarise(Path(sys.argv[1]))
