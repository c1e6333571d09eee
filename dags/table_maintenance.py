"""table_maintenance: compact small files, vacuum old ones, checkpoint the log, weekly."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, TriggerRule, dag, task

from clickstream.orchestration import refuse_unknown_conf, task_errors

DOC = """
# Table maintenance

Weekly (Sunday 03:00 UTC; also **Trigger** by hand), for every table of
`clickstream.tables.ALL_TABLES` that exists (`clickstream.jobs.maintenance`):

1. `compact` — rewrite small files into larger ones (`dataChange=false`: data and streaming
   readers are unaffected). The sessionizer writes one small file per partition and
   micro-batch, so this keeps reads fast.
2. `vacuum` — delete files no version within `retention_hours` needs, and files no version
   ever named (left by a writer killed before its commit) once older than that. The minimum,
   and the default, is **168 h** (7 days): writers place files before committing them, and
   readers or time travel may still need files a newer version removed.
3. `checkpoint` — write a log checkpoint so readers replay less of the log.

None of them changes data; all are safe while the other jobs run. A compaction that
conflicts with a concurrent commit fails with `CommitConflictError` and is retried; a
compaction started while another one of the same table runs (a retry beside a stuck attempt)
waits for it.

Each step tries every table even when one fails, then fails naming each failed table and
its reason (its log also has a line per table). Vacuum and checkpoint do not depend on
compaction, so they run whatever the step before them did; `watcher` (skipped when all went
well) then fails the run, so a failed step is never hidden behind a green run.
"""


@dag(
    dag_id="table_maintenance",
    schedule="0 3 * * 0",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    doc_md=DOC,
    tags=["clickstream", "maintenance"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5)},
    params={
        "retention_hours": Param(
            # maintenance.MIN/MAX_VACUUM_RETENTION_HOURS, not imported: parsing stays light
            168, type="integer", minimum=168, maximum=87_600, title="Vacuum retention (hours)",
            description="Files unreferenced for longer than this are deleted; from 168 (a "
                        "week) to 87600 (ten years)."),
    },
)
def table_maintenance():
    @task
    def compact() -> dict:
        from clickstream.config import Config
        from clickstream.jobs.maintenance import compact_tables

        with task_errors():
            return compact_tables(Config.from_env())

    @task(trigger_rule=TriggerRule.ALL_DONE)  # independent of compaction's outcome
    def vacuum(params=None, dag_run=None, dag=None) -> dict:
        from clickstream.config import Config
        from clickstream.jobs.maintenance import vacuum_tables

        with task_errors():
            refuse_unknown_conf(dag_run.conf, dag.params)
            return vacuum_tables(Config.from_env(),
                                 retention_hours=int(params["retention_hours"]))

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def checkpoint() -> dict:
        from clickstream.config import Config
        from clickstream.jobs.maintenance import checkpoint_tables

        with task_errors():
            return checkpoint_tables(Config.from_env())

    @task(trigger_rule=TriggerRule.ONE_FAILED, retries=0)
    def watcher() -> None:
        """Fail the run when a step failed: with ALL_DONE downstream, the leaf alone would
        decide the run's state and a failed compaction would end in a green run."""
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException("a maintenance step failed; its log names each failed "
                                   "table and why (the other tables were done)")

    steps = [compact(), vacuum(), checkpoint()]
    steps[0] >> steps[1] >> steps[2]
    steps >> watcher()


table_maintenance()
