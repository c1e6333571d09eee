"""``clickstream`` command line: parses arguments, builds the Config, calls one library function.

Every command exits 0 on success and non-zero with a one-line reason on failure: 3 when a
retry would fail the same way (a refused batch, a bad setting, a failed quality gate:
``errors.NOT_RETRYABLE``), 1 for any other failure, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from clickstream import interrupts
from clickstream.config import ENV_NAMES, FLAG_HELP, Config, cli_flag
from clickstream.errors import (
    EXIT_NOT_RETRYABLE,
    NOT_RETRYABLE,
    ClickstreamError,
    ConfigError,
    QueryFailedError,
    carried_error,
    error_line,
    typed_error_line,
)
from clickstream.events.contract import EARLIEST_TS, LATEST_TS, client_id_problem
from clickstream.io.kafka_broker import host_address, port_number
from clickstream.progress import heartbeat

Handler = Callable[[argparse.Namespace, Config], int]
DRY_RUN_STEPS = ("check", "report")  # the backfill steps that write nothing


def _add_config_flags(parser: argparse.ArgumentParser,
                      only: Sequence[str] | None = None) -> None:
    """The settings' flags, or ``only`` those a command reads (a generator took and checked
    ``--warehouse`` and ``--session-gap``, then ignored them)."""
    group = parser.add_argument_group("configuration (flags override environment variables)")
    for name, help_text in FLAG_HELP.items():
        if only is not None and name not in only:
            continue
        metavar = "DURATION" if name.endswith("_minutes") else None  # not its dest's unit
        group.add_argument(cli_flag(name), dest=name, default=None, metavar=metavar,
                           help=f"{help_text} [env {ENV_NAMES[name]}]")


BROKER_SETTINGS = ("events_topic", "sessions_topic", "attributions_topic")
# What the generators read: a setting only the jobs use (a sessionizer's trigger size, say)
# refused a generator's run, naming a flag the generator never looks at.
GENERATE_EVENTS_SETTINGS = ("home", "kafka_bootstrap_servers", "kafka_options", "events_topic",
                            "max_ts_ahead_minutes")
GENERATE_HISTORY_SETTINGS = ("home", "landing")


def _cmd_broker(args: argparse.Namespace, config: Config) -> int:
    from clickstream.io.kafka_broker import TOPIC_PARTITIONS, run_broker_forever

    jobs_kafka = os.environ.get(ENV_NAMES["kafka_bootstrap_servers"], "").strip()
    here = {f"{host}:{args.port}" for host in (args.host, "localhost", "127.0.0.1")}
    if jobs_kafka and args.port and jobs_kafka not in here:
        print(f"clickstream broker: warning: {ENV_NAMES['kafka_bootstrap_servers']}="
              f"{jobs_kafka} is not this broker's address ({args.host}:{args.port}): the other "
              "commands in this environment will use that Kafka", file=sys.stderr, flush=True)
    # The configured names: a renamed topic exists when the sessionizer first asks for it.
    names = (config.events_topic, config.sessions_topic, config.attributions_topic)
    run_broker_forever(port=args.port, host=args.host,
                       topics=dict.fromkeys(names, TOPIC_PARTITIONS))
    return 0


def _cmd_sessionize(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.sessionize import run_sessionizer

    overrides = {}
    if args.max_events_per_trigger:
        overrides["max_events_per_trigger"] = args.max_events_per_trigger
    summary = run_sessionizer(config.replace(**overrides), until_caught_up=args.until_caught_up)
    print(summary.describe())
    # A stop by Ctrl-C is a clean one, yet says it was interrupted (128 + SIGINT), as a shell
    # expects: a script running the sessionizer then stops too, instead of going on.
    return 128 + signal.SIGINT if summary.stopped_by == signal.SIGINT else 0


def _cmd_backfill(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.backfill import run_backfill

    with heartbeat(print, config.progress_interval_seconds) as progress:
        summary = run_backfill(config, kind=args.kind, client_id=args.client, path=args.path,
                               progress=progress)
    print(summary.describe())
    return 0


def _cmd_backfill_step(args: argparse.Namespace, config: Config) -> int:
    import json

    from clickstream.jobs.backfill_steps import locate_batch, run_step

    if args.dry_run and args.step not in DRY_RUN_STEPS:
        raise ConfigError(f"--dry-run true applies to the steps {' and '.join(DRY_RUN_STEPS)} "
                          f"only, which write nothing; step {args.step} writes the tables "
                          "(a dry run of the DAG skips it)")
    run_id = args.run_id or locate_batch(config, kind=args.kind, client_id=args.client,
                                         path=args.path)["run_id"]
    with heartbeat(print, config.progress_interval_seconds) as progress:
        result = run_step(config, args.step, kind=args.kind, client_id=args.client,
                          path=args.path, run_id=run_id, dry_run=args.dry_run,
                          progress=progress)
    print(json.dumps(result, default=str))
    return 0


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


def _cmd_recompute(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.recompute import run_full_recompute, run_recompute

    if args.full:
        if not args.client:
            raise ConfigError("--full needs --client: a full recompute rewrites one client")
        if args.save_result_as:
            raise ConfigError("--save-result-as is the queue's recompute's (the "
                              "scheduled_recompute DAG's), not --full's")
    with heartbeat(print, config.progress_interval_seconds) as progress:
        if args.full:
            summary = run_full_recompute(config, client_id=args.client, progress=progress)
        else:
            summary = run_recompute(config, client_id=args.client,
                                    result_name=args.save_result_as, progress=progress)
    print(summary.describe())
    return 0


def _cmd_maintain(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.maintenance import maintain_tables

    done = maintain_tables(config, retention_hours=args.retention_hours)
    if not done["checkpoint"]:  # each step said why
        print("maintain: no table yet: nothing done")
        return 0
    compacted = done["compact"].values()
    print(f"maintain: {len(done['checkpoint'])} tables: "
          f"{sum(d['files_removed'] for d in compacted)} files compacted into "
          f"{sum(d['files_added'] for d in compacted)}, {sum(done['vacuum'].values())} deleted "
          "by vacuum, each log checkpointed")
    return 0


def _cmd_republish(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.republish import run_republish

    with heartbeat(print, config.progress_interval_seconds) as progress:
        summary = run_republish(config, progress=progress)
    print(summary.describe())
    return 0


def _cmd_generate_events(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.generate import Delivery, Scale, live_records

    scale = Scale(clients=args.clients, users_per_client=args.users, minutes=args.minutes,
                  start=args.start)
    delivery = Delivery(late_fraction=args.late_fraction,
                        duplicate_fraction=args.duplicate_fraction,
                        bad_fraction=args.bad_fraction)
    _check_within_accepted_times(scale.start, timedelta(minutes=scale.minutes), "--minutes",
                                 "the sessionizer would quarantine those events")
    if not args.out:  # before the records are built, which takes a while at a large scale
        _check_not_ahead_of_now(scale.start, timedelta(minutes=scale.minutes), config,
                                "the sessionizer would quarantine those events")
    records = live_records(scale, delivery, args.seed)
    if args.out:
        import json

        from clickstream.jobs.generate import file_in_the_way

        path = Path(args.out)
        if path.is_dir():
            raise ConfigError(f"--out {args.out!r} is a folder; name the JSON Lines file to write")
        in_the_way = file_in_the_way(path.parent)
        if in_the_way is not None:
            raise ConfigError(f"--out {args.out!r}: {in_the_way} is a file, not a folder; name "
                              "a file in a folder")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as handle:
                for key, value in records:
                    handle.write(json.dumps({"key": key, "value": value}) + "\n")
        except BrokenPipeError:  # a reader of /dev/stdout that stopped (| head): main's
            raise
        except OSError as error:  # the user's to fix: no traceback kept (from None)
            raise ConfigError(f"--out {args.out!r} cannot be written: {error.strerror or error}"
                              "; name a file in a folder this user can write") from None
        # On stderr: with ``--out /dev/stdout`` stdout holds only the records, for a pipe.
        print(f"wrote {len(records)} records to {path}", file=sys.stderr)
        return 0
    from clickstream.io.kafka_produce import produce_records

    sent = produce_records(config, config.events_topic, records, rate_per_second=args.rate)
    print(f"produced {sent} records to topic {config.events_topic} "
          f"at {config.kafka_bootstrap_servers}")
    return 0


def _span_end(start: datetime, length: timedelta, span: str) -> datetime:
    try:
        return start + length
    except OverflowError:
        raise ConfigError(f"--start and {span} reach beyond the year 9999; choose an earlier "
                          "--start") from None


def _check_within_accepted_times(start: datetime, length: timedelta, span: str,
                                 consequence: str) -> None:
    """Both parsers quarantine event times outside ``contract.EARLIEST_TS`` ..
    ``LATEST_TS``; refuse before writing any rather than label them valid (a file written
    with ``--out`` meets no check of the time ahead of now)."""
    if start < EARLIEST_TS:
        raise ConfigError(f"--start {start.isoformat()} is before {EARLIEST_TS.date()}, the "
                          f"earliest event time the product accepts: {consequence}; choose a "
                          "later --start")
    end = _span_end(start, length, span)
    if end > LATEST_TS:
        raise ConfigError(f"--start and {span} reach {end.isoformat()}, after "
                          f"{LATEST_TS.date()}, the latest event time the product accepts: "
                          f"{consequence}; choose an earlier --start")


def _check_not_ahead_of_now(start: datetime, length: timedelta, config: Config,
                            consequence: str, span: str = "--minutes") -> None:
    """Events produced now are received now, and a batch written now is judged against its
    files' time: stamped further ahead, the sessionizer or the backfill would quarantine them
    (CLICKSTREAM_MAX_TS_AHEAD), so refuse before writing any."""
    allowed = datetime.now(UTC) + timedelta(minutes=config.max_ts_ahead_minutes)
    latest = _span_end(start, length, span)
    if latest > allowed:
        raise ConfigError(
            f"--start and {span} reach {latest.isoformat()}, more than "
            f"{config.max_ts_ahead_minutes:g} minutes ahead of now: {consequence} as "
            f"stamped by a wrong clock ({ENV_NAMES['max_ts_ahead_minutes']}); choose an "
            "earlier --start")


def _cmd_generate_history(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.generate import Scale, history_folder, simulate, write_table

    _check_within_accepted_times(args.start, timedelta(days=args.days), "--days",
                                 "a backfill would quarantine those rows")
    _check_not_ahead_of_now(args.start, timedelta(days=args.days), config,
                            "a backfill would quarantine those rows", span="--days")
    target = history_folder(config, args.out, args.overwrite)
    scale = Scale(users_per_client=args.users, minutes=args.days * 24 * 60, start=args.start,
                  sessions_per_user_per_day=args.sessions_per_user_per_day,
                  order_probability=args.order_probability)
    pageviews, orders = simulate(scale, args.seed, client=args.client)
    for name, table in (("pageviews", pageviews), ("orders", orders)):
        try:
            files = write_table(table, target / name, args.format)
        except OSError as error:  # the user's to fix: no traceback kept (from None)
            raise ConfigError(f"--out {args.out!r}: {target / name} cannot be written: "
                              f"{error.strerror or error}; choose a landing folder "
                              "(CLICKSTREAM_LANDING, --landing) this user can write") from None
        print(f"wrote {table.num_rows} {name} of {args.client} to {target / name} "
              f"({len(files)} {args.format} files)")
    return 0


def _cmd_inspect(args: argparse.Namespace, config: Config) -> int:
    from clickstream.jobs.inspect import (
        describe_lag,
        describe_read_point,
        describe_sessionizer,
        describe_tables,
        describe_topic,
    )

    # Each part as soon as it is known: what needs no Kafka is shown when Kafka is down.
    parts = [partial(describe_tables, config, args.sample), partial(describe_read_point, config),
             partial(describe_sessionizer, config)]
    if args.lag:
        parts.append(partial(describe_lag, config))
    parts += [partial(describe_topic, config, topic, args.sample) for topic in args.topic or []]
    for part in parts:
        lines = part()
        if lines:
            print("\n".join(lines), flush=True)
    return 0


def _cmd_read_point(args: argparse.Namespace, config: Config) -> int:
    from clickstream.io import read_point
    from clickstream.io.delta_tables import open_tables

    if args.release:
        # Versions need no Spark: the delta-rs reader reads delta-spark's tables too.
        tables = open_tables(config.replace(delta_engine="deltalake"))
        read_point.release(config, tables, args.release)
        print(f"read-point: released {args.release}: what it committed is shown as it is",
              file=sys.stderr)
    point = read_point.current(config)
    print(json.dumps({
        "read_point": None if point is None else point.to_json(),
        "open_groups": read_point.describe_open_groups(config),
        "file": str(read_point.folder(config) / read_point.READ_POINT_FILE)}, indent=1))
    return 0


def _given(text: str) -> str:
    """A value whose absence means something else: ``--out ""`` (a variable left unset) sent
    the events to Kafka, ``--run-id ""`` dropped the pin on the batch's files."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a value or leave the flag "
                                         "out")
    return text


