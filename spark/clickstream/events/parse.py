"""Parse and validate raw Kafka records in Spark: every record comes out, valid or with a reason.

Runs as JVM expressions (no Python UDF) so validation costs little per event. A record is valid
when ``error`` is null; otherwise ``error`` holds the first rule it broke, which becomes the
quarantine reason. Time always comes from the event's own ``ts`` (ISO-8601 with a zone, or
integer epoch milliseconds), normalised to UTC and kept to the millisecond.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, DecimalType, DoubleType

from clickstream.config import ENV_NAMES
from clickstream.events import contract
from clickstream.tables import AMOUNT_TYPE

PARSED_COLUMNS = (
    "raw", "source", "event_id", "client_id", "user_id", "event_type", "ts", "url", "referrer",
    "order_id", "amount", "currency", "error",
)


NOT_UTF8_PREFIX = "base64:"  # a quarantined value that is not UTF-8 is kept as its bytes


# Every field is read as text in one pass; a JSON number, boolean, object or array comes out
# as its JSON text. (``try_variant_get`` per field cost ~3x more: Spark builds a Cast and
# reads the SQL conf per row and field; ``try_parse_json`` stays as the validity check, since
# it rejects what ``from_json`` tolerates, such as a repeated key.) An order's ``amount`` is
# the exception (``amount_text``): ``from_json`` writes a number back through a double.
_FIELDS_AS_TEXT = ", ".join(f"{name} string" for name in (
    *contract.REQUIRED_EVENT_FIELDS, "url", "referrer",
    *(name for name in contract.ORDER_FIELDS if name != "amount")))


def _sent_text(value: Column, field: str, text: Column) -> Column:
    """A field as its record sent it, for a quarantine reason: ``from_json`` writes a JSON
    number back through a double (``1793500000000.5`` as ``1.7935000000005E12``), and a
    reason quoting a value never sent sends its reader looking for it in vain. Only read
    where a reason is built, so valid records do not pay for it."""
    return F.coalesce(F.try_variant_get(value, f"$.{field}", "string"), text)


# A JSON number with an exponent is a double in a variant, its text Java's shortest; up to
# 15 significant digits that text is the number as sent (any such decimal round-trips).
_JSON_DOUBLE_KIND = r"^(DOUBLE|FLOAT)\b"
_DOUBLE_EXACT_DIGITS = 15


def amount_text(value: Column) -> Column:
    """An order's ``amount`` in a parsed JSON record (``value``, a variant) as the amount rule
    judges it, in the stream and in JSON Lines batches alike: a string as sent, a JSON number
    by its value written plainly (``1.5E7`` as ``15000000``, ``1E-4`` as ``0.0001``).

    A variant keeps a number without an exponent as an exact decimal, whose text is plain
    already (``12.500000`` as ``12.5``), and one with an exponent as a double, whose text is
    Java's (``1.23456785E7``): such valid orders were quarantined, quoting a value never
    sent. A double is judged by its plain value only when its text has at most 15
    significant digits and the decimal converts back to it, so a value that text or a cast
    rounded (``1E-20`` to 0) is judged by its text and refused. A batch judged the column by
    the type Spark inferred for it, so it took ``"1e3"`` and ``true`` as amounts (B9)."""
    sent = F.try_variant_get(value, "$.amount", "string")
    kind = F.schema_of_variant(F.try_variant_get(value, "$.amount", "variant"))
    digits = F.regexp_replace(F.regexp_extract(sent, r"^-?([0-9.]+)", 1), r"\.|^0+", "")
    exact = exact_decimal_text(sent, F.try_variant_get(value, "$.amount", "double"),
                               DoubleType())
    return F.when(kind.rlike(_JSON_DOUBLE_KIND) & (F.length(digits) <= _DOUBLE_EXACT_DIGITS),
                  F.coalesce(exact, sent)).otherwise(sent)


def exact_decimal_text(number: Column, original: Column, original_type: DataType) -> Column:
    """``number`` (a number, or its text) written plainly when a ``decimal(38,18)`` holds it
    exactly (it converts back to ``original``, of ``original_type``), else null: a cast
    rounds past 18 decimals, and ``-1e-20`` was judged as 0 and accepted."""
    decimal = number.try_cast(DecimalType(38, 18))
    return F.when(decimal.cast(original_type) == original, plain_decimal_text(decimal))


def plain_decimal_text(decimal: Column) -> Column:
    """A decimal's text without trailing zeros (12.500000 as 12.5, 3.000 as 3)."""
    return F.regexp_replace(F.regexp_replace(decimal.cast("string"), r"(\.\d*?)0+$", "$1"),
                            r"\.$", "")


