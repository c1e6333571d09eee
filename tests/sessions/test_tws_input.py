"""The worker's key-run reader gives the processor what PySpark's own row-by-row reader gives.

Both readers get the same Arrow stream (keys in runs as the JVM sends them, runs crossing
batch boundaries, a key coming back later, empty batches, nulls); the modes, keys, and the
rows of each call must be equal, and no frame may exceed PySpark's record cap.
"""

from __future__ import annotations

import io
import itertools
import pickle
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyspark
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.pandas.serializers import TransformWithStateInPandasSerializer

from clickstream.sessions import tws_input
from clickstream.sessions.stream_processor import SessionProcessor

MAX_RECORDS = 4


def _serializer(key_offsets: list[int]) -> TransformWithStateInPandasSerializer:
    serializer = TransformWithStateInPandasSerializer(
        timezone="UTC", safecheck=False, assign_cols_by_name=True, prefer_int_ext_dtype=False,
        arrow_max_records_per_batch=MAX_RECORDS, arrow_max_bytes_per_batch=2**31 - 1,
        int_to_decimal_coercion_enabled=False)
    serializer.key_offsets = key_offsets
    return serializer


def _stream(table: pa.Table, batch_sizes: list[int]) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        offset = 0
        for size in batch_sizes:
            writer.write_batch(table.slice(offset, size).combine_chunks().to_batches()[0]
                               if size else pa.RecordBatch.from_pylist([], schema=table.schema))
            offset += size
    return sink.getvalue()


def _calls(load_stream, data: bytes, key_offsets: list[int]):
    calls = []
    for mode, key, group in load_stream(_serializer(key_offsets), io.BytesIO(data)):
        if group is None:
            calls.append((mode, key, None, []))
            continue
        frames = [frame for _, frame in group]
        rows = pd.concat(frames, ignore_index=True)
        calls.append((mode, key, rows, [len(frame) for frame in frames]))
    return calls


keyed_rows = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from(["a", "b"]),
              st.one_of(st.none(), st.integers(-5, 5)), st.one_of(st.none(), st.text(max_size=3))),
    min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(keyed_rows, st.data())
def test_key_runs_equal_pyspark_row_by_row(rows, data) -> None:
    # Runs of equal keys, as the JVM sends them; a key may come back after another.
    rows = sorted(rows, key=lambda row: (row[0], row[1])) if data.draw(st.booleans()) else rows
    table = pa.table({
        "bucket": pa.array([r[0] for r in rows], pa.int32()),
        "client": pa.array([r[1] for r in rows], pa.string()),
        "amount": pa.array([r[2] for r in rows], pa.int64()),
        "url": pa.array([r[3] for r in rows], pa.string()),
        "ts": pa.array([1_700_000_000_000_000 + i for i in range(len(rows))],
                       pa.timestamp("us", tz="UTC")),
    })
    # Batch boundaries anywhere, repeated ones giving empty batches.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=6)))
    bounds = [0, *cuts, len(rows)]
    sizes = [end - start for start, end in itertools.pairwise(bounds)]
    key_offsets = data.draw(st.sampled_from([[0], [0, 1]]))
    stream = _stream(table, sizes)

    expected = _calls(tws_input.UPSTREAM_LOAD_STREAM, stream, key_offsets)
    actual = _calls(tws_input.load_stream_by_key_runs, stream, key_offsets)

    assert [(mode, key) for mode, key, _, _ in actual] == \
        [(mode, key) for mode, key, _, _ in expected]
    for (_, key, got, sizes_got), (_, _, want, _) in zip(actual, expected, strict=True):
        if want is None:
            assert got is None
            continue
        assert all(0 < size <= MAX_RECORDS for size in sizes_got), (key, sizes_got)
        assert list(got.columns) == list(want.columns)
        pd.testing.assert_frame_equal(got, want, check_dtype=False)
        assert all(type(k) is int or type(k) is str for k in key)


def test_the_pinned_pyspark_is_verified() -> None:
    # A PySpark upgrade lands here first: compare its load_stream with ours, then add it.
    assert pyspark.__version__ in tws_input.VERIFIED_PYSPARK


def test_a_worker_unpickling_the_processor_reads_by_key_runs(monkeypatch) -> None:
    monkeypatch.setattr(TransformWithStateInPandasSerializer, "load_stream",
                        tws_input.UPSTREAM_LOAD_STREAM)
    processor = pickle.loads(pickle.dumps(SessionProcessor(gap_ms=1_000)))
    assert processor.gap_ms == 1_000
    assert TransformWithStateInPandasSerializer.load_stream is tws_input.load_stream_by_key_runs


UNPICKLE_IN_A_FRESH_WORKER = """
import sys
import pyspark.sql.streaming.transform_with_state_driver_worker  # what Spark starts
from pyspark import cloudpickle
from pyspark.sql.pandas.serializers import TransformWithStateInPandasSerializer
processor = cloudpickle.loads(sys.stdin.buffer.read())
print(processor.gap_ms, TransformWithStateInPandasSerializer.load_stream.__module__)
print(sorted({"numpy", "pandas", "pyarrow"} & set(sys.modules)))
"""


def test_a_query_starts_python_worker_unpickles_the_processor_without_pandas() -> None:
    """Spark unpickles the processor in a fresh Python process at every query start, to run
    its ``init``: importing pandas, NumPy and Arrow there was most of that process's time."""
    from pyspark import cloudpickle

    done = subprocess.run([sys.executable, "-c", UNPICKLE_IN_A_FRESH_WORKER],
                          input=cloudpickle.dumps(SessionProcessor(gap_ms=1_000)),
                          capture_output=True, check=True)
    assert done.stdout.decode().splitlines() == ["1000 clickstream.sessions.tws_input", "[]"]
