"""The inter-process lock that serialises correction runs of one client."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clickstream import locks
from clickstream.locks import PROC_LOCKS, exclusive, exclusive_or_refuse, held

HOLD = """
import sys, time
from pathlib import Path
from clickstream.locks import exclusive
with exclusive(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_process_waits_for_the_holder_and_is_told_so(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "corrections-c1.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        told: list[float] = []
        started = time.monotonic()
        with exclusive(path, on_wait=lambda: told.append(time.monotonic())):
            waited = time.monotonic() - started
        assert len(told) == 1 and waited > 0.5  # it waited for the holder, after saying so
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()

    with exclusive(path, on_wait=lambda: told.append(-1.0)):  # free now: no wait, no message
        pass
    assert told[-1] != -1.0


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "held.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "60"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.kill()  # SIGKILL: no cleanup runs
    holder.wait(timeout=30)
    started = time.monotonic()
    with exclusive(path):
        assert time.monotonic() - started < 30  # the holder would have held it for 60 s


def test_held_tells_a_holder_without_taking_the_lock(tmp_path: Path) -> None:
    """``held`` reads who holds the lock and takes nothing: a holder starting meanwhile (a
    sessionizer, ``exclusive_or_refuse``) is never refused because of the probe."""
    path = tmp_path / "sessionize.lock"
    assert not held(path)  # no file
    with exclusive(path):
        assert held(path)  # this process
    assert not held(path)  # the file stays, unlocked
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "30"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert held(path)  # another process
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert not held(path)  # its holder killed
    with exclusive_or_refuse(path, refuse=lambda holder: AssertionError(holder), role="a test"):
        assert held(path)


def test_held_finds_the_holder_whatever_device_proc_locks_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On btrfs, ``/proc/locks`` names the filesystem's device and ``stat`` the subvolume's:
    matched by device too, no holder was ever found there, and correction runs took a
    sessionizer waiting for its first micro-batch for none (``sessionize`` Z18). Played
    with this machine's own ``/proc/locks`` lines, their devices rewritten."""
    path = tmp_path / "sessionize.lock"
    other = tmp_path / "other.lock"
    other.touch()
    with exclusive(path):
        inode = path.stat().st_ino
        mine = [line for line in PROC_LOCKS.read_text().splitlines()
                if line.split()[5].endswith(f":{inode}")]
        assert mine, "this process's lock is in /proc/locks"
        as_btrfs = tmp_path / "locks"
        as_btrfs.write_text("".join(re.sub(r"\b[0-9a-f]+:[0-9a-f]+:(\d+)\b", r"00:2d:\1", line)
                                    + "\n" for line in mine))
        monkeypatch.setattr(locks, "PROC_LOCKS", as_btrfs)
        assert held(path)
        assert not held(other)  # another inode, on the same device


def test_held_finds_a_holder_that_proc_locks_leaves_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux leaves out of ``/proc/locks`` the locks of processes whose pid the reader cannot
    see: a sessionizer in another container on the host (another PID namespace) read as no
    holder, and a correction run took its history pins for none (``sessionize`` Z18).
    Played with an empty ``/proc/locks``, as such a reader sees it (checked by hand with
    ``unshare --pid --fork --mount-proc``)."""
    path = tmp_path / "sessionize.lock"
    nothing_listed = tmp_path / "locks"
    nothing_listed.write_text("")
    monkeypatch.setattr(locks, "PROC_LOCKS", nothing_listed)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "30"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert held(path)
        with pytest.raises(LookupError), exclusive_or_refuse(  # still its holder's
                path, refuse=lambda holder: LookupError(holder), role="a test"):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert not held(path)  # the mark went with its holder
    with exclusive(path):  # and the next holder marks it again
        assert held(path)
