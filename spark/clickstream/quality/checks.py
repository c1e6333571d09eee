"""Check results of each gate, computed in Spark: one row of numbers GX validates.

Every ``*_checks`` function turns a step's data into :class:`Checks`: ``values`` is the one row
of check results (its columns are the ones the gate's suite in ``expectations/`` names), and
``rows`` says, per check, which rows of which frame are behind it, so a failed expectation can
quarantine exactly the offending rows. Each function runs one or two Spark jobs over data the
step has already computed (usually persisted); none samples.

Known edge cases, cited inline as (K1)..(K6):
  K1. The stream's checks re-test, on the records the parser accepted, rules the parser
      already enforces: a gate is a second, independent line (a parser bug must not reach the
      tables), so its counts are normally zero and its cost must stay small.
  K2. A batch's conflicting duplicates (same key, different content) are only visible in the
      ``error`` text ``validate_batch`` wrote; a row broken in two ways counts under its
      first reason only.
  K3. The merge is found by its commit (metadata ``run_id``), and the table is read at that
      commit and the one before it (time travel), so concurrent appends by the stream are
      not counted, and a rerun (whose merge commits nothing) checks the original merge.
  K4. Overlap and gap checks compare each session with the user's previous session *among
      the recomputed ones*: sessions outside the affected windows are at least one gap away
      from them by construction (corrections C1).
  K5. Publishing is verified by reading back, from each partition, exactly the offset range
      written between two watermark snapshots; records of other keys that other producers
      wrote meanwhile are ignored, and a key counts as published if its *last* record there
      has the revision (a tombstone for a retraction): that record is what a compacted reader
      keeps. An older revision of the key written after the run's (a replayed micro-batch, a
      run outside the lock) passed when any record of the key counted.
  K6. The merge's keys are first counted by their 64-bit hash (a third cheaper to shuffle
      than strings). Equal keys have equal hashes, so a pass is a pass; a collision can only
      make counts look wrong, and then everything is counted again by the keys themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import reduce
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DateType,
    DecimalType,
    FractionalType,
    IntegralType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from clickstream.config import Config
from clickstream.errors import VACUUMED_WAY_FORWARD, VersionVacuumedError
from clickstream.events import contract
from clickstream.io.delta_tables import DeltaTables, PartitionFilter
from clickstream.tables import ORDERS, TableSpec

if TYPE_CHECKING:
    from clickstream.jobs.corrections import Snapshot

EVENT_TYPE_IDENTIFIER = r"^[A-Za-z][A-Za-z0-9_.:-]{0,63}\z"  # Java: $ allows a final \n


@dataclass
class Checks:
    """One gate's check results and, per check column, the rows behind it.

    Attributes:
        values: the one row of check results, ``{column: number or text}``.
        rows: ``{column: (frame, predicate)}``: the rows of ``frame`` where ``predicate`` is
            true are the ones the check counts (absent for table-level checks).
        keys: ``{id(frame): column}`` naming each frame's row key, for quarantine sources.
    """

    values: dict[str, Any]
    rows: dict[str, tuple[DataFrame, Column]] = field(default_factory=dict)
    keys: dict[int, str] = field(default_factory=dict)


def _blank(name: str) -> Column:
    return F.col(name).isNull() | (F.trim(F.col(name)) == "")


def _out_of_range(ts: Column) -> Column:
    return (ts < F.lit(contract.EARLIEST_TS)) | (ts >= F.lit(contract.LATEST_TS))


def _fraction(part: int, whole: int) -> float | None:
    return None if not whole else part / whole


# --- raw_events ------------------------------------------------------------------------------

RAW_EVENTS_ROW_CHECKS = (
    "accepted_blank_event_id", "accepted_blank_client_id", "accepted_blank_user_id",
    "accepted_null_ts", "accepted_ts_out_of_range", "accepted_invalid_event_type",
    "accepted_unknown_event_type", "accepted_pageview_without_url",
    "accepted_order_without_order_id", "accepted_order_bad_amount",
    "accepted_order_unknown_currency",
)
"""The raw_events check columns that count records (one predicate each)."""


def raw_events_predicates() -> dict[str, Column]:
    """Per check column, the accepted records it counts (K1); needs an active Spark."""
    accepted = F.col("error").isNull()
    is_order = F.col("event_type") == contract.ORDER
    event_type = F.coalesce(F.col("event_type"), F.lit(""))
    return {
        "accepted_blank_event_id": accepted & _blank("event_id"),
        "accepted_blank_client_id": accepted & _blank("client_id"),
        "accepted_blank_user_id": accepted & _blank("user_id"),
        "accepted_null_ts": accepted & F.col("ts").isNull(),
        "accepted_ts_out_of_range": accepted & _out_of_range(F.col("ts")),
        "accepted_invalid_event_type": accepted & ~event_type.rlike(EVENT_TYPE_IDENTIFIER),
        "accepted_unknown_event_type": accepted & ~event_type.isin(contract.PAGEVIEW,
                                                                   contract.ORDER),
        "accepted_pageview_without_url": accepted & (F.col("event_type") == contract.PAGEVIEW)
        & _blank("url"),
        "accepted_order_without_order_id": accepted & is_order & _blank("order_id"),
        "accepted_order_bad_amount": accepted & is_order
        & (F.col("amount").isNull() | (F.col("amount") < 0)),
        "accepted_order_unknown_currency": accepted & is_order
        & ~F.coalesce(F.col("currency").isin(*sorted(contract.CURRENCIES)), F.lit(False)),
    }


def raw_events_checks(records: DataFrame) -> Checks:
    """Check results of one micro-batch of parsed records (``events.parse`` layout)."""
    predicates = raw_events_predicates()
    row = records.agg(
        F.count(F.lit(1)).alias("records"),
        F.count_if(F.col("error").isNotNull()).alias("malformed_records"),
        *(F.count_if(p).alias(name) for name, p in predicates.items()),
    ).first()
    values = row.asDict()
    values["accepted_records"] = values["records"] - values["malformed_records"]
    values["malformed_fraction"] = _fraction(values["malformed_records"], values["records"])
    return Checks(values, {name: (records, p) for name, p in predicates.items()},
                  {id(records): "source"})


# --- historical_batch ------------------------------------------------------------------------

def type_family(kind: Any) -> str:
    """The type family a suite names: string, timestamp, integer, decimal, floating, ..."""
    if isinstance(kind, StringType):
        return "string"
    if isinstance(kind, TimestampType | TimestampNTZType):
        return "timestamp"
    if isinstance(kind, IntegralType):
        return "integer"
    if isinstance(kind, DecimalType):
        return "decimal"
    if isinstance(kind, FractionalType):
        return "floating"
    if isinstance(kind, DateType):
        return "date"
    if isinstance(kind, BooleanType):
        return "boolean"
    return kind.simpleString()


def historical_batch_checks(batch: DataFrame, raw_schema: StructType, kind: str, key: str,
                            client_id: str) -> Checks:
    """Check results of a validated historical batch (``batch_input.validate_batch`` output).

    Args:
        batch: every row of the batch, typed, with ``error`` (null when valid).
        raw_schema: the batch's schema as read, before typing (for the column type checks).
        kind: ``"orders"`` or ``"pageviews"``.
        key: the key column (``order_id`` / ``event_id``).
        client_id: the client the run declares.
    """
    everyone = F.lit(True)
    predicates = {
        "blank_key_fraction": _blank(key),
        "blank_user_id_fraction": _blank("user_id"),
        "blank_client_id_fraction": _blank("client_id"),
        "bad_ts_fraction": F.col("ts").isNull() | _out_of_range(F.col("ts")),
        # Not a blank one: rows without a client were reported as another client's.
        "other_client_fraction": ~_blank("client_id") & (F.col("client_id") != client_id),
        "conflicting_duplicate_fraction": F.coalesce(F.col("error").rlike(
            r"appears \d+ times in the batch with different content$"), F.lit(False)),  # (K2)
    }
    if kind == "orders":
        predicates.update({
            "bad_amount_fraction": F.col("amount").isNull(),
            "negative_amount_fraction": F.col("amount") < 0,
            "bad_currency_fraction": ~F.coalesce(
                F.col("currency").isin(*sorted(contract.CURRENCIES)), F.lit(False)),
        })
    else:
        predicates["missing_url_fraction"] = _blank("url")
    # A row refused for a reason none of the above counts (its ts ahead of its file's time,
    # a control character, text that is not UTF-8, ...): alone, such rows passed the gate.
    counted = reduce(lambda a, b: a | b, (F.coalesce(p, F.lit(False))
                                          for p in predicates.values()))
    predicates["other_problem_fraction"] = F.col("error").isNotNull() & ~counted
    row = batch.agg(
        F.count(F.lit(1)).alias("rows_read"),
        F.count_if(F.col("error").isNotNull()).alias("rows_quarantined"),
        *(F.count_if(F.coalesce(p, F.lit(False))).alias(name) for name, p in predicates.items()),
    ).first().asDict()
    rows_read = row.pop("rows_read")
    values: dict[str, Any] = {
        "rows_read": rows_read,
        "rows_accepted": rows_read - row["rows_quarantined"],
        "rows_quarantined": row["rows_quarantined"],
        "quarantined_fraction": _fraction(row.pop("rows_quarantined"), rows_read),
        "ts_column_type": type_family(raw_schema["ts"].dataType),
        "amount_column_type": (type_family(raw_schema["amount"].dataType)
                               if kind == "orders" else None),
        "main_client_id": client_id,
    }
    # Every row bad, each fraction at most half (half blank ts, half no url): each passed.
    values["every_row_refused"] = rows_read > 0 and values["rows_accepted"] == 0
    values["main_client_fraction"] = _fraction(
        rows_read - row["other_client_fraction"] - row["blank_client_id_fraction"], rows_read)
    if row["other_client_fraction"] * 2 > rows_read:  # the declared client is not the main one
        main = batch.groupBy("client_id").count().orderBy(F.desc("count"), "client_id").first()
        values["main_client_id"] = main.client_id
        values["main_client_fraction"] = _fraction(main["count"], rows_read)
    for name in ("blank_key_fraction", "blank_user_id_fraction", "blank_client_id_fraction",
                 "bad_ts_fraction",
                 "other_client_fraction", "conflicting_duplicate_fraction",
                 "bad_amount_fraction", "negative_amount_fraction", "bad_currency_fraction",
                 "missing_url_fraction", "other_problem_fraction"):
        values[name] = _fraction(row[name], rows_read) if name in row else None
    rows = {name: (batch, F.coalesce(p, F.lit(False))) for name, p in predicates.items()}
    rows.update({"ts_column_type": (batch, everyone), "amount_column_type": (batch, everyone),
                 "main_client_id": (batch, predicates["other_client_fraction"]),
                 "every_row_refused": (batch, F.col("error").isNotNull())})
    return Checks(values, rows, {id(batch): "source"})


# --- tables_after_merge ----------------------------------------------------------------------

def backfill_app_id(run_id: str) -> str:
    """The application transaction of a backfill's merge into ``pageviews`` / ``orders``."""
    return f"backfill-{run_id}"


