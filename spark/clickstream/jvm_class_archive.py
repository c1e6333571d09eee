"""A class-data-sharing archive of the classes a Spark driver of this product loads.

Every job starts a JVM of its own: each spark-submit step of a DAG run, each CLI command, the
sessionizer's restarts. Starting Spark, a JVM loads and verifies ~12,000 classes from the jars,
about half of the CPU of a short job's start here: a driver that builds its session and runs
one query took 9.7-11.3 CPU-s, and 5.5-6.0 with the archive (BENCHMARKS.md, session 38). With
it, the JVM maps those classes, parsed and verified already, from one file (Java's AppCDS).

``scripts/setup.sh`` builds the archive once per environment (:func:`build_if_stale`), by
running a small end-to-end workload of the product (:func:`_warm_up`) in a driver started with
``-XX:ArchiveClassesAtExit``; :func:`launch_options` hands it to every driver the product starts
(``spark_session.driver_launch_conf``). An archive is valid only for the JVM build and the jars
it was made from: the JVM checks both when it starts and, if either changed, starts without it,
as it would without the option. A stale or missing archive costs start-up time, never
correctness; ``CLICKSTREAM_JVM_CLASS_ARCHIVE=off`` leaves it out.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from clickstream.config import Config

ARCHIVE = Path(sys.prefix) / "share" / "clickstream" / "spark-driver-classes.jsa"
"""In the environment (the venv) whose jars it was made from."""

# The JVM reports an archive it cannot use (another JVM build, changed jars) with a warning on
# stdout and starts without it: the output of a command (a step's JSON) must stay its own.
QUIET = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")
WARM_UP_TIMEOUT_S = 900  # it takes 80-90 s here


def launch_options(config: Config) -> list[str]:
    """The driver's JVM options that map the archive, when there is one and it is wanted."""
    if config.jvm_class_archive == "off" or not ARCHIVE.is_file():
        return []
    return [f"-XX:SharedArchiveFile={ARCHIVE}", *QUIET]


def environment_stamp() -> str:
    """What the archive depends on: the JVM build and Spark's jars (names, sizes, times)."""
    # The JVM and the jars spark-submit uses (bin/spark-class: JAVA_HOME, else PATH).
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    version = subprocess.run([str(java), "-version"], capture_output=True, text=True, check=True)
    digest = hashlib.sha256(version.stderr.encode())
    for jar in sorted((spark_home() / "jars").glob("*.jar")):
        stat = jar.stat()
        digest.update(f"{jar.name}\x1f{stat.st_size}\x1f{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def spark_home() -> Path:
    import pyspark

    return Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)


def _stamp_path() -> Path:
    return ARCHIVE.with_suffix(".stamp")


def build_if_stale(progress: Callable[[str], None] = print) -> Path:
    """Build the archive unless the one there was made for this JVM and these jars."""
    stamp = environment_stamp()
    stamp_path = _stamp_path()
    if ARCHIVE.is_file() and stamp_path.is_file() and stamp_path.read_text().strip() == stamp:
        progress(f"jvm class archive: up to date ({ARCHIVE})")
        return ARCHIVE
    return build(stamp, progress)


def build(stamp: str, progress: Callable[[str], None] = print) -> Path:
    """Run the warm-up in a driver that writes the classes it loaded at exit; replace the
    archive only once the new one is complete."""
    ARCHIVE.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress("jvm class archive: running a small end-to-end job to record the classes a "
             "driver loads (~1.5 min, once per environment)")
    with tempfile.TemporaryDirectory(prefix="clickstream-class-archive-") as workdir:
        partial = ARCHIVE.with_name(f".{ARCHIVE.name}.{os.getpid()}")
        java_options = f"-XX:ArchiveClassesAtExit={partial} {' '.join(QUIET)}"
        command = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]",
                   "--conf", f"spark.driver.extraJavaOptions={java_options}",
                   str(Path(__file__)), "--warm-up", workdir]
        env = {**os.environ, "CLICKSTREAM_JVM_CLASS_ARCHIVE": "off",
               "SPARK_HOME": str(spark_home()), "PYSPARK_PYTHON": sys.executable,
               "PYSPARK_DRIVER_PYTHON": sys.executable}
        env.pop("JAVA_TOOL_OPTIONS", None)
        try:
            finished = subprocess.run(command, env=env, capture_output=True, text=True,
                                      timeout=WARM_UP_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            partial.unlink(missing_ok=True)
            raise RuntimeError(
                f"jvm class archive: the warm-up job did not finish in {WARM_UP_TIMEOUT_S} s "
                "(stopped), so no archive was written; jobs start without one (slower, "
                "otherwise the same)") from error
        if finished.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            tail = "\n".join((finished.stdout + finished.stderr).strip().splitlines()[-20:])
            raise RuntimeError(
                f"jvm class archive: the warm-up job failed (exit {finished.returncode}), so no "
                f"archive was written; jobs start without one (slower, otherwise the same). "
                f"Its last lines:\n{tail}")
        partial.replace(ARCHIVE)
    _stamp_path().write_text(stamp + "\n")
    progress(f"jvm class archive: {ARCHIVE} ({ARCHIVE.stat().st_size / 2**20:.0f} MiB) in "
             f"{time.monotonic() - started:.0f}s")
    return ARCHIVE


def _warm_up(workdir: Path) -> None:
    """The product's main paths on a few hundred rows: the stream, both backfill kinds and
    the scheduled recompute, against an embedded broker, so the classes they load are
    archived."""
    from datetime import UTC, datetime

    from clickstream.io.kafka_broker import EmbeddedBroker
    from clickstream.io.kafka_clients import produce_records
    from clickstream.jobs.backfill import run_backfill
    from clickstream.jobs.generate import Delivery, Scale, live_records, simulate, write_table
    from clickstream.jobs.recompute import run_recompute
    from clickstream.jobs.sessionize import run_sessionizer

    start = datetime(2026, 1, 1, tzinfo=UTC)
    with EmbeddedBroker(port=0) as broker:
        config = Config(warehouse=workdir / "warehouse", home=workdir / "home",
                        landing=workdir / "landing", spark_master="local[2]",
                        shuffle_partitions=2, kafka_bootstrap_servers=broker.bootstrap_servers,
                        jvm_class_archive="off")
        produce_records(config, config.events_topic, live_records(
            Scale(clients=2, users_per_client=10, start=start, minutes=180), Delivery(), 1))
        run_sessionizer(config, until_caught_up=True)
        pageviews, orders = simulate(Scale(users_per_client=10, start=start, minutes=180), 2,
                                     client="client-00")
        for kind, table in (("orders", orders), ("pageviews", pageviews)):
            write_table(table, config.landing / "late" / kind, "parquet")
            run_backfill(config, kind=kind, client_id="client-00", path=f"late/{kind}",
                         progress=lambda _: None)
        run_recompute(config)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--warm-up"] and len(argv) == 2:
        _warm_up(Path(argv[1]))
        return 0
    if argv == ["--if-stale"]:
        try:
            build_if_stale()
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    print("usage: jvm_class_archive.py --if-stale | --warm-up WORKDIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
