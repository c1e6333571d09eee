"""Realistic synthetic clickstream data: live events for Kafka and historical batches for backfills.

Everything is a deterministic function of ``seed`` and the scale flags, so a test or benchmark
can regenerate exactly the data it measured. The flags are part of the seed (``_rng``): another
day, period or client with the same ``seed`` gets other ids, never the same ones again.
Vectorised with numpy: 10 million pageviews take seconds, not minutes.

Model: each user has sessions at random times; a session is 1 + Geometric pageviews spaced by
exponential think times (well under the session gap); some sessions end in an order. Live data
is then delivered the way real trackers deliver it: slightly out of order, a few events very
late (beyond the watermark), some duplicates (retries) and some malformed records.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import pyarrow as pa

from clickstream.config import Config, unreadable_path_reason
from clickstream.errors import ConfigError

T = TypeVar("T")

URL_PATHS = ("/", "/search", "/products", "/products/{n}", "/cart", "/checkout", "/blog/{n}",
             "/account", "/help", "/pricing")
REFERRERS = ("https://www.google.com/", "https://news.ycombinator.com/", "https://t.co/x",
             "https://www.bing.com/", "")
CURRENCY_BY_CLIENT = ("EUR", "USD", "GBP", "JPY", "CHF")
FileFormat = Literal["parquet", "csv", "jsonl"]


@dataclass(frozen=True)
class Scale:
    """How much data: clients, users per client, event-time span and activity."""

    clients: int = 3
    users_per_client: int = 50
    start: datetime = datetime(2026, 11, 1, tzinfo=UTC)
    minutes: float = 24 * 60
    sessions_per_user_per_day: float = 2.0
    mean_think_seconds: float = 90.0
    order_probability: float = 0.08


@dataclass(frozen=True)
class Delivery:
    """How live events reach Kafka: jitter, lateness, duplicates and bad records."""

    jitter_seconds: float = 30.0
    late_fraction: float = 0.01
    late_minutes: float = 180.0
    duplicate_fraction: float = 0.02
    bad_fraction: float = 0.01


def client_ids(count: int) -> list[str]:
    return [f"client-{i:02d}" for i in range(count)]


def client_currency(client_id: str) -> str:
    """A client's one currency, the same whichever command generates its data: ``history``
    of one client (a scale of its own) gave every client but the first three EUR, so its
    orders' revenue mixed with the live orders' JPY or CHF."""
    numbered = re.fullmatch(r"client-(\d+)", client_id)
    index = int(numbered[1]) if numbered else zlib.crc32(client_id.encode())
    return CURRENCY_BY_CLIENT[index % len(CURRENCY_BY_CLIENT)]


def _hex_ids(rng: np.random.Generator, count: int, prefix: str) -> np.ndarray:
    raw = rng.integers(0, 2**63 - 1, size=(count, 2), dtype=np.int64)
    return np.array([f"{prefix}{a:016x}{b:016x}" for a, b in raw], dtype=object)


def _url(rng: np.random.Generator, count: int) -> np.ndarray:
    paths = np.array(URL_PATHS, dtype=object)[rng.integers(0, len(URL_PATHS), count)]
    numbers = rng.integers(1, 500, count)
    return np.array(
        [f"https://shop.example{p.replace('{n}', str(n))}" for p, n in zip(paths, numbers,
                                                                         strict=True)],
        dtype=object,
    )


def _rng(seed: int, scale: Scale, clients: list[str]) -> np.random.Generator:
    """Seeded by ``seed`` and what is generated: ids drawn from ``seed`` alone came out the same
    for every ``--start`` and client, so a second day's events (or another client's history)
    repeated the first one's event and order ids, and the tables held each id twice."""
    what = zlib.crc32(repr((_as_values(scale), clients)).encode())
    return np.random.default_rng([seed, what])


