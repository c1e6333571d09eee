"""Every failure the product raises on purpose.

Messages say what failed, on which object, how many, the first cause, and what a retry does.
Bad stream records are never exceptions: they become quarantine rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager


class ClickstreamError(Exception):
    """Raised for any failure the product detects itself; the CLI prints it as one line."""


class ConfigError(ClickstreamError):
    """Raised when a setting is missing, malformed or outside its accepted values."""


class BrokerError(ClickstreamError):
    """Raised when the embedded broker cannot start, or a topic cannot be created on it."""


class BrokerUnavailableError(ClickstreamError):
    """Raised when Kafka cannot be reached after the configured retries."""


class KafkaRefusedError(ClickstreamError):
    """Raised when Kafka answers with an error no retry gets past (authorization,
    authentication, TLS, a batch the client cannot decode): the cause must be fixed first."""


class DataLossError(ClickstreamError):
    """Raised when records the product has not consumed yet are gone from the broker."""


class VersionVacuumedError(ClickstreamError):
    """Raised when a time-travel read needs files a vacuum deleted, or a commit the log no
    longer holds: no retry brings them back."""


VACUUMED_WAY_FORWARD = (
    "A job reading the table as it was then (a backfill step reads its tables as they were "
    "before its own commits) cannot go on; `clickstream recompute --full --client C` brings "
    "that client's sessions and attributions up to date from the tables as they are (a "
    "finished batch's rerun has nothing left to do)")


class DeliveryError(ClickstreamError):
    """Raised when records could not be delivered to Kafka after retries."""


class CommitConflictError(ClickstreamError):
    """Raised when a Delta commit still conflicts after every retry."""


class TableRefusedError(ClickstreamError):
    """Raised when Delta refuses a write for good (a table feature the engine cannot write, an
    append-only table): no retry commits it until the table changes."""


class BatchRefusedError(ClickstreamError):
    """Raised when a historical batch is refused as a whole (path, schema or client mismatch)."""


class RevenueOverflowError(ClickstreamError):
    """Raised when a session's attributed orders add up to more than its revenue can hold:
    the same stored orders give the same sum at every retry (README, Known limits)."""


class QueryFailedError(ClickstreamError):
    """Raised when the streaming query stopped on a failure the product did not foresee (a bug,
    a full disk): the CLI keeps its traceback, as for any unexpected error."""


class QualityGateFailedError(ClickstreamError):
    """Raised when a data-quality gate fails and its step must not write anything."""


class PlanNotAppliedError(QualityGateFailedError):
    """Raised when the tables do not hold a recorded correction plan: it must not be
    published, and only a full recompute of the client supersedes it."""


NOT_RETRYABLE: tuple[type[ClickstreamError], ...] = (
    BatchRefusedError, ConfigError, DataLossError, KafkaRefusedError, QualityGateFailedError,
    RevenueOverflowError, TableRefusedError, VersionVacuumedError)
"""Failures a retry cannot fix: the same input gives the same refusal (records the broker
dropped stay dropped). Airflow tasks fail at once on them instead of retrying
(``clickstream.orchestration``, O1)."""


_PRODUCT_ERROR_LINE = re.compile(r"^clickstream\.errors\.(\w+): (.*)$")


def carried_error(error: BaseException) -> ClickstreamError | None:
    """The product's own error that a Spark error carries (raised in a Python worker, or in
    the Kafka source), rebuilt with its type and caused by ``error``, or None. Spark hands the
    driver its own wrapper, so a refusal no retry can fix read as an unexpected, retryable
    failure (exit 1, retried by Airflow for nothing). Only the error the worker raised counts
    (its trace's last line, :func:`error_line`): not one it was handling, nor text quoted in a
    message."""
    match = _PRODUCT_ERROR_LINE.match(error_line(str(error)))
    if match is None:
        return None
    kind = globals().get(match.group(1))
    if not (isinstance(kind, type) and issubclass(kind, ClickstreamError)):
        kind = ClickstreamError
    carried = kind(match.group(2).strip())
    carried.__cause__ = error
    return carried


_PYTHON_TRACE = "Traceback (most recent call last):"
_GROUP_MARGIN = re.compile(r"^\s*\| ?")


def error_line(text: str) -> str:
    """One line of an error's text that says what went wrong: the last Python exception a
    Spark error carries (``ZeroDivisionError: ...``, the first unindented line after its last
    traceback; Spark's first line ends at the traceback), else its first line."""
    _, found, trace = text.rpartition(_PYTHON_TRACE)
    if found:  # an exception group's trace prefixes its lines with "| " (``_GROUP_MARGIN``)
        lines = [line for line in (_GROUP_MARGIN.sub("", text_line)
                                   for text_line in trace.splitlines()) if line.strip()]
        python = next((line.strip() for line in lines if not line[0].isspace()), None)
        if python:
            return python
    return (text.strip().splitlines() or [""])[0]


def typed_error_line(error: BaseException) -> str:
    """``Type: reason`` in one line (:func:`error_line`); the Python error a Spark error
    carries is typed already (``OverflowError: ...``, not Spark's generic first line)."""
    text = str(error)
    line = error_line(text)
    if line != (text.strip().splitlines() or [""])[0]:
        return line
    return f"{type(error).__name__}: {line}"


@contextmanager
def noted_on(error: BaseException, what: str) -> Iterator[None]:
    """Run a cleanup (or a record of the failure) while ``error`` propagates: ``error`` is the
    one to raise, so the cleanup's own failure becomes a note on it (``what failed as well:
    ...``; the CLI prints it above the error's line) instead of replacing it, its message and
    its exit status (a full disk turned a refused batch into a retried ``OSError``)."""
    try:
        yield
    except Exception as failed:
        error.add_note(f"{what} failed as well: {typed_error_line(failed)}")


def one_error_for(failures: list[BaseException], message: str) -> ClickstreamError:
    """One error standing for several independent failures (each table's, each client's).

    A retry of the whole step redoes them all, so the error is retryable unless a retry can
    fix none of them: then it takes the first failure's type, and the step fails at once
    (``EXIT_NOT_RETRYABLE``, Airflow without retries) instead of failing alike each time.
    """
    if failures and all(isinstance(f, NOT_RETRYABLE) for f in failures):
        return type(failures[0])(message)
    return ClickstreamError(message)


EXIT_NOT_RETRYABLE = 3
"""The exit status of a command that failed with one of :data:`NOT_RETRYABLE`; any other
failure exits 1. spark-submit passes the status on, so a Spark task can tell the two apart."""

EXIT_USAGE = 2
"""argparse's exit status for arguments it refuses (a value a form let through, e.g. a client
id of more than 64 bytes in fewer characters): like :data:`EXIT_NOT_RETRYABLE`, the same
arguments are refused again on every retry."""
