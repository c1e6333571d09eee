"""Session semantics: the one definition, shared by the stream and the batch recompute.

Pure and vectorised (pandas/numpy only; no pyspark, kafka or deltalake imports), so Spark can
apply it to whole Arrow batches of many users at once. Two adapters use it: the stream's
stateful processor (``stream_adapter``) and the batch recompute (``batch_adapter``); a
property test proves they agree.

Rules (../shared/BRIEF.md, "Session semantics"):
  per (client_id, user_id), pageviews ordered by ``ts``; a new session starts when the gap to
  the previous pageview is >= the session gap. An order belongs to the session of the same user
  with ``session_start <= order.ts < session_end + gap``, else it is unattributed.

Known edge cases, cited inline as (E1)..(E7):
  E1. Pageviews with equal ``ts`` are ordered by ``event_id`` so landing/exit URLs are
      deterministic.
  E2. A gap of exactly ``gap_ms`` starts a new session; ``gap_ms - 1`` extends the current one.
  E3. A pageview earlier than a session's start extends it backwards; the session id, derived
      from the start, changes with it.
  E4. A pageview between two sessions closer than ``gap_ms`` to both merges them into one.
  E5. The attribution windows ``[start, end + gap)`` of one user's sessions never overlap
      (consecutive sessions are >= gap apart), so an order has at most one session.
  E6. Duplicates (same ``event_id`` / ``order_id``) count once; the first occurrence wins.
  E7. A session is final once the watermark reaches ``end + gap``, and an uncovered order once
      the watermark reaches its ``ts``: no later on-time pageview (ts > watermark) can touch
      them. Later changes are the recompute's job.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

SESSION_ID_VERSION = "v1"
AMOUNT_SCALE = 10_000  # amounts travel as exact integers of 1/10000 (DECIMAL(20,4))

PAGEVIEW_COLUMNS = ["client_id", "user_id", "event_id", "ts_ms", "url"]
ORDER_COLUMNS = ["client_id", "user_id", "order_id", "ts_ms", "amount_e4", "currency"]
SESSION_COLUMNS = [
    "client_id", "user_id", "session_id", "start_ms", "end_ms", "pageview_count",
    "landing_url", "exit_url", "order_count", "revenue_e4",
]
ATTRIBUTION_COLUMNS = ["client_id", "user_id", "order_id", "ts_ms", "session_id"]


def session_id(client_id: str, user_id: str, start_ms: int) -> str:
    """Deterministic id, so reruns and stream vs batch agree on it."""
    raw = f"{SESSION_ID_VERSION}\x1f{client_id}\x1f{user_id}\x1f{int(start_ms)}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def empty_pageviews() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="int64" if c == "ts_ms" else object)
                         for c in PAGEVIEW_COLUMNS})


def empty_orders() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="int64" if c in ("ts_ms", "amount_e4") else object)
                         for c in ORDER_COLUMNS})


@dataclass(frozen=True)
class Sessionized:
    """Result for a set of users: sessions, each pageview's session, each order's session."""

    sessions: pd.DataFrame  # SESSION_COLUMNS, one row per session
    pageview_session: pd.Series  # session_id per input pageview row (aligned to its index)
    attributions: pd.DataFrame  # ATTRIBUTION_COLUMNS, session_id None when unattributed


def dedupe(frame: pd.DataFrame, key: str) -> pd.DataFrame:
    """First occurrence of each key wins (E6)."""
    return frame[~frame[key].duplicated(keep="first")]


def sessionize(pageviews: pd.DataFrame, orders: pd.DataFrame, gap_ms: int) -> Sessionized:
    """From-scratch sessions of every user present in ``pageviews`` and ``orders``.

    ``pageviews`` has PAGEVIEW_COLUMNS, ``orders`` ORDER_COLUMNS; duplicates are dropped (E6).
    """
    pageviews = dedupe(pageviews, "event_id")
    orders = dedupe(orders, "order_id")
    ordered = pageviews.iloc[_user_time_order(pageviews)]
    client = ordered["client_id"].to_numpy()
    user = ordered["user_id"].to_numpy()
    ts = ordered["ts_ms"].to_numpy(dtype=np.int64)
    n = len(ordered)
    new_user = np.ones(n, dtype=bool)
    if n:
        new_user[1:] = (client[1:] != client[:-1]) | (user[1:] != user[:-1])
    gap_before = np.empty(n, dtype=np.int64)
    if n:
        gap_before[0] = 0
        gap_before[1:] = ts[1:] - ts[:-1]
    starts = new_user | (gap_before >= gap_ms)  # (E2)
    number = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.r_[first[1:] - 1, n - 1] if n else first
    start_ms = ts[first]
    ids = np.array(
        [session_id(c, u, s) for c, u, s in zip(client[first], user[first], start_ms,
                                                 strict=True)],
        dtype=object,
    )
    url = ordered["url"].to_numpy()
    sessions = pd.DataFrame({
        "client_id": client[first],
        "user_id": user[first],
        "session_id": ids,
        "start_ms": start_ms,
        "end_ms": ts[last] if n else ts[first],
        "pageview_count": (last - first + 1).astype(np.int64),
        "landing_url": url[first],
        "exit_url": url[last] if n else url[first],
    })
    pageview_session = pd.Series(ids[number] if n else [], index=ordered.index, dtype=object)
    attributions = attribute(sessions, orders, gap_ms)
    return Sessionized(with_order_totals(sessions, attributions, orders),
                       pageview_session.reindex(pageviews.index), attributions)


def reattribute(sessions: pd.DataFrame, orders: pd.DataFrame, gap_ms: int
                ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(sessions with new ``order_count`` / ``revenue_e4``, attributions) for ``orders`` over
    sessions whose boundaries are known: orders never move them, so an orders-only correction
    needs no pageviews. ``sessions`` needs client_id, user_id, session_id, start_ms, end_ms;
    its other SESSION_COLUMNS are passed through (None where absent)."""
    orders = dedupe(orders, "order_id")
    attributions = attribute(sessions, orders, gap_ms)
    known = sessions.assign(**{c: None for c in SESSION_COLUMNS if c not in sessions})
    return with_order_totals(known, attributions, orders), attributions


