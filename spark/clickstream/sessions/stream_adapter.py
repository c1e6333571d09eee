"""The streaming adapter: applies ``semantics`` inside Spark's ``transformWithStateInPandas``.

State is keyed by a *bucket* of users (a hash of client_id/user_id), not by user: Spark calls
the processor once per bucket with a pandas frame of many users, and ``semantics`` works on it
vectorised. Per-user keys would cost a state round trip per user per batch (measured: ~10k
events/s); buckets keep the number of calls small and constant.

A bucket's state holds only what the watermark has not closed, as Arrow blobs: its open
sessions as spans (one summary row per session, not its pageviews), the orders not emitted
yet, and the ids of pageviews newer than the watermark (the only ones an on-time duplicate can
repeat), stored by minute of event time so that a call reads and rewrites only the minutes its
input falls in (S6). Each call merges the new pageviews into the spans with the function the
batch recompute builds its sessions with (``semantics.merge_spans``), emits the sessions the
watermark closes (with their attributions) and keeps the rest. So the stream equals the batch
by construction, and a call's work grows with its input and the open sessions, not with every
open pageview.

Known edge cases, cited inline as (S1)..(S6):
  S1. Within one micro-batch a bucket's input is complete, so anything the batch's watermark
      already closes is emitted right away instead of waiting for a timer.
  S2. A record whose id is already in the state (a retry of an on-time event) is reported as a
      ``duplicate`` row, so the sink does not store it twice; copies inside one batch are
      collapsed here and de-duplicated by id in the sink as well.
  S3. Rows at or before the previous batch's watermark never reach the processor (Spark drops
      them); the sink stores them and queues them for the recompute. So a pageview id is kept
      only while its ts is after the current watermark: no later copy of it can arrive on time.
  S4. Checkpoints written before spans held each open pageview in ``open_pageviews``; the first
      call for such a bucket folds them into the spans and clears it.
  S5. Spark fires a batch's expired timers after its input rows. A bucket with input has just
      closed everything the watermark allows, so its expired timer is deleted instead of
      waking it a second time in the same batch (a second state round trip for nothing).
  S6. Recent pageview ids live in a map keyed by minute of event time (``ID_WINDOW_MS``). A
      retried record is the same event, with the same ts, so its earlier copy is in the
      minute of its own ts: a call loads only the minutes of its new pageviews, and drops a
      minute once the watermark has passed all of it (ids kept a little longer are harmless:
      no on-time copy can repeat them). The sink relies on the same fact for late copies (Z2).
      Checkpoints of session 13 held all ids in one value, ``recent_pageview_ids``; the first
      call folds it into minutes and clears it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from clickstream.sessions import tws_input
from clickstream.sessions.semantics import (
    ORDER_COLUMNS,
    PAGEVIEW_COLUMNS,
    SPAN_COLUMNS,
    closed_sessions,
    dedupe,
    empty_orders,
    empty_pageviews,
    merge_spans,
    next_wakeup,
    pageview_spans,
    reattribute,
    with_session_ids,
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


RECENT_IDS_SCHEMA = pa.schema([("event_id", pa.string()), ("ts_ms", pa.int64())])
ID_WINDOW_MS = 60_000  # recent pageview ids are stored by minute of event time (S6)
ID_WINDOW_KEY_SCHEMA = StructType([StructField("window", LongType(), False)])
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def encode_table(table: pa.Table) -> bytes:
    """Compact Arrow IPC bytes of a state table."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(table)
    return sink.getvalue()


def decode_table(blob: bytes) -> pa.Table:
    with pa.ipc.open_stream(io.BytesIO(blob)) as reader:
        return reader.read_all()


def encode_frame(frame: pd.DataFrame) -> bytes:
    return encode_table(pa.Table.from_pandas(frame, preserve_index=False))


def decode_frame(blob: bytes | None, empty: pd.DataFrame) -> pd.DataFrame:
    return decode_table(blob).to_pandas() if blob else empty


SPANS_SCHEMA = pa.schema([
    (c, pa.int64() if c in ("start_ms", "end_ms", "pageview_count") else pa.string())
    for c in SPAN_COLUMNS])


def _users_in(spans: pa.Table, frame: pd.DataFrame) -> pa.ChunkedArray:
    """Mask of the spans whose user_id occurs in ``frame``: a superset of its users' spans
    (user ids of other clients match too), which is all that merging or attributing needs."""
    users = pa.array(frame["user_id"].unique(), pa.string())
    return pc.is_in(spans["user_id"], value_set=users)


def id_windows(ts_ms: Any) -> np.ndarray:
    """The minute (``ID_WINDOW_MS``) each pageview id is stored under (S6)."""
    return np.asarray(ts_ms, dtype=np.int64) // ID_WINDOW_MS


