"""One place that builds the SparkSession, so the CLI, spark-submit entry points and tests agree."""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from py4j.java_gateway import JavaObject
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from clickstream import interrupts, jvm_class_archive
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import ConfigError, noted_on

P = ParamSpec("P")
R = TypeVar("R")

# How much of a query plan Spark spells out in explain output and listener events (see
# build_spark): enough to read the top of a plan, far below what nested cached plans reach.
MAX_PLAN_STRING_CHARS = 20_000
# Spark's warnings about choices the product made, silenced (kept at ERROR):
QUIETED_LOGGERS = (
    # each plan cut to that length, asking to raise the setting: ~39 lines of a year's
    # orders backfill on the console, about a limit the product chose;
    "org.apache.spark.sql.catalyst.util.StringUtils",
    # "Current batch is falling behind": a continuous sessionizer's micro-batch takes longer
    # than its trigger interval (2 s) in normal operation (~4 s here), so the line came with
    # every micro-batch; the interval only says how soon the next starts after a short one.
    "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
)


def build_spark(config: Config, app_name: str = "clickstream", *, ui: bool = False,
                long_running: bool = False) -> SparkSession:
    """Get or create the session for ``config``; the UI is off unless asked for.

    The driver's JVM settings (:func:`driver_launch_conf`) apply only when this call starts
    the JVM; under ``spark-submit`` they must be passed to it (``orchestration.spark_job``
    does), and a driver heap well below ``CLICKSTREAM_DRIVER_MEMORY`` is reported on stderr.
    """
    # Executors must run the same interpreter as the driver (the project's venv).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # A local master keeps everything on loopback; with a cluster master (docker-compose) the
    # executors must reach the driver, which then advertises its host name.
    local = config.spark_master.startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.appName(app_name)
        .master(config.spark_master)
        .config("spark.ui.enabled", str(ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        # A broadcast hash relation holds at least one whole memory page, and the driver keeps
        # it until the plans using it are garbage: at the default page size (64 MiB here) a
        # long-lived session (the sessionizer, the test suite) retained ~64 MiB per broadcast
        # join (~340 MiB of heap kept per small backfill in the test session; BENCHMARKS.md).
        # A page is one long[] on the heap, and G1 (CLICKSTREAM_DRIVER_GC=g1, and every driver
        # before session 39) keeps any object of at least half a region
        # (regions are 1-4 MiB here) "humongous", in whole regions of its own: 4 MiB pages
        # took 6-8 MiB each, and validating a year of pageviews (10.5M rows) ran out of an
        # 8 GiB heap. Pages just under 512 KiB are never humongous.
        .config("spark.buffer.pageSize", "511k")
        .config("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
        # Spark writes every query's plan out as text for its listeners when the query starts
        # and again at each adaptive re-plan, UI on or off; a persisted frame's node prints the
        # whole plan it was cached from (InMemoryRelation's inner child), so the recompute's
        # later queries (built on several persisted frames) spent more time printing plans
        # than running: in a warm JVM, a one-day orders backfill's recompute step took 23-32 s
        # with full plans and 14.7 s with them cut here (BENCHMARKS.md, session 18). Only
        # plan text is shortened (explain output, listener events, errors quoting a plan).
        .config("spark.sql.maxPlanStringLength", str(MAX_PLAN_STRING_CHARS))
        # PySpark's DataFrame debugging wraps every `functions.*` call in ~5 JVM round trips
        # (the active session, a setting, the Python call site set and cleared) so that a
        # Spark error can name the Python line that built the failing expression. Our jobs
        # build plans from many small calls: off, the backfill tests took 2-5% less CPU and
        # 5% less time (BENCHMARKS.md, session 34). Errors keep their Python traceback.
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.sql.warehouse.dir", str(config.home / "spark-warehouse"))
    )
    for key, value in driver_launch_conf(config, long_running=long_running).items():
        builder = builder.config(key, value)
    if local:
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1")
        # The JVM and its Python processes (workers, a streaming source's runner, a collect's
        # result) meet on Unix domain sockets, not on a fresh loopback TCP port each time:
        # any local client dialling that port number first took the worker's place, and the
        # query failed with "Python worker failed to connect back" or "Authentication failed"
        # (BENCHMARKS.md, session 85). A socket in a folder only this user can open has no
        # such strangers. Local masters only: a cluster's executors would need the folder on
        # their own hosts (unverified here; they keep Spark's default).
        builder = builder.config("spark.python.unix.domain.socket.enabled", "true").config(
            "spark.python.unix.domain.socket.dir", str(python_socket_folder()))
    spark = builder.getOrCreate()
    interrupts.note_sigint()  # pyspark put its own SIGINT handler in place: noted too
    log4j = spark._jvm.org.apache.logging.log4j
    for logger in QUIETED_LOGGERS:
        log4j.core.config.Configurator.setLevel(logger, log4j.Level.ERROR)
    heap_mib = driver_heap_mib(spark)
    if heap_mib < 0.9 * config.driver_memory_mib:
        print(f"warning: {ENV_NAMES['driver_memory']}={config.driver_memory}, but this "
              f"driver's JVM has a {heap_mib} MiB heap: it was started before the setting "
              "could apply (spark-submit without --driver-memory, or a session that already "
              "existed); pass --conf spark.driver.memory=... to spark-submit or set it in "
              "spark-defaults.conf", file=sys.stderr, flush=True)
    return spark


# A socket's path fits in 107 bytes (sockaddr_un); Spark names its sockets "." + a UUID + ".sock".
MAX_SOCKET_PATH_CHARS = 107
SPARK_SOCKET_NAME_CHARS = len("/.00000000-0000-0000-0000-000000000000.sock")


def python_socket_folder() -> Path:
    """The folder of the sockets between a local JVM and its Python processes: this user's
    own (mode 0700) under the temporary folder, or under ``/tmp`` when that folder's path is
    too long for a socket's. Spark's default place, the JVM's temporary folder, can be too
    deep: the crash tests' JVMs failed to start with "AF_UNIX path too long"."""
    name = f"clickstream-sockets-{os.getuid()}"
    folder = Path(tempfile.gettempdir()) / name
    if len(str(folder)) + SPARK_SOCKET_NAME_CHARS > MAX_SOCKET_PATH_CHARS:
        folder = Path("/tmp") / name
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise ConfigError(
            f"{folder} is not a folder only this user can open (mode "
            f"{stat.filemode(found.st_mode)}, owner uid {found.st_uid}): Spark's Python "
            "processes would meet the JVM through it; remove it, or set TMPDIR to another "
            "temporary folder")
    remove_dead_sockets(folder)
    return folder


def remove_dead_sockets(folder: Path) -> None:
    """Remove the socket files in ``folder`` no process holds: a JVM or Python daemon killed
    with -9 leaves its sockets behind (the crash tests left ~20 in six minutes). A socket is
    held while the kernel lists its path in ``/proc/net/unix``; probing it by connecting
    instead would be a stranger at a live socket. Elsewhere than Linux they stay."""
    # Listed first: a socket bound after the kernel's table was read is not in this list.
    files = list(folder.glob(".*.sock"))
    try:
        table = Path("/proc/net/unix").read_text()
    except FileNotFoundError:
        return
    held = {fields[7] for fields in (line.split(maxsplit=7) for line in table.splitlines()[1:])
            if len(fields) == 8}
    for path in files:
        if str(path) not in held:
            path.unlink(missing_ok=True)


def driver_launch_conf(config: Config, *, long_running: bool = False) -> dict[str, str]:
    """The Spark settings that size the driver's JVM, for whoever starts it: this module's
    :func:`build_spark`, or ``spark-submit --conf`` (``orchestration.spark_job``).

    A ``long_running`` driver (the continuous sessionizer) takes its whole heap when it starts
    (``-Xms`` equal to ``CLICKSTREAM_DRIVER_MEMORY``, pages touched up front): otherwise the
    collector grows the committed heap toward its cap over the first minutes and keeps it, so the
    process slowly claims memory other jobs on the machine counted on, and its RSS mixes heap
    sizing with real growth. Fixed, the memory a service needs is known at start, and RSS
    growth is growth outside the heap. Batch jobs keep a heap that grows only when needed.
    Every driver maps the environment's class archive when there is one
    (:mod:`clickstream.jvm_class_archive`), and runs ``CLICKSTREAM_DRIVER_GC``'s collector
    unless the environment's JVM options choose one (:func:`collector_options`).
    """
    # Quoted: Spark splits extraJavaOptions at spaces, and paths may hold some.
    deployments = spark_defaults_java_options()
    java_options = [f'"-Dderby.system.home={config.home}"', COMPILE_HUGE_METHODS,
                    *jvm_class_archive.launch_options(config),
                    *([] if _SELECTS_COLLECTOR.search(deployments) else collector_options(config))]
    if long_running:
        java_options += [f"-Xms{config.driver_memory}", "-XX:+AlwaysPreTouch"]
    if deployments:  # last: they win over the product's where both set one
        java_options.append(deployments)
    return {"spark.driver.memory": config.driver_memory,
            "spark.driver.extraJavaOptions": " ".join(java_options)}


def spark_defaults_java_options() -> str:
    """``spark.driver.extraJavaOptions`` of the deployment's ``spark-defaults.conf``
    (``$SPARK_CONF_DIR``, else Spark's ``conf`` folder). The product's setting, passed as
    ``--conf``, replaces that file's: its options (a truststore, a proxy, a heap dump on
    out-of-memory) were dropped without a word, so they are carried over."""
    folder = os.environ.get("SPARK_CONF_DIR") or jvm_class_archive.spark_home() / "conf"
    try:
        lines = Path(folder, "spark-defaults.conf").read_text(encoding="utf-8").splitlines()
    except OSError:  # none (pip's pyspark ships none), or not readable: nothing to carry over
        return ""
    found = ""
    for line in lines:  # Java properties as Spark reads them: key, then = : or blanks, value
        match = _DEFAULTS_LINE.match(line.strip())
        if match and match.group(1) == "spark.driver.extraJavaOptions":
            found = match.group(2).strip()  # the last one wins, as in a properties file
    return found


_DEFAULTS_LINE = re.compile(r"([^\s=:#!]+)\s*[=:\s]\s*(.*)")


# Up to this many keys, a job sends them to every task (~70 bytes a key in memory) rather
# than shuffling the rows they select to meet them. At the cap, broadcast and shuffle took
# about as long (6.0 / 6.1 s for 2.6M rows; the heap in use +0.3 GiB, BENCHMARKS.md session 17).
BROADCAST_KEYS_MAX = 2_000_000


def broadcast_up_to_cap(keys: DataFrame, how_many: int) -> DataFrame:
    """``keys`` hinted to be sent to every task when they are at most
    :data:`BROADCAST_KEYS_MAX` rows, else as they are (the join then shuffles to meet them).
    ``how_many`` is counted by the caller, who usually has it from a job it runs anyway."""
    return F.broadcast(keys) if how_many <= BROADCAST_KEYS_MAX else keys


# HotSpot leaves a method of more than 8,000 bytecodes to the interpreter. Whole-stage codegen
# puts a stage's whole projection in one method, and the stream's parser and checks (one
# reason per rule, every rule evaluated for a valid record) make it larger than that: parsing
# 1M records took 15.5 s interpreted and 9.4 s compiled (BENCHMARKS.md, session 82). On a
# cluster, executors run that code: give them the flag too (spark-defaults.conf's
# spark.executor.extraJavaOptions; README, Cluster profile).
COMPILE_HUGE_METHODS = "-XX:-DontCompileHugeMethods"
COLLECTOR_FLAGS = {"parallel": "-XX:+UseParallelGC", "g1": "-XX:+UseG1GC"}
# Variables whose JVM options every JVM started here reads (the java launcher, the JVM itself).
JVM_OPTION_VARIABLES = ("JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS")
_SELECTS_COLLECTOR = re.compile(r"-XX:\+Use\w+GC\b")


def collector_options(config: Config) -> list[str]:
    """The driver's garbage collector flag: none when a variable of
    :data:`JVM_OPTION_VARIABLES` already selects a collector, which then wins (a JVM given
    two refuses to start: "Multiple garbage collectors selected")."""
    if any(_SELECTS_COLLECTOR.search(os.environ.get(name, "")) for name in JVM_OPTION_VARIABLES):
        return []
    return [COLLECTOR_FLAGS[config.driver_gc]]


def driver_heap_mib(spark: SparkSession) -> int:
    """The running driver JVM's maximum heap (its -Xmx), in MiB. Read as the JVM's
    ``MaxHeapSize``: ``Runtime.maxMemory()`` leaves out a survivor space under the parallel
    collector (3,641 MiB of a 4 GiB heap)."""
    return int(jvm_option(spark, "MaxHeapSize")) // 2**20


def jvm_option(spark: SparkSession, name: str) -> str:
    """The running driver JVM's value of HotSpot option ``name`` (``-XX:``), as text."""
    jvm = spark.sparkContext._jvm
    diagnostics = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    return str(diagnostics.getVMOption(name).getValue())


def submitted_master() -> str | None:
    """The master ``spark-submit`` launched this driver with (for the DAGs: the
    ``spark_default`` connection); None when the process was not started by spark-submit."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return None
    from pyspark import SparkConf
    from pyspark.context import SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM; starts no new one
    return SparkConf().get("spark.master", None)


def submitted_args(command: str, args: list[str]) -> list[str]:
    """CLI arguments for a spark-submit entry point: ``command`` and ``args``, plus the
    submitted master as ``--spark-master`` unless the arguments name one."""
    master = None if any(a.startswith("--spark-master") for a in args) else submitted_master()
    return [command, *args, *(["--spark-master", master] if master else [])]


# Frames made by keep(), by id, with the JVM RDD holding their blocks, until released.
_KEPT: dict[int, tuple[DataFrame, JavaObject]] = {}


def keep(frame: DataFrame) -> DataFrame:
    """``frame`` computed now and kept in the executors' block stores until :func:`release`.

    Rather than ``persist``: a persisted frame keeps its lineage, and Spark writes a query's
    whole plan out as text for its listeners when it starts and again at every adaptive
    re-plan, UI on or off, a persisted frame's cached plan included, and the cached plans
    inside that one too. The recompute builds queries on several frames built on each
    other, and planned and printed their lineage again in each (BENCHMARKS.md, session 34).
    A kept frame is a local checkpoint: a query built on it plans a scan of its blocks.

    Unlike a persisted frame, a released one cannot be computed again: a use after
    :func:`release` fails (``CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND``) instead of reading its
    sources a second time; so does one that reads blocks from an executor lost since.
    """
    kept = frame.localCheckpoint(eager=True)
    _KEPT[id(kept)] = (kept, kept._jdf.queryExecution().analyzed().rdd())
    return kept


def release(*frames: DataFrame | None) -> None:
    """Free the blocks of frames made by :func:`keep` and unpersist any others (None:
    nothing to release)."""
    for frame in frames:
        if frame is None:
            continue
        kept = _KEPT.pop(id(frame), None)
        if kept is None:
            frame.unpersist()
        else:
            _free_blocks(kept[1])


def _free_blocks(rdd: JavaObject) -> None:
    # What RDD.unpersist does, without its warning that a checkpointed RDD cannot be
    # recomputed (keep() says so); the cleaner does the same once the RDD is garbage.
    rdd.context().unpersistRDD(rdd.id(), False)


def releases_cache(job: Callable[P, R]) -> Callable[P, R]:
    """Free every cached DataFrame of the active session, and every kept one, when ``job``
    ends, however it ends.

    Batch jobs persist or keep intermediate frames; a job that stops on an error (a refused
    batch, a failed gate) would otherwise leave them in memory, and a long-lived session (the
    test suite, a notebook, an in-process Airflow task) would fill its heap run after run. A
    job owns its session's cache while it runs: do not share one session between concurrent
    jobs.
    """
    @functools.wraps(job)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            result = job(*args, **kwargs)
        except BaseException as error:
            # fails too when the job's error was the JVM's end: the job's error is shown
            with noted_on(error, "freeing the job's cached frames"):
                _free_cache()
            raise
        _free_cache()
        return result
    return run


def _free_cache() -> None:
    kept = list(_KEPT.values())
    _KEPT.clear()  # tried once: a dead JVM frees nothing, and its frames are not kept on
    try:  # the active session is per thread: a job off the main thread has none
        spark = SparkSession.getActiveSession() or SparkSession._instantiatedSession
        if spark is not None:
            spark.catalog.clearCache()
    finally:
        for _, rdd in kept:
            _free_blocks(rdd)