# The fields read as text; ``ts`` and ``amount`` have rules of their own for a JSON number.
# The text fields whose JSON type is checked (``not_text_error``): the ids, which name folders,
# keys and sessions, and the event type. A url or referrer is free text (an object there is
# kept as its JSON text); a currency is one of a set, which refuses any other type.
TEXT_FIELDS = ("event_id", "client_id", "user_id", "event_type", "order_id")
# How a reason names the JSON types a text field may not hold (``schema_of_variant``'s names).
_NOT_TEXT_KINDS = {"OBJECT": "object", "ARRAY": "array", "BOOLEAN": "boolean",
                   **dict.fromkeys(("DECIMAL", "DOUBLE", "FLOAT"),
                               "number with a fraction or an exponent")}


def json_number_not_whole(value: Column, field: str, text: Column) -> Column:
    """Whether a parsed JSON record's ``field`` (``value``, a variant; ``text``, its text as
    ``from_json`` reads it) is a number with a fraction or an exponent. Only a text with a
    ``.`` and no ``:`` of a time can be one (``from_json`` writes every such number with a
    ``.``), and only such a text is looked up: a variant holds ``7.0`` and a whole number of
    23 digits alike, as a DECIMAL of scale 0."""
    kind = F.schema_of_variant(F.try_variant_get(value, f"$.{field}", "variant"))
    return F.when(text.contains(".") & ~text.contains(":"),
                  kind.rlike(r"^(DECIMAL|DOUBLE|FLOAT)\b")).otherwise(False)


def not_text_error(value: Column, sent: Column, texts: dict[str, Column]) -> Column:
    """Reason one of a parsed JSON record's ``TEXT_FIELDS`` (``texts``: name -> its text as
    ``from_json`` reads it) holds a JSON object, array, boolean or a number with a fraction
    or an exponent, or null. Read as text, such a value came out as its JSON text and was
    stored as valid: a client ``{"name":"acme"}``, a user ``["u",1]``; a number's text is
    not what was sent (``7.0`` stayed ``7.0`` in the stream, ``7`` in a backfill: one user
    twice; ``1e400`` became ``"Infinity"``, quotes and all). An integer is its digits, as
    sent, in both; but ``-0`` reads as ``0``, so it is refused (``sent``: the record's JSON
    text, looked at for it only where the text is ``0``, by the key's text: a key written
    with escapes, ``"order\\u005fid": -0``, is not recognised and stored as ``0``, and a
    ``-0`` under the same key in a nested object refuses a top-level ``0``; both far rarer
    than a ``-0`` id, itself rare). Only a text that could be one (it
    starts with ``{``, ``[`` or ``"``, is ``true``/``false``/``0``, or has a ``.``, which the
    text of every other such number has) is looked up in ``value`` (a variant), so a valid
    record pays a few comparisons per field: parsing took ~18% longer in three alternated
    pairs over 1M records (``bench/parse_bench.py``; ~35% with a regular expression for
    numbers and these checks on every text field)."""
    names = F.create_map(*(F.lit(x) for pair in _NOT_TEXT_KINDS.items() for x in pair))
    reasons = []
    for name, text in texts.items():
        kind = F.regexp_extract(F.schema_of_variant(
            F.try_variant_get(value, f"$.{name}", "variant")), r"^[A-Z]+", 0)
        could_be = (text.startswith("{") | text.startswith("[") | text.startswith('"')
                    | text.isin("true", "false") | text.contains("."))
        # Nested, so the lookup stays in the branch only such texts reach; a string's kind
        # names no entry: null, no reason.
        reasons.append(F.when(could_be, F.concat(
            F.lit(f"{name} is a JSON "), F.try_element_at(names, kind),
            F.lit(", not a string: send it as a JSON string"))))
        # Nested too: as a conjunction's right side, ``kind`` (used twice) may be evaluated
        # up front for every record by subexpression elimination (``lost_offsets_error``);
        # nested, a parse took 5-14% less in two alternated pairs (``bench/parse_bench.py``).
        reasons.append(F.when(text == "0", F.when((kind != "STRING") & sent.rlike(
            rf'"{name}"\s*:\s*-0(?![0-9.eE])'), F.lit(
                f"{name} is the JSON number -0, which reads as 0: send it as a JSON string"))))
    return F.coalesce(*reasons) if reasons else F.lit(None).cast("string")


