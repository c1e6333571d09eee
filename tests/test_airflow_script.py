"""scripts/airflow.sh's, demo.sh's and airflow_demo.py's own checks, run by bash (or Python)
itself: no Airflow is started, and the demo runs in a copy of the scripts beside stubs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

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
    try:
        result = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True,
                                text=True, timeout=120, env={
                                    **environment, "AIRFLOW_HOME": str(tmp_path / "airflow"),
                                    "CLICKSTREAM_HOME": str(tmp_path / "home"),
                                    "AIRFLOW_PORT": "18791", "CLICKSTREAM_BROKER_PORT": "19791",
                                    "CLICKSTREAM_EVENTS_TOPIC": "web events"})  # it reads that
    finally:  # a broker that did start (the staging broken, as once in CI) is not left running
        subprocess.run(["pkill", "-f", "clickstream broker --port 19791"], check=False)
    assert result.stdout.strip().endswith("rc=1"), result.stdout + result.stderr
    assert "the embedded broker did not start" in result.stderr
    assert ("CLICKSTREAM_EVENTS_TOPIC='web events' is not a Kafka topic name"
            in result.stderr)
    assert "Airflow components" not in result.stdout


def _environment(**env: str) -> dict[str, str]:
    """This process's environment without the settings the scripts read, plus ``env``."""
    kept = {k: v for k, v in os.environ.items()
            if not k.startswith(("AIRFLOW", "CLICKSTREAM_", "KAFKA_"))}
    return {**kept, **env}


STUB_CLICKSTREAM = """#!/bin/bash
echo "[stub clickstream $*]"
if [ "$1" = broker ]; then
  echo "embedded broker ready on 127.0.0.1:$3"; trap 'exit 0' TERM; while sleep 0.2; do :; done
fi
"""
STUB_PYTHON = """#!/bin/bash
case "$1" in  # the trigger script and the corrections read: stubbed; the rest is Python's
  scripts/airflow_demo.py) echo "[stub trigger]"; exit "${STUB_TRIGGER_STATUS:-0}" ;;
  -) if [ $# = 1 ]; then cat >/dev/null; echo "[stub corrections]"; exit 0; fi ;;
esac
exec %s "$@"
"""


