"""The one retry-wait formula: doubling from the first wait, capped, jittered when racing."""

import pytest

from clickstream.retry import retry_delay


def test_waits_double_until_the_cap_without_jitter() -> None:
    waits = [retry_delay(attempt, 0.5, jitter=False) for attempt in range(1, 7)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_jitter_takes_between_half_and_all_of_the_wait() -> None:
    waits = [retry_delay(3, 0.1) for _ in range(500)]
    assert all(0.2 <= wait <= 0.4 for wait in waits)
    assert max(waits) - min(waits) > 0.1  # spread out, so racing writers do not retry in step


def test_attempt_numbers_start_at_one() -> None:
    with pytest.raises(ValueError, match="start at 1"):
        retry_delay(0, 0.5)


def test_a_loop_that_retries_without_end_keeps_the_cap() -> None:
    """A caller retrying until told to stop (no attempt limit) reaches any attempt number."""
    assert retry_delay(1025, 0.5, jitter=False) == 5.0
    assert retry_delay(10**6, 0.001, cap_s=2.0, jitter=False) == 2.0
