"""Liveness lines of the long commands (clickstream.progress): a silence is filled with what
Spark is doing, in the real Spark session; a command that speaks, or is done, gets none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.progress import heartbeat

BEAT = r"  \.\.\. still working, [\d.]+s since "
STAGE_LINE = re.compile(BEAT + r"the line above; Spark stage \d+: [01] of 2 tasks done")


def test_a_silence_is_filled_with_the_running_stage_and_its_tasks(
    spark: SparkSession, tmp_path: Path,
) -> None:
    flag = str(tmp_path / "seen")
    lines: list[str] = []

    def collect(line: str) -> None:
        lines.append(line)
        if STAGE_LINE.fullmatch(line):
            Path(flag).touch()

    def wait_for_a_line(_: int) -> None:
        """In a Spark task: held until a line named its stage (a minute at most, so a missing
        line fails the test instead of hanging it)."""
        import time
        from pathlib import Path

        deadline = time.monotonic() + 60
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    with heartbeat(collect, every_s=0.2) as progress:
        progress("  merge ...")
        spark.sparkContext.parallelize([1, 2], 2).foreach(wait_for_a_line)
        progress("  merge: done")
    assert lines[0] == "  merge ..." and lines[-1] == "  merge: done"
    assert Path(flag).exists(), lines  # the tasks were let go by a line, not by the deadline
    beats = lines[1:-1]  # before the stage starts and after it ends, there is none
    assert all(STAGE_LINE.fullmatch(line) or re.fullmatch(
        BEAT + "the line above; no Spark stage running", line) for line in beats), lines
    # Each says how long the silence has lasted: longer and longer.
    silences = [float(re.match(BEAT.replace(r"[\d.]+", r"([\d.]+)"), line)[1])
                for line in beats]
    assert silences == sorted(silences) and silences[0] >= 0.2, beats


def test_a_command_that_speaks_gets_no_line_and_none_once_it_is_done() -> None:
    lines: list[str] = []
    with heartbeat(lines.append, every_s=1.0) as progress:
        for step in range(30):  # 3 s, never a second without a line
            progress(f"step {step}")
            time.sleep(0.1)
    assert lines == [f"step {step}" for step in range(30)]
    assert not [t for t in threading.enumerate() if t.name == "clickstream-heartbeat"]


def test_a_silence_before_spark_starts_says_so() -> None:
    script = ("import time\n"
              "from clickstream.progress import heartbeat\n"
              "with heartbeat(print, every_s=0.2):\n"
              "    time.sleep(0.7)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out and all(re.fullmatch(BEAT + "the start; Spark not started yet", line)
                       for line in out), out


def test_a_reader_that_stops_reading_ends_the_beats_without_a_traceback() -> None:
    """``clickstream backfill ... | head -1``: the beat after the reader left raised
    BrokenPipeError in the heartbeat's thread, which printed a traceback (the command itself
    still ended with status 141 at its next line)."""
    script = ("import sys, time\n"
              "from clickstream.progress import heartbeat\n"
              "with heartbeat(print, every_s=0.2):\n"
              "    time.sleep(1.5)\n"
              "try:\n"
              "    print('done', flush=True)\n"
              "except BrokenPipeError:\n"
              "    sys.exit(141)\n")
    result = subprocess.run(f"{sys.executable} -c \"$SCRIPT\" | head -1", shell=True,
                            env={**os.environ, "SCRIPT": script}, capture_output=True,
                            text=True, timeout=60)
    assert re.fullmatch(BEAT + "the start; Spark not started yet\n", result.stdout), result
    assert "Traceback" not in result.stderr, result.stderr


def test_a_silence_while_spark_starts_or_stops_says_so_and_the_beats_go_on(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PySpark registers its context before the JVM side exists (``_jsc``), and clears it on
    stop: a beat then raised AttributeError, which ended the heartbeat for the rest of the
    command with a traceback on stderr."""
    monkeypatch.setattr(spark.sparkContext, "_jsc", None)  # the context as it starts
    lines: list[str] = []
    with heartbeat(lines.append, every_s=0.2):
        time.sleep(0.9)
    monkeypatch.undo()
    assert len(lines) >= 2 and all(re.fullmatch(
        BEAT + "the start; Spark starting or stopping", line) for line in lines), lines


def test_the_commands_say_they_are_still_working_at_the_configured_interval(
    tmp_path: Path,
) -> None:
    """``clickstream recompute`` on an empty warehouse: starting Spark is a silence of a
    second or more, longer than the interval (a beat while it starts ended the heartbeat,
    with a traceback on stderr)."""
    env = {**os.environ, "CLICKSTREAM_HOME": str(tmp_path / "home"),
           "CLICKSTREAM_WAREHOUSE": str(tmp_path / "warehouse"),
           "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "CLICKSTREAM_PROGRESS_INTERVAL": "0.2s"}
    result = subprocess.run([sys.executable, "-m", "clickstream.cli", "recompute"],
                            capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    *beats, last = result.stdout.splitlines()
    assert last == "recompute: the queue is empty"
    assert beats and all(re.fullmatch(
        BEAT + "the start; (Spark not started yet|Spark starting or stopping|no Spark stage "
        "running)", line) for line in beats), beats
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_the_interval_reads_bare_numbers_as_seconds() -> None:
    assert Config.from_env({}).progress_interval_seconds == 30
    assert Config.from_env({"CLICKSTREAM_PROGRESS_INTERVAL": "5"}).progress_interval_seconds == 5
    assert Config.from_env({"CLICKSTREAM_PROGRESS_INTERVAL": "2m"}).progress_interval_seconds \
        == 120
