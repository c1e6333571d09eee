"""The streaming adapter: applies ``semantics`` inside Spark's ``transformWithStateInPandas``.

What ``stream_processor.SessionProcessor`` (the processor Spark pickles) does when Spark calls
it: :func:`handle_input_rows` and :func:`handle_expired_timer`, on the state variables its
``init`` declared.

State is keyed by a *bucket* of users (a hash of client_id/user_id), not by user: Spark calls
the processor once per bucket with a pandas frame of many users, and ``semantics`` works on it
vectorised. Per-user keys would cost a state round trip per user per batch (measured: ~10k
events/s); buckets keep the number of calls small and constant.

A bucket's state holds only what the watermark has not closed, as Arrow blobs: its open
sessions as spans (one summary row per session, not its pageviews), the orders not emitted
yet, and the ids of pageviews newer than the watermark (the only ones an on-time duplicate can
repeat), stored as one slice per call so that a call writes only its own ids and the
watermark drops them a slice at a time (S6). Each call merges the new pageviews into the spans
with the function the batch recompute builds its sessions with (``semantics.merge_spans``),
emits the sessions the watermark closes (with their attributions) and keeps the rest. So the
stream equals the batch by construction, and a call's work grows with its input and the open
sessions, not with every open pageview.

Known edge cases, cited inline as (S1)..(S8):
  S1. Within one micro-batch a bucket's input is complete, so anything the batch's watermark
      already closes is emitted right away instead of waiting for a timer.
  S2. A record whose id is already in the state (a retry of an on-time event) is reported as a
      ``duplicate`` row, so the sink does not store it twice; copies inside one batch are
      collapsed here and in the sink by one rule (semantics E6), so the copy the sessions count
      is the one the table stores. The row names the record's
      type (``record_type``) and client: a pageview's event_id may equal an order's order_id,
      and a retried pageview must not drop a new order with that id.
  S3. Rows at or before the previous batch's watermark never reach the processor (Spark drops
      them); the sink stores them and queues them for the recompute. So a pageview id is kept
      only while its ts is after the current watermark: no later copy of it can arrive on time.
      Spark compares in microseconds, ids keep their millisecond (``ts_ms``, truncated): an id
      in the watermark's own millisecond is kept too, since 0.5 ms after the watermark is on
      time (dropped with it, such a pageview's retry was stored and sessionized twice).
  S4. Checkpoints written before spans held each open pageview in ``open_pageviews``; the first
      call for such a bucket folds them into the spans and clears it.
  S5. Spark fires a batch's expired timers after its input rows. A bucket with input has just
      closed everything the watermark allows, so its expired timer is deleted instead of
      waking it a second time in the same batch (a second state round trip for nothing).
  S6. Recent pageview ids live in a map of *slices*: each call stores the ids it added as one
      slice, keyed by their (min ts, max ts), and drops a slice once the watermark has passed
      its max ts (ids kept a little longer are harmless: no on-time copy can repeat them). A
      call with pageviews loads every slice: a copy of an id may carry another ts (a producer
      reusing the id), and loaded only where its own ts fell, such a copy in a later
      micro-batch was sessionized and stored a second time (the state benchmark at 5,000
      events/s: +17% per bucket call, +39% once the held slices are the watermark delay's
      worth; BENCHMARKS, session 74). A copy whose first copy the
      watermark passed is not recognised (Z2 finds a late copy only in its own day). Keying
      ids by minute instead cost a state call per minute of event time in a catch-up. Earlier
      checkpoints held all ids in one value, ``recent_pageview_ids``; the first call moves
      them into a slice and clears it.
  S7. State tables are stored as one record batch. Arrow's filter and concat keep chunks, so
      spans written as they are would gain a record batch per call, for as long as the stream
      runs: after 100 calls a bucket's spans took 4x as long to encode. Checkpoints written
      that way are compacted by their next save.
  S8. Ids are a client's (semantics E6): a bucket holds users of several clients, so a held id
      or order matches a new record of its own client only. Taken for a retry, another
      client's record got a ``duplicate`` row and the sink did not store it either: lost
      without a quarantine row. Ids saved before they carried their client (``client_id``
      null) match any client's, as they did; they leave the state with their slice (S6).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.stateful_processor import TimerValues
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from clickstream.sessions.semantics import (
    ORDER_COLUMNS,
    ORDER_COPY_ORDER,
    ORDER_KEY,
    PAGEVIEW_COLUMNS,
    PAGEVIEW_COPY_ORDER,
    PAGEVIEW_KEY,
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
from clickstream.sessions.stream_processor import SessionProcessor

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
    # A duplicate's event type (pageview | order): pageview and order ids are separate
    # namespaces, so the sink drops a duplicate's id from its own type's rows only (S2).
    StructField("record_type", StringType(), True),
])
OUTPUT_COLUMNS = OUTPUT_SCHEMA.fieldNames()


RECENT_IDS_SCHEMA = pa.schema([("event_id", pa.string()), ("ts_ms", pa.int64()),
                               ("client_id", pa.string())])  # (S8) null: any client
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def encode_table(table: pa.Table) -> bytes:
    """Compact Arrow IPC bytes of a state table, as one record batch.

    A call filters the spans and appends its merged ones, which adds a chunk; written chunk by
    chunk, a bucket's spans would carry one more record batch per call for the life of the
    stream, and every later decode, filter and encode would pay for all of them (S7)."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=_IPC_OPTIONS) as writer:
        writer.write_table(table.combine_chunks())
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


