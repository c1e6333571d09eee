"""late_batch_backfill: merge a late historical batch, recompute what it affects, republish."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import AssetAlias, Param, dag, task

from clickstream.events.contract import CLIENT_ID_MAX_BYTES, CLIENT_ID_PATTERN, CLIENT_ID_RULE
from clickstream.orchestration import refuse_unknown_conf, spark_job, table_asset, task_errors

DOC = """
# Late batch backfill

Merges a late historical batch (a client's year of orders, or pageviews from another source)
into the Delta tables, recomputes **only the sessions it affects**, and republishes the
corrections to Kafka. Trigger it from **Trigger → form**:

* `client` — the client the batch belongs to; rows of other clients are quarantined.
* `kind` — `orders` or `pageviews`.
* `path` — file or folder (Parquet, CSV, JSON Lines) **relative to the landing folder**
  (`CLICKSTREAM_LANDING`); a path that leaves it (`..`, absolute elsewhere, symlinks) is
  refused and the run fails with a message naming the landing folder.
* `dry_run` — validate and report what would change, write nothing.

Tasks (`locate_batch` and `announce_merge` are small Python tasks; every other task runs
`spark/entrypoints/backfill_step.py <step>` through **SparkSubmitOperator** and the
**`spark_default`** connection: `local[*]` in the embedded profile, the Spark master in the
cluster profile; each calls one function of `clickstream.jobs.backfill_steps`, with the quality
gates of `clickstream.quality.gates` and reports under **Quality reports**):

1. `locate_batch` — the path must stay inside the landing folder; formats; the batch's
   fingerprint becomes the run id, and every later step refuses files that changed since.
   A refused path fails the run at once with the reason (no retries), as does a conf key
   this DAG has no parameter for (from the REST API: Airflow would ignore it). Its result's
   `not_read` names the folder's hidden files of an accepted format (names starting with
   `.` or `_`), which the batch leaves out as Spark does.
2. `validate_batch` — columns, types and values; counts bad rows (with reasons), rows that
   are new or changed, users and stored sessions in reach. In a dry run it also runs the
   `historical_batch` gate and reports its verdict. Writes nothing.
3. `writes_enabled` — a dry run stops here: the writing tasks are skipped.
4. `merge` — `historical_batch` gate (a failure quarantines the implicated rows, refuses
   the batch and fails the task without retries), bad rows to `quarantine`, the rest into
   `pageviews` / `orders` exactly once, then the `tables_after_merge` gate.
   `announce_merge` emits the Asset events of the tables it wrote (`quarantine` too when
   the gate refused the batch and the task failed; the merged table and `quarantine` when
   `tables_after_merge` failed after the merge's commit; `recompute_queue` for rows it
   queued ahead of a running stream).
5. `recompute` — re-sessionizes the affected users' windows (`recomputed_sessions` gate),
   stores the plan in `corrections`, applies it (one commit per table).
6. `validate_corrections` — the tables hold the plan at its revisions, keys unique;
   otherwise nothing is published.
7. `publish` — new revisions and tombstones to the `sessions` / `attributions` topics, then
   the `publish` gate reads them back.
8. `report` — the run's summary in the log and as a page, and the correction report. A step
   that fails writes that page itself: the steps done, and its own reason (the run turns
   red in **Quality reports**); the run's summary replaces that page once the run ends well
   (here, or through `clickstream backfill`, which shares the run id).

Every task is idempotent (application transactions, stored plan), so retrying any of them,
or rerunning the whole DAG, resumes instead of doubling. The same batch run through
`clickstream backfill` (or `clickstream backfill-step`) is the same run. Steps hand their
results to the next through `$CLICKSTREAM_HOME/runs/backfill/<run id>/`.

