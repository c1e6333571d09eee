"""What every benchmark records about itself: which code ran (git HEAD) and where its result
goes (``bench/results/<name>-<UTC stamp>.json``, the file BENCHMARKS.md cites)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"


def git_head(*, short: bool = True) -> str | None:
    """HEAD's commit, or None where there is no git checkout (a copied tree, no git)."""
    command = ["git", "-C", str(REPO), "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def git_dirty(*paths: str) -> list[str]:
    """Uncommitted changes under ``paths`` (the whole tree when none): a result measured on
    them is not the code its ``git_head`` names."""
    command = ["git", "-C", str(REPO), "status", "--porcelain", *paths]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines()


def source_sha256() -> str:
    """A digest of the product's code (``spark/clickstream``): tells apart runs of one commit
    with different uncommitted edits (an A/B run in the working tree)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "spark" / "clickstream").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def result_path(name: str) -> Path:
    """A new result file's path: ``name`` stamped with the current UTC time."""
    return RESULTS_DIR / f"{name}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"


def write_result(name: str, result: dict[str, Any], path: Path | None = None, *,
                 indent: int = 2) -> Path:
    """Writes ``result`` whole or not at all (a run killed mid-write leaves no half file to
    cite); a new stamped file unless ``path`` names one to overwrite (a long run's updates)."""
    if path is None:
        path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(result, indent=indent, default=str) + "\n")
    partial.replace(path)
    return path
