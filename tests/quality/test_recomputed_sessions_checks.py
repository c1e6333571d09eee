"""Each ``recomputed_sessions`` check counts exactly the crafted defect it names, and nothing
on well-formed sessions (the gate's end-to-end behaviour is in test_gates_batch)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructField, StructType

from clickstream.quality.checks import recomputed_sessions_checks
from clickstream.tables import ATTRIBUTIONS, ORDERS, SESSIONS

GAP_MS = 30 * 60_000
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def session(user: str, sid: str, start: float, end: float, pageviews: int = 1,
            orders: int = 0, revenue: str = "0") -> dict:
    return {"session_id": sid, "client_id": "c", "user_id": user, "session_start": at(start),
            "session_end": at(end), "pageview_count": pageviews, "landing_url": "/",
            "exit_url": "/", "order_count": orders, "revenue": Decimal(revenue),
            "session_date": at(start).date(), "revision": 1}


def order(user: str, order_id: str, minutes: float, amount: str, sid: str | None) -> tuple:
    ts = at(minutes)
    return ({"order_id": order_id, "client_id": "c", "user_id": user, "ts": ts,
             "amount": Decimal(amount), "currency": "EUR", "event_id": None,
             "source": "test", "event_date": ts.date()},
            {"order_id": order_id, "client_id": "c", "user_id": user, "order_ts": ts,
             "session_id": sid, "order_date": ts.date(), "revision": 1})


def frames(spark: SparkSession, sessions: list[dict], orders: list[tuple]
           ) -> dict[str, DataFrame]:
    def frame(rows: list[dict], spec) -> DataFrame:
        # nullable, as a recomputed frame's columns are: the gate sees them before the write
        schema = StructType([StructField(f.name, f.dataType) for f in spec.schema.fields])
        return spark.createDataFrame([tuple(r[f.name] for f in schema.fields)
                                      for r in rows], schema).drop("revision")

    return {"sessions": frame(sessions, SESSIONS),
            "orders": frame([o for o, _ in orders], ORDERS),
            "attributions": frame([a for _, a in orders], ATTRIBUTIONS)}


def values(spark: SparkSession, sessions: list[dict], orders: list[tuple]) -> dict[str, int]:
    return recomputed_sessions_checks(gap_ms=GAP_MS, **frames(spark, sessions, orders)).values


GOOD_SESSIONS = [session("u1", "a", 0, 10, orders=2, revenue="15.50"),
                 session("u1", "b", 60, 70),
                 session("u2", "c", 0, 0)]
GOOD_ORDERS = [order("u1", "o1", 5, "10.00", "a"), order("u1", "o2", 39, "5.50", "a"),
               order("u2", "o3", 500, "1.00", None)]


def test_well_formed_sessions_pass_every_check(spark: SparkSession) -> None:
    assert values(spark, GOOD_SESSIONS, GOOD_ORDERS) == {
        "sessions": 3, "sessions_without_id_or_bounds": 0, "session_start_after_end": 0,
        "pageview_count_below_one": 0,
        "duplicate_session_ids": 0, "overlapping_sessions": 0, "sessions_within_gap": 0,
        "revenue_mismatch": 0, "order_count_mismatch": 0, "sessions_with_orders_outside": 0,
        "attributions_to_unknown_sessions": 0}


def test_one_order_id_of_two_users_or_two_days_is_each_sessions_own_order(
        spark: SparkSession) -> None:
    """The tables may hold an order_id twice in a client (README, Known limits): joined by the
    id alone, each session counted both copies, and the gate refused every full recompute of
    such a client."""
    sessions = [session("u1", "a", 0, 10, orders=1, revenue="10.00"),
                session("u1", "b", 2000, 2010, orders=1, revenue="4.00"),
                session("u2", "c", 0, 10, orders=1, revenue="7.00")]
    orders = [order("u1", "o1", 5, "10.00", "a"), order("u1", "o1", 2005, "4.00", "b"),
              order("u2", "o1", 5, "7.00", "c")]
    got = values(spark, sessions, orders)
    assert (got["revenue_mismatch"], got["order_count_mismatch"]) == (0, 0), got


def test_an_order_stored_with_microseconds_meets_its_attribution_in_milliseconds(
        spark: SparkSession) -> None:
    """Sessions keep times in whole milliseconds (an attribution's order_ts); a stored order's
    ts may hold microseconds, and joined on the exact time its amount was left out."""
    stored, attribution = order("u1", "o1", 5, "10.00", "a")
    stored = {**stored, "ts": stored["ts"] + timedelta(microseconds=500)}
    got = values(spark, [session("u1", "a", 0, 10, orders=1, revenue="10.00")],
                 [(stored, attribution)])
    assert (got["revenue_mismatch"], got["order_count_mismatch"]) == (0, 0), got


def test_each_defect_is_counted_by_its_check(spark: SparkSession) -> None:
    sessions = [
        session("u1", "backwards", 10, 5),
        session("u2", "empty", 0, 5, pageviews=0),
        session("u3", "twice", 0, 5), session("u3", "twice", 0, 5),
        session("u4", "first", 0, 20), session("u4", "overlaps", 10, 15),
        session("u5", "early", 0, 10), session("u5", "too-close", 30, 40),
        session("u6", "short-revenue", 0, 10, orders=1, revenue="9.00"),
        session("u7", "one-too-many", 0, 10, orders=2, revenue="3.00"),
        session("u8", "late-order", 0, 10, orders=1, revenue="1.00"),
        # each of its fields missing, alone (no other check counts these: their comparisons
        # with a null are null)
        {**session("u10", "no-start", 0, 5), "session_start": None},
        {**session("u11", "no-end", 0, 5), "session_end": None},
        {**session("u12", "no-id", 0, 5), "session_id": None},
    ]
    orders = [
        order("u6", "o6", 1, "10.00", "short-revenue"),
        order("u7", "o7", 1, "3.00", "one-too-many"),
        order("u8", "o8", 40, "1.00", "late-order"),  # end + gap = 40: outside
        order("u9", "o9a", 1, "1.00", "ghost"), order("u9", "o9b", 2, "1.00", "ghost"),
        order("u9", "o9c", 3, "1.00", "early"),  # another user's session: unknown to u9
    ]
    got = values(spark, sessions, orders)
    assert got == {
        "sessions": 14, "sessions_without_id_or_bounds": 3, "session_start_after_end": 1,
        "pageview_count_below_one": 1,
        "duplicate_session_ids": 1,
        # a duplicate overlaps its twin, and an overlap is closer than a gap too
        "overlapping_sessions": 2, "sessions_within_gap": 3,
        "revenue_mismatch": 1, "order_count_mismatch": 1, "sessions_with_orders_outside": 1,
        "attributions_to_unknown_sessions": 3}


def test_the_checks_leave_the_sessions_join_setting_as_it_was(spark: SparkSession) -> None:
    name = "spark.sql.requireAllClusterKeysForCoPartition"  # turned off for the checks' join
    before = spark.conf.get(name)
    values(spark, GOOD_SESSIONS, GOOD_ORDERS)
    assert spark.conf.get(name) == before
