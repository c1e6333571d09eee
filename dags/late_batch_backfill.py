"""late_batch_backfill: merge a late historical batch, recompute what it affects, republish."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import AssetAlias, Param, dag, task

from clickstream.orchestration import table_asset, task_errors

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

Tasks (each calls one function of `clickstream.jobs.backfill_steps`; quality gates from
`clickstream.quality.gates`, reports under **Quality reports**):

1. `validate_batch` — path inside the landing folder, formats, columns; counts bad rows
   (with reasons), rows that are new or changed, users and stored sessions in reach. A
   refused batch fails the run at once with the reason (no retries). In a dry run it also
   runs the `historical_batch` gate and reports its verdict.
2. `merge` — `historical_batch` gate (a failure quarantines the implicated rows and refuses
   the batch), bad rows to `quarantine`, the rest into `pageviews` / `orders` exactly once,
   then the `tables_after_merge` gate.
3. `recompute` — re-sessionizes the affected users' windows (`recomputed_sessions` gate),
   stores the plan in `corrections`, applies it (one commit per table).
4. `validate_corrections` — the tables hold the plan at its revisions, keys unique;
   otherwise nothing is published.
5. `publish` — new revisions and tombstones to the `sessions` / `attributions` topics, then
   the `publish` gate reads them back.
6. `report` — the run's summary in the log and as a page, and the correction report.

With `dry_run`, tasks 2–5 are skipped and `report` says what would have changed.
Every task is idempotent (application transactions, stored plan), so retrying any of them,
or rerunning the whole DAG, resumes instead of doubling; a batch that changed after
validation is refused. The same batch run through `clickstream backfill` is the same run.

**Why in-process Spark, not SparkSubmitOperator:** these are bounded batch steps that hand
small results (counts, the run id) to the next task. Each task builds a SparkSession from
`CLICKSTREAM_SPARK_MASTER` (`local[*]` embedded; the cluster master in docker-compose, where
the task is the driver in client mode), so results flow through XCom and failures surface as
the product's own one-line errors. The long-running streaming job (`sessionizer`) goes
through SparkSubmitOperator and the `spark_default` connection.

Outlets: `merge` emits events for the tables it wrote (through the `clickstream-backfill-merge`
alias); `recompute` for `sessions`, `attributions`, `corrections`.
"""

MERGED = AssetAlias("clickstream-backfill-merge")
RECOMPUTED = [table_asset(name) for name in ("sessions", "attributions", "corrections")]

RETRY = {"retries": 2, "retry_delay": timedelta(seconds=30),
         "retry_exponential_backoff": True}


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
            "", type="string", minLength=1, title="Client",
            description="The client the batch belongs to, e.g. client-00."),
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
    def validate_batch(params=None) -> dict:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import check_batch

        with task_errors():
            return check_batch(Config.from_env(), kind=params["kind"],
                               client_id=params["client"], path=params["path"],
                               quality_gate=params["dry_run"]).as_dict()

    @task(outlets=[MERGED])
    def merge(check: dict, params=None, outlet_events=None) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import merge_batch

        if params["dry_run"]:
            raise AirflowSkipException("dry run: nothing is written")
        with task_errors():
            result = merge_batch(Config.from_env(), kind=check["kind"],
                                 client_id=check["client_id"], path=check["path"],
                                 run_id=check["run_id"])
        extra = {"run_id": result.run_id, "client_id": check["client_id"]}
        if result.rows_merged:
            outlet_events[MERGED].add(table_asset(check["kind"]),
                                      extra={**extra, "rows": result.rows_merged})
        if result.quarantined:
            outlet_events[MERGED].add(table_asset("quarantine"),
                                      extra={**extra, "rows": result.quarantined})
        return dict(vars(result))

    @task(outlets=RECOMPUTED)
    def recompute(check: dict, merged: dict, outlet_events=None) -> dict:
        import dataclasses

        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import recompute_affected

        with task_errors():
            summary = recompute_affected(Config.from_env(), kind=check["kind"],
                                         client_id=check["client_id"], path=check["path"],
                                         run_id=check["run_id"])
        for asset in RECOMPUTED:
            outlet_events[asset].extra = {"run_id": check["run_id"],
                                          "client_id": check["client_id"]}
        return dataclasses.asdict(summary)

    @task
    def validate_corrections(check: dict, corrections: dict) -> dict:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import check_applied

        with task_errors():
            return check_applied(Config.from_env(), client_id=check["client_id"],
                                 run_id=check["run_id"])

    @task
    def publish(check: dict, applied: dict) -> int:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import publish_corrections

        with task_errors():
            return publish_corrections(Config.from_env(), client_id=check["client_id"],
                                       run_id=check["run_id"])

    @task(trigger_rule="none_failed")
    def report(check: dict, merged: dict | None, corrections: dict | None,
               applied: dict | None, published: int | None, params=None) -> dict:
        from clickstream.config import Config
        from clickstream.jobs.backfill_steps import write_report

        with task_errors():
            return write_report(Config.from_env(), check=check, dry_run=params["dry_run"],
                                merged=merged, corrections=corrections, applied=applied,
                                published=published)

    check = validate_batch()
    merged = merge(check)
    corrections = recompute(check, merged)
    applied = validate_corrections(check, corrections)
    published = publish(check, applied)
    report(check, merged, corrections, applied, published)


late_batch_backfill()
