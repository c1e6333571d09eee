"""table_maintenance and scheduled_recompute run through dag.test() on the embedded profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from clickstream.config import Config
from clickstream.errors import ConfigError
from clickstream.jobs.maintenance import vacuum_tables
from tests.dags.test_late_batch_backfill import changed_assets
from tests.jobs.test_maintenance import corrupt_one_file, removed_hours_ago, small_files


@pytest.fixture(scope="module")
def dagbag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    from tests.dags.airflow_env import DAGS

    return DagBag(dag_folder=str(DAGS))


def test_maintenance_compacts_vacuums_and_checkpoints_every_table(dagbag,
                                                                  env_config: Config) -> None:
    """Two tables: quarantine's files were compacted away 200 hours ago (past the week the
    vacuum keeps), pageviews holds a micro-batch's small files (a vacuum that deleted nothing
    passed here before)."""
    from deltalake import DeltaTable

    vacuumed = small_files(env_config, "quarantine", 3)
    removed_hours_ago(env_config, vacuumed, 200)
    compacted = small_files(env_config, "pageviews", 3)

    dagrun = dagbag.dags["table_maintenance"].test()

    states = {ti.task_id: str(ti.state) for ti in dagrun.get_task_instances()}
    assert str(dagrun.state) == "success", states
    for path in (compacted, vacuumed):
        table = DeltaTable(str(path))
        (active,) = (Path(uri.removeprefix("file://")).name for uri in table.file_uris())
        assert table.to_pyarrow_table().num_rows == 3
        assert list((path / "_delta_log").glob("*.checkpoint.parquet")), path
        on_disk = sorted(p.name for p in path.glob("*.parquet"))
        # The compaction's removed files stay their week; those removed 200 h ago are gone.
        assert (on_disk == [active]) == (path == vacuumed), (path, on_disk)


def test_a_failed_compaction_still_vacuums_and_checkpoints_then_fails_the_run(
        dagbag, env_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltalake import DeltaTable

    dag = dagbag.dags["table_maintenance"]
    monkeypatch.setattr(dag.task_dict["compact"], "retries", 0)  # not 2 retries 5 min apart
    paths = {name: small_files(env_config, name, 3) for name in ("pageviews", "quarantine")}
    corrupt_one_file(paths["pageviews"])  # compacting pageviews fails

    dagrun = dag.test()

    states = {ti.task_id: str(ti.state) for ti in dagrun.get_task_instances()}
    assert states == {"compact": "failed", "vacuum": "success", "checkpoint": "success",
                      "watcher": "failed"}, states
    assert str(dagrun.state) == "failed"  # the week's failure shows on the run
    assert len(DeltaTable(str(paths["quarantine"])).file_uris()) == 1
    for path in paths.values():
        assert list((path / "_delta_log").glob("*.checkpoint.parquet")), path


def test_vacuum_below_seven_days_is_refused(dagbag, env_config: Config) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ConfigError, match="below the safe minimum of 168 h"):
        vacuum_tables(env_config, retention_hours=1)
    with pytest.raises(ConfigError, match="above 87600 h"):  # delta-rs panicked on ~2.5e12 h
        vacuum_tables(env_config, retention_hours=10**13)
    with pytest.raises(ParamValidationError):
        dagbag.dags["table_maintenance"].test(run_conf={"retention_hours": 24})


def test_scheduled_recompute_with_an_empty_queue_succeeds_and_announces_no_change(
        dagbag, env_config: Config) -> None:
    """Its four tables were announced as changed every night (static outlets), waking the
    DAGs scheduled on them for nothing."""
    dagrun = dagbag.dags["scheduled_recompute"].test()
    assert str(dagrun.state) == "success"
    assert {ti.task_id: str(ti.state) for ti in dagrun.get_task_instances()} == {
        "recompute_queue": "success", "announce_changes": "success", "watcher": "skipped"}
    assert changed_assets(dagrun) == set()


def recompute_task(dagrun):
    """The run's recompute task. The task announcing what it changed ran anyway (the job
    never started: nothing), and ``watcher`` failed the run."""
    states = {ti.task_id: ti for ti in dagrun.get_task_instances()}
    assert (str(states["announce_changes"].state), str(states["watcher"].state)) == (
        "success", "failed")
    return states["recompute_queue"]


def test_a_client_the_form_lets_through_and_the_job_refuses_fails_the_task_at_once(
        dagbag, env_config: Config, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture) -> None:
    """The form counts characters, the rule bytes: 40 two-byte characters pass the form, and
    the job's argument parser refuses them, as it would on every retry (O1)."""
    client = "\u00e9" * 40
    assert dagbag.dags["scheduled_recompute"].params.get_param("client").resolve(client)

    dagrun = dagbag.dags["scheduled_recompute"].test(run_conf={"client": client})

    assert str(dagrun.state) == "failed"
    ti = recompute_task(dagrun)
    assert (str(ti.state), ti.try_number) == ("failed", 1), "a refused argument was retried"
    output = capfd.readouterr().out + caplog.text
    assert "AirflowFailException: clickstream recompute: error: argument --client: " in output
    assert "longer than 64 bytes of UTF-8" in output


def test_a_misspelled_parameter_fails_the_task_that_would_ignore_it(
        dagbag, env_config: Config, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture) -> None:
    """Airflow ignores a conf key the DAG has no Param for: the vacuum ran at the default
    retention, the recompute for every client (O1)."""
    maintenance = dagbag.dags["table_maintenance"].test(run_conf={"retention-hours": 1000})
    states = {ti.task_id: (str(ti.state), ti.try_number)
              for ti in maintenance.get_task_instances()}
    assert states["vacuum"] == ("failed", 1), states
    assert str(maintenance.state) == "failed"

    recompute = dagbag.dags["scheduled_recompute"].test(run_conf={"client_id": "client-00"})
    ti = recompute_task(recompute)
    assert (str(ti.state), ti.try_number) == ("failed", 1)
    output = capfd.readouterr().out + caplog.text
    assert "the run's conf has 'retention-hours', which this DAG has no parameter for (it " \
           "has retention_hours)" in output
    assert "the run's conf has 'client_id', which this DAG has no parameter for (it has " \
           "client)" in output
