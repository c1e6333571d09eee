"""The read point: one version per table at which a client's tables agree (issue #3: a reader
never sees half a backfill).

Delta commits one table at a time. A backfill commits ``pageviews`` or ``orders`` (its merge),
then ``sessions``, then ``attributions`` (its correction), and a reader joining the tables
between those commits saw merged records in no session, or attributions naming retracted
sessions. Every writer that changes several tables together declares a *group* around its
commits, and the read point (a small JSON file in the warehouse) names, per table, the version
a reader should read:

* a client's group (a backfill from its merge to its plan's apply; a correction from its
  plan's record in ``corrections`` to its apply; a full recompute's record and rewrite) holds
  that client at the versions of the read point before the group opened, until it closes:
  every other client's rows move on;
* the sessionizer's micro-batch is a group of every client (its commits span clients): while
  one is open the read point does not move; it moves when the micro-batch closes, at most one
  trigger later.

A group killed part way stays open (its marker is a file) until a rerun finishes it: the
client's rows stay where they were rather than show half a backfill. ``clickstream read-point``
names what holds a client; ``--release GROUP`` lets an operator give up on a group that will
never be rerun (its committed half becomes visible as it is).

Writers open, close and publish under one lock, so no version a group committed reaches a read
point before the group closes: a group opens before its first commit, and a read point is
written either before that (older versions) or after the group's marker is in place (the
client held). Readers take no lock: the file is replaced in one rename.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from clickstream.atomic_files import write_atomically
from clickstream.errors import ClickstreamError
from clickstream.io.delta_tables import TABLE_MISSING, DeltaTables
from clickstream.locks import LOCKS_FOLDER, exclusive, warehouse_sessionizer_lock
from clickstream.locks import held as lock_held
from clickstream.progress import utc_text
from clickstream.tables import (
    ATTRIBUTIONS,
    CORRECTIONS,
    ORDERS,
    OTHER_EVENTS,
    PAGEVIEWS,
    SESSIONS,
    TableSpec,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from clickstream.config import Config

# The tables whose rows depend on each other (all partitioned by client first). ``quarantine``
# and ``recompute_queue`` are the product's working tables, read at their latest.
READ_POINT_TABLES: tuple[TableSpec, ...] = (PAGEVIEWS, ORDERS, OTHER_EVENTS, SESSIONS,
                                            ATTRIBUTIONS, CORRECTIONS)
FOLDER = "_clickstream_read_point"  # in the warehouse; no table is named with a leading "_"
READ_POINT_FILE = "read_point.json"
GROUPS_FOLDER = "open_groups"
EVERY_CLIENT = "*"  # a group of every client: the sessionizer's micro-batch


@dataclass(frozen=True)
class OpenGroup:
    """A group whose commits are not all made: its client is read at ``versions``."""

    group: str
    client_id: str  # EVERY_CLIENT for the sessionizer's micro-batch
    opened_at: str
    versions: Mapping[str, int]
    as_of: str  # when the read point it holds the client at was written

    def describe(self) -> str:
        whose = "every client" if self.client_id == EVERY_CLIENT else f"client {self.client_id}"
        return f"{self.group} (open since {self.opened_at}, holds {whose})"


@dataclass(frozen=True)
class ReadPoint:
    """Versions to read: ``versions`` for every client but the held ones, read at theirs."""

    versions: Mapping[str, int]
    held: Mapping[str, Mapping[str, int]]
    written_at: str
    # When the versions a held client is read at were the read point's (vacuum keeps them).
    held_since: Mapping[str, str] = field(default_factory=dict)
    # The event-time watermark of the sessionizer's last micro-batch in these versions: a
    # session ending less than one gap before it may still be open in the stream.
    stream_watermark_ms: int | None = None

    def versions_of(self, client_id: str) -> Mapping[str, int]:
        return self.held.get(client_id, self.versions)

    def as_of(self, client_id: str) -> str:
        return self.held_since.get(client_id, self.written_at)

    def to_json(self) -> dict[str, object]:
        watermark = self.stream_watermark_ms
        return {"written_at": self.written_at, "versions": dict(self.versions),
                "held": {client: dict(v) for client, v in self.held.items()},
                "held_since": dict(self.held_since),
                "stream_watermark_ms": watermark,
                "stream_watermark": None if watermark is None else utc_text(watermark)}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ReadPoint:
        return cls(versions=dict(data["versions"]),  # type: ignore[arg-type]
                   held={c: dict(v) for c, v in data["held"].items()},  # type: ignore[union-attr]
                   written_at=str(data["written_at"]),
                   held_since=dict(data.get("held_since", {})),  # type: ignore[call-overload]
                   stream_watermark_ms=data.get("stream_watermark_ms"))  # type: ignore[arg-type]


def _group_json(group: OpenGroup) -> dict[str, object]:
    return {"group": group.group, "client_id": group.client_id, "opened_at": group.opened_at,
            "versions": dict(group.versions), "as_of": group.as_of}


def _group_of(data: Mapping[str, object]) -> OpenGroup:
    return OpenGroup(str(data["group"]), str(data["client_id"]), str(data["opened_at"]),
                     dict(data["versions"]), str(data["as_of"]))  # type: ignore[arg-type]


def folder(config: Config) -> Path:
    return config.warehouse / FOLDER


def _lock_path(config: Config) -> Path:
    return config.warehouse / LOCKS_FOLDER / "read-point.lock"


def _group_path(config: Config, group: str) -> Path:
    # Run ids carry client ids, which may hold any character: the file is named by digest.
    return folder(config) / GROUPS_FOLDER / f"{hashlib.sha256(group.encode()).hexdigest()}.json"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def current(config: Config) -> ReadPoint | None:
    """The read point last written; None before any writer wrote one."""
    path = folder(config) / READ_POINT_FILE
    try:
        return ReadPoint.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise ClickstreamError(
            f"the read point {path} cannot be read ({error}): it is written in one rename, so "
            "something else wrote it. Restore it from a backup; or, with the sessionizer "
            "stopped after a micro-batch that committed (no group of every client open), "
            "delete it and the next writer writes it again") from error


def open_groups(config: Config) -> list[OpenGroup]:
    """The groups open now, oldest first."""
    found = []
    for path in sorted((folder(config) / GROUPS_FOLDER).glob("*.json")):
        try:
            found.append(_group_of(json.loads(path.read_text())))
        except FileNotFoundError:
            continue  # closed since it was listed
    return sorted(found, key=lambda g: (g.opened_at, g.group))


def _latest(tables: DeltaTables) -> dict[str, int]:
    return {spec.name: tables.version(spec.name) for spec in READ_POINT_TABLES}


def _publish_locked(config: Config, tables: DeltaTables, previous: ReadPoint | None,
                    stream_watermark_ms: int | None = None) -> ReadPoint | None:
    """A new read point from the latest versions, unless a group of every client is open
    (then the last one stays: what the stream committed so far is half a micro-batch).
    ``stream_watermark_ms``: the closing micro-batch's; others keep the last one."""
    groups = open_groups(config)
    if previous is not None and any(g.client_id == EVERY_CLIENT for g in groups):
        return previous
    held: dict[str, dict[str, int]] = {}
    since: dict[str, str] = {}
    for group in groups:
        if group.client_id == EVERY_CLIENT:
            continue  # none before this read point: it would be the first
        versions = held.setdefault(group.client_id, dict(group.versions))
        for name, version in group.versions.items():  # the oldest of the client's groups
            versions[name] = min(versions.get(name, version), version)
        since[group.client_id] = min(since.get(group.client_id, group.as_of), group.as_of,
                                     key=_parsed)
    if stream_watermark_ms is None and previous is not None:
        stream_watermark_ms = previous.stream_watermark_ms
    point = ReadPoint(_latest(tables), held, _now(), since, stream_watermark_ms)
    write_atomically(folder(config) / READ_POINT_FILE, json.dumps(point.to_json(), indent=1))
    return point


