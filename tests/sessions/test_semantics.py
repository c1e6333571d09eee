"""Session semantics at their exact boundaries, without Spark."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clickstream.errors import RevenueOverflowError
from clickstream.sessions.semantics import (
    ORDER_COLUMNS,
    PAGEVIEW_COLUMNS,
    REVENUE_E4_MAX,
    SPAN_COLUMNS,
    closed_sessions,
    merge_spans,
    next_wakeup,
    pageview_spans,
    reattribute,
    session_id,
    sessionize,
)
from tests.reference import reference_sessions

GAP = 30 * 60_000


def pageviews(*rows: tuple) -> pd.DataFrame:
    """Rows of (event_id, ts_ms) or (event_id, ts_ms, user_id) for client c."""
    data = [("c", r[2] if len(r) > 2 else "u", r[0], r[1], f"/{r[0]}") for r in rows]
    return pd.DataFrame(data, columns=PAGEVIEW_COLUMNS).astype({"ts_ms": "int64"})


def orders(*rows: tuple) -> pd.DataFrame:
    """Rows of (order_id, ts_ms, amount_e4)."""
    data = [("c", "u", r[0], r[1], r[2], "EUR") for r in rows]
    return pd.DataFrame(data, columns=ORDER_COLUMNS).astype({"ts_ms": "int64",
                                                             "amount_e4": "int64"})


NO_ORDERS = orders()


def spans(result) -> list[tuple[int, int, int]]:
    frame = result.sessions.sort_values(["user_id", "start_ms"])
    return list(zip(frame.start_ms, frame.end_ms, frame.pageview_count, strict=True))


def test_gap_exactly_starts_a_new_session() -> None:
    assert spans(sessionize(pageviews(("a", 0), ("b", GAP)), NO_ORDERS, GAP)) == [
        (0, 0, 1), (GAP, GAP, 1)]


def test_gap_minus_one_ms_extends_the_session() -> None:
    assert spans(sessionize(pageviews(("a", 0), ("b", GAP - 1)), NO_ORDERS, GAP)) == [
        (0, GAP - 1, 2)]


def test_backward_extension_moves_start_and_id() -> None:
    before = sessionize(pageviews(("b", 600_000)), NO_ORDERS, GAP)
    after = sessionize(pageviews(("b", 600_000), ("a", 0)), NO_ORDERS, GAP)
    assert spans(after) == [(0, 600_000, 2)]
    assert after.sessions.landing_url[0] == "/a"
    assert before.sessions.session_id[0] != after.sessions.session_id[0]
    assert after.sessions.session_id[0] == session_id("c", "u", 0)


def test_late_event_merges_two_sessions() -> None:
    two = sessionize(pageviews(("a", 0), ("c", 2 * GAP - 2)), NO_ORDERS, GAP)
    assert len(two.sessions) == 2
    merged = sessionize(pageviews(("a", 0), ("c", 2 * GAP - 2), ("b", GAP - 1)), NO_ORDERS, GAP)
    assert spans(merged) == [(0, 2 * GAP - 2, 3)]
    assert (merged.sessions.landing_url[0], merged.sessions.exit_url[0]) == ("/a", "/c")


def test_equal_timestamps_order_by_event_id() -> None:
    result = sessionize(pageviews(("z", 5), ("m", 5)), NO_ORDERS, GAP)
    assert (result.sessions.landing_url[0], result.sessions.exit_url[0]) == ("/m", "/z")


def test_duplicates_count_once() -> None:
    result = sessionize(pageviews(("a", 0), ("a", 0), ("b", 60_000)),
                        orders(("o", 1, 5), ("o", 1, 5)), GAP)
    assert spans(result) == [(0, 60_000, 2)]
    assert result.sessions.order_count[0] == 1


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(6)), st.permutations(range(3)))
def test_differing_copies_of_an_id_keep_the_first_by_time_user_and_content(
    pageview_order: list[int], order_order: list[int]
) -> None:
    """(E6) A producer reusing an id: whatever order the copies arrive in, the one first by
    time, then user, then url (amount, currency) is kept; nulls first. The stream's sink keeps
    the same copy, so its sessions are those of the stored rows."""
    copies = pd.concat([
        pageviews(("a", 9 * GAP)),  # a later time loses to any earlier one
        pageviews(("a", 2 * GAP, "v")),
        pageviews(("a", 2 * GAP, "u")).assign(url="/z"),
        pageviews(("a", 2 * GAP, "u")).assign(url="/y"),  # the kept pageview
        pageviews(("b", 0)),
        pageviews(("b", 0)).assign(url=None),  # the kept copy of b: a null url first
    ]).iloc[pageview_order]
    order_copies = orders(("o", GAP // 2, 9), ("o", GAP // 2, 3), ("o", 5 * GAP, 1))
    kept = sessionize(copies, order_copies.iloc[order_order], GAP)
    sessions = kept.sessions[["user_id", "start_ms", "pageview_count", "landing_url",
                              "order_count", "revenue_e4"]].to_numpy().tolist()
    assert sorted(sessions, key=repr) == sorted(
        [["u", 0, 1, None, 1, 3], ["u", 2 * GAP, 1, "/y", 0, 0]], key=repr)


def test_two_clients_may_use_one_id() -> None:
    """(E6) Ids are a client's: the same event_id or order_id from another client is another
    event, counted in that client's session."""
    both = pd.concat([pageviews(("a", 0)), pageviews(("a", 5)).assign(client_id="d")])
    result = sessionize(both, pd.concat([orders(("o", 1, 5)),
                                         orders(("o", 6, 7)).assign(client_id="d")]), GAP)
    assert sorted(result.sessions[["client_id", "pageview_count", "order_count",
                                   "revenue_e4"]].to_numpy().tolist()) == [
        ["c", 1, 1, 5], ["d", 1, 1, 7]]
    assert result.attributions["session_id"].notna().all()


