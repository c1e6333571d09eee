"""Benchmark of issue #3: a year of late orders backfilled into one client's tables.

What it measures (BRIEF.md, "Quality bars"; BENCHMARKS.md, "Backfill (issue #3)"):

1. **Setup (not timed against the goals, but reported):** an embedded Kafka-protocol broker
   (``clickstream.io.kafka_broker.EmbeddedBroker``), one year of pageviews of the benchmark
   client (``client-00``) plus smaller histories (pageviews and orders) of two other clients,
   generated with ``clickstream.jobs.generate.simulate`` and loaded with the product's own
   ``run_backfill(kind="pageviews" | "orders")`` from Parquet in the landing folder. The
   pre-backfill warehouse is then frozen (copied) so every timed run starts from the same state.
2. **Backfill:** the client's year of orders (Parquet in the landing folder) through
   ``run_backfill(kind="orders")``: validate -> merge -> recompute the affected sessions and
   attributions -> record corrections -> apply -> publish to Kafka. Wall time of the call plus
   the product's own per-step timings.
3. **Baseline:** on an identical copy of the pre-backfill warehouse, the same orders merged
   with the same product functions (``validate_batch`` + ``merge_orders``), then the
   delete-and-rewrite ``run_full_recompute(config, client_id=...)``.
4. **DuckDB reference:** the same recompute as SQL (window functions for sessions, an
   as-of interval join for attributions) on the same Parquet files (the client's active
   ``pageviews`` and ``orders`` files from the Delta log), ``threads=2``, written to Parquet.
   Its result is also compared with the product's ``sessions`` table (a correctness check).
5. **Bytes:** affected partitions = the (client_id, date) partitions of ``sessions``,
   ``attributions`` and ``orders`` whose files the backfill removed or added (Delta log diff
   between the versions before and after the run); their bytes = total size of their files
   before the backfill (and after, for reference). Bytes read by the backfill: see
   "Bytes read" below.

Each timed phase runs in its own Python process with its own Spark JVM (``local[2]``), so no
phase benefits from another's JIT warm-up or cached DataFrames; the broker runs in this
process. Spark start-up is measured separately and excluded from the job wall times.

Bytes read, three views (each phase reports all three):

* ``hadoop_fs_bytes_read`` (primary): the JVM's Hadoop FileSystem statistics for the ``file``
  scheme (``FileSystem.getAllStatistics()``), before vs after. Every Parquet read Spark does
  (input batch, Delta data files, footers) goes through it; it counts bytes actually read
  (after column pruning), not cached DataFrame blocks, not shuffle files, not jars. Caveat,
  measured: parquet-java's vectored reads (on by default in Spark 4.2) bypass these counters
  (only footers are counted). So the primary number comes from a separate, untimed "bytes
  run": the same backfill on a third copy of the pre-backfill state with
  ``parquet.hadoop.vectored.io.enabled=false``; the timed run keeps the default.
* ``scan_file_bytes``: the sum over all SQL executions of the file-scan metric "size of files
  read" (the size of the files each scan selected, column pruning ignored; a file scanned by
  two queries counts twice), per table, from Spark's SQL status store. Spark prints it with
  one decimal (e.g. "12.3 MiB"), so it is precise to ~2.5%.
* ``delta_rs_bytes``: delta-rs (Rust, in the Python driver) reads the merge target itself;
  counted as the size of the target files inside the merge's partition scope before the run.
  Delta log reads (small JSON, on every table load) are not counted.

``/proc/<pid>/io`` ``rchar`` of the JVM and the Python driver is recorded too, as a
diagnostic only: it also counts socket traffic (Py4J, Arrow transfers to Python workers),
shuffle files and jars, so it is an upper bound, not the "bytes read from tables" the goal
means. ``read_bytes`` is useless here: everything sits in the page cache.

Usage:
    .venv/bin/python bench/backfill_bench.py --scale small
    .venv/bin/python bench/backfill_bench.py --scale full --workdir /tmp/backfill-bench
    .venv/bin/python bench/backfill_bench.py --markdown bench/results/backfill-full-....json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from proc_cpu import process_tree
from results_file import REPO, git_dirty, git_head, source_sha256, write_result

BENCHMARKS_MD = REPO / "BENCHMARKS.md"
CLIENT = "client-00"
OTHER_CLIENTS = ("client-01", "client-02")
SEED = 2026
TABLES_OF_INTEREST = ("sessions", "attributions", "orders")
GOALS = {"backfill_vs_full": 0.2, "bytes_read_vs_affected": 1.5, "gates_share_of_backfill": 0.15}
OTHER_BENCH_PATTERN = "sessionizer_bench"
CHANGELOG_PARTITIONS = {"bench-sessions": 512, "bench-attributions": 256}
# Every phase's Spark (local mode: executors inside the driver JVM) gets the same memory.
DRIVER_MEMORY = "8g"
COPIES = ("warehouse-backfill", "warehouse-baseline", "warehouse-backfill-bytes")


@dataclass(frozen=True)
class BenchScale:
    """Data volume: the benchmark client's year, and each other client's."""

    name: str
    users: int
    sessions_per_user_per_day: float
    order_probability: float
    other_users: int
    other_sessions_per_user_per_day: float
    days: int = 365


SCALES = {
    # ~0.44M pageviews / ~22k orders of client-00: validates the harness in a few minutes.
    "small": BenchScale("small", users=300, sessions_per_user_per_day=1.0,
                        order_probability=0.2, other_users=60,
                        other_sessions_per_user_per_day=0.5),
    # ~10.5M pageviews / ~0.52M orders of client-00 (the bar: >= 10M and >= 500k);
    # pages per session are 1 + Geometric(0.25) - 1 capped at 40 (mean ~4).
    "full": BenchScale("full", users=7200, sessions_per_user_per_day=1.0,
                       order_probability=0.2, other_users=700,
                       other_sessions_per_user_per_day=0.5),
}


def log(message: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


OTHER_PATTERNS = [OTHER_BENCH_PATTERN]


def other_benchmarks() -> list[str]:
    """Command lines of other benchmark processes running now (they share the 2 cores);
    this benchmark's own processes are not counted."""
    lines: list[str] = []
    for pattern in OTHER_PATTERNS:
        found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True,
                               check=False).stdout.splitlines()
        lines += [line for line in found if "pgrep" not in line and "backfill_bench" not in line
                  and line not in lines]
    return lines


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    hz = os.sysconf("SC_CLK_TCK")
    return (total - idle) / hz, total / hz


def own_cpu() -> float:
    """CPU seconds of this process and its reaped children (the phase processes, their JVMs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def tree_cpu() -> dict[tuple[int, int], float]:
    """CPU seconds of this process and each live descendant (the phase processes and their
    Spark JVMs), by (pid, start time); see ``proc_cpu.process_tree``."""
    return {key: cpu_s for key, (_, cpu_s) in process_tree(os.getpid()).items()}


def busy_share(window_s: float = 5.0) -> float:
    """Share of the machine's CPU capacity used by others during ``window_s``."""
    b0, t0 = machine_cpu()
    own0 = own_cpu()
    time.sleep(window_s)
    b1, t1 = machine_cpu()
    return max(0.0, (b1 - b0) - (own_cpu() - own0)) / max(t1 - t0, 1e-9)


MAX_WAIT_CPU_S = [1200.0]


