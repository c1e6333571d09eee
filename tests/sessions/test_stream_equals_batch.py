"""Property: the stream's stateful processor emits exactly the batch recompute's sessions.

Drives ``SessionProcessor`` with PySpark's ``TwsTester`` the way Spark does: random arrival
batches, a watermark that trails the maximum event time of earlier batches, late rows (ts <=
the previous batch's watermark) filtered before the processor, expired timers after the
input. After a final watermark closes everything, the emitted sessions and attributions must
equal ``sessionize`` over every row the processor was given.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql.streaming.tws_tester import TwsTester

from clickstream.sessions.semantics import ORDER_COLUMNS, PAGEVIEW_COLUMNS, sessionize
from clickstream.sessions.stream_adapter import (
    INPUT_COLUMNS,
    OUTPUT_COLUMNS,
    decode_table,
    encode_frame,
    encode_table,
)
from clickstream.sessions.stream_processor import SessionProcessor

GAP = 30 * 60_000
DELAY = 10 * 60_000
FAR_FUTURE = 10**13

# Besides times drawn anywhere, times that step from the same user's previous one by the
# boundaries the stream and the batch must agree on (a gap, give or take a millisecond; the
# watermark delay): a continuous draw almost never puts two pageviews exactly a gap apart, a
# session's end + gap on the watermark, or an order at a session's end + gap.
BOUNDARY_STEPS = [0, 1, GAP - 1, GAP, GAP + 1, DELAY - 1, DELAY, DELAY + 1, 2 * GAP]


def stepped(rows: list[tuple]) -> list[tuple]:
    """(user, step, kind, ident, client) rows as events at each user's running sum of steps."""
    last: dict[tuple[str, str], int] = {}
    out = []
    for user, step, kind, ident, client in rows:
        ts = last[client, user] = last.get((client, user), 1) + step
        out.append((user, ts, kind, ident, client))
    return out


users = st.sampled_from(["u1", "u2", "u3"])
kinds = st.sampled_from(["pageview"] * 4 + ["order"])
idents = st.integers(0, 60)  # id pool small enough to produce duplicates
clients = st.sampled_from(["c", "d"])  # two clients of one bucket, sending the same ids (E6)
event = st.tuples(users, st.integers(1, 10 * GAP), kinds, idents, clients)
events_at_boundaries = st.lists(
    st.tuples(users, st.sampled_from(BOUNDARY_STEPS), kinds, idents, clients),
    min_size=1, max_size=60,
).map(stepped).flatmap(lambda rows: st.one_of(st.just(rows), st.permutations(rows)))


def to_frame(events: list[tuple]) -> pd.DataFrame:
    """Rows of (user, ts, kind, ident) or (user, ts, kind, ident, client) for client c. Ids
    depend on the user, not the client: two clients' events may share one."""
    rows = []
    first_ts: dict[tuple[str, str, str, int], int] = {}
    for user, ts, kind, ident, *client in events:
        client_id = client[0] if client else "c"
        ts = first_ts.setdefault((client_id, user, kind, ident), ts)  # a retry repeats its event
        rows.append({
            "bucket": 0, "client_id": client_id, "user_id": user, "event_type": kind,
            "event_id": f"{kind}-{user}-{ident}", "ts_ms": ts,
            "url": f"/{ident}" if kind == "pageview" else None,
            "order_id": f"o-{user}-{ident}" if kind == "order" else None,
            "amount_e4": 10_000 * (ident + 1) if kind == "order" else 0,
            "currency": "EUR" if kind == "order" else None,
        })
    return pd.DataFrame(rows, columns=list(INPUT_COLUMNS)).astype(
        {"ts_ms": "int64", "amount_e4": "int64"})


def spark_like_tester() -> TwsTester:
    tester = TwsTester(SessionProcessor(GAP), timeMode="EventTime",
                       eventTimeExtractor=lambda row: int(row["ts_ms"]))
    tester._filterLateEventsPandas = lambda rows: rows  # the caller drops late rows, as Spark
    return tester


