"""CPU seconds of a process tree and of a process's threads, read from /proc: pyspark never
reaps the JVMs it starts, so ``os.times`` alone misses them."""

from __future__ import annotations

import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, list[str]] | None:
    """(command name, the fields from "state" on) of a live process or thread; None once it
    has exited."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def _cpu_s(fields: list[str]) -> float:
    # fields from "state" on: utime and stime are the 12th and 13th
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one live process, all its threads (not its children's)."""
    stat = _stat(Path(f"/proc/{pid}/stat"))
    if stat is None:
        raise ProcessLookupError(f"process {pid} has exited")
    return _cpu_s(stat[1])


def process_tree(root: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(command name, CPU seconds) of ``root`` and each live descendant, by (pid, start time):
    per process and without ``cutime``, so nothing is counted twice, and a reused pid is
    another key."""
    stats = {int(entry.name): stat for entry in Path("/proc").iterdir()
             if entry.name.isdigit() and (stat := _stat(entry / "stat")) is not None}
    children: dict[int, list[int]] = {}
    for pid, (_, fields) in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            name, fields = stats[pid]
            tree[(pid, int(fields[19]))] = (name, _cpu_s(fields))  # starttime: the 20th
        todo += children.get(pid, [])
    return tree


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """(thread name, CPU seconds) of each live thread of ``pid``, by thread id."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        stat = _stat(Path(f"/proc/{pid}/task/{tid}/stat"))
        if stat is not None:
            threads[int(tid)] = (stat[0], _cpu_s(stat[1]))
    return threads
