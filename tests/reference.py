"""A deliberately naive, independent re-implementation of the brief's session rules.

Tests compare the product against this instead of against its own ``semantics`` module, so a
mistake shared by the stream and the batch recompute would still be caught.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from decimal import Decimal
from typing import Any

from clickstream.events.contract import CURRENCIES, ID_MAX_BYTES, URL_MAX_BYTES


def reference_session_id(client_id: str, user_id: str, start_ms: int) -> str:
    return hashlib.sha256(f"v1\x1f{client_id}\x1f{user_id}\x1f{start_ms}".encode()).hexdigest()[
        :32]


def ts_ms(value: Any) -> int | None:
    """Epoch ms of an ``int`` or ISO-8601-with-zone string; None if not a valid event time."""
    from datetime import datetime

    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.isdigit():
            return int(value)
        try:
            parsed = datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        except ValueError:
            return None
        if parsed.tzinfo is None:
            return None
        return int(parsed.timestamp() * 1000)
    return None


def valid_events(records: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    """The records the contract accepts, first occurrence of each id only."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for key, raw in records:
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if any(not event.get(f) for f in ("event_id", "client_id", "user_id", "event_type")):
            continue
        ids = str(event["client_id"]) + str(event["user_id"])
        if (any(ord(c) < 32 or ord(c) == 127 for c in ids)
                or str(event["client_id"]) != str(event["client_id"]).strip()):
            continue  # a client no command could name, or ids a session id could not separate
        if any(len(str(event.get(f, "")).encode()) > ID_MAX_BYTES
               for f in ("event_id", "user_id", "order_id")):
            continue
        ms = ts_ms(event.get("ts"))
        if ms is None or not (946_684_800_000 <= ms < 4_102_444_800_000):
            continue
        if key is not None and key != f"{event['client_id']}/{event['user_id']}":
            continue
        if event["event_type"] == "pageview" and (
                not event.get("url") or len(str(event["url"]).encode()) > URL_MAX_BYTES):
            continue
        if event["event_type"] == "order":
            try:
                amount = Decimal(str(event.get("amount")))
            except ArithmeticError:
                continue
            if (not 0 <= amount < 10**12  # at most 12 digits before the point
                    or event.get("currency") not in CURRENCIES or not event.get("order_id")):
                continue
        ident = event["order_id"] if event["event_type"] == "order" else event["event_id"]
        identity = (event["client_id"], event["event_type"], ident)  # ids are a client's
        if identity in seen:
            continue
        seen.add(identity)
        out.append({**event, "ts_ms": ms})
    return out


def reference_sessions(
    events: list[dict[str, Any]], gap_ms: int
) -> tuple[dict[str, dict[str, Any]], dict[str, str | None]]:
    """(sessions by id, order_id -> session_id) over every given pageview and order."""
    by_user: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["event_type"] == "pageview":
            by_user[(event["client_id"], event["user_id"])].append(event)
    sessions: dict[str, dict[str, Any]] = {}
    windows: dict[tuple[str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for (client, user), pageviews in by_user.items():
        pageviews.sort(key=lambda e: (e["ts_ms"], e["event_id"]))
        current: list[dict[str, Any]] = []
        for pageview in [*pageviews, None]:
            if current and (pageview is None
                            or pageview["ts_ms"] - current[-1]["ts_ms"] >= gap_ms):
                start, end = current[0]["ts_ms"], current[-1]["ts_ms"]
                sid = reference_session_id(client, user, start)
                sessions[sid] = {
                    "session_id": sid, "client_id": client, "user_id": user, "start_ms": start,
                    "end_ms": end, "pageview_count": len(current),
                    "landing_url": current[0]["url"], "exit_url": current[-1]["url"],
                    "order_count": 0, "revenue": Decimal(0),
                }
                windows[(client, user)].append((start, end, sid))
                current = []
            if pageview is not None:
                current.append(pageview)
    attributions: dict[str, str | None] = {}
    for event in events:
        if event["event_type"] != "order":
            continue
        owner = None
        for start, end, sid in windows[(event["client_id"], event["user_id"])]:
            if start <= event["ts_ms"] < end + gap_ms:
                owner = sid
        attributions[event["order_id"]] = owner
        if owner:
            sessions[owner]["order_count"] += 1
            sessions[owner]["revenue"] += Decimal(str(event["amount"]))
    return sessions, attributions


def reference_changelog_value(row: Any) -> dict[str, Any]:
    """A table row (Spark Row or mapping) as the changelog topics should carry it, parsed:
    timestamps ISO-8601 UTC with milliseconds, dates ISO, decimals as text, nulls kept."""
    from datetime import UTC, date, datetime

    def jsonable(value: Any) -> Any:
        if isinstance(value, datetime):
            moment = value if value.tzinfo else value.replace(tzinfo=UTC)
            return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z")
        if isinstance(value, date):
            return value.isoformat()
        if isinstance(value, Decimal):
            return str(value)
        return value

    data = row.asDict() if hasattr(row, "asDict") else dict(row)
    return {key: jsonable(value) for key, value in data.items()}
