"""Airflow for the tests: configured through the environment before Airflow is imported.

AIRFLOW_HOME is a fresh temporary folder (SQLite metadata DB inside it), examples are off,
unit-test mode is on, and the DAGs and plugins folders are this repository's. Imported by the
conftest of tests/dags and tests/plugins, so either folder can run alone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@contextlib.contextmanager
def api_server_app() -> Iterator[Any]:
    """Airflow's API server app (core API, auth manager, plugins), as `airflow api-server`."""
    from airflow.api_fastapi.app import create_app, purge_cached_app

    try:
        yield create_app(apps="core")
    finally:
        purge_cached_app()


def admin_token() -> str:
    """A JWT of the "admin" user, as ``POST /auth/token`` returns it."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
