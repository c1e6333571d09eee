"""sessionizer: the continuous streaming job (Kafka events -> Delta tables and sessions topic)."""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag

from clickstream.orchestration import spark_job

DOC = """
# Sessionizer

The continuous Structured Streaming job: reads the `events` topic, quarantines bad records,
stores every pageview and order exactly once, and emits sessions as the watermark closes them
to the `sessions` table and topic. Late events go to `recompute_queue`
(see `scheduled_recompute`).

* **Schedule `@continuous`, one active run:** the run lasts as long as the job; when it ends
  (failure after its retries, or a stop), Airflow starts the next run at once. A failure a
  retry cannot fix (a bad setting; records the broker dropped before they were read, see
  `CLICKSTREAM_FAIL_ON_DATA_LOSS`) fails the task at once, without retries. After
  **6 failed runs in a row Airflow pauses the DAG** (`max_consecutive_failed_dag_runs`), so such
  a failure is not restarted forever, a new driver every few seconds: fix the cause, then
  unpause it. Kafka out of reach fails a run after its retries (~8-11 min), so an outage of
  about an hour pauses it too: unpause it once Kafka is back.
* **Restarts resume:** source offsets and session state live in the Spark checkpoint under
  `$CLICKSTREAM_HOME/checkpoints/sessionize`, and every Delta write is idempotent per
  micro-batch, so a retry after any failure, kill or restart continues where the last committed
  micro-batch ended — nothing lost, nothing doubled.
* **SparkSubmitOperator** runs `spark/entrypoints/sessionize.py` through `spark-submit` with
  the **`spark_default`** connection: `local[*]` in the embedded profile
  (`AIRFLOW_CONN_SPARK_DEFAULT=spark://local%5B%2A%5D`, set by `scripts/airflow.sh`), the
  Spark master in the cluster profile (docker-compose). The driver's memory is
  `CLICKSTREAM_DRIVER_MEMORY` of the worker's environment, taken whole at start (`-Xms`), and
  passed to spark-submit when the task runs. Stopping the task (mark failed/success) ends
  the spark-submit process like a crash: SparkSubmitOperator kills its JVM at once, and
  Airflow sends the task's whole process group SIGTERM, then SIGKILL 5 s later, too soon for
  a micro-batch to finish. Nothing is lost or doubled: the next run replays the micro-batch
  in flight from the checkpoint. (A SIGTERM to `clickstream sessionize` itself, outside
  Airflow, lets the planned micro-batches finish and commit, then stops.)
* **One sessionizer per checkpoint:** a `clickstream sessionize` started from a shell while
  this DAG streams (or the other way round) is refused at once, naming the pid that holds
  the checkpoint; this task then retries (5 times), and the DAG pauses after 6 failed runs
  (about an hour): unpause it once the other one stopped.
* **A quiet stream's sessions close:** once no record arrives for
  `CLICKSTREAM_IDLE_CLOCK_AFTER` (5 minutes; `off` disables it), the stream's event time runs
  on at the wall clock's pace, so the sessions open when traffic stopped close one gap plus the
  watermark delay later; the task log says `the quiet stream's clock moved on to ...`. Events
  that come afterwards for the quiet time are late: stored and queued for
  `scheduled_recompute` (README, "A quiet stream").
* Param `until_caught_up` (off by default): process what is available now, commit, and end
  the run — for demos and tests; the next continuous run streams again (a catch-up never
  moves the clock).
"""


@dag(
    dag_id="sessionizer",
    schedule="@continuous",
    max_active_runs=1,
    max_consecutive_failed_dag_runs=6,  # a failure retries cannot fix is not looped on
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    doc_md=DOC,
    tags=["clickstream", "streaming"],
    render_template_as_native_obj=True,
    params={
        "until_caught_up": Param(
            False, type="boolean", title="Until caught up",
            description="Process everything available now, commit, and stop (demos, tests)."),
    },
    default_args={"retries": 5, "retry_delay": timedelta(seconds=15),
                  "retry_exponential_backoff": True, "max_retry_delay": timedelta(minutes=5)},
)
def sessionizer():
    spark_job("sessionize", "sessionize",
              "{{ ['--until-caught-up'] if params.until_caught_up else [] }}", long_running=True)


sessionizer()
