"""The public command line: every command has --help, failures are one line and non-zero."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clickstream import cli
from clickstream.cli import main
from clickstream.config import Config
from clickstream.errors import EXIT_NOT_RETRYABLE, ClickstreamError, ConfigError

CLI = [sys.executable, "-m", "clickstream.cli"]


@pytest.mark.parametrize("command", [
    [], ["broker"], ["sessionize"], ["backfill"], ["backfill-step"], ["recompute"],
    ["republish"], ["maintain"], ["inspect"],
    ["generate"],
    ["generate", "events"],
    ["generate", "history"],
])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: clickstream" in capsys.readouterr().out


def test_duration_flags_show_a_duration_not_their_settings_unit(
    capsys: pytest.CaptureFixture,
) -> None:
    """They take 45s or 1h as well as minutes; the setting's name showed SESSION_GAP_MINUTES."""
    with pytest.raises(SystemExit):
        main(["sessionize", "--help"])
    shown = capsys.readouterr().out
    for flag in ("--session-gap", "--watermark-delay", "--max-ts-ahead"):
        assert f"[{flag} DURATION]" in shown, flag
    assert "MINUTES" not in shown


def _subcommands(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        (choices,) = [action.choices for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction)]
        parser = choices[name]
    return parser


@pytest.mark.parametrize("kind", ["events", "history"])
def test_generate_help_shows_every_default(kind: str, capsys: pytest.CaptureFixture) -> None:
    """The generator's knobs have defaults a user tunes from; --help named none of them."""
    parser = _subcommands(cli.build_parser(), "generate", kind)
    with pytest.raises(SystemExit):
        main(["generate", kind, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    defaults = [action for action in parser._actions
                if action.default not in (None, False, argparse.SUPPRESS)]
    assert len(defaults) >= 7
    for action in defaults:
        assert f"(default: {action.default})" in shown, action.option_strings


def test_invalid_setting_fails_with_one_line_naming_the_accepted_values() -> None:
    result = subprocess.run([*CLI, "inspect"], capture_output=True, text=True,
                            env={"CLICKSTREAM_DELTA_ENGINE": "parquet", "PATH": ""}, timeout=60)
    assert result.returncode == EXIT_NOT_RETRYABLE
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


def test_kafka_transactions_are_off_unless_set_true_or_false() -> None:
    assert Config.from_env({}).kafka_transactions is False
    assert Config.from_env({"CLICKSTREAM_KAFKA_TRANSACTIONS": "True"}).kafka_transactions is True
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_KAFKA_TRANSACTIONS='yes' is not "
                                          r"accepted; use true or false$"):
        Config.from_env({"CLICKSTREAM_KAFKA_TRANSACTIONS": "yes"})
    with pytest.raises(ConfigError, match="CLICKSTREAM_KAFKA_TRANSACTIONS must be true or "):
        Config(kafka_transactions="false")  # type: ignore[arg-type]
    # A transactional id of the operator's made every send need a transaction: each failed
    # as "Erroneous state" (review, session 78).
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_KAFKA_OPTIONS: transactional\.id "
                       r"would make every send .* set CLICKSTREAM_KAFKA_TRANSACTIONS=true"):
        Config.from_env({"CLICKSTREAM_KAFKA_OPTIONS": "linger.ms=5,transactional.id=x"})


def test_durations_accept_units_and_reject_nonsense() -> None:
    config = Config.from_env({"CLICKSTREAM_SESSION_GAP": "45s",
                              "CLICKSTREAM_WATERMARK_DELAY": "1h", "CLICKSTREAM_MAX_TS_AHEAD": "2"})
    assert (config.session_gap_ms, config.watermark_delay_ms, config.max_ts_ahead_ms) == (
        45_000, 3_600_000, 120_000)
    with pytest.raises(ConfigError, match="not a duration"):
        Config.from_env({"CLICKSTREAM_SESSION_GAP": "soon"})
    with pytest.raises(ConfigError, match=r"^--session-gap='soon' is not a duration"):
        Config.from_env({}, session_gap_minutes="soon")  # named as the flag the user typed
    with pytest.raises(ConfigError, match=r"^--max-ts-ahead='-5m' is negative; a duration is "
                       r"at least 1ms$"):
        Config.from_env({}, max_ts_ahead_minutes="-5m")
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_SESSION_GAP='-5' is negative"):
        Config.from_env({"CLICKSTREAM_SESSION_GAP": "-5"})
    with pytest.raises(ConfigError, match=r"^--max-ts-ahead='-5x' is not a duration"):
        Config.from_env({}, max_ts_ahead_minutes="-5x")


