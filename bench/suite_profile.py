"""Where the test suite's CPU goes: a few tests run in one pytest process, with the CPU of
the whole process tree (the tests' Python, their Spark JVM, any child JVMs) and, with
``--jfr``, a Java Flight Recording of the tests' JVM broken down by what its threads were doing.

The suite is CPU-bound (two workers keep both cores busy, README "Tests"), so its time is
the CPU its tests take. Wall times of one run vary by +-10% here; compare CPU seconds, and
run A/B pairs alternately (``--rounds``).

    .venv/bin/python bench/suite_profile.py                       # the default tests, once
    .venv/bin/python bench/suite_profile.py --jfr                 # + what the JVM did
    .venv/bin/python bench/suite_profile.py --rounds 2 \\
        --variant base: --variant noaqe:spark.sql.adaptive.enabled=false

A variant is ``name:key=value,key=value``: Spark settings applied to the tests' session
(``CLICKSTREAM_TEST_SPARK_CONF``, read by ``tests/conftest.py``), never to the product's,
after the session's own (``INTERPRETED`` there: no generated code; the product's way back is
``codegen:spark.sql.codegen.wholeStage=true,spark.sql.codegen.factoryMode=FALLBACK``); an
entry ``java=-XX:...`` is a JVM option instead, for every JVM the tests start
(``JAVA_TOOL_OPTIONS``), e.g. ``--variant c1:java=-XX:TieredStopAtLevel=1``; an entry
``launch=key=value`` is a Spark setting read only when the JVM starts (a static one, which
the session cannot change once built), given through a ``spark-defaults.conf`` of its own
(``SPARK_CONF_DIR``); a setting ``build_spark`` makes itself wins over it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import process_tree, thread_cpu
from results_file import REPO, git_dirty, git_head, source_sha256, write_result

TEST_SPARK_CONF_ENV = "CLICKSTREAM_TEST_SPARK_CONF"
DEFAULT_TESTS = (  # four warm-ish backfill tests: the kind of test most of the suite's time is
    "tests/jobs/test_backfill.py::test_rerunning_the_same_batch_changes_nothing",
    "tests/jobs/test_backfill.py::test_a_later_batch_with_the_same_order_id_updates_that_order",
    "tests/jobs/test_backfill.py::test_pageview_batch_merges_sessions_and_retracts_the_old_ones",
    "tests/jobs/test_backfill.py::test_orders_before_their_pageviews_are_kept_then_attributed",
)
# What a Java sample was doing, by the frames on its stack: the first that matches wins.
PHASES = (
    ("plan text (explain, listener events, cached names)",
     ("generateTreeString", "explainString", "simpleString", "treeString", "verboseString")),
    ("cache manager", ("CacheManager",)),
    ("analysis", ("Analyzer", "CheckAnalysis")),
    ("codegen: compile (janino)", ("org.codehaus.janino", "org.codehaus.commons")),
    ("codegen: generate", ("doProduce", "doConsume", "CodegenContext", "GenerateUnsafeProjection")),
    ("py4j class look-ups by name", ("py4j.reflection.ReflectionUtil.classForName",
                                     "py4j.reflection.TypeUtil.forName")),
    ("closure cleaning", ("ClosureCleaner",)),
    ("scheduling", ("DAGScheduler", "TaskSchedulerImpl", "TaskSetManager")),
    ("serialization", ("JavaSerializ", "Kryo")),
    ("parquet", ("parquet",)),
    # Every call from Python runs under py4j's MethodInvoker: what is left of those samples
    # (optimisation, physical planning, the SparkContext's start, parsing, ...), not py4j's
    # own work (session 33 read this as class look-ups; session 34 found them ~2%).
    ("other work called from Python", ("py4j.reflection",)),
)
TREE_TEXT = PHASES[0][1]


class TreeCpu:
    """Polls /proc for every process under ``root`` and keeps each one's last CPU reading:
    exited processes keep theirs (a process missed by at most one interval)."""

    def __init__(self, root: int, interval_s: float = 0.25) -> None:
        self.root, self.interval_s = root, interval_s
        self.processes: dict[tuple[int, int], tuple[str, float]] = {}
        self.java_threads: dict[tuple[tuple[int, int], int], tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, (name, cpu_s) in process_tree(self.root).items():
                self.processes[key] = (name, cpu_s)
                if name == "java":  # JIT compilers, GC, Spark's task and RPC threads
                    for tid, thread in thread_cpu(key[0]).items():
                        self.java_threads[(key, tid)] = thread
            self._stop.wait(self.interval_s)

    def stop(self) -> tuple[dict[str, float], dict[str, float]]:
        """(CPU seconds by process name, the JVMs' CPU seconds by thread name: digits become
        N; "exited threads" is what threads that ended between two readings took)."""
        self._stop.set()
        self._thread.join()
        by_name: dict[str, float] = collections.Counter()
        for name, cpu_s in self.processes.values():
            by_name[name] += cpu_s
        by_thread: dict[str, float] = collections.Counter()
        for name, cpu_s in self.java_threads.values():  # C1 and C2 compilers kept apart
            by_thread[name if name.startswith(("C1 ", "C2 ")) else re.sub(r"\d+", "N", name)] \
                += cpu_s
        seen = sum(by_thread.values())
        by_thread["exited threads"] = by_name.get("java", 0.0) - seen
        return ({name: round(cpu_s, 1) for name, cpu_s in sorted(by_name.items())},
                {name: round(cpu_s, 1) for name, cpu_s in
                 sorted(by_thread.items(), key=lambda item: -item[1]) if cpu_s >= 0.5})


def run_once(tests: list[str], conf: str, jfr: Path | None) -> dict[str, Any]:
    settings = [s.strip() for s in conf.split(",") if s.strip()]
    java = [s.removeprefix("java=") for s in settings if s.startswith("java=")]
    launch = [s.removeprefix("launch=") for s in settings if s.startswith("launch=")]
    spark = [s for s in settings if not s.startswith(("java=", "launch="))]
    if jfr is not None:  # deep stacks: plan printing recurses far below JFR's default 64
        java += ["-XX:FlightRecorderOptions:stackdepth=2048",
                 f"-XX:StartFlightRecording=filename={jfr},settings=profile"]
    env = dict(os.environ, **{TEST_SPARK_CONF_ENV: ",".join(spark)})
    if java:
        env["JAVA_TOOL_OPTIONS"] = " ".join([env.get("JAVA_TOOL_OPTIONS", ""), *java]).strip()
    command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
               *tests]
    with tempfile.TemporaryDirectory(prefix="suite-profile-conf-") as conf_dir:
        if launch:
            Path(conf_dir, "spark-defaults.conf").write_text("".join(
                f"{key} {value}\n" for key, _, value in (s.partition("=") for s in launch)))
            env["SPARK_CONF_DIR"] = conf_dir
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        cpu = TreeCpu(process.pid)
        output, _ = process.communicate()
        wall = time.monotonic() - started
    by_process, by_jvm_thread = cpu.stop()
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if process.returncode != 0:
        raise SystemExit(f"suite_profile: pytest failed ({process.returncode}): {last}\n"
                         f"{output[-4000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(sum(by_process.values()), 1),
            "cpu_s_by_process": by_process, "jvm_cpu_s_by_thread": by_jvm_thread,
            "pytest": last}


def jfr_breakdown(recording: Path, callers: int = 8) -> dict[str, Any]:
    """Java samples of the recording by thread and by phase, and who asked for plan text."""
    text = subprocess.run(["jfr", "print", "--stack-depth", "2048", "--events",
                           "jdk.ExecutionSample", str(recording)], capture_output=True,
                          text=True, check=True).stdout
    by_thread: collections.Counter[str] = collections.Counter()
    by_phase: collections.Counter[str] = collections.Counter()
    tree_text_callers: collections.Counter[str] = collections.Counter()
    samples = text.split("jdk.ExecutionSample")[1:]
    for sample in samples:
        thread = re.search(r'sampledThread = "([^"]*)"', sample)
        by_thread[re.sub(r"\d+", "N", thread.group(1)) if thread else "?"] += 1
        frames = re.findall(r"^\s+([\w.$<>]+)\(", sample, re.M)
        stack = " ".join(frames)
        by_phase[next((name for name, keys in PHASES if any(k in stack for k in keys)),
                      "other")] += 1
        deepest = [i for i, frame in enumerate(frames) if any(k in frame for k in TREE_TEXT)]
        if deepest:
            outer = [f.removeprefix("org.apache.spark.sql.") for f in frames[max(deepest):]
                     if f.startswith("org.apache.spark")][:3]
            tree_text_callers[" <- ".join(outer)] += 1
    total = max(len(samples), 1)

    def shares(counter: collections.Counter[str], top: int | None = None) -> dict[str, float]:
        return {k: round(100 * v / total, 1) for k, v in counter.most_common(top)}

    return {"java_samples": len(samples), "pct_by_thread": shares(by_thread, 12),
            "pct_by_phase": shares(by_phase),
            "pct_plan_text_by_caller": shares(tree_text_callers, callers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="pytest node ids (default: four backfill tests)")
    parser.add_argument("--variant", action="append", default=None,
                        help="name:key=value,... Spark settings for the tests' session "
                             "(repeatable; default: one variant 'base' with none)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of variants")
    parser.add_argument("--jfr", action="store_true",
                        help="record the tests' JVM with Java Flight Recorder and break it down")
    parser.add_argument("--no-write", action="store_true", help="print only; write no result")
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variant or ["base:"]:
        name, sep, conf = spec.partition(":")
        if not sep or not name or any("=" not in kv for kv in filter(None, conf.split(","))):
            parser.error(f"--variant {spec!r}: expected name:key=value,key=value (or name:)")
        variants.append((name, conf))

    runs = []
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as scratch:
        for round_number in range(1, args.rounds + 1):
            for name, conf in variants:
                recording = Path(scratch) / f"{name}-{round_number}.jfr" if args.jfr else None
                print(f"round {round_number}, {name} ({conf or 'no settings'}): running "
                      f"{len(args.tests)} tests", flush=True)
                run = {"round": round_number, "variant": name, "spark_conf": conf,
                       **run_once(args.tests, conf, recording)}
                if recording is not None:
                    run["jfr"] = jfr_breakdown(recording)
                print(f"  wall {run['wall_s']} s, CPU {run['cpu_s']} s "
                      f"{run['cpu_s_by_process']}; {run['pytest']}", flush=True)
                print(f"  JVM CPU by thread (s): {run['jvm_cpu_s_by_thread']}", flush=True)
                if "jfr" in run:
                    print(f"  JVM Java samples by phase (%): {run['jfr']['pct_by_phase']}",
                          flush=True)
                runs.append(run)
    result = {"bench": "suite_profile", "git_head": git_head(),
              "uncommitted": git_dirty(), "source_sha256": source_sha256(),
              "command": sys.argv, "tests": args.tests, "runs": runs}
    if not args.no_write:
        print(f"wrote {write_result('suite-profile', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