def recent_ids(table: pa.Table) -> pa.Table:
    """``table`` of pageview ids in RECENT_IDS_SCHEMA. Ids saved before they carried their
    client get a null one, which matches every client (S8)."""
    if "client_id" not in table.column_names:
        table = table.append_column("client_id", pa.nulls(table.num_rows, pa.string()))
    return table.select(RECENT_IDS_SCHEMA.names).cast(RECENT_IDS_SCHEMA)


def _keys(frame: pd.DataFrame, key: list[str]) -> pd.MultiIndex:
    return pd.MultiIndex.from_frame(frame[key])


def _seen(records: pd.DataFrame, key: list[str], held: pd.DataFrame) -> np.ndarray:
    """Mask of ``records`` whose ``key`` (client, id) ``held`` holds; a held row without a
    client matches the id of any client (S8)."""
    if held.empty or records.empty:
        return np.zeros(len(records), dtype=bool)
    client, record_id = key
    any_client = held[client].isna().to_numpy()
    return (_keys(records, key).isin(_keys(held[~any_client], key))
            | records[record_id].isin(held.loc[any_client, record_id]).to_numpy())


def _users_in(spans: pa.Table, frame: pd.DataFrame) -> pa.ChunkedArray:
    """Mask of the spans whose user_id occurs in ``frame``: a superset of its users' spans
    (user ids of other clients match too), which is all that merging or attributing needs."""
    users = pa.array(frame["user_id"].unique(), pa.string())
    return pc.is_in(spans["user_id"], value_set=users)


def exact_revenue(sessions: pd.DataFrame) -> pd.DataFrame:
    """``sessions`` with ``revenue_e4`` as pandas' nullable Int64: concatenated with rows that
    have no revenue (attributions, duplicates), an int64 column turns float64, exact only below
    2**53 (revenues below ~9e11)."""
    return sessions.astype({"revenue_e4": "Int64"})


def _output(frame: pd.DataFrame) -> pd.DataFrame:
    for column in OUTPUT_COLUMNS:
        if column not in frame:
            frame[column] = None
    return frame[OUTPUT_COLUMNS]


