"""The streaming adapter: applies ``semantics`` inside Spark's ``transformWithStateInPandas``.

State is keyed by a *bucket* of users (a hash of client_id/user_id), not by user: Spark calls
the processor once per bucket with a pandas frame of many users, and ``semantics`` works on it
vectorised. Per-user keys would cost a state round trip per user per batch (measured: ~10k
events/s); buckets keep the number of calls small and constant.

A bucket's state holds only what the watermark has not closed: the pageviews of open sessions
and the orders not emitted yet, each as one Arrow blob. On every call the processor
re-sessionizes state + new rows with the same function the batch recompute uses, emits the
sessions the watermark closes (with their attributions) and keeps the rest. So the stream equals
the batch by construction, and state stays bounded by the watermark.

Known edge cases, cited inline as (S1)..(S3):
  S1. Within one micro-batch a bucket's input is complete, so anything the batch's watermark
      already closes is emitted right away instead of waiting for a timer.
  S2. A record whose id is already in the state (a retry of an on-time event) is reported as a
      ``duplicate`` row, so the sink does not store it twice; copies inside one batch are
      collapsed here and de-duplicated by id in the sink as well.
  S3. Rows at or before the previous batch's watermark never reach the processor (Spark drops
      them); the sink stores them and queues them for the recompute.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from clickstream.sessions.semantics import (
    ORDER_COLUMNS,
    PAGEVIEW_COLUMNS,
    closed_sessions,
    dedupe,
    empty_orders,
    empty_pageviews,
    next_wakeup,
    sessionize,
)

# Input columns the processor expects (times in epoch ms, amounts in 1/10000).
INPUT_COLUMNS = ("bucket", "client_id", "user_id", "event_type", "event_id", "ts_ms", "url",
                 "order_id", "amount_e4", "currency")

OUTPUT_SCHEMA = StructType([
    StructField("kind", StringType(), False),  # session | attribution | duplicate
    StructField("client_id", StringType(), False),
    StructField("user_id", StringType(), False),
    StructField("session_id", StringType(), True),
    StructField("start_ms", LongType(), True),
    StructField("end_ms", LongType(), True),
    StructField("pageview_count", IntegerType(), True),
    StructField("landing_url", StringType(), True),
    StructField("exit_url", StringType(), True),
    StructField("order_count", IntegerType(), True),
    StructField("revenue_e4", LongType(), True),
    StructField("record_id", StringType(), True),  # order_id (attribution) or duplicate's id
    StructField("record_ts_ms", LongType(), True),
])
OUTPUT_COLUMNS = OUTPUT_SCHEMA.fieldNames()
STATE_SCHEMA = StructType([StructField("blob", BinaryType(), True)])


def encode_frame(frame: pd.DataFrame) -> bytes:
    """Compact Arrow IPC bytes of a state frame."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    return sink.getvalue()


def decode_frame(blob: bytes | None, empty: pd.DataFrame) -> pd.DataFrame:
    if not blob:
        return empty
    with pa.ipc.open_stream(io.BytesIO(blob)) as reader:
        return reader.read_all().to_pandas()


def _output(frame: pd.DataFrame) -> pd.DataFrame:
    for column in OUTPUT_COLUMNS:
        if column not in frame:
            frame[column] = None
    return frame[OUTPUT_COLUMNS]