def misspelled_key_error(sent: Column, name: str, text: Column) -> Column:
    """Reason a JSON object (``sent``, its text) lacks the contract's key ``name`` and holds
    it in other letter case (``Referrer``), or null. Shared by the stream and JSON Lines
    batches. Keys are read exactly, as JSON's are, so such a field reads as missing: a
    ``referrer``, which may be missing, was stored null and its value dropped unseen, and a
    required field's reason said only "missing".

    Nested, so a record pays only when ``text`` is null and ``sent`` lacks the exact key;
    only when the name then appears in another case are its keys listed. A key written with
    escapes (``"Referr\\u0065r"``) is not recognised."""
    quoted = f'"{name}"'
    others = F.filter(F.json_object_keys(sent),
                      lambda key: (F.lower(key) == F.lit(name)) & (key != F.lit(name)))
    reason = F.format_string(
        f"key '%s' is not the contract's '{name}': keys are matched exactly, so the field "
        f"reads as missing; send it as '{name}'", F.get(others, 0))
    return F.when(text.isNull(), F.when(~sent.contains(quoted), F.when(
        sent.rlike(f'(?i)"{name}"'), F.when(F.size(others) > 0, reason))))


def _blank(column: Column) -> Column:
    return column.isNull() | (F.trim(column) == "")


def client_id_error(client_id: Column) -> Column:
    """The stream's client ids are the ones commands can name (``contract.CLIENT_ID_PATTERN``):
    a client ``" acme"`` was stored and sessionized, but no backfill or ``recompute --client``
    could take it."""
    return F.when(~client_id.rlike(rf"(?U)^(?:{contract.CLIENT_ID_PATTERN})\z"), F.format_string(
        "client_id '%s' has a control character or spaces around it: commands take a client "
        "id as printable text without spaces around it; send it that way", client_id)).when(
        F.octet_length(client_id) > contract.CLIENT_ID_MAX_BYTES, F.format_string(
            "client_id '%s' is longer than %d bytes of UTF-8: it names a folder of every "
            "client-partitioned table, which the file system limits; send a shorter id",
            client_id, F.lit(contract.CLIENT_ID_MAX_BYTES)))


def user_id_error(user_id: Column) -> Column:
    return F.when(user_id.rlike(contract.CONTROL_CHARACTER), F.lit(
        "user_id has a control character (U+0000-U+001F or U+007F): a session id joins the "
        "client and user ids with U+001F, so two users could share one; send it as printable "
        "text")).otherwise(id_error(user_id, "user_id"))


def id_error(text: Column, name: str) -> Column:
    """Reason an id is longer than ``contract.ID_MAX_BYTES``, or null. Shared by the stream
    and backfills; the id itself is not quoted (it may be most of a message)."""
    return F.when(F.octet_length(text) > contract.ID_MAX_BYTES, F.format_string(
        "%s is %d bytes long, more than the %d an id may have (ids are keys and values of the "
        "changelog topics, whose records must fit one Kafka message); send a shorter id",
        F.lit(name), F.octet_length(text), F.lit(contract.ID_MAX_BYTES)))


def _iso_as_spark_reads_it(text: Column) -> Column:
    """A ``contract.ISO_WITH_ZONE`` text with an upper-case ``Z`` and ``:00`` seconds added
    to ``hh:mm``: Spark's cast returns null for ``z`` and for times without seconds, which
    the contract accepts."""
    return F.regexp_replace(F.upper(text), r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2})([Z+-])",
                            "$1:00$2")


