"""scripts/airflow_demo.py against Airflow's own REST API (the API server's app in process):
a run the API refuses, or a DAG it does not know, ends with the API's reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.dags.airflow_env import DAGS, REPO, admin_token, api_server_app


@pytest.fixture(scope="module")
def trigger_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "airflow_demo", REPO / "scripts" / "airflow_demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def api(airflow_db) -> Iterator[Any]:
    """A REST API client logged in as admin, with this repository's DAGs in the metadata DB
    (as the dag-processor stores them)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from fastapi.testclient import TestClient

    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(DagBag(dag_folder=str(DAGS)), "dags-folder", None)
    with api_server_app() as app, TestClient(
            app, base_url="http://testserver/api/v2",
            headers={"Authorization": f"Bearer {admin_token()}"}) as client:
        yield client


def test_a_conf_the_api_refuses_ends_with_the_apis_reason(trigger_script, api) -> None:
    conf = {"client": "client-00", "kind": "order", "path": "late/orders", "dry_run": False}
    with pytest.raises(SystemExit) as refused:
        trigger_script.trigger(api, "late_batch_backfill", conf, timeout_s=5)
    message = str(refused.value)
    assert message.startswith("trigger late_batch_backfill: the API refused it (400): ")
    assert "'order' is not one of ['orders', 'pageviews']" in message


def test_a_dag_id_airflow_does_not_know_is_named_with_the_ones_it_knows(trigger_script,
                                                                        api) -> None:
    with pytest.raises(SystemExit) as unknown:
        trigger_script.wait_for_dag(api, "late_batch_backfil", timeout_s=0)
    message = str(unknown.value)
    assert message.startswith("no DAG 'late_batch_backfil' after 0 s: Airflow knows ")
    assert "late_batch_backfill, scheduled_recompute, sessionizer, table_maintenance" in message
