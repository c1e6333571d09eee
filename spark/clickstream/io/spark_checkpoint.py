"""Spark's streaming checkpoint logs as files: what the sessionizer's sink, its correction
runs and the Kafka source's quiet-stream clock read of them."""

from __future__ import annotations

from pathlib import Path


def last_logged_batch(checkpoint: Path, log: str) -> int:
    """The last batch id in one of the checkpoint's logs (``offsets``: planned, ``commits``:
    committed); -1 if none."""
    folder = checkpoint / log
    ids = [int(p.name) for p in folder.glob("[0-9]*")] if folder.exists() else []
    return max(ids, default=-1)
