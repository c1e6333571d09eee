"""The driver's JVM gets CLICKSTREAM_DRIVER_MEMORY, or the job says it did not."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.spark_session import build_spark, driver_heap_mib


def test_a_driver_with_less_heap_than_configured_warns(
        spark: SparkSession, spark_config: Config, capfd: pytest.CaptureFixture) -> None:
    heap = driver_heap_mib(spark)
    assert heap == spark_config.driver_memory_mib  # this process started the JVM: it applied

    build_spark(spark_config)
    assert "warning" not in capfd.readouterr().err

    build_spark(spark_config.replace(driver_memory=f"{2 * heap}m"))  # the JVM already runs
    assert (f"CLICKSTREAM_DRIVER_MEMORY={2 * heap}m, but this driver's JVM has a {heap} MiB "
            "heap") in capfd.readouterr().err


def test_dataframe_calls_do_not_send_their_python_call_site_to_the_jvm(
        spark: SparkSession) -> None:
    """PySpark's DataFrame debugging costs ~5 JVM round trips per ``functions`` call; the
    product turns it off (``build_spark``), and PySpark reads the setting once per process."""
    from pyspark.errors.utils import is_debugging_enabled
    from pyspark.sql import functions as F

    spark.range(1).select(F.col("id") + 1).collect()
    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert is_debugging_enabled() is False
