"""Every DAG parses, has the expected tasks and schedule, and touches nothing while parsing."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clickstream.jobs.maintenance import MAX_VACUUM_RETENTION_HOURS, MIN_VACUUM_RETENTION_HOURS
from tests.dags.airflow_env import DAGS

EXPECTED = {
    "sessionizer": ["sessionize"],
    "late_batch_backfill": ["locate_batch", "validate_batch", "writes_enabled", "merge",
                            "recompute", "validate_corrections", "publish", "report",
                            "announce_merge", "announce_recompute"],
    "scheduled_recompute": ["recompute_queue", "announce_changes", "watcher"],
    "table_maintenance": ["compact", "vacuum", "checkpoint", "watcher"],
}


class TouchedAtParseTime(AssertionError):
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise TouchedAtParseTime(f"{what} used while parsing DAG files")
    return refuse


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_every_dag_imports_without_errors(dagbag) -> None:
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) == set(EXPECTED)


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_one_dag_per_file_named_after_it_with_tasks_and_docs(dagbag, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    assert Path(dag.fileloc).stem == dag_id
    assert sorted(dag.task_ids) == sorted(EXPECTED[dag_id])
    assert dag.doc_md and dag.doc_md.lstrip().startswith("#")
    for name, param in dag.params.items():
        assert param.description, f"{dag_id} param {name} has no description for the form"


def test_backfill_steps_run_in_order_and_report_always_runs(dagbag) -> None:
    dag = dagbag.dags["late_batch_backfill"]
    order = EXPECTED["late_batch_backfill"][:-2]  # the steps, then the two announcements
    for upstream, downstream in itertools.pairwise(order):
        assert downstream in dag.get_task(upstream).downstream_task_ids
    assert dag.get_task("report").trigger_rule == "none_failed"
    assert dag.max_active_runs == 1
    params = dag.params
    assert params.get_param("kind").schema["enum"] == ["orders", "pageviews"]
    assert params.get_param("dry_run").schema["type"] == "boolean"
    assert params.get_param("client").schema["type"] == "string"
    assert "landing folder" in params.get_param("path").description
    # A refusal fails at once (exit 3, O1); a JVM that died is worth another try.
    for task_id in ("validate_batch", "merge", "recompute", "validate_corrections", "publish"):
        assert dag.get_task(task_id).retries >= 1, f"{task_id} is idempotent: retry it"
    assert "announce_merge" in dag.get_task("merge").downstream_task_ids


def test_backfill_and_recompute_emit_table_assets(dagbag) -> None:
    from airflow.sdk import Asset, AssetAlias

    def uris(task) -> set[str]:
        return {o.uri for o in task.outlets if isinstance(o, Asset)}

    def alias(task) -> bool:
        return any(isinstance(o, AssetAlias) for o in task.outlets) and not uris(task)

    backfill = dagbag.dags["late_batch_backfill"]
    recompute = dagbag.dags["scheduled_recompute"]
    # The tables a run changed, announced by a task that reads what the job did.
    assert alias(backfill.get_task("announce_merge"))
    assert alias(backfill.get_task("announce_recompute"))
    assert alias(recompute.get_task("announce_changes"))
    for task in (backfill.get_task("recompute"), recompute.get_task("recompute_queue")):
        assert not task.outlets
    # Each announces after its step failed too (a failed step may have committed first), so
    # that step is its one upstream: one_done over several fired at the first one done.
    for announce, step in (("announce_merge", "merge"), ("announce_recompute", "recompute")):
        task = backfill.get_task(announce)
        assert (task.trigger_rule, task.upstream_task_ids) == ("one_done", {step}), announce
    assert "announce_changes" in recompute.get_task("recompute_queue").downstream_task_ids


def test_schedules(dagbag) -> None:
    sessionizer = dagbag.dags["sessionizer"]
    assert sessionizer.schedule == "@continuous"
    assert type(sessionizer.timetable).__name__ == "ContinuousTimetable"
    assert sessionizer.max_active_runs == 1
    assert dagbag.dags["late_batch_backfill"].schedule is None  # triggered from the form
    assert dagbag.dags["scheduled_recompute"].schedule == "30 2 * * *"
    assert dagbag.dags["table_maintenance"].schedule == "0 3 * * 0"
    retention = dagbag.dags["table_maintenance"].params.get_param("retention_hours").schema
    assert (retention["minimum"], retention["maximum"]) == (MIN_VACUUM_RETENTION_HOURS,
                                                            MAX_VACUUM_RETENTION_HOURS)
    # A failure retries cannot fix pauses the continuous DAG instead of restarting it forever.
    assert sessionizer.max_consecutive_failed_dag_runs == 6


@pytest.mark.parametrize(("dag_id", "value", "accepted"), [
    ("late_batch_backfill", "client-00", True), ("late_batch_backfill", "a b", True),
    ("late_batch_backfill", "", False), ("late_batch_backfill", " client-00", False),
    ("late_batch_backfill", "client-00\n", False), ("scheduled_recompute", None, True),
    ("scheduled_recompute", "", True), ("scheduled_recompute", "client-00", True),
    ("scheduled_recompute", "client-00 ", False)])
def test_the_client_param_refuses_what_matches_no_row(dagbag, dag_id: str, value: str | None,
                                                      accepted: bool) -> None:
    """Rows are matched to the client exactly: a space around it quarantined a whole batch
    as another client's. The CLI refuses the same values (cli._client_id)."""
    from airflow.sdk.exceptions import ParamValidationError

    param = dagbag.dags[dag_id].params.get_param("client")
    if accepted:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)

