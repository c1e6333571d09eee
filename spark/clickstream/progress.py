"""Liveness lines for the long commands: ``backfill``, ``backfill-step`` and ``recompute``.

A step of a year's backfill runs for a minute or more between two progress lines (recomputing
the sessions of a year of orders: 56-67 s here, BENCHMARKS.md; a larger client, minutes), and
a terminal or an Airflow task log showed nothing meanwhile: a working run and a stuck one
looked the same. While such a command runs, :func:`heartbeat` adds a line after each
``CLICKSTREAM_PROGRESS_INTERVAL`` without one, saying how long it has been and what Spark is
doing, e.g. ``  ... still working, 60s since the line above; Spark stage 41: 1 of 2 tasks
done`` (``since the start`` before the command's first line). A stage stuck at one count
across lines is where a run hangs; "no Spark stage running" means the driver's own work
(Kafka sends and read-backs, Great Expectations, Delta commits).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[str], None]


@contextmanager
def heartbeat(progress: Progress, every_s: float) -> Iterator[Progress]:
    """``progress``, wrapped: after each ``every_s`` seconds without a line, one more saying
    the command is still working. The command's lines and these go through one lock, so no
    two are interleaved."""
    lock = threading.Lock()
    started = time.monotonic()
    last_line = [started]  # the time of the command's last line, or its start
    stop = threading.Event()

    def report(line: str) -> None:
        with lock:
            progress(line)
            last_line[0] = time.monotonic()

    def beat() -> None:
        quiet_since, beats = last_line[0], 0
        while not stop.wait(min(every_s / 2, 1.0)):
            if last_line[0] != quiet_since:  # a line came: a new silence starts
                quiet_since, beats = last_line[0], 0
            silent = time.monotonic() - quiet_since
            if silent < every_s * (beats + 1):
                continue
            beats += 1
            doing = spark_activity()  # outside the lock: the command's lines never wait on it
            with lock:
                if last_line[0] == quiet_since and not stop.is_set():
                    since = "the start" if quiet_since == started else "the line above"
                    try:
                        progress(f"  ... still working, {_seconds(silent)} since {since}; "
                                 f"{doing}")
                    except BrokenPipeError:  # the reader left (| head): the command's own
                        return  # next line ends it (status 141), without this thread's trace

    thread = threading.Thread(target=beat, name="clickstream-heartbeat", daemon=True)
    thread.start()
    try:
        yield report
    finally:
        stop.set()
        thread.join()


def spark_activity() -> str:
    """What this process's Spark application is doing: its active stages and their tasks."""
    from py4j.protocol import Py4JError
    from pyspark import SparkContext

    context = SparkContext._active_spark_context  # the one this process started, if any
    if context is None:
        return "Spark not started yet"
    if getattr(context, "_jsc", None) is None:  # registered before its JVM side, or stopped
        return "Spark starting or stopping"
    try:
        tracker = context.statusTracker()
        stages = [info for stage in sorted(tracker.getActiveStageIds())
                  if (info := tracker.getStageInfo(stage)) is not None]
    except (Py4JError, AttributeError) as error:  # stopping meanwhile: said, not raised
        return f"Spark's status not readable ({type(error).__name__})"
    if not stages:
        return "no Spark stage running"
    return "Spark " + ", ".join(
        f"stage {info.stageId}: {info.numCompletedTasks} of {info.numTasks} tasks done"
        for info in stages)


def _seconds(value: float) -> str:
    return f"{value:.0f}s" if value >= 10 else f"{value:.1f}s"


def utc_text(ms: int | None) -> str:
    """An epoch-millisecond time as the commands print it (the watermark, a commit)."""
    if ms is None:
        return "(unknown)"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
