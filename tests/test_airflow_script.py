"""scripts/airflow.sh's own checks, run by bash itself (no Airflow is started)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _warning(home: Path, **env: str) -> str:
    script = "source scripts/airflow.sh && _airflow_env && _warn_if_checkpoint_outlives_broker"
    environment = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=30, env={**environment, "CLICKSTREAM_HOME": str(home), **env})
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_new_broker_beside_an_old_sessionizer_checkpoint_is_warned_about(tmp_path):
    assert _warning(tmp_path) == ""  # a first start: nothing to warn about
    offsets = tmp_path / "checkpoints" / "sessionize" / "offsets"
    offsets.mkdir(parents=True)
    assert _warning(tmp_path) == ""  # a checkpoint that never read an offset
    (offsets / "0").write_text("v1")
    assert _warning(tmp_path, KAFKA_BOOTSTRAP_SERVERS="kafka.example:9092") == ""  # real Kafka

    warning = _warning(tmp_path)

    assert warning.startswith("airflow: warning: the embedded broker starts empty")
    assert f"{tmp_path}/checkpoints/sessionize" in warning and "DataLossError" in warning
    assert "clickstream recompute --full --client C" in warning


def test_a_component_started_with_job_control_on_is_stopped_with_its_session(tmp_path):
    """Sourced in an interactive shell (job control on), each component still gets a session
    whose id airflow_stop knows: before, setsid forked and the stop stopped nothing."""
    script = """
        set -m
        source scripts/airflow.sh
        AIRFLOW_LOGS="$1"
        _start sleeper sleep 60
        pid=${_STARTED_PIDS[0]}
        sleep 0.5
        echo "session $(ps -o sid= -p "$pid" | tr -d ' ') of $pid"
        airflow_stop
        ps -o pid= -s "$pid" | wc -l
    """
    result = subprocess.run(["bash", "-c", script, "bash", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    session_line, left = result.stdout.strip().splitlines()
    _, sid, _, pid = session_line.split()
    assert sid == pid  # the started pid leads the session airflow_stop stops
    assert left.strip() == "0"


def test_a_broker_that_cannot_start_stops_the_start_with_its_reason(tmp_path):
    """Before, airflow_start went on without a broker: the banner printed, and the sessionizer
    DAG then failed run after run. Airflow itself is stubbed; the broker really starts."""
    script = """
        source scripts/airflow.sh
        airflow() { echo "airflow $*"; }
        curl() { return 0; }
        setsid() {  # only the broker really starts, never an Airflow component
            if [ "$1" = clickstream ]; then command setsid "$@"; else echo "setsid $*"; fi; }
        airflow_start
        echo "rc=$?"
    """
    environment = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={
                                **environment, "AIRFLOW_HOME": str(tmp_path / "airflow"),
                                "CLICKSTREAM_HOME": str(tmp_path / "home"),
                                "AIRFLOW_PORT": "18791", "CLICKSTREAM_BROKER_PORT": "19791",
                                "CLICKSTREAM_SESSION_GAP": "thirty"})
    assert result.stdout.strip().endswith("rc=1"), result.stdout + result.stderr
    assert "the embedded broker did not start" in result.stderr
    assert "CLICKSTREAM_SESSION_GAP='thirty' is not a duration" in result.stderr
    assert "Airflow components" not in result.stdout