def publish(config: Config, tables: DeltaTables) -> ReadPoint | None:
    """Move the read point to what the writers finished (every commit outside open groups);
    called by a writer after its commits, and by maintenance."""
    with exclusive(_lock_path(config)):
        return _publish_locked(config, tables, current(config))


def open_group(config: Config, tables: DeltaTables, group: str, client_id: str) -> bool:
    """Hold ``client_id`` (``EVERY_CLIENT``: all) at the current read point until
    ``close_group(group)``; call before the group's first commit. Opening an open group (a
    rerun of a killed one) keeps its first versions: they are older than its first commit.
    True when this call opened it (nothing of the group is committed yet)."""
    path = _group_path(config, group)
    with exclusive(_lock_path(config)):
        if path.exists():
            return False
        point = current(config) or _publish_locked(config, tables, None)
        assert point is not None  # written when there was none
        versions = dict(point.versions_of(client_id)) if client_id != EVERY_CLIENT else {}
        write_atomically(path, json.dumps(_group_json(OpenGroup(
            group, client_id, _now(), versions, point.as_of(client_id)))))
        _publish_locked(config, tables, point)  # says who holds the client (none committed)
        return True


def close_group(config: Config, tables: DeltaTables, group: str,
                stream_watermark_ms: int | None = None) -> ReadPoint | None:
    """The group's commits are all made: show them (with whatever else finished).
    ``stream_watermark_ms``: a micro-batch's, which the read point then names. A group not
    open (a correction that planned nothing) shows nothing new: the read point stays."""
    with exclusive(_lock_path(config)):
        try:
            _group_path(config, group).unlink()
        except FileNotFoundError:
            return current(config)
        return _publish_locked(config, tables, current(config), stream_watermark_ms)


