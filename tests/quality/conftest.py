"""Fixtures shared with the job tests: own topics per test, temp warehouse/home/landing."""

from tests.jobs.test_backfill import bf_config  # noqa: F401 (fixture)
from tests.jobs.test_sessionize import stream_config  # noqa: F401 (fixture)
