"""Benchmark harness for the streaming sessionizer (``clickstream sessionize``).

Subcommands (each writes ``bench/results/<name>-<UTC stamp>.json`` and prints one summary line):

``throughput``
    Generate N events with ``clickstream.jobs.generate.live_records`` (event time compressed:
    many users, event time advancing steadily, small late/duplicate/bad fractions), produce them
    with the product's lz4 producer into the embedded broker, then time
    ``clickstream sessionize --until-caught-up``: events/s over the whole process (JVM start
    included) and over the processing window (first batch start to last batch end), plus the
    per-batch lines and Spark's streaming progress (from the Spark event log).

``latency``
    Run ``clickstream sessionize`` continuously and produce at a steady rate (default 20,000
    events/s) for D seconds with ``ts`` = now. Every pageview carries its produce time in its
    ``referrer``; its latency is the commit time (``commitInfo.timestamp`` in the Delta log) of
    the ``pageviews`` version that added it minus that produce time.

``memory``
    Run the sessionizer for M minutes (default 20) under a steady live stream whose event time
    advances ``--time-scale`` times faster than the wall clock (so sessions close and the
    watermark-bounded state reaches its steady size within the run), sampling every 10 s the RSS
    of the sessionizer's process tree (driver Python, JVM, Python workers; /proc VmRSS), the JVM
    heap (jstat), the checkpoint's state folder size and Spark's state-operator metrics.

Isolation: the embedded broker (librdkafka mock) runs in this process on 127.0.0.1 with a free
port; the sessionizer is a subprocess in its own session with CLICKSTREAM_HOME / _WAREHOUSE /
_LANDING in a temporary folder. Both are stopped whatever happens (SIGTERM to the sessionizer,
then SIGKILL to whatever is left of its process group, by pid).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import platform
import queue
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import results_file
from results_file import REPO, git_dirty, git_head, source_sha256

from clickstream.config import Config
from clickstream.io.kafka_clients import make_producer
from clickstream.io.kafka_produce import PACED_LINGER_MS, produce_waiting
from clickstream.io.kafka_topics import topic_watermarks

VENV_BIN = Path(sys.executable).parent
TOPIC = "events"
EVENT_PARTITIONS = 16  # what the product's broker creates (clickstream.io.kafka_broker)
MARK = "https://bench.example/"  # referrer prefix: MARK + phase + "/" + produce epoch ms

BATCH_LINE = re.compile(r"^sessionize batch (\d+): (.*) \((\d+(?:\.\d+)?)s\)\s*$")
COUNT_ITEM = re.compile(r"(\d+) ([a-z ]+)")


# ------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "pyspark": _version("pyspark"),
        "deltalake": _version("deltalake"),
        "pyarrow": _version("pyarrow"),
        "pandas": _version("pandas"),
        "numpy": _version("numpy"),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(Exception):
        import confluent_kafka

        info["confluent_kafka"] = confluent_kafka.__version__
        info["librdkafka"] = confluent_kafka.libversion()[0]
    with contextlib.suppress(Exception):
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
        info["java"] = out.stderr.splitlines()[0]
    info["clickstream_source_sha256"] = source_sha256()
    info["git_commit"] = git_head(short=False)
    info["git_dirty"] = bool(git_dirty())
    return info


QUIET: dict[str, Any] = {}  # outcome of --wait-quiet, recorded in every result
MAX_CONTENTION_PCT = [25.0]  # set from --max-contention-pct


def write_result(name: str, result: dict[str, Any], path: Path | None = None) -> Path:
    result.setdefault("quiet_check", QUIET)
    return results_file.write_result(name, result, path, indent=1)


def cpu_seconds_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------------------------------
# /proc: the sessionizer's process tree
# ------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, pgrp, comm) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1: raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[2]), comm


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) of ``root`` and all its descendants."""
    table = {pid: stat for pid in _all_pids() if (stat := _proc_stat(pid)) is not None}
    tree: dict[int, tuple[int, str]] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        if pid in table and pid not in tree:
            tree[pid] = (table[pid][0], table[pid][2])
            frontier.extend(child for child, stat in table.items() if stat[0] == pid)
    return tree


def group_members(pgid: int) -> list[int]:
    return [pid for pid in _all_pids()
            if (stat := _proc_stat(pid)) is not None and stat[1] == pgid]


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> dict[str, Any]:
    """RSS (MiB) of the tree split into driver Python, JVM and Python workers."""
    parts = {"driver_python": 0, "jvm": 0, "python_workers": 0, "other": 0}
    workers = 0
    jvm_pid = None
    for pid, (_ppid, comm) in process_tree(root).items():
        kib = rss_kib(pid)
        if pid == root:
            parts["driver_python"] += kib
        elif comm == "java":
            parts["jvm"] += kib
            jvm_pid = pid
        elif comm.startswith("python"):
            parts["python_workers"] += kib
            workers += 1
        else:
            parts["other"] += kib
    result: dict[str, Any] = {f"{k}_mib": round(v / 1024, 1) for k, v in parts.items()}
    # "other" is reported but not counted: it holds short-lived children, and a child the JVM
    # has just forked shows the JVM's RSS until it execs (one sample caught 4.7 GiB there).
    result["total_mib"] = round(sum(v for k, v in parts.items() if k != "other") / 1024, 1)
    result["python_worker_processes"] = workers
    result["jvm_pid"] = jvm_pid
    return result


def jvm_heap_mib(pid: int | None) -> dict[str, float] | None:
    """Heap used/committed, the old generation's use and GC counts and seconds so far, from
    ``jstat -gc`` (reads the JVM's perf data; no attach)."""
    if pid is None or shutil.which("jstat") is None:
        return None
    try:
        out = subprocess.run(["jstat", "-gc", str(pid)], capture_output=True, text=True,
                             timeout=20).stdout.split("\n")
        # "-" where the collector has no such count (the parallel one's concurrent GCs)
        names = out[0].split()
        values = [0.0 if v == "-" else float(v) for v in out[1].split()]
    except Exception:
        return None
    row = dict(zip(names, values, strict=False))
    used = sum(row.get(k, 0.0) for k in ("S0U", "S1U", "EU", "OU"))
    committed = sum(row.get(k, 0.0) for k in ("S0C", "S1C", "EC", "OC"))
    return {"heap_used_mib": round(used / 1024, 1),
            "heap_committed_mib": round(committed / 1024, 1),
            "metaspace_used_mib": round(row.get("MU", 0.0) / 1024, 1),
            "old_gen_used_mib": round(row.get("OU", 0.0) / 1024, 1),
            "young_gcs": int(row.get("YGC", 0)), "full_gcs": int(row.get("FGC", 0)),
            "concurrent_gcs": int(row.get("CGC", 0)), "gc_seconds": row.get("GCT", 0.0)}


class PeakMemory:
    """Samples a process tree's RSS (by part) and the JVM's heap every ``every_s`` seconds in
    a thread and keeps the peaks: what a catch-up's large micro-batches cost in memory. The
    heap used includes garbage not yet collected, so its peak is an upper bound of the live
    heap; GC counts and time come from the last ``jstat`` sample."""

    def __init__(self, root: int, every_s: float = 5.0) -> None:
        self.root, self.every_s = root, every_s
        self.peaks: dict[str, float] = {}
        self.last_heap: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = tree_rss(self.root)
            heap = jvm_heap_mib(rss.pop("jvm_pid", None)) or {}
            rss.pop("python_worker_processes", None)
            for name, value in {**rss, **heap}.items():
                if name.endswith("_mib"):
                    self.peaks[name] = max(self.peaks.get(name, 0.0), value)
            if heap:
                self.last_heap = heap
            self.samples += 1

    def report(self) -> dict[str, Any]:
        return {"every_s": self.every_s, "samples": self.samples,
                "peak_mib": {k: round(v, 1) for k, v in sorted(self.peaks.items())},
                "gc_at_last_sample": {k: v for k, v in self.last_heap.items()
                                      if not k.endswith("_mib")}}


def _busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = values[3] + values[4]
    return (sum(values) - idle) / tick, sum(values) / tick


def wait_for_quiet(max_wait: float, threshold_pct: float = 15.0,
                   window: float = 5.0, windows: int = 3) -> dict[str, Any]:
    """Wait until the machine is nearly idle (other workloads skew a 2-core benchmark).

    Quiet = ``windows`` consecutive ``window``-second spans with total CPU use below
    ``threshold_pct`` of capacity. Gives up after ``max_wait`` seconds and proceeds.
    """
    started = time.time()
    quiet = 0
    busy_pct = None
    while time.time() - started < max_wait:
        b0, t0 = _busy_seconds()
        time.sleep(window)
        b1, t1 = _busy_seconds()
        busy_pct = 100 * (b1 - b0) / max(t1 - t0, 1e-9)
        quiet = quiet + 1 if busy_pct < threshold_pct else 0
        if quiet >= windows:
            return {"waited_s": round(time.time() - started), "quiet": True,
                    "busy_pct_last_window": round(busy_pct, 1)}
    if max_wait > 0:
        log(f"machine still busy ({busy_pct:.0f}% CPU) after {max_wait:.0f}s; starting anyway")
    return {"waited_s": round(time.time() - started), "quiet": False,
            "busy_pct_last_window": None if busy_pct is None else round(busy_pct, 1)}


class CpuWatch:
    """CPU seconds used by this benchmark's process tree vs every other process on the machine.

    Samples ``/proc/<pid>/stat`` (utime + stime) of all processes every ``every`` seconds; a
    process's usage is its last sample minus its first (or minus 0 if it started during the
    watch). Other workloads on the machine (e.g. a test suite running in parallel) compete for
    the same 2 cores, so results report how much CPU they took.
    """

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.ours: set[int] = set()
        self.started = 0.0
        self.stopped = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-watch")
        self._tick = os.sysconf("SC_CLK_TCK")

    def _sample(self, initial: bool = False) -> None:
        table: dict[int, tuple[int, float]] = {}
        for pid in _all_pids():
            try:
                raw = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            rest = raw[raw.rindex(")") + 2:].split()
            table[pid] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / self._tick)
        me = os.getpid()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _cpu) in table.items():
            children.setdefault(ppid, []).append(pid)
        frontier, seen = [me], set()
        while frontier:
            pid = frontier.pop()
            if pid not in seen:
                seen.add(pid)
                self.ours.add(pid)
                frontier.extend(children.get(pid, []))
        for pid, (_ppid, cpu) in table.items():
            if pid not in self.first:
                self.first[pid] = cpu if initial else 0.0
            self.last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> CpuWatch:
        self.started = time.time()
        self.busy0 = _busy_seconds()[0]
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self.stopped:
            self._stop.set()
            self._thread.join(timeout=10)
            self._sample()
            self.stopped = time.time()
            self.busy1 = _busy_seconds()[0]

    def report(self) -> dict[str, Any]:
        self.stop()
        used = {pid: self.last[pid] - self.first.get(pid, 0.0) for pid in self.last}
        ours = sum(v for pid, v in used.items() if pid in self.ours)
        others = sum(v for pid, v in used.items() if pid not in self.ours)
        wall = self.stopped - self.started
        capacity = wall * (os.cpu_count() or 1)
        top = sorted(((v, pid) for pid, v in used.items() if pid not in self.ours),
                     reverse=True)[:3]
        return {"wall_s": round(wall, 1), "capacity_cpu_s": round(capacity, 1),
                "machine_busy_cpu_s": round(self.busy1 - self.busy0, 1),
                "bench_tree_cpu_s": round(ours, 1), "other_processes_cpu_s": round(others, 1),
                "other_processes_pct_of_capacity": round(100 * others / max(capacity, 1e-9), 1),
                "top_other_cpu_s": [round(v, 1) for v, _pid in top],
                "loadavg_at_end": os.getloadavg()}


# ------------------------------------------------------------------------------------------
# The sessionizer subprocess
# ------------------------------------------------------------------------------------------


