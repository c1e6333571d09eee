"""The parser's contract, record by record: what a valid event becomes (fields as text, time
from ``ts``) and the first rule each bad record breaks (its quarantine reason)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from pyspark.sql import SparkSession

from clickstream.config import Config
from clickstream.events.contract import (
    CLOCK_PARTITION,
    CLOCK_SOURCE,
    ID_MAX_BYTES,
    LOST_OFFSETS_HEADER,
    URL_MAX_BYTES,
)
from clickstream.events.parse import parse_kafka_records
from clickstream.tables import KAFKA_SCHEMA

T0 = datetime(2026, 11, 1, 9, tzinfo=UTC)
PAGEVIEW = {"event_id": "e1", "client_id": "client-00", "user_id": "u1",
            "event_type": "pageview", "ts": "2026-11-01T09:00:00Z", "url": "/a", "referrer": ""}
ORDER = {**PAGEVIEW, "event_type": "order", "order_id": "o1", "amount": "12.50",
         "currency": "EUR"}
KEY = "client-00/u1"
AHEAD_MS = Config().max_ts_ahead_ms


def parse(spark: SparkSession, *records: tuple[str | None, str | None],
          received: datetime = T0) -> list[dict[str, Any]]:
    rows = [(None if k is None else k.encode(), None if v is None else v.encode(), "events", 0,
             offset, received, 0, None) for offset, (k, v) in enumerate(records)]
    parsed = parse_kafka_records(spark.createDataFrame(rows, KAFKA_SCHEMA),
                                 max_ts_ahead_ms=AHEAD_MS)
    return [row.asDict() for row in parsed.orderBy("source").collect()]


def error_of(spark: SparkSession, value: str | None, key: str | None = KEY) -> str | None:
    (row,) = parse(spark, (key, value))
    return row["error"]


@pytest.mark.parametrize(("value", "reason"), [
    (None, "value is empty"),
    ("  ", "value is empty"),
    ("{not json", "value is not valid JSON"),
    # Valid JSON the parser refuses: "not valid JSON" sent a producer after a syntax error
    *((value, "value is JSON the parser refuses: a key repeated in one object, or an escaped "
       "lone surrogate (such as \\ud800 alone); send each key once, and text as UTF-8")
      for value in ('{"event_id": "e1", "event_id": "e2"}', '{"event_id": "\\ud800"}')),
    ("[1, 2, 3]", "value is not a JSON object"),
    # Two events in one record: the JSON readers took the first and ignored the rest.
    (json.dumps(PAGEVIEW) + json.dumps({**PAGEVIEW, "event_id": "e2"}),
     "value is not valid JSON: text follows its first value"),
    (json.dumps(PAGEVIEW) + "\n" + json.dumps({**PAGEVIEW, "event_id": "e2"}),
     "value is not valid JSON: text follows its first value"),
    (json.dumps(PAGEVIEW) + " x", "value is not valid JSON: text follows its first value"),
    (json.dumps(PAGEVIEW) + "]", "value is not valid JSON: text follows its first value"),
    (json.dumps(PAGEVIEW) + ",0]", "value is not valid JSON: text follows its first value"),
    # An object and one brace more: it begins and ends as one object does
    (json.dumps(PAGEVIEW) + "}", "value is not valid JSON: text follows its first value"),
    ('"text"', "value is not a JSON object"),
    (json.dumps({k: v for k, v in PAGEVIEW.items() if k != "user_id"}),
     "missing field user_id"),
    (json.dumps({**PAGEVIEW, "client_id": " "}), "missing field client_id"),
    (json.dumps({k: v for k, v in PAGEVIEW.items() if k != "ts"}), "missing field ts"),
    # Commands could not name such a client; U+001F would join two users into one session id.
    *((json.dumps({**PAGEVIEW, "client_id": client}), f"client_id '{client}' has a control "
       "character or spaces around it: commands take a client id as printable text without "
       "spaces around it; send it that way")
      for client in (" acme", "acme\t", "acme\u00a0", "a\u001fb", "a\u0000")),
    # A folder of every client-partitioned table: a longer name failed the micro-batch's writes
    *((json.dumps({**PAGEVIEW, "client_id": client}), f"client_id '{client}' is longer than "
       "64 bytes of UTF-8: it names a folder of every client-partitioned table, which the file "
       "system limits; send a shorter id") for client in ("c" * 65, "\u5546" * 22, "/" * 65)),
    *((json.dumps({**PAGEVIEW, "user_id": user}), "user_id has a control character "
       "(U+0000-U+001F or U+007F): a session id joins the client and user ids with U+001F, so "
       "two users could share one; send it as printable text") for user in ("u\u001f1", "\u007f")),
    (json.dumps({**PAGEVIEW, "ts": "yesterday"}),
     "ts 'yesterday' is neither ISO-8601 with a time zone nor epoch milliseconds"),
    (json.dumps({**PAGEVIEW, "ts": "2026-11-01T09:00:00"}),
     "ts '2026-11-01T09:00:00' is neither ISO-8601 with a time zone nor epoch milliseconds"),
    # Java's $ matched before a final line break, and Spark's casts trim it.
    (json.dumps({**PAGEVIEW, "ts": "1793500000000\n"}),
     "ts '1793500000000\n' is neither ISO-8601 with a time zone nor epoch milliseconds"),
    (json.dumps({**PAGEVIEW, "ts": "2026-11-01T08:30:00Z\n"}),
     "ts '2026-11-01T08:30:00Z\n' is neither ISO-8601 with a time zone nor epoch milliseconds"),
    # A number with a fraction, said to be one: quoted, it read '1793500000000' (the variant's
    # text: epoch milliseconds that look valid) or from_json's '1.7935000000005E12'
    *((json.dumps({**PAGEVIEW, "ts": number}), "ts is a number with a fraction or an "
       "exponent, not whole epoch milliseconds: send it as a whole number or as ISO-8601 text "
       "with a time zone") for number in (1793500000000.5, 1793500000000.0)),
    (json.dumps({**PAGEVIEW, "ts": "1793500000000.5"}),  # a string: quoted as sent
     "ts '1793500000000.5' is neither ISO-8601 with a time zone nor epoch milliseconds"),
    (json.dumps({**PAGEVIEW, "ts": "1999-12-31T00:00:00Z"}),
     "ts '1999-12-31T00:00:00Z' is outside the plausible range 2000-01-01..2100-01-01"),
    (json.dumps({**PAGEVIEW, "url": ""}), "pageview without url"),
    # Bytes, not characters: 32,769 characters of 2 bytes each (UTF-8).
    (json.dumps({**PAGEVIEW, "url": "/" + "é" * (URL_MAX_BYTES // 2)}),
     f"url is {URL_MAX_BYTES + 1} bytes long, more than the {URL_MAX_BYTES} a url may have "
     "(its session's Kafka value carries two urls and must fit one message); shorten the url "
     "(e.g. its query string) and send the pageview again"),
    (json.dumps({k: v for k, v in ORDER.items() if k != "order_id"}),
     "missing field order_id"),
    (json.dumps({**ORDER, "amount": "-5.00"}), "amount '-5.00' is negative"),
    (json.dumps({**ORDER, "amount": "12.5\n"}),
     "amount '12.5\n' is not a decimal string with at most 4 decimals"),
    (json.dumps({**ORDER, "amount": "1.23456"}),
     "amount '1.23456' is not a decimal string with at most 4 decimals"),
    (json.dumps({**ORDER, "amount": "1000000000000"}),  # 13 digits: 1 more than kept
     "amount '1000000000000' is too large: at most 12 digits before the decimal point "
     "(amounts are kept exactly as 64-bit integers of 1/10000); correct the amount"),
    (json.dumps({**ORDER, "amount": "100000000000000"}),
     "amount '100000000000000' is too large: at most 12 digits before the decimal point "
     "(amounts are kept exactly as 64-bit integers of 1/10000); correct the amount"),
    (json.dumps({**ORDER, "amount": "1000000000000000.00"}),  # fitted DECIMAL(20,4)
     "amount '1000000000000000.00' is too large: at most 12 digits before the decimal point "
     "(amounts are kept exactly as 64-bit integers of 1/10000); correct the amount"),
    (json.dumps({**ORDER, "amount": "123456789012345678901"}),  # fitted nothing
     "amount '123456789012345678901' is too large: at most 12 digits before the decimal point "
     "(amounts are kept exactly as 64-bit integers of 1/10000); correct the amount"),
    (json.dumps({**ORDER, "currency": "EURO"}), "currency 'EURO' is not an ISO 4217 code"),
    # An attribution's key and value carry its order id: a 600 KB id fitted `events`, not the
    # attributions topic, and the stream failed on it at every restart. Bytes, not characters.
    *((json.dumps({**ORDER, field: "é" * (ID_MAX_BYTES // 2) + "x"}),
       f"{field} is {ID_MAX_BYTES + 1} bytes long, more than the {ID_MAX_BYTES} an id may have "
       "(ids are keys and values of the changelog topics, whose records must fit one Kafka "
       "message); send a shorter id") for field in ("event_id", "order_id", "user_id")),
    # Read as text, a JSON object, array or boolean came out as its JSON text, stored as a
    # valid event: a client '{"name":"acme"}' (a url or referrer is free text: kept so).
    *((json.dumps({**ORDER, field: value}), f"{field} is a JSON {kind}, not a string: send it "
       "as a JSON string")
      for field, value, kind in (
          ("client_id", {"name": "acme"}, "object"), ("user_id", ["u", 1], "array"),
          ("event_id", True, "boolean"), ("event_type", {"t": 1}, "object"),
          ("order_id", [], "array"),
          # its text is not what was sent (7.0 was 7 in a backfill), an id no longer
          ("user_id", 7.0, "number with a fraction or an exponent"),
          ("event_id", 1e300, "number with a fraction or an exponent"))),
    # Numbers whose text from_json changes: 1e400 came out as '"Infinity"', quotes and all,
    # -0 as 0 (an id changed), and both were stored as valid
    (json.dumps({**ORDER, "user_id": "N"}).replace('"N"', "1e400"),
     "user_id is a JSON number with a fraction or an exponent, not a string: send it as a JSON "
     "string"),
    (json.dumps({**ORDER, "order_id": "N"}).replace('"N"', "-1E400"),
     "order_id is a JSON number with a fraction or an exponent, not a string: send it as a "
     "JSON string"),
    (json.dumps({**ORDER, "event_id": "N"}).replace('"N"', "-0"),
     "event_id is the JSON number -0, which reads as 0: send it as a JSON string"),
    # A whole number of 23 digits is a variant's DECIMAL, as 7.0 is: not said to have a
    # fraction or an exponent
    (json.dumps({**ORDER, "ts": 17935000000000000000000}),
     "ts '17935000000000000000000' is neither ISO-8601 with a time zone nor epoch "
     "milliseconds"),
    # A JSON number is judged by its own digits: 5 decimals are still too many.
    (json.dumps({**ORDER, "amount": "AMOUNT"}).replace('"AMOUNT"', "0.00005"),
     "amount '0.00005' is not a decimal string with at most 4 decimals"),
])
def test_a_bad_record_is_marked_with_the_first_rule_it_breaks(
    spark: SparkSession, value: str | None, reason: str
) -> None:
    assert error_of(spark, value) == reason


def misspelled(record: dict[str, Any], name: str, key: str) -> str:
    """``record`` as JSON with its field ``name`` sent under ``key``."""
    return json.dumps({(key if k == name else k): v for k, v in record.items()})


def test_a_referrer_key_in_other_letter_case_is_quarantined_naming_it(
    spark: SparkSession
) -> None:
    """Keys are read exactly: a ``Referrer`` (the one field a record may lack) was taken as no
    referrer and its value dropped unseen. A required field so spelled reads as missing."""
    rows = parse(spark, *((None, misspelled(record, name, key)) for record, name, key in (
        (PAGEVIEW, "referrer", "Referrer"), (PAGEVIEW, "referrer", "REFERRER"),
        (PAGEVIEW, "user_id", "User_Id"), (ORDER, "amount", "Amount"))))
    assert [row["error"] for row in rows] == [
        *(f"key '{key}' is not the contract's 'referrer': keys are matched exactly, so the "
          "field reads as missing; send it as 'referrer'" for key in ("Referrer", "REFERRER")),
        "missing field user_id", "missing field amount"]


@pytest.mark.parametrize("value", [
    json.dumps({k: v for k, v in PAGEVIEW.items() if k != "referrer"}),  # no referrer at all
    json.dumps({**PAGEVIEW, "referrer": None}),
    json.dumps({**PAGEVIEW, "referrer": None, "Referrer": "x"}),  # the contract's key is read
    json.dumps({k: v for k, v in PAGEVIEW.items() if k != "referrer"} | {"url": "Referrer"}),
    json.dumps({**PAGEVIEW, "referrer": None, "data": {"Referrer": "x"}}),  # nested
])
def test_a_pageview_without_a_referrer_key_in_other_case_is_valid(
    spark: SparkSession, value: str
) -> None:
    (row,) = parse(spark, (KEY, value))
    assert (row["error"], row["referrer"]) == (None, None)


def test_a_zero_id_is_valid_as_a_string_or_an_integer(spark: SparkSession) -> None:
    """-0 is refused (it reads as 0); a zero, and a text quoting -0, are not."""
    rows = parse(spark, *((KEY, value) for value in (
        json.dumps({**ORDER, "order_id": "0"}),
        json.dumps({**ORDER, "order_id": "N"}).replace('"N"', "0"),
        json.dumps({**ORDER, "order_id": "0", "url": '"order_id": -0'}))))
    assert [(row["order_id"], row["error"]) for row in rows] == [("0", None)] * 3


@pytest.mark.parametrize("value", [
    "\n" + json.dumps(PAGEVIEW),  # JSON's whitespace is space, tab, CR and LF
    "\r\n\t " + json.dumps(PAGEVIEW) + "\r\n",
])
def test_json_whitespace_around_the_object_is_valid(spark: SparkSession, value: str) -> None:
    (row,) = parse(spark, (KEY, value))
    assert (row["error"], row["event_id"]) == (None, "e1")


def test_a_key_that_does_not_name_the_user_is_an_error(spark: SparkSession) -> None:
    assert error_of(spark, json.dumps(PAGEVIEW), key="client-00/u2") == (
        "key 'client-00/u2' does not match client_id/user_id 'client-00/u1'")
    assert error_of(spark, json.dumps(PAGEVIEW), key=None) is None  # a key is optional


def test_valid_events_keep_every_field_as_text_and_take_time_from_ts(
    spark: SparkSession
) -> None:
    epoch_ms = int(T0.timestamp() * 1000) + 1
    pageview, order, numeric, extra = parse(
        spark,
        (KEY, json.dumps(PAGEVIEW)),
        (KEY, json.dumps({**ORDER, "ts": "2026-11-01T10:30:00.250+01:30"})),
        # A JSON number comes out as its text (an object, array or boolean is refused)
        (KEY, json.dumps({**ORDER, "ts": epoch_ms, "amount": 12.5, "order_id": 7})),
        # Texts that only look like JSON are texts; a url or referrer is free text; fields
        # outside the contract are not read
        (KEY, json.dumps({**PAGEVIEW, "event_id": "{x}.1", "url": {"path": "/b"},
                          "referrer": "true", "extra": [1]})),
    )
    assert pageview["error"] is None and pageview["event_type"] == "pageview"
    assert (pageview["event_id"], pageview["url"], pageview["referrer"]) == ("e1", "/a", "")
    assert pageview["ts"].astimezone(UTC) == T0
    assert pageview["raw"] == json.dumps(PAGEVIEW)
    assert pageview["source"] == "kafka:events/0/0"
    assert order["error"] is None
    assert order["ts"].astimezone(UTC) == datetime(2026, 11, 1, 9, 0, 0, 250_000, tzinfo=UTC)
    assert (order["order_id"], order["amount"], order["currency"]) == (
        "o1", Decimal("12.5000"), "EUR")
    assert numeric["error"] is None
    assert numeric["ts"].astimezone(UTC) == datetime(2026, 11, 1, 9, 0, 0, 1000, tzinfo=UTC)
    assert (numeric["order_id"], numeric["amount"]) == ("7", Decimal("12.5000"))
    assert (extra["error"], extra["event_id"], extra["url"], extra["referrer"]) == (
        None, "{x}.1", '{"path":"/b"}', "true")
    assert pageview["amount"] is None and pageview["order_id"] is None


@pytest.mark.parametrize(("text", "amount"), [
    ("999999999999.9999", Decimal("999999999999.9999")),  # the largest amount kept
    ("000000000000000012.5", Decimal("12.5000")),  # leading zeros do not count
])
def test_the_largest_amount_and_leading_zeros_are_valid(
    spark: SparkSession, text: str, amount: Decimal
) -> None:
    (order,) = parse(spark, (KEY, json.dumps({**ORDER, "amount": text})))
    assert (order["error"], order["amount"]) == (None, amount)


def test_an_id_at_the_bound_is_valid(spark: SparkSession) -> None:
    longest = "o" * ID_MAX_BYTES
    (order,) = parse(spark, (None, json.dumps({**ORDER, "order_id": longest,
                                               "user_id": longest, "event_id": longest})))
    assert (order["error"], order["order_id"]) == (None, longest)


@pytest.mark.parametrize(("number", "amount"), [
    ("12345678.5", Decimal("12345678.5")),  # from_json's text of it was 1.23456785E7
    ("0.0005", Decimal("0.0005")),  # 5.0E-4
    ("999999999999.0003", Decimal("999999999999.0003")),  # beyond a double's digits
    ("1.5e2", Decimal("150")),
    ("1.5E7", Decimal("15000000")),  # a number with an exponent is a double, its text 1.5E7
    ("1.23456785E7", Decimal("12345678.5")),
    ("1E-4", Decimal("0.0001")),  # 1.0E-4
])
def test_an_amount_sent_as_a_json_number_is_judged_by_its_own_digits(
    spark: SparkSession, number: str, amount: Decimal
) -> None:
    """As a JSON Lines backfill judges it (batch_input B9): such valid orders were quarantined,
    with a reason quoting a value never sent."""
    value = json.dumps({**ORDER, "amount": "AMOUNT"}).replace('"AMOUNT"', number)
    (order,) = parse(spark, (KEY, value))
    assert (order["error"], order["amount"]) == (None, amount)


@pytest.mark.parametrize(("sent", "shown"), [
    ('"1e3"', "1e3"), ("true", "true"), ('"1.00000"', "1.00000"), ("1e25", "1.0E25"),
    # past 18 decimals a cast to decimal(38,18) rounds: each was judged 19.99 or 0, accepted
    ("19.99000000000000000001", "19.99000000000000000001"),
    ("-0.0000000000000000001", "-0.0000000000000000001"), ("-1E-20", "-1.0E-20"),
    ("1e-30", "1.0E-30"),
    # 16 digits with an exponent: a double, whose text (Java's) is not the one sent
    ("9.999999999990003E11", "9.999999999990002E11")])
def test_an_amount_that_is_no_decimal_string_nor_a_number_in_range_is_refused(
    spark: SparkSession, sent: str, shown: str
) -> None:
    """A string is judged as sent, whatever a cast would make of it; a JSON Lines batch
    judges each line's amount the same way (batch_input B9)."""
    value = json.dumps({**ORDER, "amount": "AMOUNT"}).replace('"AMOUNT"', sent)
    (order,) = parse(spark, (KEY, value))
    assert order["error"] == f"amount '{shown}' is not a decimal string with at most 4 decimals"