def with_order_totals(sessions: pd.DataFrame, attributions: pd.DataFrame,
                      orders: pd.DataFrame) -> pd.DataFrame:
    """``sessions`` (SESSION_COLUMNS) with ``order_count`` and ``revenue_e4``: how many of
    ``orders`` (one row per order_id) are attributed to each, and the sum of their amounts."""
    counts = attributions.dropna(subset=["session_id"]).merge(
        orders[["order_id", "amount_e4"]], on="order_id", how="left"
    ).groupby("session_id").agg(order_count=("order_id", "size"), revenue_e4=("amount_e4", "sum"))
    sessions = sessions.drop(columns=["order_count", "revenue_e4"], errors="ignore").join(
        counts, on="session_id")
    sessions["order_count"] = sessions["order_count"].fillna(0).astype(np.int64)
    sessions["revenue_e4"] = sessions["revenue_e4"].fillna(0).astype(np.int64)
    return sessions[SESSION_COLUMNS].reset_index(drop=True)


def _user_time_order(pageviews: pd.DataFrame) -> np.ndarray:
    """Row order grouping each user's pageviews by time, ties broken by event_id (E1).

    Sorting integer codes is ~5x faster than sorting the string columns; users only need to
    be contiguous, not in any particular order.
    """
    clients, _ = pd.factorize(pageviews["client_id"].to_numpy())
    users, _ = pd.factorize(pageviews["user_id"].to_numpy())
    ts = pageviews["ts_ms"].to_numpy(dtype=np.int64)
    order = np.lexsort((ts, users, clients))
    if len(order) < 2:
        return order
    tied = (users[order][1:] == users[order][:-1]) & (clients[order][1:] == clients[order][:-1]) & (
        ts[order][1:] == ts[order][:-1])
    if tied.any():  # rare: equal timestamps of one user, order them by event_id
        event_ids = pageviews["event_id"].to_numpy()
        starts = np.flatnonzero(np.r_[True, ~tied])
        ends = np.r_[starts[1:], len(order)]
        for start, end in zip(starts, ends, strict=True):
            if end - start > 1:
                block = order[start:end]
                order[start:end] = block[np.argsort(event_ids[block], kind="stable")]
    return order


def attribute(sessions: pd.DataFrame, orders: pd.DataFrame, gap_ms: int) -> pd.DataFrame:
    """Session of each order: same user, ``start <= ts < end + gap`` (E5), else None."""
    result = orders[["client_id", "user_id", "order_id", "ts_ms"]].copy()
    result["session_id"] = None
    if sessions.empty or orders.empty:
        return result[ATTRIBUTION_COLUMNS].reset_index(drop=True)
    key_s = sessions["client_id"].astype(str) + "\x1f" + sessions["user_id"].astype(str)
    key_o = result["client_id"].astype(str) + "\x1f" + result["user_id"].astype(str)
    codes, _ = pd.factorize(pd.concat([key_s, key_o], ignore_index=True))
    code_s, code_o = codes[: len(key_s)].astype(np.int64), codes[len(key_s):].astype(np.int64)
    order = np.lexsort((sessions["start_ms"].to_numpy(), code_s))
    by_start = sessions.iloc[order]
    code_s = code_s[order]
    # One sortable number per (user, time): the user's code above, the time below.
    base = int(min(by_start["start_ms"].min(), result["ts_ms"].min()))
    width = int(max(by_start["end_ms"].max(), result["ts_ms"].max())) - base + 1
    s_pos = code_s * width + (by_start["start_ms"].to_numpy(dtype=np.int64) - base)
    o_pos = code_o * width + (result["ts_ms"].to_numpy(dtype=np.int64) - base)
    index = np.searchsorted(s_pos, o_pos, side="right") - 1
    valid = index >= 0
    candidate = np.where(valid, index, 0)
    same_user = valid & (code_s[candidate] == code_o)
    ends = by_start["end_ms"].to_numpy()[candidate]
    covered = same_user & (result["ts_ms"].to_numpy() < ends + gap_ms)
    ids = by_start["session_id"].to_numpy()[candidate]
    result["session_id"] = np.where(covered, ids, None)
    return result[ATTRIBUTION_COLUMNS].reset_index(drop=True)


def closed_sessions(sessions: pd.DataFrame, watermark_ms: int, gap_ms: int) -> np.ndarray:
    """Mask of sessions no on-time pageview can change any more (E7)."""
    return (sessions["end_ms"].to_numpy(dtype=np.int64) + gap_ms) <= watermark_ms


def next_wakeup(
    open_sessions: pd.DataFrame, uncovered_orders: pd.DataFrame, gap_ms: int
) -> int | None:
    """Earliest watermark at which something of these users can be emitted, or None."""
    times = [int(open_sessions["end_ms"].min()) + gap_ms] if len(open_sessions) else []
    if len(uncovered_orders):
        times.append(int(uncovered_orders["ts_ms"].min()))
    return min(times) if times else None