@dataclass
class BatchLine:
    """One ``sessionize batch N: ... (X.Xs)`` line, with the wall time it was read."""

    batch_id: int
    at: float
    seconds: float
    counts: dict[str, int]

    @property
    def records(self) -> int:
        return self.counts.get("records", 0)


def parse_batch_line(line: str, at: float) -> BatchLine | None:
    match = BATCH_LINE.match(line.strip())
    if not match:
        return None
    counts = {name.strip().replace(" ", "_"): int(n)
              for n, name in COUNT_ITEM.findall(match.group(2))}
    return BatchLine(int(match.group(1)), at, float(match.group(3)), counts)


class Sessionizer:
    """``clickstream sessionize`` in its own session; stdout lines are timestamped as read."""

    def __init__(self, workdir: Path, env: dict[str, str], *, until_caught_up: bool) -> None:
        self.workdir = workdir
        self.env = env
        self.until_caught_up = until_caught_up
        self.proc: subprocess.Popen[str] | None = None
        self.batches: list[BatchLine] = []
        self.other_lines: list[str] = []
        self.started_at = 0.0
        self.exited_at: float | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @property
    def command(self) -> list[str]:
        cmd = [str(VENV_BIN / "clickstream"), "sessionize"]
        return [*cmd, "--until-caught-up"] if self.until_caught_up else cmd

    def start(self) -> Sessionizer:
        self.stdout_log = (self.workdir / "sessionize.stdout.log").open("w")
        self.stderr_log = (self.workdir / "sessionize.stderr.log").open("w")
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.command, env=self.env, cwd=self.workdir, stdout=subprocess.PIPE,
            stderr=self.stderr_log, stdin=subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True, name="sessionize-stdout")
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.time()
            self.stdout_log.write(f"{now:.3f} {line}")
            self.stdout_log.flush()
            batch = parse_batch_line(line, now)
            with self._lock:
                if batch is not None:
                    self.batches.append(batch)
                else:
                    self.other_lines.append(line.rstrip())

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def snapshot(self) -> list[BatchLine]:
        with self._lock:
            return list(self.batches)

    def records_done(self) -> int:
        with self._lock:
            return sum(b.records for b in self.batches)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._finish()
        return code

    def _finish(self) -> None:
        if self.exited_at is None:
            self.exited_at = time.time()
        if self._reader is not None:
            self._reader.join(timeout=10)

    def stop(self, grace: float = 90.0) -> int | None:
        """SIGTERM (the job stops its query and exits), then SIGKILL whatever is left."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log(f"sessionizer pid {self.proc.pid} still running {grace:.0f}s after SIGTERM")
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._finish()
        for handle in (self.stdout_log, self.stderr_log):
            handle.close()
        return self.proc.returncode

    def _kill_group(self) -> None:
        """SIGKILL the remaining members of the process group we created (JVM, workers)."""
        assert self.proc is not None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            members = group_members(self.proc.pid)
            if not members:
                return
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.time() + 10
            while time.time() < deadline and group_members(self.proc.pid):
                time.sleep(0.2)

    def stderr_tail(self, lines: int = 15) -> list[str]:
        path = self.workdir / "sessionize.stderr.log"
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        interesting = [line for line in text if "Error" in line or "error" in line
                       or "Exception" in line]
        return (interesting or text)[-lines:]


# ------------------------------------------------------------------------------------------
# Spark streaming progress from the event log
# ------------------------------------------------------------------------------------------


class ProgressLog:
    """Reads ``QueryProgressEvent`` entries from the Spark event log as it grows."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path: Path | None = None
        self.offset = 0
        self.partial = b""
        self.progress: list[dict[str, Any]] = []

    def _find(self) -> Path | None:
        if not self.folder.exists():
            return None
        found = [p for p in self.folder.rglob("*") if p.is_file()
                 and not p.name.startswith((".", "appstatus"))]
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    def poll(self) -> list[dict[str, Any]]:
        """Parse what was appended since the last call (plain, uncompressed log only)."""
        if self.path is None or not self.path.exists():
            if self.path is not None and self.path.name.endswith(".inprogress"):
                renamed = self.path.with_name(self.path.name.removesuffix(".inprogress"))
                self.path = renamed if renamed.exists() else self._find()
            else:
                self.path = self._find()
            if self.path is None or self.path.suffix in (".zstd", ".lz4", ".snappy"):
                return self.progress
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if b"QueryProgressEvent" not in line:
                continue
            with contextlib.suppress(ValueError, KeyError):
                self.progress.append(json.loads(line)["progress"])
        return self.progress


def _input_rows(p: dict[str, Any]) -> int:
    if p.get("numInputRows") is not None:
        return int(p["numInputRows"])
    return sum(int(s.get("numInputRows") or 0) for s in p.get("sources") or [])


