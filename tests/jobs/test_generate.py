"""The data generator at the edges: scales too small for any session still give (empty)
tables with the full schema, a seed reproduces the same data, and a history batch is never
mixed into an earlier one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from clickstream.cli import main
from clickstream.errors import EXIT_NOT_RETRYABLE
from clickstream.jobs.generate import Delivery, Scale, live_records, simulate

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


def test_delivery_adds_copies_after_their_originals_and_bad_records_between_the_rest() -> None:
    scale = Scale(clients=2, users_per_client=20, minutes=24 * 60, start=START)
    clean = live_records(scale, Delivery(duplicate_fraction=0, bad_fraction=0), seed=5)
    messy = live_records(scale, Delivery(duplicate_fraction=0.1, bad_fraction=0.05), seed=5)
    bad = [record for record in messy if record[0] is None]
    assert len(bad) == int(len(clean) * 0.05)
    assert all(_bad_value(value) for _key, value in bad)
    seen: set[tuple[str | None, str]] = set()
    firsts, copies = [], 0
    for record in messy:
        if record[0] is None:
            continue
        if record in seen:
            copies += 1
        else:
            seen.add(record)
            firsts.append(record)
    assert firsts == clean  # the delivery order kept, each record there once more or not
    assert copies == int(len(clean) * 0.1)


def _bad_value(value: str) -> bool:
    try:
        event = json.loads(value)
    except ValueError:
        return True
    return not isinstance(event, dict) or event["event_id"].startswith("bad-")


def test_the_same_scale_written_another_way_generates_the_same_data() -> None:
    """``--minutes 1440`` (or ``--days 365``) parsed as a float where the default is an int,
    and a ``--start`` in another zone is the same instant: each seeded other data than the
    default it equals, so a batch regenerated with its flags written out held other ids."""
    scale = Scale(clients=1, users_per_client=5, minutes=24 * 60, start=START,
                  order_probability=0.5)
    same = [Scale(**{**vars(scale), "minutes": 1440.0}),
            Scale(**{**vars(scale), "start": START.astimezone(timezone(timedelta(hours=1)))}),
            Scale(**{**vars(scale), "order_probability": 0.5, "sessions_per_user_per_day": 2}),
            ]
    expected = simulate(scale, seed=5)
    assert expected[0].num_rows > 0 and expected[1].num_rows > 0
    for other in same:
        pageviews, orders = simulate(other, seed=5)
        assert pageviews.equals(expected[0]) and orders.equals(expected[1]), other
    assert not simulate(Scale(**{**vars(scale), "minutes": 1441.0}), seed=5)[0].equals(
        expected[0])


def test_another_day_or_client_with_the_same_seed_has_other_ids() -> None:
    """Ids came from the seed alone: a second day's events, or another client's history,
    repeated every event and order id of the first, and the tables held each id twice."""
    scale = Scale(clients=1, users_per_client=20, minutes=24 * 60, start=START,
                  order_probability=0.5)
    runs = [simulate(scale, seed=1, client="c1"),
            simulate(Scale(**{**vars(scale), "start": START + timedelta(days=1)}), seed=1,
                     client="c1"),
            simulate(scale, seed=1, client="c2")]
    for table, key in ((0, "event_id"), (1, "order_id")):
        ids = [set(run[table][key].to_pylist()) for run in runs]
        assert all(ids) and sum(map(len, ids)) == len(set().union(*ids)), key


def test_a_clients_orders_have_its_currency_whichever_command_generates_them() -> None:
    """``history`` generates one client at a scale of its own, where every client but the
    first three got EUR: client-03's year of orders in EUR beside its live orders in JPY."""
    scale = Scale(clients=5, users_per_client=30, minutes=24 * 60, start=START,
                  order_probability=0.8)
    live = simulate(scale, seed=2)[1]
    currency_of = dict(zip(live["client_id"].to_pylist(), live["currency"].to_pylist(),
                           strict=True))
    assert len(set(currency_of.values())) == 5
    for client in ("client-03", "client-04"):
        history = simulate(Scale(**{**vars(scale), "clients": 1}), seed=2, client=client)[1]
        assert set(history["currency"].to_pylist()) == {currency_of[client]}


def test_every_record_falls_inside_the_span_start_is_checked_against() -> None:
    """An order follows its session's last pageview by up to 10 minutes: those of the last
    sessions fell after the span, so a --start the guard let through wrote orders ahead of
    now, which the backfill quarantined."""
    scale = Scale(clients=1, users_per_client=500, minutes=24 * 60, start=START,
                  order_probability=1.0)
    pageviews, orders = simulate(scale, seed=1)
    end = START + timedelta(minutes=scale.minutes)
    assert orders.num_rows > 500
    assert max(orders["ts"].to_pylist()) < end and max(pageviews["ts"].to_pylist()) < end


