"""Session semantics: the one definition, shared by the stream and the batch recompute.

Pure Python: no pyspark, kafka or deltalake imports. Spark applies these functions through two
adapters (``stream_adapter`` for the streaming stateful processor, ``batch_adapter`` for the
recompute); a property test proves both give the same sessions.

Rules (../shared/BRIEF.md, "Session semantics"):
  per (client_id, user_id), pageviews ordered by ``ts``; a new session starts when the gap to
  the previous pageview is >= the session gap. An order belongs to the session of the same user
  with ``session_start <= order.ts < session_end + gap``, else it is unattributed.

Known edge cases, cited inline as (E1)..(E6):
  E1. Pageviews with equal ``ts``: ordered by ``event_id`` so landing/exit URLs are deterministic.
  E2. A gap of exactly ``gap_ms`` starts a new session; ``gap_ms - 1`` extends the current one.
  E3. A pageview earlier than a session's start extends it backwards (and changes its id, since
      the id is derived from the start).
  E4. A pageview between two sessions closer than ``gap_ms`` to both merges them into one.
  E5. The attribution windows ``[start, end + gap)`` of one user's sessions never overlap
      (consecutive sessions are >= gap apart), so an order has at most one session.
  E6. A duplicate pageview (same ``event_id``) or order (same ``order_id``) changes nothing;
      the first one seen wins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal

SESSION_ID_VERSION = "v1"


@dataclass(frozen=True, slots=True)
class Pageview:
    """One valid pageview of a user; ``ts_ms`` is the event's own time in epoch milliseconds."""

    event_id: str
    ts_ms: int
    url: str | None = None

    @property
    def sort_key(self) -> tuple[int, str]:
        return (self.ts_ms, self.event_id)  # (E1)


@dataclass(frozen=True, slots=True)
class Order:
    """One order of a user; ``amount`` is exact (parsed from a decimal string)."""

    order_id: str
    ts_ms: int
    amount: Decimal
    currency: str | None = None


@dataclass(frozen=True, slots=True)
class Session:
    """A session under construction or complete; ``event_ids`` let the stream drop duplicates."""

    start_ms: int
    end_ms: int
    pageview_count: int
    landing: Pageview
    exit: Pageview
    event_ids: frozenset[str] = field(default_factory=frozenset)
    orders: tuple[Order, ...] = ()

    @property
    def order_count(self) -> int:
        return len(self.orders)

    @property
    def revenue(self) -> Decimal:
        return sum((order.amount for order in self.orders), Decimal(0))

    def covers(self, ts_ms: int, gap_ms: int) -> bool:
        """True when an order at ``ts_ms`` belongs to this session."""
        return self.start_ms <= ts_ms < self.end_ms + gap_ms

    def closes_at(self, gap_ms: int) -> int:
        """Watermark at and after which no on-time pageview can change this session."""
        return self.end_ms + gap_ms


def session_id(client_id: str, user_id: str, start_ms: int) -> str:
    """Deterministic id, so reruns and stream vs batch agree on it."""
    raw = f"{SESSION_ID_VERSION}\x1f{client_id}\x1f{user_id}\x1f{start_ms}".encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _single(pageview: Pageview) -> Session:
    return Session(
        start_ms=pageview.ts_ms,
        end_ms=pageview.ts_ms,
        pageview_count=1,
        landing=pageview,
        exit=pageview,
        event_ids=frozenset((pageview.event_id,)),
    )


def _combine(first: Session, second: Session) -> Session:
    return Session(
        start_ms=min(first.start_ms, second.start_ms),
        end_ms=max(first.end_ms, second.end_ms),
        pageview_count=first.pageview_count + second.pageview_count,
        landing=min(first.landing, second.landing, key=lambda p: p.sort_key),
        exit=max(first.exit, second.exit, key=lambda p: p.sort_key),
        event_ids=first.event_ids | second.event_ids,
        orders=first.orders + second.orders,
    )


