"""docker-compose.yml (the cluster profile), checked structurally: Docker cannot run here."""

from __future__ import annotations

import re

import pytest
import yaml

from clickstream.config import ENV_NAMES
from tests.dags.airflow_env import REPO

SERVICES = {"kafka", "spark-master", "spark-worker", "postgres", "airflow-api-server",
            "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"}
RUNS_PRODUCT_CODE = {"spark-master", "spark-worker", "airflow-api-server", "airflow-scheduler",
                     "airflow-dag-processor", "airflow-triggerer"}
SHARED = {"CLICKSTREAM_WAREHOUSE": "warehouse", "CLICKSTREAM_HOME": "home",
          "CLICKSTREAM_LANDING": "landing"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def volumes_of(service: dict) -> dict[str, str]:
    """{mount point: named volume} of a service."""
    return {entry.split(":")[1]: entry.split(":")[0] for entry in service.get("volumes", [])}


def test_every_service_of_the_cluster_profile_is_there(compose: dict) -> None:
    assert set(compose["services"]) >= SERVICES


def test_environment_names_are_the_products(compose: dict) -> None:
    known = set(ENV_NAMES.values())
    for name, service in compose["services"].items():
        for variable in service.get("environment") or {}:
            if variable.startswith("CLICKSTREAM_") or variable == "KAFKA_BOOTSTRAP_SERVERS":
                assert variable in known, f"{name}: {variable} is not in config.ENV_NAMES"


@pytest.mark.parametrize("name", sorted(RUNS_PRODUCT_CODE))
def test_product_services_share_configuration_and_data(compose: dict, name: str) -> None:
    service = compose["services"][name]
    env = service["environment"]
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert env["CLICKSTREAM_SPARK_MASTER"] == "spark://spark-master:7077"
    mounts = volumes_of(service)
    for variable, volume in SHARED.items():
        assert mounts.get(env[variable]) == volume, f"{name}: {variable} is not on {volume}"
        assert volume in compose["volumes"]


def test_airflow_submits_to_the_spark_master_and_reads_this_repos_dags(compose: dict) -> None:
    for name in sorted(s for s in RUNS_PRODUCT_CODE if s.startswith("airflow-")):
        env = compose["services"][name]["environment"]
        assert env["AIRFLOW_CONN_SPARK_DEFAULT"] == "spark://spark-master:7077"
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/clickstream/dags"
        assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == "/opt/clickstream/plugins"
    dockerfile = (REPO / "Dockerfile").read_text()
    for folder in ("dags", "plugins", "spark", "expectations"):
        assert f"COPY {folder} ./{folder}" in dockerfile


def test_no_secret_has_a_default_and_nothing_listens_beyond_localhost(compose: dict) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    for name, service in compose["services"].items():
        for variable, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD$|SECRET|FERNET|SQL_ALCHEMY_CONN", variable):
                assert re.search(r"\$\{[A-Z_]+:\?", str(value)), f"{name}: {variable}"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"
    assert ":-" not in text, "a ${VAR:-default} would give a secret a default"


def test_the_never_ending_sessionizer_leaves_the_worker_cores_for_another_job(
        compose: dict) -> None:
    """A standalone master gives an application without ``spark.cores.max`` every free core;
    the sessionizer would then hold them all, and a backfill would wait for as long as it runs.
    """
    master = compose["services"]["spark-master"]["environment"]
    worker = compose["services"]["spark-worker"]["environment"]
    default_cores = re.search(r"-Dspark\.deploy\.defaultCores=(\d+)\b",
                              master.get("SPARK_MASTER_OPTS", ""))
    assert default_cores, "the master sets no spark.deploy.defaultCores"
    assert int(worker["SPARK_WORKER_CORES"]) >= 2 * int(default_cores.group(1))
