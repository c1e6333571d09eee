"""Exclusive locks between processes of one machine (``flock`` on a file beside what it guards).

They serialise work that must not interleave, e.g. two correction runs of one client. A lock
is released when its holder exits, killed or not. ``flock`` does not reach across machines:
on the cluster profile the warehouse is one volume of one Docker host.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

LOCKS_FOLDER = "_clickstream_locks"  # in the warehouse; no table is named with a leading "_"


def warehouse_sessionizer_lock(warehouse: Path) -> Path:
    """Held by the one sessionizer of a warehouse (``sessionize`` Z15), and by ``republish``."""
    return warehouse / LOCKS_FOLDER / "sessionizer.lock"


class _Flock(ctypes.Structure):
    """Linux's ``struct flock``, for open-file-description (OFD) locks."""

    _fields_ = [("l_type", ctypes.c_short), ("l_whence", ctypes.c_short),
                ("l_start", ctypes.c_int64), ("l_len", ctypes.c_int64),
                ("l_pid", ctypes.c_int32)]


def _ofd_lock(fd: int, command: int, lock_type: int) -> int:
    """``fcntl`` on byte 0 of the file with an OFD lock request; the answer's lock type."""
    request = _Flock(l_type=lock_type, l_whence=os.SEEK_SET, l_start=0, l_len=1, l_pid=0)
    return _Flock.from_buffer_copy(fcntl.fcntl(fd, command, bytes(request))).l_type


@contextlib.contextmanager
def _locked(path: Path, when_held: Callable[[IO[str]], None]) -> Iterator[IO[str]]:
    """``path`` (created if missing) open and exclusively locked until the block ends;
    ``when_held(handle)`` runs first when another process holds it, and waits for it or
    raises.

    Besides the ``flock`` that excludes other holders, the holder marks the file with an OFD
    write lock on its first byte, which :func:`held` asks about: the kernel answers for a
    holder in any PID namespace (another container on the host), which ``/proc/locks`` leaves
    out. Released before the ``flock``, so the next holder always gets it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            when_held(handle)
        marked = _mark(handle)
        try:
            yield handle
        finally:
            if marked:
                _ofd_lock(handle.fileno(), fcntl.F_OFD_SETLK, fcntl.F_UNLCK)
            fcntl.flock(handle, fcntl.LOCK_UN)


def _mark(handle: IO[str]) -> bool:
    """Take the holder's OFD mark; False where the filesystem has no such locks (``held``
    then reads ``/proc/locks`` alone; the ``flock`` still excludes)."""
    try:
        _ofd_lock(handle.fileno(), fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
    except OSError:
        return False
    return True


ABANDON_POLL_SECONDS = 0.1
PROC_LOCKS = Path("/proc/locks")


def held(path: Path) -> bool:
    """Whether a process (this one included) holds the lock on ``path`` now, asked of the
    kernel without taking it (the holder's OFD mark, ``_locked``), else read from Linux's
    ``/proc/locks`` (a holder that took no mark): a probe that took the lock, even for an
    instant, would refuse its holder's own start meanwhile (``exclusive_or_refuse``).
    ``/proc/locks`` leaves out a holder in another PID namespace (another container on the
    host), which the mark does not. True where ``/proc/locks`` cannot be read: callers take
    a holder as the careful answer.

    Matched by inode alone: the device ``/proc/locks`` names is the filesystem's, which is
    not always ``stat``'s (btrfs gives each subvolume a device of its own), and a device
    that never matched read every holder as none. A lock on another filesystem's file with
    the same inode number reads as held, the careful answer again."""
    try:
        inode = str(path.stat().st_ino)
        if _marked(path):
            return True
    except FileNotFoundError:
        return False
    try:
        table = PROC_LOCKS.read_text()
    except OSError:
        return True
    # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; a waiter's line has "->" after "1:".
    return any(fields[1] == "FLOCK" and any(
        field.count(":") == 2 and field.rsplit(":", 1)[1] == inode for field in fields)
        for fields in map(str.split, table.splitlines()) if len(fields) > 5)


def _marked(path: Path) -> bool:
    """Whether a holder's OFD mark is on ``path`` (``_locked``); False where the kernel
    cannot be asked (no OFD locks on this filesystem, the file not readable): ``held`` then
    reads ``/proc/locks`` alone."""
    try:
        with path.open("rb") as handle:
            answer = _ofd_lock(handle.fileno(), fcntl.F_OFD_GETLK, fcntl.F_WRLCK)
    except FileNotFoundError:
        raise
    except OSError:
        return False
    return answer != fcntl.F_UNLCK


@contextlib.contextmanager
def exclusive(path: Path, on_wait: Callable[[], None] | None = None,
              abandon: Callable[[], Exception | None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing); ``on_wait`` is called once
    if another process holds it, before waiting for it. ``abandon`` is asked while it waits
    (every ``ABANDON_POLL_SECONDS``): an exception it returns is raised, and the wait given
    up; a blocking ``flock`` waits on whatever a signal handler asks. Not re-entrant: a
    second ``exclusive`` on the same path in the same process waits forever."""
    def wait(handle: IO[str]) -> None:
        if on_wait is not None:
            on_wait()
        if abandon is None:
            fcntl.flock(handle, fcntl.LOCK_EX)
            return
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                given_up = abandon()
                if given_up is not None:
                    raise given_up from None
                time.sleep(ABANDON_POLL_SECONDS)

    with _locked(path, wait):
        yield


@dataclass(frozen=True)
class Holder:
    """Who holds a lock taken by :func:`exclusive_or_refuse`, as it wrote itself in the file."""

    pid: str
    role: str | None  # None: a holder that wrote no role (an older release's)

    def __str__(self) -> str:
        return f"{self.role or 'a process'} (pid {self.pid})"


@contextlib.contextmanager
def exclusive_or_refuse(path: Path, refuse: Callable[[Holder], Exception], role: str
                        ) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for as long as this process works, or raise
    ``refuse(holder)`` at once when another process holds it. The holder writes its pid and
    ``role`` (e.g. "a sessionizer") into the file: two kinds of job take one lock, and the
    refused one is told which it met. For a service of which one copy may run, not a turn."""
    def refuse_now(handle: IO[str]) -> None:
        handle.seek(0)
        pid, _, written_role = handle.read().strip().partition(" ")
        raise refuse(Holder(pid or "unknown", written_role or None)) from None

    with _locked(path, refuse_now) as handle:
        handle.truncate(0)
        handle.write(f"{os.getpid()} {role}")
        handle.flush()
        yield