class BucketState:
    """Open pageviews and unemitted orders of one bucket, and what one call emits."""

    def __init__(self, pageviews: pd.DataFrame, orders: pd.DataFrame) -> None:
        self.pageviews = pageviews
        self.orders = orders

    def add(self, events: pd.DataFrame) -> pd.DataFrame:
        """Fold new events in; returns the ``duplicate`` rows of records already held (S2)."""
        is_order = (events["event_type"] == "order").to_numpy()
        new_pv = dedupe(events.loc[~is_order, PAGEVIEW_COLUMNS], "event_id")
        new_orders = dedupe(events.loc[is_order, ORDER_COLUMNS], "order_id")
        pv_dup = new_pv["event_id"].isin(self.pageviews["event_id"]).to_numpy()
        order_dup = new_orders["order_id"].isin(self.orders["order_id"]).to_numpy()
        duplicates = pd.concat([
            pd.DataFrame({"client_id": new_pv["client_id"][pv_dup],
                          "user_id": new_pv["user_id"][pv_dup],
                          "record_id": new_pv["event_id"][pv_dup],
                          "record_ts_ms": new_pv["ts_ms"][pv_dup]}),
            pd.DataFrame({"client_id": new_orders["client_id"][order_dup],
                          "user_id": new_orders["user_id"][order_dup],
                          "record_id": new_orders["order_id"][order_dup],
                          "record_ts_ms": new_orders["ts_ms"][order_dup]}),
        ], ignore_index=True)
        duplicates["kind"] = "duplicate"
        self.pageviews = pd.concat([self.pageviews, new_pv[~pv_dup]], ignore_index=True)
        self.orders = pd.concat([self.orders, new_orders[~order_dup]], ignore_index=True)
        return duplicates

    def close(self, watermark_ms: int, gap_ms: int) -> tuple[pd.DataFrame, int | None]:
        """Emit what the watermark closes (E7); keep the rest. Returns (rows, next wakeup)."""
        result = sessionize(self.pageviews, self.orders, gap_ms)
        sessions = result.sessions
        closed = closed_sessions(sessions, watermark_ms, gap_ms)
        closed_ids = set(sessions["session_id"][closed])
        attributions = result.attributions
        session_of_order = attributions["session_id"]
        in_closed = session_of_order.isin(closed_ids).to_numpy()
        uncovered = session_of_order.isna().to_numpy()
        final_uncovered = uncovered & (attributions["ts_ms"].to_numpy() <= watermark_ms)
        emitted_sessions = sessions[closed].assign(kind="session")
        emitted_orders = attributions[in_closed | final_uncovered].rename(
            columns={"order_id": "record_id", "ts_ms": "record_ts_ms"}).assign(kind="attribution")
        keep_pv = ~result.pageview_session.isin(closed_ids).to_numpy()
        self.pageviews = self.pageviews[keep_pv].reset_index(drop=True)
        emitted_order_ids = set(emitted_orders["record_id"])
        self.orders = self.orders[~self.orders["order_id"].isin(emitted_order_ids)]
        self.orders = self.orders.reset_index(drop=True)
        open_sessions = sessions[~closed]
        pending = attributions[uncovered & ~final_uncovered]
        rows = pd.concat([emitted_sessions, emitted_orders], ignore_index=True)
        return rows, next_wakeup(open_sessions, pending, gap_ms)


class SessionProcessor(StatefulProcessor):
    """``transformWithStateInPandas`` processor keyed by user bucket, event-time mode."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.pageview_state = handle.getValueState("open_pageviews", STATE_SCHEMA)
        self.order_state = handle.getValueState("open_orders", STATE_SCHEMA)

    def _load(self) -> BucketState:
        pv = self.pageview_state.get() if self.pageview_state.exists() else None
        orders = self.order_state.get() if self.order_state.exists() else None
        return BucketState(decode_frame(pv[0] if pv else None, empty_pageviews()),
                           decode_frame(orders[0] if orders else None, empty_orders()))

    def _save(self, state: BucketState, wakeup: int | None, watermark_ms: int) -> None:
        for holder, frame in ((self.pageview_state, state.pageviews),
                              (self.order_state, state.orders)):
            if len(frame):
                holder.update((encode_frame(frame),))
            else:
                holder.clear()
        for timer in list(self.handle.listTimers()):
            if timer > watermark_ms and timer != wakeup:  # expired ones are gone already
                self.handle.deleteTimer(timer)
        if wakeup is not None and wakeup not in set(self.handle.listTimers()):
            self.handle.registerTimer(wakeup)

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        state = self._load()
        events = pd.concat(list(rows), ignore_index=True)
        events["ts_ms"] = events["ts_ms"].astype(np.int64)
        events["amount_e4"] = events["amount_e4"].fillna(0).astype(np.int64)
        duplicates = state.add(events)
        watermark = timerValues.getCurrentWatermarkInMs()
        emitted, wakeup = state.close(watermark, self.gap_ms)  # (S1)
        self._save(state, wakeup, watermark)
        yield _output(pd.concat([duplicates, emitted], ignore_index=True))

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        state = self._load()
        watermark = timerValues.getCurrentWatermarkInMs()
        emitted, wakeup = state.close(watermark, self.gap_ms)
        self._save(state, wakeup, watermark)
        yield _output(emitted)

    def close(self) -> None:
        """No resources to release."""