def _as_values(scale: Scale) -> Scale:
    """The scale by its values, in the forms of its defaults (whole minutes an int, the start in
    UTC): ``--minutes 1440`` parses as a float where the default is an int, and a ``--start`` in
    another zone is the same instant, yet either seeded other data than the default it equals.
    The defaults' forms keep the data generated before the same."""
    minutes = float(scale.minutes)
    return replace(
        scale, clients=int(scale.clients), users_per_client=int(scale.users_per_client),
        start=scale.start.astimezone(UTC),
        minutes=int(minutes) if minutes.is_integer() else minutes,
        sessions_per_user_per_day=float(scale.sessions_per_user_per_day),
        mean_think_seconds=float(scale.mean_think_seconds),
        order_probability=float(scale.order_probability))


def simulate(scale: Scale, seed: int, client: str | None = None) -> tuple[pa.Table, pa.Table]:
    """Pageviews and orders in event time (no delivery effects). One client, or all of them."""
    clients = [client] if client else client_ids(scale.clients)
    rng = _rng(seed, scale, clients)
    start_ms = int(scale.start.timestamp() * 1000)
    span_ms = int(scale.minutes * 60_000)
    days = scale.minutes / (24 * 60)

    users = np.array([f"user-{u:05d}" for u in range(scale.users_per_client)], dtype=object)
    user_client = np.repeat(np.array(clients, dtype=object), len(users))
    user_ids = np.tile(users, len(clients))
    sessions_per_user = rng.poisson(scale.sessions_per_user_per_day * days, len(user_ids))
    session_user = np.repeat(np.arange(len(user_ids)), sessions_per_user)
    n_sessions = len(session_user)
    session_start = start_ms + rng.integers(0, max(span_ms, 1), n_sessions)
    pages = 1 + rng.geometric(0.25, n_sessions) - 1
    pages = np.minimum(pages, 40)

    pv_session = np.repeat(np.arange(n_sessions), pages)
    think = np.minimum(rng.exponential(scale.mean_think_seconds * 1000, len(pv_session)),
                       20 * 60_000).astype(np.int64)
    first_of_session = np.r_[True, pv_session[1:] != pv_session[:-1]][: len(pv_session)]
    think[first_of_session] = 0
    offsets = np.cumsum(think) - np.repeat(np.cumsum(think)[first_of_session], pages)
    pv_ts = session_start[pv_session] + offsets
    keep = pv_ts < start_ms + span_ms
    pv_session, pv_ts, first_of_session = pv_session[keep], pv_ts[keep], first_of_session[keep]
    n_pv = len(pv_ts)
    urls = _url(rng, n_pv)
    referrers = np.array(REFERRERS, dtype=object)[rng.integers(0, len(REFERRERS), n_pv)]
    previous_url = np.r_[np.array([""], dtype=object), urls[:-1]][:n_pv]
    referrers = np.where(first_of_session, referrers, previous_url)
    pv_user = session_user[pv_session]
    pageviews = pa.table({
        "event_id": _hex_ids(rng, n_pv, "pv-"),
        "client_id": user_client[pv_user],
        "user_id": user_ids[pv_user],
        "ts": pa.array(pv_ts, pa.timestamp("ms", tz="UTC")),
        "url": urls,
        "referrer": referrers,
    })

    last_ts = np.zeros(n_sessions, dtype=np.int64)
    np.maximum.at(last_ts, pv_session, pv_ts)
    has_pv = np.zeros(n_sessions, dtype=bool)
    has_pv[pv_session] = True
    ordered = has_pv & (rng.random(n_sessions) < scale.order_probability)
    order_session = np.flatnonzero(ordered)
    n_orders = len(order_session)
    order_ts = last_ts[order_session] + rng.integers(0, 10 * 60_000, n_orders)
    amounts = np.round(rng.lognormal(3.5, 0.8, n_orders), 2)
    order_user = session_user[order_session]
    currencies = np.array([client_currency(c) for c in user_client[order_user]], dtype=object)
    orders = pa.table({
        "order_id": _hex_ids(rng, n_orders, "ord-"),
        "client_id": user_client[order_user],
        "user_id": user_ids[order_user],
        "ts": pa.array(order_ts, pa.timestamp("ms", tz="UTC")),
        "amount": np.array([f"{a:.2f}" for a in amounts], dtype=object),
        "currency": currencies,
    })
    # Inside the span, like the pageviews: the span is what --start is checked against, so an
    # order of the last session may not fall up to 10 minutes after it, ahead of now.
    orders = orders.filter(pa.array(order_ts < start_ms + span_ms))
    return pageviews.sort_by("ts"), orders.sort_by("ts")


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


