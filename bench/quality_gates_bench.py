"""Benchmark of issue #4: what the data-quality gates cost.

1. **Backfill:** one client's year of history (~1M pageviews, then its orders) backfilled into
   an empty warehouse with ``CLICKSTREAM_QUALITY_GATES=off`` and with ``enforce``, each run
   in its own process (own Spark JVM, ``local[2]``; Great Expectations imported in the
   ``enforce`` runs only, as in production), in the order off, enforce, enforce, off so that
   a drifting machine load hits both modes alike. Reported: wall time per backfill and per
   step, and the gates' own time inside the enforce runs (each gate's ``seconds``: its check
   results in Spark, GX, Data Docs; plus the correction report), which the machine's load
   skews far less than a difference of two wall times.
   Goal: the gates cost at most 15% of the backfill's time.
2. **Stream:** the ``raw_events`` gate alone on persisted micro-batches of parsed records of
   several sizes (median of repeated runs), i.e. what it adds to each micro-batch.
   Goal: a few hundred milliseconds at most.

Usage:
    .venv/bin/python bench/quality_gates_bench.py --users 700 --days 365 --workdir /tmp/qgb
    .venv/bin/python bench/quality_gates_bench.py --users 60 --days 30   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def config_for(workdir: Path, phase: str, bootstrap: str, gates: str):
    from clickstream.config import Config

    return Config(home=workdir / phase / "home", warehouse=workdir / phase / "warehouse",
                  landing=workdir / "landing", spark_master="local[2]", shuffle_partitions=4,
                  kafka_bootstrap_servers=bootstrap, quality_gates=gates,
                  sessions_topic=f"sessions-{phase}", attributions_topic=f"attributions-{phase}")


def run_backfill_phase(workdir: Path, phase: str, bootstrap: str, gates: str) -> dict:
    """In a child process: both backfills, timed; the gates' own seconds from the log."""
    from clickstream.jobs.backfill import run_backfill
    from clickstream.spark_session import build_spark

    config = config_for(workdir, phase, bootstrap, gates)
    started = time.monotonic()
    spark = build_spark(config, f"quality-bench-{phase}")
    spark.range(1).count()
    spark_start = time.monotonic() - started
    result: dict = {"phase": phase, "gates": gates, "spark_start_s": spark_start, "runs": []}
    for kind in ("pageviews", "orders"):
        lines: list[tuple[float, str]] = []

        def progress(message: str, lines: list[tuple[float, str]] = lines) -> None:
            lines.append((time.monotonic(), message))
            print(message, flush=True)

        began = time.monotonic()
        summary = run_backfill(config, kind=kind, client_id="client-00", path=f"history/{kind}",
                               spark=spark, progress=progress)
        wall = time.monotonic() - began
        gate_seconds = {}
        for _moment, line in lines:
            text = line.strip()
            if text.startswith("quality gate ") and " expectations met in " in text:
                name = text.split()[2]
                gate_seconds[name] = float(text.split(" expectations met in ")[1].split("s")[0])
        if "correction report" in summary.corrections.seconds_by_step:
            gate_seconds["correction report"] = summary.corrections.seconds_by_step[
                "correction report"]
        result["runs"].append({
            "kind": kind, "wall_s": wall, "rows_read": summary.rows_read,
            "rows_merged": summary.rows_merged, "steps_s": summary.seconds_by_step,
            "correction_steps_s": summary.corrections.seconds_by_step,
            "sessions_created": summary.corrections.sessions_created,
            "sessions_updated": summary.corrections.sessions_updated,
            "gate_seconds": gate_seconds})
    return result