def merged_source(run_id: str) -> str:
    """``source`` of the rows the run's merge writes into ``pageviews`` / ``orders``: what
    finds them again once the batch's files changed or are gone (``backfill_steps`` S5)."""
    return f"backfill:{run_id}"


def quarantined_source_prefix(run_id: str) -> str:
    """How ``source`` begins in the ``quarantine`` rows of the run's batch (the batch file's
    name follows): what counts them again when the step that wrote them saved no result."""
    return f"{merged_source(run_id)}:"


def run_commit_version(tables: DeltaTables, table: str, run_id: str, *,
                       app_id: str | None = None) -> int | None:
    """Version of the newest commit to ``table`` whose metadata names ``run_id`` (K3); None
    if the run committed nothing to it.

    The recent commits first, then the whole log: a step retried beside a running stream
    (which commits every micro-batch) may find its run's commit far behind. Not finding it
    would make the gate compare the table with itself and pass whatever the merge did.

    Raises:
        VersionVacuumedError: the commit's application transaction ``app_id`` is in the
            table but the commit is no longer in its log (``delta_rs_engine`` edge case 18).
    """
    entry = tables.newest_commit(
        table, lambda e: e.get("run_id") == run_id and e.get("version") is not None)
    if entry is not None:
        return int(entry["version"])
    if app_id is not None and tables.app_version(table, app_id) is not None:
        raise VersionVacuumedError(
            f"table {table!r}: run {run_id} committed to it ({app_id}), but its log no longer "
            "holds that commit (Delta deletes commits older than the table's "
            "delta.logRetentionDuration at a checkpoint; table_maintenance keeps them as long "
            "as its vacuum retention, 30 days at least), so the table as it was before cannot "
            f"be read. {VACUUMED_WAY_FORWARD}")
    return None


