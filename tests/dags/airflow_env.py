"""Airflow for the tests: configured through the environment before Airflow is imported.

AIRFLOW_HOME is a fresh temporary folder (SQLite metadata DB inside it), examples are off,
unit-test mode is on, and the DAGs and plugins folders are this repository's. Imported by the
conftest of tests/dags and tests/plugins, so either folder can run alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
PLUGINS = REPO / "plugins"


def configure_airflow_env() -> Path:
    """Point Airflow at a temporary home (once per test process); returns it.

    Each pytest-xdist worker has its own home: a worker inherits the environment of the
    process that started it, which may have set up a home of its own (``pytest -n 2
    tests/dags`` loads this folder's conftest there too), and two workers creating one SQLite
    metadata DB at once would collide."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("CLICKSTREAM_TEST_AIRFLOW_WORKER") == worker:
        return Path(os.environ["CLICKSTREAM_TEST_AIRFLOW_HOME"])
    if "airflow" in sys.modules:
        raise RuntimeError("Airflow was imported before the test environment was configured")
    home = Path(tempfile.mkdtemp(prefix="clickstream-airflow-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    os.environ.update({
        "CLICKSTREAM_TEST_AIRFLOW_HOME": str(home),
        "CLICKSTREAM_TEST_AIRFLOW_WORKER": worker,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
    })
    return home


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[Path]:
    """The metadata DB, created once per test run (about 5 s)."""
    from airflow.utils import db

    db.initdb()
    # Airflow's logging setup sends py4j's INFO lines to a stream pytest closes at exit.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    yield Path(os.environ["AIRFLOW_HOME"])
