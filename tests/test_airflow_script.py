"""scripts/airflow.sh's own checks, run by bash itself (no Airflow is started)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _warning(home: Path) -> str:
    result = subprocess.run(
        ["bash", "-c", "source scripts/airflow.sh && _warn_if_checkpoint_outlives_broker"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
        env={**os.environ, "CLICKSTREAM_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_new_broker_beside_an_old_sessionizer_checkpoint_is_warned_about(tmp_path):
    assert _warning(tmp_path) == ""  # a first start: nothing to warn about
    (tmp_path / "checkpoints" / "sessionize").mkdir(parents=True)

    warning = _warning(tmp_path)

    assert warning.startswith("airflow: warning: the embedded broker starts empty")
    assert f"{tmp_path}/checkpoints/sessionize" in warning and "DataLossError" in warning
    assert "clickstream recompute --full --client C" in warning
