"""How several independent failures become one error: retryable unless none could pass."""

from __future__ import annotations

from clickstream.errors import (
    NOT_RETRYABLE,
    ClickstreamError,
    CommitConflictError,
    ConfigError,
    PlanNotAppliedError,
    one_error_for,
)


def test_one_error_is_not_retryable_only_when_no_failure_is_retryable() -> None:
    plan, config = PlanNotAppliedError("c1's plan"), ConfigError("bad retention")
    both = one_error_for([plan, config], "2 failed")
    assert (type(both), str(both)) == (PlanNotAppliedError, "2 failed")
    assert isinstance(one_error_for([config], "1 failed"), NOT_RETRYABLE)
    mixed = one_error_for([plan, CommitConflictError("c2 conflicted")], "2 failed")
    assert type(mixed) is ClickstreamError and not isinstance(mixed, NOT_RETRYABLE)
    assert type(one_error_for([OSError("disk")], "1 failed")) is ClickstreamError