def summarize_progress(progress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compact per-batch view of Spark's progress reports that ran a batch.

    ``source_rows`` is what the source reported; the sessionizer's plan scans the source once
    per branch (session and record branches), so it is twice the number of Kafka records.
    """
    rows = []
    for p in progress:
        if p.get("batchDuration") is None or "addBatch" not in (p.get("durationMs") or {}):
            continue
        ops = p.get("stateOperators") or [{}]
        op = ops[0]
        rows.append({
            "batch": p.get("batchId"),
            "started": p.get("timestamp"),
            "source_rows": _input_rows(p),
            "duration_ms": p.get("durationMs", {}),
            "watermark": (p.get("eventTime") or {}).get("watermark"),
            "state_rows": op.get("numRowsTotal"),
            "state_update_ms": op.get("allUpdatesTimeMs"),
            "state_commit_ms": op.get("commitTimeMs"),
            "state_memory_bytes": op.get("memoryUsedBytes"),
            "state_metrics": {k: v for k, v in (op.get("customMetrics") or {}).items()
                              if k in ("rocksdbTotalBytesInMemory", "rocksdbSstFileSize",
                                       "rocksdbPinnedBlocksMemoryUsage")},
        })
    return rows


def _iso_ms(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def stage_breakdown(folder: Path, max_batches: int = 60) -> list[dict[str, Any]]:
    """Where each micro-batch's time went, from the Spark event log.

    Jobs are assigned to batches by the batches' [start, start + duration] windows. Per batch:
    the number of Spark jobs, the duration of the first job (it materialises the persisted
    micro-batch: Kafka read, parse, state operator) and of all the others (counts and table
    writes of the sink), and the slowest stages with their executor run time, JVM CPU time
    (Python time is run time minus JVM CPU, roughly) and the RDDs they ran.
    """
    found = [p for p in folder.rglob("*") if p.is_file()
             and not p.name.startswith((".", "appstatus"))] if folder.exists() else []
    if not found:
        return []
    jobs: dict[int, dict[str, Any]] = {}
    stages: dict[int, dict[str, Any]] = {}
    progress: list[dict[str, Any]] = []
    with max(found, key=lambda p: p.stat().st_size).open("rb") as handle:
        for raw in handle:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            kind = event.get("Event", "")
            if kind == "SparkListenerJobStart":
                jobs[event["Job ID"]] = {"start": event["Submission Time"],
                                         "stages": event["Stage IDs"]}
            elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                jobs[event["Job ID"]]["end"] = event["Completion Time"]
            elif kind == "SparkListenerTaskEnd":
                metrics = event.get("Task Metrics") or {}
                stage = stages.setdefault(event["Stage ID"], {"run_ms": 0, "cpu_ms": 0.0,
                                                              "gc_ms": 0, "tasks": 0})
                stage["run_ms"] += metrics.get("Executor Run Time", 0)
                stage["cpu_ms"] += metrics.get("Executor CPU Time", 0) / 1e6
                stage["gc_ms"] += metrics.get("JVM GC Time", 0)
                stage["tasks"] += 1
            elif kind == "SparkListenerStageCompleted":
                info = event["Stage Info"]
                stage = stages.setdefault(info["Stage ID"], {"run_ms": 0, "cpu_ms": 0.0,
                                                             "gc_ms": 0, "tasks": 0})
                stage["wall_ms"] = info.get("Completion Time", 0) - info.get("Submission Time", 0)
                stage["rdds"] = sorted({r["Name"].split("\n")[0].split("[")[0].strip()[:40]
                                        for r in info.get("RDD Info", [])}
                                       - {"MapPartitionsRDD", "ShuffledRowRDD"})
            elif kind.endswith("QueryProgressEvent"):
                progress.append(event["progress"])
    out = []
    for p in summarize_progress(progress)[:max_batches]:
        start = _iso_ms(p["started"])
        end = start + sum(v for k, v in p["duration_ms"].items() if k == "triggerExecution")
        batch_jobs = sorted((j for j in jobs.values() if start <= j["start"] <= end
                             and "end" in j), key=lambda j: j["start"])
        if not batch_jobs:
            continue
        durations = [j["end"] - j["start"] for j in batch_jobs]
        stage_rows = []
        for job in batch_jobs:
            for sid in job["stages"]:
                stage = stages.get(sid)
                if stage and "wall_ms" in stage and stage["tasks"]:
                    stage_rows.append({"stage": sid, "wall_ms": stage["wall_ms"],
                                       "tasks": stage["tasks"], "run_ms": stage["run_ms"],
                                       "jvm_cpu_ms": round(stage["cpu_ms"]),
                                       "gc_ms": stage["gc_ms"], "rdds": stage["rdds"]})
        stage_rows.sort(key=lambda r: -r["wall_ms"])
        out.append({"batch": p["batch"], "source_rows": p["source_rows"],
                    "trigger_ms": end - start, "add_batch_ms": p["duration_ms"].get("addBatch"),
                    "jobs": len(batch_jobs), "first_job_ms": durations[0],
                    "other_jobs_ms": sum(durations[1:]),
                    "state_update_ms": p["state_update_ms"],
                    "slowest_stages": stage_rows[:3]})
    return out


# ------------------------------------------------------------------------------------------
# Workspace: broker, folders, environment
# ------------------------------------------------------------------------------------------


class Workspace:
    """Temporary home/warehouse/landing, the embedded broker, and the sessionizer's env."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        base = Path(args.workdir) if args.workdir else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"clickstream-bench-{name}-", dir=base))
        self.keep = args.keep_workdir
        self.event_log = not args.no_event_log
        self.broker: Any = None
        self.partitions = args.partitions
        self.linger_ms = args.linger_ms
        self.producers: list[Any] = []

    def __enter__(self) -> Workspace:
        from clickstream.io.kafka_broker import EmbeddedBroker

        for sub in ("home", "warehouse", "landing", "eventlog", "conf"):
            (self.root / sub).mkdir()
        self.broker = EmbeddedBroker(port=0, host="127.0.0.1", topics={
            TOPIC: self.partitions, "sessions": 16, "attributions": 16}).start()
        log(f"workspace {self.root}; embedded broker on {self.broker.bootstrap_servers}")
        return self

    def producer(self) -> Any:
        """A producer with the product's settings; closed before the broker stops."""
        made = make_bench_producer(self.bootstrap, self.linger_ms)
        self.producers.append(made)
        return made

    def __exit__(self, *exc: object) -> None:
        for producer in self.producers:
            with contextlib.suppress(Exception):
                producer.flush(5)
                producer.close()
        self.producers.clear()
        if self.broker is not None:
            self.broker.stop()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            log(f"kept {self.root}")

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    @property
    def warehouse(self) -> Path:
        return self.root / "warehouse"

    @property
    def checkpoint(self) -> Path:
        return self.root / "home" / "checkpoints" / "sessionize"

    def env(self, **settings: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("CLICKSTREAM_") and k not in ("PYSPARK_SUBMIT_ARGS",)}
        env.update({
            "CLICKSTREAM_HOME": str(self.root / "home"),
            "CLICKSTREAM_WAREHOUSE": str(self.warehouse),
            "CLICKSTREAM_LANDING": str(self.root / "landing"),
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "PYTHONUNBUFFERED": "1",
            "SPARK_LOCAL_IP": "127.0.0.1",
        })
        if self.event_log:
            # Spark's event log carries every StreamingQueryProgress (durations, state metrics)
            # without touching the job: spark-submit reads spark-defaults.conf from here.
            conf = self.root / "conf" / "spark-defaults.conf"
            conf.write_text("spark.eventLog.enabled true\n"
                            "spark.eventLog.compress false\n"
                            "spark.eventLog.rolling.enabled false\n"
                            f"spark.eventLog.dir file://{self.root / 'eventlog'}\n")
            env["SPARK_CONF_DIR"] = str(conf.parent)
        env.update(settings)
        return env

    def progress_log(self) -> ProgressLog:
        return ProgressLog(self.root / "eventlog")

    def topic_watermarks(self) -> dict[int, tuple[int, int]]:
        return topic_watermarks(Config(kafka_bootstrap_servers=self.bootstrap), TOPIC)


def make_bench_producer(bootstrap: str, linger_ms: float) -> Any:
    # The product's producer settings (lz4, acks=all, idempotence) with the given linger and a
    # larger local queue so bulk loading does not stall on BufferError.
    return make_producer(Config(kafka_bootstrap_servers=bootstrap), **{
        "linger.ms": linger_ms,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
    })


def produce_one(producer: Any, key: bytes | None, value: bytes) -> None:
    produce_waiting(producer, TOPIC, key=key, value=value)


# ------------------------------------------------------------------------------------------
# Event sources
# ------------------------------------------------------------------------------------------

BAD_VALUES: tuple[Callable[[str, str, str], str], ...] = (
    lambda cid, uid, eid: "{not json",
    lambda cid, uid, eid: "[1, 2, 3]",
    lambda cid, uid, eid: json.dumps({"event_id": eid, "client_id": cid, "user_id": uid,
                                      "event_type": "pageview", "ts": "yesterday",
                                      "url": "https://shop.example/"}),
    lambda cid, uid, eid: json.dumps({"event_id": eid, "client_id": cid,
                                      "event_type": "pageview", "ts": 1_790_000_000_000,
                                      "url": "https://shop.example/"}),
    lambda cid, uid, eid: json.dumps({"event_id": eid, "client_id": cid, "user_id": uid,
                                      "event_type": "order", "ts": 1_790_000_000_000,
                                      "order_id": "bad", "amount": "-5.00", "currency": "EUR"}),
)


def generated_records(args: argparse.Namespace) -> tuple[list[tuple[bytes | None, bytes]],
                                                         dict[str, Any]]:
    """Records for the throughput run, from the product's generator, in delivery order.

    ``live_records`` is called with ``bad_fraction=0`` and bad records are inserted here
    instead, at the same fraction and at random positions: the bad records of every run since
    the harness's first (the generator's own then failed on epoch-millis ``ts``), so runs
    stay comparable.
    """
    from clickstream.jobs.generate import Delivery, Scale, interleaved, live_records

    scale = Scale(clients=args.clients, users_per_client=args.users, minutes=args.minutes,
                  sessions_per_user_per_day=args.sessions_per_user_per_day)
    delivery = Delivery(late_fraction=args.late_fraction,
                        duplicate_fraction=args.duplicate_fraction, bad_fraction=0.0)
    started = time.time()
    records = live_records(scale, delivery, args.seed)
    if args.events and len(records) > args.events:
        records = records[: args.events]
    rng = random.Random(args.seed)
    bad_count = int(len(records) * args.bad_fraction)
    positions = sorted((rng.randrange(len(records) + 1) for _ in range(bad_count)),
                       reverse=True)
    encoded: list[tuple[bytes | None, bytes]] = [
        (k.encode() if k else None, v.encode()) for k, v in records]
    bad = [(None, BAD_VALUES[i % len(BAD_VALUES)]("client-00", "user-00000", f"bad-{i}").encode())
           for i in range(len(positions))]
    # In one pass, as the generator places its own (one insert at a time was quadratic);
    # reversed, so that records at one position keep the order those inserts gave them.
    encoded = interleaved(encoded, bad[::-1], np.array(positions[::-1], dtype=np.int64))
    meta = {
        "generator": "clickstream.jobs.generate.live_records + bench bad records",
        "scale": {k: str(v) for k, v in asdict(scale).items()},
        "delivery": asdict(delivery) | {"bad_fraction (inserted by bench)": args.bad_fraction},
        "seed": args.seed,
        "records": len(encoded),
        "bad_records": bad_count,
        "generate_seconds": round(time.time() - started, 1),
        "mean_value_bytes": round(sum(len(v) for _, v in encoded) / max(len(encoded), 1)),
    }
    return encoded, meta


@dataclass
class Chunk:
    """Simulated events of one event-time window, sorted by ts (columns as Python lists)."""

    client: list[str]
    user: list[str]
    event_id: list[str]
    is_order: list[bool]
    ts_ms: list[int]
    url: list[str]
    order_id: list[str]
    amount: list[str]
    currency: list[str]
    ts_iso: list[str]


class LiveFeed:
    """An endless, realistic event stream from ``clickstream.jobs.generate.simulate``.

    Event time comes in windows of ``chunk_seconds * time_scale`` seconds, each simulated with
    enough users that a window holds about ``rate * chunk_seconds`` events (calibrated after
    every window). ``ts_mode="now"`` writes ``ts`` = produce time (the simulated users, urls and
    ordering are kept); ``"simulated"`` writes the simulated ``ts``, so event time runs
    ``time_scale`` times faster than the wall clock. Delivery effects: duplicates (same value
    re-sent a few records later), bad records (key null) and late records (held back
    ``late_seconds`` of wall time). Every pageview's referrer carries its produce time:
    ``MARK + phase + "/" + epoch ms``.
    """

    PAGEVIEW = ('{{"event_id":"{}","client_id":"{}","user_id":"{}","event_type":"pageview",'
                '"ts":{},"url":"{}","referrer":"' + MARK + '{}/{}"}}')
    ORDER = ('{{"event_id":"ev-{}","client_id":"{}","user_id":"{}","event_type":"order",'
             '"ts":{},"url":"https://shop.example/checkout/done","referrer":"",'
             '"order_id":"{}","amount":"{}","currency":"{}"}}')

    def __init__(self, *, rate: float, time_scale: float, ts_mode: str, clients: int,
                 seed: int, start: datetime, chunk_seconds: float = 30.0,
                 sessions_per_user_per_day: float = 6.0, duplicate_fraction: float = 0.02,
                 bad_fraction: float = 0.01, late_fraction: float = 0.0,
                 late_seconds: float = 20.0) -> None:
        self.rate = rate
        self.time_scale = time_scale
        self.ts_mode = ts_mode
        self.clients = clients
        self.seed = seed
        self.start = start
        self.window_minutes = chunk_seconds * time_scale / 60
        self.target_per_chunk = rate * chunk_seconds
        self.spd = sessions_per_user_per_day
        expected_per_user = self.spd * self.window_minutes / 1440 * 3.5
        self.users_per_client = max(10, round(self.target_per_chunk / expected_per_user
                                              / clients))
        self.dup_p, self.bad_p, self.late_p = duplicate_fraction, bad_fraction, late_fraction
        self.late_seconds = late_seconds
        self.rng = random.Random(seed)
        self.chunks: queue.Queue[Chunk | BaseException] = queue.Queue(maxsize=2)
        self.chunk_index = 0
        self.current: Chunk | None = None
        self.pos = 0
        self.dups: list[tuple[bytes | None, bytes]] = []
        self.held: list[tuple[float, int, tuple[Any, ...], tuple[int, str]]] = []
        self.held_seq = 0
        self.counts = {"pageviews": 0, "orders": 0, "duplicates": 0, "bad": 0, "late": 0}
        self.phase_pageviews: dict[str, int] = {}
        self.generate_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._generate, daemon=True, name="live-feed")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self.chunks.get_nowait()

    def _generate(self) -> None:
        from clickstream.jobs.generate import Scale, simulate

        index = 0
        while not self._stop.is_set():
            try:
                started = time.process_time()
                scale = Scale(
                    clients=self.clients, users_per_client=self.users_per_client,
                    start=self.start + timedelta(minutes=index * self.window_minutes),
                    minutes=self.window_minutes, sessions_per_user_per_day=self.spd,
                )
                pageviews, orders = simulate(scale, self.seed + index)
                chunk = self._to_chunk(pageviews, orders)
                got = len(chunk.ts_ms)
                if got:  # calibrate the user count so the next window holds the target
                    factor = min(max(self.target_per_chunk / got, 0.5), 2.0)
                    self.users_per_client = max(10, round(self.users_per_client * factor))
                self.generate_seconds += time.process_time() - started
            except BaseException as error:  # surface in the producer thread
                self.chunks.put(error)
                return
            index += 1
            while not self._stop.is_set():
                try:
                    self.chunks.put(chunk, timeout=0.5)
                    break
                except queue.Full:
                    continue

    @staticmethod
    def _to_chunk(pageviews: Any, orders: Any) -> Chunk:
        n_pv, n_or = pageviews.num_rows, orders.num_rows
        ts = np.concatenate([
            pageviews.column("ts").cast("int64").to_numpy(),
            orders.column("ts").cast("int64").to_numpy(),
        ]).astype(np.int64)
        order = np.argsort(ts, kind="stable")

        def col(table: Any, name: str, fill: str = "") -> np.ndarray:
            if name in table.column_names:
                return np.array(table.column(name).to_pylist(), dtype=object)
            return np.full(table.num_rows, fill, dtype=object)

        def both(pv_name: str, or_name: str | None = None) -> list[Any]:
            merged = np.concatenate([col(pageviews, pv_name), col(orders, or_name or pv_name)])
            return merged[order].tolist()

        iso = np.datetime_as_string(ts[order].astype("datetime64[ms]"), unit="ms")
        return Chunk(
            client=both("client_id"), user=both("user_id"),
            event_id=both("event_id", "order_id"),
            is_order=np.r_[np.zeros(n_pv, bool), np.ones(n_or, bool)][order].tolist(),
            ts_ms=ts[order].tolist(), url=both("url"), order_id=both("order_id"),
            amount=both("amount"), currency=both("currency"),
            ts_iso=[f'"{s}Z"' for s in iso.tolist()],
        )

    def _next_event(self) -> tuple[Any, ...]:
        while self.current is None or self.pos >= len(self.current.ts_ms):
            item = self.chunks.get(timeout=120)
            if isinstance(item, BaseException):
                raise item
            self.current, self.pos = item, 0
            self.chunk_index += 1
        c, i = self.current, self.pos
        self.pos += 1
        return (c.client[i], c.user[i], c.event_id[i], c.is_order[i], c.ts_ms[i], c.ts_iso[i],
                c.url[i], c.order_id[i], c.amount[i], c.currency[i])

    def _format(self, event: tuple[Any, ...], now_ms: int, now_iso: str, phase: str,
                held_ts: tuple[int, str] | None = None) -> tuple[bytes, bytes]:
        client, user, event_id, is_order, ts_ms, ts_iso, url, order_id, amount, currency = event
        if self.ts_mode == "now":  # a held (late) record keeps the ts it was drawn with
            ms, iso = held_ts or (now_ms, now_iso)
            ts_text = str(ms) if self.rng.random() < 0.5 else iso
        else:
            ts_text = str(ts_ms) if self.rng.random() < 0.5 else ts_iso
        if is_order:
            self.counts["orders"] += 1
            value = self.ORDER.format(order_id, client, user, ts_text, order_id, amount,
                                      currency)
        else:
            self.counts["pageviews"] += 1
            self.phase_pageviews[phase] = self.phase_pageviews.get(phase, 0) + 1
            value = self.PAGEVIEW.format(event_id, client, user, ts_text, url, phase, now_ms)
        return f"{client}/{user}".encode(), value.encode()

    def take(self, n: int, now: float, phase: str) -> list[tuple[bytes | None, bytes]]:
        """The next ``n`` records to produce at wall time ``now``."""
        now_ms = int(now * 1000)
        now_iso = '"' + datetime.fromtimestamp(now, UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z") + '"'
        out: list[tuple[bytes | None, bytes]] = []
        while self.held and self.held[0][0] <= now and len(out) < n:
            _due, _seq, event, held_ts = heapq.heappop(self.held)
            out.append(self._format(event, now_ms, now_iso, phase, held_ts))
        if self.dups:
            k = n - len(out)
            out.extend(self.dups[:k])
            del self.dups[:k]
        rng = self.rng
        while len(out) < n:
            roll = rng.random()
            if roll < self.bad_p:
                self.counts["bad"] += 1
                i = self.counts["bad"]
                maker = BAD_VALUES[i % len(BAD_VALUES)]
                out.append((None, maker("client-00", "user-00000", f"bad-{phase}-{i}").encode()))
                continue
            event = self._next_event()
            if roll < self.bad_p + self.late_p:
                self.counts["late"] += 1
                self.held_seq += 1
                heapq.heappush(self.held, (now + self.late_seconds, self.held_seq, event,
                                           (now_ms, now_iso)))
                continue
            record = self._format(event, now_ms, now_iso, phase)
            out.append(record)
            if roll > 1.0 - self.dup_p:
                self.counts["duplicates"] += 1
                self.dups.append(record)
        return out


class Pacer:
    """Produces ``feed`` records at a steady rate; every recorded phase lands in ``phases``
    (also when the phase ends with an exception, e.g. the sessionizer died)."""

    def __init__(self, producer: Any, feed: LiveFeed, rate: float) -> None:
        self.producer = producer
        self.feed = feed
        self.rate = rate
        self.sent = 0
        self.phases: list[dict[str, Any]] = []

    def run(self, seconds: float, phase: str, check: Callable[[], None] | None = None,
            rate: float | None = None, record: bool = True) -> dict[str, Any]:
        rate = rate or self.rate
        started = time.time()
        cpu0 = cpu_seconds_self()
        sent = 0
        next_check = started + 1.0
        behind_max = 0
        stats: dict[str, Any] = {"phase": phase, "target_rate_per_s": rate,
                                 "target_seconds": seconds}
        try:
            while True:
                now = time.time()
                elapsed = now - started
                if elapsed >= seconds:
                    break
                due = int(rate * elapsed) - sent
                if due > 0:
                    for key, value in self.feed.take(due, now, phase):
                        produce_one(self.producer, key, value)
                        self.sent += 1
                    sent += due
                    behind_max = max(behind_max, int(rate * (time.time() - started)) - sent)
                self.producer.poll(0)
                if check is not None and now >= next_check:
                    check()
                    next_check = now + 1.0
                time.sleep(0.004)
            self.producer.flush(30)
        except BaseException as error:
            stats["ended_by"] = f"{type(error).__name__}: {error}"
            raise
        finally:
            wall = time.time() - started
            stats.update({"seconds": round(wall, 2), "records": sent,
                          "rate_per_s": round(sent / max(wall, 1e-9), 1),
                          "max_behind_records": behind_max,
                          "bench_process_cpu_s": round(cpu_seconds_self() - cpu0, 1)})
            if record:
                self.phases.append(stats)
        return stats


# ------------------------------------------------------------------------------------------
# Delta log: commit time of every pageview
# ------------------------------------------------------------------------------------------


def delta_commits(table: Path) -> Iterator[tuple[Path, int | None, list[str]]]:
    """(log file, commit timestamp ms or None, data files added) of every commit, in order."""
    for entry in sorted((table / "_delta_log").glob("*.json")):
        commit_ms, added = None, []
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "commitInfo" in action:
                commit_ms = action["commitInfo"].get("timestamp")
            elif "add" in action:
                added.append(unquote(action["add"]["path"]))
        yield entry, commit_ms, added


def pageview_commit_latencies(table: Path) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Latency (ms) of every bench-marked pageview, keyed by phase, and one row per version.

    Reads ``_delta_log/*.json``: ``commitInfo.timestamp`` of each version and the Parquet files
    it added; a row's produce time comes from its referrer (``MARK + phase/ms``).
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    by_phase: dict[str, list[np.ndarray]] = {}
    versions = []
    for entry, commit_ms, added in delta_commits(table):
        if commit_ms is None:
            commit_ms = int(entry.stat().st_mtime * 1000)
        rows = 0
        lat_parts: list[np.ndarray] = []
        for rel in added:
            data = pq.read_table(table / rel, columns=["referrer"]).column("referrer")
            rows += len(data)
            marked = pc.starts_with(data, MARK)
            refs = pc.filter(data, marked)
            if not len(refs):
                continue
            tail = pc.utf8_slice_codeunits(refs, len(MARK))
            parts = pc.split_pattern(tail, "/")
            phases = pc.list_element(parts, 0).to_numpy(zero_copy_only=False)
            produced = pc.cast(pc.list_element(parts, 1), "int64").to_numpy()
            latency = commit_ms - produced
            for phase in np.unique(phases):
                sel = latency[phases == phase]
                by_phase.setdefault(str(phase), []).append(sel)
                lat_parts.append(sel)
        all_lat = np.concatenate(lat_parts) if lat_parts else np.array([])
        versions.append({
            "version": int(entry.stem), "commit_ms": commit_ms, "rows": rows,
            "latency_ms_min": int(all_lat.min()) if len(all_lat) else None,
            "latency_ms_max": int(all_lat.max()) if len(all_lat) else None,
        })
    return {k: np.concatenate(v) for k, v in by_phase.items()}, versions


def latency_stats(values: np.ndarray) -> dict[str, Any]:
    if not len(values):
        return {"count": 0}
    return {"count": len(values),
            "p50_ms": round(percentile(values, 50)), "p95_ms": round(percentile(values, 95)),
            "p99_ms": round(percentile(values, 99)), "max_ms": int(values.max()),
            "min_ms": int(values.min()), "mean_ms": round(float(values.mean()))}


def delta_row_count(table: Path) -> int | None:
    try:
        from deltalake import DeltaTable

        return DeltaTable(str(table)).to_pyarrow_dataset().count_rows()
    except Exception:
        return None


# ------------------------------------------------------------------------------------------
# Batch timing analysis
# ------------------------------------------------------------------------------------------


def batch_summary(batches: list[BatchLine], started_at: float) -> dict[str, Any]:
    if not batches:
        return {"batches": 0}
    first_start = batches[0].at - batches[0].seconds
    last_end = batches[-1].at
    records = sum(b.records for b in batches)
    in_batches = sum(b.seconds for b in batches)
    result: dict[str, Any] = {
        "batches": len(batches),
        "records": records,
        "first_batch_started_after_s": round(first_start - started_at, 1),
        "processing_window_s": round(last_end - first_start, 2),
        "events_per_s_processing_window": round(records / max(last_end - first_start, 1e-9)),
        "seconds_in_foreach_batch": round(in_batches, 1),
        "events_per_s_in_foreach_batch": round(records / max(in_batches, 1e-9)),
    }
    if len(batches) > 1:
        later = batches[1:]
        span = later[-1].at - batches[0].at
        result["events_per_s_after_first_batch"] = round(
            sum(b.records for b in later) / max(span, 1e-9))
        gaps = [b.at - b.seconds - a.at for a, b in itertools.pairwise(batches)]
        result["mean_gap_between_batches_s"] = round(statistics.fmean(gaps), 2)
    return result


def compact_batches(batches: list[BatchLine], started_at: float,
                    limit: int = 400) -> list[dict[str, Any]]:
    rows = [{"batch": b.batch_id, "t_s": round(b.at - started_at, 1), "seconds": b.seconds,
             **b.counts} for b in batches]
    if len(rows) > limit:  # keep the result file small: every k-th batch plus the last
        step = -(-len(rows) // limit)
        rows = [*rows[::step], rows[-1]]
    return rows


# ------------------------------------------------------------------------------------------
# throughput
# ------------------------------------------------------------------------------------------


def cmd_throughput(args: argparse.Namespace) -> int:
    info = machine_info()
    records, gen_meta = generated_records(args)
    log(f"generated {len(records):,} records in {gen_meta['generate_seconds']}s")
    result: dict[str, Any] = {"benchmark": "throughput", "argv": sys.argv, "machine": info,
                              "generated": gen_meta, "status": "failed"}
    with Workspace(args, "throughput") as ws:
        producer = ws.producer()
        started = time.time()
        for key, value in records:
            produce_one(producer, key, value)
        producer.flush(120)
        produce_s = time.time() - started
        result["produce"] = {"records": len(records), "seconds": round(produce_s, 1),
                             "rate_per_s": round(len(records) / produce_s),
                             "failed": producer.failed}
        marks = ws.topic_watermarks()
        in_topic = sum(high - low for low, high in marks.values())
        dropped = sum(low for low, _high in marks.values())
        result["topic"] = {"partitions": len(marks), "records": in_topic,
                           "dropped_by_broker_cap": dropped}
        log(f"produced {len(records):,} in {produce_s:.1f}s; topic holds {in_topic:,} "
            f"(dropped by the broker's per-partition cap: {dropped:,})")
        if dropped:
            result["error"] = (f"the embedded broker dropped {dropped} records (per-partition "
                               "cap); lower --events or raise --partitions")
            return finish("throughput", result, 1)
        del records
        env = ws.env(CLICKSTREAM_MAX_EVENTS_PER_TRIGGER=str(args.max_events_per_trigger),
                     CLICKSTREAM_SHUFFLE_PARTITIONS=str(args.shuffle_partitions))
        with CpuWatch() as cpu:
            sess = Sessionizer(ws.root, env, until_caught_up=True).start()
            progress = ws.progress_log()
            try:
                with PeakMemory(sess.pid) as memory:
                    code = sess.wait(timeout=args.timeout)
            finally:
                if sess.alive():
                    log("sessionizer did not finish in time; stopping it")
                sess.stop()
        result["cpu"] = cpu.report()
        result["memory"] = memory.report()
        wall = (sess.exited_at or time.time()) - sess.started_at
        batches = sess.snapshot()
        result["sessionizer"] = {
            "command": " ".join(sess.command), "exit_code": sess.proc.returncode,
            "env": {k: v for k, v in env.items() if k.startswith(("CLICKSTREAM_", "KAFKA_"))},
            "wall_s": round(wall, 1), "summary_line": next(
                (line for line in sess.other_lines if line.startswith("sessionize:")), None),
        }
        records_done = sum(b.records for b in batches)
        timing = batch_summary(batches, sess.started_at)
        cpu_s = result["cpu"]["bench_tree_cpu_s"]
        result["results"] = {
            "events_per_s_wall_including_jvm_start": round(records_done / wall),
            **timing,
            # Contention-robust view: CPU the sessionizer (and the in-process broker) used.
            "cpu_us_per_event": round(cpu_s * 1e6 / max(records_done, 1)),
            "events_per_s_if_all_cores_were_ours_estimate": round(
                records_done / max(cpu_s / (os.cpu_count() or 1), 1e-9)),
        }
        result["batches"] = compact_batches(batches, sess.started_at)
        result["spark_progress"] = summarize_progress(progress.poll())
        result["stage_breakdown"] = stage_breakdown(ws.root / "eventlog")
        stored = delta_row_count(ws.warehouse / "pageviews")
        result["check"] = {"records_processed": records_done, "records_in_topic": in_topic,
                           "pageviews_stored": stored,
                           "quarantined": delta_row_count(ws.warehouse / "quarantine")}
        if code != 0 or records_done != in_topic:
            result["error"] = (f"sessionizer exit code {code}; processed {records_done} of "
                               f"{in_topic} records")
            result["stderr_tail"] = sess.stderr_tail()
            return finish("throughput", result, 1)
        result["status"] = "ok"
        summary = (f"throughput: {records_done:,} events; "
                   f"{result['results']['events_per_s_wall_including_jvm_start']:,}/s wall "
                   f"(incl. JVM start, {wall:.0f}s); "
                   f"{timing['events_per_s_processing_window']:,}/s over the processing window "
                   f"({timing['processing_window_s']}s, {timing['batches']} batches); "
                   f"{result['results']['cpu_us_per_event']} CPU-us/event; other processes "
                   f"took {result['cpu']['other_processes_pct_of_capacity']}% of the CPU; "
                   f"goal >= 100,000/s")
        return finish("throughput", result, 0, summary)


LAST_RESULT: dict[str, Any] = {}  # the result ``finish`` wrote last (for --retries)


def finish(name: str, result: dict[str, Any], code: int, summary: str | None = None,
           path: Path | None = None) -> int:
    result["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    other = (result.get("cpu") or {}).get("other_processes_pct_of_capacity")
    result["contended"] = other is not None and other > MAX_CONTENTION_PCT[0]
    LAST_RESULT.update(result)
    written = write_result(name, result, path)
    if summary is None:
        summary = f"{name}: FAILED: {result.get('error', 'see result file')}"
    print(f"{summary} -> {written.relative_to(REPO)}", flush=True)
    return code


# ------------------------------------------------------------------------------------------
# stages: the pipeline's pieces with a no-op sink (where the time goes)
# ------------------------------------------------------------------------------------------

REFERENCE_SCHEMA = ("event_id string, client_id string, user_id string, event_type string, "
                    "ts string, url string, referrer string, order_id string, amount string, "
                    "currency string")


def _steady_rate(row: dict[str, Any]) -> float:
    return row.get("events_per_s_steady_batches", row["events_per_s"])


def _floor_sink(spark: Any, config: Config, *, sessionize: bool
                ) -> Callable[[Any, int], None]:
    """A lower bound for any sessionizer on this machine's components: a ``foreachBatch`` sink
    that stores each valid pageview once (deduplicated by event_id within the micro-batch) with
    the product's Delta writer, and with ``sessionize`` also the sessions of the micro-batch's
    own pageviews, computed in the JVM (window functions) and stored. Strictly less than the
    product does: no state across micro-batches (sessions split at micro-batch edges), no orders,
    quarantine, duplicates against stored data, gates or topics."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from clickstream.io.delta_tables import open_tables
    from clickstream.jobs.sessionize import _shape
    from clickstream.tables import PAGEVIEWS, SESSIONS

    tables = open_tables(config, spark)
    app_id = f"bench-floor-{uuid.uuid4().hex}"  # a query of its own: --repeat appends again

    def store(spec: Any, rows: Any, batch_id: int) -> None:
        tables.append_once(
            spec.name, _shape(rows, spec),
            app_id=app_id, version=batch_id, partition_by=spec.partition_by,
            metadata={"cause": f"bench floor batch {batch_id}"})

    def sink(batch: Any, batch_id: int) -> None:
        pageviews = (batch.where(F.col("error").isNull() & (F.col("event_type") == "pageview"))
                     .withColumn("event_date", F.to_date("ts")).dropDuplicates(["event_id"]))
        if not sessionize:
            store(PAGEVIEWS, pageviews, batch_id)
            return
        pageviews = pageviews.persist()
        try:
            store(PAGEVIEWS, pageviews, batch_id)
            by_user = Window.partitionBy("client_id", "user_id").orderBy("ts", "event_id")
            previous = F.lag("ts").over(by_user)
            starts = (previous.isNull()
                      | (F.unix_micros("ts") - F.unix_micros(previous)
                         >= F.lit(config.session_gap_ms * 1000)))
            numbered = pageviews.withColumn(
                "n", F.sum(starts.cast("int")).over(by_user))
            sessions = numbered.groupBy("client_id", "user_id", "n").agg(
                F.min("ts").alias("session_start"), F.max("ts").alias("session_end"),
                F.count("*").alias("pageview_count"),
                F.min_by("url", "ts").alias("landing_url"), F.max_by("url", "ts").alias("exit_url"))
            store(SESSIONS, sessions.select(
                F.sha2(F.concat_ws("/", "client_id", "user_id",
                                   F.col("session_start").cast("string")), 256)
                .alias("session_id"), "*", F.lit(0).alias("order_count"),
                F.lit(0).alias("revenue"), F.lit(1).alias("revision"),
                F.to_date("session_start").alias("session_date")), batch_id)
        finally:
            pageviews.unpersist()

    return sink


def cmd_stages(args: argparse.Namespace) -> int:
    """Time prefixes of the sessionizer's plan with Spark's ``noop`` sink, in this process.

    Uses the product's own functions (``read_kafka_stream``, ``parse_kafka_records``,
    ``build_stream``) over the same pre-produced events as ``throughput``, each as an
    ``availableNow`` query with a fresh checkpoint, after one warm-up pass. The difference
    between ``build_stream`` and a full ``throughput`` run is the ``foreachBatch`` sink;
    ``build_stream_unshared_reads`` is the same plan with each branch fetching its records from
    Kafka (what sharing the reads saves, kafka_source K6). Not product code:
    ``reference_from_json`` (``from_json`` with a fixed schema and no validation, what a cheaper
    parse could cost) and the two ``floor_*`` sinks (the least any sessionizer must do here:
    store each pageview once, and with sessions of each micro-batch alone, see
    ``_floor_sink``), which bound what the product's throughput could reach on this machine.
    """
    records, gen_meta = generated_records(args)
    result: dict[str, Any] = {"benchmark": "stages", "argv": sys.argv, "machine": machine_info(),
                              "generated": gen_meta, "status": "failed", "variants": {}}
    with Workspace(args, "stages") as ws:
        producer = ws.producer()
        for key, value in records:
            produce_one(producer, key, value)
        producer.flush(120)
        marks = ws.topic_watermarks()
        in_topic = sum(high - low for low, high in marks.values())
        if sum(low for low, _high in marks.values()):
            result["error"] = "the embedded broker dropped records; lower --events"
            return finish("stages", result, 1)
        del records
        from pyspark.sql import functions as F

        from clickstream.events.parse import parse_kafka_records
        from clickstream.io.kafka_source import read_kafka_stream
        from clickstream.jobs.sessionize import build_stream
        from clickstream.spark_session import build_spark

        env = ws.env(CLICKSTREAM_MAX_EVENTS_PER_TRIGGER=str(args.max_events_per_trigger),
                     CLICKSTREAM_SHUFFLE_PARTITIONS=str(args.shuffle_partitions))
        config = Config.from_env(env)
        started = time.time()
        spark = build_spark(config, "clickstream-bench-stages")
        result["spark_start_s"] = round(time.time() - started, 1)

        def source() -> Any:
            return read_kafka_stream(spark, config, TOPIC)

        def parsed() -> Any:
            return parse_kafka_records(source(), max_ts_ahead_ms=config.max_ts_ahead_ms)

        variants: list[tuple[str, Callable[[], Any]]] = [
            ("warmup_kafka_source", source),
            ("kafka_source", source),
            ("kafka_source_parse", parsed),
            ("build_stream", lambda: build_stream(spark, config)),
            ("build_stream_unshared_reads",
             lambda: build_stream(spark, config, share_reads=False)),
            ("reference_from_json", lambda: source().select(
                F.from_json(F.col("value").cast("string"), REFERENCE_SCHEMA).alias("v"))
                .select("v.*")),
            ("floor_store_pageviews", parsed),
            ("floor_store_and_sessionize", parsed),
        ]
        # --repeat N: the measured variants N times over, in an order that alternates, so
        # that pairs compare on a host whose speed drifts; each run keeps its own row.
        warmups = [v for v in variants if v[0].startswith("warmup")]
        measured = [v for v in variants if not v[0].startswith("warmup")]
        rounds = [measured if r % 2 == 0 else measured[::-1] for r in range(args.repeat)]
        cpu = CpuWatch().__enter__()
        try:
            for run, (name, make) in enumerate(warmups + [v for r in rounds for v in r]):
                t0 = time.time()
                writer = make().writeStream.trigger(availableNow=True)
                if name.startswith("floor_"):
                    writer = writer.foreachBatch(_floor_sink(
                        spark, config, sessionize=name == "floor_store_and_sessionize"))
                else:
                    writer = writer.format("noop")
                query = (writer.option("checkpointLocation",
                                       str(ws.root / "stages" / f"{run}-{name}")).start())
                query.awaitTermination()
                wall = time.time() - t0
                runs = [p for p in query.recentProgress if _input_rows(p)]
                steady = [p["durationMs"].get("addBatch", 0) for p in runs[1:]]
                steady_rows = sum(_input_rows(p) for p in runs[1:])
                doubled = name.startswith("build_stream")  # two scans per batch
                row = {"wall_s": round(wall, 1), "events_per_s": round(in_topic / wall),
                       "batches": len(runs),
                       "add_batch_ms": [p["durationMs"].get("addBatch") for p in runs]}
                if steady:
                    events = steady_rows / (2 if doubled else 1)
                    row["events_per_s_steady_batches"] = round(events / (sum(steady) / 1000))
                    row["us_per_event_steady"] = round(sum(steady) * 1000 / events, 1)
                result["variants"].setdefault(name, []).append(row)
                log(f"stages: {name}: {row}")
        finally:
            spark.stop()
            result["cpu"] = cpu.report()
        result["records"] = in_topic
        result["status"] = "ok"
        parts = ", ".join(
            f"{k} {statistics.median(_steady_rate(v) for v in runs):,.0f}/s"
            for k, runs in result["variants"].items() if not k.startswith("warmup"))
        return finish("stages", result, 0, f"stages (steady batches, median of runs): {parts}")


# ------------------------------------------------------------------------------------------
# latency and memory: continuous runs
# ------------------------------------------------------------------------------------------


def bucket_sessions(args: argparse.Namespace) -> Any:
    """One user bucket's pageviews and orders over ``--history-minutes`` + the measured window.

    Each user repeats: a session of a geometric number of pageviews (at least 1, mean
    ``--pageviews-per-session``) 10-120 s apart, then 31-110 minutes idle; a first offset
    spreads users over the cycle. Users are as many as the bucket's share of ``--rate`` needs.
    About 2% of sessions hold an order. Returns the processor's input columns, sorted by ts.
    """
    import pandas as pd

    rng = np.random.default_rng(args.seed)
    per_bucket = args.rate / args.buckets
    mean_spacing, mean_idle = 65.0, (31 + 110) / 2 * 60
    length = args.pageviews_per_session
    cycle_s = (length - 1) * mean_spacing + mean_idle
    users = max(1, round(per_bucket * cycle_s / length))
    horizon_ms = int((args.history_minutes * 60 + args.batches * args.batch_seconds) * 1000)
    ts_parts, user_parts = [], []
    clock = rng.uniform(-cycle_s, 0, users) * 1000  # each user's next session start
    while (live := np.flatnonzero(clock < horizon_ms)).size:
        count = rng.geometric(1 / length, len(live))  # pageviews per session, mean ``length``
        first = np.cumsum(count) - count
        gaps = rng.uniform(10_000, 120_000, int(count.sum()))
        gaps[first] = 0.0
        within = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[first], count)
        ts = np.repeat(clock[live], count) + within
        ts_parts.append(ts)
        user_parts.append(np.repeat(live, count))
        clock[live] = ts[first + count - 1] + rng.uniform(31, 110, len(live)) * 60_000
    ts = np.concatenate(ts_parts).astype(np.int64)
    user = np.concatenate(user_parts)
    keep = (ts >= 0) & (ts < horizon_ms)
    ts, user = ts[keep], user[keep]
    n = len(ts)
    is_order = rng.random(n) < 0.02 / length
    frame = pd.DataFrame({
        "bucket": 0, "client_id": "client-00",
        "user_id": np.char.add("user-", user.astype(str)).astype(object),
        "event_type": np.where(is_order, "order", "pageview").astype(object),
        "event_id": np.char.add("ev-", np.arange(n).astype(str)).astype(object),
        "ts_ms": ts + 1_793_491_200_000,  # 2026-11-01
        "url": np.char.add("https://shop.example/p/", (user % 997).astype(str)).astype(object),
        "order_id": np.where(is_order, np.char.add("o-", np.arange(n).astype(str)), None),
        "amount_e4": np.where(is_order, 250_000, 0).astype(np.int64),
        "currency": np.where(is_order, "EUR", None),
    })
    return frame.sort_values("ts_ms", kind="stable").reset_index(drop=True)


def cmd_state(args: argparse.Namespace) -> int:
    """Per-call cost of the session state at steady state, for one user bucket.

    Drives the product's ``SessionProcessor`` with PySpark's ``TwsTester`` (the processor's own
    state encoding, no Spark): one call with ``--history-minutes`` of events fills the state
    as a long-running stream would have it, then ``--batches`` micro-batches of
    ``--batch-seconds`` of events each are timed (input call plus the timers the new watermark
    fires). The sessionizer makes ``--buckets`` such calls per micro-batch over its two cores.
    The 2-minute ``latency`` run never reaches this state: no session closes in it. The mean
    per quarter of the timed calls shows a cost that grows with the stream's age (S7).
    """
    import pandas as pd
    from pyspark.sql.streaming.tws_tester import TwsTester

    from clickstream.sessions.stream_adapter import INPUT_COLUMNS
    from clickstream.sessions.stream_processor import SessionProcessor

    gap_ms, delay_ms = 30 * 60_000, 10 * 60_000
    started = time.perf_counter()
    events = bucket_sessions(args)
    dup = events.sample(frac=args.duplicate_fraction, random_state=args.seed)
    log(f"generated {len(events):,} events for one bucket in {time.perf_counter() - started:.1f}s")
    tester = TwsTester(SessionProcessor(gap_ms), timeMode="EventTime",
                       eventTimeExtractor=lambda row: int(row["ts_ms"]))
    # Late rows are dropped below, vectorised: the tester's own filter runs Python per row.
    tester._filterLateEventsPandas = lambda frame: frame
    base = int(events["ts_ms"].min())
    history_end = base + int(args.history_minutes * 60_000)

    def state_bytes() -> int:
        tester.handle.setGroupingKey(0)
        values = [v._get_value() for v in tester.handle.value_states.values()]  # uncounted
        values += [v for m in tester.handle.map_states.values() for v in m.values()]
        return sum(len(v[0]) for v in values if v and v[0])

    moved = {"read": 0, "written": 0}  # blob bytes through the state API, as Spark would

    def count(kind: str, method: Any, value_at: int) -> Any:
        def counted(*call_args: Any) -> Any:
            result = method(*call_args)
            value = result if kind == "read" else call_args[value_at]
            moved[kind] += len(value[0]) if value and value[0] else 0
            return result
        return counted

    def call(frame: pd.DataFrame, watermark: int) -> tuple[float, int]:
        """One micro-batch in Spark's order: input under the batch's watermark, then the timers
        it expired (``TwsTester.setWatermark`` would fire them before the input)."""
        begin = time.perf_counter()
        if watermark > tester._currentWatermarkMs:
            tester._currentWatermarkMs = watermark
            tester.handle.setWatermark(watermark)
        emitted = [tester.testInPandas(0, frame[list(INPUT_COLUMNS)].reset_index(drop=True)),
                   tester._handleExpiredTimers()]
        rows = sum(len(e) for e in emitted if e is not None)
        return time.perf_counter() - begin, rows

    history = events[events["ts_ms"] < history_end]
    max_ts = int(history["ts_ms"].max())
    fill_s, _ = call(history, max_ts - delay_ms)
    log(f"filled the state with {len(history):,} events in {fill_s:.1f}s: "
        f"{state_bytes() / 2**20:.1f} MiB of state blobs")
    for value_state in tester.handle.value_states.values():
        value_state.get = count("read", value_state.get, 0)
        value_state.update = count("written", value_state.update, 0)
    for map_state in tester.handle.map_states.values():
        map_state.getValue = count("read", map_state.getValue, 0)
        map_state.updateValue = count("written", map_state.updateValue, 1)
    with CpuWatch() as cpu:
        batches = []
        for index in range(args.batches):
            lo = history_end + int(index * args.batch_seconds * 1000)
            hi = lo + int(args.batch_seconds * 1000)
            window = events[(events["ts_ms"] >= lo) & (events["ts_ms"] < hi)]
            copies = dup[(dup["ts_ms"] >= lo - 60_000) & (dup["ts_ms"] < hi - 60_000)]
            frame = pd.concat([window, copies], ignore_index=True)
            frame = frame[frame["ts_ms"] > tester._currentWatermarkMs]  # the previous one
            before = dict(moved)
            seconds, emitted = call(frame, max_ts - delay_ms)
            max_ts = max(max_ts, int(window["ts_ms"].max()))
            batches.append({"rows": len(frame), "seconds": round(seconds, 4),
                            "emitted_rows": emitted, "state_bytes": state_bytes(),
                            "bytes_read": moved["read"] - before["read"],
                            "bytes_written": moved["written"] - before["written"]})
    seconds = np.array([b["seconds"] for b in batches])
    per_call = {"mean_ms": round(1000 * float(seconds.mean()), 1),
                "p95_ms": round(1000 * float(percentile(seconds, 95)), 1),
                "max_ms": round(1000 * float(seconds.max()), 1)}
    micro_batch_s = float(seconds.mean()) * args.buckets / 2
    # A state that grows call after call shows as a rising mean from one quarter to the next.
    by_quarter_ms = [round(1000 * float(part.mean()), 1)
                     for part in np.array_split(seconds, 4) if len(part)]
    result = {"benchmark": "state", "argv": sys.argv, "machine": machine_info(),
              "status": "ok", "cpu": cpu.report(), "settings": {
                  k: getattr(args, k) for k in ("rate", "buckets", "batch_seconds",
                                                "history_minutes", "batches",
                                                "pageviews_per_session", "seed",
                                                "duplicate_fraction")},
              "history_events": len(history), "fill_seconds": round(fill_s, 2),
              "per_call": per_call, "per_call_mean_ms_by_quarter": by_quarter_ms,
              "state_mib": round(float(np.mean([b["state_bytes"] for b in batches])) / 2**20, 2),
              "state_mib_read_per_call": round(
                  float(np.mean([b["bytes_read"] for b in batches])) / 2**20, 2),
              "state_mib_written_per_call": round(
                  float(np.mean([b["bytes_written"] for b in batches])) / 2**20, 2),
              "micro_batch_state_seconds": round(micro_batch_s, 2), "batches": batches}
    summary = (f"state: {args.rate:,.0f} events/s over {args.buckets} buckets, "
               f"{args.history_minutes:.0f} min of history ({len(history):,} events a bucket): "
               f"{per_call['mean_ms']:.0f} ms per bucket call (p95 {per_call['p95_ms']:.0f}; "
               f"by quarter of the run {' / '.join(f'{q:.0f}' for q in by_quarter_ms)}), "
               f"~{micro_batch_s:.2f}s of state work per {args.batch_seconds:.0f}s micro-batch "
               f"on 2 cores; state {result['state_mib']} MiB a bucket, "
               f"{result['state_mib_read_per_call']} MiB read and "
               f"{result['state_mib_written_per_call']} MiB written per call")
    return finish("state", result, 0, summary)


def cmd_tws_input(args: argparse.Namespace) -> int:
    """How fast the state operator's Python worker reads its input: PySpark's own reader
    (row by row) against the product's (``sessions.tws_input``, by runs of one key).

    Both read the same Arrow stream, shaped like the sessionizer's session input (its columns,
    ``--rows`` rows in 10,000-row batches, 16 buckets in runs as the JVM sends them), and hand
    every frame on as the worker would; the results must be equal. No Spark.
    """
    import io

    import pandas as pd
    import pyarrow as pa
    from pyspark.sql.pandas.serializers import TransformWithStateInPandasSerializer

    from clickstream.sessions import tws_input

    rng = np.random.default_rng(args.seed)
    n = args.rows
    ts = 1_793_000_000_000 + rng.integers(0, 3_600_000, n)
    is_order = rng.random(n) < 0.05
    table = pa.table({
        "bucket": pa.array(np.sort(rng.integers(0, 16, n)), pa.int32()),
        "client_id": pa.array([f"client-{i % 10:02d}" for i in range(n)]),
        "user_id": pa.array([f"user-{u:06d}" for u in rng.integers(0, 50_000, n)]),
        "event_type": pa.array(np.where(is_order, "order", "page_view")),
        "event_id": pa.array([f"ev-{i:012d}" for i in range(n)]),
        "event_time": pa.array(ts * 1000, pa.timestamp("us", tz="UTC")),
        "ts_ms": pa.array(ts, pa.int64()),
        "url": pa.array([f"https://shop.example/p/{i % 500}" for i in range(n)]),
        "order_id": pa.array([f"o-{i}" if o else None for i, o in enumerate(is_order)]),
        "amount_e4": pa.array([12_345 if o else None for o in is_order], pa.int64()),
        "currency": pa.array(["EUR" if o else None for o in is_order]),
    })
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=10_000):
            writer.write_batch(batch)
    stream = sink.getvalue()

    def read(load_stream: Any) -> tuple[float, list[tuple[Any, pd.DataFrame | None]]]:
        serializer = TransformWithStateInPandasSerializer(
            timezone="UTC", safecheck=False, assign_cols_by_name=True,
            prefer_int_ext_dtype=False, arrow_max_records_per_batch=10_000,
            arrow_max_bytes_per_batch=2**31 - 1, int_to_decimal_coercion_enabled=False)
        serializer.key_offsets = [0]
        begin = time.perf_counter()
        calls = [(key, pd.concat([frame for _, frame in group], ignore_index=True)
                  if group is not None else None)
                 for _, key, group in load_stream(serializer, io.BytesIO(stream))]
        return time.perf_counter() - begin, calls

    runs: dict[str, list[float]] = {"pyspark_row_by_row": [], "key_runs": []}
    with CpuWatch() as cpu:
        for _ in range(args.repeat):
            upstream_s, upstream = read(tws_input.UPSTREAM_LOAD_STREAM)
            runs_s, ours = read(tws_input.load_stream_by_key_runs)
            runs["pyspark_row_by_row"].append(upstream_s)
            runs["key_runs"].append(runs_s)
    assert [key for key, _ in ours] == [key for key, _ in upstream]
    for (_, got), (_, want) in zip(ours, upstream, strict=True):
        if want is not None:
            pd.testing.assert_frame_equal(got, want, check_dtype=False)
    best = {name: min(seconds) for name, seconds in runs.items()}
    per_row = {name: round(1e6 * seconds / n, 2) for name, seconds in best.items()}
    result = {"benchmark": "tws-input", "argv": sys.argv, "machine": machine_info(),
              "status": "ok", "cpu": cpu.report(), "rows": n, "columns": table.num_columns,
              "seconds": runs, "best_us_per_row": per_row, "equal": True}
    summary = (f"tws-input: {n:,} rows: PySpark's reader {per_row['pyspark_row_by_row']} µs a "
               f"row, by key runs {per_row['key_runs']} µs a row (best of {args.repeat}); "
               "same frames")
    return finish("tws-input", result, 0, summary)


class SessionizerDied(RuntimeError):
    pass


def continuous_env(ws: Workspace, args: argparse.Namespace) -> dict[str, str]:
    memory = {"CLICKSTREAM_DRIVER_MEMORY": args.driver_memory} if args.driver_memory else {}
    return ws.env(CLICKSTREAM_TRIGGER_INTERVAL=str(args.trigger_interval),
                  CLICKSTREAM_MAX_EVENTS_PER_TRIGGER=str(args.max_events_per_trigger),
                  CLICKSTREAM_SHUFFLE_PARTITIONS=str(args.shuffle_partitions), **memory)


def wait_first_commit(sess: Sessionizer, pacer: Pacer, timeout: float) -> float:
    """Trickle events until the sessionizer committed its first batch; returns seconds."""
    started = time.time()

    def check() -> None:
        if not sess.alive():
            raise SessionizerDied(f"sessionizer exited with {sess.proc.returncode}")

    while not sess.snapshot():
        if time.time() - started > timeout:
            raise SessionizerDied(f"no batch committed within {timeout:.0f}s of the start")
        pacer.run(1.0, "w", check, rate=200, record=False)
    return time.time() - started


def drain(sess: Sessionizer, target_records: int, timeout: float) -> float | None:
    """Wait until the sessionizer reports ``target_records`` processed; seconds or None."""
    started = time.time()
    while time.time() - started < timeout:
        if sess.records_done() >= target_records:
            return time.time() - started
        if not sess.alive():
            return None
        time.sleep(0.25)
    return None


def make_feed(args: argparse.Namespace, ts_mode: str) -> LiveFeed:
    start = datetime.now(UTC).replace(microsecond=0) if ts_mode == "now" else args.event_start
    return LiveFeed(rate=args.rate, time_scale=args.time_scale, ts_mode=ts_mode,
                    clients=args.clients, seed=args.seed, start=start,
                    sessions_per_user_per_day=args.sessions_per_user_per_day,
                    duplicate_fraction=args.duplicate_fraction, bad_fraction=args.bad_fraction,
                    late_fraction=args.late_fraction, late_seconds=args.late_seconds)


def cmd_latency(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"benchmark": "latency", "argv": sys.argv, "machine": machine_info(),
                              "status": "failed"}
    feed = make_feed(args, "now")
    with Workspace(args, "latency") as ws, CpuWatch() as cpu:
        env = continuous_env(ws, args)
        producer = ws.producer()
        pacer = Pacer(producer, feed, args.rate)
        sess = Sessionizer(ws.root, env, until_caught_up=False).start()
        progress = ws.progress_log()
        measured_from = 0.0

        def check() -> None:
            if not sess.alive():
                raise SessionizerDied(f"sessionizer exited with code {sess.proc.returncode}")

        try:
            ready_s = wait_first_commit(sess, pacer, timeout=300)
            result["first_commit_after_s"] = round(ready_s, 1)
            log(f"sessionizer committed its first batch {ready_s:.0f}s after start; warming up")
            pacer.run(args.warmup, "w", check)
            log(f"measuring: {args.rate:,.0f} events/s for {args.duration:.0f}s")
            measured_from = time.time()
            pacer.run(args.duration, "m", check)
            log("producer done; waiting for the sessionizer to catch up")
            drained = drain(sess, pacer.sent, args.drain_timeout)
            result["drain_s"] = None if drained is None else round(drained, 1)
            if drained is None:
                result["error"] = (f"the sessionizer did not catch up within "
                                   f"{args.drain_timeout:.0f}s after the producer stopped "
                                   f"(backlog {pacer.sent - sess.records_done():,} records)")
        except SessionizerDied as error:
            died = time.time()
            result["error"] = str(error)
            result["died"] = {
                "after_s_of_measurement": round(died - measured_from, 1) if measured_from
                else None,
                "backlog_records": pacer.sent - sess.records_done(),
                "produced": pacer.sent, "processed": sess.records_done()}
        finally:
            sess.stop()
            feed.close()
        result["cpu"] = cpu.report()
        batches = sess.snapshot()
        latencies, versions = pageview_commit_latencies(ws.warehouse / "pageviews")
        measured = latencies.get("m", np.array([]))
        phase_m = next((p for p in pacer.phases if p["phase"] == "m"), {})
        produced_m = feed.phase_pageviews.get("m", 0)
        result["phases"] = pacer.phases
        result["settings"] = {
            "rate": args.rate, "duration_s": args.duration, "warmup_s": args.warmup,
            "ts": "now (produce time)", "trigger_interval_s": args.trigger_interval,
            "producer_linger_ms": args.linger_ms,
            "max_events_per_trigger": args.max_events_per_trigger,
            "duplicate_fraction": args.duplicate_fraction, "bad_fraction": args.bad_fraction,
            "late_fraction": args.late_fraction, "clients": args.clients,
        }
        result["sessionizer"] = {"command": " ".join(sess.command),
                                 "exit_code": sess.proc.returncode,
                                 "env": {k: v for k, v in env.items()
                                         if k.startswith(("CLICKSTREAM_", "KAFKA_"))}}
        result["results"] = {
            "achieved_produce_rate_per_s": phase_m.get("rate_per_s"),
            "latency_measured": latency_stats(measured),
            "latency_warmup": latency_stats(latencies.get("w", np.array([]))),
            "measured_pageviews_produced": produced_m,
            "measured_pageviews_committed": len(measured),
            "batch_timing": batch_summary(batches, sess.started_at),
        }
        if len(measured):
            result["results"]["latency_by_10s_of_produce_time"] = latency_windows(
                ws.warehouse / "pageviews", measured_from)
        result["batches"] = compact_batches(batches, sess.started_at)
        result["delta_versions"] = len(versions)
        result["spark_progress"] = summarize_progress(progress.poll())[-100:]
        result["stage_breakdown"] = stage_breakdown(ws.root / "eventlog")[-10:]
        result["feed"] = dict(feed.counts, users_per_client=feed.users_per_client)
        if "error" in result:
            result["stderr_tail"] = sess.stderr_tail()
        else:
            result["status"] = "ok"
        stats = result["results"]["latency_measured"]
        if stats.get("count"):
            summary = (
                f"latency at {phase_m.get('rate_per_s', 0):,.0f} events/s produced for "
                f"{phase_m.get('seconds', 0):.0f}s: p50 {stats['p50_ms'] / 1000:.2f}s, "
                f"p95 {stats['p95_ms'] / 1000:.2f}s, p99 {stats['p99_ms'] / 1000:.2f}s, "
                f"max {stats['max_ms'] / 1000:.2f}s over {stats['count']:,} of {produced_m:,} "
                f"measured pageviews (goal p95 <= 5s)")
        else:
            summary = (f"latency at {args.rate:,.0f} events/s: no measured pageview was "
                       f"committed ({produced_m:,} produced in "
                       f"{phase_m.get('seconds', 0):.0f}s)")
        if "error" in result:
            summary += f"; FAILED: {result['error']}"
            if "died" in result:
                summary += (f" after {result['died']['after_s_of_measurement']}s of "
                            f"measurement, backlog {result['died']['backlog_records']:,}")
        return finish("latency", result, 0 if result["status"] == "ok" else 1, summary)


def latency_windows(table: Path, t0: float, window_s: float = 10.0) -> list[dict[str, Any]]:
    """p50/p95 of measured pageviews grouped by produce time window (to show a trend)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows: list[tuple[np.ndarray, np.ndarray]] = []
    for _entry, commit_ms, added in delta_commits(table):
        for rel in added:
            refs = pq.read_table(table / rel, columns=["referrer"]).column("referrer")
            refs = pc.filter(refs, pc.starts_with(refs, MARK + "m/"))
            if not len(refs):
                continue
            produced = pc.cast(pc.utf8_slice_codeunits(refs, len(MARK) + 2), "int64").to_numpy()
            rows.append((produced, (commit_ms or 0) - produced))
    if not rows:
        return []
    produced = np.concatenate([r[0] for r in rows])
    latency = np.concatenate([r[1] for r in rows])
    window = ((produced / 1000 - t0) // window_s).astype(int)
    out = []
    for w in np.unique(window):
        sel = latency[window == w]
        out.append({"from_s": int(w * window_s), "count": len(sel),
                    "p50_ms": round(percentile(sel, 50)), "p95_ms": round(percentile(sel, 95)),
                    "max_ms": int(sel.max())})
    return out


def cmd_memory(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"benchmark": "memory", "argv": sys.argv, "machine": machine_info(),
                              "status": "running"}
    out_path = results_file.result_path("memory")
    feed = make_feed(args, "simulated")
    samples: list[dict[str, Any]] = []
    with Workspace(args, "memory") as ws:
        env = continuous_env(ws, args)
        result["settings"] = {
            "minutes": args.minutes, "rate": args.rate, "time_scale": args.time_scale,
            "event_start": args.event_start.isoformat(), "ts": "simulated, compressed",
            "producer_linger_ms": args.linger_ms,
            "trigger_interval_s": args.trigger_interval,
            "max_events_per_trigger": args.max_events_per_trigger, "clients": args.clients,
            "sessions_per_user_per_day": args.sessions_per_user_per_day,
            "duplicate_fraction": args.duplicate_fraction, "bad_fraction": args.bad_fraction,
            "late_fraction": args.late_fraction, "late_seconds": args.late_seconds,
            "sample_every_s": args.sample_every,
            "env": {k: v for k, v in env.items() if k.startswith(("CLICKSTREAM_", "KAFKA_"))},
        }
        producer = ws.producer()
        pacer = Pacer(producer, feed, args.rate)
        sess = Sessionizer(ws.root, env, until_caught_up=False).start()
        result["sessionizer"] = {"command": " ".join(sess.command), "pid": sess.pid}
        progress = ws.progress_log()
        stop_sampling = threading.Event()
        measure_start = [0.0]

        def sample_loop() -> None:
            last_jstat = 0.0
            while not stop_sampling.wait(args.sample_every):
                if not sess.alive():
                    continue
                now = time.time()
                rss = tree_rss(sess.pid)
                row: dict[str, Any] = {"t_s": round(now - measure_start[0], 1), **rss}
                row.pop("jvm_pid", None)
                if now - last_jstat >= args.jstat_every:
                    heap = jvm_heap_mib(rss.get("jvm_pid"))
                    if heap:
                        row.update(heap)
                    last_jstat = now
                row["state_dir_mib"] = round(folder_bytes(ws.checkpoint / "state") / 2**20, 1)
                row["checkpoint_mib"] = round(folder_bytes(ws.checkpoint) / 2**20, 1)
                row["warehouse_files"] = sum(len(f) for _r, _d, f in os.walk(ws.warehouse))
                batches = sess.snapshot()
                done = sum(b.records for b in batches)
                row.update({"batches": len(batches), "processed": done, "produced": pacer.sent,
                            "lag": pacer.sent - done,
                            "last_batch_s": batches[-1].seconds if batches else None})
                prog = summarize_progress(progress.poll())
                if prog:
                    last = prog[-1]
                    row.update({"state_rows": last["state_rows"],
                                "state_memory_mib": round((last["state_memory_bytes"] or 0)
                                                          / 2**20, 1),
                                "watermark": last["watermark"]})
                    row.update({k: round(v / 2**20, 1)
                                for k, v in last["state_metrics"].items()})
                samples.append(row)
                result["samples"] = samples
                with contextlib.suppress(Exception):
                    write_result("memory", result, out_path)

        sampler = threading.Thread(target=sample_loop, daemon=True, name="sampler")

        def check() -> None:
            if not sess.alive():
                raise SessionizerDied(f"sessionizer exited with {sess.proc.returncode}")

        cpu = CpuWatch(every=5.0).__enter__()
        try:
            ready_s = wait_first_commit(sess, pacer, timeout=300)
            log(f"sessionizer ready after {ready_s:.0f}s; producing {args.rate:,.0f} events/s "
                f"for {args.minutes:g} min")
            measure_start[0] = time.time()
            sampler.start()
            pacer.run(args.minutes * 60, "m", check)
        except SessionizerDied as error:
            result["error"] = str(error)
            result["died"] = {"after_s_of_measurement": round(time.time() - measure_start[0], 1),
                              "backlog_records": pacer.sent - sess.records_done()}
        finally:
            stop_sampling.set()
            if sampler.is_alive():
                sampler.join(timeout=60)
            sess.stop()
            feed.close()
            result["cpu"] = cpu.report()
        result["phases"] = pacer.phases
        batches = sess.snapshot()
        result["sessionizer"]["exit_code"] = sess.proc.returncode
        result["batch_timing"] = batch_summary(batches, sess.started_at)
        result["batches"] = compact_batches(batches, sess.started_at, limit=300)
        result["feed"] = dict(feed.counts, users_per_client=feed.users_per_client,
                              generate_cpu_s=round(feed.generate_seconds, 1))
        result["spark_progress_last"] = summarize_progress(progress.poll())[-5:]
        with contextlib.suppress(Exception):
            latencies, _versions = pageview_commit_latencies(ws.warehouse / "pageviews")
            result["latency_measured"] = latency_stats(latencies.get("m", np.array([])))
            result["latency_by_minute"] = latency_windows(ws.warehouse / "pageviews",
                                                          measure_start[0], 60.0)
        if "error" in result:
            result["stderr_tail"] = sess.stderr_tail()
        result["results"] = memory_drift(samples, args)
        result["status"] = "ok" if "error" not in result else "failed"
        r = result["results"]
        if not r.get("first_window_rss_mib"):
            return finish("memory", result, 1, path=out_path)
        summary = (f"memory over {args.minutes:g} min at {args.rate:,.0f} events/s: RSS "
                   f"first {args.window_minutes:g} min avg {r['first_window_rss_mib']:.0f} MiB, "
                   f"last {args.window_minutes:g} min avg {r['last_window_rss_mib']:.0f} MiB, "
                   f"drift {r['rss_drift_pct']:+.1f}% (goal within 15%); state dir "
                   f"{r['state_dir_first_mib']} -> {r['state_dir_last_mib']} MiB"
                   f"{' [' + result['error'] + ']' if 'error' in result else ''}")
        return finish("memory", result, 0 if result["status"] == "ok" else 1, summary,
                      path=out_path)


def memory_drift(samples: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    if not samples:
        return {}
    end = samples[-1]["t_s"]
    window = args.window_minutes * 60
    first = [s for s in samples if s["t_s"] <= window]
    last = [s for s in samples if s["t_s"] > end - window]

    def avg(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(values), 1) if values else None

    out: dict[str, Any] = {"duration_s": end, "samples": len(samples)}
    for key in ("total_mib", "jvm_mib", "python_workers_mib", "driver_python_mib",
                "heap_used_mib", "state_dir_mib", "state_memory_mib", "lag"):
        a, b = avg(first, key), avg(last, key)
        out[f"{key}_first"] = a
        out[f"{key}_last"] = b
    out["first_window_rss_mib"] = out["total_mib_first"]
    out["last_window_rss_mib"] = out["total_mib_last"]
    a, b = out["total_mib_first"], out["total_mib_last"]
    out["rss_drift_pct"] = round((b - a) / a * 100, 1) if a and b else None
    out["rss_max_mib"] = max(s["total_mib"] for s in samples)
    out["state_dir_first_mib"] = out["state_dir_mib_first"]
    out["state_dir_last_mib"] = out["state_dir_mib_last"]
    return out


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def _iso(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/sessionizer_bench.py",
        description="Benchmarks of the streaming sessionizer: throughput, produce-to-Delta "
        "latency and memory over a long run. Results go to bench/results/*.json.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workdir", default=None,
                        help="parent of the temporary home/warehouse (default: system temp)")
    common.add_argument("--keep-workdir", action="store_true",
                        help="keep the tables, checkpoint and logs after the run")
    common.add_argument("--no-event-log", action="store_true",
                        help="do not enable Spark's event log (used for streaming progress)")
    common.add_argument("--partitions", type=int, default=EVENT_PARTITIONS,
                        help="partitions of the events topic (product default 16)")
    common.add_argument("--linger-ms", type=float, default=PACED_LINGER_MS,
                        help="the feeding producer's linger.ms (default: the product's paced "
                             "producers'; the embedded broker stores one batch per produce "
                             "request and reads tiny batches slowly, see kafka_broker limit 7)")
    common.add_argument("--shuffle-partitions", type=int, default=4,
                        help="CLICKSTREAM_SHUFFLE_PARTITIONS (product default 4)")
    common.add_argument("--wait-quiet", type=float, default=900, metavar="SECONDS",
                        help="first wait up to this long for the machine to be idle (other "
                        "workloads on the 2 cores skew results; 0 = do not wait)")
    common.add_argument("--max-contention-pct", type=float, default=25.0,
                        help="mark a run 'contended' when other processes used more than this "
                        "%% of the CPU capacity during it (default 25)")
    common.add_argument("--retries", type=int, default=2,
                        help="rerun a contended run up to this many times (default 2)")
    common.add_argument("--seed", type=int, default=7)
    common.add_argument("--clients", type=int, default=10)
    common.add_argument("--duplicate-fraction", type=float, default=0.02)
    common.add_argument("--bad-fraction", type=float, default=0.01)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tp = commands.add_parser(
        "throughput", parents=[common], help="events/s of sessionize --until-caught-up",
        description="Pre-produce generated events, then time `clickstream sessionize "
        "--until-caught-up`. The embedded broker keeps ~5 MiB per partition (about 1M of "
        "these events over 16 partitions); the run fails if anything was dropped.")
    tp.add_argument("--events", type=int, default=900_000,
                    help="cap on generated records (default 900,000: what fits the embedded "
                    "broker's 16 partitions)")
    tp.add_argument("--users", type=int, default=5000, help="users per client")
    tp.add_argument("--minutes", type=float, default=3600,
                    help="event-time span of the generated data (default 2.5 days)")
    tp.add_argument("--sessions-per-user-per-day", type=float, default=2.0)
    tp.add_argument("--late-fraction", type=float, default=0.01)
    tp.add_argument("--max-events-per-trigger", type=int,
                    default=Config.max_events_per_trigger,
                    help="CLICKSTREAM_MAX_EVENTS_PER_TRIGGER (default: the product's, "
                    f"{Config.max_events_per_trigger:,})")
    tp.add_argument("--timeout", type=float, default=1800, help="give up after this many s")
    tp.set_defaults(handler=cmd_throughput)

    st = commands.add_parser(
        "stages", parents=[common], help="time the plan's pieces with a no-op sink",
        description="Pre-produce the throughput data, then time (in this process) the Kafka "
        "source, source + parse, build_stream (both branches with the stateful operator, reads "
        "shared and not) with a no-op sink, a from_json reference, and two floors (store each "
        "pageview once; and sessions of each micro-batch alone) with foreachBatch sinks.")
    for action in tp._actions:
        if action.dest in ("events", "users", "minutes", "sessions_per_user_per_day",
                           "late_fraction", "max_events_per_trigger"):
            st._add_action(action)
    st.add_argument("--repeat", type=_positive_int, default=1,
                    help="run the measured variants this many times, alternating their order; "
                    "the summary gives each variant's median (default 1)")
    st.set_defaults(handler=cmd_stages)

    continuous = argparse.ArgumentParser(add_help=False)
    continuous.add_argument("--rate", type=float, default=20_000, help="events/s to produce")
    continuous.add_argument("--trigger-interval", type=float, default=1.0,
                            help="CLICKSTREAM_TRIGGER_INTERVAL in seconds")
    continuous.add_argument("--max-events-per-trigger", type=int,
                            default=Config.max_events_per_trigger)
    continuous.add_argument("--driver-memory", default=None, metavar="SIZE",
                            help="CLICKSTREAM_DRIVER_MEMORY of the sessionizer (default: the "
                                 "product's, 4g)")
    continuous.add_argument("--sessions-per-user-per-day", type=float, default=6.0)
    continuous.add_argument("--late-fraction", type=float, default=0.001)
    continuous.add_argument("--late-seconds", type=float, default=20.0,
                            help="wall-clock delay of late records")

    lat = commands.add_parser(
        "latency", parents=[common, continuous], help="produce-to-commit latency in pageviews",
        description="Produce at a steady rate with ts = now while `clickstream sessionize` "
        "runs; latency = commit time of the pageviews version holding a pageview - its "
        "produce time.")
    lat.add_argument("--duration", type=float, default=120, help="measured seconds")
    lat.add_argument("--warmup", type=float, default=20,
                     help="seconds at full rate after the first commit, not measured")
    lat.add_argument("--drain-timeout", type=float, default=300)
    lat.add_argument("--time-scale", type=float, default=60,
                     help="event-time compression used to simulate users (ts is still now)")
    lat.set_defaults(handler=cmd_latency)

    state = commands.add_parser(
        "state", parents=[common], help="per-call cost of the session state at steady state",
        description="Fill one user bucket's session state with --history-minutes of realistic "
        "sessions, then time the processor's calls for --batches micro-batches (no Spark).")
    state.add_argument("--rate", type=float, default=5_000, help="events/s of the whole stream")
    state.add_argument("--buckets", type=int, default=16, help="state buckets (product: 16)")
    state.add_argument("--batch-seconds", type=float, default=5.0)
    state.add_argument("--history-minutes", type=float, default=60.0)
    state.add_argument("--batches", type=int, default=120,
                       help="timed micro-batches; enough to show a cost that grows per call")
    state.add_argument("--pageviews-per-session", type=float, default=8.0)
    state.set_defaults(handler=cmd_state)

    tws = commands.add_parser(
        "tws-input", parents=[common], help="the state operator's input reader, both ways",
        description="Time PySpark's row-by-row transformWithStateInPandas input reader and "
        "the product's key-run reader on the same Arrow stream (no Spark).")
    tws.add_argument("--rows", type=int, default=200_000)
    tws.add_argument("--repeat", type=int, default=3)
    tws.set_defaults(handler=cmd_tws_input)

    mem = commands.add_parser(
        "memory", parents=[common, continuous], help="RSS and state size over a long run",
        description="Run the sessionizer for --minutes under a steady stream whose event time "
        "advances --time-scale times faster than the clock; sample RSS of its process tree "
        "and the state size.")
    mem.add_argument("--minutes", type=float, default=20)
    mem.add_argument("--window-minutes", type=float, default=5,
                     help="compare the average of the first and last windows of this length")
    mem.add_argument("--time-scale", type=float, default=60,
                     help="event seconds per wall second (60: 20 min = 20 h of event time)")
    mem.add_argument("--event-start", type=_iso, default=_iso("2026-11-01T00:00:00+00:00"))
    mem.add_argument("--sample-every", type=float, default=10.0)
    mem.add_argument("--jstat-every", type=float, default=30.0)
    mem.set_defaults(handler=cmd_memory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    MAX_CONTENTION_PCT[0] = args.max_contention_pct
    code = 1
    for attempt in range(1, args.retries + 2):
        QUIET.clear()
        LAST_RESULT.clear()
        if args.wait_quiet > 0:
            log(f"waiting up to {args.wait_quiet:.0f}s for the machine to be idle")
            QUIET.update(wait_for_quiet(args.wait_quiet))
            log(f"quiet check: {QUIET}")
        try:
            code = int(args.handler(args))
        except KeyboardInterrupt:
            print(f"{args.command}: interrupted", file=sys.stderr)
            return 130
        other = (LAST_RESULT.get("cpu") or {}).get("other_processes_pct_of_capacity")
        if other is None or other <= args.max_contention_pct:
            break
        log(f"attempt {attempt}: other processes used {other}% of the CPU capacity during the "
            f"run (limit {args.max_contention_pct}%); the result is marked contended"
            + ("; retrying" if attempt <= args.retries else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