def test_a_flag_wins_over_a_malformed_variable_it_overrides() -> None:
    """The variable was converted first, so its error stopped the command the flag fixed."""
    env = {"CLICKSTREAM_SESSION_GAP": "30x", "CLICKSTREAM_MAX_EVENTS_PER_TRIGGER": "abc"}
    config = Config.from_env(env, session_gap_minutes="30", max_events_per_trigger=1000)
    assert (config.session_gap_ms, config.max_events_per_trigger) == (1_800_000, 1000)
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_SESSION_GAP='30x' is not a duration"):
        Config.from_env(env, max_events_per_trigger=1000)  # a variable no flag overrides


def test_kafka_options_take_a_comma_inside_a_value_escaped() -> None:
    """List settings (``ssl.cipher.suites``, ``debug``) and passwords hold commas."""
    options = Config.from_env({"CLICKSTREAM_KAFKA_OPTIONS": (
        r"ssl.cipher.suites=A\,B, debug=broker\,topic,sasl.password=p\,w=1,")}).kafka_options
    assert options == {"ssl.cipher.suites": "A,B", "debug": "broker,topic",
                       "sasl.password": "p,w=1"}
    with pytest.raises(ConfigError, match=r"item 2 \(after 'ssl.cipher.suites'\) is not "
                       r"key=value .*inside a value as \\,"):
        Config.from_env({"CLICKSTREAM_KAFKA_OPTIONS": "ssl.cipher.suites=A,B"})
    # The rest of a password cut at a comma stays out of the message (task logs, the CLI).
    with pytest.raises(ConfigError) as cut:
        Config.from_env({"CLICKSTREAM_KAFKA_OPTIONS": "sasl.username=u,sasl.password=hunter,2sec"})
    assert "2sec" not in str(cut.value) and "hunter" not in str(cut.value)
    assert str(cut.value).startswith("CLICKSTREAM_KAFKA_OPTIONS: item 3 (after 'sasl.password') ")
    # Applied over KAFKA_BOOTSTRAP_SERVERS, a stale address here was used silently, and a
    # failure named the variable's address, which worked.
    for variable in ("CLICKSTREAM_KAFKA_OPTIONS", "CLICKSTREAM_SPARK_KAFKA_OPTIONS"):
        for key in ("bootstrap.servers", "metadata.broker.list"):
            with pytest.raises(ConfigError, match=rf"^{variable}: {key} is KAFKA_BOOTSTRAP_"):
                Config.from_env({variable: f"acks=all,{key}=127.0.0.1:1"})


def test_trigger_interval_reads_bare_numbers_as_seconds_and_echoes_what_was_typed() -> None:
    assert Config.from_env({"CLICKSTREAM_TRIGGER_INTERVAL": "5"}).trigger_interval_seconds == 5
    assert Config.from_env({}, trigger_interval_seconds="2m").trigger_interval_seconds == 120
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_TRIGGER_INTERVAL='0' must be at least"):
        Config.from_env({"CLICKSTREAM_TRIGGER_INTERVAL": "0"})
    with pytest.raises(ConfigError, match=r"'soon' is not a duration; use seconds \(10\)"):
        Config.from_env({"CLICKSTREAM_TRIGGER_INTERVAL": "soon"})