def tables_after_merge_checks(tables: DeltaTables, spec: TableSpec, *, run_id: str,
                              client_id: str, batch_keys: DataFrame,
                              scope: PartitionFilter | None,
                              stored: Snapshot | None = None) -> Checks:
    """Row-count reconciliation and key uniqueness of ``spec``'s table around the merge.

    One scan of the merged range counts its rows and duplicated keys; the batch's keys are
    joined with the keys stored before only if there were any.

    Args:
        tables: the warehouse.
        spec: ``PAGEVIEWS`` or ``ORDERS``.
        run_id: the backfill's run id (the merge commit carries it in its metadata).
        client_id: the batch's client.
        batch_keys: one column, the key, one row per key: the batch's accepted keys.
        scope: the partitions the merge may touch (client, and for pageviews the batch's days);
            None when it could touch none (a pageview batch without a row).
        stored: the table's rows in ``scope`` at the merge commit, already read (a
            ``corrections.Snapshot``, kept for the recompute), or None to read them here.
    """
    key = spec.key[0]
    values = {"rows_before": 0, "batch_keys": batch_keys.count(), "keys_already_stored": 0,
              "copies_replaced": 0, "rows_after": 0, "duplicate_keys": 0}
    checks = Checks(values)
    if scope is None or not tables.exists(spec.name):
        values["expected_rows_after"] = values["batch_keys"]
        values["table"] = spec.name
        return checks
    # The caller's rows were read at the merge commit: no second search of the history.
    merged = stored.version if stored is not None else run_commit_version(
        tables, spec.name, run_id, app_id=backfill_app_id(run_id))
    after_version = merged if merged is not None else tables.version(spec.name)
    before_version = after_version - 1 if merged is not None else after_version
    whole = (stored.rows if stored is not None
             else tables.read(spec.name, None, scope, version=after_version))
    after = whole.select(key)
    before = (tables.read(spec.name, [key], scope, version=before_version)
              if before_version >= 0 else None)
    values["rows_before"] = before.count() if before is not None else 0

    def counted(ident: Column) -> tuple[int, int, int]:
        """(rows after, keys stored twice, batch keys stored before): one scan of each."""
        rows, duplicated = after.groupBy(ident.alias("_id")).count().agg(
            F.sum("count"), F.count_if(F.col("count") > 1)).first()
        stored = 0
        if values["rows_before"]:
            stored = batch_keys.select(ident.alias("_id")).join(
                before.select(ident.alias("_id")), "_id", "left_semi").count()
        return int(rows or 0), int(duplicated or 0), stored

    def expected(stored: int, copies: int = 0) -> int:
        """Each batch key adds a row unless stored before; replaced copies go (one per key
        stays)."""
        return values["rows_before"] + values["batch_keys"] - stored - copies

    rows, duplicated, stored = counted(F.xxhash64(key))
    copies = 0
    if duplicated or rows != expected(stored):
        rows, duplicated, stored = counted(F.col(key))  # (K6) exactly
        if spec.name == ORDERS.name and before is not None and rows != expected(stored):
            # The upsert replaced every stored copy of an order it updated: one stored twice
            # before (a new checkpoint's replay, Known limits) failed this gate at every rerun.
            # Only of those it wrote (its rows carry the run's source): one the batch sent as
            # stored is not written, its copies stay, and counted, they failed it too.
            written = whole.where(F.col("source") == merged_source(run_id)).select(
                key).distinct()
            copies = (before.join(written, key, "left_semi").count()
                      - written.join(before, key, "left_semi").count())
    values.update(rows_after=rows, duplicate_keys=duplicated, keys_already_stored=stored,
                  copies_replaced=copies, expected_rows_after=expected(stored, copies))
    values["table"] = spec.name
    if duplicated:
        twice = after.groupBy(key).count().where(F.col("count") > 1).select(key)
        if before is not None:  # only keys the merge stored twice: one stored twice before
            # (a new checkpoint's replay, Known limits) failed every later backfill of its
            # days, its reruns too, since they check the merge commit's snapshot again.
            twice = twice.join(before.groupBy(key).count().where(F.col("count") > 1)
                               .select(key), key, "left_anti")
        values["duplicate_keys"] = duplicated = twice.count()  # a rare path: computed again
    if duplicated:  # whole rows, for the quarantine
        offending = whole.join(twice, key, "left_semi")
        checks.rows["duplicate_keys"] = (offending, F.lit(True))
        checks.keys[id(offending)] = key
    return checks


