"""A quiet stream's clock: event time runs on at the wall clock's pace while no event arrives.

Spark's watermark is the latest event time the query saw, minus the delay: it moves only when
events come. A stream that went quiet (the night, every producer down, the end of a replay)
kept its last open sessions, and their orders, until traffic resumed: the field's "we can't
wait for the next click to advance the time, because it may never happen". Kafka Streams
answers it with wall-clock punctuation, Flink with idle sources. Here the Kafka source plans a
*clock tick* once the topic has had no new record for ``CLICKSTREAM_IDLE_CLOCK_AFTER``: a
micro-batch whose only row is a tick, timed at the latest event time plus the wall time the
stream has been quiet. The parser gives it ``contract.CLOCK_SOURCE`` and no error; the session
branch lets it through the watermark but not into the session state, and the record branch
drops it (``jobs.sessionize``). So a tick moves the watermark and nothing else, and the
sessions it passes close in the next micro-batch, as if events had gone on arriving.

Known edge cases, cited inline as (T1)..(T6):
  T1. The tick is part of the micro-batch's end offsets (``CLOCK_OFFSET``), and every later
      end offset carries it on: a replayed micro-batch reads the same tick, and the next tick
      starts from the last one.
  T2. The latest event time is read from the checkpoint's last commit (Spark's
      ``nextBatchWatermarkMs``, plus the delay: ticks included). Before the first commit, or
      before any event passed the watermark, there is none, and no tick.
  T3. Ticks stop once event time has passed every session open when the quiet began (its
      latest event time plus one gap and the delay): a stream quiet for days plans a few
      micro-batches, not one every period.
  T4. A record arriving after a tick with a ``ts`` at or before the new watermark is late, as
      any late record: stored and queued for ``clickstream recompute``. A producer resuming
      after a pause with its events' own times stays on time (its events are as far ahead as
      the pause was long); one that sends the pause's events afterwards (buffered through an
      outage) sends them late, once the pause was longer than the idle period and the delay.
  T5. Quiet is measured by each reader, from its last planning with new records or its last
      tick, on its own monotonic clock: a restarted sessionizer counts from its start.
  T6. ``--until-caught-up`` (Trigger.AvailableNow) never ticks, nor does Spark's native Kafka
      source (Spark's own code).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from clickstream.io.spark_checkpoint import has_log_entry, last_logged_batch, log_entry

CLOCK_OFFSET = "clock"  # in the source's end offsets: the latest tick's event time, ms (T1)


@dataclass(frozen=True)
class IdleClock:
    """When and how far a quiet stream's event time runs on. Travels to the source as text
    options (``options``), like the rest of its settings."""

    after_ms: int  # CLICKSTREAM_IDLE_CLOCK_AFTER
    delay_ms: int  # the watermark's delay
    gap_ms: int  # the session gap (T3)
    checkpoint: Path  # the query's checkpoint, whose last commit holds the watermark (T2)

    def options(self) -> dict[str, str]:
        return {"idleClockAfterMs": str(self.after_ms), "idleClockDelayMs": str(self.delay_ms),
                "idleClockGapMs": str(self.gap_ms), "idleClockCheckpoint": str(self.checkpoint)}

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> IdleClock | None:
        """The clock ``options`` describe; None when there is none (or it is off)."""
        after = int(options.get("idleClockAfterMs", "0"))
        if after <= 0:
            return None
        return cls(after, int(options["idleClockDelayMs"]), int(options["idleClockGapMs"]),
                   Path(options["idleClockCheckpoint"]))

    def latest_event_time_ms(self) -> int | None:
        """The latest event time the query's watermark has taken in, ticks included (T2)."""
        committed = last_logged_batch(self.checkpoint, "commits")
        if committed < 0:
            return None
        watermark = int(log_entry(self.checkpoint, "commits", committed)
                        .metadata.get("nextBatchWatermarkMs", 0))
        return watermark + self.delay_ms if watermark > 0 else None


class QuietTimer:
    """One reader's view of how long the stream has been quiet, and the ticks it plans (T5)."""

    def __init__(self, clock: IdleClock, now: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._now = now
        self._since = now()
        self._closes_all_at: int | None = None  # (T3) of the quiet period going on
        self._spent = False  # (T3) it has passed them: no more ticks until records come

    def moved(self) -> None:
        """New records were planned: the stream is not quiet."""
        self._since = self._now()
        self._closes_all_at = None
        self._spent = False

    def tick(self, last_tick_ms: int | None) -> int | None:
        """The event time of a tick to plan now, or None: not quiet long enough, nothing seen
        yet (T2), or every session open when the quiet began is closed (T3)."""
        quiet_ms = int((self._now() - self._since) * 1000)
        if self._spent or quiet_ms < self.clock.after_ms:
            return None
        latest = self.clock.latest_event_time_ms()
        if latest is None:
            return None
        latest = max(latest, last_tick_ms or 0)
        if self._closes_all_at is None:
            self._closes_all_at = latest + self.clock.gap_ms + self.clock.delay_ms
        if latest > self._closes_all_at:
            self._spent = True
            return None
        self._since = self._now()
        return latest + quiet_ms


def logged_tick_ms(checkpoint: Path, batch_id: int) -> int | None:
    """The latest clock tick the end offsets of micro-batch ``batch_id`` carry (T1), or None."""
    if not has_log_entry(checkpoint, "offsets", batch_id):
        return None
    ticks = [source.get(CLOCK_OFFSET)
             for source in log_entry(checkpoint, "offsets", batch_id).source_offsets]
    return max((tick for tick in ticks if tick is not None), default=None)


def planned_tick_ms(checkpoint: Path, batch_id: int) -> int | None:
    """The clock tick micro-batch ``batch_id`` reads, or None: its end offsets name a later
    tick than the previous micro-batch's (T1)."""
    tick, before = logged_tick_ms(checkpoint, batch_id), logged_tick_ms(checkpoint, batch_id - 1)
    return tick if tick is not None and (before is None or tick > before) else None
