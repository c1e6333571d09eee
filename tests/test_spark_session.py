"""The one SparkSession builder: the driver's JVM gets CLICKSTREAM_DRIVER_MEMORY (or the job
says it did not) and CLICKSTREAM_DRIVER_GC's collector, its settings, and the frames a job
keeps."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.errors import ConfigError
from clickstream.spark_session import (
    MAX_PLAN_STRING_CHARS,
    build_spark,
    collector_options,
    driver_heap_mib,
    driver_launch_conf,
    jvm_option,
    keep,
    python_socket_folder,
    release,
    releases_cache,
    remove_dead_sockets,
)
from tests.child_jvm import DRIVER_JOB, submit_driver, temp_folders_in

# The names the JVM's collectors report (java.lang.management), by collector.
COLLECTOR_BEANS = {"parallel": "PS MarkSweep,PS Scavenge",
                   "g1": "G1 Concurrent GC,G1 Old Generation,G1 Young Generation",
                   "serial": "Copy,MarkSweepCompact"}


def test_a_driver_with_less_heap_than_configured_warns(
        spark: SparkSession, spark_config: Config, capfd: pytest.CaptureFixture) -> None:
    heap = driver_heap_mib(spark)
    assert heap == spark_config.driver_memory_mib  # this process started the JVM: it applied

    build_spark(spark_config)
    assert "warning" not in capfd.readouterr().err

    build_spark(spark_config.replace(driver_memory=f"{2 * heap}m"))  # the JVM already runs
    assert (f"CLICKSTREAM_DRIVER_MEMORY={2 * heap}m, but this driver's JVM has a {heap} MiB "
            "heap") in capfd.readouterr().err


def collectors(spark: SparkSession) -> str:
    beans = spark._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    return ",".join(sorted(bean.getName() for bean in beans))


def test_the_driver_runs_the_configured_collector(spark: SparkSession,
                                                  spark_config: Config) -> None:
    assert collector_options(spark_config), "this environment's JVM options choose a collector"
    assert collectors(spark) == COLLECTOR_BEANS[spark_config.driver_gc]


def test_the_driver_compiles_the_large_methods_spark_generates(spark: SparkSession) -> None:
    """The parser's generated projection is larger than HotSpot compiles by default: it ran
    interpreted, and parsing took ~1.6x as long (BENCHMARKS.md, session 82)."""
    assert jvm_option(spark, "DontCompileHugeMethods") == "false"


def test_a_collector_the_environment_chooses_wins(tmp_path: Path, config: Config,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert collector_options(config.replace(driver_gc="g1")) == ["-XX:+UseG1GC"]
    serial = "-XX:+UseSerialGC -Xss4m"
    monkeypatch.setenv("JDK_JAVA_OPTIONS", serial)
    assert collector_options(config.replace(driver_gc="g1")) == []
    # Both on one JVM's command line, it would refuse to start.
    output, _ = submit_driver(tmp_path, config.replace(driver_gc="g1"))
    assert f"collectors: {COLLECTOR_BEANS['serial']}" in output


def test_the_deployments_driver_options_are_kept_and_its_collector_wins(
        tmp_path: Path, config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment's ``spark.driver.extraJavaOptions`` in spark-defaults.conf (a heap dump on
    out-of-memory, a truststore) was replaced by the product's ``--conf`` without a word."""
    folder = tmp_path / "conf"
    folder.mkdir()
    (folder / "spark-defaults.conf").write_text(
        "# the deployment's\nspark.master local[1]\n"
        "spark.driver.extraJavaOptions  -Dprobe.from.defaults=yes -XX:+UseSerialGC\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(folder))
    options = driver_launch_conf(config.replace(driver_gc="g1"))["spark.driver.extraJavaOptions"]
    assert options.endswith(" -Dprobe.from.defaults=yes -XX:+UseSerialGC")
    assert "UseG1GC" not in options  # two collectors: the JVM would refuse to start
    job = DRIVER_JOB + ('print("probe:", spark._jvm.java.lang.System.getProperty('
                        '"probe.from.defaults"))\n')
    output, _ = submit_driver(tmp_path, config.replace(driver_gc="g1"), job=job)
    assert "probe: yes" in output and f"collectors: {COLLECTOR_BEANS['serial']}" in output


def test_dataframe_calls_do_not_send_their_python_call_site_to_the_jvm(
        spark: SparkSession) -> None:
    """PySpark's DataFrame debugging costs ~5 JVM round trips per ``functions`` call; the
    product turns it off (``build_spark``), and PySpark reads the setting once per process."""
    from pyspark.errors.utils import is_debugging_enabled
    from pyspark.sql import functions as F

    spark.range(1).select(F.col("id") + 1).collect()
    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert is_debugging_enabled() is False


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its socket fds, found in the kernel's tables)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while listed
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_python_workers_and_results_reach_the_jvm_on_no_loopback_tcp_port(
        spark: SparkSession) -> None:
    """A collect's result, a DataFrame from pandas and a Python UDF's worker each met the JVM on
    a fresh loopback TCP port: a local client dialling that port number first took their place
    (CI: "Python worker failed to connect back", "Authentication failed"). Watched while they
    run, the driver's JVM listens on no port it did not listen on before (``build_spark``:
    Unix domain sockets)."""
    import pandas as pd
    from pyspark.sql import functions as F

    jvm_pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    before = listening_tcp_ports(jvm_pid)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(listening_tcp_ports(jvm_pid))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        plus_one = F.udf(lambda value: value + 1, "long")
        for rows in range(1, 21):
            assert spark.range(rows).select(plus_one("id")).collect()[-1][0] == rows
            frame = spark.createDataFrame(pd.DataFrame({"id": range(rows)}))
            assert frame.toPandas()["id"].sum() == rows * (rows - 1) // 2
    finally:
        done.set()
        watcher.join()
    assert seen - before == set()


@pytest.fixture
def short_folder() -> Iterator[Path]:
    """A folder under ``/tmp`` for socket paths: pytest's ``tmp_path`` is already too long
    for a socket's 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder)


def test_the_sockets_folder_is_this_users_own_and_short_enough(
        tmp_path: Path, short_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket's path fits in 107 bytes: a temporary folder deep in a job's folder (the crash
    tests' JVMs) failed Spark's start with "AF_UNIX path too long"; and a folder others can
    open would let them take a Python worker's place."""
    monkeypatch.setattr(tempfile, "tempdir", str(short_folder))
    folder = short_folder / f"clickstream-sockets-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(ConfigError, match="is not a folder only this user can open"):
        python_socket_folder()
    folder.chmod(0o700)
    assert python_socket_folder() == folder
    deep = tmp_path / ("a-job's-own-temporary-folder" * 3)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert python_socket_folder() == Path("/tmp") / f"clickstream-sockets-{os.getuid()}"


def test_the_sockets_a_killed_process_left_are_removed_and_live_ones_kept(
        short_folder: Path) -> None:
    live, dead = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    with live:
        live.bind(str(short_folder / ".live.sock"))
        live.listen()
        dead.bind(str(short_folder / ".dead.sock"))
        dead.close()  # its file stays, as a process killed with -9 leaves it
        (short_folder / ".notes.txt").write_text("not a socket of Spark's")
        remove_dead_sockets(short_folder)
        assert sorted(path.name for path in short_folder.iterdir()) == [
            ".live.sock", ".notes.txt"]


LONG_PLAN_JOB = """
from functools import reduce
from pyspark.sql import DataFrame, functions as F
from clickstream.config import Config
from clickstream.spark_session import build_spark
spark = build_spark(Config.from_env())
parts = [spark.range(2).select((F.col("id") + i).alias("id")) for i in range(200)]
union = reduce(DataFrame.unionByName, parts)
assert union.count() == 400
print("plan chars:", len(union._jdf.queryExecution().toString()))
import tempfile, time
query = (spark.readStream.format("rate").option("rowsPerSecond", 10).load().writeStream
         .trigger(processingTime="10 milliseconds").option("checkpointLocation", tempfile.mkdtemp())
         .foreachBatch(lambda batch, batch_id: time.sleep(0.3)).start())
while (query.lastProgress or {}).get("batchId", -1) < 3:
    time.sleep(0.1)
query.stop()
print("micro-batches run:", query.lastProgress["batchId"] + 1)
"""


def test_spark_does_not_warn_of_the_products_own_choices(tmp_path: Path, config: Config
                                                           ) -> None:
    """Spark warned of every plan it cut to ``spark.sql.maxPlanStringLength`` (~39 lines of
    a year's orders backfill), asking to raise the setting the product chose; and of every
    continuous micro-batch longer than the trigger interval, which is each one here."""
    output, _ = submit_driver(tmp_path, config, job=LONG_PLAN_JOB)
    chars = int(output.split("plan chars: ")[1].split()[0])
    assert chars <= MAX_PLAN_STRING_CHARS, output  # the plan was cut: Spark had a warning
    assert "Truncated the string representation" not in output, output
    assert int(output.split("micro-batches run: ")[1].split()[0]) >= 4, output  # each 0.3 s,
    assert "falling behind" not in output, output  # against a 10 ms trigger: Spark had one


def stored_rdds(spark: SparkSession) -> set[int]:
    return {info.id() for info in spark.sparkContext._jsc.sc().getRDDStorageInfo()}


def test_a_kept_frame_is_a_scan_of_its_blocks_until_released(spark: SparkSession) -> None:
    from pyspark.sql import functions as F

    before = stored_rdds(spark)
    kept = keep(spark.range(1000).where("id % 7 = 0").groupBy((F.col("id") % 3).alias("k"))
                .count())
    assert stored_rdds(spark) - before  # computed now, not at first use
    query = kept.where("k > 0").join(kept.withColumnRenamed("count", "n"), "k")
    plan = query._jdf.queryExecution().executedPlan().toString()
    assert "Range" not in plan and "Scan ExistingRDD" in plan, plan  # no lineage to plan
    sevens_by_k = [sum(1 for i in range(0, 1000, 7) if i % 3 == k) for k in (1, 2)]
    assert sorted(r["count"] for r in query.collect()) == sorted(sevens_by_k)
    release(kept)
    assert stored_rdds(spark) == before


def test_a_job_frees_what_it_kept_however_it_ends(spark: SparkSession) -> None:
    kept_by_the_job: set[int] = set()

    @releases_cache
    def failing_job() -> None:
        before = stored_rdds(spark)
        keep(spark.range(100))
        kept_by_the_job.update(stored_rdds(spark) - before)
        raise RuntimeError("the job stops here")

    with pytest.raises(RuntimeError, match="stops here"):
        failing_job()
    assert kept_by_the_job
    assert not kept_by_the_job & stored_rdds(spark)


def test_a_job_run_off_the_main_thread_frees_what_it_persisted(spark: SparkSession) -> None:
    """The active session is per thread: in another thread (an in-process Airflow task, a
    notebook's worker) there was none, and what the job persisted stayed in memory."""
    persisted_by_the_job: set[int] = set()

    @releases_cache
    def job() -> None:
        before = stored_rdds(spark)
        spark.range(100).where("id % 3 = 0").persist().count()
        persisted_by_the_job.update(stored_rdds(spark) - before)

    runner = threading.Thread(target=job)
    runner.start()
    runner.join()
    assert persisted_by_the_job
    assert not persisted_by_the_job & stored_rdds(spark)


JOB_OUTLIVED_BY_ITS_ERROR = """
from clickstream.config import Config
from clickstream.spark_session import build_spark, keep, releases_cache

spark = build_spark(Config.from_env())

@releases_cache
def job():
    keep(spark.range(10))
    try:
        spark._jvm.java.lang.Runtime.getRuntime().halt(1)  # the JVM ends under the job
    except Exception as lost:
        raise ValueError("the job's own error") from lost

try:
    job()
except BaseException as error:
    print("escaped:", type(error).__name__, error)
    print("notes:", *getattr(error, "__notes__", []))
"""


def test_a_job_whose_jvm_ended_shows_its_own_error(tmp_path: Path, config: Config) -> None:
    """Freeing the cache needs the JVM: with it gone, the freeing's error replaced the job's."""
    finished = subprocess.run(
        [sys.executable, "-c", JOB_OUTLIVED_BY_ITS_ERROR],
        env={**os.environ, "CLICKSTREAM_HOME": str(config.home),
             "CLICKSTREAM_WAREHOUSE": str(config.warehouse), **temp_folders_in(tmp_path)},
        capture_output=True, text=True, timeout=300)
    assert "escaped: ValueError the job's own error" in finished.stdout, finished.stderr[-3000:]
    assert "notes: freeing the job's cached frames failed as well: " in finished.stdout