def add_pageviews(
    sessions: Sequence[Session], pageviews: Iterable[Pageview], gap_ms: int
) -> list[Session]:
    """Fold new pageviews into one user's sessions; returns them sorted by start.

    Treats every session and every new pageview as an interval and merges neighbours closer
    than the gap. Within a session consecutive pageviews are already < gap apart, so this equals
    sessionizing all underlying pageviews from scratch (E2, E3, E4).
    """
    seen = set().union(*(s.event_ids for s in sessions)) if sessions else set()
    pieces = list(sessions)
    for pageview in pageviews:
        if pageview.event_id in seen:  # (E6)
            continue
        seen.add(pageview.event_id)
        pieces.append(_single(pageview))
    pieces.sort(key=lambda s: (s.start_ms, s.landing.event_id))
    merged: list[Session] = []
    for piece in pieces:
        if merged and piece.start_ms - merged[-1].end_ms < gap_ms:  # (E2)
            merged[-1] = _combine(merged[-1], piece)
        else:
            merged.append(piece)
    return merged


def attribute_orders(
    sessions: Sequence[Session], orders: Iterable[Order], gap_ms: int
) -> tuple[list[Session], list[Order]]:
    """Attach each order to the session covering it (E5); return the ones no session covers."""
    known = {o.order_id for s in sessions for o in s.orders}
    attached: dict[int, list[Order]] = {}
    unattributed: list[Order] = []
    starts = [s.start_ms for s in sessions]
    for order in sorted(orders, key=lambda o: (o.ts_ms, o.order_id)):
        if order.order_id in known:  # (E6)
            continue
        known.add(order.order_id)
        index = _covering_index(sessions, starts, order.ts_ms, gap_ms)
        if index is None:
            unattributed.append(order)
        else:
            attached.setdefault(index, []).append(order)
    result = [
        replace(s, orders=s.orders + tuple(attached[i])) if i in attached else s
        for i, s in enumerate(sessions)
    ]
    return result, unattributed


def _covering_index(
    sessions: Sequence[Session], starts: list[int], ts_ms: int, gap_ms: int
) -> int | None:
    from bisect import bisect_right

    index = bisect_right(starts, ts_ms) - 1
    if index >= 0 and sessions[index].covers(ts_ms, gap_ms):
        return index
    return None


def split_closed(
    sessions: Sequence[Session], watermark_ms: int, gap_ms: int
) -> tuple[list[Session], list[Session]]:
    """Split into (closed, still open): closed once the watermark reaches end + gap."""
    closed = [s for s in sessions if s.closes_at(gap_ms) <= watermark_ms]
    still_open = [s for s in sessions if s.closes_at(gap_ms) > watermark_ms]
    return closed, still_open


def split_final_orders(
    pending: Sequence[Order], watermark_ms: int
) -> tuple[list[Order], list[Order]]:
    """Split uncovered orders into (finally unattributed, still pending).

    A session that could still cover an order must start at or before it; sessions that have
    not started yet start after the watermark, so an uncovered order at or before the watermark
    stays unattributed for the stream (a later recompute may still attribute it).
    """
    final = [o for o in pending if o.ts_ms <= watermark_ms]
    still_pending = [o for o in pending if o.ts_ms > watermark_ms]
    return final, still_pending


def sessionize(
    pageviews: Iterable[Pageview], orders: Iterable[Order], gap_ms: int
) -> tuple[list[Session], list[Order]]:
    """From-scratch sessions and unattributed orders of one user (the batch recompute's view)."""
    sessions = add_pageviews([], pageviews, gap_ms)
    return attribute_orders(sessions, orders, gap_ms)


def next_wakeup(sessions: Sequence[Session], pending: Sequence[Order], gap_ms: int) -> int | None:
    """Earliest watermark at which something of this user can be emitted, or None."""
    times = [s.closes_at(gap_ms) for s in sessions] + [o.ts_ms for o in pending]
    return min(times) if times else None