@pytest.mark.parametrize(("text", "instant"), [
    ("2026-11-01T09:00:00Z", T0),
    ("2026-11-01T09:00Z", T0),  # no seconds
    ("2026-11-01T10:00+01:00", T0),
    ("2026-11-01T10:00+0100", T0),
    ("2026-11-01T10:00+01", T0),
    ("2026-11-01T09:00:00z", T0),  # lower-case z
    ("2026-11-01T09:00z", T0),
    ("2026-11-01 09:00Z", T0),
    ("2026-11-01T10:00:00+01", T0),
    ("2026-11-01T03:30:00.5-05:30", T0.replace(microsecond=500_000)),
    ("2026-11-01T09:00:00.0009Z", T0),  # kept to the millisecond (contract.TS_PRECISION)
    ("2026-11-01T09:00:00.123456789Z", T0.replace(microsecond=123_000)),
])
def test_every_ts_form_the_contract_accepts_parses_to_its_instant(
    spark: SparkSession, text: str, instant: datetime
) -> None:
    (row,) = parse(spark, (KEY, json.dumps({**PAGEVIEW, "ts": text})))
    assert row["error"] is None, row["error"]
    assert row["ts"].astimezone(UTC) == instant


def test_an_iso_ts_that_names_no_real_time_is_an_error(spark: SparkSession) -> None:
    assert error_of(spark, json.dumps({**PAGEVIEW, "ts": "2026-11-01T25:00Z"})) == (
        "ts '2026-11-01T25:00Z' is neither ISO-8601 with a time zone nor epoch milliseconds")