BAD_VALUES = (
    lambda r: "{not json",
    lambda r: "[1, 2, 3]",
    lambda r: json.dumps({**r, "ts": "yesterday"}),
    lambda r: json.dumps({**r, "ts": _iso(r["ts"])[:19] if isinstance(r["ts"], int)
                          else r["ts"][:19]}),  # no time zone
    lambda r: json.dumps({k: v for k, v in r.items() if k != "user_id"}),
    lambda r: json.dumps({**r, "event_type": "order", "order_id": "bad", "amount": "-5.00",
                          "currency": "EUR"}),
)


def live_records(
    scale: Scale, delivery: Delivery, seed: int
) -> list[tuple[str | None, str]]:
    """Kafka (key, value) records in delivery order, with jitter, late events, dups, bad ones."""
    pageviews, orders = simulate(scale, seed)
    rng = np.random.default_rng(seed + 1)
    records: list[dict[str, object]] = []
    for row in pageviews.to_pylist():
        records.append({"event_id": row["event_id"], "client_id": row["client_id"],
                        "user_id": row["user_id"], "event_type": "pageview",
                        "ts": row["ts"], "url": row["url"], "referrer": row["referrer"]})
    for row in orders.to_pylist():
        records.append({"event_id": "ev-" + row["order_id"], "client_id": row["client_id"],
                        "user_id": row["user_id"], "event_type": "order", "ts": row["ts"],
                        "url": "https://shop.example/checkout/done", "referrer": "",
                        "order_id": row["order_id"], "amount": row["amount"],
                        "currency": row["currency"]})
    n = len(records)
    ts_ms = np.array([int(r["ts"].timestamp() * 1000) for r in records], dtype=np.int64)
    delay = rng.exponential(delivery.jitter_seconds * 1000, n)
    late = rng.random(n) < delivery.late_fraction
    delay[late] += delivery.late_minutes * 60_000
    order = np.argsort(ts_ms + delay, kind="stable")
    epoch_ms_format = rng.random(n) < 0.5
    out: list[tuple[str | None, str]] = []
    for i in order:
        record = dict(records[i])
        record["ts"] = int(ts_ms[i]) if epoch_ms_format[i] else _iso(int(ts_ms[i]))
        out.append((f"{record['client_id']}/{record['user_id']}", json.dumps(record)))
    copied = rng.choice(n, int(n * delivery.duplicate_fraction), replace=False) if n else []
    copied = np.asarray(copied, dtype=np.int64)
    # A producer's retry: the copy arrives 1-49 records after its original.
    later = np.minimum(n, copied + rng.integers(1, 50, size=len(copied)))
    with_copies = interleaved(out, [out[int(d)] for d in copied], later)
    bad: list[tuple[str | None, str]] = []
    for _ in range(int(n * delivery.bad_fraction)):
        template = json.loads(with_copies[int(rng.integers(0, len(with_copies)))][1])
        template["event_id"] = "bad-" + str(int(rng.integers(0, 2**62)))
        bad.append((None, BAD_VALUES[int(rng.integers(0, len(BAD_VALUES)))](template)))
    return interleaved(with_copies, bad,
                        rng.integers(0, len(with_copies) + 1, size=len(bad)))


def interleaved(records: list[T], extra: list[T], before: np.ndarray) -> list[T]:
    """``records`` with each ``extra[j]`` placed before ``records[before[j]]`` (at the end for
    ``len(records)``), in one pass: inserting them one at a time took time quadratic in the
    records (minutes at ten million)."""
    order = np.argsort(before, kind="stable").tolist()
    places = before[order].tolist() if len(order) else []
    result: list[T] = []
    taken = 0
    for index, record in enumerate(records):
        while taken < len(order) and places[taken] <= index:
            result.append(extra[order[taken]])
            taken += 1
        result.append(record)
    result.extend(extra[j] for j in order[taken:])
    return result


