"""Spark's streaming checkpoint logs as files: what the sessionizer's sink, its correction
runs and the Kafka source's quiet-stream clock read of them.

A log entry (``offsets/N``, ``commits/N``) is a version line, then the batch's metadata as
JSON (watermarks, trigger time), then, in ``offsets``, one line per source: its end offsets
as JSON, or "-" for a source that had none yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def last_logged_batch(checkpoint: Path, log: str) -> int:
    """The last batch id in one of the checkpoint's logs (``offsets``: planned, ``commits``:
    committed); -1 if none."""
    folder = checkpoint / log
    ids = [int(p.name) for p in folder.glob("[0-9]*")] if folder.exists() else []
    return max(ids, default=-1)


@dataclass(frozen=True)
class LogEntry:
    """One batch's entry in a checkpoint log, read once."""

    metadata: dict[str, Any]  # offsets: ``batchWatermarkMs``, ``batchTimestampMs``;
    # commits: ``nextBatchWatermarkMs``
    source_offsets: list[dict[str, Any]]  # offsets: each source's end offsets, if it had some


def has_log_entry(checkpoint: Path, log: str, batch_id: int) -> bool:
    """Whether ``log`` holds ``batch_id`` (Spark deletes the entries of old batches)."""
    return batch_id >= 0 and (checkpoint / log / str(batch_id)).exists()


def log_entry(checkpoint: Path, log: str, batch_id: int) -> LogEntry:
    """The entry of ``batch_id`` in ``log``."""
    lines = (checkpoint / log / str(batch_id)).read_text().splitlines()
    return LogEntry(json.loads(lines[1]), [json.loads(line) for line in lines[2:]
                                           if line.strip() not in ("", "-")])