def _fake_repo(tmp_path: Path) -> Path:
    """The scripts copied beside stubs: setup.sh does nothing, clickstream and airflow only
    pretend (the components sleep in their sessions), curl finds Airflow healthy."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("airflow.sh", "demo.sh", "airflow_password.py"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    (repo / "scripts" / "setup.sh").write_text('echo "[stub setup]"\n')
    stubs = {"clickstream": STUB_CLICKSTREAM, "python": STUB_PYTHON % sys.executable,
             "airflow": '#!/bin/bash\n[ "$1" = db ] && exit 0\n'
                        'echo $$ >>"$AIRFLOW_HOME/components.pid"; exec sleep 60\n',
             "curl": "#!/bin/bash\nexit 0\n"}
    (repo / ".venv" / "bin").mkdir(parents=True)
    for name, text in stubs.items():
        (repo / ".venv" / "bin" / name).write_text(text)
        (repo / ".venv" / "bin" / name).chmod(0o755)
    return repo


def test_airflow_sh_takes_no_arguments_but_help(tmp_path):
    """Before, any argument (--help too) set up, migrated and started everything."""
    repo = _fake_repo(tmp_path)
    (repo / "scripts" / "setup.sh").write_text('echo "[stub setup]"; exit 1\n')
    run = {"cwd": repo, "capture_output": True, "text": True, "timeout": 30,
           "env": _environment()}

    usage = subprocess.run(["bash", "scripts/airflow.sh", "--help"], **run)
    refused = subprocess.run(["bash", "scripts/airflow.sh", "--port", "9"], **run)
    demo_usage = subprocess.run(["bash", "scripts/demo.sh", "-h"], **run)
    demo_refused = subprocess.run(["bash", "scripts/demo.sh", "--no-airflow", "x"], **run)

    assert usage.returncode == 0, usage.stdout + usage.stderr
    assert usage.stdout.startswith("Airflow on the embedded default profile, one command:")
    assert "bash scripts/airflow.sh --help" in usage.stdout and "stub" not in usage.stdout
    assert "REPO=" not in usage.stdout and "\n#" not in usage.stdout
    assert refused.returncode == 2 and "stub" not in refused.stdout
    assert refused.stderr.strip() == ("airflow.sh: unknown argument '--port'; it takes none "
                                      "(--help for usage)")
    assert demo_usage.returncode == 0 and "stub" not in demo_usage.stdout
    assert demo_usage.stdout.rstrip().endswith("Ctrl-C stops everything.")  # not the code
    assert demo_refused.returncode == 2 and "stub" not in demo_refused.stdout


def _start_with_stubs(tmp_path: Path, setsid: str, curl: int = 0,
                      **env: str) -> subprocess.CompletedProcess:
    """airflow_start with Airflow, curl (its exit status) and setsid (a function's body)
    stubbed."""
    script = f"""
        source scripts/airflow.sh
        airflow() {{ echo "airflow $*"; }}
        curl() {{ return {curl}; }}
        setsid() {{
            {setsid}
        }}
        SECONDS=0
        airflow_start
        echo "rc=$? after $SECONDS s"
    """
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=_environment(
                              AIRFLOW_HOME=str(tmp_path / "airflow"),
                              CLICKSTREAM_HOME=str(tmp_path / "home"), AIRFLOW_PORT="18792",
                              CLICKSTREAM_BROKER_PORT="19792", **env))


STUB_BROKER = '[ "$1" != clickstream ] || echo "embedded broker ready on"'


def test_the_embedded_broker_starts_only_when_the_jobs_use_it(tmp_path):
    """Before, with KAFKA_BOOTSTRAP_SERVERS naming another Kafka, a broker nobody used started
    on CLICKSTREAM_BROKER_PORT."""
    setsid = f'echo "setsid $*"; {STUB_BROKER}'
    broker_log = tmp_path / "airflow" / "logs" / "broker.log"

    elsewhere = _start_with_stubs(tmp_path, setsid, KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:19794")

    assert "rc=0" in elsewhere.stdout, elsewhere.stdout + elsewhere.stderr
    assert ("== embedded broker not started: the jobs use "
            "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:19794\n") in elsewhere.stdout
    assert not broker_log.exists()
    for bootstrap in ({}, {"KAFKA_BOOTSTRAP_SERVERS": "localhost:19792"}):
        here = _start_with_stubs(tmp_path, setsid, **bootstrap)
        assert "rc=0" in here.stdout, here.stdout + here.stderr
        assert "== embedded broker on 127.0.0.1:19792" in here.stdout
        assert "setsid clickstream broker --port 19792" in broker_log.read_text()
        broker_log.unlink()


def test_an_api_server_that_stops_fails_the_start_at_once(tmp_path):
    """Before, the start waited its full 180 s for the health check of a dead API server."""
    setsid = f"""{STUB_BROKER}
            if [ "$2" = api-server ]; then echo "api-server: fatal config error"; return 1; fi"""

    result = _start_with_stubs(tmp_path, setsid, curl=7)

    assert "rc=1 after" in result.stdout, result.stdout + result.stderr
    assert int(result.stdout.split("rc=1 after ")[1].split()[0]) < 20
    assert "airflow: the API server stopped; see" in result.stderr
    assert "api-server: fatal config error" in result.stderr


def _airflow_demo(monkeypatch):
    """scripts/airflow_demo.py as a module, with its sleeps skipped."""
    spec = importlib.util.spec_from_file_location("airflow_demo", REPO / "scripts" /
                                                  "airflow_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "time", SimpleNamespace(sleep=lambda _: None,
                                                        monotonic=time.monotonic))
    return module


def test_a_run_still_going_after_the_timeout_is_not_reported_as_failed(monkeypatch, capsys):
    """Before: "run X: running" and exit status 1, which demo.sh reported as a failed run."""
    demo = _airflow_demo(monkeypatch)

    def api(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(200, json={"dag_run_id": "manual__1"})
        if request.url.path.endswith("/taskInstances"):
            return httpx.Response(200, json={"task_instances": [
                {"task_id": "locate_batch", "state": "running"}]})
        return httpx.Response(200, json={"state": "running"})  # the DAG, the run; PATCH

    with httpx.Client(base_url="http://airflow/api/v2",
                      transport=httpx.MockTransport(api)) as client:
        status = demo.trigger(client, "late_batch_backfill", {"client": "c"}, timeout_s=0.2)

    out = capsys.readouterr().out
    assert status == 4 == demo.STILL_RUNNING
    assert "run manual__1: still running after 0 s (--timeout); it goes on: follow it in the UI" \
        in out
    assert "run summary" not in out  # no summary of a run that has not ended


@pytest.mark.parametrize("conf", ["{'client': 'client-00'}", "[1]"])
def test_a_conf_that_is_not_a_json_object_is_refused_before_logging_in(monkeypatch, capsys,
                                                                       conf):
    demo = _airflow_demo(monkeypatch)

    def client(*_):
        raise AssertionError("logged in")

    monkeypatch.setattr(demo, "client", client)
    with pytest.raises(SystemExit) as exit_:
        demo.main(["trigger", "late_batch_backfill", "--password-file", "pw", "--conf", conf])

    assert exit_.value.code == 2
    assert "error: --conf " in capsys.readouterr().err


def _demo(repo: Path, *args: str, **env: str) -> tuple[int, str, str]:
    """demo.sh in ``repo`` (_fake_repo) until it says it runs until Ctrl-C, then Ctrl-C'd the
    way the terminal's SIGTERM does; or until it exits."""
    process = subprocess.Popen(["bash", "scripts/demo.sh", *args], cwd=repo, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=_environment(**{"CLICKSTREAM_BROKER_PORT": "19796",
                                                   "AIRFLOW_PORT": "18796", **env}))
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Running until Ctrl-C."):
                process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=60)
        return status, "".join(lines), process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_demo_reports_still_running_runs_and_where_the_password_is(tmp_path):
    """Before, a run still going after the trigger script's timeout was reported as failed, and
    the last banner said the password was printed above when only the first start prints it."""
    repo = _fake_repo(tmp_path)
    password_file = repo / "var" / "airflow" / "simple_auth_manager_passwords.json.generated"

    status, first, errors = _demo(repo, STUB_TRIGGER_STATUS="4")

    assert status == 130, first + errors
    assert first.count("[stub trigger]") == 2
    assert first.count("(the run is still running after the script's timeout: follow it in the "
                       "UI)") == 2
    assert "(the run failed" not in first
    assert " password:    " in first and "(generated now and shown only this once;" in first
    assert "(user admin; the password was printed above, once)" in first

    status, second, errors = _demo(repo, STUB_TRIGGER_STATUS="1")

    assert status == 130, second + errors
    assert second.count("(the run failed: see its task logs in the UI)") == 2
    assert "printed above" not in second and "generated now" not in second
    assert f"(user admin; the password is in {password_file})" in second
    started = (repo / "var" / "airflow" / "components.pid").read_text().split()
    assert len(started) == 8  # four components, twice: both stopped with the demo
    for pid in map(int, started):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_demo_checks_airflow_s_port_before_it_resets_anything(tmp_path):
    repo = _fake_repo(tmp_path)
    kept = repo / "var" / "demo" / "kept"
    kept.parent.mkdir(parents=True)
    kept.write_text("an earlier demo's")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])

        status, out, errors = _demo(repo, AIRFLOW_PORT=port)

        assert status == 1, out + errors
        assert errors.startswith(f"demo.sh: port {port} is in use (an Airflow still running?)")
        assert kept.exists() and "broker" not in out
        # Without Airflow, its port does not matter.
        status, out, errors = _demo(repo, "--no-airflow", AIRFLOW_PORT=port)

    assert status == 0, out + errors
    assert "== what the tables and the sessions topic hold" in out and not kept.exists()