def test_history_refuses_to_mix_a_second_run_into_the_first_runs_batch(tmp_path: Path) -> None:
    landing = tmp_path / "landing"
    run = [sys.executable, "-m", "clickstream.cli", "generate", "history", "--client", "c1",
           "--days", "0.2", "--users", "20", "--out", "late"]
    env = {**os.environ, "CLICKSTREAM_LANDING": str(landing), "CLICKSTREAM_HOME": str(tmp_path)}
    assert subprocess.run(run, env=env, capture_output=True, timeout=120).returncode == 0
    first = sorted(p.name for p in (landing / "late" / "orders").iterdir())
    assert first == ["part-00000.parquet"]

    again = subprocess.run([*run, "--format", "csv"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == EXIT_NOT_RETRYABLE  # a setting: rerunning fails the same way
    assert "already holds a batch (pageviews, orders); pass --overwrite" in again.stderr
    assert sorted(p.name for p in (landing / "late" / "orders").iterdir()) == first

    replaced = subprocess.run([*run, "--format", "csv", "--overwrite"], env=env, timeout=120)
    assert replaced.returncode == 0
    assert sorted(p.name for p in (landing / "late" / "orders").iterdir()) == ["part-00000.csv"]

    outside = subprocess.run([*run[:-1], "../elsewhere"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert outside.returncode == EXIT_NOT_RETRYABLE
    assert "must name a folder inside the landing folder" in outside.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_a_landing_folder_that_is_a_file_fails_in_one_line_naming_it(tmp_path: Path) -> None:
    """It failed as an unexpected error (NotADirectoryError), its traceback kept as for a bug
    (``generate events --out`` under a file: ``tests/test_cli.py``)."""
    a_file = tmp_path / "landing"
    a_file.write_text("")
    env = {**os.environ, "CLICKSTREAM_HOME": str(tmp_path), "CLICKSTREAM_LANDING": str(a_file)}
    result = subprocess.run([sys.executable, "-m", "clickstream.cli", "generate", "history",
                             "--client", "c1", "--days", "0.1", "--users", "2", "--out", "late"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_NOT_RETRYABLE
    assert result.stderr == (f"clickstream generate: error: --out 'late': {a_file} is a file, "
                             "not a folder; choose another landing folder (CLICKSTREAM_LANDING, "
                             "--landing)\n")
    assert not (tmp_path / "logs").exists()


def test_overwrite_refuses_a_file_or_link_where_a_batch_folder_would_be(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--overwrite`` removes the batch folders a run wrote; a file or a link in their place
    failed as an unexpected error (rmtree) with a traceback kept."""
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "orders").write_text("someone's notes")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "late" / "pageviews").symlink_to(tmp_path / "elsewhere")
    for kind, what in (("pageviews", "a link"), ("orders", "a file")):
        if kind == "orders":
            (tmp_path / "late" / "pageviews").unlink()
        code = main(["generate", "history", "--client", "c1", "--days", "0.1", "--users", "2",
                     "--landing", str(tmp_path), "--out", "late", "--overwrite"])
        assert code == EXIT_NOT_RETRYABLE
        assert capsys.readouterr().err == (
            f"clickstream generate: error: --out 'late': {tmp_path / 'late' / kind} is {what}, "
            "not a batch folder this command wrote; remove it yourself or choose another "
            "--out\n")
    assert (tmp_path / "elsewhere").is_dir() and not list(tmp_path.rglob("*.parquet"))


def test_records_written_to_stdout_are_all_the_pipe_carries(tmp_path: Path) -> None:
    """The count line went to stdout too, so a producer fed by the pipe sent it as a record."""
    env = {**os.environ, "CLICKSTREAM_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "clickstream.cli", "generate", "events",
                             "--users", "2", "--minutes", "60", "--out", "/dev/stdout"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines and all(set(json.loads(line)) == {"key", "value"} for line in lines)
    assert result.stderr == f"wrote {len(lines)} records to /dev/stdout\n"


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path) -> None:
    """``clickstream ... | head`` reported an unexpected error with a traceback kept."""
    env = {**os.environ, "CLICKSTREAM_HOME": str(tmp_path)}
    with subprocess.Popen([sys.executable, "-m", "clickstream.cli", "generate", "events",
                           "--minutes", "600", "--users", "200", "--out", "/dev/stdout"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stdout.readline().startswith(b'{"key"')
        process.stdout.close()  # as head does after its lines
        assert process.wait(timeout=120) == 141
        assert process.stderr is not None and process.stderr.read() == b""
    assert not (tmp_path / "logs").exists()
