"""Whether Ctrl-C was pressed in this process, whoever handles SIGINT.

A ``KeyboardInterrupt`` raised in a Python callback of a C extension may be lost there: the
extension then raises ``SystemError`` ("returned NULL without setting an exception";
confluent-kafka's ``poll`` and ``flush`` serve delivery callbacks). The CLI reports such an
error as the interrupt it was only if a Ctrl-C was noted, and pyspark replaces the SIGINT
handler when a SparkContext starts, so each handler is wrapped as it is installed.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

pressed = threading.Event()
_NOTES = "_clickstream_notes_sigint"


def note_sigint() -> None:
    """Wrap the process's SIGINT handler so that a Ctrl-C sets ``pressed`` before it runs
    (once per handler; ignored or default-action handlers, not Python callables, are left)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler) or getattr(handler, _NOTES, False):
        return

    def noting(signum: int, frame: FrameType | None) -> object:
        pressed.set()
        return handler(signum, frame)

    setattr(noting, _NOTES, True)
    signal.signal(signal.SIGINT, noting)