def micro_batch(tester: TwsTester, rows: pd.DataFrame, watermark: int) -> list[pd.DataFrame]:
    """One micro-batch in Spark's order: input rows under the batch's watermark, then the
    timers it expired. (``TwsTester.setWatermark`` fires timers before the input instead, so
    the watermark is moved through the tester's internals.) Rows between the previous and this
    watermark reach the processor, and a key without rows gets no input call, as in Spark."""
    if watermark > tester._currentWatermarkMs:
        tester._currentWatermarkMs = watermark
        tester.handle.setWatermark(watermark)
    out = [tester.testInPandas(0, rows.reset_index(drop=True))] if len(rows) else []
    return [*out, tester._handleExpiredTimers()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.lists(event, min_size=1, max_size=60), events_at_boundaries),
       st.lists(st.integers(1, 15), min_size=1))
def test_stream_sessions_equal_batch_sessions(events, batch_sizes) -> None:
    frame = to_frame(events)
    tester = spark_like_tester()
    late_before, max_ts, start = 0, 0, 0
    delivered: list[pd.DataFrame] = []
    emitted: list[pd.DataFrame] = []
    sizes = iter(batch_sizes * len(events))
    while start < len(frame):
        batch = frame.iloc[start: start + next(sizes)]
        start += len(batch)
        watermark = max(late_before, max_ts - DELAY)
        on_time = batch[batch["ts_ms"] > late_before]  # Spark drops ts <= previous watermark
        delivered.append(on_time)
        emitted.extend(micro_batch(tester, on_time, watermark))
        max_ts = max(max_ts, int(batch["ts_ms"].max()))
        late_before = watermark
    emitted.append(tester.setWatermark(FAR_FUTURE))
    parts = [e for e in emitted if e is not None and len(e)]
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=OUTPUT_COLUMNS)

    given_rows = pd.concat(delivered, ignore_index=True)
    is_order = given_rows["event_type"] == "order"
    expected = sessionize(given_rows.loc[~is_order, PAGEVIEW_COLUMNS],
                          given_rows.loc[is_order, ORDER_COLUMNS], GAP)

    sessions = out[out["kind"] == "session"]
    got = sorted(zip(sessions.session_id, sessions.start_ms, sessions.end_ms,
                     sessions.pageview_count, sessions.order_count, sessions.revenue_e4,
                     sessions.landing_url, sessions.exit_url, strict=True))
    want_frame = expected.sessions
    want = sorted(zip(want_frame.session_id, want_frame.start_ms, want_frame.end_ms,
                      want_frame.pageview_count, want_frame.order_count, want_frame.revenue_e4,
                      want_frame.landing_url, want_frame.exit_url, strict=True))
    assert got == want

    attributions = out[out["kind"] == "attribution"]
    got_attr = sorted(zip(attributions.client_id, attributions.record_id,
                          attributions.session_id.fillna(""), strict=True))
    want_attr = sorted(zip(expected.attributions.client_id, expected.attributions.order_id,
                           expected.attributions.session_id.fillna(""), strict=True))
    assert got_attr == want_attr

    # A retry repeats its event's time, so every copy delivered on time in a later micro-batch
    # finds its first copy still held: one ``duplicate`` row each (the sink drops those).
    copies = pd.concat([d.drop_duplicates(["client_id", "event_id"]) for d in delivered],
                       ignore_index=True).groupby(["client_id", "event_type", "event_id"]).size()
    want_dup = sorted((client, kind, ident) for (client, kind, ident), n in copies.items()
                      for _ in range(n - 1))
    duplicates = out[out["kind"] == "duplicate"]
    got_dup = sorted(zip(duplicates.client_id, duplicates.record_type, duplicates.record_id,
                         strict=True))
    order_ids = {f"o{ident[5:]}": ident for _, kind, ident in want_dup if kind == "order"}
    assert sorted((c, k, order_ids.get(i, i)) for c, k, i in got_dup) == want_dup

    # Nothing is left in state once the watermark passed everything: state is bounded.
    for name in ("open_sessions", "open_orders", "recent_pageview_ids"):
        assert tester.peekValueState(name, 0) is None
    assert not tester.peekMapState("recent_pageview_id_slices", 0)