def run_stream_phase(workdir: Path, sizes: list[int], repeats: int) -> dict:
    """The raw_events gate on persisted micro-batches of parsed records."""
    from pyspark.sql import functions as F

    from clickstream.config import Config
    from clickstream.events.parse import parse_kafka_records
    from clickstream.jobs.generate import Delivery, Scale, live_records
    from clickstream.quality import suites
    from clickstream.quality.gates import gate_raw_events
    from clickstream.spark_session import build_spark
    from clickstream.tables import KAFKA_SCHEMA

    config = Config(home=workdir / "stream" / "home", warehouse=workdir / "stream" / "wh",
                    landing=workdir / "landing", spark_master="local[2]", shuffle_partitions=4)
    spark = build_spark(config, "quality-bench-stream")
    began = time.monotonic()
    suites.engine()
    import_s = time.monotonic() - began
    records = live_records(Scale(clients=3, users_per_client=max(sizes) // 24, minutes=24 * 60),
                           Delivery(), seed=5)
    out: dict = {"gx_import_and_engine_s": import_s, "sizes": {}}
    now = datetime.now(UTC)
    for size in sizes:
        rows = [(k.encode() if k else None, v.encode(), "events", i % 16, i, now, 0, None)
                for i, (k, v) in enumerate(records[:size])]
        parsed = parse_kafka_records(spark.createDataFrame(rows, KAFKA_SCHEMA),
                                     max_ts_ahead_ms=config.max_ts_ahead_ms).persist()
        parsed.count()
        count_times, gate_times = [], []
        for attempt in range(repeats + 1):
            began = time.monotonic()
            parsed.where(F.col("error").isNotNull()).count()  # what a micro-batch does anyway
            count_s = time.monotonic() - began
            began = time.monotonic()
            gate_raw_events(parsed, config, batch_id=attempt, run_id="bench")
            gate_s = time.monotonic() - began
            if attempt:  # the first one writes the run's first report and warms up
                count_times.append(count_s)
                gate_times.append(gate_s)
        out["sizes"][size] = {"records": len(rows), "one_count_s": statistics.median(count_times),
                              "gate_s": statistics.median(gate_times),
                              "gate_max_s": max(gate_times)}
        parsed.unpersist()
    return out


def generate(workdir: Path, users: int, days: float) -> dict:
    from clickstream.jobs.generate import Scale, simulate, write_table

    landing = workdir / "landing" / "history"
    if landing.exists():
        shutil.rmtree(landing)
    pageviews, orders = simulate(Scale(users_per_client=users, minutes=days * 24 * 60,
                                       start=datetime(2025, 11, 1, tzinfo=UTC),
                                       sessions_per_user_per_day=1.0),
                                 seed=11, client="client-00")
    write_table(pageviews, landing / "pageviews", "parquet")
    write_table(orders, landing / "orders", "parquet")
    return {"pageviews": pageviews.num_rows, "orders": orders.num_rows}


def child(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    if args.child == "stream":
        result = run_stream_phase(workdir, [int(s) for s in args.sizes.split(",")],
                                  args.repeats)
    else:
        result = run_backfill_phase(workdir, args.child, args.bootstrap,
                                    args.child.split("-")[0])
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=700)
    parser.add_argument("--days", type=float, default=365)
    parser.add_argument("--workdir", default="/tmp/quality-gates-bench")
    parser.add_argument("--sizes", default="2000,20000,200000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None)
    parser.add_argument("--bootstrap", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from clickstream.io.kafka_broker import EmbeddedBroker

    workdir = Path(args.workdir)
    phases = ("off-1", "enforce-1", "enforce-2", "off-2")
    for phase in (*phases, "stream"):
        shutil.rmtree(workdir / phase, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = generate(workdir, args.users, args.days)
    print(f"generated {rows}", flush=True)
    report: dict = {"rows": rows, "users": args.users, "days": args.days,
                    "cpus": os.cpu_count(), "load_before": os.getloadavg(), "phases": {}}
    with EmbeddedBroker(port=0) as broker:
        for phase in phases:
            for topic in (f"sessions-{phase}", f"attributions-{phase}"):
                broker.create_topic(topic, 16)
        for phase in (*phases, "stream"):
            out = workdir / f"{phase}.json"
            command = [sys.executable, __file__, "--child", phase, "--workdir", str(workdir),
                       "--bootstrap", broker.bootstrap_servers, "--out", str(out),
                       "--sizes", args.sizes, "--repeats", str(args.repeats)]
            print(f"--- phase {phase}", flush=True)
            subprocess.run(command, check=True)
            report["phases"][phase] = json.loads(out.read_text())
    report["load_after"] = os.getloadavg()
    report["overhead"] = {}
    for index, kind in enumerate(("pageviews", "orders")):
        off = [report["phases"][p]["runs"][index] for p in phases if p.startswith("off")]
        on = [report["phases"][p]["runs"][index] for p in phases if p.startswith("enforce")]
        off_s = statistics.mean(r["wall_s"] for r in off)
        on_s = statistics.mean(r["wall_s"] for r in on)
        own_s = statistics.mean(sum(r["gate_seconds"].values()) for r in on)
        report["overhead"][kind] = {
            "rows": on[0]["rows_read"], "off_s": [r["wall_s"] for r in off],
            "enforce_s": [r["wall_s"] for r in on],
            "wall_overhead_pct": 100 * (on_s / off_s - 1),
            "gates_own_s": own_s, "gates_own_pct_of_enforce": 100 * own_s / on_s,
            "gates_own_by_gate_s": {g: statistics.mean(r["gate_seconds"].get(g, 0) for r in on)
                                    for g in on[0]["gate_seconds"]}}
    target = workdir / "report.json"
    target.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["overhead"], indent=1))
    print(json.dumps(report["phases"]["stream"], indent=1))
    print(f"report: {target}")


if __name__ == "__main__":
    main()
