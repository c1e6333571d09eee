"""The public command line: every command has --help, failures are one line and non-zero."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from clickstream.cli import main
from clickstream.config import Config
from clickstream.errors import ConfigError

CLI = [sys.executable, "-m", "clickstream.cli"]


@pytest.mark.parametrize("command", [
    [], ["broker"], ["sessionize"], ["backfill"], ["backfill-step"], ["recompute"], ["inspect"],
    ["generate"],
    ["generate", "events"],
    ["generate", "history"],
])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: clickstream" in capsys.readouterr().out


def test_invalid_setting_fails_with_one_line_naming_the_accepted_values() -> None:
    result = subprocess.run([*CLI, "inspect"], capture_output=True, text=True,
                            env={"CLICKSTREAM_DELTA_ENGINE": "parquet", "PATH": ""}, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == ["clickstream inspect: error: CLICKSTREAM_DELTA_ENGINE='parquet' is not "
                     "accepted; use one of: deltalake, delta-spark"]


def test_broker_on_a_busy_port_fails_with_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = subprocess.run([*CLI, "broker", "--port", str(port)], capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"127.0.0.1:{port}" in result.stderr and "already in use" in result.stderr


def test_durations_accept_units_and_reject_nonsense() -> None:
    config = Config.from_env({"CLICKSTREAM_SESSION_GAP": "45s",
                              "CLICKSTREAM_WATERMARK_DELAY": "1h"})
    assert (config.session_gap_ms, config.watermark_delay_ms) == (45_000, 3_600_000)
    with pytest.raises(ConfigError, match="not a duration"):
        Config.from_env({"CLICKSTREAM_SESSION_GAP": "soon"})


@pytest.mark.parametrize("size", ["1536", "0g", "4 g", "lots"])
def test_driver_memory_needs_a_jvm_size_with_a_unit(size: str) -> None:
    assert Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": "1536m"}).driver_memory == "1536m"
    with pytest.raises(ConfigError, match=r"CLICKSTREAM_DRIVER_MEMORY=.* with a unit"):
        Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": size})


@pytest.mark.parametrize(("size", "mib"), [("1536m", 1536), ("4G", 4096), ("2097152k", 2048),
                                           ("1t", 1024 * 1024)])
def test_driver_memory_in_mib_reads_every_jvm_unit(size: str, mib: int) -> None:
    assert Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": size}).driver_memory_mib == mib


def test_a_backfill_step_out_of_order_fails_with_one_line(tmp_path) -> None:
    landing = tmp_path / "landing"
    (landing / "b").mkdir(parents=True)
    (landing / "b" / "orders.jsonl").write_text("{}\n")
    env = {"CLICKSTREAM_HOME": str(tmp_path / "home"), "CLICKSTREAM_LANDING": str(landing),
           "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"), "PATH": ""}
    result = subprocess.run([*CLI, "backfill-step", "report", "--kind", "orders", "--client",
                             "client-00", "--path", "b"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no result of step 'check'" in result.stderr and "run the steps in order" in \
        result.stderr
