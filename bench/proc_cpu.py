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


def _cpu_s(fields: list[str], *, reaped: bool = False) -> float:
    # fields from "state" on: utime and stime are the 12th and 13th; cutime and cstime (the
    # children it has waited for) the 14th and 15th
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICKS_PER_S


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one live process, all its threads (not its children's)."""
    stat = _stat(Path(f"/proc/{pid}/stat"))
    if stat is None:
        raise ProcessLookupError(f"process {pid} has exited")
    return _cpu_s(stat[1])


def process_tree(root: int, *, reaped: bool = False
                 ) -> dict[tuple[int, int], tuple[str, float]]:
    """(command name, CPU seconds) of ``root`` and each live descendant, by (pid, start time):
    per process, so nothing is counted twice, and a reused pid is another key.

    ``reaped``: each process's seconds include those of the children it has waited for
    (``cutime``), such as the Python workers a Spark JVM's daemon forked and reaped, which no
    live process shows any more. Compare two readings then: a process's reaped children may
    have run before the first one. (Still missed: the orphans of a killed process, which
    pid 1 reaps.)"""
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
            tree[(pid, int(fields[19]))] = (name, _cpu_s(fields, reaped=reaped))  # 20th: start
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