@pytest.mark.parametrize("master", ["local[*]", "local", "local[2]", "local[2,3]", "yarn",
                                    "spark://h1:7077,h2:7077", "k8s://https://h:6443",
                                    "local-cluster[2, 1, 1024]"])
def test_spark_master_urls_spark_accepts_are_accepted(master: str) -> None:
    assert Config.from_env({"CLICKSTREAM_SPARK_MASTER": master}).spark_master == master


def test_a_bad_spark_master_fails_with_one_line_before_spark_starts(tmp_path) -> None:
    env = {**os.environ, "CLICKSTREAM_HOME": str(tmp_path), "CLICKSTREAM_WAREHOUSE": str(tmp_path)}
    result = subprocess.run([*CLI, "sessionize", "--until-caught-up", "--spark-master", "bogus"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "clickstream sessionize: error: spark master 'bogus' (CLICKSTREAM_SPARK_MASTER or "
        "--spark-master) is not a Spark master URL; use local[*], local[2], spark://host:7077, "
        "yarn or k8s://host:port"], result.stderr


@pytest.mark.parametrize(("env", "complaint"), [
    ({"CLICKSTREAM_SESSIONS_TOPIC": "events"}, "CLICKSTREAM_EVENTS_TOPIC and "
     "CLICKSTREAM_SESSIONS_TOPIC both name topic 'events'; give each role its own topic"),
    ({"CLICKSTREAM_ATTRIBUTIONS_TOPIC": "sessions"}, "CLICKSTREAM_SESSIONS_TOPIC and "
     "CLICKSTREAM_ATTRIBUTIONS_TOPIC both name topic 'sessions'"),
    ({"CLICKSTREAM_EVENTS_TOPIC": "web events/v2"}, "CLICKSTREAM_EVENTS_TOPIC='web events/v2' "
     "is not a Kafka topic name; use 1-249 letters, digits, '.', '_' or '-'"),
    ({"CLICKSTREAM_SESSIONS_TOPIC": "s" * 250}, "is not a Kafka topic name"),
    ({"CLICKSTREAM_SESSIONS_TOPIC": ".."}, "is not a Kafka topic name")])
def test_topics_kafka_would_refuse_or_two_roles_sharing_one_are_refused(
        env: dict[str, str], complaint: str) -> None:
    """A shared topic passed: the sessionizer would publish its sessions into the topic it
    reads, and the broker created one topic fewer without a word."""
    assert Config.from_env({"CLICKSTREAM_EVENTS_TOPIC": "web.events_v-2"}).events_topic
    with pytest.raises(ConfigError) as refused:
        Config.from_env(env)
    assert complaint in str(refused.value)


@pytest.mark.parametrize("size", ["1536", "0g", "4 g", "lots"])
def test_driver_memory_needs_a_jvm_size_with_a_unit(size: str) -> None:
    assert Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": "1536m"}).driver_memory == "1536m"
    with pytest.raises(ConfigError, match=r"CLICKSTREAM_DRIVER_MEMORY=.* with a unit"):
        Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": size})


def test_progress_reaches_a_pipe_as_it_is_printed() -> None:
    """Commands print progress with plain ``print``: into a pipe or a log file (``| tee``,
    cron, nohup) it was held in a block buffer until the process ended, so a backfill
    waiting for a lock said nothing, and a kill -9 lost what it had said."""
    script = ("import sys, time\nfrom clickstream.cli import main\n"
              "try:\n    main(['broker', '--help'])\nexcept SystemExit:\n    pass\n"
              "print('a progress line')\ntime.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(
            iter(lambda: process.stdout.readline(), "")), daemon=True)  # type: ignore[union-attr]
        reader.start()
        deadline = time.monotonic() + 30
        while "a progress line\n" not in lines and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "a progress line\n" in lines, "the line was still buffered while it ran"
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_line_is_written_whole_even_unbuffered(stream: str) -> None:
    """The sessionizer's log holds its JVM's lines too (one file for stdout and stderr):
    unbuffered (PYTHONUNBUFFERED, as Spark's runner and CI set it) a print wrote its text and
    its newline apart, and a JVM warning landed inside "sessionize: stopped; ..." (a CI
    failure). Here another writer's bytes go to the same descriptor mid-line: they must come
    before the line, not inside it."""
    fd = 1 if stream == "stdout" else 2
    script = ("import os, sys\nfrom clickstream.cli import main\n"
              "try:\n    main(['broker', '--help'])\nexcept SystemExit:\n    pass\n"
              f"print('start of line', end='', file=sys.{stream})\n"
              f"os.write({fd}, b'[jvm]')\n"
              f"print(' end of line', file=sys.{stream})\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    output = getattr(done, stream)
    assert output.endswith("[jvm]start of line end of line\n"), output[-200:]


@pytest.mark.parametrize("name", ["wh[1]", "wh{a,b}", "wh*", "wh:1"])
@pytest.mark.parametrize("variable", ["CLICKSTREAM_WAREHOUSE", "CLICKSTREAM_HOME",
                                      "CLICKSTREAM_LANDING"])
def test_folders_spark_would_read_as_a_pattern_or_a_scheme_are_refused(
    tmp_path: Path, variable: str, name: str
) -> None:
    """Every table read names the files below the warehouse to Spark, which read
    ``wh[1]/...`` as a glob matching ``wh1``: writes went through, every read failed."""
    folder = tmp_path / name
    flag = "--" + variable.removeprefix("CLICKSTREAM_").lower()
    with pytest.raises(ConfigError, match=rf"^'.*' \({variable} or {flag}\) has (one of|':') "
                                          ".* choose a folder whose path has none"):
        Config.from_env({variable: str(folder)})
    assert Config.from_env({variable: str(tmp_path / "wh1")})


@pytest.mark.parametrize(("size", "mib"), [("1536m", 1536), ("4G", 4096), ("2097152k", 2048),
                                           ("1t", 1024 * 1024)])
def test_driver_memory_in_mib_reads_every_jvm_unit(size: str, mib: int) -> None:
    assert Config.from_env({"CLICKSTREAM_DRIVER_MEMORY": size}).driver_memory_mib == mib


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("false", False), ("False", False), ("TRUE", True), (" false ", False)])
def test_fail_on_data_loss_reads_true_or_false(text: str, value: bool) -> None:
    assert Config.from_env({"CLICKSTREAM_FAIL_ON_DATA_LOSS": text}).fail_on_data_loss is value
    assert Config.from_env({}, fail_on_data_loss=text).fail_on_data_loss is value