def test_order_exactly_at_end_plus_gap_is_unattributed() -> None:
    result = sessionize(
        pageviews(("a", 0), ("b", 60_000)),
        orders(("inside", 60_000 + GAP - 1, 105_000), ("outside", 60_000 + GAP, 30_000),
               ("before", -1, 10_000)),
        GAP,
    )
    by_order = dict(zip(result.attributions.order_id, result.attributions.session_id,
                        strict=True))
    assert by_order["inside"] == result.sessions.session_id[0]
    assert by_order["outside"] is None and by_order["before"] is None
    assert (result.sessions.order_count[0], result.sessions.revenue_e4[0]) == (1, 105_000)


LARGEST_AMOUNT_E4 = 10**16 - 1  # 999999999999.9999, the contract's largest amount


def test_a_session_at_the_largest_revenue_it_can_hold_is_exact() -> None:
    """922 orders at the largest amount fit 64 bits; the loud check below must not fire."""
    count = REVENUE_E4_MAX // LARGEST_AMOUNT_E4
    result = sessionize(pageviews(("a", 0)), orders(
        *((f"o{i}", i, LARGEST_AMOUNT_E4) for i in range(count))), GAP)
    assert (result.sessions.order_count[0], result.sessions.revenue_e4[0]) == (
        count, count * LARGEST_AMOUNT_E4)


def test_a_session_revenue_past_64_bits_stops_loudly_instead_of_wrapping() -> None:
    """The int64 sum wrapped to a negative revenue, which was then stored and published."""
    count = REVENUE_E4_MAX // LARGEST_AMOUNT_E4 + 1
    big = orders(*((f"o{i}", i, LARGEST_AMOUNT_E4) for i in range(count)))
    with pytest.raises(RevenueOverflowError, match=(
            r"^session [0-9a-f]+: its attributed orders add up to 922999999999999\.9077, "
            r"above the largest revenue a session can hold \(922337203685477\.5807: ")):
        sessionize(pageviews(("a", 0)), big, GAP)


def test_orders_do_not_move_boundaries() -> None:
    result = sessionize(pageviews(("a", 0)), orders(("o", 60_000, 1)), GAP)
    assert spans(result) == [(0, 0, 1)]
    assert result.sessions.order_count[0] == 1


def test_orders_of_other_users_are_not_attributed() -> None:
    result = sessionize(pageviews(("a", 0, "other")), orders(("o", 10, 1)), GAP)
    assert result.attributions.session_id[0] is None


