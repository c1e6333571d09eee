"""How several independent failures become one error: retryable unless none could pass."""

from __future__ import annotations

import pytest
from pyspark.errors import PythonException

from clickstream.errors import (
    NOT_RETRYABLE,
    BatchRefusedError,
    ClickstreamError,
    CommitConflictError,
    ConfigError,
    PlanNotAppliedError,
    error_line,
    noted_on,
    one_error_for,
    typed_error_line,
)
from clickstream.quality.run_summary import failure_line


def test_one_error_is_not_retryable_only_when_no_failure_is_retryable() -> None:
    plan, config = PlanNotAppliedError("c1's plan"), ConfigError("bad retention")
    both = one_error_for([plan, config], "2 failed")
    assert (type(both), str(both)) == (PlanNotAppliedError, "2 failed")
    assert isinstance(one_error_for([config], "1 failed"), NOT_RETRYABLE)
    mixed = one_error_for([plan, CommitConflictError("c2 conflicted")], "2 failed")
    assert type(mixed) is ClickstreamError and not isinstance(mixed, NOT_RETRYABLE)
    assert type(one_error_for([OSError("disk")], "1 failed")) is ClickstreamError


def test_the_line_of_a_spark_error_is_the_python_exception_it_carries(spark) -> None:
    """What a Spark job's Python failure says, as the CLI's one line and the run pages show
    it: the exception a UDF raised; for an exception group, the group's own line (every line
    of its trace starts with '| ', so the first line of Spark's text was shown instead)."""
    from pyspark.sql import functions as F

    def failing(error: BaseException) -> PythonException:
        @F.udf("int")
        def fails(_):  # no hints: PySpark would read them as the UDF's kind
            raise error

        with pytest.raises(PythonException) as raised:
            spark.range(1).select(fails("id")).collect()
        return raised.value

    overflow = failing(OverflowError("session s1: its orders add up to more than 10^14"))
    assert error_line(str(overflow)) == typed_error_line(overflow) == (
        "OverflowError: session s1: its orders add up to more than 10^14")
    # A backfill's run page said only "PythonException: An exception was thrown from the
    # Python worker:"
    assert failure_line("recompute", overflow) == (
        "recompute: failed", "OverflowError: session s1: its orders add up to more than 10^14")
    group = failing(ExceptionGroup("two rows refused", [ValueError("a"), TypeError("b")]))
    assert error_line(str(group)) == "ExceptionGroup: two rows refused (2 sub-exceptions)"
    assert typed_error_line(ValueError("bad row\nits detail")) == "ValueError: bad row"


def test_a_trace_line_that_is_only_a_group_margin_is_skipped() -> None:
    """A line of an exception group's trace that holds only its margin ('  |') is blank once
    the margin is taken off: read as a line, it failed the error's own report (IndexError)."""
    text = ("Spark failed: An exception was thrown from the Python worker:\n"
            "+ Exception Group Traceback (most recent call last):\n"
            "  |\n"
            "  |   File \"job.py\", line 3, in run\n"
            "  | ExceptionGroup: two rows refused (2 sub-exceptions)\n")
    assert error_line(text) == "ExceptionGroup: two rows refused (2 sub-exceptions)"


def close_group_on_a_full_disk() -> None:
    raise OSError(28, "No space left on device")


def test_a_cleanup_failing_beside_an_error_is_a_note_on_it_not_a_replacement() -> None:
    refused = BatchRefusedError("batch refused: 2 rows of another client")
    with pytest.raises(BatchRefusedError, match="another client") as raised:
        try:
            raise refused
        except BatchRefusedError as error:
            with noted_on(error, "closing its read point group"):
                close_group_on_a_full_disk()
            raise
    assert raised.value.__notes__ == [
        "closing its read point group failed as well: OSError: [Errno 28] No space left on "
        "device"]
    with noted_on(refused, "a cleanup that works"):
        pass
    assert len(refused.__notes__) == 1