def release(config: Config, tables: DeltaTables, group: str) -> ReadPoint | None:
    """An operator gives up on an open group (``clickstream read-point --release``)."""
    if not _group_path(config, group).exists():
        known = ", ".join(g.group for g in open_groups(config)) or "none"
        raise ClickstreamError(f"no open group {group!r} to release (open: {known})")
    return close_group(config, tables, group)


def still_holding(config: Config, group: str) -> str | None:
    """For a run that failed: what its open group means to readers, or None. Called while
    the run's own error is raised, so a marker it cannot read is said, not raised over it."""
    path = _group_path(config, group)
    try:
        opened = _group_of(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as unreadable:
        return (f"the read point group {group} left open has a marker that cannot be read "
                f"({path}: {unreadable!r}); `clickstream read-point` says what readers see")
    return (f"readers of the read point see client {opened.client_id} as it was before "
            f"{group} until a rerun finishes it (or `clickstream read-point --release "
            f"{group}`, which shows what it committed as it is)")


def describe_open_groups(config: Config) -> list[str]:
    """The open groups as an operator reads them: a micro-batch's says whether a sessionizer
    is running to finish it (one killed left it, and holds every client until it restarts)."""
    running = lock_held(warehouse_sessionizer_lock(config.warehouse))
    return [group.describe() + ("" if group.client_id != EVERY_CLIENT or running else
                                "; no sessionizer is running: its next start replays the "
                                "micro-batch and closes it")
            for group in open_groups(config)]


def read_consistent(tables: DeltaTables, point: ReadPoint, name: str,
                    client_ids: Iterable[str] | None = None,
                    columns: Sequence[str] | None = None) -> DataFrame:
    """Table ``name`` at the read point: each client's rows at its versions (all clients
    when ``client_ids`` is None)."""
    from pyspark.sql import functions as F

    spec = next((s for s in READ_POINT_TABLES if s.name == name), None)
    if spec is None:
        raise ClickstreamError(
            f"table {name!r} has no read point version; the read point covers "
            f"{', '.join(s.name for s in READ_POINT_TABLES)} (read the others at their latest)")

    def at(versions: Mapping[str, int], clients: Sequence[str] | None) -> DataFrame:
        version = versions.get(name, TABLE_MISSING)
        if version == TABLE_MISSING:  # the table did not exist then
            return tables.read(name, schema=spec.schema).limit(0)
        return tables.read(name, None, None if clients is None else {"client_id": clients},
                           schema=spec.schema, version=version)

    held = dict(point.held)
    if client_ids is not None:
        wanted = sorted(set(client_ids))
        free = [c for c in wanted if c not in held]
        parts = [at(point.versions, free)] if free else []
        parts += [at(held[c], [c]) for c in wanted if c in held]
        if not parts:
            parts = [at(point.versions, None).limit(0)]
    else:
        everyone = at(point.versions, None)
        if held:
            everyone = everyone.where(~F.col("client_id").isin(sorted(held)))
        parts = [everyone, *(at(versions, [c]) for c, versions in held.items())]
    result = parts[0]
    for part in parts[1:]:
        result = result.unionByName(part)
    return result if columns is None else result.select(*columns)


def _parsed(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=dt.UTC)


def oldest_read(config: Config) -> tuple[dt.datetime, str] | None:
    """When the oldest read point a reader may still be sent to was written, and what keeps
    it: vacuum must not delete the files its versions name (``maintenance`` M5)."""
    point = current(config)
    if point is None:
        return None
    oldest = (_parsed(point.written_at), "the read point itself: a micro-batch of the "
              "sessionizer has been open since (it closes when its replay commits)")
    for client, since in point.held_since.items():
        if _parsed(since) < oldest[0]:
            oldest = (_parsed(since), f"client {client}, held by a group that closed while a "
                      "micro-batch of the sessionizer was open")
    for group in open_groups(config):
        if group.client_id != EVERY_CLIENT and _parsed(group.as_of) <= oldest[0]:
            oldest = (_parsed(group.as_of), f"open group {group.describe()}")
    return oldest


def close_stale_stream_groups(config: Config, tables: DeltaTables, keep: str) -> list[str]:
    """Close the groups of every client but ``keep``: a killed sessionizer's of another
    checkpoint (deleted since), which no replay will close. Only one sessionizer runs per
    warehouse (``sessionize`` Z15), so no other one is writing them."""
    with exclusive(_lock_path(config)):
        stale = [g.group for g in open_groups(config)
                 if g.client_id == EVERY_CLIENT and g.group != keep]
        for group in stale:
            _group_path(config, group).unlink(missing_ok=True)
        if stale:
            _publish_locked(config, tables, current(config))
    return stale