def test_orders_find_their_session_when_users_times_span_more_than_64_bits() -> None:
    """Users x time span beyond 2**63 (a recompute bucket of millions of users, or epoch
    milliseconds far apart): one sortable number per (user, time) would wrap around."""
    far = 4 * 10**18
    views = pageviews(("a", -far, "u1"), ("b", far, "u2"), ("c", far + 5, "u3"))
    bought = orders(("o1", far + 1, 1), ("o2", -far + 7, 1), ("o3", far + 6, 1))
    bought["user_id"] = ["u2", "u1", "u3"]

    result = sessionize(views, bought, GAP)

    by_user = dict(zip(result.sessions.user_id, result.sessions.session_id, strict=True))
    got = dict(zip(result.attributions.order_id, result.attributions.session_id, strict=True))
    assert got == {"o1": by_user["u2"], "o2": by_user["u1"], "o3": by_user["u3"]}


def test_session_closes_when_watermark_reaches_end_plus_gap() -> None:
    sessions = sessionize(pageviews(("a", 0)), NO_ORDERS, GAP).sessions
    assert not closed_sessions(sessions, GAP - 1, GAP)[0]
    assert closed_sessions(sessions, GAP, GAP)[0]
    # An uncovered order once the watermark passes its millisecond (E7).
    assert next_wakeup(sessions, orders(("o", 5, 1)), GAP) == 6


def test_session_id_is_deterministic_and_distinct_per_user() -> None:
    assert session_id("c", "u", 1) == session_id("c", "u", 1)
    assert session_id("c", "u", 1) != session_id("c", "v", 1)
    assert len(session_id("c", "u", 1)) == 32


def naive_sessions(ts_by_user: dict[str, list[int]]) -> list[tuple[str, int, int, int]]:
    """Straightforward reference: sort, split on gap."""
    out = []
    for user, values in ts_by_user.items():
        values = sorted(values)
        start = prev = values[0]
        count = 1
        for ts in values[1:]:
            if ts - prev >= GAP:
                out.append((user, start, prev, count))
                start, count = ts, 0
            prev = ts
            count += 1
        out.append((user, start, prev, count))
    return sorted(out)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("uvw"), st.integers(0, 8 * GAP)), max_size=40))
def test_matches_a_straightforward_reference(events: list[tuple[str, int]]) -> None:
    frame = pageviews(*((f"e{i}", ts, user) for i, (user, ts) in enumerate(events)))
    result = sessionize(frame, NO_ORDERS, GAP)
    by_user: dict[str, list[int]] = {}
    for user, ts in events:
        by_user.setdefault(user, []).append(ts)
    got = sorted(zip(result.sessions.user_id, result.sessions.start_ms, result.sessions.end_ms,
                     result.sessions.pageview_count, strict=True))
    assert got == (naive_sessions(by_user) if events else [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("uv"), st.integers(0, 6 * GAP)), min_size=1,
                max_size=30),
       st.lists(st.tuples(st.sampled_from("uvw"), st.integers(-GAP, 7 * GAP),
                          st.integers(0, 10**9), st.integers(0, 5)), max_size=20))
def test_reattributing_orders_equals_sessionizing_with_them(
        views: list[tuple[str, int]], order_rows: list[tuple[str, int, int, int]]) -> None:
    """The orders-only correction's path: orders over sessions computed without them give the
    sessions and attributions a from-scratch run with them gives (duplicates included)."""
    page = pd.DataFrame([("c", u, f"e{i}", ts, f"/{i}") for i, (u, ts) in enumerate(views)],
                        columns=PAGEVIEW_COLUMNS).astype({"ts_ms": "int64"})
    order = pd.DataFrame([("c", u, f"o{n}", ts, amount, "EUR")
                          for u, ts, amount, n in order_rows],
                         columns=ORDER_COLUMNS).astype({"ts_ms": "int64", "amount_e4": "int64"})
    expected = sessionize(page, order, GAP)
    bare = sessionize(page, NO_ORDERS, GAP).sessions
    sessions, attributions = reattribute(
        bare[["client_id", "user_id", "session_id", "start_ms", "end_ms"]], order, GAP)

    def by_id(frame: pd.DataFrame, key: str, columns: list[str]) -> dict:
        return {row[key]: tuple(row[c] for c in columns) for row in frame.to_dict("records")}

    totals = ["order_count", "revenue_e4"]
    assert by_id(sessions, "session_id", totals) == by_id(expected.sessions, "session_id", totals)
    assert by_id(attributions, "order_id", ["session_id"]) == by_id(
        expected.attributions, "order_id", ["session_id"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("cd"), st.sampled_from("uv"), st.integers(0, 6 * GAP)),
                min_size=1, max_size=30),
       st.lists(st.tuples(st.sampled_from("cde"), st.sampled_from("uvw"),
                          st.integers(-GAP, 7 * GAP), st.integers(0, 10**9)), max_size=20))