def file_in_the_way(folder: Path) -> Path | None:
    """The first of ``folder``'s parents, or itself, that exists and is not a folder; None if
    none is. Creating the folder fails there with "File exists" or "Not a directory", which
    name neither the file nor the setting (the landing folder, ``--out``) to change."""
    return next((p for p in (*reversed(folder.parents), folder)
                 if p.exists() and not p.is_dir()), None)


def history_folder(config: Config, out: str, overwrite: bool) -> Path:
    """The folder ``generate history`` writes, checked before anything is simulated.

    A second run into the same folder would leave the first run's files beside its own (a
    batch of both, or of two formats), so it is refused unless ``overwrite``, which removes
    the folder's ``pageviews`` and ``orders`` first.

    Raises:
        ConfigError: ``out`` leaves the landing folder, lies inside another batch, has a
            character backfill reads as a pattern, is (or lies under) a file, or already
            holds a batch.
    """
    target, inside = config.in_landing(out)
    if not inside or target == config.landing:
        raise ConfigError(f"--out {out!r} must name a folder inside the landing folder "
                          f"{config.landing} (CLICKSTREAM_LANDING); backfills read only "
                          "from there")
    reason = unreadable_path_reason(str(target))
    if reason:
        raise ConfigError(f"--out {out!r} {reason}; backfill refuses such a batch, choose "
                          "another --out")
    inside_batch = [p for p in (target, *target.parents) if p.name in ("pageviews", "orders")
                    and config.landing in p.parents]
    if inside_batch:
        raise ConfigError(f"--out {out!r} is or lies inside a batch folder ({inside_batch[0]}), "
                          "so a backfill of that batch would read both kinds written here; "
                          "choose a folder outside it")
    not_a_folder = file_in_the_way(target)
    if not_a_folder is not None:
        landing = not_a_folder == config.landing or not_a_folder in config.landing.parents
        raise ConfigError(f"--out {out!r}: {not_a_folder} is a file, not a folder; choose "
                          + ("another landing folder (CLICKSTREAM_LANDING, --landing)"
                             if landing else "another --out"))
    held = [target / kind for kind in ("pageviews", "orders")
            if (target / kind).is_symlink() or (target / kind).exists()]
    if held and not overwrite:
        raise ConfigError(f"{target} already holds a batch ({', '.join(p.name for p in held)}"
                          "); pass --overwrite to replace it or choose another --out")
    odd = next((p for p in held if p.is_symlink() or not p.is_dir()), None)
    if odd is not None:  # --overwrite removes only folders this command writes
        raise ConfigError(f"--out {out!r}: {odd} is a {'link' if odd.is_symlink() else 'file'}"
                          ", not a batch folder this command wrote; remove it yourself or "
                          "choose another --out")
    for folder in held:
        shutil.rmtree(folder)
    return target


def write_table(table: pa.Table, path: Path, file_format: FileFormat,
                rows_per_file: int = 1_000_000) -> list[Path]:
    """Write a historical batch as Parquet, CSV or JSON Lines files under ``path``."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for index, start in enumerate(range(0, max(table.num_rows, 1), rows_per_file)):
        chunk = table.slice(start, rows_per_file)
        target = path / f"part-{index:05d}.{ 'jsonl' if file_format == 'jsonl' else file_format}"
        if file_format == "parquet":
            pq.write_table(chunk, target)
        elif file_format == "csv":
            pacsv.write_csv(_ts_as_iso(chunk), target)
        else:
            with target.open("w") as handle:
                for row in _ts_as_iso(chunk).to_pylist():
                    handle.write(json.dumps(row) + "\n")
        written.append(target)
    return written


def _ts_as_iso(table: pa.Table) -> pa.Table:
    if not pa.types.is_timestamp(table.schema.field("ts").type):
        return table
    ms = table.column("ts").cast(pa.timestamp("ms", tz="UTC")).cast(pa.int64()).to_pylist()
    return table.set_column(table.schema.get_field_index("ts"), "ts",
                            pa.array([_iso(v) for v in ms], pa.string()))
