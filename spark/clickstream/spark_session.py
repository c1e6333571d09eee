"""One place that builds the SparkSession, so the CLI, spark-submit entry points and tests agree."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from clickstream.config import Config


def build_spark(config: Config, app_name: str = "clickstream", *, ui: bool = False) -> SparkSession:
    """Get or create the session for ``config``; the UI is off unless asked for."""
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
        .config("spark.sql.shuffle.partitions", str(config.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.sql.warehouse.dir", str(config.home / "spark-warehouse"))
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={config.home}")
    )
    if local:
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1")
    return builder.getOrCreate()
