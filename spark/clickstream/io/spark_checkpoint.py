"""Spark's streaming checkpoint logs as files: what the sessionizer's sink, its correction
runs and the Kafka source's quiet-stream clock read of them.

A log entry (``offsets/N``, ``commits/N``) is a version line, then the batch's metadata as
JSON (watermarks, trigger time), then, in ``offsets``, one line per source: its end offsets
as JSON, or "-" for a source that had none yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def last_logged_batch(checkpoint: Path, log: str) -> int:
    """The last batch id in one of the checkpoint's logs (``offsets``: planned, ``commits``:
    committed); -1 if none."""
    folder = checkpoint / log
    ids = [int(p.name) for p in folder.glob("[0-9]*")] if folder.exists() else []
    return max(ids, default=-1)


def logged_metadata(checkpoint: Path, log: str, batch_id: int) -> dict[str, Any]:
    """The metadata line of ``batch_id`` in ``log`` (``batchWatermarkMs``,
    ``batchTimestampMs`` in offsets; ``nextBatchWatermarkMs`` in commits)."""
    return json.loads(_lines(checkpoint, log, batch_id)[1])


def logged_source_offsets(checkpoint: Path, batch_id: int) -> list[dict[str, Any]]:
    """The end offsets of each source that had some in micro-batch ``batch_id``."""
    return [json.loads(line) for line in _lines(checkpoint, "offsets", batch_id)[2:]
            if line.strip() not in ("", "-")]


def _lines(checkpoint: Path, log: str, batch_id: int) -> list[str]:
    return (checkpoint / log / str(batch_id)).read_text().splitlines()
