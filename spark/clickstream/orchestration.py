"""What the Airflow DAGs share: the Asset of each Delta table, how a Spark job is submitted, and
how product errors end a task.

DAG files (``dags/``) are wiring: they build the :class:`~clickstream.config.Config` inside a
task (never at parse time) and call one library function. This module keeps the Airflow
glue they have in common in one place. ``airflow.sdk`` is imported lazily, so the
library itself does not need Airflow to run.

Known edge cases, cited inline as (O1)..(O5):
  O1. A refused batch, a bad setting or a failed quality gate gives the same result on every
      retry, so the task fails at once (no retries) with the product's one-line reason;
      transient failures (broker unavailable, commit conflicts, delivery) keep Airflow's
      retries, and every step is idempotent, so a retry resumes rather than doubles. A Python
      task sees the exception itself (``task_errors``); a Spark task sees only spark-submit's
      exit status, which the entry point sets to ``errors.EXIT_NOT_RETRYABLE`` for these, or
      ``errors.EXIT_USAGE`` for arguments it refuses (``spark_job``). A run's conf with a key
      the DAG has no Param for fails too, before the task works (``refuse_unknown_conf``:
      every Spark task, and the Python tasks that read a Param, ``locate_batch`` and
      ``vacuum``):
      Airflow ignores such a key, so a misspelled ``dry_run`` would start a run that writes,
      and a misspelled ``retention_hours`` vacuum at the default.
  O2. Asset URIs name a table, not a folder: the warehouse location is configuration and
      must not be read while the DAG file is parsed.
  O3. Configuration is read when a task runs, in the worker's environment, never while the
      DAG file is parsed (the scheduler's environment is not the worker's): settings a
      submitted job needs before its JVM starts (the driver's memory) are added to the
      spark-submit command just before it runs.
  O4. spark-submit runs with ``LC_ALL=C.UTF-8``: Java's launcher decodes and re-encodes argv
      in the locale's charset, so on a worker without a UTF-8 locale (``LANG`` unset, as under
      systemd, cron or ``env -i``) a client ``café`` reached the job as ``caf??`` and its
      whole batch was quarantined as another client's.
  O5. A deployment may bound every task's time (``[core] default_task_execution_timeout``,
      ``AIRFLOW__CORE__DEFAULT_TASK_EXECUTION_TIMEOUT``), which suits the batch steps (a hung
      job is killed, then retried: every step resumes). A service's task never ends, so it is
      exempt: timed out, the sessionizer would be killed and counted as failed at every
      interval, and after its retries six such runs would pause its DAG.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clickstream.errors import EXIT_NOT_RETRYABLE, EXIT_USAGE, NOT_RETRYABLE, ConfigError

if TYPE_CHECKING:
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.sdk import Asset

# The spark-submit entry points, next to this package (spark/entrypoints/).
ENTRYPOINTS = Path(__file__).resolve().parents[1] / "entrypoints"

ASSET_URI_PREFIX = "clickstream://warehouse/"
# The product's one-line reason in a job's output (``clickstream.cli.main``, or argparse's).
ERROR_LINE_MARKER = ": error: "
# A job that exits with one of these failed as it would on every retry (O1).
NOT_RETRYABLE_EXITS = (EXIT_NOT_RETRYABLE, EXIT_USAGE)
# spark-submit's environment on top of the worker's: argv survives the JVM intact (O4).
SPARK_SUBMIT_ENV = {"LC_ALL": "C.UTF-8"}


def table_asset(table: str) -> Asset:
    """The Airflow Asset standing for one Delta table of the warehouse (O2).

    Args:
        table: a name from ``clickstream.tables.ALL_TABLES`` (``"sessions"``, ...).
    """
    from airflow.sdk import Asset

    return Asset(name=f"clickstream.{table}", uri=f"{ASSET_URI_PREFIX}{table}",
                 group="clickstream-tables")


@contextmanager
def task_errors() -> Iterator[None]:
    """Turn errors a retry cannot fix into an immediate task failure with a clear reason (O1).

    Raises:
        AirflowFailException: for ``BatchRefusedError``, ``ConfigError`` and
            ``QualityGateFailedError``; the message is the product's own one-line reason.
    """
    try:
        yield
    except NOT_RETRYABLE as error:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"{type(error).__name__}: {error}") from error


def refuse_unknown_conf(conf: Mapping[str, Any] | None, params: Iterable[str]) -> None:
    """Fail a run whose conf has keys the DAG has no Param for (O1): Airflow ignores them,
    so ``{"dry-run": true}`` from the REST API would run with ``dry_run`` false, and write.

    Raises:
        ConfigError: naming the unknown keys and the DAG's Params.
    """
    known = set(params)
    unknown = sorted(set(conf or {}) - known)
    if unknown:
        raise ConfigError(
            f"the run's conf has {', '.join(map(repr, unknown))}, which this DAG has no "
            f"parameter for (it has {', '.join(sorted(known))}): Airflow would ignore "
            "it and use the default; trigger the run again with the parameter's own name")


def spark_job(task_id: str, entrypoint: str, args: Sequence[str] | str = (), *,
              long_running: bool = False, **operator_args: Any) -> SparkSubmitOperator:
    """A task that runs ``spark/entrypoints/<entrypoint>.py`` through ``spark-submit`` with
    the ``spark_default`` connection: ``local[*]`` in the embedded profile, the Spark master
    in the cluster profile (the entry point takes the submitted master as its own).

    spark-submit starts the driver's JVM before the job's own settings are read, so the
    driver's memory (``CLICKSTREAM_DRIVER_MEMORY``) and heap options are passed to it as
    ``--conf``, from the worker's environment when the task runs (O3).

    Args:
        task_id: the task's id.
        entrypoint: file name under ``spark/entrypoints`` without ``.py``.
        args: the entry point's arguments (Jinja-templated), or one template rendering a list.
        long_running: a service's driver (the sessionizer): its whole heap is taken at start
            (``spark_session.driver_launch_conf``), and it has no execution timeout (O5).
        operator_args: more ``SparkSubmitOperator`` arguments (``outlets``, ``retries``...);
            ``env_vars`` are added to ``SPARK_SUBMIT_ENV`` (O4), and win over it.
    """
    def size_the_driver(context: Any) -> None:
        from clickstream.config import Config
        from clickstream.spark_session import driver_launch_conf

        with task_errors():
            refuse_unknown_conf(context["dag_run"].conf, context["dag"].params)  # (O1)
            config = Config.from_env()
        operator = context["task"]
        operator.conf = {**driver_launch_conf(config, long_running=long_running),
                         **(operator.conf or {})}

    if long_running:  # (O5)
        operator_args.setdefault("execution_timeout", None)
    return _spark_job_operator()(
        task_id=task_id, application=str(ENTRYPOINTS / f"{entrypoint}.py"),
        conn_id="spark_default", name=f"clickstream-{task_id.replace('_', '-')}",
        application_args=args if isinstance(args, str) else list(args),
        env_vars={**SPARK_SUBMIT_ENV, **(operator_args.pop("env_vars", None) or {})},
        pre_execute=size_the_driver, **operator_args)


@cache
def _spark_job_operator() -> type[SparkSubmitOperator]:
    """``SparkSubmitOperator`` that fails without retries when the job exited with
    ``EXIT_NOT_RETRYABLE`` (O1), with the job's own reason as the task's error.

    Defined on first use: the library imports Airflow only where a DAG needs it.
    """
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    class ClickstreamSparkJob(SparkSubmitOperator):
        def execute(self, context: Any) -> None:
            try:
                super().execute(context)
            except AirflowException as error:
                process = getattr(self._hook, "_submit_sp", None)
                if process is None or process.returncode not in NOT_RETRYABLE_EXITS:
                    raise
                lines = getattr(self._hook, "_last_submit_log_lines", ())
                reasons = [line.strip() for line in lines if ERROR_LINE_MARKER in line
                           and line.lstrip().startswith("clickstream ")]
                raise AirflowFailException(
                    reasons[-1] if reasons else
                    f"{self.task_id} failed in a way a retry cannot fix (exit status "
                    f"{process.returncode}); its reason is in the log above") from error

    ClickstreamSparkJob.__module__ = __name__
    return ClickstreamSparkJob
