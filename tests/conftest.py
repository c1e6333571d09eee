"""Shared fixtures: one SparkSession per test process (each pytest-xdist worker has its own),
a Config rooted in a temp folder."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clickstream.config import Config
from clickstream.io.kafka_broker import EmbeddedBroker

INTERPRETED = {"spark.sql.codegen.wholeStage": "false",
               "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
"""The worker's session evaluates expressions without generating code for them. Its queries
run once each on a few rows: compiling each query's generated Java (Janino), then JIT-compiling
those classes, cost more CPU than running them. Four backfill tests took 14-27% less CPU, in
four alternated pairs (``bench/suite_profile.py``, session 64; ``wholeStage`` off alone: no
difference). Spark's interpreted path gives the same results (its own suites run both ways;
``factoryMode`` is the setting they use for it). The product keeps code generation, and so
do the JVMs the tests start in child processes (the DAGs' spark-submit steps, the crash tests'
CLI runs), so the suite runs both paths."""


@pytest.fixture(scope="session")
def spark_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    root = tmp_path_factory.mktemp("spark")
    return Config(home=root / "home", warehouse=root / "warehouse", landing=root / "landing",
                  spark_master="local[2]", shuffle_partitions=2)


@pytest.fixture(scope="session")
def spark(spark_config: Config) -> Iterator[object]:
    from clickstream.spark_session import build_spark

    session = build_spark(spark_config, "clickstream-tests")
    for key, value in INTERPRETED.items():
        session.conf.set(key, value)
    # Runtime settings for an A/B of the tests' own cost (bench/suite_profile.py): key=value,...
    for setting in filter(None, os.environ.get("CLICKSTREAM_TEST_SPARK_CONF", "").split(",")):
        key, _, value = setting.partition("=")
        session.conf.set(key.strip(), value.strip())
    yield session
    session.stop()


@pytest.fixture
def spark_conf(spark) -> Iterator[Callable[[str, str], None]]:
    """Sets Spark runtime settings for one test (the session is shared) and restores them
    after it, as ``monkeypatch`` does for attributes."""
    previous: dict[str, str] = {}

    def set_conf(key: str, value: str) -> None:
        previous.setdefault(key, spark.conf.get(key))
        spark.conf.set(key, value)

    yield set_conf
    for key, value in previous.items():
        spark.conf.set(key, value)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A fresh warehouse/home/landing per test."""
    return Config(home=tmp_path / "home", warehouse=tmp_path / "warehouse",
                  landing=tmp_path / "landing", spark_master="local[2]", shuffle_partitions=2,
                  trigger_interval_seconds=0.5)


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A 127.0.0.1 port that refuses connections for the whole test: bound, never listening.
    A port merely released could be handed to another worker's JVM (Spark's one-shot result
    sockets), and a Kafka client's reconnects would land there: the likely cause of a crash
    test's ``collect()`` failing in CI with "Authentication failed" from a stranger."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield int(holder.getsockname()[1])


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """The embedded broker on a free port (port 0 lets the OS pick), default topics created."""
    with EmbeddedBroker(port=0) as running:
        yield running


@pytest.fixture
def kafka_config(config: Config, broker: EmbeddedBroker) -> Config:
    """The per-test Config (temp folders) with KAFKA_BOOTSTRAP_SERVERS set to the broker."""
    return config.replace(kafka_bootstrap_servers=broker.bootstrap_servers)


@pytest.fixture
def stream_config(kafka_config: Config, broker: EmbeddedBroker) -> Config:
    """Own topics per test, so tests sharing the broker never see each other's records."""
    suffix = uuid.uuid4().hex[:8]
    topics = {"events_topic": f"events-{suffix}", "sessions_topic": f"sessions-{suffix}",
              "attributions_topic": f"attributions-{suffix}"}
    for name in topics.values():
        broker.create_topic(name, 4)
    return kafka_config.replace(**topics)
