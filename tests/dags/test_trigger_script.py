"""scripts/airflow_demo.py against Airflow's own REST API (the API server's app in process):
a run the API refuses, or a DAG it does not know, ends with the API's reason."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import pytest

from clickstream.config import Config
from clickstream.errors import QualityGateFailedError
from clickstream.jobs import backfill_steps
from tests.dags.airflow_env import DAGS, REPO, admin_token, api_server_app
from tests.dags.test_late_batch_backfill import history


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


def test_an_api_that_does_not_answer_or_a_missing_passwords_file_is_one_line(
        trigger_script, tmp_path, refusing_port: int) -> None:
    url = f"http://127.0.0.1:{refusing_port}"
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"admin": "x"}))
    with pytest.raises(SystemExit) as down:
        trigger_script.main(["trigger", "late_batch_backfill", "--url", url,
                             "--password-file", str(passwords)])
    assert str(down.value).startswith(f"airflow_demo: the Airflow API at {url} does not answer")
    with pytest.raises(SystemExit) as missing:
        trigger_script.main(["trigger", "late_batch_backfill", "--url", url,
                             "--password-file", str(tmp_path / "none.json")])
    assert str(missing.value) == (f"airflow_demo: [Errno 2] No such file or directory: "
                                  f"'{tmp_path / 'none.json'}' (--password-file)")


def test_a_backfill_runs_summary_is_printed_in_full(trigger_script, env_config: Config,
                                                   spark, capsys) -> None:
    """The reports index keeps only a summary's first 500 characters: the demo printed its
    recompute line cut in the middle ('sessions created 187, updated 7, retracte ...')."""
    config = env_config
    history(config, "late")
    conf = {"client": "client-00", "kind": "pageviews", "path": "late/pageviews",
            "dry_run": False}
    batch = {"kind": "pageviews", "client_id": "client-00", "path": conf["path"]}
    run_id = backfill_steps.locate_batch(config, **batch)["run_id"]
    since = datetime.now(UTC).isoformat()
    for step in backfill_steps.STEPS:
        backfill_steps.run_step(config, step, run_id=run_id, spark=spark,
                                progress=lambda _: None, **batch)
    capsys.readouterr()

    trigger_script.print_run_summary(conf, since, "success")

    lines = capsys.readouterr().out.splitlines()
    recompute = backfill_steps.recompute_result(config, run_id)
    assert lines[0].startswith("  summary (") and lines[0].endswith(".html):")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  validate", "  merge", "  recompute", "  check", "  publish"]
    assert lines[3].startswith(f"  recompute: {recompute.describe()} (")
    assert recompute.sessions_created > 0


def test_a_dry_runs_summary_is_printed(trigger_script, env_config: Config, spark,
                                       capsys) -> None:
    """It looked only for a real run's page: a dry run said it had no summary."""
    config = env_config
    history(config, "late")
    conf = {"client": "client-00", "kind": "orders", "path": "late/orders", "dry_run": True}
    batch = {"kind": "orders", "client_id": "client-00", "path": conf["path"]}
    run_id = backfill_steps.locate_batch(config, **batch)["run_id"]
    since = datetime.now(UTC).isoformat()
    for step in ("check", "report"):  # the DAG's dry run: validate_batch, then report
        backfill_steps.run_step(config, step, run_id=run_id, spark=spark, dry_run=True,
                                progress=lambda _: None, **batch)
    capsys.readouterr()

    trigger_script.print_run_summary(conf, since, "success")

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  summary (") and lines[0].endswith(".dry-run.html):")
    assert [line.split(":")[0] for line in lines[1:]] == ["  validate", "  dry run"]


def test_a_failed_backfill_runs_summary_ends_with_the_failed_steps_reason(
        trigger_script, env_config: Config, spark, capsys) -> None:
    config = env_config
    history(config, "late")
    conf = {"client": "client-01", "kind": "orders", "path": "late/orders", "dry_run": False}
    batch = {"kind": "orders", "client_id": "client-01", "path": conf["path"]}  # client-00's
    run_id = backfill_steps.locate_batch(config, **batch)["run_id"]
    since = datetime.now(UTC).isoformat()
    backfill_steps.run_step(config, "check", run_id=run_id, spark=spark,
                            progress=lambda _: None, **batch)
    with pytest.raises(QualityGateFailedError):
        backfill_steps.run_step(config, "merge", run_id=run_id, spark=spark,
                                progress=lambda _: None, **batch)
    capsys.readouterr()

    trigger_script.print_run_summary(conf, since, "failed")

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  summary (") and lines[1].startswith("  validate: ")
    assert len(lines) == 3
    assert lines[-1].startswith("  merge: failed: QualityGateFailedError: most of the batch's "
                                "rows (100%) are of client 'client-00'")