def _output(frame: pd.DataFrame) -> pd.DataFrame:
    for column in OUTPUT_COLUMNS:
        if column not in frame:
            frame[column] = None
    return frame[OUTPUT_COLUMNS]


class BucketState:
    """Open sessions (spans), unemitted orders and recent pageview ids of one bucket.

    Spans and ids stay Arrow tables: a call turns into pandas only the spans of users it
    touches (new pageviews or orders) and the spans it closes, so its cost follows its input,
    not the bucket's open state. ``recent_ids`` holds the ids of the minutes the call loaded
    (those of its input, S6), and gains the new ones."""

    def __init__(self, spans: pa.Table, orders: pd.DataFrame, recent_ids: pa.Table,
                 gap_ms: int) -> None:
        self.spans = spans
        self.orders = orders
        self.recent_ids = recent_ids
        self.gap_ms = gap_ms

    def add_pageviews(self, pageviews: pd.DataFrame) -> None:
        """Merge new, deduplicated pageviews into the open sessions and remember their ids."""
        if pageviews.empty:
            return
        touched = _users_in(self.spans, pageviews)
        held, new = self.spans.filter(touched).to_pandas(), pageview_spans(pageviews)
        merged = merge_spans({c: np.concatenate([held[c].to_numpy(), new[c]])
                              for c in SPAN_COLUMNS}, self.gap_ms)
        self.spans = pa.concat_tables([
            self.spans.filter(pc.invert(touched)),
            pa.Table.from_pandas(merged, schema=SPANS_SCHEMA, preserve_index=False)])
        self.recent_ids = pa.concat_tables([self.recent_ids, pa.table({
            "event_id": pa.array(pageviews["event_id"].to_numpy(), pa.string()),
            "ts_ms": pa.array(pageviews["ts_ms"].to_numpy(dtype=np.int64), pa.int64()),
        }, schema=RECENT_IDS_SCHEMA)])

    def add(self, events: pd.DataFrame) -> pd.DataFrame:
        """Fold new events in; returns the ``duplicate`` rows of records already held (S2)."""
        is_order = (events["event_type"] == "order").to_numpy()
        new_pv = dedupe(events.loc[~is_order, PAGEVIEW_COLUMNS], "event_id")
        new_orders = dedupe(events.loc[is_order, ORDER_COLUMNS], "order_id")
        # Probe the held ids with the batch's (hashing the few new ids, not every held one).
        new_ids = pa.array(new_pv["event_id"].to_numpy(), pa.string())
        held = self.recent_ids["event_id"].filter(
            pc.is_in(self.recent_ids["event_id"], value_set=new_ids))
        pv_dup = new_pv["event_id"].isin(held.to_pylist()).to_numpy()
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
        self.add_pageviews(new_pv[~pv_dup])
        self.orders = pd.concat([self.orders, new_orders[~order_dup]], ignore_index=True)
        return duplicates

    def close(self, watermark_ms: int) -> tuple[pd.DataFrame, int | None]:
        """Emit what the watermark closes (E7); keep the rest. Returns (rows, next wakeup)."""
        closing = pa.array(closed_sessions(self.spans, watermark_ms, self.gap_ms))
        open_spans = self.spans.filter(pc.invert(closing))
        closed = self.spans.filter(closing).to_pandas()
        # Orders are attributed among their users' sessions only, closed or still open.
        with_orders = open_spans.filter(_users_in(open_spans, self.orders)).to_pandas()
        sessions, attributions = reattribute(
            with_session_ids(pd.concat([closed, with_orders], ignore_index=True)),
            self.orders, self.gap_ms)  # closed rows first, in that order
        closed_ids = set(sessions["session_id"][: len(closed)])
        session_of_order = attributions["session_id"]
        in_closed = session_of_order.isin(closed_ids).to_numpy()
        uncovered = session_of_order.isna().to_numpy()
        final_uncovered = uncovered & (attributions["ts_ms"].to_numpy() <= watermark_ms)
        emitted_sessions = sessions[: len(closed)].assign(kind="session")
        emitted_orders = attributions[in_closed | final_uncovered].rename(
            columns={"order_id": "record_id", "ts_ms": "record_ts_ms"}).assign(kind="attribution")
        self.spans = open_spans
        emitted_order_ids = set(emitted_orders["record_id"])
        self.orders = self.orders[~self.orders["order_id"].isin(emitted_order_ids)]
        self.orders = self.orders.reset_index(drop=True)
        recent_ts = self.recent_ids["ts_ms"]
        self.recent_ids = self.recent_ids.filter(pc.greater(recent_ts, watermark_ms))  # (S3)
        pending = attributions[uncovered & ~final_uncovered]
        rows = pd.concat([emitted_sessions, emitted_orders], ignore_index=True)
        return rows, next_wakeup(open_spans, pending, self.gap_ms)


