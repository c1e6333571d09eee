"""How the tests start the JVMs of child processes: the spark-submit steps of DAG runs, the
CLI runs of the crash tests, the small drivers that check the product's JVM options
(:func:`submit_driver`).

Each lives for seconds to minutes on a few rows, so C2's optimising compiler, running on the
second core while the other test worker needs it, costs more CPU than its code saves. C1 only
(``-XX:TieredStopAtLevel=1``) took the backfill kill -9 test from 278 to 197 CPU-seconds
(165 to 138 s) in session 32. The JIT tier changes nothing a test asserts; the product keeps the
JVM's defaults, and so does each test worker's own long-lived SparkSession, where C2 pays off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clickstream.config import Config
from clickstream.spark_session import driver_launch_conf

JAVA_TOOL_OPTIONS = "-XX:TieredStopAtLevel=1"
"""Set in a child's environment (the JVM reads it before its command line; it notes so on
stderr: ``Picked up JAVA_TOOL_OPTIONS: ...``)."""


def temp_folders_in(folder: Path) -> dict[str, str]:
    """A child's environment that keeps its JVM's temporary folders (the block manager's,
    Spark's scratch, spark-submit's) in ``folder`` rather than ``/tmp``: a JVM the crash tests
    kill -9 never runs the shutdown hook that deletes them, and each run left them behind."""
    folder.mkdir(parents=True, exist_ok=True)  # native libraries are unpacked there at once
    return {"SPARK_LOCAL_DIRS": str(folder),
            "JAVA_TOOL_OPTIONS": f"{JAVA_TOOL_OPTIONS} -Djava.io.tmpdir={folder}"}


DRIVER_JOB = """
from clickstream.config import Config
from clickstream.spark_session import build_spark
spark = build_spark(Config.from_env())
assert spark.range(100).selectExpr("id % 7 AS k").groupBy("k").count().count() == 7
beans = spark._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
print("collectors:", ",".join(sorted(bean.getName() for bean in beans)))
"""


def submit_driver(tmp_path: Path, config: Config, *conf: str, job: str = DRIVER_JOB
                  ) -> tuple[str, list[str]]:
    """spark-submit a small job (``job``, a script) with the driver options the product
    passes for ``config`` (and ``conf``, more ``key=value`` settings); (its output, the
    JVM's class-load log lines)."""
    script = tmp_path / "job.py"
    script.write_text(job)
    log = tmp_path / "classes.log"
    options = driver_launch_conf(config)["spark.driver.extraJavaOptions"]
    finished = subprocess.run(
        [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]", "--conf",
         f"spark.driver.extraJavaOptions={options} -Xlog:class+load=info:file={log}",
         *(arg for setting in conf for arg in ("--conf", setting)), str(script)],
        env={**os.environ, "CLICKSTREAM_HOME": str(config.home),
             "CLICKSTREAM_WAREHOUSE": str(config.warehouse),
             "PYSPARK_PYTHON": sys.executable},
        capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished.stdout + finished.stderr, log.read_text().splitlines()
