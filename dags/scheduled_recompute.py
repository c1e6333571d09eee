"""scheduled_recompute: fold the recompute queue (events too late for the stream) in, nightly."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import AssetAlias, Param, TriggerRule, dag, task

from clickstream.events.contract import CLIENT_ID_MAX_BYTES, CLIENT_ID_PATTERN, CLIENT_ID_RULE
from clickstream.orchestration import spark_job, table_asset, task_errors

DOC = """
# Scheduled recompute

Every night (02:30 UTC; also **Trigger** by hand, optionally for one client) this folds the
`recompute_queue` — events that reached the stream after its watermark, and backfilled rows
of users the stream still held open — into sessions: it recomputes only the affected
sessions, records the changes in `corrections`, applies them and republishes them to the
`sessions` / `attributions` topics, then clears the processed queue rows
(`clickstream.jobs.recompute.run_recompute`, the same code as `clickstream recompute`).

* Safe while the `sessionizer` runs: sessions it still holds open stay queued for the next
  run; a conflicting commit makes this run keep its rows queued instead of overwriting.
* Idempotent and retryable: a retry after a crash finishes the stored plan (as its own run
  when the queue is unchanged, else as the plan of an earlier run) before it plans again.
* Runs `spark/entrypoints/recompute.py` through **SparkSubmitOperator** and the
  **`spark_default`** connection (`local[*]` embedded, the Spark master in the cluster
  profile); the summary is in the task log, the correction report under **Quality reports**.
* Outlets: `announce_changes` emits Asset events for the tables the run changed, of
  `sessions`, `attributions`, `corrections`, `recompute_queue` (through the
  `clickstream-recompute` alias), and none when it changed nothing. It runs when the
  recompute failed too: the clients folded in before one failed changed their tables, and a
  client that fails every night (a plan refused until `--full`) would hide them; `watcher`
  then fails the run, so the failure is not hidden behind a green run. A job killed while it
  worked on a client (kill -9, out of memory) is taken to have changed all four tables.
"""

CHANGED = AssetAlias("clickstream-recompute")
RESULT_PREFIX = "scheduled_recompute-"  # + the DAG run's id: where the job leaves its result


@dag(
    dag_id="scheduled_recompute",
    schedule="30 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=DOC,
    tags=["clickstream", "recompute"],
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=2),
                  "retry_exponential_backoff": True},
    params={
        "client": Param(
            None, type=["null", "string"], maxLength=CLIENT_ID_MAX_BYTES,
            pattern=rf"^({CLIENT_ID_PATTERN})?$(?!\n)",
            title="Client",
            description="Only this client's queue; empty for every client with queued "
                        f"events. A client id has {CLIENT_ID_RULE}."),
    },
)
def scheduled_recompute():
    @task(outlets=[CHANGED], trigger_rule=TriggerRule.ALL_DONE)
    def announce_changes(run_id=None, outlet_events=None) -> list[str]:
        from clickstream.config import Config
        from clickstream.jobs.recompute import changed_tables_saved

        with task_errors():
            changed = changed_tables_saved(Config.from_env(), RESULT_PREFIX + run_id)
        for table in changed:
            outlet_events[CHANGED].add(table_asset(table))
        return changed

    @task(trigger_rule=TriggerRule.ONE_FAILED, retries=0)
    def watcher() -> None:
        """Fail the run when the recompute failed: the announcing leaf runs anyway
        (ALL_DONE), and alone it would decide the run's state."""
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException("recompute_queue failed; its log has the reason (the "
                                   "tables it changed before failing were announced)")

    recompute = spark_job(
        "recompute_queue", "recompute",
        "{{ (['--client=' ~ params.client] if params.client else []) + "
        f"['--save-result-as={RESULT_PREFIX}' ~ run_id] }}}}")
    recompute >> [announce_changes(), watcher()]


scheduled_recompute()