# --- recomputed_sessions ---------------------------------------------------------------------

@contextmanager
def _join_on_partitioning_by_a_subset_of_keys(spark: SparkSession) -> Iterator[None]:
    """Let a join keep its sides' partitioning by some of its keys (both sides hashed the
    same way) instead of shuffling both again by all of them. Spark asks for all keys by
    default because fewer can skew; here the window already partitions by (client, user), so
    the join adds no skew of its own. Restored afterwards."""
    name = "spark.sql.requireAllClusterKeysForCoPartition"
    before = spark.conf.get(name)
    spark.conf.set(name, "false")
    try:
        yield
    finally:
        spark.conf.set(name, before)


def recomputed_sessions_checks(*, gap_ms: int, sessions: DataFrame, attributions: DataFrame,
                               orders: DataFrame) -> Checks:
    """Invariants of the recomputed sessions and attributions of the affected windows.

    One Spark job: the user's previous session by a window, the attributed orders per
    session (count, amount, earliest and latest ts) by an aggregation, and a full outer join of
    the two on (client, user, session), so orders attributed to a session that is not there,
    or is another user's, show up too. (Stacking the totals under the sessions to share one
    partitioning by user, with a second window instead of the join, measured slower: 18.4 s
    against 15.0 s on the full-scale benchmark's 2.57M sessions.)

    Args:
        gap_ms: the session gap.
        sessions: recomputed sessions (``SESSIONS`` columns, revision not needed).
        attributions: recomputed attributions (``ATTRIBUTIONS`` columns, no revision).
        orders: the stored orders the recompute attributed (``ORDERS`` columns, at least
            the keys below and ``amount``): their amounts are what the revenue must add up to.

    An attribution meets its own order by (client, user, order id, time): the tables may hold
    one ``order_id`` twice in a client (another user's, or another day's: README, Known
    limits), and a join by the id alone counted both copies in each session. The time in
    whole milliseconds, as sessions keep it (an attribution's ``order_ts``): an order's ``ts``
    may hold microseconds. Copies of one order at one place (an earlier version stored some
    twice, README, Known limits) count once, with the amount ``semantics`` E6 keeps (the
    smallest); counted twice, they failed every correction of that user's window.
    """
    place = ["client_id", "user_id", "order_id", "order_ts"]
    attributed = attributions.where(F.col("session_id").isNotNull()).join(
        orders.select("client_id", "user_id", "order_id",
                      F.timestamp_millis(F.unix_millis("ts")).alias("order_ts"), "amount")
        .groupBy(*place).agg(F.min("amount").alias("amount")),  # partitioned as the join
        place, "left"
    ).repartition("client_id", "user_id")  # as the window below: the join needs no shuffle
    totals = attributed.groupBy("client_id", "user_id", "session_id").agg(
        F.count(F.lit(1)).alias("_orders"), F.sum("amount").alias("_revenue"),
        F.min("order_ts").alias("_first_order"), F.max("order_ts").alias("_last_order"))
    # A session_id is a function of (client, user, start): two sessions with one id sit next
    # to each other in their user's order, so one window finds duplicates and overlaps.
    by_user = Window.partitionBy("client_id", "user_id").orderBy("session_start", "session_id")
    joined = (sessions
              .withColumn("_previous_end", F.lag("session_end").over(by_user))
              .withColumn("_previous_id", F.lag("session_id").over(by_user))
              .withColumn("_session", F.lit(True))
              .join(totals, ["client_id", "user_id", "session_id"], "full_outer"))
    is_session = F.col("_session").isNotNull()
    previous = F.col("_previous_end")
    checks = {
        # The comparisons below are null, so not counted, for a session without these.
        "sessions_without_id_or_bounds": is_session & (
            F.col("session_id").isNull() | F.col("session_start").isNull()
            | F.col("session_end").isNull()),
        "session_start_after_end": is_session & (F.col("session_start") > F.col("session_end")),
        "pageview_count_below_one": is_session & F.coalesce(F.col("pageview_count") < 1,
                                                            F.lit(True)),
        "duplicate_session_ids": is_session & (F.col("_previous_id") == F.col("session_id")),
        "overlapping_sessions": is_session & previous.isNotNull()
        & (F.col("session_start") <= previous),  # (K4)
        "sessions_within_gap": is_session & previous.isNotNull()
        & (F.unix_millis("session_start") - F.unix_millis(previous) < gap_ms),
        "revenue_mismatch": is_session & ~F.col("revenue").eqNullSafe(
            F.coalesce(F.col("_revenue"), F.lit(0))),
        "order_count_mismatch": is_session & ~F.col("order_count").eqNullSafe(
            F.coalesce(F.col("_orders"), F.lit(0))),
        "sessions_with_orders_outside": is_session & F.col("_orders").isNotNull() & (
            (F.col("_first_order") < F.col("session_start"))
            | (F.unix_millis("_last_order") >= F.unix_millis("session_end") + gap_ms)),
        "attributions_to_unknown_sessions": ~is_session,
    }
    predicates = {name: F.coalesce(p, F.lit(False)) for name, p in checks.items()}
    counted = joined.agg(
        F.count_if(is_session).alias("sessions"),
        F.sum(F.when(~is_session, F.col("_orders")).otherwise(0)).alias(
            "attributions_to_unknown_sessions"),
        *(F.count_if(p).alias(name) for name, p in predicates.items()
          if name != "attributions_to_unknown_sessions"),
    )
    with _join_on_partitioning_by_a_subset_of_keys(counted.sparkSession):
        row = counted.first().asDict()
    values = {name: int(value or 0) for name, value in row.items()}
    shown = joined.drop("_previous_id", "_session")
    return Checks(values, {name: (shown, p) for name, p in predicates.items()},
                  {id(shown): "session_id"})


