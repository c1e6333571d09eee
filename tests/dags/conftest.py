"""Airflow is configured (temporary AIRFLOW_HOME, SQLite) before any test imports it."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from tests import child_jvm
from tests.dags.airflow_env import configure_airflow_env

configure_airflow_env()

from clickstream.config import Config  # noqa: E402
from clickstream.io.kafka_broker import EmbeddedBroker  # noqa: E402
from tests.dags.airflow_env import airflow_db  # noqa: E402, F401  (fixture)


@pytest.fixture
def env_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, broker: EmbeddedBroker,
               spark, request: pytest.FixtureRequest) -> Config:
    """The task environment: CLICKSTREAM_* variables (tasks build Config.from_env()), a
    uuid-named topic set, the metadata DB and the session's SparkSession."""
    request.getfixturevalue("airflow_db")
    suffix = uuid.uuid4().hex[:8]
    values = {
        "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"),
        "CLICKSTREAM_HOME": str(tmp_path / "home"),
        "CLICKSTREAM_LANDING": str(tmp_path / "landing"),
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
        "CLICKSTREAM_SPARK_MASTER": "local[2]",
        "CLICKSTREAM_SHUFFLE_PARTITIONS": "2",
        "CLICKSTREAM_EVENTS_TOPIC": f"events-{suffix}",
        "CLICKSTREAM_SESSIONS_TOPIC": f"sessions-{suffix}",
        "CLICKSTREAM_ATTRIBUTIONS_TOPIC": f"attributions-{suffix}",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    # The embedded profile's spark_default connection, as scripts/airflow.sh sets it (master
    # local[2] here), pyspark's spark-submit on PATH for SparkSubmitOperator, and the JVM
    # settings of the tests' child processes (this worker's own JVM is running already).
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", child_jvm.JAVA_TOOL_OPTIONS)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://local%5B2%5D")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep
                       + os.environ["PATH"])
    config = Config.from_env()
    for topic in (config.events_topic, config.sessions_topic, config.attributions_topic):
        broker.create_topic(topic, 4)
    config.landing.mkdir(parents=True)
    return config