SPARK_TASKS = {
    ("sessionizer", "sessionize"): "sessionize.py",
    ("late_batch_backfill", "validate_batch"): "backfill_step.py",
    ("late_batch_backfill", "merge"): "backfill_step.py",
    ("late_batch_backfill", "recompute"): "backfill_step.py",
    ("late_batch_backfill", "validate_corrections"): "backfill_step.py",
    ("late_batch_backfill", "publish"): "backfill_step.py",
    ("late_batch_backfill", "report"): "backfill_step.py",
    ("scheduled_recompute", "recompute_queue"): "recompute.py",
}


@pytest.mark.parametrize(("dag_id", "task_id"), sorted(SPARK_TASKS))
def test_spark_jobs_are_submitted_through_spark_default(dagbag, dag_id: str,
                                                        task_id: str) -> None:
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    task = dagbag.dags[dag_id].get_task(task_id)
    assert isinstance(task, SparkSubmitOperator)
    assert task._conn_id == "spark_default"
    # A worker without a UTF-8 locale mangled a non-ASCII --client in spark-submit (O4).
    assert (task.env_vars or {}).get("LC_ALL") == "C.UTF-8"
    assert Path(task.application).is_file()
    assert Path(task.application).name == SPARK_TASKS[dag_id, task_id]
    if dag_id == "sessionizer":
        assert task.retries >= 1  # a retry resumes from the checkpoint


def test_a_deployments_default_task_timeout_bounds_the_batch_steps_not_the_sessionizer(
) -> None:
    """(O5 of ``orchestration``) Parsed where Airflow bounds every task's time by default: the
    never-ending sessionizer would be killed at each interval and counted as failed."""
    script = ("import json, sys\n"
              "from airflow.dag_processing.dagbag import DagBag\n"
              "bag = DagBag(dag_folder=sys.argv[1])\n"
              "assert not bag.import_errors, bag.import_errors\n"
              "print(json.dumps({f'{d}.{t.task_id}': t.execution_timeout and\n"
              "                  t.execution_timeout.total_seconds()\n"
              "                  for d, dag in bag.dags.items() for t in dag.tasks}))\n")
    result = subprocess.run(
        [sys.executable, "-c", script, str(DAGS)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "AIRFLOW__CORE__DEFAULT_TASK_EXECUTION_TIMEOUT": "3600"})
    assert result.returncode == 0, result.stderr[-3000:]
    timeouts = json.loads(result.stdout.strip().splitlines()[-1])
    assert timeouts.pop("sessionizer.sessionize") is None
    assert set(timeouts) == {f"{dag}.{task}" for dag, tasks in EXPECTED.items()
                             for task in tasks} - {"sessionizer.sessionize"}
    assert set(timeouts.values()) == {3600.0}


def test_parsing_uses_no_connection_variable_spark_kafka_or_files(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Parse every DAG with connections, variables, Spark and the network booby-trapped."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import BaseHook, Connection, Variable
    from pyspark.sql import SparkSession

    for target, name in ((BaseHook, "get_connection"), (Connection, "get"),
                         (Variable, "get"), (SparkSession.Builder, "getOrCreate")):
        monkeypatch.setattr(target, name, _refuse(f"{target.__name__}.{name}"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("a network connection"))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "poisoned://must-not-be-read")
    monkeypatch.setenv("AIRFLOW_VAR_ANYTHING", "poisoned")
    state = {name: tmp_path / name for name in ("warehouse", "home", "landing")}
    for name, path in state.items():
        monkeypatch.setenv(f"CLICKSTREAM_{name.upper()}", str(path))

    bag = DagBag(dag_folder=str(DAGS))

    assert bag.import_errors == {}
    assert set(bag.dag_ids) == set(EXPECTED)
    assert not any(path.exists() for path in state.values()), "a DAG file wrote at parse time"