class SessionProcessor(StatefulProcessor):
    """``transformWithStateInPandas`` processor keyed by user bucket, event-time mode."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in the Python worker, before it reads any input: read it by key runs.
        tws_input.install()
        self.__dict__.update(state)

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.span_state = handle.getValueState("open_sessions", STATE_SCHEMA)
        self.order_state = handle.getValueState("open_orders", STATE_SCHEMA)
        self.recent_id_windows = handle.getMapState("recent_pageview_id_windows",
                                                    ID_WINDOW_KEY_SCHEMA, STATE_SCHEMA)
        self.legacy_recent_id_state = handle.getValueState("recent_pageview_ids", STATE_SCHEMA)
        self.legacy_pageview_state = handle.getValueState("open_pageviews", STATE_SCHEMA)

    @staticmethod
    def _blob(holder: Any) -> bytes | None:
        value = holder.get() if holder.exists() else None
        return value[0] if value else None

    def _load(self, events: pd.DataFrame | None = None) -> BucketState:
        """The bucket's state, with the recent ids of the minutes of ``events``' pageviews."""
        spans = self._blob(self.span_state)
        held = []
        if events is not None:
            pageview_ts = events.loc[events["event_type"] != "order", "ts_ms"]
            for window in np.unique(id_windows(pageview_ts)).tolist():
                value = self.recent_id_windows.getValue((window,))
                if value and value[0]:
                    held.append(decode_table(value[0]))
        legacy_ids = self._blob(self.legacy_recent_id_state)
        if legacy_ids:  # (S6) every minute of it is rewritten on save; none is stored yet
            held.append(decode_table(legacy_ids))
            self.legacy_recent_id_state.clear()
        state = BucketState(decode_table(spans) if spans else SPANS_SCHEMA.empty_table(),
                            decode_frame(self._blob(self.order_state), empty_orders()),
                            pa.concat_tables(held) if held else RECENT_IDS_SCHEMA.empty_table(),
                            self.gap_ms)
        legacy = self._blob(self.legacy_pageview_state)
        if legacy:  # (S4)
            state.add_pageviews(decode_frame(legacy, empty_pageviews()))
            self.legacy_pageview_state.clear()
        return state

    def _save_recent_ids(self, recent_ids: pa.Table, watermark_ms: int) -> None:
        """Rewrite the minutes the call loaded or added to; drop the minutes the watermark
        passed entirely (S6)."""
        windows = id_windows(recent_ids["ts_ms"])
        for window in np.unique(windows).tolist():
            rows = recent_ids.filter(pa.array(windows == window))
            self.recent_id_windows.updateValue((window,), (encode_table(rows),))
        for (window,) in list(self.recent_id_windows.keys()):
            if (window + 1) * ID_WINDOW_MS - 1 <= watermark_ms:
                self.recent_id_windows.removeKey((window,))

    def _save(self, state: BucketState, wakeup: int | None, watermark_ms: int,
              closed_through_watermark: bool) -> None:
        """Write the state back and leave one timer, at ``wakeup``. After input rows the state
        is closed through the watermark, so a timer the watermark already passed would only
        wake the bucket again in this batch for nothing (Spark fires timers after input):
        it is deleted too (S5)."""
        for holder, blob in ((self.span_state,
                              state.spans.num_rows and encode_table(state.spans)),
                             (self.order_state, len(state.orders) and encode_frame(state.orders))):
            if blob:
                holder.update((blob,))
            else:
                holder.clear()
        self._save_recent_ids(state.recent_ids, watermark_ms)
        for timer in list(self.handle.listTimers()):
            if timer != wakeup and (timer > watermark_ms or closed_through_watermark):
                self.handle.deleteTimer(timer)  # a firing timer is deleted by Spark
        if wakeup is not None and wakeup not in set(self.handle.listTimers()):
            self.handle.registerTimer(wakeup)

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        events = pd.concat(list(rows), ignore_index=True)
        events["ts_ms"] = events["ts_ms"].astype(np.int64)
        state = self._load(events)
        events["amount_e4"] = events["amount_e4"].fillna(0).astype(np.int64)
        duplicates = state.add(events)
        watermark = timerValues.getCurrentWatermarkInMs()
        emitted, wakeup = state.close(watermark)  # (S1)
        self._save(state, wakeup, watermark, closed_through_watermark=True)
        yield _output(pd.concat([duplicates, emitted], ignore_index=True))

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        state = self._load()
        watermark = timerValues.getCurrentWatermarkInMs()
        emitted, wakeup = state.close(watermark)
        self._save(state, wakeup, watermark, closed_through_watermark=False)
        yield _output(emitted)

    def close(self) -> None:
        """No resources to release."""