def _topic_name(text: str) -> str:
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a topic name (empty, or spaces "
                                         "around it)")
    return text


def _iso_datetime(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ISO-8601 (2026-11-01T00:00Z)") from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone; add Z or +hh:mm")
    return value


def _number(kind: Callable[[str], float], low: float, high: float | None = None,
            low_included: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` number from ``low`` (up to ``high``)."""
    bounds = (f"{'at least' if low_included else 'greater than'} {low:g}"
              + (f" and at most {high:g}" if high is not None else ""))

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value >= low if low_included else value > low)
                and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{text!r} must be {bounds}")
        return value

    return parse


_DEFAULT = "(default: %(default)s)"
_COUNT = _number(int, 1)
_SEED = _number(int, 0)
_FRACTION = _number(float, 0, 1)
_SPAN = _number(float, 0, 1e7, low_included=False)  # 1e7: within what dates can hold


def _client_id(text: str) -> str:
    problem = client_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a client id: {problem}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clickstream",
        description="Late-data-aware sessionization on Spark, Delta Lake and Kafka.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    broker = commands.add_parser(
        "broker", help="run the embedded Kafka-protocol broker in the foreground",
        description="Run the embedded Kafka-protocol broker (librdkafka's mock cluster) until "
        "Ctrl-C or SIGTERM, with the configured topics (CLICKSTREAM_EVENTS_TOPIC, "
        "CLICKSTREAM_SESSIONS_TOPIC, CLICKSTREAM_ATTRIBUTIONS_TOPIC), 16 partitions each. "
        "Memory only: its data is gone when it stops.")
    broker.add_argument("--port", type=port_number, default=9092,
                        help="fixed port, 0 for any free one (default 9092)")
    broker.add_argument("--host", type=host_address, default="127.0.0.1", help=(
        "address the bootstrap port binds (default 127.0.0.1); clients must run on this "
        "machine whatever it is: after bootstrapping they are sent to the broker's loopback "
        "address. The broker has no authentication: any host that reaches this port can "
        "read and write every topic through it, so keep it on loopback"))
    # Its topic names only: a malformed setting of the jobs (a session gap, a warehouse path)
    # stopped the broker, naming flags it does not take.
    broker.set_defaults(handler=_cmd_broker, reads_settings=BROKER_SETTINGS)

    sessionize = commands.add_parser(
        "sessionize", help="run the streaming sessionizer (Kafka events -> Delta and Kafka)",
        description="Read the events topic, quarantine bad records, store every pageview and "
        "order exactly once, and emit sessions as they close to the sessions table and topic.")
    sessionize.add_argument("--until-caught-up", action="store_true",
                            help="process everything available now, commit, and stop")
    sessionize.add_argument("--max-events-per-trigger", type=_COUNT, default=None,
                            help="rate limit: at most this many records per micro-batch "
                            f"(default {Config().max_events_per_trigger}) "
                            f"[env {ENV_NAMES['max_events_per_trigger']}]")
    sessionize.add_argument(
        cli_flag("fail_on_data_loss"), dest="fail_on_data_loss", default=None,
        metavar="true|false",
        help="false: go on when the broker dropped records not read yet, recording each lost "
        f"run of offsets in quarantine (default true: stop) [env {ENV_NAMES['fail_on_data_loss']}]")
    sessionize.add_argument(
        cli_flag("idle_clock_after_minutes"), dest="idle_clock_after_minutes", default=None,
        metavar="DURATION",
        help="after this long with no new event, the stream's event time runs on at the wall "
        "clock's pace so that the sessions open when it went quiet close; off: they wait for "
        f"the next events (default {Config().idle_clock_after_minutes:g} minutes) "
        f"[env {ENV_NAMES['idle_clock_after_minutes']}]")
    _add_config_flags(sessionize)
    sessionize.set_defaults(handler=_cmd_sessionize)

    backfill = commands.add_parser(
        "backfill", help="merge a late historical batch and correct only what it affects",
        description="Validate a batch from the landing folder (bad rows to quarantine), merge "
        "it into pageviews/orders exactly once, recompute the affected sessions and "
        "attributions, record corrections, and republish them to Kafka.")
    backfill.add_argument("--kind", required=True, choices=("orders", "pageviews"))
    backfill.add_argument("--client", required=True, type=_client_id,
                          help="the client the batch belongs to")
    backfill.add_argument("--path", required=True,
                          help="file or folder (Parquet, CSV, JSON Lines) relative to the "
                          "landing folder, or absolute inside it")
    _add_config_flags(backfill)
    backfill.set_defaults(handler=_cmd_backfill)

    step = commands.add_parser(
        "backfill-step", help="one step of a backfill (what the late_batch_backfill DAG runs)",
        description="Run one step of `clickstream backfill` on its own: check (writes "
        "nothing), merge, recompute (plan and apply), check-applied, publish, report. Each "
        "step saves its result under $CLICKSTREAM_HOME/runs/backfill/<run id>/ for the next "
        "(a dry run's under <run id>.dry-run/).")
    step.add_argument("step", choices=("check", "merge", "recompute", "check-applied",
                                       "publish", "report"))
    step.add_argument("--kind", required=True, choices=("orders", "pageviews"))
    step.add_argument("--client", required=True, type=_client_id,
                      help="the client the batch belongs to")
    step.add_argument("--path", required=True, help="as for `clickstream backfill`")
    step.add_argument("--run-id", type=_given, default=None,
                      help="the run id the batch was located as; the step refuses files that "
                      "changed since (default: the batch as it is now)")
    step.add_argument("--dry-run", type=_true_or_false, default=False, metavar="true|false",
                      help="check: also run the historical_batch gate; report: a dry run's "
                      "(other steps refuse it: they write)")
    _add_config_flags(step)
    step.set_defaults(handler=_cmd_backfill_step)

    recompute = commands.add_parser(
        "recompute", help="fold the recompute queue (events too late for the stream) in",
        description="Recompute the sessions affected by queued late events, record the "
        "corrections, republish them, and clear the processed queue rows. Safe while the "
        "sessionizer runs: sessions it still holds open stay queued.")
    recompute.add_argument("--client", default=None, type=_client_id,
                           help="only this client (default: all)")
    recompute.add_argument("--full", action="store_true",
                           help="delete-and-rewrite all sessions of --client from all its data "
                           "(slow; a repair tool and the benchmark baseline)")
    recompute.add_argument("--save-result-as", type=_given, default=None, metavar="NAME",
                           help="also save the tables the run changed to "
                           "$CLICKSTREAM_HOME/runs/recompute/NAME.json (the scheduled_recompute "
                           "DAG announces them as Asset events)")
    _add_config_flags(recompute)
    recompute.set_defaults(handler=_cmd_recompute)

    republish = commands.add_parser(
        "republish", help="publish the sessions and attributions tables to their topics as "
        "they are (after a broker lost them)",
        description="Publish every row of the sessions and attributions tables to their "
        "changelog topics at its stored revision, retract keys a topic holds that its table "
        "does not, read the topics back, and record them as the tables' logs. For topics that "
        "lost their log (the embedded broker restarted empty, a topic created again: jobs "
        "refuse a topic that is not the log the tables were published to) and after a move to "
        "new ones (another Kafka, renamed, more partitions: not detected). Run it with the "
        "sessionizer stopped.")
    _add_config_flags(republish)
    republish.set_defaults(handler=_cmd_republish)

    maintain = commands.add_parser(
        "maintain", help="compact, vacuum and checkpoint every table (the weekly "
        "table_maintenance DAG's steps)",
        description="Compact small files, delete files no version within the retention needs "
        "(and files a killed writer left, once that old), and write a log checkpoint, for every "
        "table. Changes no data; safe while the other jobs run. Each step tries every table "
        "and runs whatever the step before did; the command then fails naming each failure.")
    maintain.add_argument("--retention-hours", type=int, default=168,
                          help="vacuum's retention, from 168 (a week) to 87600 (ten years) "
                          + _DEFAULT)
    _add_config_flags(maintain)
    maintain.set_defaults(handler=_cmd_maintain)

    inspect = commands.add_parser(
        "inspect", help="row counts of the Delta tables and the compacted view of topics",
        description="Print every table's version and row count (read through the Delta log), "
        "where the sessionizer's checkpoint stands (last committed micro-batch, event-time "
        "watermark, offsets), and, with --topic, a topic's compacted view (last value per "
        "key).")
    inspect.add_argument("--topic", action="append", type=_topic_name,
                         help="also read this topic (repeatable)")
    inspect.add_argument("--lag", action="store_true",
                         help="also ask Kafka how far the events topic's end is past the "
                         "sessionizer's committed offsets")
    inspect.add_argument("--sample", type=_SEED, default=0,
                         help="print this many rows of each")
    _add_config_flags(inspect)
    inspect.set_defaults(handler=_cmd_inspect)

    point = commands.add_parser(
        "read-point", help="the table versions at which each client's tables agree (a "
        "reader never sees half a backfill)",
        description="Print the read point as JSON: per table, the Delta version to read "
        "(\"versions\"), and for a client a backfill or correction is changing right now, the "
        "versions it is read at until the change is whole (\"held\"), with the open groups "
        "holding it. Read each table at its version (e.g. deltalake's DeltaTable(path, "
        "version=v), Spark's versionAsOf) to see every client's tables agree.")
    point.add_argument("--release", metavar="GROUP",
                       help="give up on an open group that will never be rerun: what it "
                       "committed becomes visible as it is")
    _add_config_flags(point, only=("warehouse",))
    point.set_defaults(handler=_cmd_read_point)

    generate = commands.add_parser("generate", help="write realistic synthetic data")
    kinds = generate.add_subparsers(dest="kind", required=True, metavar="KIND")
    events = kinds.add_parser(
        "events", help="live events to Kafka (or a JSON Lines file)",
        description="Live events with out-of-order delivery, late events, duplicates and bad "
        "records; produced to the events topic, or written to --out.")
    events.add_argument("--seed", type=_SEED, default=7, help=_DEFAULT)
    events.add_argument("--clients", type=_COUNT, default=3, help=_DEFAULT)
    events.add_argument("--users", type=_COUNT, default=50, help="users per client " + _DEFAULT)
    events.add_argument("--minutes", type=_SPAN, default=24 * 60,
                        help="event-time span " + _DEFAULT)
    events.add_argument("--start", type=_iso_datetime,
                        default=_iso_datetime("2026-11-01T00:00:00+00:00"),
                        help="start of the event-time span " + _DEFAULT)
    events.add_argument("--late-fraction", type=_FRACTION, default=0.01,
                        help="share of events delivered 3 hours late " + _DEFAULT)
    events.add_argument("--duplicate-fraction", type=_FRACTION, default=0.02,
                        help="share of events sent twice " + _DEFAULT)
    events.add_argument("--bad-fraction", type=_FRACTION, default=0.01,
                        help="bad records added, as a share of the events " + _DEFAULT)
    events.add_argument("--rate", type=_SPAN, default=None,
                        help="records per second to Kafka (default: as fast as it takes them)")
    events.add_argument("--out", type=_given, default=None,
                        help="write JSON Lines here instead of Kafka")
    _add_config_flags(events, GENERATE_EVENTS_SETTINGS)
    events.set_defaults(handler=_cmd_generate_events, reads_settings=GENERATE_EVENTS_SETTINGS)

    history = kinds.add_parser(
        "history", help="a historical batch (pageviews and orders) in the landing folder",
        description="Write DIR/pageviews and DIR/orders for one client under the landing folder.")
    history.add_argument("--client", required=True, type=_client_id)
    history.add_argument("--days", type=_SPAN, default=365, help="days of history " + _DEFAULT)
    history.add_argument("--users", type=_COUNT, default=500,
                         help="users of the client " + _DEFAULT)
    history.add_argument("--sessions-per-user-per-day", type=_SPAN, default=1.0,
                         help="mean sessions a user starts per day " + _DEFAULT)
    history.add_argument("--order-probability", type=_FRACTION, default=0.08,
                         help="chance that a session has an order " + _DEFAULT)
    history.add_argument("--start", type=_iso_datetime,
                         default=_iso_datetime("2025-11-01T00:00:00+00:00"),
                         help="start of the first day " + _DEFAULT)
    history.add_argument("--seed", type=_SEED, default=11, help=_DEFAULT)
    history.add_argument("--format", choices=("parquet", "csv", "jsonl"), default="parquet",
                         help=_DEFAULT)
    history.add_argument("--out", default="history",
                         help="folder relative to the landing folder " + _DEFAULT)
    history.add_argument("--overwrite", action="store_true",
                         help="replace the batch an earlier run wrote to --out")
    _add_config_flags(history, GENERATE_HISTORY_SETTINGS)
    history.set_defaults(handler=_cmd_generate_history,
                         reads_settings=GENERATE_HISTORY_SETTINGS)
    return parser


@contextmanager
def _noting_interrupts() -> Iterator[threading.Event]:
    """``interrupts.pressed``, set once Ctrl-C was pressed during the command; the interrupt is
    raised as usual. A C extension whose Python callback the ``KeyboardInterrupt`` hit may
    lose it and raise ``SystemError`` (``interrupts``), which was reported as an unexpected
    error, exit 1, instead of interrupted, 130. The handler found is put back after."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    interrupts.pressed.clear()
    interrupts.note_sigint()
    try:
        yield interrupts.pressed
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    # Progress lines reach a log file or a pipe as they are printed, not when a block fills
    # (lost at a kill -9, when they matter most), and each in one write: unbuffered (Spark's
    # runner sets PYTHONUNBUFFERED) a print wrote its text and its newline apart, and the JVM's
    # log lines, in the same file, landed between them.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent on a StringIO
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)
    parser = build_parser()
    args = parser.parse_args(argv)
    with _noting_interrupts() as ctrl_c:
        return _run(args, ctrl_c)


def _run(args: argparse.Namespace, ctrl_c: threading.Event) -> int:
    config: Config | None = None
    try:
        overrides = {name: getattr(args, name, None) for name in ENV_NAMES
                     if getattr(args, name, None) is not None}
        reads = getattr(args, "reads_settings", None)  # a command reading only these
        environ = None if reads is None else {
            ENV_NAMES[name]: os.environ[ENV_NAMES[name]] for name in reads
            if ENV_NAMES[name] in os.environ}
        config = Config.from_env(environ, **overrides)
        return args.handler(args, config)
    except ClickstreamError as error:
        unforeseen = error.__cause__ is not None and not isinstance(error.__cause__,
                                                                    ClickstreamError)
        return _failed(args.command, config, error,
                       keep_traceback=isinstance(error, QueryFailedError) or unforeseen)
    except KeyboardInterrupt:
        print(f"clickstream {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # its reader stopped reading (| head): done, as a shell's tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 141  # 128 + SIGPIPE, what a pipeline reports for a tool a closed pipe stopped
    except Exception as error:  # a bug or an engine's failure: one line, the traceback kept
        if isinstance(error, SystemError) and ctrl_c.is_set():  # the interrupt, lost
            print(f"clickstream {args.command}: interrupted", file=sys.stderr)
            return 130
        carried = carried_error(error)  # the product's own, raised in a Spark worker
        if carried is not None:
            return _failed(args.command, config, carried, keep_traceback=True)
        _print_notes(args.command, error)
        print(f"clickstream {args.command}: unexpected error: {typed_error_line(error)}; "
              f"{_keep_traceback(config, args.command)}", file=sys.stderr)
        return 1


def _failed(command: str, config: Config | None, error: ClickstreamError, *,
            keep_traceback: bool) -> int:
    """The error in one line, always: a message carrying an engine's text (several lines) is
    cut to its first, and kept whole in the traceback file; so is one raised from a bug (a
    recompute's clients, R12). Above it, a line per failure noted on the way (``add_note``:
    a failed run's summary page that could not be written): not part of ``str(error)``, they
    were never shown."""
    _print_notes(command, error)
    first, *rest = str(error).strip().splitlines() or [""]
    kept = f"; {_keep_traceback(config, command)}" if keep_traceback or rest else ""
    print(f"clickstream {command}: error: {first}{kept}", file=sys.stderr)
    return EXIT_NOT_RETRYABLE if isinstance(error, NOT_RETRYABLE) else 1


def _print_notes(command: str, error: BaseException) -> None:
    for note in getattr(error, "__notes__", ()):
        print(f"clickstream {command}: also: {error_line(str(note))}", file=sys.stderr)


def _keep_traceback(config: Config | None, command: str) -> str:
    """Where the traceback of an unexpected error went: a file under the home's ``logs``
    folder, or this process's stderr when that cannot be written."""
    import tempfile
    import traceback

    folder = (config.home if config else Path(tempfile.gettempdir())) / "logs"
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    path = folder / f"clickstream-{command}-{stamp}-{os.getpid()}.traceback"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
    except OSError:
        traceback.print_exc()
        return "its traceback is above"
    return f"traceback in {path}"


if __name__ == "__main__":
    sys.exit(main())
