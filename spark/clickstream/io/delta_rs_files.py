"""The executors' side of the delta-rs engine's writes: Parquet files in a table's folder.

A Spark task (``mapInArrow``) or the driver, for rows it holds, writes one file per table
partition it has rows of, into Hive-style folders Spark reads back, and returns one row per
file (:data:`WRITTEN_FILE_ROWS`): its path, size, partition values and Delta statistics. The
driver turns those rows into the commit (:mod:`clickstream.io.delta_rs_engine`, whose edge
cases are cited here as "edge case N": 1 a failed task's files, 7 the statistics, 13 the row
groups, 19 the folder names).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clickstream.io.delta_tables import partition_string

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_MAX_STAT_STRING = 64
# Spark's ExternalCatalogUtils.escapePathName set, plus '}' so no folder looks like a glob,
# and '~', which deltalake's compaction cannot find raw (edge case 19).
_ESCAPE = set(map(chr, range(1, 32))) | set("\"#%'*/:=?\\\x7f{}[]^~")
# What a write task returns: a row per file it wrote.
WRITTEN_FILE_ROWS = (
    "path string, size long, partition_values string, modification_time long, stats string")
ROW_GROUP_ROWS = 1_000_000  # pyarrow's default row group cap
ROW_GROUP_BYTES = 64 * 2**20  # Arrow bytes buffered per file before a row group is written (13)


class OpenFile:
    """A Parquet file being written by one task, with running statistics (edge case 7)."""

    def __init__(self, root: str, rel: str, schema: pa.Schema) -> None:
        self.rel = rel
        self.full = os.path.join(root, rel)
        os.makedirs(os.path.dirname(self.full), exist_ok=True)
        self.writer = pq.ParquetWriter(self.full, schema, compression="snappy")
        self.pending: list[pa.Table] = []  # rows of the next row group (edge case 13)
        self.pending_rows = 0
        self.pending_bytes = 0
        self.rows = 0
        self.nulls = dict.fromkeys(schema.names, 0)
        self.low: dict[str, Any] = {}
        self.high: dict[str, Any] = {}
        self.skip: set[str] = set()

    def write(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        self.pending_bytes += table.nbytes
        if self.pending_rows >= ROW_GROUP_ROWS or self.pending_bytes >= ROW_GROUP_BYTES:
            self.flush()
        self.rows += table.num_rows
        for name in table.column_names:
            column = table.column(name)
            self.nulls[name] += column.null_count
            if name in self.skip or not _has_exact_stats(column.type):
                continue
            bounds = pc.min_max(column).as_py()
            if bounds["min"] is None:
                continue
            low, high = bounds["min"], bounds["max"]
            if isinstance(low, str) and max(len(low), len(high)) > _MAX_STAT_STRING:
                self.skip.add(name)
                continue
            self.low[name] = low if name not in self.low else min(self.low[name], low)
            self.high[name] = high if name not in self.high else max(self.high[name], high)

    def flush(self) -> None:
        """Write the buffered rows as one row group."""
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending),
                                    row_group_size=max(self.pending_rows, 1))
            self.pending, self.pending_rows, self.pending_bytes = [], 0, 0

    def close(self) -> tuple[int, int, str]:
        self.flush()
        self.writer.close()
        kept = [n for n in self.low if n not in self.skip]
        stats = {
            "numRecords": self.rows,
            "minValues": {n: _stat_json(self.low[n]) for n in kept},
            "maxValues": {n: _stat_json(self.high[n]) for n in kept},
            "nullCount": self.nulls,
        }
        info = os.stat(self.full)
        return info.st_size, int(info.st_mtime * 1000), json.dumps(stats)


def write_task(
    batches: Iterator[pa.RecordBatch],
    *,
    root: str,
    partition_by: list[str],
    file_schema: pa.Schema,
) -> Iterator[pa.RecordBatch]:
    """Write one Spark partition's rows as one Parquet file per table partition (sorted by
    partition, a file is complete once a batch holds none of its rows)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    task = context.partitionId() if context is not None else 0
    files: dict[tuple, OpenFile] = {}
    keys: dict[tuple, dict[str, str | None]] = {}
    out: dict[str, list] = {"path": [], "size": [], "partition_values": [],
                            "modification_time": [], "stats": []}

    def finish(key: tuple) -> None:
        handle = files.pop(key)
        size, mtime, stats = handle.close()
        out["path"].append(handle.rel)
        out["size"].append(size)
        out["partition_values"].append(json.dumps(keys.pop(key)))
        out["modification_time"].append(mtime)
        out["stats"].append(stats)

    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table = pa.Table.from_batches([batch])
            groups = (
                table.select(partition_by).group_by(partition_by).aggregate([]).to_pylist()
                if partition_by else [{}]
            )
            touched = set()
            for group in groups:
                values = {c: partition_string(group[c]) for c in partition_by}
                key = tuple(values.values())
                touched.add(key)
                if key not in files:
                    folder = "/".join(
                        f"{hive_escape(c)}={HIVE_NULL if v is None else hive_escape(v)}"
                        for c, v in values.items()
                    )
                    name = f"part-{task:05d}-{uuid.uuid4()}.c000.snappy.parquet"
                    rel = f"{folder}/{name}" if folder else name
                    files[key] = OpenFile(root, rel, file_schema)
                    keys[key] = values
                rows = table.filter(_group_mask(table, group)) if partition_by else table
                files[key].write(rows.select(file_schema.names).cast(file_schema))
            for key in [k for k in files if k not in touched]:  # its rows ended (13)
                finish(key)
        for key in list(files):
            finish(key)
        yield pa.RecordBatch.from_pydict(
            out,
            schema=pa.schema([
                ("path", pa.string()), ("size", pa.int64()), ("partition_values", pa.string()),
                ("modification_time", pa.int64()), ("stats", pa.string()),
            ]),
        )
    finally:
        for handle in files.values():  # a failed task: close what it opened (edge case 1)
            handle.writer.close()


def _group_mask(table: pa.Table, group: Mapping[str, Any]) -> pa.ChunkedArray:
    mask = None
    for column, value in group.items():
        values = table.column(column)
        if value is None:
            test = pc.is_null(values)
        else:
            test = pc.fill_null(pc.equal(values, pa.scalar(value, values.type)), False)
        mask = test if mask is None else pc.and_(mask, test)
    return mask


def hive_escape(text: str) -> str:
    """Escape a partition folder component like Spark (``%XX``), so Spark parses it back."""
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPE else ch for ch in text)


def spark_unescape(text: str) -> str:
    """Spark's ExternalCatalogUtils.unescapePathName: ``%XX`` (hex) becomes one char."""
    out, i = [], 0
    while i < len(text):
        code = text[i + 1 : i + 3] if text[i] == "%" and i + 2 < len(text) else ""
        # Java's Integer.parseInt(code, 16) also takes a sign; negative codes stay literal.
        if re.fullmatch(r"[+-]?[0-9A-Fa-f]+", code) and int(code, 16) >= 0:
            out.append(chr(int(code, 16)))
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _has_exact_stats(kind: pa.DataType) -> bool:
    return (
        pa.types.is_integer(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_date32(kind)
        or (pa.types.is_timestamp(kind) and kind.unit == "us")
    )


def _stat_json(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return value.strftime("%Y-%m-%dT%H:%M:%S.%f")
    if isinstance(value, dt.date):
        return value.isoformat()
    return value
