"""The raw_events gate: on a crafted micro-batch, and inside the running sessionizer, where it
quarantines the offending records and lets the rest through (the stream never stops)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.events.parse import parse_kafka_records
from clickstream.jobs.sessionize import run_sessionizer
from clickstream.quality.gates import gate_raw_events
from clickstream.quality.reports import read_entries, reports_dir
from clickstream.tables import KAFKA_SCHEMA
from tests.jobs.test_sessionize import produce, table_rows

T0 = datetime(2026, 11, 1, 9, tzinfo=UTC)


def event(event_id: str, minutes: float, event_type: str = "pageview", user: str = "u1"
          ) -> tuple[str, str]:
    return (f"client-00/{user}", json.dumps({
        "event_id": event_id, "client_id": "client-00", "user_id": user,
        "event_type": event_type, "ts": (T0 + timedelta(minutes=minutes)).isoformat(),
        "url": f"/{event_id}", "referrer": ""}))


def test_offending_records_are_marked_with_the_expectation_and_the_rest_pass(
    config: Config, spark: SparkSession
) -> None:
    records = [event("good", 0), event("odd", 1, event_type="page view!"),
               ("client-00/u1", "{not json")]
    rows = [(k.encode(), v.encode(), "events", 0, i, T0, 0, None)
            for i, (k, v) in enumerate(records)]
    parsed = parse_kafka_records(spark.createDataFrame(rows, KAFKA_SCHEMA),
                                 max_ts_ahead_ms=config.max_ts_ahead_ms)
    marked, result = gate_raw_events(parsed, config, batch_id=7, run_id=uuid.uuid4().hex)
    assert result is not None and result.status == "failed"
    assert [o.column for o in result.failures] == ["accepted_invalid_event_type"]
    assert (result.checks["records"], result.checks["malformed_records"]) == (3, 1)
    errors = {r.event_id: r.error for r in marked.select("event_id", "error").collect()}
    assert errors["good"] is None
    assert errors["odd"] == (  # the expectation's note comes from the suite file
        "quality gate raw_events: accepted_invalid_event_type = 1, expected 0 "
        "(expect_column_values_to_be_between: event_type is an identifier: letters, digits, "
        "_ . : -, at most 64 characters, starting with a letter.)")
    assert errors[None] == "value is not valid JSON"  # the parser's reason is kept
    assert result.report is not None and result.report.is_file()  # a failure is reported


def test_the_stream_quarantines_a_bad_record_and_goes_on(stream_config: Config,
                                                         spark: SparkSession) -> None:
    produce(stream_config, [event("a", 0), event("b", 5), event("odd", 6, "page view!"),
                            event("flush", 24 * 60, user="u2")])
    summary = run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    assert summary.totals.quarantined == 1 and summary.totals.pageviews == 3
    (bad,) = table_rows(stream_config, spark, "quarantine")
    assert json.loads(bad["raw"])["event_id"] == "odd"
    assert "quality gate raw_events: accepted_invalid_event_type = 1" in bad["reason"]
    assert table_rows(stream_config, spark, "other_events") == []
    (session,) = table_rows(stream_config, spark, "sessions")
    assert (session["user_id"], session["pageview_count"]) == ("u1", 2)
    entries = [e for e in read_entries(reports_dir(stream_config)) if e.job == "sessionize"]
    assert [e.status for e in entries] == ["failed"]
    assert entries[0].title.startswith("raw_events (batch ")
