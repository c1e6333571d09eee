"""Read and validate a historical batch from the landing folder (the backfill's first step).

A batch is refused as a whole (``BatchRefusedError``, nothing written) when its path is outside
the landing folder, it holds no readable files, mixes formats, or lacks required columns.
Otherwise every row comes out valid or with a reason, which becomes its quarantine row.
Time always comes from ``ts``, never from load time.

Known edge cases, cited inline as (B1)..(B4):
  B1. ``..`` segments and symlinks are resolved before the landing check, so neither can
      escape the landing folder.
  B2. ``ts`` may arrive as text (ISO-8601 with zone, or epoch ms), an integer (epoch ms) or a
      Parquet timestamp (an instant, already UTC); all three are accepted.
  B3. The same id twice in one batch with identical content counts once; with different
      content the batch contradicts itself, so every copy is quarantined.
  B4. A row of another client than ``--client`` is quarantined, never merged into the
      declared client's partitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DateType, IntegralType, StringType, TimestampType

from clickstream.config import Config
from clickstream.errors import BatchRefusedError
from clickstream.events.parse import amount_error, currency_error, ts_error, ts_from_text
from clickstream.tables import AMOUNT_TYPE

BatchKind = Literal["orders", "pageviews"]
FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json",
           ".ndjson": "json"}
REQUIRED = {
    "orders": ("order_id", "client_id", "user_id", "ts", "amount", "currency"),
    "pageviews": ("event_id", "client_id", "user_id", "ts", "url", "referrer"),
}
KEY = {"orders": "order_id", "pageviews": "event_id"}


@dataclass(frozen=True)
class BatchFiles:
    """The files of one batch, all of one format."""

    root: Path
    files: tuple[Path, ...]
    file_format: str

    @property
    def fingerprint(self) -> str:
        """Identity of the batch's content (names, sizes, modification times)."""
        import hashlib

        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path}\x1f{stat.st_size}\x1f{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()[:16]


def resolve_in_landing(config: Config, path: str) -> Path:
    """The batch path, refused unless it is inside the landing folder (B1)."""
    landing = config.landing.resolve()
    candidate = Path(path)
    resolved = (candidate if candidate.is_absolute() else landing / candidate).resolve()
    if resolved != landing and landing not in resolved.parents:
        raise BatchRefusedError(
            f"batch path {path!r} resolves to {resolved}, which is outside the landing folder "
            f"{landing}; copy the batch into the landing folder (CLICKSTREAM_LANDING) and pass "
            "a path relative to it"
        )
    if not resolved.exists():
        raise BatchRefusedError(
            f"batch path {path!r} does not exist under the landing folder {landing}")
    return resolved


def list_batch_files(config: Config, path: str) -> BatchFiles:
    root = resolve_in_landing(config, path)
    candidates = [root] if root.is_file() else sorted(
        p for p in root.rglob("*")
        if p.is_file() and not p.name.startswith((".", "_")))
    unknown = [p.name for p in candidates if p.suffix.lower() not in FORMATS]
    if unknown:
        raise BatchRefusedError(
            f"batch {root} has files of no accepted format: {', '.join(unknown[:5])}; accepted: "
            f"{', '.join(sorted(FORMATS))}")
    if not candidates:
        raise BatchRefusedError(f"batch {root} holds no files")
    formats = {FORMATS[p.suffix.lower()] for p in candidates}
    if len(formats) > 1:
        raise BatchRefusedError(
            f"batch {root} mixes formats ({', '.join(sorted(formats))}); send one format per "
            "batch")
    for p in candidates:
        if p.resolve() != root and root not in p.resolve().parents:  # (B1) symlinked files
            raise BatchRefusedError(f"batch file {p} links outside the landing folder")
    return BatchFiles(root, tuple(candidates), formats.pop())


def read_batch(spark: SparkSession, batch: BatchFiles, kind: BatchKind) -> DataFrame:
    """Raw rows of the batch with their file of origin; refuses missing columns."""
    reader = spark.read
    if batch.file_format == "csv":
        reader = reader.option("header", "true").option("inferSchema", "false")
    frame = reader.format(batch.file_format).load([str(p) for p in batch.files])
    missing = [c for c in REQUIRED[kind] if c not in frame.columns]
    if missing:
        raise BatchRefusedError(
            f"batch {batch.root} lacks required {kind} columns: {', '.join(missing)} (found: "
            f"{', '.join(frame.columns) or 'none'}); required: {', '.join(REQUIRED[kind])}")
    return frame.withColumn("_file", F.input_file_name())


def _text(frame: DataFrame, name: str) -> Column:
    return F.col(name).cast(StringType())


def _ts(frame: DataFrame) -> tuple[Column, Column]:
    """(timestamp, text for messages) of the ``ts`` column, whatever its type (B2)."""
    kind = frame.schema["ts"].dataType
    if isinstance(kind, TimestampType):
        return F.col("ts"), F.col("ts").cast("string")
    if isinstance(kind, DateType):
        return F.lit(None).cast("timestamp"), F.col("ts").cast("string")
    if isinstance(kind, IntegralType):
        return F.timestamp_millis(F.col("ts")), F.col("ts").cast("string")
    text = F.col("ts").cast("string")
    return ts_from_text(text), text


def validate_batch(frame: DataFrame, kind: BatchKind, client_id: str) -> DataFrame:
    """Every row with typed columns and ``error`` (null when valid); conflicting duplicates
    marked (B3); other clients' rows marked (B4)."""
    ts, ts_text = _ts(frame)
    key = KEY[kind]
    columns = {name: _text(frame, name) for name in REQUIRED[kind] if name != "ts"}
    raw = F.to_json(F.struct(*[F.col(c) for c in frame.columns if c != "_file"]))
    typed = frame.select(
        raw.alias("raw"), F.col("_file").alias("source"),
        *(c.alias(n) for n, c in columns.items()),
        ts.alias("ts"), ts_text.alias("ts_text"))
    blank = {n: F.col(n).isNull() | (F.trim(F.col(n)) == "") for n in columns}
    checks = [F.when(blank[n], F.lit(f"missing {n}")) for n in (key, "client_id", "user_id")]
    checks.append(ts_error(F.col("ts_text"), F.col("ts")))
    checks.append(F.when(F.col("client_id") != F.lit(client_id), F.format_string(
        "client_id '%s' is not the batch's client '%s'", F.col("client_id"),
        F.lit(client_id))))  # (B4)
    if kind == "orders":
        checks += [amount_error(F.col("amount")), currency_error(F.col("currency"))]
    else:
        checks.append(F.when(blank["url"], F.lit("pageview without url")))
    typed = typed.withColumn("error", F.coalesce(*checks))
    if kind == "orders":
        typed = typed.withColumn("amount", F.col("amount").try_cast(AMOUNT_TYPE))
    content = [c for c in typed.columns if c not in ("raw", "source", "error", "ts_text")]
    by_key = Window.partitionBy(key)
    variants = F.size(F.collect_set(F.to_json(F.struct(*content))).over(by_key))
    typed = typed.withColumn("error", F.coalesce(F.col("error"), F.when(
        variants > 1, F.format_string(
            "%s '%s' appears %d times in the batch with different content", F.lit(key),
            F.col(key), F.count(F.lit(1)).over(by_key)))))  # (B3)
    return typed.drop("ts_text")