def wait_until_idle(max_wait_s: float, quiet_s: float = 60, cpu_threshold: float = 0.15
                    ) -> dict[str, Any]:
    """Wait (up to ``max_wait_s``) until no other benchmark has run for ``quiet_s`` seconds
    (a queue of benchmarks leaves short gaps between its commands), then (up to
    ``MAX_WAIT_CPU_S`` more) until the machine's CPU is nearly idle (others below
    ``cpu_threshold`` of capacity over 3 x 5 s); report what was seen."""
    started = time.monotonic()
    quiet_since = None
    cpu_wait_started = None
    seen = other_benchmarks()
    share = None
    idle = False
    while time.monotonic() - started < max_wait_s:
        if seen:
            quiet_since = cpu_wait_started = None
            log(f"waiting for other benchmarks to finish: {seen[:2]}")
            time.sleep(30)
        else:
            quiet_since = quiet_since or time.monotonic()
            cpu_wait_started = cpu_wait_started or time.monotonic()
            share = max(busy_share() for _ in range(3))
            if time.monotonic() - quiet_since >= quiet_s and share < cpu_threshold:
                idle = True
                break
            if time.monotonic() - cpu_wait_started >= MAX_WAIT_CPU_S[0]:
                log(f"no other benchmark, but others still use {share:.0%} of the CPU; "
                    "starting anyway (recorded)")
                break
            if share >= cpu_threshold:
                log(f"waiting for the machine to be idle: others use {share:.0%} of the CPU")
                time.sleep(15)
        seen = other_benchmarks()
    return {"waited_s": round(time.monotonic() - started, 1), "idle": idle,
            "others_running": seen,
            "others_cpu_share_before": None if share is None else round(share, 3),
            "loadavg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}


class BusyWatcher:
    """While a timed phase runs: other benchmarks seen, load average, and the CPU seconds the
    rest of the machine used (machine busy time minus this process tree's, the tree sampled
    every second so that processes ending before the phase are counted as ours)."""

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(1):
            self._tree.update(tree_cpu())
            ticks += 1
            if ticks % 10 == 0:
                self.samples.append({"others": len(other_benchmarks()),
                                     "loadavg_1m": os.getloadavg()[0]})

    def __enter__(self) -> BusyWatcher:
        self._tree0 = tree_cpu()
        self._tree = dict(self._tree0)
        self._machine0, self._t0 = machine_cpu(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._tree.update(tree_cpu())
        b1, t1 = machine_cpu()
        self.wall = time.monotonic() - self._t0
        self.capacity = t1 - self._machine0[1]
        self.own = sum(cpu - self._tree0.get(key, 0.0) for key, cpu in self._tree.items())
        self.others = max(0.0, (b1 - self._machine0[0]) - self.own)

    def summary(self) -> dict[str, Any]:
        return {"samples": len(self.samples),
                "other_benchmark_seen": any(s["others"] for s in self.samples),
                "max_loadavg_1m": max((s["loadavg_1m"] for s in self.samples), default=None),
                "own_cpu_s": round(self.own, 1), "others_cpu_s": round(self.others, 1),
                "others_cpu_share": round(self.others / max(self.capacity, 1e-9), 3)}


# ------------------------------------------------------------------------------------------
# Delta log helpers (deltalake, no Spark)
# ------------------------------------------------------------------------------------------


def active_files(table_path: Path, version: int | None = None) -> list[dict[str, Any]]:
    """Active files of a Delta table: path (as in the log), size, partition values."""
    import pyarrow as pa
    from deltalake import DeltaTable

    if version is not None and version < 0:
        return []
    table = DeltaTable(str(table_path), version=version)
    actions = pa.table(table.get_add_actions(flatten=True))
    parts = [c for c in actions.schema.names if c.startswith("partition.")]
    rows = actions.select(["path", "size_bytes", *parts]).to_pydict()
    return [{"path": rows["path"][i], "size": int(rows["size_bytes"][i]),
             "partition": tuple((c.removeprefix("partition."), _as_text(rows[c][i]))
                                for c in parts)}
            for i in range(actions.num_rows)]


def _as_text(value: Any) -> str | None:
    return None if value is None else str(value)


def table_version(table_path: Path) -> int:
    from deltalake import DeltaTable

    return DeltaTable(str(table_path)).version() if DeltaTable.is_deltatable(
        str(table_path)) else -1


def client_files(table_path: Path, client: str) -> list[str]:
    """Absolute paths of one client's active files (for DuckDB)."""
    from urllib.parse import unquote

    return [str(table_path / unquote(f["path"])) for f in active_files(table_path)
            if dict(f["partition"]).get("client_id") == client]


def affected_partitions(table_path: Path, before: int, after: int) -> dict[str, Any]:
    """Partitions whose files changed between two versions, and their bytes before/after."""
    old = {f["path"]: f for f in active_files(table_path, before)}
    new = {f["path"]: f for f in active_files(table_path, after)}
    removed = [old[p] for p in old.keys() - new.keys()]
    added = [new[p] for p in new.keys() - old.keys()]
    touched = {f["partition"] for f in removed + added}
    clients = sorted({dict(p).get("client_id") for p in touched}, key=str)
    return {
        "version_before": before, "version_after": after,
        "partitions": len(touched), "clients": clients,
        "files_removed": len(removed), "files_added": len(added),
        "bytes_before": sum(f["size"] for f in old.values() if f["partition"] in touched),
        "bytes_after": sum(f["size"] for f in new.values() if f["partition"] in touched),
        "table_bytes_before": sum(f["size"] for f in old.values()),
        "client_bytes_before": sum(f["size"] for f in old.values()
                                   if dict(f["partition"]).get("client_id") == CLIENT),
    }


def scope_bytes(table_path: Path, version: int, client: str) -> int:
    """Bytes of one client's files at a version (what the partition-scoped orders upsert may
    read on the driver, outside Spark's counters)."""
    return sum(f["size"] for f in active_files(table_path, version)
               if dict(f["partition"]).get("client_id") == client)


# ------------------------------------------------------------------------------------------
# Phases that run in their own process with their own Spark JVM
# ------------------------------------------------------------------------------------------


def _config(state: dict[str, Any], warehouse: str):
    from clickstream.config import Config

    return Config(warehouse=Path(warehouse), home=Path(state["workdir"]) / "home",
                  landing=Path(state["workdir"]) / "landing",
                  kafka_bootstrap_servers=state["bootstrap"], spark_master="local[2]",
                  driver_memory=DRIVER_MEMORY, sessions_topic="bench-sessions",
                  attributions_topic="bench-attributions")


def _proc_io(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


class SparkProbe:
    """Counters of one Spark JVM: Hadoop FS bytes, /proc io, SQL executions."""

    SIZE = re.compile(r"([\d.,]+)\s*(B|KiB|MiB|GiB|TiB)\b")
    UNITS: ClassVar[dict[str, int]] = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
                                       "TiB": 2**40}

    def __init__(self, spark) -> None:
        self.spark = spark
        self.jvm = spark._jvm
        self.jvm_pid = int(self.jvm.java.lang.ProcessHandle.current().pid())
        self.store = spark._jsparkSession.sharedState().statusStore()

    def hadoop_bytes_read(self) -> int:
        total = 0
        for stats in self.jvm.org.apache.hadoop.fs.FileSystem.getAllStatistics():
            if stats.getScheme() == "file":
                total += int(stats.getBytesRead())
        return total

    def drain(self) -> None:
        self.spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()

    def last_execution_id(self) -> int:
        last = -1
        iterator = self.store.executionsList().iterator()
        while iterator.hasNext():
            last = max(last, int(iterator.next().executionId()))
        return last

    def snapshot(self) -> dict[str, Any]:
        self.drain()
        return {"t": time.monotonic(), "hadoop_fs_bytes_read": self.hadoop_bytes_read(),
                "jvm_io": _proc_io(self.jvm_pid), "python_io": _proc_io(os.getpid()),
                "last_execution": self.last_execution_id()}

    def _size(self, text: str | None) -> int:
        if not text:
            return 0
        body = text.split("\n", 1)[1] if "\n" in text else text
        match = self.SIZE.search(body)
        if not match:
            return 0
        return int(float(match.group(1).replace(",", "")) * self.UNITS[match.group(2)])

    def executions(self, after_id: int) -> list[dict[str, Any]]:
        """SQL executions after ``after_id``: call site, duration, files scanned per table."""
        out = []
        iterator = self.store.executionsList().iterator()
        while iterator.hasNext():
            execution = iterator.next()
            eid = int(execution.executionId())
            if eid <= after_id:
                continue
            completion = execution.completionTime()
            ended = int(completion.get().getTime()) if completion.isDefined() else None
            submitted = int(execution.submissionTime())
            values: dict[int, str] = {}
            metric_iterator = self.store.executionMetrics(eid).iterator()
            while metric_iterator.hasNext():
                pair = metric_iterator.next()
                values[int(pair._1())] = str(pair._2())
            scans: dict[str, dict[str, int]] = {}
            nodes = self.store.planGraph(eid).allNodes().iterator()
            while nodes.hasNext():
                node = nodes.next()
                if not str(node.name()).startswith("Scan "):
                    continue
                table = _table_of(str(node.desc()))
                metrics = {}
                metric_nodes = node.metrics().iterator()
                while metric_nodes.hasNext():
                    metric = metric_nodes.next()
                    metrics[str(metric.name())] = values.get(int(metric.accumulatorId()))
                entry = scans.setdefault(table, {"scans": 0, "files": 0, "bytes": 0})
                entry["scans"] += 1
                entry["bytes"] += self._size(metrics.get("size of files read"))
                files = re.search(r"[\d,]+", (metrics.get("number of files read") or "")
                                  .split("\n")[-1])
                entry["files"] += int(files.group(0).replace(",", "")) if files else 0
            out.append({"id": eid, "description": str(execution.description())[:160],
                        "seconds": None if ended is None else (ended - submitted) / 1000,
                        "scans": scans})
        return out


def _table_of(desc: str) -> str:
    match = re.search(r"/(warehouse[\w.-]*)/([\w-]+)/", desc)
    if match:
        return match.group(2)
    if "/landing/" in desc:
        return "landing batch"
    return "other"


def _delta(before: dict[str, Any], after: dict[str, Any], probe: SparkProbe) -> dict[str, Any]:
    executions = probe.executions(before["last_execution"])
    per_table: dict[str, dict[str, int]] = {}
    for execution in executions:
        for table, entry in execution["scans"].items():
            total = per_table.setdefault(table, {"scans": 0, "files": 0, "bytes": 0})
            for key in total:
                total[key] += entry[key]
    by_site: dict[str, dict[str, float]] = {}
    for execution in executions:
        site = execution["description"]
        entry = by_site.setdefault(site, {"executions": 0, "seconds": 0.0})
        entry["executions"] += 1
        entry["seconds"] += execution["seconds"] or 0.0
    top_sites = sorted(({"call_site": k, **v} for k, v in by_site.items()),
                       key=lambda e: -e["seconds"])[:15]

    def io_delta(key: str) -> dict[str, int]:
        return {k: after[key].get(k, 0) - before[key].get(k, 0)
                for k in ("rchar", "read_bytes", "wchar", "write_bytes")}

    return {
        "hadoop_fs_bytes_read": after["hadoop_fs_bytes_read"] - before["hadoop_fs_bytes_read"],
        "scan_file_bytes_by_table": per_table,
        "scan_file_bytes": sum(e["bytes"] for e in per_table.values()),
        "jvm_proc_io": io_delta("jvm_io"), "python_proc_io": io_delta("python_io"),
        "sql_executions": len(executions),
        "sql_seconds_total": round(sum(e["seconds"] or 0 for e in executions), 1),
        "top_call_sites": top_sites,
        "executions": executions,  # per SQL execution: call site, seconds, files per table
    }


def _versions(config) -> dict[str, int]:
    return {name: table_version(config.table_path(name))
            for name in ("pageviews", "orders", "sessions", "attributions", "corrections",
                         "quarantine")}


def _start_spark(config) -> tuple[Any, float]:
    from clickstream.spark_session import build_spark

    started = time.monotonic()
    spark = build_spark(config, "backfill-bench")
    spark.range(1).count()
    return spark, time.monotonic() - started


def _progress(lines: list[dict[str, Any]], origin: float):
    def progress(message: str) -> None:
        lines.append({"t": round(time.monotonic() - origin, 2), "line": message})
        log(f"    | {message}")

    return progress


def phase_load(state: dict[str, Any]) -> dict[str, Any]:
    """Setup: the pageviews (and the other clients' orders) through ``run_backfill``."""
    from clickstream.jobs.backfill import run_backfill

    config = _config(state, state["warehouse"])
    spark, spark_start = _start_spark(config)
    loads = []
    for item in state["loads"]:
        lines: list[dict[str, Any]] = []
        started = time.monotonic()
        log(f"  load {item['kind']} of {item['client']} from {item['path']}")
        summary = run_backfill(config, kind=item["kind"], client_id=item["client"],
                               path=item["path"], spark=spark,
                               progress=_progress(lines, started))
        loads.append({**item, "seconds": round(time.monotonic() - started, 1),
                      "rows_read": summary.rows_read, "rows_merged": summary.rows_merged,
                      "steps": summary.seconds_by_step,
                      "correction_steps": summary.corrections.seconds_by_step,
                      "corrections": _corrections(summary.corrections), "progress": lines})
        log(f"  loaded in {loads[-1]['seconds']:.1f}s")
    spark.stop()
    return {"spark_start_s": round(spark_start, 1), "loads": loads}


def _corrections(summary) -> dict[str, Any]:
    data = asdict(summary)
    data.pop("seconds_by_step", None)
    return data


def phase_backfill(state: dict[str, Any]) -> dict[str, Any]:
    """Timed: ``run_backfill(kind="orders")`` on the frozen pre-backfill state."""
    from clickstream.jobs.backfill import run_backfill

    config = _config(state, state["warehouse"])
    spark, spark_start = _start_spark(config)
    if not state.get("vectored_io", True):
        _disable_vectored_io(spark)
    probe = SparkProbe(spark)
    versions_before = _versions(config)
    merge_scope = scope_bytes(config.table_path("orders"), versions_before["orders"], CLIENT)
    lines: list[dict[str, Any]] = []
    before = probe.snapshot()
    started = time.monotonic()
    summary = run_backfill(config, kind="orders", client_id=CLIENT, path=state["orders_path"],
                           spark=spark, progress=_progress(lines, started))
    wall = time.monotonic() - started
    after = probe.snapshot()
    result = {
        "spark_start_s": round(spark_start, 1), "wall_s": round(wall, 2),
        "steps": summary.seconds_by_step, "correction_steps": summary.corrections.seconds_by_step,
        "rows_read": summary.rows_read, "rows_merged": summary.rows_merged,
        "corrections": _corrections(summary.corrections), "describe": summary.describe(),
        "progress": lines, "versions_before": versions_before, "versions_after": _versions(config),
        "io": {**_delta(before, after, probe), "delta_rs_merge_scope_bytes": merge_scope},
    }
    spark.stop()
    return result


def _disable_vectored_io(spark) -> None:
    """Parquet vectored reads (parquet-java's default here) bypass Hadoop's FileSystem
    byte counters; with them off every byte Spark reads from a Parquet file is counted."""
    spark.sparkContext._jsc.hadoopConfiguration().set("parquet.hadoop.vectored.io.enabled",
                                                      "false")
    spark.conf.set("spark.hadoop.parquet.hadoop.vectored.io.enabled", "false")


def phase_baseline(state: dict[str, Any]) -> dict[str, Any]:
    """Timed: the same merge, then a delete-and-rewrite full recompute of the client."""
    from pyspark.sql import functions as F

    from clickstream.io.delta_tables import open_tables
    from clickstream.jobs.backfill import merge_orders
    from clickstream.jobs.batch_input import (
        list_batch_files,
        read_batch,
        valid_rows,
        validate_batch,
    )
    from clickstream.jobs.recompute import run_full_recompute

    config = _config(state, state["warehouse"])
    spark, spark_start = _start_spark(config)
    probe = SparkProbe(spark)
    versions_before = _versions(config)
    merge_scope = scope_bytes(config.table_path("orders"), versions_before["orders"], CLIENT)
    before = probe.snapshot()
    started = time.monotonic()
    tables = open_tables(config, spark)
    files = list_batch_files(config, state["orders_path"])
    run_id = f"orders-{CLIENT}-{files.fingerprint}"
    batch = validate_batch(read_batch(spark, files, "orders"), "orders", CLIENT,
                           config.max_ts_ahead_ms).persist()
    rows_read = batch.count()
    bad = batch.where(F.col("error").isNotNull()).count()
    valid = valid_rows(batch, "orders").persist()
    valid.count()
    validated = time.monotonic()
    merged = merge_orders(tables, valid, CLIENT, run_id)
    merge_done = time.monotonic()
    batch.unpersist()
    valid.unpersist()
    mid = probe.snapshot()
    full = run_full_recompute(config, client_id=CLIENT, spark=spark)
    ended = time.monotonic()
    after = probe.snapshot()
    result = {
        "spark_start_s": round(spark_start, 1), "wall_s": round(ended - started, 2),
        "validate_s": round(validated - started, 2), "merge_s": round(merge_done - validated, 2),
        "full_recompute_s": round(ended - merge_done, 2), "rows_read": rows_read,
        "rows_quarantined": bad, "rows_merged": merged, "describe": full.describe(),
        "sessions": full.sessions, "attributions": full.attributions,
        "versions_before": versions_before, "versions_after": _versions(config),
        "io": {**_delta(before, after, probe), "delta_rs_merge_scope_bytes": merge_scope},
        "io_full_recompute_only": _delta(mid, after, probe),
    }
    spark.stop()
    return result


PHASES = {"load": phase_load, "backfill": phase_backfill, "baseline": phase_baseline,
          "backfill-bytes": phase_backfill}


def run_phase(name: str, state: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one phase in a child process (own interpreter, own Spark JVM)."""
    state_file = workdir / f"phase-{name}-in.json"
    out_file = workdir / f"phase-{name}-out.json"
    state_file.write_text(json.dumps(state))
    out_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, __file__, "--phase", name, str(state_file),
                                str(out_file)], env=env)
    try:
        code = process.wait()
    except BaseException:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    if code != 0 or not out_file.exists():
        raise SystemExit(f"phase {name} failed with exit code {code}")
    result = json.loads(out_file.read_text())
    result["process_s"] = round(time.monotonic() - started, 1)
    return result


# ------------------------------------------------------------------------------------------
# DuckDB reference
# ------------------------------------------------------------------------------------------


DUCKDB_SESSIONS = """
CREATE TEMP TABLE sessions AS
WITH pv AS (
    SELECT client_id, user_id, event_id, epoch_ms(ts) AS ts_ms, url
    FROM read_parquet($pageviews, hive_partitioning = true)
), marked AS (
    SELECT *, CASE WHEN lag(ts_ms) OVER w IS NULL OR ts_ms - lag(ts_ms) OVER w >= $gap_ms
                   THEN 1 ELSE 0 END AS starts
    FROM pv WINDOW w AS (PARTITION BY client_id, user_id ORDER BY ts_ms, event_id)
), numbered AS (
    SELECT *, sum(starts) OVER (PARTITION BY client_id, user_id ORDER BY ts_ms, event_id
                                ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS session_no
    FROM marked
)
SELECT client_id, user_id, session_no, min(ts_ms) AS start_ms, max(ts_ms) AS end_ms,
       count(*) AS pageview_count,
       first(url ORDER BY ts_ms, event_id) AS landing_url,
       last(url ORDER BY ts_ms, event_id) AS exit_url,
       substr(sha256(concat_ws(chr(31), 'v1', client_id, user_id,
                               CAST(min(ts_ms) AS VARCHAR))), 1, 32) AS session_id
FROM numbered GROUP BY client_id, user_id, session_no
"""

# Attribution: same user, session_start <= order.ts < session_end + gap. A user's windows
# never overlap (semantics E5), so the interval join is an as-of join on start plus the end
# check: each order meets at most one candidate session.
DUCKDB_ATTRIBUTIONS = """
CREATE TEMP TABLE attributions AS
WITH o AS (
    SELECT order_id, client_id, user_id, epoch_ms(ts) AS ts_ms, amount
    FROM read_parquet($orders, hive_partitioning = true)
)
SELECT o.order_id, o.client_id, o.user_id, o.ts_ms, o.amount,
       CASE WHEN o.ts_ms < s.end_ms + $gap_ms THEN s.session_id END AS session_id
FROM o ASOF LEFT JOIN sessions s
  ON o.client_id = s.client_id AND o.user_id = s.user_id AND o.ts_ms >= s.start_ms
"""

DUCKDB_WRITE_SESSIONS = """
COPY (
    SELECT s.session_id, s.client_id, s.user_id, make_timestamp(s.start_ms * 1000)
           AS session_start, make_timestamp(s.end_ms * 1000) AS session_end,
           s.pageview_count, s.landing_url, s.exit_url,
           coalesce(a.order_count, 0) AS order_count,
           coalesce(a.revenue, 0)::DECIMAL(20, 4) AS revenue,
           CAST(make_timestamp(s.start_ms * 1000) AS DATE) AS session_date
    FROM sessions s LEFT JOIN (
        SELECT session_id, count(*) AS order_count, sum(amount) AS revenue
        FROM attributions WHERE session_id IS NOT NULL GROUP BY session_id
    ) a USING (session_id)
) TO '{path}' (FORMAT parquet)
"""

DUCKDB_WRITE_ATTRIBUTIONS = """
COPY (
    SELECT order_id, client_id, user_id, make_timestamp(ts_ms * 1000) AS order_ts, session_id,
           CAST(make_timestamp(ts_ms * 1000) AS DATE) AS order_date
    FROM attributions
) TO '{path}' (FORMAT parquet)
"""


def duckdb_reference(pageview_files: list[str], order_files: list[str], out: Path,
                     gap_ms: int, threads: int = 2) -> dict[str, Any]:
    import duckdb

    out.mkdir(parents=True, exist_ok=True)
    steps: dict[str, float] = {}
    started = time.monotonic()
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.execute("SET preserve_insertion_order = false")
    mark = time.monotonic()
    con.execute(DUCKDB_SESSIONS, {"pageviews": pageview_files, "gap_ms": gap_ms})
    steps["sessionize"] = time.monotonic() - mark
    mark = time.monotonic()
    con.execute(DUCKDB_ATTRIBUTIONS, {"orders": order_files, "gap_ms": gap_ms})
    steps["attribute"] = time.monotonic() - mark
    mark = time.monotonic()
    con.execute(DUCKDB_WRITE_SESSIONS.format(path=out / "sessions.parquet"))
    con.execute(DUCKDB_WRITE_ATTRIBUTIONS.format(path=out / "attributions.parquet"))
    steps["write parquet"] = time.monotonic() - mark
    wall = time.monotonic() - started
    counts = con.execute(
        "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM attributions), "
        "(SELECT count(*) FROM attributions WHERE session_id IS NOT NULL)").fetchone()
    con.close()
    return {"wall_s": round(wall, 2), "steps": {k: round(v, 2) for k, v in steps.items()},
            "threads": threads, "sessions": counts[0], "orders": counts[1],
            "orders_attributed": counts[2],
            "input_bytes": sum(os.path.getsize(p) for p in pageview_files + order_files),
            "output_bytes": folder_bytes(out)}


def compare_results(duck_out: Path, backfill_wh: Path, baseline_wh: Path) -> dict[str, Any]:
    """Not timed: DuckDB vs the backfilled tables, and backfill vs full recompute."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET threads = 2")
    out: dict[str, Any] = {}
    columns = ("session_start", "session_end", "pageview_count", "landing_url", "exit_url",
               "order_count", "revenue")
    differs = " OR ".join(f"a.{c} IS DISTINCT FROM b.{c}" for c in columns)

    def compare(left: str, right: str, key: str, differs: str) -> dict[str, Any]:
        """Rows only on the left, only on the right, and on both sides but different."""
        row = con.execute(
            f"SELECT count(*) FILTER (WHERE b.{key} IS NULL), "
            f"count(*) FILTER (WHERE a.{key} IS NULL), "
            f"count(*) FILTER (WHERE a.{key} IS NOT NULL AND b.{key} IS NOT NULL "
            f"AND ({differs})), count(*) "
            f"FROM {left} a FULL OUTER JOIN {right} b USING ({key})").fetchone()
        return {"only_left": row[0], "only_right": row[1], "different": row[2],
                "rows": row[3], "equal": row[0] == row[1] == row[2] == 0}

    def sessions(files: list[str]) -> str:
        return (f"(SELECT session_id, session_start::TIMESTAMP AS session_start, "
                f"session_end::TIMESTAMP AS session_end, pageview_count, landing_url, exit_url, "
                f"order_count, revenue::DECIMAL(20, 4) AS revenue, revision "
                f"FROM read_parquet({files!r}, hive_partitioning = true))")

    backfill = sessions(client_files(backfill_wh / "sessions", CLIENT))
    baseline = sessions(client_files(baseline_wh / "sessions", CLIENT))
    duck = (f"(SELECT *, NULL::INT AS revision FROM "
            f"read_parquet('{duck_out / 'sessions.parquet'}'))")
    for name, left, right, extra in (
        ("duckdb_vs_backfill_sessions", duck, backfill, ""),
        ("full_recompute_vs_backfill_sessions", baseline, backfill,
         " OR a.revision IS DISTINCT FROM b.revision"),
    ):
        out[name] = compare(left, right, "session_id", differs + extra)

    def attributions(files: list[str]) -> str:
        return f"(SELECT order_id, session_id FROM read_parquet({files!r}))"

    duck_a = attributions([str(duck_out / "attributions.parquet")])
    for name, left, right in (
        ("duckdb_vs_backfill_attributions", duck_a,
         attributions(client_files(backfill_wh / "attributions", CLIENT))),
        ("full_recompute_vs_backfill_attributions",
         attributions(client_files(baseline_wh / "attributions", CLIENT)),
         attributions(client_files(backfill_wh / "attributions", CLIENT))),
    ):
        out[name] = compare(left, right, "order_id", "a.session_id IS DISTINCT FROM b.session_id")
    con.close()
    return out


# ------------------------------------------------------------------------------------------
# The whole benchmark
# ------------------------------------------------------------------------------------------


def generate(scale: BenchScale, landing: Path) -> dict[str, Any]:
    """Write the landing Parquet batches; returns counts and where they are."""
    from clickstream.jobs.generate import Scale, simulate, write_table

    started = time.monotonic()
    counts: dict[str, Any] = {}
    plan = [(CLIENT, scale.users, scale.sessions_per_user_per_day, SEED)] + [
        (client, scale.other_users, scale.other_sessions_per_user_per_day, SEED + 1 + i)
        for i, client in enumerate(OTHER_CLIENTS)]
    for client, users, rate, seed in plan:
        sim = Scale(clients=3, users_per_client=users, minutes=scale.days * 24 * 60,
                    start=datetime(2025, 1, 1, tzinfo=UTC), sessions_per_user_per_day=rate,
                    order_probability=scale.order_probability)
        pageviews, orders = simulate(sim, seed, client=client)
        for kind, table in (("pageviews", pageviews), ("orders", orders)):
            write_table(table, landing / kind / client, "parquet")
            counts[f"{client}/{kind}"] = table.num_rows
            counts[f"{client}/{kind}_bytes"] = folder_bytes(landing / kind / client)
        del pageviews, orders
        log(f"generated {client}: {counts[f'{client}/pageviews']} pageviews, "
            f"{counts[f'{client}/orders']} orders")
    counts["seconds"] = round(time.monotonic() - started, 1)
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    scale = SCALES[args.scale]
    if args.users:
        scale = replace(scale, users=args.users)
    workdir = Path(args.workdir or f"/tmp/backfill-bench-{scale.name}").resolve()
    landing = workdir / "landing"
    frozen = workdir / "warehouse-prebackfill"
    marker = workdir / "prepared.json"
    result: dict[str, Any] = {
        "benchmark": "backfill", "issue": 3, "scale": asdict(scale),
        "client": CLIENT, "other_clients": list(OTHER_CLIENTS), **_run_identity(),
    }
    broker = _changelog_broker()
    try:
        state = {"workdir": str(workdir), "bootstrap": broker.bootstrap_servers,
                 "orders_path": f"orders/{CLIENT}"}
        prepared = json.loads(marker.read_text()) if marker.exists() else None
        if args.reuse_setup and prepared and prepared.get("scale") == asdict(scale):
            log(f"reusing the prepared state in {workdir}")
            result["setup"] = {**prepared["setup"], "reused": True}
        else:
            if workdir.exists():
                shutil.rmtree(workdir)
            workdir.mkdir(parents=True)
            result["idle_before_setup"] = wait_until_idle(args.max_wait_idle)
            log(f"generating {scale.name} data under {landing}")
            counts = generate(scale, landing)
            loads = [{"client": c, "kind": k, "path": f"{k}/{c}"}
                     for c in OTHER_CLIENTS for k in ("pageviews", "orders")]
            loads.append({"client": CLIENT, "kind": "pageviews", "path": f"pageviews/{CLIENT}"})
            load_idle = wait_until_idle(args.max_wait_idle)
            log(f"loading the tables with run_backfill (setup; idle check: {load_idle})")
            with BusyWatcher() as watcher:
                load = run_phase("load", {**state, "warehouse": str(workdir / "warehouse"),
                                          "loads": loads}, workdir)
            load["idle"] = {**load_idle, "during": watcher.summary()}
            shutil.copytree(workdir / "warehouse", frozen)
            setup = {"generate": counts, "load": load,
                     "warehouse_bytes": {p.name: folder_bytes(p) for p in frozen.iterdir()}}
            marker.write_text(json.dumps({"scale": asdict(scale), "setup": setup}))
            result["setup"] = setup
        for name in (*COPIES, "duckdb-out"):
            shutil.rmtree(workdir / name, ignore_errors=True)
        for name in COPIES:
            shutil.copytree(frozen, workdir / name)
        shutil.rmtree(workdir / "home", ignore_errors=True)

        result["idle"] = {}
        for name in ("backfill", "baseline"):
            result["idle"][name] = wait_until_idle(args.max_wait_idle)
            log(f"timed phase {name} (idle check: {result['idle'][name]})")
            with BusyWatcher() as watcher:
                result[name] = run_phase(name, {**state, "warehouse": str(
                    workdir / f"warehouse-{name}")}, workdir)
            result["idle"][name]["during"] = watcher.summary()
            log(f"{name}: {result[name]['wall_s']:.1f}s")

        # Not timed: the same backfill once more on a third copy, with Parquet vectored
        # reads off so that Hadoop's byte counters see every byte read (SparkProbe).
        log("bytes run: the same backfill with Parquet vectored reads off (not timed)")
        result["backfill_bytes_run"] = run_phase("backfill-bytes", {
            **state, "warehouse": str(workdir / "warehouse-backfill-bytes"),
            "vectored_io": False}, workdir)
        backfill_wh = workdir / "warehouse-backfill"
        pageview_files = client_files(backfill_wh / "pageviews", CLIENT)
        order_files = client_files(backfill_wh / "orders", CLIENT)
        result["idle"]["duckdb"] = wait_until_idle(args.max_wait_idle)
        with BusyWatcher() as watcher:
            result["duckdb"] = duckdb_reference(pageview_files, order_files,
                                                workdir / "duckdb-out", 30 * 60_000)
        result["idle"]["duckdb"]["during"] = watcher.summary()
        log(f"duckdb: {result['duckdb']['wall_s']:.1f}s")
        result["checks"] = compare_results(workdir / "duckdb-out", backfill_wh,
                                           workdir / "warehouse-baseline")
        result["bytes"] = bytes_summary(result, frozen, backfill_wh)
        result["goals"] = goals(result)
    finally:
        broker.stop()
    if not args.keep:
        for name in (*COPIES, "duckdb-out"):
            shutil.rmtree(workdir / name, ignore_errors=True)
    return result


def _run_identity() -> dict[str, Any]:
    """How a result file was made: command, start, machine and product code."""
    return {
        "command": " ".join([".venv/bin/python", "bench/backfill_bench.py", *sys.argv[1:]]),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(), "product_source": _source_fingerprint(),
    }


def _changelog_broker() -> Any:
    """A started embedded broker with the bench's changelog topics. It keeps ~5 MiB per
    partition (kafka_broker limit 2): the topics get enough partitions for every revision the
    setup and the three runs publish (~4M sessions, ~0.6M attributions), so the publish gate
    reads all of them back."""
    from clickstream.io.kafka_broker import EmbeddedBroker

    broker = EmbeddedBroker(port=0).start()
    for topic, partitions in CHANGELOG_PARTITIONS.items():
        broker.create_topic(topic, partitions)
    return broker


def prepared_workdir(args: argparse.Namespace) -> tuple[BenchScale, Path]:
    """The scale and workdir of a previous run whose prepared state the later modes reuse."""
    scale = SCALES[args.scale]
    workdir = Path(args.workdir or f"/tmp/backfill-bench-{scale.name}").resolve()
    marker = workdir / "prepared.json"
    prepared = json.loads(marker.read_text()) if marker.exists() else None
    if not prepared or prepared.get("scale") != asdict(scale):
        raise SystemExit(f"no prepared {scale.name} state in {workdir}: run the benchmark once "
                         f"with --scale {scale.name} first")
    return scale, workdir


def fresh_warehouse(workdir: Path, name: str) -> Path:
    """A new copy of the frozen pre-backfill warehouse for phase ``name``, and an empty home."""
    warehouse = workdir / f"warehouse-{name}"
    shutil.rmtree(warehouse, ignore_errors=True)
    shutil.copytree(workdir / "warehouse-prebackfill", warehouse)
    shutil.rmtree(workdir / "home", ignore_errors=True)
    return warehouse


def run_phase_with_broker(name: str, workdir: Path, warehouse: Path, orders_path: str
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Phase ``name`` on ``warehouse`` with a fresh changelog broker (its topics start
    empty, so the publish gate reads back only this phase's records); returns the phase's
    result and what else used the CPU meanwhile."""
    broker = _changelog_broker()
    try:
        state = {"workdir": str(workdir), "bootstrap": broker.bootstrap_servers,
                 "orders_path": orders_path, "warehouse": str(warehouse)}
        with BusyWatcher() as watcher:
            result = run_phase(name, state, workdir)
        return result, watcher.summary()
    finally:
        broker.stop()


def run_phase_alone(args: argparse.Namespace) -> dict[str, Any]:
    """One timed phase on a fresh copy of a previous run's frozen pre-backfill state, with a
    fresh broker: an A/B of two commits of the backfill takes minutes, not the setup's ~10.
    The phase imports the product from this checkout, so checking out another commit's files
    measures that commit."""
    scale, workdir = prepared_workdir(args)
    name = args.phase_alone
    warehouse = fresh_warehouse(workdir, name)
    result: dict[str, Any] = {
        "benchmark": f"backfill benchmark, phase {name} alone (fresh copy of the frozen "
                     "pre-backfill state, fresh broker)",
        "issue": 3, "scale": asdict(scale), **_run_identity(),
        "idle": wait_until_idle(args.max_wait_idle),
    }
    orders_path = (recent_orders(workdir / "landing", args.orders_days)
                   if args.orders_days else f"orders/{CLIENT}")
    result["orders_path"] = orders_path
    try:
        result[name], result["idle"]["during"] = run_phase_with_broker(
            name, workdir, warehouse, orders_path)
    finally:
        if not args.keep:
            shutil.rmtree(warehouse, ignore_errors=True)
    if name == "backfill":
        result["gates"] = gate_seconds(result[name])
    return result


def recent_orders(landing: Path, days: int) -> str:
    """Write the benchmark client's orders of the last ``days`` x 24 hours of its year as a
    batch of their own in the landing folder (once); returns its path relative to the landing
    folder."""
    from datetime import timedelta

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    relative = f"orders-last-{days}d/{CLIENT}"
    target = landing / relative
    if not target.exists():
        orders = ds.dataset(landing / "orders" / CLIENT, format="parquet").to_table()
        cutoff = pc.max(orders["ts"]).as_py() - timedelta(days=days)
        subset = orders.filter(pc.greater(orders["ts"], pa.scalar(cutoff, orders["ts"].type)))
        target.mkdir(parents=True)
        pq.write_table(subset, target / "part-00000.parquet")
    return relative


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Backfills of the last N days of the year's orders, each against the full recompute
    after the same merge, on fresh copies of a previous run's prepared state: how the
    backfill's time grows with the batch while the client's history stays the same."""
    scale, workdir = prepared_workdir(args)
    try:
        days_list = sorted({int(d) for d in args.sweep_days.split(",")})
    except ValueError:
        raise SystemExit(f"--sweep-days takes comma-separated whole days, e.g. 1,7,30,365; "
                         f"got {args.sweep_days!r}") from None
    if not days_list or days_list[0] < 1 or days_list[-1] > scale.days:
        raise SystemExit(f"--sweep-days must lie in 1..{scale.days}; got {args.sweep_days!r}")
    result: dict[str, Any] = {
        "benchmark": "backfill sweep: the last N days of the year's orders, backfilled vs the "
                     "same merge plus the full recompute (fresh copies of the frozen "
                     "pre-backfill state, a fresh broker per phase)",
        "issue": 3, "scale": asdict(scale), "client": CLIENT, **_run_identity(), "runs": [],
    }
    for days in days_list:
        orders_path = recent_orders(workdir / "landing", days)
        entry: dict[str, Any] = {"days": days, "orders_path": orders_path, "idle": {}}
        for name in ("backfill", "baseline"):
            warehouse = fresh_warehouse(workdir, name)
            entry["idle"][name] = wait_until_idle(args.max_wait_idle)
            log(f"sweep {days} days: {name}")
            entry[name], entry["idle"][name]["during"] = run_phase_with_broker(
                name, workdir, warehouse, orders_path)
            if name == "backfill":
                versions = entry[name]
                entry["affected"] = {
                    table: affected_partitions(warehouse / table,
                                               versions["versions_before"][table],
                                               versions["versions_after"][table])
                    for table in TABLES_OF_INTEREST}
                entry["gates"] = gate_seconds(entry[name])
            log(f"sweep {days} days: {name} {entry[name]['wall_s']:.1f}s")
        for name in ("backfill", "baseline"):
            if not args.keep:
                shutil.rmtree(workdir / f"warehouse-{name}", ignore_errors=True)
        entry["backfill_vs_full"] = round(entry["backfill"]["wall_s"]
                                          / entry["baseline"]["wall_s"], 3)
        result["runs"].append(entry)
    return result


def _days(days: int) -> str:
    return f"{days} day" if days == 1 else f"{days} days"


def sweep_markdown(result: dict[str, Any], path: Path) -> str:
    """The BENCHMARKS.md table of a sweep's result file."""
    rows = [
        f"Result file: `bench/results/{path.name}` (scale `{result['scale']['name']}`, "
        f"{result['started_utc']}, code `{result['product_source'].get('git_head') or '?'}`).",
        "",
        "| orders of the last | orders | sessions updated | `sessions` partitions rewritten "
        "| backfill | full recompute (same merge) | backfill / full | gates |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        backfill, baseline = run["backfill"], run["baseline"]
        corrections = backfill["corrections"]
        rows.append(
            f"| {_days(run['days'])} | {backfill['rows_merged']:,} "
            f"| {corrections['sessions_updated']:,} "
            f"| {run['affected']['sessions']['partitions']} "
            f"| {backfill['wall_s']:.1f} s | {baseline['wall_s']:.1f} s "
            f"| **{run['backfill_vs_full']:.3f}** | {sum(run['gates'].values()):.1f} s |")
    rows.append("")
    rows.append("Backfill steps (product timings): " + "; ".join(
        f"{_days(run['days'])}: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in {**run['backfill']['steps'],
                                          **run['backfill']['correction_steps']}.items())
        for run in result["runs"]) + ".")
    return "\n".join(rows)


def bytes_summary(result: dict[str, Any], frozen: Path, backfill_wh: Path) -> dict[str, Any]:
    before = result["backfill"]["versions_before"]
    after = result["backfill"]["versions_after"]
    affected = {name: affected_partitions(backfill_wh / name, before[name], after[name])
                for name in TABLES_OF_INTEREST}
    affected_before = sum(a["bytes_before"] for a in affected.values())
    affected_after = sum(a["bytes_after"] for a in affected.values())
    io = result["backfill"]["io"]
    counted = result["backfill_bytes_run"]["io"]
    batch = result["setup"]["generate"][f"{CLIENT}/orders_bytes"]
    read_primary = counted["hadoop_fs_bytes_read"] + counted["delta_rs_merge_scope_bytes"]
    scanned = io["scan_file_bytes"] + io["delta_rs_merge_scope_bytes"]
    client_tables = {name: affected_partitions(backfill_wh / name, before[name], before[name])[
        "client_bytes_before"] for name in ("pageviews", "sessions")}

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {
        "affected": affected,
        "affected_bytes_before": affected_before,
        "affected_bytes_after": affected_after,
        "orders_batch_bytes": batch,
        "client_bytes_before": client_tables,
        "backfill_bytes_read": read_primary,
        "backfill_scan_file_bytes": scanned,
        "baseline_scan_file_bytes": result["baseline"]["io"]["scan_file_bytes"]
        + result["baseline"]["io"]["delta_rs_merge_scope_bytes"],
        "baseline_scan_file_bytes_by_table": result["baseline"]["io"][
            "scan_file_bytes_by_table"],
        "ratio_read_vs_affected_before": ratio(read_primary, affected_before),
        "ratio_read_vs_affected_before_plus_batch": ratio(read_primary, affected_before + batch),
        "ratio_read_vs_affected_after": ratio(read_primary, affected_after),
        "ratio_scanned_vs_affected_before": ratio(scanned, affected_before),
    }


GATE_LINE = re.compile(r"quality gate (\w+) \(suite v[^)]*\): \w+, .* in (\d+(?:\.\d+)?)s")


def gate_seconds(phase: dict[str, Any]) -> dict[str, float]:
    """Seconds of each quality gate (its Spark checks, GX, Data Docs) in a phase, from the
    product's own progress lines: issue #4's overhead bar is for the gates."""
    seconds: dict[str, float] = {}
    for entry in phase.get("progress", []):
        match = GATE_LINE.search(entry["line"])
        if match:
            seconds[match.group(1)] = seconds.get(match.group(1), 0.0) + float(match.group(2))
    return seconds


def report_seconds(phase: dict[str, Any]) -> float:
    """Seconds of the run's correction report (a report, not a gate; reported next to them)."""
    return float(phase.get("correction_steps", {}).get("correction report", 0.0))


def goals(result: dict[str, Any]) -> dict[str, Any]:
    backfill = result["backfill"]["wall_s"]
    gates = gate_seconds(result["backfill"])
    report = report_seconds(result["backfill"])
    full = result["baseline"]["wall_s"]
    duck = result["duckdb"]["wall_s"]
    ratio_bytes = result["bytes"]["ratio_read_vs_affected_before"]
    return {
        "backfill_s": backfill, "full_recompute_s": full, "duckdb_s": duck,
        "backfill_vs_full": round(backfill / full, 3),
        "backfill_vs_full_met": backfill / full <= GOALS["backfill_vs_full"],
        "backfill_vs_duckdb": round(backfill / duck, 2),
        "faster_than_duckdb_met": backfill < duck,
        "bytes_read_vs_affected": ratio_bytes,
        "bytes_read_vs_affected_met": ratio_bytes is not None
        and ratio_bytes <= GOALS["bytes_read_vs_affected"],
        "gate_seconds": gates,
        "gates_share_of_backfill": round(sum(gates.values()) / backfill, 3),
        "gates_share_met": sum(gates.values()) / backfill <= GOALS["gates_share_of_backfill"],
        "correction_report_s": report,
        "gates_and_report_share_of_backfill": round((sum(gates.values()) + report) / backfill,
                                                    3),
    }


def _source_fingerprint() -> dict[str, Any]:
    """Which product code ran: git HEAD, and a hash of spark/clickstream (files change
    uncommitted while other engineers work)."""
    return {"git_head": git_head(), "uncommitted_files_under_spark": len(git_dirty("spark")),
            "sha256_spark_clickstream": source_sha256()}


def _machine() -> dict[str, Any]:
    import duckdb
    import pyspark

    cpu = "unknown"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {"cpus": os.cpu_count(), "cpu": cpu, "mem_gib": round(int(memory) / 2**20, 1),
            "python": platform.python_version(), "pyspark": pyspark.__version__,
            "duckdb": duckdb.__version__, "spark_master": "local[2]",
            "spark_driver_memory": DRIVER_MEMORY,
            "duckdb_threads": 2}


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summary_lines(result: dict[str, Any]) -> list[str]:
    g, b, io = result["goals"], result["bytes"], result["backfill"]["io"]
    gen = result["setup"]["generate"]
    steps = {**result["backfill"]["steps"], **result["backfill"]["correction_steps"]}
    return [
        f"scale {result['scale']['name']}: {gen[f'{CLIENT}/pageviews']:,} pageviews and "
        f"{gen[f'{CLIENT}/orders']:,} orders of {CLIENT} over {result['scale']['days']} days; "
        f"other clients: " + ", ".join(
            f"{c} {gen[f'{c}/pageviews']:,} pv / {gen[f'{c}/orders']:,} orders"
            for c in OTHER_CLIENTS),
        f"backfill {g['backfill_s']:.1f}s | full recompute (merge + rewrite) "
        f"{g['full_recompute_s']:.1f}s | DuckDB {g['duckdb_s']:.1f}s",
        f"backfill / full = {g['backfill_vs_full']} (goal <= {GOALS['backfill_vs_full']}: "
        f"{'met' if g['backfill_vs_full_met'] else 'NOT met'}); backfill / DuckDB = "
        f"{g['backfill_vs_duckdb']} ({'met' if g['faster_than_duckdb_met'] else 'NOT met'})",
        f"bytes read {_mib(b['backfill_bytes_read'])} (Hadoop FS, actually read) / "
        f"affected partitions before {_mib(b['affected_bytes_before'])} = "
        f"{b['ratio_read_vs_affected_before']} (goal <= {GOALS['bytes_read_vs_affected']}: "
        f"{'met' if g['bytes_read_vs_affected_met'] else 'NOT met'}); files scanned "
        f"{_mib(b['backfill_scan_file_bytes'])}; affected after {_mib(b['affected_bytes_after'])}",
        "backfill steps: " + ", ".join(f"{k} {v:.1f}s" for k, v in steps.items()),
        f"quality gates {sum(g['gate_seconds'].values()):.1f}s = "
        f"{g['gates_share_of_backfill']:.1%} of the backfill (goal <= "
        f"{GOALS['gates_share_of_backfill']:.0%}: {'met' if g['gates_share_met'] else 'NOT met'}"
        "): " + ", ".join(f"{k} {v:.1f}s" for k, v in g["gate_seconds"].items())
        + f"; with the correction report ({g['correction_report_s']:.1f}s) "
        f"{g['gates_and_report_share_of_backfill']:.1%}",
        "scanned by table: " + ", ".join(
            f"{t} {_mib(v['bytes'])} ({v['scans']} scans)"
            for t, v in sorted(io["scan_file_bytes_by_table"].items(),
                               key=lambda kv: -kv[1]["bytes"])),
    ]


def markdown(result: dict[str, Any], path: Path) -> str:
    g, b = goals(result), result["bytes"]  # recomputed: older files predate the report split
    gen = result["setup"]["generate"]
    back, base = result["backfill"], result["baseline"]
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    loads = result["setup"]["load"]["loads"]
    main_load = next(item for item in loads
                     if item["client"] == CLIENT and item["kind"] == "pageviews")
    steps = {**back["steps"], **back["correction_steps"]}
    rows = [
        "| measure | value | goal | |",
        "|---|---|---|---|",
        f"| backfill wall (validate + merge + recompute + publish) | {g['backfill_s']:.1f} s | "
        "| |",
        f"| full recompute wall (same merge + `run_full_recompute`) | {g['full_recompute_s']:.1f}"
        f" s (merge {base['validate_s'] + base['merge_s']:.1f} s + rewrite "
        f"{base['full_recompute_s']:.1f} s) | | |",
        f"| DuckDB recompute (threads=2, Parquet in, Parquet out) | {g['duckdb_s']:.1f} s | | |",
        f"| backfill / full recompute | {g['backfill_vs_full']} | <= 0.2 | "
        f"{'met' if g['backfill_vs_full_met'] else '**not met**'} |",
        f"| backfill / DuckDB | {g['backfill_vs_duckdb']} | < 1 | "
        f"{'met' if g['faster_than_duckdb_met'] else '**not met**'} |",
        f"| bytes read / affected partitions (before) | {_mib(b['backfill_bytes_read'])} / "
        f"{_mib(b['affected_bytes_before'])} = {b['ratio_read_vs_affected_before']} | <= 1.5 | "
        f"{'met' if g['bytes_read_vs_affected_met'] else '**not met**'} |",
        f"| quality gates inside the backfill (issue #4: {', '.join(g['gate_seconds'])}) | "
        f"{sum(g['gate_seconds'].values()):.1f} s = {g['gates_share_of_backfill']:.1%} | "
        f"<= 15% | {'met' if g['gates_share_met'] else '**not met**'} |",
        f"| the gates plus the correction report (a report, not a gate) | "
        f"{sum(g['gate_seconds'].values()) + g['correction_report_s']:.1f} s = "
        f"{g['gates_and_report_share_of_backfill']:.1%} | | |",
    ]
    affected = ", ".join(
        f"{name} {a['partitions']} partitions ({_mib(a['bytes_before'])} before, "
        f"{_mib(a['bytes_after'])} after)" for name, a in b["affected"].items())
    scanned = ", ".join(
        f"{t} {_mib(v['bytes'])} in {v['scans']} scans"
        for t, v in sorted(back["io"]["scan_file_bytes_by_table"].items(),
                           key=lambda kv: -kv[1]["bytes"]))
    checks = result["checks"]
    idle = result["idle"]
    return "\n".join([
        f"Result file: `{rel}` (scale `{result['scale']['name']}`, "
        f"{result['started_utc']}).",
        "",
        f"Data: {gen[f'{CLIENT}/pageviews']:,} pageviews and {gen[f'{CLIENT}/orders']:,} orders "
        f"of `{CLIENT}` over {result['scale']['days']} days "
        f"({result['scale']['users']:,} users); "
        + ", ".join(f"`{c}` {gen[f'{c}/pageviews']:,} pageviews / {gen[f'{c}/orders']:,} orders"
                    for c in OTHER_CLIENTS) + " in the same tables.",
        f"Setup (not part of the goals): loading `{CLIENT}`'s pageviews with "
        f"`run_backfill(kind=\"pageviews\")` took {main_load['seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in {**main_load['steps'],
                                                  **main_load['correction_steps']}.items())
        + ").",
        "",
        *rows,
        "",
        "Backfill steps (product timings): " + ", ".join(f"{k} {v:.1f} s"
                                                         for k, v in steps.items()) + ".",
        f"Affected partitions: {affected}. Files scanned by the backfill (Spark 'size of files "
        f"read', per table): {scanned}; bytes actually read (Hadoop FS counters, bytes run) "
        f"{_mib(result['backfill_bytes_run']['io']['hadoop_fs_bytes_read'])}; the orders "
        f"upsert's scope, read outside Spark {_mib(back['io']['delta_rs_merge_scope_bytes'])}. "
        "The full recompute scanned "
        f"{_mib(b['baseline_scan_file_bytes'])} of files (scan metric).",
        "Correctness (not timed): DuckDB vs backfilled sessions "
        f"{'equal' if checks['duckdb_vs_backfill_sessions']['equal'] else 'DIFFERENT'}, "
        "attributions "
        f"{'equal' if checks['duckdb_vs_backfill_attributions']['equal'] else 'DIFFERENT'}; "
        "full recompute vs backfill (with revisions) "
        f"{'equal' if checks['full_recompute_vs_backfill_sessions']['equal'] else 'DIFFERENT'}.",
        "Machine: " + f"{result['machine']['cpus']} CPUs ({result['machine']['cpu']}), "
        f"{result['machine']['mem_gib']} GiB. Share of the CPU used by other processes "
        "during the timed phases: " + ", ".join(
            f"{k} {v.get('during', {}).get('others_cpu_share', 0):.0%}"
            + (" (another benchmark seen)" if v.get("during", {}).get("other_benchmark_seen")
               else "") for k, v in idle.items()) + ".",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Backfill benchmark (issue #3): a year of orders of one client, backfilled "
        "vs a full delete-and-rewrite recompute vs DuckDB, and bytes read vs affected "
        "partitions. Writes bench/results/backfill-<scale>-<UTC stamp>.json.")
    parser.add_argument("--scale", choices=sorted(SCALES), default="small",
                        help="small: ~0.4M pageviews (minutes); full: >= 10M pageviews and "
                        ">= 500k orders of the benchmark client (the issue's bar)")
    parser.add_argument("--workdir", help="working folder (default /tmp/backfill-bench-<scale>)"
                        "; its content is replaced")
    parser.add_argument("--users", type=int, help="override the benchmark client's users "
                        "(fallback when the full load is too slow)")
    parser.add_argument("--reuse-setup", action="store_true",
                        help="reuse the loaded pre-backfill state of a previous run in the "
                        "workdir if its scale matches (skips generation and loading)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the post-run warehouses and DuckDB output in the workdir")
    parser.add_argument("--max-wait-idle", type=float, default=3 * 3600,
                        help="seconds to wait for other benchmarks (pgrep -f "
                        f"{OTHER_BENCH_PATTERN}) to finish before each timed phase")
    parser.add_argument("--max-wait-cpu", type=float, default=MAX_WAIT_CPU_S[0],
                        help="then seconds to wait for the CPU to be idle (others < 15%%) "
                        "before starting anyway; the CPU others used is recorded either way")
    parser.add_argument("--other-pattern", action="append", default=[],
                        help="more pgrep -f patterns of processes to wait for (repeatable)")
    parser.add_argument("--markdown", metavar="RESULT_JSON",
                        help="print the BENCHMARKS.md section for a result file and exit")
    parser.add_argument("--phase-alone", choices=("backfill", "baseline"),
                        help="time only this phase on a fresh copy of the prepared state of "
                        "a previous run in the workdir (writes backfill-phase-<scale>-<stamp>"
                        ".json)")
    parser.add_argument("--orders-days", type=int, metavar="N",
                        help="with --phase-alone: the orders of the last N days of the year "
                        "only (default: the whole year)")
    parser.add_argument("--sweep-days", metavar="N,N,...",
                        help="on a previous run's prepared state: backfill the orders of the "
                        "last N days of the year, and the same merge plus the full "
                        "recompute, for each N (writes backfill-sweep-<scale>-<stamp>.json)")
    parser.add_argument("--phase", nargs=3, metavar=("NAME", "IN", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        name, state_file, out_file = args.phase
        result = PHASES[name](json.loads(Path(state_file).read_text()))
        Path(out_file).write_text(json.dumps(result, default=str))
        return 0
    if args.markdown:
        path = Path(args.markdown).resolve()
        data = json.loads(path.read_text())
        print(sweep_markdown(data, path) if "runs" in data else markdown(data, path))
        return 0
    OTHER_PATTERNS.extend(args.other_pattern)
    MAX_WAIT_CPU_S[0] = args.max_wait_cpu
    if args.orders_days is not None and not args.phase_alone:
        raise SystemExit("--orders-days goes with --phase-alone (the sweep takes --sweep-days)")
    if args.orders_days is not None and args.orders_days < 1:
        raise SystemExit(f"--orders-days must be at least 1; got {args.orders_days}")
    if args.sweep_days:
        result = run_sweep(args)
        path = write_result(f"backfill-sweep-{result['scale']['name']}", result)
        print(sweep_markdown(result, path))
        print(f"wrote {path}")
        return 0
    if args.phase_alone:
        result = run_phase_alone(args)
        path = write_result(f"backfill-phase-{result['scale']['name']}", result)
        phase = result[args.phase_alone]
        print(f"{args.phase_alone}: {phase['wall_s']:.1f}s; steps "
              f"{phase.get('correction_steps') or phase.get('steps') or ''}")
        print(f"wrote {path}")
        return 0
    result = run(args)
    path = write_result(f"backfill-{result['scale']['name']}", result)
    for line in summary_lines(result):
        print(line)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