def test_a_ts_further_ahead_of_its_arrival_than_allowed_is_an_error(
    spark: SparkSession
) -> None:
    """Judged against the record's Kafka timestamp (10 minutes by default), not the clock
    as the check runs."""
    limit = timedelta(minutes=Config().max_ts_ahead_minutes)
    at_limit, beyond = (json.dumps({**PAGEVIEW, "ts": (T0 + ahead).isoformat()})
                        for ahead in (limit, limit + timedelta(milliseconds=1)))
    ok, bad = parse(spark, (KEY, at_limit), (KEY, beyond))
    assert ok["error"] is None
    assert bad["error"] == (
        "ts '2026-11-01T09:10:00.001000+00:00' is more than 10 minutes ahead of its arrival at "
        "the stream (2026-11-01T09:00:00.000Z): a producer's clock is wrong, and the event "
        "would carry the stream's watermark with it (CLICKSTREAM_MAX_TS_AHEAD)")
    years_late = json.dumps({**PAGEVIEW, "ts": "2001-01-01T00:00:00Z"})
    assert parse(spark, (KEY, years_late))[0]["error"] is None


def test_a_record_without_a_kafka_timestamp_is_not_judged_by_it(spark: SparkSession) -> None:
    """Kafka reports a missing timestamp as -1 ms: the micro-batch's time is the arrival."""
    no_timestamp = datetime(1969, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC)
    (row,) = parse(spark, (KEY, json.dumps(PAGEVIEW)), received=no_timestamp)
    assert row["error"] is None
    ahead = json.dumps({**PAGEVIEW, "ts": (datetime.now(UTC) + timedelta(hours=6)).isoformat()})
    (row,) = parse(spark, (KEY, ahead), received=no_timestamp)
    assert "is more than 10 minutes ahead of its arrival at the stream" in row["error"]