Outlets: `announce_merge` emits events for the tables `merge` wrote (through the
`clickstream-backfill-merge` alias, with row counts; `quarantine` also when `merge` failed
after quarantining a refused batch's rows, or after its commit; `recompute_queue` for rows
queued ahead of a running stream); `announce_recompute` for those of `sessions`,
`attributions`, `corrections` the `recompute` step changed, and `recompute_queue` for the
rows of users the stream holds that it queued (through the `clickstream-backfill-recompute`
alias; none when it changed nothing; `sessions`, `attributions` and `corrections` when
`recompute` failed with the client's plan recorded and not published: its apply may have
committed).
"""

MERGED = AssetAlias("clickstream-backfill-merge")
RECOMPUTED = AssetAlias("clickstream-backfill-recompute")

RETRY = {"retries": 2, "retry_delay": timedelta(seconds=30),
         "retry_exponential_backoff": True}
RUN_ID = "{{ ti.xcom_pull(task_ids='locate_batch')['run_id'] }}"


def step(name: str, *, dry_run: str = "false") -> list[str]:
    """``backfill_step.py`` arguments for one step of the run (templated)."""
    return [name, "--kind={{ params.kind }}", "--client={{ params.client }}",
            "--path={{ params.path }}", f"--run-id={RUN_ID}", f"--dry-run={dry_run}"]


@dag(
    dag_id="late_batch_backfill",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=DOC,
    tags=["clickstream", "backfill"],
    default_args=RETRY,
    params={
        "client": Param(
            "", type="string", minLength=1, maxLength=CLIENT_ID_MAX_BYTES,
            pattern=rf"^{CLIENT_ID_PATTERN}$(?!\n)",
            title="Client",
            description="The client the batch belongs to, e.g. client-00, matched to its "
                        f"rows exactly: {CLIENT_ID_RULE}."),
        "kind": Param(
            "orders", type="string", enum=["orders", "pageviews"], title="Kind",
            values_display={"orders": "orders (order_id, client_id, user_id, ts, amount, "
                                      "currency)",
                            "pageviews": "pageviews (event_id, client_id, user_id, ts, url, "
                                         "referrer)"},
            description="What the batch holds."),
        "path": Param(
            "", type="string", minLength=1, title="Path in the landing folder",
            description="File or folder of Parquet, CSV or JSON Lines, relative to the "
                        "landing folder (CLICKSTREAM_LANDING). Paths outside it are refused."),
        "dry_run": Param(
            False, type="boolean", title="Dry run",
            description="Validate and report what would change, without writing anything."),
    },
)
def late_batch_backfill():
    @task
    def locate_batch(params=None, dag_run=None, dag=None) -> dict:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import locate_batch

        with task_errors():
            refuse_unknown_conf(dag_run.conf, dag.params)
            return locate_batch(Config.from_env(), kind=params["kind"],
                                client_id=params["client"], path=params["path"])

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def writes_enabled(params=None) -> bool:
        return not params["dry_run"]

    # Runs when merge ran in this DAG run, and failed too (one_done): a refused batch's merge
    # quarantines its rows, then fails. Skipped when merge was (a dry run) or never ran (its
    # upstream failed: a saved result would be an earlier run's of the batch). `located` is
    # pulled here, not passed: a failed locate_batch leaves no XCom to pass.
    @task(outlets=[MERGED], trigger_rule="one_done")
    def announce_merge(params=None, ti=None, outlet_events=None) -> None:
        from airflow.sdk.exceptions import AirflowSkipException

        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import merged_tables

        located = ti.xcom_pull(task_ids="locate_batch")
        if not located:
            raise AirflowSkipException("locate_batch found no batch: no table changed")
        extra = {"run_id": located["run_id"], "client_id": params["client"]}
        for table, rows in merged_tables(Config.from_env(), kind=params["kind"],
                                         run_id=located["run_id"],
                                         dry_run=params["dry_run"]).items():
            outlet_events[MERGED].add(table_asset(table), extra={**extra, "rows": rows})

    # Runs when recompute ran in this DAG run, and failed too (one_done): its apply may have
    # committed before it failed (recompute R15). `located` is pulled, as announce_merge's.
    @task(outlets=[RECOMPUTED], trigger_rule="one_done")
    def announce_recompute(params=None, ti=None, outlet_events=None) -> list[str]:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import recomputed_tables

        located = ti.xcom_pull(task_ids="locate_batch")
        changed = recomputed_tables(Config.from_env(), client_id=params["client"],
                                    run_id=located["run_id"])
        for table in changed:
            outlet_events[RECOMPUTED].add(table_asset(table), extra={
                "run_id": located["run_id"], "client_id": params["client"]})
        return changed

    located = locate_batch()
    validate = spark_job("validate_batch", "backfill_step",
                         step("check", dry_run="{{ params.dry_run | lower }}"))
    merge = spark_job("merge", "backfill_step", step("merge"))
    recompute = spark_job("recompute", "backfill_step", step("recompute"))
    validate_corrections = spark_job("validate_corrections", "backfill_step",
                                     step("check-applied"))
    publish = spark_job("publish", "backfill_step", step("publish"))
    report = spark_job("report", "backfill_step",
                       step("report", dry_run="{{ params.dry_run | lower }}"),
                       trigger_rule="none_failed")

    located >> validate >> writes_enabled() >> merge >> recompute >> validate_corrections
    validate_corrections >> publish >> report
    merge >> announce_merge()
    recompute >> announce_recompute()
    validate >> report


late_batch_backfill()
