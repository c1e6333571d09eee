"""Airflow is configured (temporary AIRFLOW_HOME, SQLite) before any test imports it."""

from tests.dags.airflow_env import configure_airflow_env

configure_airflow_env()

from tests.dags.airflow_env import airflow_db  # noqa: E402, F401  (fixture)