def test_a_producer_clock_ahead_is_caught_though_it_stamped_the_record_too(
    spark: SparkSession
) -> None:
    """A topic's default timestamps (CreateTime) are the producer's: a clock 6 hours ahead
    stamps the record as far ahead as its ts, and the record passed, carrying the watermark
    6 hours ahead. The micro-batch's time bounds the arrival (in a stream: the batch's
    timestamp in the offsets log, the same on a replay)."""
    wrong_clock = datetime.now(UTC) + timedelta(hours=6)
    value = json.dumps({**PAGEVIEW, "ts": wrong_clock.isoformat()})
    (row,) = parse(spark, (KEY, value), received=wrong_clock)
    assert "is more than 10 minutes ahead of its arrival at the stream" in row["error"]


def test_a_clock_tick_is_a_row_of_its_own_with_its_time_and_no_error(
    spark: SparkSession
) -> None:
    """A quiet stream's clock tick (io.stream_clock): no record, so no reason to quarantine it;
    its time is the tick's. An empty record of a Kafka partition is refused as ever."""
    at = T0 + timedelta(hours=3)
    rows = [(None, None, "events", CLOCK_PARTITION, 0, at, 0, None),
            (None, None, "events", 1, 7, at, 0, None)]
    tick, empty = [r.asDict() for r in parse_kafka_records(
        spark.createDataFrame(rows, KAFKA_SCHEMA), max_ts_ahead_ms=AHEAD_MS).orderBy(
        "source").collect()]
    assert (tick["source"], tick["error"], tick["event_type"], tick["ts"]) == (
        CLOCK_SOURCE, None, None, at.replace(tzinfo=None))
    assert (empty["source"], empty["error"]) == ("kafka:events/1/7", "value is empty")


