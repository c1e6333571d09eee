"""The batch adapter: applies ``semantics`` to Spark DataFrames (the recompute's path).

Rows are grouped by the same user bucket as the stream, and each bucket's pageviews and orders
go through ``semantics.sessionize`` / ``semantics.reattribute`` in one vectorised call, so the
recompute and the stream share one definition of a session and of its orders.
"""

from __future__ import annotations

import pandas as pd
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType

from clickstream.sessions.semantics import (
    AMOUNT_SCALE,
    ORDER_COLUMNS,
    PAGEVIEW_COLUMNS,
    reattribute,
    sessionize,
)
from clickstream.sessions.stream_adapter import OUTPUT_COLUMNS, OUTPUT_SCHEMA, exact_revenue
from clickstream.tables import AMOUNT_TYPE


def user_bucket(buckets: int) -> Column:
    """Bucket of a (client_id, user_id): the same hash the stream uses."""
    return F.pmod(F.xxhash64("client_id", "user_id"), F.lit(buckets))


def amount_from_e4(column: str) -> Column:
    """An amount (or revenue) in 1/10000 as the tables' DECIMAL, exactly: ``/`` on a long
    gives a double (~16 significant digits), which rounded 99999999999999.9999 up to 10**14."""
    return (F.col(column).cast(DecimalType(19, 0)) / F.lit(AMOUNT_SCALE)).cast(AMOUNT_TYPE)


def no_amount() -> Column:
    """The amount of a row without one: 0, not null. Amounts in 1/10000 reach pandas through
    Arrow, and a long column holding a null arrives as float64, exact only below 2**53
    (amounts below ~9e11)."""
    return F.lit(0).cast("long")


def _pageview_input(pageviews: DataFrame, buckets: int) -> DataFrame:
    return pageviews.select(
        user_bucket(buckets).alias("bucket"), F.lit("pageview").alias("kind"), "client_id",
        "user_id", F.col("event_id").alias("record_id"), F.unix_millis("ts").alias("ts_ms"),
        "url", no_amount().alias("amount_e4"),
        F.lit(None).cast("string").alias("currency"),
        F.lit(None).cast("string").alias("session_id"), F.lit(None).cast("long").alias("start_ms"),
        F.lit(None).cast("long").alias("end_ms"))


def _order_input(orders: DataFrame, buckets: int) -> DataFrame:
    return orders.select(
        user_bucket(buckets).alias("bucket"), F.lit("order").alias("kind"), "client_id",
        "user_id", F.col("order_id").alias("record_id"), F.unix_millis("ts").alias("ts_ms"),
        F.lit(None).cast("string").alias("url"),
        (F.col("amount") * AMOUNT_SCALE).cast("long").alias("amount_e4"), "currency",
        F.lit(None).cast("string").alias("session_id"), F.lit(None).cast("long").alias("start_ms"),
        F.lit(None).cast("long").alias("end_ms"))


def _session_input(sessions: DataFrame, buckets: int) -> DataFrame:
    return sessions.select(
        user_bucket(buckets).alias("bucket"), F.lit("session").alias("kind"), "client_id",
        "user_id", F.lit(None).cast("string").alias("record_id"),
        F.lit(None).cast("long").alias("ts_ms"), F.lit(None).cast("string").alias("url"),
        no_amount().alias("amount_e4"), F.lit(None).cast("string").alias("currency"),
        "session_id", F.unix_millis("session_start").alias("start_ms"),
        F.unix_millis("session_end").alias("end_ms"),
        F.col("order_count").cast("long").alias("order_count"),
        (F.col("revenue") * AMOUNT_SCALE).cast("long").alias("revenue_e4"))


def _split(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    pageviews = frame[frame["kind"] == "pageview"].rename(columns={"record_id": "event_id"})
    orders = frame[frame["kind"] == "order"].rename(columns={"record_id": "order_id"})
    pageviews = pageviews[PAGEVIEW_COLUMNS].astype({"ts_ms": "int64"})
    orders = orders[ORDER_COLUMNS].astype({"ts_ms": "int64", "amount_e4": "int64"})
    return pageviews, orders


def _as_output(sessions: pd.DataFrame, attributions: pd.DataFrame) -> pd.DataFrame:
    rows = [
        exact_revenue(sessions).assign(kind="session"),
        attributions.rename(columns={"order_id": "record_id", "ts_ms": "record_ts_ms"})
        .assign(kind="attribution"),
    ]
    out = pd.concat([r for r in rows if len(r)], ignore_index=True) if any(
        len(r) for r in rows) else pd.DataFrame(columns=OUTPUT_COLUMNS)
    for column in OUTPUT_COLUMNS:
        if column not in out:
            out[column] = None
    return out[OUTPUT_COLUMNS]


def sessionize_frames(pageviews: DataFrame, orders: DataFrame, gap_ms: int,
                      buckets: int) -> DataFrame:
    """From-scratch sessions and attributions of every user in the inputs.

    ``pageviews`` needs client_id, user_id, event_id, ts, url; ``orders`` client_id, user_id,
    order_id, ts, amount, currency. Returns rows in the stream's output layout
    (``kind`` = session | attribution), so both paths feed the same writers.
    """

    def apply(frame: pd.DataFrame) -> pd.DataFrame:
        page, order = _split(frame)
        result = sessionize(page, order, gap_ms)
        return _as_output(result.sessions, result.attributions)

    data = _pageview_input(pageviews, buckets).unionByName(_order_input(orders, buckets))
    return data.groupBy("bucket").applyInPandas(apply, schema=OUTPUT_SCHEMA)


def reattribute_frames(sessions: DataFrame, orders: DataFrame, gap_ms: int,
                       buckets: int) -> DataFrame:
    """Each order's session among the given stored sessions (boundaries unchanged: orders
    never move them, so an orders-only correction needs no pageviews), and the new
    ``order_count`` / ``revenue_e4`` of the sessions where they change. Session rows carry only
    those and the session's identity (client, user, id, start, end): the caller keeps the rest
    of each session, and its stored totals where no row says otherwise (most sessions of a
    large window keep theirs, and not sending them back through Arrow is most of the cost)."""

    def apply(frame: pd.DataFrame) -> pd.DataFrame:
        stored = frame[frame["kind"] == "session"]
        known = stored[["client_id", "user_id", "session_id", "start_ms", "end_ms"]].astype(
            {"start_ms": "int64", "end_ms": "int64"})
        _, order = _split(frame)
        totals, attributions = reattribute(known, order, gap_ms)  # rows in ``known``'s order
        columns = ["order_count", "revenue_e4"]
        changed = (totals[columns].to_numpy()
                   != stored[columns].astype("int64").to_numpy()).any(axis=1)
        return _as_output(totals[changed], attributions)

    data = _session_input(sessions, buckets).unionByName(_order_input(orders, buckets).withColumns(
        {"order_count": no_amount(), "revenue_e4": no_amount()}))  # no nulls: see no_amount
    return data.groupBy("bucket").applyInPandas(apply, schema=OUTPUT_SCHEMA)