def _one_json_value(text: Column, *, parsed: bool = False) -> Column:
    """True when ``text`` holds one JSON value and nothing after it but whitespace (never null).

    ``try_parse_json`` and ``from_json`` read the first value and ignore what follows: two
    events in one record (``{...}{...}``, or JSON Lines) stored the first and dropped the
    second unseen. Wrapped in an array, text after the value either breaks the array (null),
    adds elements (``,``) or closes it early (``]``), which the second wrapping tells apart
    from one value (its ``,0`` stays inside the array only then).

    ``parsed``: only texts whose first value parsed are judged (``try_parse_json`` took it).
    Then a text that begins with ``{`` and holds one ``}``, its last character, is one
    object, closed by that brace, with nothing after it; most events are such objects and
    skip the two array parses, which were ~30% of parsing one (``bench/parse_bench.py``).
    A ``}`` inside a string, a nested object or whitespace after the object take them.
    """
    def wrapped(close: str) -> Column:
        return F.json_array_length(F.concat(F.lit("["), text, F.lit(close)))

    exact = F.coalesce((wrapped("]") == 1) & (wrapped(",0]") == 2), F.lit(False))
    if not parsed:
        return exact
    flat_object = (text.startswith("{") & text.endswith("}")
                   & (F.instr(text, "}") == F.length(text)))
    return F.when(flat_object, F.lit(True)).otherwise(exact)


def unparsed_json_reason(text: Column, what: str) -> Column:
    """Reason of a ``what`` (a value, a line) whose ``text`` ``try_parse_json`` refused. Some
    such text is valid JSON all the same: a key repeated in one object, an escaped lone
    surrogate (``"\\ud800"``), which JSON's grammar allows and Spark's variant refuses; "not
    valid JSON" sent its producer looking for a syntax error its JSON validator never finds."""
    return F.when(_one_json_value(text), F.lit(
        f"{what} is JSON the parser refuses: a key repeated in one object, or an escaped lone "
        "surrogate (such as \\ud800 alone); send each key once, and text as UTF-8")).otherwise(
        F.lit(f"{what} is not valid JSON"))


def _starts_an_object(text: Column) -> Column:
    # JSON's whitespace (space, tab, CR, LF) may precede the object: ``ltrim`` removed spaces
    # only, and a valid object after a newline was quarantined.
    return text.rlike(r"^[ \t\r\n]*\{")


def is_one_json_object(text: Column) -> Column:
    """True when valid JSON ``text`` (``try_parse_json`` took it) is one object, JSON's
    whitespace around it allowed (never null); a JSON Lines batch's lines are judged as the
    stream's values are."""
    return _one_json_value(text, parsed=True) & F.coalesce(_starts_an_object(text), F.lit(False))


def to_milliseconds(ts: Column) -> Column:
    """``ts`` cut to its millisecond (``contract.TS_PRECISION``): sessions are computed in
    epoch milliseconds, so a finer time stored as it came would disagree with its session
    (a first pageview at .0009 s starting a session at .000 s, two pageviews 0.8 ms short of
    the gap apart in two sessions)."""
    return F.timestamp_millis(F.unix_millis(ts))


def ts_from_text(text: Column) -> Column:
    """Timestamp of an ISO-8601-with-zone or epoch-millis string, to the millisecond; null
    when it is neither (or names no real time, such as hour 25)."""
    return (
        F.when(text.rlike(contract.EPOCH_MILLIS), F.timestamp_millis(text.cast("bigint")))
        .when(text.rlike(contract.ISO_WITH_ZONE),  # rewritten only when Spark cannot read it
              to_milliseconds(F.coalesce(text.try_cast("timestamp"),
                                         _iso_as_spark_reads_it(text).try_cast("timestamp"))))
    )


TS_NOT_WHOLE = ("ts is a number with a fraction or an exponent, not whole epoch milliseconds: "
                "send it as a whole number or as ISO-8601 text with a time zone")


def ts_error(text: Column, ts: Column, shown: Column | None = None,
             not_whole: Column | None = None) -> Column:
    """Reason ``ts`` is unusable, or null; the reason quotes ``shown`` (default ``text``),
    the value as it was sent where ``text`` is not (:func:`_sent_text`). A number with a
    fraction or an exponent (``not_whole``: the record sent one) is said to be one: quoted,
    ``1735689600000.0`` read '1735689600000' in the stream (its variant's text, epoch
    milliseconds that look valid) and '1.7356896E12' in a batch. ``not_whole`` is looked at
    only for a ``ts`` that is unusable."""
    shown = text if shown is None else shown
    unusable = F.when(_blank(text), F.lit("missing field ts"))
    if not_whole is not None:
        unusable = unusable.when(ts.isNull() & not_whole, F.lit(TS_NOT_WHOLE))
    return (
        unusable
        .when(
            ts.isNull(),
            F.format_string(
                "ts '%s' is neither ISO-8601 with a time zone nor epoch milliseconds", shown
            ),
        )
        .when(
            (ts < F.lit(contract.EARLIEST_TS)) | (ts >= F.lit(contract.LATEST_TS)),
            F.format_string(
                "ts '%s' is outside the plausible range %s..%s", shown,
                F.lit(contract.EARLIEST_TS.date().isoformat()),
                F.lit(contract.LATEST_TS.date().isoformat()),
            ),
        )
    )