def test_a_marker_of_lost_offsets_is_quarantined_before_any_other_rule(
    spark: SparkSession
) -> None:
    """The record the Kafka source puts in place of offsets the broker dropped, when told to
    go on (io.kafka_source K1): its reason names the lost run; a record with a value and the
    same header is parsed as usual, and so is a frame without ``headers`` (Spark's native
    source without includeHeaders)."""
    lost = [(LOST_OFFSETS_HEADER, b"100-199")]
    rows = [(None, None, "events", 3, 100, T0, 0, lost),
            (KEY.encode(), json.dumps(PAGEVIEW).encode(), "events", 3, 200, T0, 0, lost),
            (None, None, "events", 3, 201, T0, 0, [("other", b"1-2")])]
    records = spark.createDataFrame(rows, KAFKA_SCHEMA)
    marker, forged, tombstone = [r.asDict() for r in
                                 parse_kafka_records(records, max_ts_ahead_ms=AHEAD_MS)
                                 .orderBy("source").collect()]
    assert marker["error"] == (
        "records 100..199 of events partition 3 were dropped by the broker before the "
        "sessionizer read them (CLICKSTREAM_FAIL_ON_DATA_LOSS=false): they are lost; if you "
        "still have them, load them with `clickstream backfill`")
    assert (marker["source"], marker["raw"], marker["client_id"]) == (
        "kafka:events/3/100", None, None)
    assert (forged["error"], forged["event_id"]) == (None, "e1")
    assert tombstone["error"] == "value is empty"
    without_headers = parse_kafka_records(records.drop("headers"), max_ts_ahead_ms=AHEAD_MS
                                          ).orderBy("source").collect()
    assert [r.error for r in without_headers] == ["value is empty", None, "value is empty"]
