"""CPU of the Python processes Spark starts afresh at each streaming query start (the Python
data source runner, the ``transformWithState`` driver worker), while a command runs.

They live for about a second and the JVM reaps them, so no process tree shows them once they
end: this polls ``/proc`` every 20 ms and keeps each one's last reading (BENCHMARKS.md,
session 85)::

    PYTHONPATH=bench .venv/bin/python bench/query_start_cpu.py -- .venv/bin/python -m pytest \\
        -q -p no:cacheprovider -n 0 tests/jobs/test_sessionize.py \\
        -k "second_signal or holds_the_records_lock"
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from proc_cpu import process_cpu_s

KINDS = ("transform_with_state_driver_worker", "python_streaming_source_runner")
POLL_S = 0.02


def _kind(pid: int) -> str | None:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # exited while listed
        return None
    return next((kind for kind in KINDS if kind in command), None)


def main(command: list[str]) -> int:
    last: dict[int, tuple[str, float]] = {}
    running = subprocess.Popen(command)
    while running.poll() is None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or (kind := _kind(int(entry.name))) is None:
                continue
            try:
                last[int(entry.name)] = (kind, process_cpu_s(int(entry.name)))
            except ProcessLookupError:
                continue
        time.sleep(POLL_S)
    by_kind: dict[str, list[float]] = {}
    for kind, cpu_s in last.values():
        by_kind.setdefault(kind, []).append(cpu_s)
    print(json.dumps({kind: {"processes": len(cpus), "mean_cpu_s": round(sum(cpus) / len(cpus), 3)}
                      for kind, cpus in by_kind.items()}))
    return running.returncode


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--"]:
        arguments = arguments[1:]
    if not arguments:
        sys.exit("usage: query_start_cpu.py -- COMMAND ...")
    sys.exit(main(arguments))
