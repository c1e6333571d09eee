"""``quarantine_once`` on real Delta tables: what a step's rerun appends to ``quarantine``."""

from __future__ import annotations

from datetime import date, datetime

from pyspark.sql import DataFrame, SparkSession

from clickstream.config import Config
from clickstream.io.delta_tables import open_tables
from clickstream.quality.quarantine import quarantine_once
from clickstream.tables import QUARANTINE


def rows(spark: SparkSession, *pairs: tuple[str, str | None]) -> DataFrame:
    """Quarantine rows of ``(source, raw)``."""
    return spark.createDataFrame(
        [(raw, source, "bad", "client-00", datetime(2026, 12, 7), date(2026, 12, 7))
         for source, raw in pairs], QUARANTINE.schema)


def stored(config: Config, spark: SparkSession) -> list[tuple[str, str | None]]:
    return sorted(((r.source, r.raw) for r in open_tables(config, spark).read(
        QUARANTINE.name, ["source", "raw"]).collect()), key=lambda p: (p[0], p[1] or ""))


def test_a_rerun_appends_only_the_rows_no_attempt_stored_and_commits_nothing_without_them(
    config: Config, spark: SparkSession
) -> None:
    tables = open_tables(config, spark)
    step = {"app_id": "step-r1", "stored_under": "run:r1:", "metadata": {"run_id": "r1"}}
    first = rows(spark, ("run:r1:a.csv", "x"), ("run:r1:a.csv", None))
    assert quarantine_once(tables, first, **step) == 2
    version = tables.version(QUARANTINE.name)

    assert quarantine_once(tables, first, **step) == 0  # the same rows again
    assert tables.version(QUARANTINE.name) == version  # and no empty commit

    # a rerun refusing one more row of the same file: found by its text, not its source
    assert quarantine_once(tables, rows(spark, ("run:r1:a.csv", "x"),
                                        ("run:r1:a.csv", "y")), **step) == 1
    assert tables.app_version(QUARANTINE.name, "step-r1") == 2
    assert stored(config, spark) == [("run:r1:a.csv", None), ("run:r1:a.csv", "x"),
                                     ("run:r1:a.csv", "y")]


def test_only_rows_under_the_steps_sources_count_as_stored(
    config: Config, spark: SparkSession
) -> None:
    """Another run's row with the same source and text is not this run's: a run that finds it
    stored still quarantines its own copy (each run's rows are counted by their prefix)."""
    tables = open_tables(config, spark)
    assert quarantine_once(tables, rows(spark, ("shared", "x")), app_id="other",
                           metadata={}) == 1
    mine = {"app_id": "mine", "metadata": {}, "stored_under": "run:r2:"}
    assert quarantine_once(tables, rows(spark, ("run:r2:f", "x")), **mine) == 1
    assert quarantine_once(tables, rows(spark, ("run:r2:f", "x"), ("shared", "x")),
                           **mine) == 1  # "shared" is outside run:r2: so not found stored
    assert stored(config, spark) == [("run:r2:f", "x"), ("shared", "x"), ("shared", "x")]


def test_after_an_attempt_under_another_transaction_the_first_write_compares_too(
    config: Config, spark: SparkSession
) -> None:
    """The stream's replay (Z21): the batch's own transaction stored the first attempt's rows,
    so the replay's first write under its own transaction must not store them again."""
    tables = open_tables(config, spark)
    assert quarantine_once(tables, rows(spark, ("events:0:5", "x")), app_id="batch-3",
                           metadata={}) == 1
    replay = {"app_id": "batch-3-replay", "metadata": {}, "after_an_attempt": True}
    assert quarantine_once(tables, rows(spark, ("events:0:5", "x")), **replay) == 0
    assert tables.app_version(QUARANTINE.name, "batch-3-replay") is None
    assert quarantine_once(tables, rows(spark, ("events:0:5", "x"), ("events:0:6", "z")),
                           **replay) == 1
    assert stored(config, spark) == [("events:0:5", "x"), ("events:0:6", "z")]
