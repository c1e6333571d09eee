"""A class-data-sharing archive of the classes a Spark driver of this product loads.

Every job starts a JVM of its own: each spark-submit step of a DAG run, each CLI command, the
sessionizer's restarts. Starting Spark, a JVM loads and verifies ~12,000 classes from the jars,
about half of the CPU of a short job's start here: a driver that builds its session and runs
one query took 9.7-10.2 CPU-s, and 5.5 with the archive (BENCHMARKS.md, session 38). With it,
the JVM maps those classes, parsed and verified already, from one file (Java's AppCDS).

``scripts/setup.sh`` builds the archive once per environment (:func:`build_if_stale`), by
running a small end-to-end workload of the product (:func:`_warm_up`) in a driver started with
``-XX:ArchiveClassesAtExit``; :func:`launch_options` hands it to every driver the product starts
(``spark_session.driver_launch_conf``). An archive is valid only for the JVM build and the jars
it was made from: the JVM checks both when it starts and, if either changed, starts without it.
Setup rebuilds it when the stamp of the JVM and the jars changed or a probe driver does not
map it (:func:`usable`: that also catches a damaged file, which would crash a driver). A
stale or missing archive costs start-up time, never correctness;
``CLICKSTREAM_JVM_CLASS_ARCHIVE=off`` leaves it out.
"""

from __future__ import annotations

import hashlib
import os
import signal
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
PROBE_TIMEOUT_S = 300  # ~1 s here


def launch_options(config: Config) -> list[str]:
    """The driver's JVM options that map the archive, when there is one it can read and it is
    wanted. (Named but missing or unreadable, the JVM would drop its own default archive of
    the JDK's classes too.) Quoted: Spark splits ``extraJavaOptions`` at spaces."""
    if config.jvm_class_archive == "off" or not _readable(ARCHIVE):
        return []
    return [f'"-XX:SharedArchiveFile={ARCHIVE}"', *QUIET]


def _readable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.R_OK)


def environment_stamp() -> str:
    """What the archive depends on: the JVM build and Spark's jars (names, sizes, times)."""
    # The JVM and the jars spark-submit uses (bin/spark-class: JAVA_HOME, else PATH).
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    # With the environment the builds and jobs' probes get: JAVA_TOOL_OPTIONS adds a "Picked
    # up ..." line to the output, and changed the stamp (a rebuild for nothing).
    version = subprocess.run([str(java), "-version"], capture_output=True, text=True,
                             check=True, env=_submit_env())
    digest = hashlib.sha256(version.stderr.encode())
    for jar in sorted((spark_home() / "jars").glob("*.jar")):
        stat = jar.stat()
        digest.update(f"{jar.name}\x1f{stat.st_size}\x1f{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def spark_home() -> Path:
    """Where spark-submit finds Spark's jars (pip's pyspark unless SPARK_HOME says)."""
    import pyspark

    return Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)


def _spark_submit() -> str:
    return str(Path(sys.executable).parent / "spark-submit")


def _submit_env() -> dict[str, str]:
    env = {**os.environ, "CLICKSTREAM_JVM_CLASS_ARCHIVE": "off",
           "SPARK_HOME": str(spark_home()), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("JAVA_TOOL_OPTIONS", None)
    return env


def _stamp_path() -> Path:
    return ARCHIVE.with_suffix(".stamp")


def usable() -> bool:
    """Whether a driver spark-submit starts here maps the archive: with ``-Xshare:on`` the JVM
    refuses to start when it cannot (another JVM build or base archive, other jars or
    configuration folder first on the class path), and a damaged file fails its checksum or
    crashes this probe (a job would crash the same way). ~1 s."""
    with tempfile.TemporaryDirectory(prefix="clickstream-class-archive-") as scratch:
        try:
            probe = subprocess.run(  # in scratch: a crashed JVM writes its hs_err log there
                [_spark_submit(), "--conf", "spark.driver.extraJavaOptions=-Xshare:on "
                 f'-XX:+VerifySharedSpaces "-XX:SharedArchiveFile={ARCHIVE}"', "--version"],
                env=_submit_env(), cwd=scratch, capture_output=True, text=True,
                timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False  # a driver that hangs mapping it is no better than one refusing it
    return probe.returncode == 0


def build_if_stale(progress: Callable[[str], None] = print) -> Path:
    """Build the archive unless the one there was made for this JVM and these jars, and a
    driver maps it."""
    stamp = environment_stamp()
    stamp_path = _stamp_path()
    if (_readable(ARCHIVE) and stamp_path.is_file()
            and stamp_path.read_text().strip() == stamp and usable()):
        progress(f"jvm class archive: up to date ({ARCHIVE})")
        return ARCHIVE
    # Gone before the build, which may fail too: jobs then start without one, as its
    # messages say. Kept, a damaged file crashed every driver that mapped it.
    ARCHIVE.unlink(missing_ok=True)
    stamp_path.unlink(missing_ok=True)
    return build(stamp, progress)


def build(stamp: str, progress: Callable[[str], None] = print) -> Path:
    """Run the warm-up in a driver that writes the classes it loaded at exit; replace the
    archive only once the new one is complete and a driver maps it."""
    ARCHIVE.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress("jvm class archive: running a small end-to-end job to record the classes a "
             "driver loads (~1.5 min, when the JVM or Spark's jars changed)")
    with tempfile.TemporaryDirectory(prefix="clickstream-class-archive-") as workdir:
        partial = ARCHIVE.with_name(f".{ARCHIVE.name}.{os.getpid()}")
        java_options = f'"-XX:ArchiveClassesAtExit={partial}" {" ".join(QUIET)}'
        command = [_spark_submit(), "--master", "local[2]",
                   "--conf", f"spark.driver.extraJavaOptions={java_options}",
                   str(Path(__file__)), "--warm-up", workdir]
        # Its own process group: on a timeout or an interrupt of this process (Ctrl-C, a CI
        # time limit), the driver's Python and broker are stopped too, and no partial
        # archive is left; a terminal's Ctrl-C does not reach a new session by itself.
        job = subprocess.Popen(command, env=_submit_env(), cwd=workdir, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
        try:
            output, _ = job.communicate(timeout=WARM_UP_TIMEOUT_S)
        except BaseException as error:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            partial.unlink(missing_ok=True)
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            raise RuntimeError(
                f"jvm class archive: the warm-up job did not finish in {WARM_UP_TIMEOUT_S} s "
                "(stopped), so no archive was written; jobs start without one (slower, "
                "otherwise the same)") from error
        if job.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            tail = "\n".join(output.strip().splitlines()[-20:])
            raise RuntimeError(
                f"jvm class archive: the warm-up job failed (exit {job.returncode}), so no "
                f"archive was written; jobs start without one (slower, otherwise the same). "
                f"Its last lines:\n{tail}")
        partial.chmod(0o444)  # every user's jobs read it
        partial.replace(ARCHIVE)
    if not usable():
        ARCHIVE.unlink()
        raise RuntimeError(
            f"jvm class archive: a driver does not map the archive just built ({ARCHIVE}), so "
            "it was removed; jobs start without one (slower, otherwise the same)")
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
    from clickstream.io.kafka_produce import produce_records
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


def _exit_on(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--warm-up"] and len(argv) == 2:
        _warm_up(Path(argv[1]))
        return 0
    if argv == ["--if-stale"]:
        # A stop by signal (a CI time limit, `timeout`) as an exception: build() then stops
        # the warm-up job's process group and removes the partial archive. Killed by the
        # signal itself, this process left both behind.
        for stop in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop, _exit_on)
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