def ts_ahead_error(text: Column, ts: Column, reference: Column, max_ahead_ms: int, *,
                   reference_is: str,
                   harm: str = "the event would carry the stream's watermark with it") -> Column:
    """Reason ``ts`` is further ahead of ``reference`` than ``max_ahead_ms``, or null: no event
    is recorded before it happens, so its clock is wrong (config.max_ts_ahead_minutes).
    ``reference`` is a time fixed for the record (its arrival at the stream, its file's
    modification time), never the clock as the check runs, so a replay judges it the same
    way; a record without one (null) is not judged."""
    return F.when(
        (reference > F.lit(contract.EARLIEST_TS))
        & (F.unix_millis(ts) - F.unix_millis(reference) > F.lit(max_ahead_ms)),
        F.format_string(
            f"ts '%s' is more than %s minutes ahead of {reference_is} (%s): a producer's clock "
            f"is wrong, and {harm} (CLICKSTREAM_MAX_TS_AHEAD)", text,
            F.lit(f"{max_ahead_ms / 60_000:g}"),
            F.date_format(reference, "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'")),
    )


def amount_error(text: Column) -> Column:
    """Reason an order amount is unusable, or null."""
    return (
        F.when(_blank(text), F.lit("missing field amount"))
        .when(
            ~text.rlike(contract.AMOUNT),
            F.format_string("amount '%s' is not a decimal string with at most 4 decimals", text),
        )
        .when(
            ~text.rlike(contract.AMOUNT_IN_RANGE),
            F.format_string(
                "amount '%s' is too large: at most %d digits before the decimal point (amounts "
                "are kept exactly as 64-bit integers of 1/10000); correct the amount", text,
                F.lit(contract.AMOUNT_MAX_INTEGER_DIGITS)),
        )
        .when(text.startswith("-") & (text.cast(AMOUNT_TYPE) != 0),
              F.format_string("amount '%s' is negative", text))
    )


def amount_value(text: Column) -> Column:
    """The amount as a decimal if its text is one :func:`amount_error` reads (a negative one
    too: its own rule judges it), else null. A plain cast rounded 1.23456 to 1.2346 and read
    13-digit amounts and exponents, so a gate counting null amounts missed them."""
    return F.when(text.rlike(contract.AMOUNT) & text.rlike(contract.AMOUNT_IN_RANGE),
                  text.try_cast(AMOUNT_TYPE))


def url_error(text: Column) -> Column:
    """Reason a pageview's url is unusable, or null: missing, or longer than
    ``contract.URL_MAX_BYTES`` (a session's Kafka value carries two urls and must fit one
    message). Shared by the stream and backfills, so both judge a url alike."""
    return (
        F.when(_blank(text), F.lit("pageview without url"))
        .when(
            F.octet_length(text) > contract.URL_MAX_BYTES,
            F.format_string(
                "url is %d bytes long, more than the %d a url may have (its session's Kafka "
                "value carries two urls and must fit one message); shorten the url (e.g. its "
                "query string) and send the pageview again", F.octet_length(text),
                F.lit(contract.URL_MAX_BYTES)),
        )
    )


def currency_error(text: Column) -> Column:
    return (
        F.when(_blank(text), F.lit("missing field currency"))
        .when(
            ~text.isin(*sorted(contract.CURRENCIES)),
            F.format_string("currency '%s' is not an ISO 4217 code", text),
        )
    )