class BucketState:
    """Open sessions (spans), unemitted orders and recent pageview ids of one bucket.

    Spans and ids stay Arrow tables: a call turns into pandas only the spans of users it
    touches (new pageviews or orders) and the spans it closes, so its cost follows its input,
    not the bucket's open state. Ids: ``held_ids`` are those of the slices the call loaded
    (every held one, S6), ``new_ids`` those it adds, stored as one new slice."""

    def __init__(self, spans: pa.Table, orders: pd.DataFrame, held_ids: pa.Table,
                 gap_ms: int) -> None:
        self.spans = spans
        self.orders = orders
        self.held_ids = held_ids
        self.new_ids = RECENT_IDS_SCHEMA.empty_table()
        self.gap_ms = gap_ms

    def remember_ids(self, ids: pa.Table) -> None:
        self.new_ids = pa.concat_tables([self.new_ids, recent_ids(ids)])

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
        self.remember_ids(pa.table({
            "event_id": pa.array(pageviews["event_id"].to_numpy(), pa.string()),
            "ts_ms": pa.array(pageviews["ts_ms"].to_numpy(dtype=np.int64), pa.int64()),
            "client_id": pa.array(pageviews["client_id"].to_numpy(), pa.string()),
        }, schema=RECENT_IDS_SCHEMA))

    def add(self, events: pd.DataFrame) -> pd.DataFrame:
        """Fold new events in; returns the ``duplicate`` rows of records already held (S2)."""
        is_order = (events["event_type"] == "order").to_numpy()
        new_pv = dedupe(events.loc[~is_order, PAGEVIEW_COLUMNS], PAGEVIEW_KEY,
                        PAGEVIEW_COPY_ORDER)
        new_orders = dedupe(events.loc[is_order, ORDER_COLUMNS], ORDER_KEY, ORDER_COPY_ORDER)
        # Probe the held ids with the batch's (hashing the few new ids, not every held one).
        new_ids = pa.array(new_pv["event_id"].to_numpy(), pa.string())
        known = pa.concat_tables([self.held_ids, self.new_ids])
        held = known.filter(pc.is_in(known["event_id"], value_set=new_ids)).to_pandas()
        pv_dup = _seen(new_pv, PAGEVIEW_KEY, held)
        order_dup = _seen(new_orders, ORDER_KEY, self.orders)
        duplicates = pd.concat([
            pd.DataFrame({"client_id": new_pv["client_id"][pv_dup],
                          "user_id": new_pv["user_id"][pv_dup],
                          "record_id": new_pv["event_id"][pv_dup],
                          "record_ts_ms": new_pv["ts_ms"][pv_dup], "record_type": "pageview"}),
            pd.DataFrame({"client_id": new_orders["client_id"][order_dup],
                          "user_id": new_orders["user_id"][order_dup],
                          "record_id": new_orders["order_id"][order_dup],
                          "record_ts_ms": new_orders["ts_ms"][order_dup],
                          "record_type": "order"}),
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
        final_uncovered = uncovered & (attributions["ts_ms"].to_numpy() < watermark_ms)  # E7
        emitted_sessions = exact_revenue(sessions[: len(closed)]).assign(kind="session")
        emitted_orders = attributions[in_closed | final_uncovered].rename(
            columns={"order_id": "record_id", "ts_ms": "record_ts_ms"}).assign(kind="attribution")
        self.spans = open_spans
        if len(emitted_orders):
            emitted = emitted_orders.rename(columns={"record_id": "order_id"})
            self.orders = self.orders[~_keys(self.orders, ORDER_KEY).isin(
                _keys(emitted, ORDER_KEY))].reset_index(drop=True)
        self.new_ids = self.new_ids.filter(  # (S3) its millisecond may still be on time
            pc.greater_equal(self.new_ids["ts_ms"], watermark_ms))
        pending = attributions[uncovered & ~final_uncovered]
        rows = pd.concat([emitted_sessions, emitted_orders], ignore_index=True)
        return rows, next_wakeup(open_spans, pending, self.gap_ms)


def _blob(holder: Any) -> bytes | None:
    value = holder.get() if holder.exists() else None
    return value[0] if value else None


def _slices(processor: SessionProcessor) -> list[tuple[int, int]]:
    keys = processor.recent_id_slices.keys()  # a MapState, not a dict: no iteration of its own
    return [(int(low), int(high)) for low, high in keys]


def _load(processor: SessionProcessor, slices: list[tuple[int, int]],
          events: pd.DataFrame | None = None) -> BucketState:
    """The bucket's state, with the held ids when ``events`` has pageviews (S6)."""
    spans = _blob(processor.span_state)
    held = []
    if events is not None and (events["event_type"] != "order").any():
        for key in slices:
            value = processor.recent_id_slices.getValue(key)
            if value and value[0]:
                held.append(recent_ids(decode_table(value[0])))
    state = BucketState(decode_table(spans) if spans else SPANS_SCHEMA.empty_table(),
                        decode_frame(_blob(processor.order_state), empty_orders()),
                        pa.concat_tables(held) if held else RECENT_IDS_SCHEMA.empty_table(),
                        processor.gap_ms)
    legacy_ids = _blob(processor.legacy_recent_id_state)
    if legacy_ids:  # (S6) saved with this call's slice
        state.remember_ids(decode_table(legacy_ids))
        processor.legacy_recent_id_state.clear()
    legacy = _blob(processor.legacy_pageview_state)
    if legacy:  # (S4)
        state.add_pageviews(decode_frame(legacy, empty_pageviews()))
        processor.legacy_pageview_state.clear()
    return state


def _save_ids(processor: SessionProcessor, new_ids: pa.Table, slices: list[tuple[int, int]],
              watermark_ms: int) -> None:
    """Store the call's new ids as one slice; drop the slices the watermark passed (S6)."""
    if new_ids.num_rows:
        key = (pc.min(new_ids["ts_ms"]).as_py(), pc.max(new_ids["ts_ms"]).as_py())
        if key in slices:  # the same range again: keep both calls' ids
            earlier = processor.recent_id_slices.getValue(key)
            new_ids = pa.concat_tables([recent_ids(decode_table(earlier[0])), new_ids])
        processor.recent_id_slices.updateValue(key, (encode_table(new_ids),))
    for key in slices:
        if key[1] < watermark_ms:  # (S3) ids of the watermark's millisecond stay
            processor.recent_id_slices.removeKey(key)


def _save(processor: SessionProcessor, state: BucketState, slices: list[tuple[int, int]],
          wakeup: int | None, watermark_ms: int, closed_through_watermark: bool) -> None:
    """Write the state back and leave one timer, at ``wakeup``. After input rows the state
    is closed through the watermark, so a timer the watermark already passed would only
    wake the bucket again in this batch for nothing (Spark fires timers after input):
    it is deleted too (S5)."""
    for holder, blob in ((processor.span_state,
                          state.spans.num_rows and encode_table(state.spans)),
                         (processor.order_state, len(state.orders) and encode_frame(state.orders))):
        if blob:
            holder.update((blob,))
        else:
            holder.clear()
    _save_ids(processor, state.new_ids, slices, watermark_ms)
    handle = processor.handle
    for timer in list(handle.listTimers()):
        if timer != wakeup and (timer > watermark_ms or closed_through_watermark):
            handle.deleteTimer(timer)  # a firing timer is deleted by Spark
    if wakeup is not None and wakeup not in set(handle.listTimers()):
        handle.registerTimer(wakeup)


def handle_input_rows(processor: SessionProcessor, rows: Iterator[pd.DataFrame],
                      timer_values: TimerValues) -> Iterator[pd.DataFrame]:
    """``SessionProcessor.handleInputRows``: fold a bucket's new events in, emit what closes."""
    events = pd.concat(list(rows), ignore_index=True)
    events["ts_ms"] = events["ts_ms"].astype(np.int64)
    slices = _slices(processor)
    state = _load(processor, slices, events)
    events["amount_e4"] = events["amount_e4"].fillna(0).astype(np.int64)
    duplicates = state.add(events)
    watermark = timer_values.getCurrentWatermarkInMs()
    emitted, wakeup = state.close(watermark)  # (S1)
    _save(processor, state, slices, wakeup, watermark, closed_through_watermark=True)
    yield _output(pd.concat([duplicates, emitted], ignore_index=True))


def handle_expired_timer(processor: SessionProcessor, timer_values: TimerValues
                         ) -> Iterator[pd.DataFrame]:
    """``SessionProcessor.handleExpiredTimer``: emit what the watermark closed since."""
    slices = _slices(processor)
    state = _load(processor, slices)
    watermark = timer_values.getCurrentWatermarkInMs()
    emitted, wakeup = state.close(watermark)
    _save(processor, state, slices, wakeup, watermark, closed_through_watermark=False)
    yield _output(emitted)