# --- publish ---------------------------------------------------------------------------------

def topic_ends(config: Config, topics: Sequence[str]) -> dict[str, dict[int, int]]:
    """The next offset to be written, per partition of each topic (K5)."""
    from clickstream.io.kafka_topics import topic_watermarks

    return {topic: {p: high for p, (_low, high) in topic_watermarks(config, topic).items()}
            for topic in topics}


def read_published(config: Config, since: Mapping[str, Mapping[int, int]]
                   ) -> dict[str, AbstractSet[tuple[str, int | None]]]:
    """Per topic, the (key, revision) of each key's last record written after ``since``
    (revision None = tombstone): what a compacted reader keeps of the range (K5). A key
    lives in one partition, whose records come in offset order, so the last one read wins.
    Returned as the pairs of one dict (a set view): at a million records per-key sets of
    revisions cost more than reading them."""
    from clickstream.io.kafka_clients import gc_paused
    from clickstream.io.kafka_read import PUBLISHED_LOSS_ADVICE, read_offset_ranges

    now = topic_ends(config, list(since))
    seen: dict[str, AbstractSet[tuple[str, int | None]]] = {}
    with gc_paused():
        for topic, ends in now.items():
            last: dict[str, int | None] = {}
            ranges = {p: (since[topic].get(p, 0), end) for p, end in ends.items()}
            for batch in read_offset_ranges(  # one consumer per topic
                    config, topic, ranges, advice=PUBLISHED_LOSS_ADVICE):
                last.update((key.decode(), _revision(message.value()))
                            for message in batch if (key := message.key()) is not None)
            seen[topic] = last.items()
    return seen