def test_order_totals_and_attributions_match_a_straightforward_reference(
        views: list[tuple[str, str, int]], order_rows: list[tuple[str, str, int, int]]) -> None:
    """Order counts, revenue and each order's session against the naive reference, one order
    at a time (two clients share user ids, so a user's orders must not reach the other
    client's sessions)."""
    events = [{"event_type": "pageview", "client_id": c, "user_id": u, "event_id": f"e{i}",
               "ts_ms": ts, "url": f"/{i}"} for i, (c, u, ts) in enumerate(views)]
    events += [{"event_type": "order", "client_id": c, "user_id": u, "order_id": f"o{i}",
                "ts_ms": ts, "amount": Decimal(amount) / 10_000}
               for i, (c, u, ts, amount) in enumerate(order_rows)]
    page = pd.DataFrame([(e["client_id"], e["user_id"], e["event_id"], e["ts_ms"], e["url"])
                         for e in events if e["event_type"] == "pageview"],
                        columns=PAGEVIEW_COLUMNS).astype({"ts_ms": "int64"})
    order = pd.DataFrame([(c, u, f"o{i}", ts, amount, "EUR")
                          for i, (c, u, ts, amount) in enumerate(order_rows)],
                         columns=ORDER_COLUMNS).astype({"ts_ms": "int64", "amount_e4": "int64"})
    result = sessionize(page, order, GAP)
    expected, owners = reference_sessions(events, GAP)
    assert {row["session_id"]: (row["order_count"], row["revenue_e4"])
            for row in result.sessions.to_dict("records")} == {
        sid: (s["order_count"], int(s["revenue"] * 10_000)) for sid, s in expected.items()}
    assert dict(zip(result.attributions.order_id, result.attributions.session_id,
                    strict=True)) == owners


def fold_spans(chunks: list[pd.DataFrame]) -> pd.DataFrame:
    """What the stream does: merge each arrival into the spans merged so far."""
    state = merge_spans(pageview_spans(pageviews()), GAP)
    for chunk in chunks:
        new = pageview_spans(chunk)
        state = merge_spans({c: np.concatenate([state[c].to_numpy(), new[c]])
                             for c in SPAN_COLUMNS}, GAP)
    return state


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("uv"), st.integers(0, 24)), min_size=1, max_size=40),
       st.lists(st.integers(1, 8), min_size=1), st.randoms(use_true_random=False))
def test_folding_spans_in_any_grouping_equals_merging_everything(
        events: list[tuple[str, int]], chunk_sizes: list[int], shuffle) -> None:
    """Spans are associative (the stream's state relies on it), ties and exact gaps included:
    timestamps on a GAP/4 grid make equal times and gaps of exactly GAP common."""
    rows = [(f"e{i:02d}", step * GAP // 4, user) for i, (user, step) in enumerate(events)]
    shuffle.shuffle(rows)
    frame = pageviews(*rows)
    sizes = iter(chunk_sizes * len(rows))
    chunks, start = [], 0
    while start < len(frame):
        size = next(sizes)
        chunks.append(frame.iloc[start: start + size])
        start += size
    everything = merge_spans(pageview_spans(frame), GAP)
    key = ["user_id", "start_ms"]
    assert fold_spans(chunks).sort_values(key).reset_index(drop=True).equals(
        everything.sort_values(key).reset_index(drop=True))

    # Landing and exit are the earliest and latest (ts, event_id) of each session (E1).
    for session in everything.itertuples():
        members = [(ts, eid) for eid, ts, user in rows
                   if user == session.user_id and session.start_ms <= ts <= session.end_ms]
        assert (session.landing_event_id, session.exit_event_id) == (
            min(members)[1], max(members)[1])
        assert session.pageview_count == len(members)