def test_a_checkpoint_holding_open_pageviews_is_folded_into_sessions() -> None:
    """(S4) State written before spans (each open pageview in ``open_pageviews``) still gives
    the batch's sessions: the next call folds those pageviews in and clears the old state."""
    frame = to_frame([("u1", GAP, "pageview", 1), ("u1", GAP + 5, "pageview", 2),
                      ("u2", GAP, "pageview", 3), ("u1", 2 * GAP, "pageview", 4),
                      ("u1", GAP + 5, "pageview", 2), ("u1", 2 * GAP + 1, "order", 5)])
    held, arriving = frame.iloc[:3], frame.iloc[3:]
    tester = TwsTester(SessionProcessor(GAP), timeMode="EventTime",
                       eventTimeExtractor=lambda row: int(row["ts_ms"]))
    tester.updateValueState("open_pageviews", 0,
                            (encode_frame(held[PAGEVIEW_COLUMNS].reset_index(drop=True)),))
    out = pd.concat([tester.testInPandas(0, arriving.reset_index(drop=True)),
                     tester.setWatermark(FAR_FUTURE)], ignore_index=True)

    expected = sessionize(frame.loc[frame.event_type == "pageview", PAGEVIEW_COLUMNS],
                          frame.loc[frame.event_type == "order", ORDER_COLUMNS], GAP).sessions
    sessions = out[out["kind"] == "session"]
    columns = ["session_id", "start_ms", "end_ms", "pageview_count", "order_count"]
    assert sorted(map(tuple, sessions[columns].to_numpy().tolist())) == sorted(
        map(tuple, expected[columns].to_numpy().tolist()))
    assert list(out.loc[out["kind"] == "duplicate", "record_id"]) == ["pageview-u1-2"]
    assert tester.peekValueState("open_pageviews", 0) is None


def test_a_checkpoint_holding_all_recent_ids_in_one_value_still_finds_retries() -> None:
    """(S6) Earlier state held every recent pageview id in one value, ``recent_pageview_ids``.
    A retry of one of them is still a duplicate; the ids the watermark has not passed move
    into the call's slice, keyed by their time range."""
    first, retried = 5 * 60_000 + 7, 9 * 60_000 + 1
    frame = to_frame([("u1", first, "pageview", 1), ("u1", retried, "pageview", 2)])
    tester = spark_like_tester()
    tester.updateValueState("recent_pageview_ids", 0, (encode_table(pa.table({
        "event_id": frame["event_id"], "ts_ms": frame["ts_ms"]})),))  # no client_id then (S8)
    arriving = pd.concat([to_frame([("u1", retried, "pageview", 2)]),
                          to_frame([("u2", retried + 3, "pageview", 3)])], ignore_index=True)

    out = pd.concat(micro_batch(tester, arriving, watermark=6 * 60_000), ignore_index=True)

    assert list(out.loc[out["kind"] == "duplicate", "record_id"]) == ["pageview-u1-2"]
    assert tester.peekValueState("recent_pageview_ids", 0) is None
    slices = tester.peekMapState("recent_pageview_id_slices", 0)
    assert sorted(slices) == [(retried, retried + 3)]  # the id at minute 5 is behind the watermark


