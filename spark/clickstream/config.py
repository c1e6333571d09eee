"""The one configuration object, built once at the edge (CLI, DAG task, spark-submit entry point).

Every setting comes from an environment variable (``CLICKSTREAM_*`` and ``KAFKA_BOOTSTRAP_SERVERS``)
and can be overridden by a CLI flag of the same name. Defaults live here and only here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from clickstream.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VAR = REPO_ROOT / "var"

KafkaSourceKind = Literal["python", "native"]
DeltaEngineKind = Literal["deltalake", "delta-spark"]
QualityGatesMode = Literal["enforce", "off"]
JvmClassArchiveMode = Literal["auto", "off"]
DriverGcKind = Literal["parallel", "g1"]

# Environment variable name for each field; one place, used by the CLI and the docs.
ENV_NAMES: dict[str, str] = {
    "warehouse": "CLICKSTREAM_WAREHOUSE",
    "home": "CLICKSTREAM_HOME",
    "landing": "CLICKSTREAM_LANDING",
    "kafka_bootstrap_servers": "KAFKA_BOOTSTRAP_SERVERS",
    "session_gap_minutes": "CLICKSTREAM_SESSION_GAP",
    "watermark_delay_minutes": "CLICKSTREAM_WATERMARK_DELAY",
    "max_ts_ahead_minutes": "CLICKSTREAM_MAX_TS_AHEAD",
    "idle_clock_after_minutes": "CLICKSTREAM_IDLE_CLOCK_AFTER",
    "events_topic": "CLICKSTREAM_EVENTS_TOPIC",
    "sessions_topic": "CLICKSTREAM_SESSIONS_TOPIC",
    "attributions_topic": "CLICKSTREAM_ATTRIBUTIONS_TOPIC",
    "kafka_source": "CLICKSTREAM_KAFKA_SOURCE",
    "delta_engine": "CLICKSTREAM_DELTA_ENGINE",
    "spark_master": "CLICKSTREAM_SPARK_MASTER",
    "shuffle_partitions": "CLICKSTREAM_SHUFFLE_PARTITIONS",
    "max_events_per_trigger": "CLICKSTREAM_MAX_EVENTS_PER_TRIGGER",
    "trigger_interval_seconds": "CLICKSTREAM_TRIGGER_INTERVAL",
    "progress_interval_seconds": "CLICKSTREAM_PROGRESS_INTERVAL",
    "kafka_options": "CLICKSTREAM_KAFKA_OPTIONS",
    "spark_kafka_options": "CLICKSTREAM_SPARK_KAFKA_OPTIONS",
    "quality_gates": "CLICKSTREAM_QUALITY_GATES",
    "driver_memory": "CLICKSTREAM_DRIVER_MEMORY",
    "fail_on_data_loss": "CLICKSTREAM_FAIL_ON_DATA_LOSS",
    "kafka_transactions": "CLICKSTREAM_KAFKA_TRANSACTIONS",
    "jvm_class_archive": "CLICKSTREAM_JVM_CLASS_ARCHIVE",
    "driver_gc": "CLICKSTREAM_DRIVER_GC",
}

# The settings every command also takes as a flag (cli.py adds them), with their help.
FLAG_HELP: Mapping[str, str] = {
    "warehouse": "root folder of the Delta tables",
    "home": "checkpoints, reports and local state",
    "landing": "folder historical batches are read from",
    "kafka_bootstrap_servers": "Kafka to use (embedded broker: 127.0.0.1:9092)",
    "session_gap_minutes": "session gap (30, 45s, 1h)",
    "watermark_delay_minutes": "how late an event may be and still join the stream",
    "max_ts_ahead_minutes": "how far an event's ts may be ahead of its arrival at Kafka",
    "spark_master": "Spark master URL",
    "quality_gates": "data-quality gates: enforce (default) or off",
}
# ... and those only `sessionize` takes.
_FLAGGED = {*FLAG_HELP, "fail_on_data_loss", "max_events_per_trigger",
            "idle_clock_after_minutes"}
# The durations that also take "off" (or 0).
_MAY_BE_OFF = ("idle_clock_after_minutes",)
# The settings that are true or false.
_BOOLEANS = ("fail_on_data_loss", "kafka_transactions")

# A unit is required: a bare number reaches the JVM's -Xmx/-Xms as bytes, too small to start.
_MEMORY = re.compile(r"^[1-9]\d*[kmgt]$", re.IGNORECASE)
_UNIT_MIB = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}
# The master URLs Spark 4 accepts (Mesos was removed in 4.0); checked here because a bad one
# makes the JVM exit with a stack trace before PySpark says anything useful.
_MASTER = re.compile(r"^(local(\[([1-9]\d*|\*)(,\d+)?\])?|local-cluster\[\d+, *\d+, *\d+\]"
                     r"|spark://\S+|yarn|k8s://\S+)$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_UNIT_MINUTES = {"ms": 1 / 60_000, "s": 1 / 60, "m": 1.0, "min": 1.0, "h": 60.0}


def cli_flag(name: str) -> str:
    """The command-line flag of a setting: ``session_gap_minutes`` -> ``--session-gap``."""
    return "--" + name.removesuffix("_minutes").replace("_", "-")


MAX_DURATION_MINUTES = 100 * 365.25 * 24 * 60  # event times lie in 2000..2100 (contract)


def parse_minutes(text: str, name: str, bare_unit: str = "m") -> float:
    """Parse ``"30"`` (``bare_unit``, minutes by default), ``"45s"``, ``"1.5h"``, ``"500ms"``."""
    match = _DURATION.match(str(text))
    bare_example = "minutes (30)" if bare_unit == "m" else "seconds (10)"
    if not match and _DURATION.match(str(text).strip().removeprefix("-")):
        raise ConfigError(f"{name}={text!r} is negative; a duration is at least 1ms")
    if not match:
        raise ConfigError(
            f"{name}={text!r} is not a duration; use {bare_example} or a unit: "
            "500ms, 45s, 30m, 2h"
        )
    minutes = float(match.group(1)) * _UNIT_MINUTES[match.group(2) or bare_unit]
    if minutes > MAX_DURATION_MINUTES:  # beyond every event time; 400 nines were infinite
        raise ConfigError(f"{name}={text!r} must be at most 100 years")
    if round(minutes * 60_000) < 1:  # durations are kept in whole milliseconds
        raise ConfigError(f"{name}={text!r} must be at least 1ms")
    return minutes


def parse_bool(text: str, name: str) -> bool:
    """Parse ``"true"`` / ``"false"`` (any case: ``str(True)`` is how scripts pass a bool)."""
    if text.strip().lower() not in ("true", "false"):
        raise ConfigError(f"{name}={text!r} is not accepted; use true or false")
    return text.strip().lower() == "true"


def option_place(number: int, previous: str) -> str:
    """An option named by its place, not quoted: a malformed one, or a name the client does
    not know, is most likely the rest of a password cut at an unescaped comma, and the message
    reaches task logs and the command's one-line reason."""
    return f"item {number}" + (f" (after {previous!r})" if previous else "")