def test_fail_on_data_loss_refuses_anything_else(capsys: pytest.CaptureFixture) -> None:
    assert Config.from_env({}).fail_on_data_loss is True
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_FAIL_ON_DATA_LOSS='no' is not "
                                          r"accepted; use true or false$"):
        Config.from_env({"CLICKSTREAM_FAIL_ON_DATA_LOSS": "no"})
    with pytest.raises(ConfigError, match="CLICKSTREAM_FAIL_ON_DATA_LOSS must be true or false"):
        Config(fail_on_data_loss="false")  # type: ignore[arg-type]
    assert main(["sessionize", "--fail-on-data-loss", "0"]) == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err.strip().splitlines() == [
        "clickstream sessionize: error: --fail-on-data-loss='0' is not accepted; use true or "
        "false"]


@pytest.mark.parametrize(("text", "ms"), [
    ("off", 0), ("OFF", 0), ("0", 0), ("0.0", 0), ("0s", 0), ("90s", 90_000), ("5", 300_000)])
def test_the_idle_clock_takes_a_duration_or_off(text: str, ms: int) -> None:
    assert Config.from_env({"CLICKSTREAM_IDLE_CLOCK_AFTER": text}).idle_clock_after_ms == ms
    assert Config.from_env({}, idle_clock_after_minutes=text).idle_clock_after_ms == ms


