"""The data generator at the edges: scales too small for any session still give (empty)
tables with the full schema, and a seed reproduces the same data."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from clickstream.jobs.generate import Scale, simulate

START = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.mark.parametrize(("users", "minutes"), [(0, 60), (1, 0.01), (2, 5)])
def test_scales_without_sessions_give_empty_tables(users: int, minutes: float) -> None:
    pageviews, orders = simulate(Scale(clients=1, users_per_client=users, minutes=minutes,
                                       start=START), seed=1)
    assert (pageviews.num_rows, orders.num_rows) == (0, 0)
    assert pageviews.column_names == ["event_id", "client_id", "user_id", "ts", "url",
                                      "referrer"]
    assert orders.column_names == ["order_id", "client_id", "user_id", "ts", "amount",
                                   "currency"]


def test_a_seed_reproduces_the_data_and_orders_follow_pageviews() -> None:
    scale = Scale(clients=2, users_per_client=5, minutes=24 * 60, start=START,
                  order_probability=0.5)
    first, again = simulate(scale, seed=3), simulate(scale, seed=3)
    assert first[0].equals(again[0]) and first[1].equals(again[1])
    pageviews, orders = first
    assert pageviews.num_rows > 0 and orders.num_rows > 0
    users_with_pageviews = set(zip(pageviews["client_id"].to_pylist(),
                                   pageviews["user_id"].to_pylist(), strict=True))
    assert set(zip(orders["client_id"].to_pylist(), orders["user_id"].to_pylist(),
                   strict=True)) <= users_with_pageviews
