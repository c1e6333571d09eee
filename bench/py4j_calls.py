"""Where a test's Python waits on its JVM: a pytest plugin that times every py4j call of the
tests' process, by the JVM method called and, for calls over 20 ms, by the product line that
made them.

A test of this suite spends most of its time in py4j calls (the JVM plans and runs each job
while Python waits), so their times show which actions (``collectToPython``,
``localCheckpoint``, a streaming query's ``awaitTermination``) and which product lines a test
pays for. Child processes (spark-submit steps, CLI runs) are not counted.

    PYTHONPATH=bench .venv/bin/python -m pytest -p py4j_calls -n 0 \\
        tests/jobs/test_recompute.py::test_a_full_recompute_keeps_the_copy_of_a_reused_order_id_a_held_user_holds

writes ``py4j-calls-<UTC stamp>.txt`` in ``bench/results/`` (``PY4J_CALLS_OUT``: another file).
"""

from __future__ import annotations

import collections
import os
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from py4j import clientserver

SLOW_S = 0.02
_by_method: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
_by_line: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
_send_command = clientserver.ClientServerConnection.send_command


def _timed_send_command(self: clientserver.ClientServerConnection, command: str) -> str:
    started = time.perf_counter()
    try:
        return _send_command(self, command)
    finally:
        seconds = time.perf_counter() - started
        parts = command.split("\n")  # a command kind, a target object, the method's name
        method = parts[2] if len(parts) > 2 else parts[0]
        _add(_by_method, f"{parts[0]}:{method}", seconds)
        if seconds > SLOW_S:
            for frame in reversed(traceback.extract_stack(limit=40)):
                if "/clickstream/" in frame.filename or "/tests/" in frame.filename:
                    _add(_by_line, f"{Path(frame.filename).name}:{frame.lineno} {frame.name} "
                         f"[{method}]", seconds)
                    break


def _add(table: dict[str, list[float]], key: str, seconds: float) -> None:
    table[key][0] += 1
    table[key][1] += seconds


def pytest_configure(config: object) -> None:
    clientserver.ClientServerConnection.send_command = _timed_send_command


def pytest_unconfigure(config: object) -> None:
    clientserver.ClientServerConnection.send_command = _send_command
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(os.environ.get("PY4J_CALLS_OUT")
               or Path(__file__).parent / "results" / f"py4j-calls-{stamp}.txt")
    total = sum(seconds for _, seconds in _by_method.values())
    calls = sum(int(count) for count, _ in _by_method.values())
    lines = [f"py4j calls: {calls}, {total:.1f} s", "", "by JVM method (s, calls):"]
    lines += [f"{seconds:8.2f} {int(count):7d} {key}" for key, (count, seconds)
              in sorted(_by_method.items(), key=lambda item: -item[1][1])[:40]]
    lines += ["", f"calls over {SLOW_S * 1000:g} ms, by the product or test line (s, calls):"]
    lines += [f"{seconds:8.2f} {int(count):5d} {key}" for key, (count, seconds)
              in sorted(_by_line.items(), key=lambda item: -item[1][1])[:40]]
    out.write_text("\n".join(lines) + "\n")
    print(f"\npy4j calls: {calls}, {total:.1f} s -> {out}")
