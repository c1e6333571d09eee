"""late_batch_backfill end to end through dag.test(): embedded broker, local Spark, Delta on
disk, the landing folder in tmp. Corrections must reach Kafka; bad paths must fail the run."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from clickstream.config import Config
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_read import read_compacted
from clickstream.jobs.backfill import run_backfill
from clickstream.jobs.backfill_steps import locate_batch, run_step
from clickstream.jobs.generate import Scale, simulate, write_table
from tests.jobs.test_backfill import run_summaries
from tests.reference import reference_changelog_value

TABLES = ("pageviews", "orders", "sessions", "attributions", "corrections", "quarantine")


@pytest.fixture(scope="module")
def backfill_dag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    from tests.dags.airflow_env import DAGS

    bag = DagBag(dag_folder=str(DAGS / "late_batch_backfill.py"))
    assert bag.import_errors == {}
    return bag.dags["late_batch_backfill"]


def history(config: Config, relative: str) -> tuple[int, int]:
    """One day of pageviews and orders of client-00 in the landing folder."""
    scale = Scale(clients=1, users_per_client=12, minutes=24 * 60,
                  start=datetime(2026, 3, 1, tzinfo=UTC), sessions_per_user_per_day=2.0,
                  order_probability=0.3)
    pageviews, orders = simulate(scale, seed=5, client="client-00")
    write_table(pageviews, config.landing / relative / "pageviews", "parquet")
    write_table(orders, config.landing / relative / "orders", "jsonl")
    return pageviews.num_rows, orders.num_rows


def run(dag, **conf):
    dagrun = dag.test(run_conf={"client": "client-00", "dry_run": False, **conf})
    return dagrun, {ti.task_id: str(ti.state) for ti in dagrun.get_task_instances()}


def versions(config: Config, spark) -> dict[str, int]:
    tables = open_tables(config, spark)
    return {name: tables.version(name) for name in TABLES}


def changed_assets(dagrun) -> set[str]:
    """Tables for which the run emitted Asset events."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        uris = session.scalars(select(AssetModel.uri).join(
            AssetEvent, AssetEvent.asset_id == AssetModel.id).where(
            AssetEvent.source_run_id == dagrun.run_id))
        return {uri.removeprefix("clickstream://warehouse/") for uri in uris}