def test_the_idle_clock_refuses_what_is_no_duration(capsys: pytest.CaptureFixture) -> None:
    assert Config().idle_clock_after_ms == 300_000
    with pytest.raises(ConfigError, match="is negative; give a duration, or off"):
        Config(idle_clock_after_minutes=-1.0)
    assert main(["sessionize", "--idle-clock-after", "soon"]) == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err.strip().splitlines() == [
        "clickstream sessionize: error: --idle-clock-after='soon' is not a duration; use "
        "minutes (30) or a unit: 500ms, 45s, 30m, 2h"]


@pytest.mark.parametrize(("step", "run_id"), [
    ("report", []), ("publish", ["--run-id", "orders-client-00-typo"]),
    ("check-applied", ["--run-id", "orders-client-00-typo"])])
def test_a_backfill_step_out_of_order_fails_with_one_line(tmp_path, step: str,
                                                          run_id: list[str]) -> None:
    """Before it writes anything, its failure page included: a mistyped run id published
    nothing and said so with exit 0, and a report's failure page named a run that never was."""
    landing = tmp_path / "landing"
    (landing / "b").mkdir(parents=True)
    (landing / "b" / "orders.jsonl").write_text("{}\n")
    home = tmp_path / "home"
    env = {"CLICKSTREAM_HOME": str(home), "CLICKSTREAM_LANDING": str(landing),
           "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"), "PATH": ""}
    result = subprocess.run([*CLI, "backfill-step", step, "--kind", "orders", "--client",
                             "client-00", "--path", "b", *run_id], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == EXIT_NOT_RETRYABLE
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no result of step 'check'" in result.stderr and "run the steps in order" in \
        result.stderr
    assert not home.exists() or not any(path.is_file() for path in home.rglob("*"))


def test_an_unexpected_error_is_one_line_and_its_traceback_is_kept(tmp_path) -> None:
    log = tmp_path / "warehouse" / "pageviews" / "_delta_log"
    log.mkdir(parents=True)
    (log / f"{0:020d}.json").write_text("not json\n")  # a damaged table: no product error
    env = {"CLICKSTREAM_HOME": str(tmp_path / "home"),
           "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"), "PATH": ""}
    result = subprocess.run([*CLI, "inspect"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clickstream inspect: unexpected error: ")
    kept = lines[0].rsplit("traceback in ", 1)[1]
    assert kept.startswith(str(tmp_path / "home" / "logs"))
    assert "Traceback (most recent call last)" in Path(kept).read_text()


@pytest.mark.parametrize(("pressed", "spark_started"), [
    (True, False), (True, True), (False, False)])
def test_a_ctrl_c_a_c_extension_lost_is_still_an_interrupt(
        pressed: bool, spark_started: bool, spark_config: Config, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C during ``generate events --rate`` hit the delivery callback inside
    confluent-kafka's ``poll``, which lost the ``KeyboardInterrupt`` and raised
    ``SystemError``: reported as an unexpected error, exit 1, not interrupted, 130. Also
    once a command started Spark, whose context puts its own SIGINT handler in place."""
    def pyspark_handler(signum: int, frame: object) -> None:  # cancels the jobs, then:
        raise KeyboardInterrupt

    def poll_losing_the_interrupt(args: object, config: Config) -> int:
        if spark_started:
            from clickstream.spark_session import build_spark

            signal.signal(signal.SIGINT, pyspark_handler)  # as SparkContext's start does
            build_spark(spark_config, "clickstream-tests")
        if pressed:
            with contextlib.suppress(KeyboardInterrupt):  # lost in "the callback"
                signal.raise_signal(signal.SIGINT)
        raise SystemError("<method 'poll' of 'cimpl.Producer' objects> returned NULL "
                          "without setting an exception")

    monkeypatch.setattr(cli, "_cmd_generate_events", poll_losing_the_interrupt)
    monkeypatch.setenv("CLICKSTREAM_HOME", str(tmp_path / "home"))
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal:
    try:  # a process started in the background (`cmd &`, CI) inherits SIGINT ignored
        status = main(["generate", "events", "--rate", "5"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, inherited)
    error = capsys.readouterr().err
    if pressed:
        assert (status, error) == (130, "clickstream generate: interrupted\n")
    else:  # a SystemError of its own is a bug
        assert status == 1 and "unexpected error: SystemError" in error


def test_sessionize_without_kafka_fails_in_one_line_before_spark_starts(
        tmp_path, refusing_port: int) -> None:
    port = refusing_port
    env = {"CLICKSTREAM_HOME": str(tmp_path / "home"), "PATH": "",
           "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"),
           "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}
    result = subprocess.run([*CLI, "sessionize", "--until-caught-up"], capture_output=True,
                            text=True, env=env, timeout=180)
    assert result.returncode == 1
    reason = result.stderr.strip().splitlines()[-1]  # above it: librdkafka's connect failures
    assert reason.startswith(f"clickstream sessionize: error: kafka at 127.0.0.1:{port} did "
                             "not answer")
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    assert not (tmp_path / "home" / "checkpoints").exists()  # nothing started
    waits = [line.rpartition(" (attempt ")[2] for line in result.stderr.splitlines()
             if line.startswith(f"kafka at 127.0.0.1:{port}, topic 'events': ")]
    assert waits == [f"{n} of 5); asking again in {s} s"  # not ~30 s without a word
                     for n, s in ((1, "0.5"), (2, "1"), (3, "2"), (4, "4"))], result.stderr


def test_generating_events_ahead_of_now_is_refused_before_anything_is_produced(
    capsys: pytest.CaptureFixture,
) -> None:
    """The sessionizer would quarantine them all (CLICKSTREAM_MAX_TS_AHEAD); no broker runs at
    this address, so reaching the producer would fail differently."""
    code = main(["generate", "events", "--start", "2099-01-01T00:00Z", "--minutes", "60",
                 "--kafka-bootstrap-servers", "127.0.0.1:1"])
    assert code == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err.strip().splitlines() == [
        "clickstream generate: error: --start and --minutes reach 2099-01-01T01:00:00+00:00, "
        "more than 10 minutes ahead of now: the sessionizer would quarantine those events as "
        "stamped by a wrong clock (CLICKSTREAM_MAX_TS_AHEAD); choose an earlier --start"]


def test_generating_reads_only_the_settings_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
) -> None:
    """A job's setting the generators never use (a sessionizer's trigger size) refused them,
    naming a flag they do not look at; one they use is still read."""
    monkeypatch.setenv("CLICKSTREAM_MAX_EVENTS_PER_TRIGGER", "0")
    monkeypatch.setenv("CLICKSTREAM_LANDING", str(tmp_path / "landing"))
    out = tmp_path / "events.jsonl"
    assert main(["generate", "events", "--clients", "1", "--users", "3", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    assert main(["generate", "history", "--client", "c1", "--days", "1", "--users", "1",
                 "--format", "jsonl"]) == 0
    assert (tmp_path / "landing" / "history" / "orders").is_dir()
    monkeypatch.setenv("CLICKSTREAM_MAX_TS_AHEAD", "soon")
    assert main(["generate", "events", "--out", str(out)]) == EXIT_NOT_RETRYABLE
    assert "CLICKSTREAM_MAX_TS_AHEAD='soon'" in capsys.readouterr().err
    # Nor do they take a job's flag: it was checked, then ignored
    for command in (["events", "--out", str(out)], ["history", "--client", "c1"]):
        with pytest.raises(SystemExit) as refused:
            main(["generate", *command, "--session-gap", "abc"])
        assert refused.value.code == 2
        assert "unrecognized arguments: --session-gap abc" in capsys.readouterr().err


@pytest.mark.parametrize(("start", "minutes", "complaint"), [
    ("1999-12-31T20:00Z", "600", "--start 1999-12-31T20:00:00+00:00 is before 2000-01-01, the "
     "earliest event time the product accepts: the sessionizer would quarantine those "
     "events; choose a later --start"),
    ("2099-12-31T23:00Z", "120", "--start and --minutes reach 2100-01-01T01:00:00+00:00, after "
     "2100-01-01, the latest event time the product accepts: the sessionizer would quarantine "
     "those events; choose an earlier --start"),
])
def test_generating_events_outside_the_accepted_times_is_refused_even_into_a_file(
    start: str, minutes: str, complaint: str, tmp_path: Path, capsys: pytest.CaptureFixture,
) -> None:
    """Both parsers quarantine times before 2000 or from 2100 on; the generator labelled
    them valid in a file (which meets no check of the time ahead of now)."""
    out = tmp_path / "events.jsonl"
    code = main(["generate", "events", "--start", start, "--minutes", minutes,
                 "--out", str(out)])
    assert code == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err.strip().splitlines() == [
        f"clickstream generate: error: {complaint}"]
    assert not out.exists()


def test_settings_that_would_mean_something_else_are_refused_naming_where_they_came_from(
) -> None:
    with pytest.raises(ConfigError, match=r"^--warehouse is empty; give a value or leave it out"):
        Config.from_env({}, warehouse="")  # "$UNSET_VARIABLE": not the current folder
    with pytest.raises(ConfigError, match=r"^--session-gap='0.0001ms' must be at least 1ms"):
        Config.from_env({}, session_gap_minutes="0.0001ms")  # 0 ms: every pageview alone
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_SESSION_GAP='9{400}' must be at most "
                                          r"100 years$"):  # a float's infinity, unnamed
        Config.from_env({"CLICKSTREAM_SESSION_GAP": "9" * 400})
    with pytest.raises(ConfigError, match=r"spark master 'local\[0\]'"):
        Config.from_env({"CLICKSTREAM_SPARK_MASTER": "local[0]"})  # Spark: "0 threads"
    # A value that may have come from the variable or the flag names both.
    with pytest.raises(ConfigError, match=r"^'bogus' \(CLICKSTREAM_QUALITY_GATES or "
                                          r"--quality-gates\) is not accepted; use one of: "):
        Config.from_env({}, quality_gates="bogus")
    with pytest.raises(ConfigError, match=r"^0 \(CLICKSTREAM_MAX_EVENTS_PER_TRIGGER or "
                                          r"--max-events-per-trigger\) must be at least 1$"):
        Config.from_env({"CLICKSTREAM_MAX_EVENTS_PER_TRIGGER": "0"})


@pytest.mark.parametrize(("argv", "complaint"), [
    (["generate", "events", "--minutes", "-5"], "argument --minutes: '-5' must be greater than 0"),
    (["generate", "events", "--minutes", "nan"], "argument --minutes: 'nan' must be greater"),
    (["generate", "events", "--duplicate-fraction", "2"],
     "argument --duplicate-fraction: '2' must be at least 0 and at most 1"),
    (["generate", "events", "--seed", "-1"], "argument --seed: '-1' must be at least 0"),
    (["generate", "history", "--client", "c1", "--users", "0"],
     "argument --users: '0' must be at least 1"),
    (["generate", "history", "--client", " c1"], "argument --client: ' c1' is not a client id"),
    (["recompute", "--client="], "argument --client: '' is not a client id"),
    (["recompute", "--client", "a\x1fb"], "argument --client: 'a\\x1fb' is not a client id: "
     "it is empty, has spaces around it or a control character"),
    (["backfill", "--kind", "orders", "--client", "c1 ", "--path", "b"],
     "argument --client: 'c1 ' is not a client id"),
    (["recompute", "--client", "\u5546" * 22], "is not a client id: it is longer than 64 "
     "bytes of UTF-8"),
    (["inspect", "--sample", "-1"], "argument --sample: '-1' must be at least 0"),
    (["inspect", "--topic", ""], "argument --topic: '' is not a topic name"),
    # A variable left unset: the events went to Kafka, the batch was taken as it is now.
    (["generate", "events", "--out", ""], "argument --out: '' is empty; give a value or leave "
     "the flag out"),
    (["backfill-step", "check", "--kind", "orders", "--client", "c1", "--path", "b",
      "--run-id", " "], "argument --run-id: ' ' is empty"),
    (["recompute", "--save-result-as", ""], "argument --save-result-as: '' is empty"),
])
def test_flag_values_that_mean_nothing_are_refused_before_anything_runs(
        argv: list[str], complaint: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_an_out_file_that_cannot_be_written_is_named_in_one_line(tmp_path, capsys) -> None:
    """It was an unexpected error, its traceback in a file; then "File exists", with a
    traceback kept as for a bug: the file in the way is named now."""
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "events.jsonl"
    code = main(["generate", "events", "--clients", "1", "--users", "2", "--minutes", "1",
                 "--out", str(out), "--home", str(tmp_path / "home")])
    assert code == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err == (
        f"clickstream generate: error: --out '{out}': {tmp_path / 'a-file'} is a file, not a "
        "folder; name a file in a folder\n")
    assert not (tmp_path / "home" / "logs").exists()


def test_an_error_carrying_an_engines_text_is_one_line_its_text_kept(
        tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark's text of a failure is many lines (a worker's traceback, a JVM stack): the
    first line alone is printed, the whole text kept in the traceback file."""
    def fails(args, config) -> int:
        raise ClickstreamError("recompute failed for 1 of 2 clients (c1: boom)\n  at a.b(C)")

    monkeypatch.setattr(cli, "_cmd_recompute", fails)
    code = main(["recompute", "--home", str(tmp_path / "home")])
    assert code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("clickstream recompute: error: recompute failed for 1 of 2 clients "
                           "(c1: boom); traceback in ")
    assert "at a.b(C)" in Path(line.rsplit("traceback in ", 1)[1]).read_text()


def test_a_dry_run_of_a_step_that_writes_is_refused(tmp_path, capsys) -> None:
    """The DAG skips the writing steps in a dry run; on the command line, --dry-run true on
    one of them used to write all the same."""
    code = main(["backfill-step", "merge", "--kind", "orders", "--client", "c1", "--path", "b",
                 "--dry-run", "true", "--warehouse", str(tmp_path / "warehouse"),
                 "--home", str(tmp_path / "home"), "--landing", str(tmp_path)])
    assert code == EXIT_NOT_RETRYABLE
    assert capsys.readouterr().err.strip() == (
        "clickstream backfill-step: error: --dry-run true applies to the steps check and "
        "report only, which write nothing; step merge writes the tables (a dry run of the DAG "
        "skips it)")
    assert not (tmp_path / "warehouse").exists()


@pytest.mark.parametrize(("argv", "complaint"), [
    (["--out", "h[9]"], "has one of * ? [ \\ ] { } in its path, which Spark would read as a "
     "pattern matching other files; backfill refuses such a batch"),
    (["--out", "late-2026-11-01T00:00"], "has ':' in its path"),
    (["--out", "h1/pageviews"], "is or lies inside a batch folder"),
    (["--out", "notes.txt/late"], "notes.txt is a file, not a folder"),  # unexpected error
    (["--start", "2099-01-01T00:00Z"], "--start and --days reach 2099-01-02T00:00:00+00:00, more "
     "than 10 minutes ahead of now: a backfill would quarantine those rows"),
    (["--start", "2000-01-01T01:00+02:00"], "--start 2000-01-01T01:00:00+02:00 is before "
     "2000-01-01, the earliest event time the product accepts: a backfill would quarantine "
     "those rows; choose a later --start"),
])
def test_generate_history_refuses_a_batch_backfill_would_refuse(
        argv: list[str], complaint: str, tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("not a batch")
    code = main(["generate", "history", "--client", "c1", "--days", "1", "--users", "2",
                 "--landing", str(tmp_path), *argv])
    assert code == EXIT_NOT_RETRYABLE
    assert complaint in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.parquet"))