def parse_options(text: str, name: str) -> dict[str, str]:
    """Parse ``"a=1,b=2"`` into a mapping of extra Kafka client settings; ``\\,`` is a comma
    inside a value (list settings such as ``ssl.cipher.suites``, a password)."""
    options: dict[str, str] = {}
    previous = ""
    for number, part in enumerate(re.split(r"(?<!\\),", text), start=1):
        item = part.strip().replace("\\,", ",")
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{name}: {option_place(number, previous)} is not key=value "
                              "(example: linger.ms=5,acks=all; write a comma inside a value "
                              "as \\,)")
        previous = key.strip()
        if previous == "transactional.id":
            raise ConfigError(
                f"{name}: transactional.id would make every send of the product need a "
                "transaction (each failed with 'Erroneous state'); set "
                "CLICKSTREAM_KAFKA_TRANSACTIONS=true for corrections to publish in one")
        if previous in _BOOTSTRAP_OPTIONS:
            raise ConfigError(
                f"{name}: {previous} is KAFKA_BOOTSTRAP_SERVERS' (--kafka-bootstrap-servers); "
                "remove it here: the clients used it over that variable silently, and errors "
                "named the address they did not use")
        options[previous] = value.strip()
    return options


# Kafka's address under the names a client's settings take it.
_BOOTSTRAP_OPTIONS = frozenset({"bootstrap.servers", "metadata.broker.list"})