def asset_rows(dagrun) -> dict[str, int]:
    """The row count each Asset event of the run carries, by table."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        events = session.execute(select(AssetModel.uri, AssetEvent.extra).join(
            AssetEvent, AssetEvent.asset_id == AssetModel.id).where(
            AssetEvent.source_run_id == dagrun.run_id))
        return {uri.removeprefix("clickstream://warehouse/"): extra.get("rows")
                for uri, extra in events}


def assert_topic_equals_table(config: Config, spark, topic: str, table: str, key: str) -> None:
    rows = open_tables(config, spark).read_arrow(table).to_pylist()
    assert read_compacted(config, topic) == {r[key]: reference_changelog_value(r) for r in rows}


# One real run: six spark-submit steps, each its own JVM (~2-3 min on an idle 2-core box). The
# day's pageviews are loaded in-process first (the same library call the steps make), so the
# orders batch has sessions to correct: new revisions on both topics, attributions.
@pytest.mark.timeout(1200)
def test_backfill_publishes_corrections_to_kafka(backfill_dag, env_config: Config,
                                                 spark) -> None:
    config = env_config
    _, n_orders = history(config, "late/2026-03")
    run_backfill(config, kind="pageviews", client_id="client-00",
                 path="late/2026-03/pageviews", spark=spark, progress=lambda _: None)
    revisions_before = {r["session_id"]: r["revision"] for r in
                        open_tables(config, spark).read_arrow("sessions").to_pylist()}

    dagrun, states = run(backfill_dag, kind="orders", path="late/2026-03/orders")

    assert str(dagrun.state) == "success", states
    assert set(states.values()) == {"success"}
    tables = open_tables(config, spark)
    assert tables.read_arrow("orders").num_rows == n_orders
    revisions = {r["session_id"]: r["revision"] for r in tables.read_arrow("sessions").to_pylist()}
    assert revisions.keys() == revisions_before.keys()
    assert any(revisions[k] > revisions_before[k] for k in revisions)
    assert_topic_equals_table(config, spark, config.sessions_topic, "sessions", "session_id")
    assert_topic_equals_table(config, spark, config.attributions_topic, "attributions",
                              "order_id")
    assert {"orders", "sessions", "attributions", "corrections"} <= changed_assets(dagrun)
    causes = {r["cause"] for r in tables.read_arrow("corrections").to_pylist()}
    assert any(c.startswith("backfill orders-client-00-") for c in causes)
    pages = sorted((config.home / "reports" / "backfills").glob("*.html"))
    assert [p.name.split("-")[0] for p in pages] == ["orders", "pageviews"]  # the CLI's too
    assert "publish" in pages[0].read_text()


def test_dry_run_reports_and_writes_nothing(backfill_dag, env_config: Config, spark) -> None:
    config = env_config
    n_pageviews, _ = history(config, "late/dry")

    dagrun, states = run(backfill_dag, kind="pageviews", path="late/dry/pageviews",
                         dry_run=True)

    assert str(dagrun.state) == "success", states
    for task_id in ("locate_batch", "validate_batch", "writes_enabled", "report"):
        assert states[task_id] == "success", states
    for task_id in ("merge", "announce_merge", "recompute", "announce_recompute",
                    "validate_corrections", "publish"):
        assert states[task_id] == "skipped", states
    assert set(versions(config, spark).values()) == {-1}
    report = next((config.home / "reports" / "backfills").glob("*.dry-run.html")).read_text()
    assert f"{n_pageviews} pageviews new or changed" in report
    assert "nothing was written" in report


def test_a_failed_dry_run_announces_none_of_the_tables_a_real_run_of_its_batch_merged(
        backfill_dag, env_config: Config, spark, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run of the batch merged it (the same run id, S2). A dry run of the batch whose
    validate_batch then failed (here spark-submit cannot reach its master; in the field a
    lost JVM) announced that merge's tables as its own Asset events: announce_merge runs
    after a failed upstream (none_skipped), and it read the real run's saved result."""
    config = env_config
    history(config, "late/again")
    batch = {"kind": "orders", "client_id": "client-00", "path": "late/again/orders"}
    run_id = locate_batch(config, **batch)["run_id"]
    for step in ("check", "merge"):
        run_step(config, step, run_id=run_id, spark=spark, progress=lambda _: None, **batch)
    monkeypatch.setattr(backfill_dag.task_dict["validate_batch"], "retries", 0)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", "spark://nowhere%5Bx%5D")

    dagrun, states = run(backfill_dag, kind="orders", path=batch["path"], dry_run=True)

    assert str(dagrun.state) == "failed"
    assert (states["validate_batch"], states["merge"]) == ("failed", "upstream_failed"), states
    assert changed_assets(dagrun) == set()


def test_a_path_outside_the_landing_folder_fails_the_run_with_a_clear_message(
        backfill_dag, env_config: Config, spark, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    config = env_config
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "orders.jsonl").write_text("{}\n")

    dagrun, states = run(backfill_dag, kind="orders", path="../elsewhere")

    assert str(dagrun.state) == "failed"
    assert states["locate_batch"] == "failed"
    assert all(states[t] == "upstream_failed" for t in
               ("validate_batch", "writes_enabled", "merge", "recompute",
                "validate_corrections", "publish", "report")), states
    assert states["announce_merge"] == "skipped", states  # it runs after a failed merge too
    output = capfd.readouterr().out + caplog.text
    assert "outside the landing folder" in output
    assert str(config.landing) in output
    assert set(versions(config, spark).values()) == {-1}