_REVISION = b'"revision":'


def _revision(value: bytes | None) -> int | None:
    """The ``revision`` of a changelog value; None for a tombstone.

    Found by the last ``"revision":`` in the bytes, not by parsing the JSON (a third of the
    gate's time at a million records): the producer writes compact JSON in which a quote
    inside a string is always escaped, so the sequence can only be the top-level key (K5).
    Anything unexpected falls back to parsing."""
    if value is None:
        return None
    at = value.rfind(_REVISION)
    if at >= 0:
        digits = value[at + len(_REVISION):].split(b",", 1)[0].rstrip(b"}")
        if digits.lstrip(b"-").isdigit():
            return int(digits)
    return json.loads(value).get("revision")


def publish_checks(changes: DataFrame, config: Config,
                   published: Mapping[str, AbstractSet[tuple[str, int | None]]]) -> Checks:
    """What the run's plan (``corrections`` rows) says was published vs what the topics hold."""
    from clickstream.io.kafka_clients import gc_paused

    sessions_seen = published.get(config.sessions_topic, set())
    attributions_seen = published.get(config.attributions_topic, set())
    missing: dict[str, list[str]] = {"sessions_missing_at_revision": [],
                                     "retractions_without_tombstone": [],
                                     "attributions_missing_at_revision": []}
    counts = {"session": 0, "attribution": 0}
    plan = changes.select("entity", "key", "change", "new_revision").toArrow().to_pydict()
    with gc_paused():
        for entity, key, change, revision in zip(plan["entity"], plan["key"], plan["change"],
                                                 plan["new_revision"], strict=True):
            counts[entity] = counts.get(entity, 0) + 1
            if entity == "session" and change == "retracted":
                if (key, None) not in sessions_seen:
                    missing["retractions_without_tombstone"].append(key)
            elif entity == "session":
                if (key, revision) not in sessions_seen:
                    missing["sessions_missing_at_revision"].append(key)
            elif (key, revision) not in attributions_seen:
                missing["attributions_missing_at_revision"].append(key)
    if missing["attributions_missing_at_revision"]:
        missing["attributions_missing_at_revision"] = _copies_unpublished(
            plan, missing["attributions_missing_at_revision"], attributions_seen)
    values: dict[str, Any] = {"session_changes": counts["session"],
                              "attribution_changes": counts["attribution"]}
    values.update({name: len(keys) for name, keys in missing.items()})
    entity = {"sessions_missing_at_revision": "session", "retractions_without_tombstone":
              "session", "attributions_missing_at_revision": "attribution"}
    rows = {name: (changes, (F.col("entity") == entity[name]) & F.col("key").isin(keys))
            for name, keys in missing.items() if keys}
    return Checks(values, rows, {id(changes): "key"})


def _copies_unpublished(plan: Mapping[str, list[Any]], keys: list[str],
                        seen: AbstractSet[tuple[str, int | None]]) -> list[str]:
    """Of ``keys`` (attributions not on the topic at their planned revision), those whose last
    record is at none of the key's planned revisions. A key with copies (an order id two users
    hold, ``corrections`` C14) has a row per copy, each at its own revision, and the topic
    keeps one record per key: checked row by row, such a plan could never pass."""
    wanted = set(keys)
    planned: dict[str, set[int | None]] = {}
    for entity, key, revision in zip(plan["entity"], plan["key"], plan["new_revision"],
                                     strict=True):
        if entity == "attribution" and key in wanted:
            planned.setdefault(key, set()).add(revision)
    return [key for key in dict.fromkeys(keys)
            if not any((key, revision) in seen for revision in planned[key])]
