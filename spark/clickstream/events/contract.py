"""The public contract of input records (pure constants, shared by parsing, backfill and gates)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

PAGEVIEW = "pageview"
ORDER = "order"

REQUIRED_EVENT_FIELDS = ("event_id", "client_id", "user_id", "event_type", "ts")
# Session ids join a client's and a user's ids with U+001F (sessions.semantics), so a control
# character in either could give two users' sessions one id: such ids are refused everywhere.
CONTROL_CHARACTER = r"[\x00-\x1f\x7f]"
# A client id as commands and the Airflow forms take it, and as the stream and batches accept
# it: rows are matched to it exactly, so a space around it (or an empty one) would match no
# row. Unanchored, for JSON Schema too (whose Python validator's ``$`` also matches before a
# final newline: anchor with ``$(?!\n)``). Java reads ``\s`` as Python does with ``(?U)``.
CLIENT_ID_PATTERN = r"[^\s\x00-\x1f\x7f]([^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f])?"
# A client id names a folder of every client-partitioned table (``client_id=<escaped id>``),
# and a folder name holds at most 255 bytes: a longer id failed every write of its micro-batch,
# other clients' rows with it, at every restart. At most 64 bytes of UTF-8, which stays under
# that limit even when every byte is escaped (3 bytes each).
CLIENT_ID_MAX_BYTES = 64
CLIENT_ID_RULE = (f"no spaces around it, no control characters, at most {CLIENT_ID_MAX_BYTES} "
                  "bytes of UTF-8")
"""The rule in words, where a form shows it beside its field (a form's error quotes the
pattern)."""


def client_id_problem(text: str) -> str | None:
    """Why ``text`` is not a client id, or None: the one rule of commands, forms and jobs
    (``events.parse.client_id_error`` is its Spark form for records)."""
    if not re.fullmatch(CLIENT_ID_PATTERN, text):
        return "it is empty, has spaces around it or a control character"
    if len(text.encode()) > CLIENT_ID_MAX_BYTES:
        return f"it is longer than {CLIENT_ID_MAX_BYTES} bytes of UTF-8"
    return None


ORDER_FIELDS = ("order_id", "amount", "currency")

# Plausible event-time range: a fixed range (not "now"), so a replay judges a record the same way.
EARLIEST_TS = datetime(2000, 1, 1, tzinfo=UTC)
LATEST_TS = datetime(2100, 1, 1, tzinfo=UTC)

# Event times are kept to the millisecond, the precision of epoch-ms times, of Kafka's
# timestamps and of the session arithmetic (semantics works in epoch ms): a finer ISO-8601
# fraction is cut (events.parse.to_milliseconds), in the stream and in backfills alike.
TS_PRECISION = "millisecond"

# ISO-8601 with an explicit zone (Z or z, +hh:mm / +hhmm / +hh); a bare local time is
# ambiguous. Seconds and their fraction are optional. Spark's cast reads only an upper-case Z
# and times with seconds: events.parse.ts_from_text brings every form here into that shape.
# The patterns are Java's (Spark's rlike): they end in \z, since $ also matches before a final
# line break, and Spark's casts trim it, so "1793500000000\n" was read as a valid time.
ISO_WITH_ZONE = (r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?"
                 r"([Zz]|[+-]\d{2}(:?\d{2})?)\z")
EPOCH_MILLIS = r"^-?\d{1,15}\z"
# Non-negative decimal string with at most 4 decimals (the tables keep DECIMAL(20,4) exactly).
AMOUNT = r"^-?\d+(\.\d{1,4})?\z"
# Sessions add amounts up exactly as 64-bit integers of 1/10000 (semantics.AMOUNT_SCALE), so a
# session's revenue must stay below 2**63 / 10**4 (~9.2e14). An amount must stay below 10**12
# (at most 12 digits before the point, leading zeros aside): a session then overflows only past
# 922 orders at the largest amount (semantics.with_order_totals stops loudly if one does); with
# 14 digits, 10 placeholder amounts such as 99999999999999 made a negative revenue unnoticed.
AMOUNT_MAX_INTEGER_DIGITS = 12
AMOUNT_IN_RANGE = rf"^-?0*\d{{1,{AMOUNT_MAX_INTEGER_DIGITS}}}(\.\d*)?\z"

# A pageview's url is at most this many bytes (UTF-8); a longer one is quarantined, in the
# stream and in backfills alike. A session's changelog value carries two urls (landing and
# exit, from different pageviews), so an input that fits one Kafka message can still make a
# session value above the producer's limit (librdkafka's message.max.bytes, 1,000,000 by
# default; a broker's is ~1 MiB), and a backfill's files have no limit at all: the publish
# fails, and fails again on every restart. Two urls of this size stay under it even when
# JSON escapes every byte (6 bytes for a control character): 2 * 6 * 65,536 = 786,432.
# Browsers and servers rarely accept urls beyond 8-64 KiB.
URL_MAX_BYTES = 64 * 1024
# An event's, order's and user's id is at most this many bytes (UTF-8); a longer one is
# quarantined, in the stream and in backfills alike. The ids are Kafka keys and values of the
# changelogs (an attribution's key and value both carry its order id): a 600 KB order id fits
# the ``events`` topic, but its attribution record did not fit one message, and the stream
# failed on it at every restart. With two urls at their bound, a session value stays under
# the limit with the ids at theirs, every byte escaped.
ID_MAX_BYTES = 1024

# ISO 4217 active codes.
CURRENCIES = frozenset(
    """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP
    BYN BZD CAD CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP
    GEL GHS GIP GMD GNF GTQ GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR
    KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK
    MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON RSD RUB RWF SAR
    SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT TND TOP TRY TTD TWD TZS
    UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XCG XOF XPF YER ZAR ZMW ZWG
    """.split()
)

# The header of the marker record the Kafka source puts in place of offsets the broker dropped
# before they were read, when told to go on (CLICKSTREAM_FAIL_ON_DATA_LOSS=false; io.kafka_source
# K1, K2); its value names the lost run, b"<first>-<last>". The parser quarantines the marker.
LOST_OFFSETS_HEADER = "clickstream-lost-offsets"

# A clock tick: the row the Kafka source puts in a micro-batch of a quiet stream so that its
# event time runs on (io.stream_clock). Its partition is one no Kafka record has; the parser
# gives it this ``source`` (a record's is ``kafka:<topic>/<partition>/<offset>``) and no error.
CLOCK_PARTITION = -1
CLOCK_SOURCE = "clickstream-clock"
