"""A quiet stream's clock (``io.stream_clock``): the sessions open when the events stop close
without another event, and what arrives afterwards for their time is late, not lost."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.io.stream_clock import IdleClock, QuietTimer
from clickstream.jobs.inspect import describe_sessionizer
from clickstream.jobs.recompute import run_recompute
from tests.jobs.test_sessionize import (
    assert_topic_equals_table,
    ms,
    pageview,
    produce,
    table_rows,
)
from tests.jobs.test_sessionize_crash import group_ends, logged, start_sessionizer


class FakeMonotonic:
    def __init__(self) -> None:
        self.seconds = 1000.0

    def __call__(self) -> float:
        return self.seconds


def commit(checkpoint: Path, batch_id: int, watermark_ms: int) -> None:
    """A commit as Spark writes it: its version line, then its metadata."""
    (checkpoint / "commits").mkdir(parents=True, exist_ok=True)
    (checkpoint / "commits" / str(batch_id)).write_text(
        "v1\n" + json.dumps({"nextBatchWatermarkMs": watermark_ms}))


def test_the_clock_ticks_at_the_wall_clock_pace_until_every_open_session_can_close(
    tmp_path: Path,
) -> None:
    now = FakeMonotonic()
    clock = IdleClock(after_ms=60_000, delay_ms=60_000, gap_ms=300_000, checkpoint=tmp_path)
    quiet = QuietTimer(clock, now)
    now.seconds += 120
    assert quiet.tick(None) is None  # (T2) no micro-batch committed: no event time yet
    commit(tmp_path, 0, 0)
    assert quiet.tick(None) is None  # (T2) committed, but no event passed the watermark
    commit(tmp_path, 1, 1_000_000)  # the latest event time: 1,060,000
    assert quiet.tick(None) == 1_060_000 + 120_000  # quiet for two minutes: two minutes on
    now.seconds += 59
    assert quiet.tick(1_180_000) is None  # not quiet for a period since that tick
    now.seconds += 1
    assert quiet.tick(1_180_000) == 1_240_000  # on from the last tick (T1), not from commits
    # (T3) Every session open when the quiet began ended by 1,060,000, and closes once the
    # watermark (a tick less the delay) reaches 1,360,000. One tick passes it, then none.
    now.seconds += 600
    assert quiet.tick(1_240_000) == 1_840_000
    now.seconds += 600
    assert quiet.tick(1_840_000) is None
    quiet.moved()  # records came: a new quiet period starts from them
    now.seconds += 60
    assert quiet.tick(1_840_000) == 1_900_000


def test_a_clock_that_is_off_or_short_of_a_period_plans_nothing(tmp_path: Path) -> None:
    assert IdleClock.from_options({}) is None
    assert IdleClock.from_options({"idleClockAfterMs": "0"}) is None
    clock = IdleClock(after_ms=1_000, delay_ms=0, gap_ms=0, checkpoint=tmp_path)
    assert IdleClock.from_options(clock.options()) == clock
    commit(tmp_path, 0, 5_000)
    now = FakeMonotonic()
    quiet = QuietTimer(clock, now)
    now.seconds += 0.999
    assert quiet.tick(None) is None
    now.seconds += 0.001
    assert quiet.tick(None) == 6_000


def test_a_quiet_stream_closes_its_last_sessions_and_a_later_event_of_their_time_is_late(
    stream_config: Config, spark: SparkSession, tmp_path: Path
) -> None:
    """Two pageviews, then nothing: without the clock, their session stays open in the state
    for as long as no other event comes (the README's Known limits before session 81)."""
    config = stream_config.replace(session_gap_minutes=2 / 60, watermark_delay_minutes=1 / 60,
                                   idle_clock_after_minutes=2 / 60, driver_memory="1g")
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=30)
    produce(config, [pageview("u1", start), pageview("u1", start + timedelta(seconds=1))])
    log = tmp_path / "sessionize.log"
    process = start_sessionizer(config, log)
    try:
        deadline = time.monotonic() + 240
        while not table_rows(config, spark, "sessions"):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no session closed:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        sessions = table_rows(config, spark, "sessions")
        assert [(ms(s["session_start"]), ms(s["session_end"]), s["pageview_count"])
                for s in sessions] == [(ms(start), ms(start) + 1_000, 2)]
        # A tick's micro-batch reads no record (it read the first micro-batch's again once).
        ticks = [line for line in log.read_text().splitlines() if "clock moved on" in line]
        assert ticks and all(": 0 records," in line for line in ticks), ticks
        # (T4) The clock has passed the session: a pageview of its time is late now.
        produce(config, [pageview("u1", start + timedelta(seconds=2))])
        deadline = time.monotonic() + 120
        while not table_rows(config, spark, "recompute_queue"):
            assert time.monotonic() < deadline, f"not queued:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
        # Its progress line says what made it late.
        assert "where the quiet stream's clock moved it (CLICKSTREAM_IDLE_CLOCK_AFTER)" in (
            log.read_text())
        assert group_ends(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # The ticks moved the watermark and stored nothing: every row is one of the pageviews.
    assert len(table_rows(config, spark, "pageviews")) == 3
    assert table_rows(config, spark, "quarantine") == []
    assert table_rows(config, spark, "other_events") == []
    assert table_rows(config, spark, "sessions") == sessions  # the late one did not reopen it
    assert_topic_equals_table(config, sessions)
    assert logged(config, "commits")[-1] >= 2  # the pageviews' micro-batch, a tick, its close
    assert any(line.startswith("  the quiet stream's clock moved event time on to ")
               for line in describe_sessionizer(config))
    # Late, not lost: the recompute folds it into the session, at its next revision.
    run_recompute(config, spark=spark)
    assert table_rows(config, spark, "recompute_queue") == []
    (session,) = table_rows(config, spark, "sessions")
    assert (ms(session["session_start"]), ms(session["session_end"]), session["pageview_count"],
            session["revision"]) == (ms(start), ms(start) + 2_000, 3, 2)
    assert_topic_equals_table(config, [session])
