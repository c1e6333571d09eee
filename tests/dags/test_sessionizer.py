"""The sessionizer DAG runs the streaming job through SparkSubmitOperator and spark_default."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from clickstream.config import Config
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_produce import produce_records
from clickstream.jobs.generate import Delivery, Scale, live_records, simulate


def test_sessionizer_submits_the_job_with_the_spark_default_connection(
        env_config: Config, spark, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    from airflow.dag_processing.dagbag import DagBag

    from tests.dags.airflow_env import DAGS

    # spark-submit starts the driver's JVM (its own default heap is 1g): the task must pass
    # the configured memory to it, read when the task runs.
    monkeypatch.setenv("CLICKSTREAM_DRIVER_MEMORY", "1280m")
    config = env_config
    scale = Scale(clients=1, users_per_client=30, minutes=360,
                  start=datetime(2026, 11, 1, tzinfo=UTC))
    records = live_records(scale, Delivery(late_fraction=0, duplicate_fraction=0.05,
                                           bad_fraction=0), seed=3)
    produce_records(config, config.events_topic, records)
    pageviews, _ = simulate(scale, 3)
    bag = DagBag(dag_folder=str(DAGS / "sessionizer.py"))

    dagrun = bag.dags["sessionizer"].test(run_conf={"until_caught_up": True})

    assert str(dagrun.state) == "success"
    output = capfd.readouterr().out + caplog.text
    assert "driver heap 1280 MiB" in output
    assert "warning: CLICKSTREAM_DRIVER_MEMORY" not in output
    stored = open_tables(config, spark).read_arrow("pageviews")
    assert stored.num_rows == pageviews.num_rows
    assert len(set(stored.column("event_id").to_pylist())) == pageviews.num_rows
    assert (config.home / "checkpoints" / "sessionize" / "offsets").is_dir()