def test_a_conf_key_the_dag_has_no_param_for_fails_the_run_before_it_reads_anything(
        backfill_dag, env_config: Config, spark, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture) -> None:
    """Airflow ignores a conf key it has no Param for: a misspelled dry run would write."""
    history(env_config, "late")

    dagrun, states = run(backfill_dag, kind="orders", path="late/orders",
                         **{"dry-run": True})

    assert str(dagrun.state) == "failed"
    assert states["locate_batch"] == "failed"
    tries = {ti.task_id: ti.try_number for ti in dagrun.get_task_instances()}
    assert tries["locate_batch"] == 1, "a conf a retry cannot fix was retried"
    assert states["merge"] == "upstream_failed", states
    output = capfd.readouterr().out + caplog.text
    assert "the run's conf has 'dry-run', which this DAG has no parameter for (it has " \
           "client, dry_run, kind, path)" in output
    assert set(versions(env_config, spark).values()) == {-1}


def test_a_batch_the_gate_refuses_fails_the_spark_task_at_once_with_its_reason(
        backfill_dag, env_config: Config, spark, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture) -> None:
    """merge runs through spark-submit with retries; a refusal must not be retried (O1). The
    refused rows go to quarantine, and no Asset event said so: announce_merge ran only after a
    merge that succeeded (S7)."""
    config = env_config
    rows = [{"order_id": f"o{i}", "client_id": "client-00", "user_id": "u",
             "ts": f"2026-03-01T10:0{i}:00Z", "amount": "5.00", "currency": "XXX"}
            for i in range(3)]
    (config.landing / "bad").mkdir()
    (config.landing / "bad" / "orders.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows))

    dagrun, states = run(backfill_dag, kind="orders", path="bad")

    assert str(dagrun.state) == "failed"
    assert states["validate_batch"] == "success", states
    assert states["merge"] == "failed", states
    tries = {ti.task_id: ti.try_number for ti in dagrun.get_task_instances()}
    assert tries["merge"] == 1, "a refused batch was retried"
    output = capfd.readouterr().out + caplog.text
    assert "AirflowFailException: clickstream backfill-step: error: quality gate " \
           "historical_batch failed" in output
    assert "bad_currency_fraction = 1, expected at most 0.5" in output
    assert versions(config, spark)["orders"] == -1
    # The run's summary page says which step failed and why, after what validate found.
    ((summary, page),) = run_summaries(config, "orders-client-00-")
    assert summary.status == "failed"
    assert "<th>validate</th>" in page and "3 rows, 0 valid" in page
    assert "merge: failed" in page and "QualityGateFailedError: quality gate " \
        "historical_batch failed" in page and "bad_currency_fraction = 1" in page

    # The refused batch's rows are in quarantine: that change is announced (S7).
    assert open_tables(config, spark).read_arrow("quarantine").num_rows == 3
    assert states["announce_merge"] == "success", states
    assert changed_assets(dagrun) == {"quarantine"}, "quarantine changed, no Asset event"
    assert asset_rows(dagrun) == {"quarantine": 3}


def test_a_non_ascii_client_reaches_the_spark_steps_intact_on_a_worker_without_a_utf8_locale(
        backfill_dag, env_config: Config, spark, monkeypatch: pytest.MonkeyPatch) -> None:
    """Java's launcher decodes and re-encodes argv in the locale's charset: with LANG unset (a
    systemd unit, cron, ``env -i``) ``--client=café`` reached the job as ``caf??``, and a dry
    run went green with every row of the batch to quarantine as another client's (O4)."""
    for name in ("LANG", "LC_ALL", "LC_CTYPE", "LANGUAGE"):
        monkeypatch.delenv(name, raising=False)
    config, client = env_config, "caf\u00e9"
    rows = [{"order_id": f"o{i}", "client_id": client, "user_id": "u",
             "ts": f"2026-03-01T10:0{i}:00Z", "amount": "5.00", "currency": "EUR"}
            for i in range(3)]
    (config.landing / "b").mkdir()
    (config.landing / "b" / "orders.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows))

    dagrun, states = run(backfill_dag, client=client, kind="orders", path="b", dry_run=True)

    assert str(dagrun.state) == "success", states
    (check,) = [json.loads(p.read_text()) for p in
                (config.home / "runs" / "backfill").glob("*/check.json")]
    assert (check["client_id"], check["valid_rows"], check["quarantined"]) == (client, 3, 0), \
        check.get("first_reasons")
