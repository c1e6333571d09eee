"""How long to wait before trying again: one formula for every retry loop in the product.

Waits double from ``first_s`` up to ``cap_s``. Writers that race each other (Delta commits,
the recompute queue's removal against the stream's appends) take a random share of the wait,
so two of them that failed together do not try again together.
"""

from __future__ import annotations

import random
import time

CAP_S = 5.0


def retry_delay(attempt: int, first_s: float, *, cap_s: float = CAP_S, jitter: bool = True
                ) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    delay = min(cap_s, first_s * 2.0 ** min(attempt - 1, 64))  # 2.0 ** 1024 overflows
    return delay * random.uniform(0.5, 1.0) if jitter else delay


def wait_before_retry(attempt: int, first_s: float, *, cap_s: float = CAP_S,
                      jitter: bool = True) -> None:
    """Sleep :func:`retry_delay` seconds."""
    time.sleep(retry_delay(attempt, first_s, cap_s=cap_s, jitter=jitter))