def bytes_unless_utf8(text: Column) -> Column:
    """``NOT_UTF8_PREFIX`` and the bytes of ``text`` in base64 when they are not UTF-8, else
    null (a Kafka value, a line of a JSON Lines batch).

    Spark's text of bytes keeps them as they are, and such a text cannot be kept: its invalid
    bytes failed the write of its quarantine row (Arrow's statistics decode it) at every
    replay, stopping the stream, and ``from_json`` replaced them, so a Latin-1 url was stored
    altered as a valid pageview. The quarantine row keeps the exact bytes instead, to replay
    them once re-encoded.
    """
    unchunked = F.regexp_replace(F.base64(text.cast("binary")), r"[\r\n]", "")  # MIME's lines
    return F.when(~F.is_valid_utf8(text), F.concat(F.lit(NOT_UTF8_PREFIX), unchunked))


def not_utf8_reason(what: str) -> str:
    """The reason of a record whose ``what`` :func:`bytes_unless_utf8` kept as bytes."""
    return (f"{what} is not UTF-8 text, as the contract's JSON must be: raw holds its bytes in "
            f"base64 after '{NOT_UTF8_PREFIX}'; re-encode it as UTF-8 and send it again")


def lost_offsets_error(records: DataFrame) -> Column:
    """Reason of a marker the Kafka source put in place of records the broker dropped before
    they were read (``CLICKSTREAM_FAIL_ON_DATA_LOSS=false``; io.kafka_source K1, K2), or null.

    A marker has no value and a ``contract.LOST_OFFSETS_HEADER`` naming the lost run, so a
    record with a value is never taken for one. Its reason comes before every other rule (it
    has no value either). Without a ``headers`` column (Spark's native source without
    ``includeHeaders``) there are no markers.
    """
    if "headers" not in records.columns:
        return F.lit(None).cast("string")
    marked = F.filter("headers", lambda header: header["key"] == contract.LOST_OFFSETS_HEADER)
    lost = F.split(F.get(marked, 0)["value"].cast("string"), "-")  # [first, last]
    # Nested, not one conjunction: the header search sits in a branch that only records
    # without a value reach (a conjunction's right side may be evaluated up front by Spark's
    # subexpression elimination, as ``lost`` is used twice).
    return F.when(F.col("value").isNull(), F.when(
        F.get(lost, 1).isNotNull(),
        F.format_string(
            "records %s..%s of %s partition %d were dropped by the broker before the "
            "sessionizer read them (%s=false): they are lost; if you still have them, load "
            "them with `clickstream backfill`",
            F.get(lost, 0), F.get(lost, 1), "topic", "partition",
            F.lit(ENV_NAMES["fail_on_data_loss"])),
    ))


ARRIVAL = "its arrival at the stream"  # _arrival


def _arrival(kafka_timestamp: Column) -> Column:
    """When a record reached the stream, as far as it can be told the same way on a replay.

    A topic's default timestamps (CreateTime) are the producer's clock: a clock hours ahead
    stamps the record as far ahead as its ``ts``, so the record alone passed the check and
    carried the watermark with it. The micro-batch's time bounds it: in a streaming query
    ``current_timestamp()`` is the batch's timestamp, kept in the offsets log, so a replay
    judges the record the same way. (A LogAppendTime topic stamps the broker's time.) A
    record without a timestamp (Kafka's -1) is judged by the micro-batch's time alone."""
    known = F.when(kafka_timestamp > F.lit(contract.EARLIEST_TS), kafka_timestamp)
    return F.least(known, F.current_timestamp())  # least() skips a null


def is_clock_tick() -> Column:
    """Whether a parsed row is a quiet stream's clock tick (``io.stream_clock``), not a record:
    no error, no event, ``ts`` the event time the stream's clock moves on to. Told by its
    ``source``, which Spark computes from the partition alone when it pushes this filter
    below the parse (an ``event_type`` test there would parse each record's JSON again)."""
    return F.col("source") == contract.CLOCK_SOURCE


