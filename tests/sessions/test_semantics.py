"""Session semantics at their exact boundaries, without Spark."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from clickstream.sessions.semantics import (
    Order,
    Pageview,
    add_pageviews,
    attribute_orders,
    session_id,
    sessionize,
    split_closed,
    split_final_orders,
)

GAP = 30 * 60_000


def pv(event_id: str, ts_ms: int, url: str | None = None) -> Pageview:
    return Pageview(event_id, ts_ms, url or f"/{event_id}")


def spans(sessions) -> list[tuple[int, int, int]]:
    return [(s.start_ms, s.end_ms, s.pageview_count) for s in sessions]


def test_gap_exactly_starts_a_new_session() -> None:
    sessions = add_pageviews([], [pv("a", 0), pv("b", GAP)], GAP)
    assert spans(sessions) == [(0, 0, 1), (GAP, GAP, 1)]


def test_gap_minus_one_ms_extends_the_session() -> None:
    sessions = add_pageviews([], [pv("a", 0), pv("b", GAP - 1)], GAP)
    assert spans(sessions) == [(0, GAP - 1, 2)]


def test_backward_extension_moves_start_and_id() -> None:
    first = add_pageviews([], [pv("b", 10 * 60_000)], GAP)
    extended = add_pageviews(first, [pv("a", 0)], GAP)
    assert spans(extended) == [(0, 10 * 60_000, 2)]
    assert extended[0].landing.event_id == "a"
    assert session_id("c", "u", 0) != session_id("c", "u", 10 * 60_000)


def test_late_event_merges_two_sessions() -> None:
    two = add_pageviews([], [pv("a", 0), pv("c", 2 * GAP - 2)], GAP)
    assert len(two) == 2
    merged = add_pageviews(two, [pv("b", GAP - 1)], GAP)
    assert spans(merged) == [(0, 2 * GAP - 2, 3)]
    assert (merged[0].landing.url, merged[0].exit.url) == ("/a", "/c")


def test_equal_timestamps_order_by_event_id() -> None:
    sessions = add_pageviews([], [pv("z", 5), pv("m", 5)], GAP)
    assert (sessions[0].landing.event_id, sessions[0].exit.event_id) == ("m", "z")


def test_duplicate_pageview_changes_nothing() -> None:
    once = add_pageviews([], [pv("a", 0), pv("b", 60_000)], GAP)
    again = add_pageviews(once, [pv("a", 0), pv("b", 60_000)], GAP)
    assert again == once


def test_order_exactly_at_end_plus_gap_is_unattributed() -> None:
    sessions = add_pageviews([], [pv("a", 0), pv("b", 60_000)], GAP)
    inside = Order("o1", 60_000 + GAP - 1, Decimal("10.50"))
    outside = Order("o2", 60_000 + GAP, Decimal("3"))
    before = Order("o3", -1, Decimal("1"))
    attributed, unattributed = attribute_orders(sessions, [inside, outside, before], GAP)
    assert [o.order_id for o in attributed[0].orders] == ["o1"]
    assert attributed[0].revenue == Decimal("10.50")
    assert sorted(o.order_id for o in unattributed) == ["o2", "o3"]


def test_orders_do_not_move_boundaries() -> None:
    sessions, _ = sessionize([pv("a", 0)], [Order("o", 60_000, Decimal("1"))], GAP)
    assert spans(sessions) == [(0, 0, 1)]
    assert sessions[0].order_count == 1


def test_session_closes_when_watermark_reaches_end_plus_gap() -> None:
    sessions = add_pageviews([], [pv("a", 0)], GAP)
    assert split_closed(sessions, GAP - 1, GAP) == ([], sessions)
    assert split_closed(sessions, GAP, GAP) == (sessions, [])


def test_pending_order_is_final_once_watermark_passes_it() -> None:
    order = Order("o", 100, Decimal("1"))
    assert split_final_orders([order], 99) == ([], [order])
    assert split_final_orders([order], 100) == ([order], [])


def test_session_id_is_deterministic_and_distinct_per_user() -> None:
    assert session_id("c", "u", 1) == session_id("c", "u", 1)
    assert session_id("c", "u", 1) != session_id("c", "v", 1)
    assert len(session_id("c", "u", 1)) == 32


timestamps = st.integers(min_value=0, max_value=6 * GAP)


@given(st.lists(timestamps, max_size=30), st.randoms(use_true_random=False))
def test_incremental_folding_equals_from_scratch(ts_list: list[int], rnd) -> None:
    """Any split of the pageviews into arrival batches gives the from-scratch sessions."""
    pageviews = [pv(f"e{i}", ts) for i, ts in enumerate(ts_list)]
    expected, _ = sessionize(pageviews, [], GAP)
    shuffled = pageviews + pageviews[: len(pageviews) // 3]  # with duplicates
    rnd.shuffle(shuffled)
    sessions: list = []
    while shuffled:
        take = rnd.randint(1, len(shuffled))
        sessions = add_pageviews(sessions, shuffled[:take], GAP)
        shuffled = shuffled[take:]
    assert spans(sessions) == spans(expected)
    assert [(s.landing, s.exit) for s in sessions] == [(s.landing, s.exit) for s in expected]