@dataclass(frozen=True)
class Config:
    """Settings of one run. Paths are absolute; durations carry their unit in the name."""

    warehouse: Path = DEFAULT_VAR / "warehouse"
    home: Path = DEFAULT_VAR / "home"
    landing: Path = DEFAULT_VAR / "landing"
    kafka_bootstrap_servers: str = "127.0.0.1:9092"
    session_gap_minutes: float = 30.0
    watermark_delay_minutes: float = 10.0
    # How far an event's ts may be ahead of its arrival (the record's Kafka timestamp, or the
    # micro-batch's time if earlier: events.parse._arrival). One event further ahead would
    # carry the stream's watermark with it: every on-time event after it would count as late
    # and every open session would close early.
    # Such an event is quarantined (events.parse.ts_ahead_error).
    max_ts_ahead_minutes: float = 10.0
    # After this long with no new record on the events topic, the continuous sessionizer's
    # event time runs on at the wall clock's pace, so the sessions open when the stream went
    # quiet close (io.stream_clock); 0 ("off"): they wait for the next events.
    idle_clock_after_minutes: float = 5.0
    events_topic: str = "events"
    sessions_topic: str = "sessions"
    attributions_topic: str = "attributions"
    kafka_source: KafkaSourceKind = "python"
    delta_engine: DeltaEngineKind = "deltalake"
    spark_master: str = "local[*]"
    shuffle_partitions: int = 4
    # A micro-batch costs ~4.4 s whatever its size here (session state, commits, the sink's
    # jobs): a catch-up at 500k per batch ran ~30% faster than at 200k (BENCHMARKS.md).
    max_events_per_trigger: int = 500_000
    trigger_interval_seconds: float = 2.0
    # backfill, backfill-step and recompute say they are still working after this long
    # without a progress line, and what Spark is doing (clickstream.progress).
    progress_interval_seconds: float = 30.0
    kafka_options: Mapping[str, str] = field(default_factory=dict)
    # Spark's native Kafka source is the Java client, which names some settings otherwise
    # (sasl.jaas.config, ssl.truststore.location) and librdkafka refuses those names: one
    # variable could not carry credentials for both. Over kafka_options, native source only.
    spark_kafka_options: Mapping[str, str] = field(default_factory=dict)
    # "enforce": data-quality gates (clickstream.quality) validate every step and stop it on
    # failure; "off": skipped (an emergency bypass, and the baseline of the gates' benchmark).
    quality_gates: QualityGatesMode = "enforce"
    # spark.driver.memory of the sessions this product starts; with a local master the
    # executors live in the driver's JVM, so this is all the memory a local job has.
    driver_memory: str = "4g"
    # True: the Kafka source stops with DataLossError when the broker dropped records it has
    # not read. False: it records each lost run of offsets in quarantine and reads on, keeping
    # its checkpoint and state (io.kafka_source K1, K2; Spark's failOnDataLoss=false).
    fail_on_data_loss: bool = True
    # True: a correction run (backfill, recompute) publishes its sessions and attributions
    # in one Kafka transaction, so a read_committed reader sees the run's changes to both
    # topics together or none. Off by default: the embedded broker accepts transactions but
    # does not hide open ones from readers; the cluster profile turns it on.
    kafka_transactions: bool = False
    # "auto": drivers map the class archive scripts/setup.sh built for this environment, when
    # it is there (clickstream.jvm_class_archive: about half a short job's start-up CPU);
    # "off": they load every class from the jars.
    jvm_class_archive: JvmClassArchiveMode = "auto"
    # The driver JVM's garbage collector. "parallel": the most work per CPU-second, and every
    # job here is bound by its two cores (5-7% faster than G1, and no longer latency at
    # 20,000 events/s: BENCHMARKS.md, session 39). "g1": the JVM's own default, shorter
    # pauses at a cost in throughput.
    driver_gc: DriverGcKind = "parallel"

    def __post_init__(self) -> None:
        _check_choice("kafka_source", self.kafka_source, KafkaSourceKind)
        _check_choice("delta_engine", self.delta_engine, DeltaEngineKind)
        _check_choice("quality_gates", self.quality_gates, QualityGatesMode)
        _check_choice("jvm_class_archive", self.jvm_class_archive, JvmClassArchiveMode)
        _check_choice("driver_gc", self.driver_gc, DriverGcKind)
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):  # a text "false" would be true
                raise ConfigError(f"{ENV_NAMES[name]} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        idle_after = self.idle_clock_after_minutes
        if idle_after < 0:
            raise ConfigError(f"{_setting_value('idle_clock_after_minutes', idle_after)} is "
                              "negative; give a duration, or off")
        for name in ("shuffle_partitions", "max_events_per_trigger"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{_setting_value(name, value)} must be at least 1")
        _check_topics(self)
        if not _MASTER.match(self.spark_master):
            raise ConfigError(f"spark master {self.spark_master!r} ({ENV_NAMES['spark_master']} "
                              f"or {cli_flag('spark_master')}) is not a Spark master URL; use "
                              "local[*], local[2], spark://host:7077, yarn or k8s://host:port")
        if not _MEMORY.match(self.driver_memory):
            raise ConfigError(f"{ENV_NAMES['driver_memory']}={self.driver_memory!r} is not a "
                              "JVM memory size with a unit; use e.g. 4g or 2048m")
        for name in ("warehouse", "home", "landing"):
            folder = Path(getattr(self, name)).expanduser().resolve()
            object.__setattr__(self, name, folder)
            reason = unreadable_path_reason(str(folder))
            if reason:  # every table read names files below the warehouse to Spark
                raise ConfigError(f"{_setting_value(name, str(folder))} {reason}; choose a "
                                  "folder whose path has none of these characters")

    @property
    def driver_memory_mib(self) -> int:
        return int(int(self.driver_memory[:-1]) * _UNIT_MIB[self.driver_memory[-1].lower()])

    @property
    def session_gap_ms(self) -> int:
        return round(self.session_gap_minutes * 60_000)

    @property
    def watermark_delay_ms(self) -> int:
        return round(self.watermark_delay_minutes * 60_000)

    @property
    def max_ts_ahead_ms(self) -> int:
        return round(self.max_ts_ahead_minutes * 60_000)

    @property
    def idle_clock_after_ms(self) -> int:
        return round(self.idle_clock_after_minutes * 60_000)

    def table_path(self, table: str) -> Path:
        """Folder of one Delta table under the warehouse."""
        return self.warehouse / table

    def in_landing(self, path: str | Path) -> tuple[Path, bool]:
        """``path`` (relative to the landing folder, or absolute) with ``..`` and links
        resolved, and whether it is still inside the landing folder (it or below it)."""
        candidate = Path(path)
        resolved = (candidate if candidate.is_absolute() else self.landing / candidate).resolve()
        return resolved, resolved == self.landing or self.landing in resolved.parents

    def checkpoint_path(self, job: str) -> Path:
        """Spark checkpoint folder of one streaming job under the product's home."""
        return self.home / "checkpoints" / job

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> Config:
        """Build from ``CLICKSTREAM_*`` variables; non-None ``overrides`` (CLI flags) win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, var in ENV_NAMES.items():
            # A flag given wins unread: a malformed variable it overrides is no error.
            if var in env and env[var] != "" and overrides.get(name) is None:
                values[name] = _convert(name, env[var], var)
        for name, value in overrides.items():
            if name not in ENV_NAMES:
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(ENV_NAMES)}")
            if value is not None:
                values[name] = _convert(name, value, cli_flag(name))
        return cls(**values)  # type: ignore[arg-type]


GLOB_CHARACTERS = frozenset("*?[]{}\\")  # Hadoop's glob syntax


def unreadable_path_reason(path: str) -> str | None:
    """Why Spark cannot read ``path`` as the one file or folder it names, or None: the
    landing folder's batches (batch_input B5) and the folders of this configuration."""
    if GLOB_CHARACTERS & set(path):
        return (f"has one of {' '.join(sorted(GLOB_CHARACTERS))} in its path, which Spark "
                "would read as a pattern matching other files")
    if ":" in path:
        return ("has ':' in its path, which Spark's file system cannot open (it reads the "
                "text before ':' as a URI scheme)")
    return None


def _convert(name: str, raw: object, source: str) -> object:
    if not isinstance(raw, str):
        return raw
    if not raw.strip():  # an unset shell variable passed as a flag, not "the current folder"
        raise ConfigError(f"{source} is empty; give a value or leave it out for the default")
    if name in _MAY_BE_OFF and _is_off(raw):
        return 0.0
    if name.endswith("_minutes"):
        return parse_minutes(raw, source)
    if name.endswith("_seconds"):
        return parse_minutes(raw, source, bare_unit="s") * 60
    if name in ("shuffle_partitions", "max_events_per_trigger"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{source}={raw!r} is not an integer") from None
    if name in ("kafka_options", "spark_kafka_options"):
        return parse_options(raw, source)
    if name in _BOOLEANS:
        return parse_bool(raw, source)
    return raw


def _is_off(text: str) -> bool:
    """``off``, or a zero duration (``0``, ``0s``; ``0.0`` is how a script passes the float)."""
    match = _DURATION.match(text)
    return text.strip().lower() == "off" or (match is not None and float(match.group(1)) == 0)


def _setting_value(name: str, value: object) -> str:
    """A setting's value as a message names it: with its variable, and with its flag where
    commands take one (the value may have come from either)."""
    if name in _FLAGGED:
        return f"{value!r} ({ENV_NAMES[name]} or {cli_flag(name)})"
    return f"{ENV_NAMES[name]}={value!r}"


_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")  # what Kafka accepts


def _check_topics(config: Config) -> None:
    """Each topic a name Kafka accepts, and one topic per role: the stream would publish its
    sessions to the topic it reads, or attributions would replace sessions under their keys."""
    roles = ("events_topic", "sessions_topic", "attributions_topic")
    for name in roles:
        if not _TOPIC_NAME.fullmatch(getattr(config, name)) or getattr(config, name) in (
                ".", ".."):
            raise ConfigError(f"{_setting_value(name, getattr(config, name))} is not a Kafka "
                              "topic name; use 1-249 letters, digits, '.', '_' or '-'")
    for i, name in enumerate(roles):
        for other in roles[i + 1:]:
            if getattr(config, name) == getattr(config, other):
                raise ConfigError(f"{ENV_NAMES[name]} and {ENV_NAMES[other]} both name topic "
                                  f"{getattr(config, name)!r}; give each role its own topic")


def _check_choice(name: str, value: str, kind: object) -> None:
    accepted = get_args(kind)
    if value not in accepted:
        raise ConfigError(
            f"{_setting_value(name, value)} is not accepted; use one of: {', '.join(accepted)}"
        )