def test_an_id_slice_saved_without_clients_still_finds_retries() -> None:
    """(S8) Slices saved before ids carried their client match an id of any client, as they
    did; the call's own slice carries its clients."""
    minute = 60_000
    frame = to_frame([("u1", 5 * minute, "pageview", 1)])
    tester = spark_like_tester()
    tester.updateMapState("recent_pageview_id_slices", 0, {
        (5 * minute, 5 * minute): (encode_table(pa.table({"event_id": frame["event_id"],
                                                          "ts_ms": frame["ts_ms"]})),)})
    arriving = to_frame([("u1", 5 * minute, "pageview", 1), ("u2", 6 * minute, "pageview", 2)])

    out = pd.concat(micro_batch(tester, arriving, watermark=0), ignore_index=True)

    assert list(out.loc[out["kind"] == "duplicate", "record_id"]) == ["pageview-u1-1"]
    (blob,) = tester.peekMapState("recent_pageview_id_slices", 0)[(6 * minute, 6 * minute)]
    assert decode_table(blob).to_pylist() == [
        {"event_id": "pageview-u2-2", "ts_ms": 6 * minute, "client_id": "c"}]


def test_a_retry_is_recognised_while_its_slice_is_partly_behind_the_watermark() -> None:
    """(S6) A slice is dropped only once the watermark has passed its *last* id: one of its
    ids may still be repeated on time after the watermark passed its first."""
    minute = 60_000
    tester = spark_like_tester()
    first = to_frame([("u1", 1 * minute, "pageview", 1), ("u1", 20 * minute, "pageview", 2)])
    micro_batch(tester, first, watermark=0)
    micro_batch(tester, to_frame([("u2", 25 * minute, "pageview", 3)]), watermark=10 * minute)
    retry = to_frame([("u1", 20 * minute, "pageview", 2)])

    out = pd.concat(micro_batch(tester, retry, watermark=15 * minute), ignore_index=True)

    assert list(out.loc[out["kind"] == "duplicate", "record_id"]) == ["pageview-u1-2"]


def test_two_clients_of_one_bucket_may_send_the_same_ids() -> None:
    """(E6, S2) Ids are a client's: another client's event with an id the state holds is new,
    not a retry. Taken for one, it got a ``duplicate`` row, so the sink did not store it
    either, and it was lost without a quarantine row."""
    minute = 60_000
    tester = spark_like_tester()
    micro_batch(tester, to_frame([("u1", minute, "pageview", 1, "c"),
                                  ("u1", minute + 1, "order", 2, "c")]), watermark=0)
    arriving = to_frame([("u1", 2 * minute, "pageview", 1, "d"),
                         ("u1", 2 * minute + 1, "order", 2, "d"),
                         ("u1", minute, "pageview", 1, "c")])  # c's retry is one

    out = pd.concat([*micro_batch(tester, arriving, watermark=0),
                     tester.setWatermark(FAR_FUTURE)], ignore_index=True)

    assert out.loc[out["kind"] == "duplicate", ["client_id", "record_id"]].to_numpy(
        ).tolist() == [["c", "pageview-u1-1"]]
    sessions = out[out["kind"] == "session"].sort_values("client_id")
    assert sessions[["client_id", "pageview_count", "order_count"]].to_numpy().tolist() == [
        ["c", 1, 1], ["d", 1, 1]]
    attributed = out[out["kind"] == "attribution"].sort_values("client_id")
    assert attributed["session_id"].tolist() == sessions["session_id"].tolist()


def test_open_sessions_stay_one_record_batch_call_after_call() -> None:
    """(S7) Each call filters the spans and appends its merged ones; stored as they are, the
    spans would gain one record batch per call for the life of the stream, and every later
    call would decode, filter and encode all of them."""
    tester = spark_like_tester()
    users = ["u1", "u2", "u3"]
    for call in range(12):  # every session stays open: each user returns within the gap
        ts = (call + 1) * 60_000
        arriving = to_frame([(users[call % 3], ts, "pageview", call),
                             (users[(call + 1) % 3], ts + 1, "pageview", 40 + call)])
        micro_batch(tester, arriving, watermark=0)

    (blob,) = tester.peekValueState("open_sessions", 0)
    with pa.ipc.open_stream(blob) as reader:
        record_batches = list(reader)
    assert len(record_batches) == 1
    assert record_batches[0].num_rows == 3