def parse_kafka_records(records: DataFrame, *, max_ts_ahead_ms: int) -> DataFrame:
    """Turn Kafka-layout rows (key, value, topic, partition, offset, timestamp, ...) into parsed
    events; ``max_ts_ahead_ms`` is ``Config.max_ts_ahead_ms``. A clock tick of the Kafka source
    becomes a row of its own (:func:`is_clock_tick`)."""
    text = F.col("value").cast("string")  # Spark's cast keeps the bytes as they are
    key = F.col("key").cast("string")
    tick = F.col("partition") == contract.CLOCK_PARTITION  # a quiet stream's clock tick
    source = F.when(tick, F.lit(contract.CLOCK_SOURCE)).otherwise(
        F.format_string("kafka:%s/%d/%d", "topic", "partition", "offset"))
    base = records.select(
        text.alias("raw"),
        bytes_unless_utf8(text).alias("_raw_bytes"),
        key.alias("_key"),
        source.alias("source"),
        F.col("timestamp").alias("_received"),
        F.try_parse_json(text).alias("v"),
        F.from_json(text, _FIELDS_AS_TEXT).alias("_fields"),
        lost_offsets_error(records).alias("_lost"),
        tick.alias("_tick"),
    )
    v = F.col("v")
    events = base.select(F.coalesce("_raw_bytes", "raw").alias("raw"), "_raw_bytes", "_key",
                         "source", "_received", v, "_fields.*", "_lost", "_tick")
    is_order = F.col("event_type") == contract.ORDER
    events = events.withColumn("amount", F.when(is_order, amount_text(v)))
    events = events.withColumn("ts_value", ts_from_text(F.col("ts"))).withColumnRenamed(
        "ts", "ts_text"
    )

    missing = None
    for name in contract.REQUIRED_EVENT_FIELDS[:-1]:
        check = F.when(_blank(F.col(name)), F.lit(f"missing field {name}"))
        missing = check if missing is None else F.coalesce(missing, check)

    is_pageview = F.col("event_type") == contract.PAGEVIEW
    # The referrer alone, the one field a record may lack: a required field spelled so reads
    # as missing and is quarantined as such. Every field's check made the generated
    # projection ~40% slower (BENCHMARKS "Session 90").
    misspelled = F.when(is_pageview, misspelled_key_error(F.col("raw"), "referrer",
                                                          F.col("referrer")))
    error = F.when(~F.col("_tick"), F.coalesce(
        F.col("_lost"),
        F.when(F.col("_raw_bytes").isNotNull(), F.lit(not_utf8_reason("value"))),
        F.when(_blank(F.col("raw")), F.lit("value is empty")),
        F.when(v.isNull(), unparsed_json_reason(F.col("raw"), "value")),
        F.when(~_one_json_value(F.col("raw"), parsed=True),
               F.lit("value is not valid JSON: text follows its first value")),
        F.when(~_starts_an_object(F.col("raw")), F.lit("value is not a JSON object")),
        missing,
        misspelled,
        not_text_error(v, F.col("raw"), {name: F.col(name) for name in TEXT_FIELDS}),
        client_id_error(F.col("client_id")),
        user_id_error(F.col("user_id")),
        id_error(F.col("event_id"), "event_id"),
        ts_error(F.col("ts_text"), F.col("ts_value"), _sent_text(v, "ts", F.col("ts_text")),
                 json_number_not_whole(v, "ts", F.col("ts_text"))),
        ts_ahead_error(F.col("ts_text"), F.col("ts_value"), _arrival(F.col("_received")),
                       max_ts_ahead_ms, reference_is=ARRIVAL),
        F.when(~F.is_valid_utf8("_key"), F.lit(
            "key is not UTF-8 text: a key is '<client_id>/<user_id>' in UTF-8")),
        F.when(
            F.col("_key").isNotNull()
            & (F.col("_key") != F.concat_ws("/", "client_id", "user_id")),
            F.format_string(
                "key '%s' does not match client_id/user_id '%s/%s'",
                "_key", "client_id", "user_id",
            ),
        ),
        F.when(is_pageview, url_error(F.col("url"))),
        F.when(is_order & _blank(F.col("order_id")), F.lit("missing field order_id")),
        F.when(is_order, id_error(F.col("order_id"), "order_id")),
        F.when(is_order, amount_error(F.col("amount"))),
        F.when(is_order, currency_error(F.col("currency"))),
    ))
    return events.select(
        "raw",
        "source",
        "event_id",
        "client_id",
        "user_id",
        "event_type",
        F.when(F.col("_tick"), F.col("_received")).otherwise(F.col("ts_value")).alias("ts"),
        "url",
        "referrer",
        "order_id",
        F.when(is_order, amount_value(F.col("amount"))).alias("amount"),
        "currency",
        error.alias("error"),
    )
