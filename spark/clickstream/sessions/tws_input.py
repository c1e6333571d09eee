"""How a Python worker reads ``transformWithStateInPandas`` input: by key runs, not by row.

PySpark 4.2 turns each Arrow batch the JVM sends into pandas, then walks it *row by row*
(``itertuples``) to split it by grouping key, and rebuilds a pandas frame from those Python
tuples (``TransformWithStateInPandasSerializer.load_stream``). For the sessionizer that was as
much worker time as all of its session logic (py-spy, throughput benchmark, session 14). The
JVM already sends a key's rows next to each other, so the split can be done on whole columns:
find where the key changes and slice.

``install()`` replaces that one method when the running PySpark is a version whose method was
checked against this one (``VERIFIED_PYSPARK``; a test feeds both the same Arrow stream and
compares what the processor receives). On any other version it changes nothing and PySpark's
own method runs: slower, same result. What differs, by design: the frames keep the dtypes of
PySpark's vectorised Arrow conversion (as every other pandas UDF gets them) instead of dtypes
re-inferred from Python objects, and a key's frames are cut at Arrow batch boundaries as well
as every ``arrow_max_records_per_batch`` rows.

Installing imports no pandas or NumPy (the reader imports them when it first reads): the
processor installs it as it is unpickled, also in the Python process that only runs its
``init`` at each query start (``stream_processor``).
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyspark
from pyspark.sql.pandas.serializers import (
    ArrowStreamSerializer,
    TransformWithStateInPandasSerializer,
)
from pyspark.sql.streaming.stateful_processor_util import TransformWithStateInPandasFuncMode

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

# PySpark versions whose ``TransformWithStateInPandasSerializer.load_stream`` this replaces.
VERIFIED_PYSPARK = frozenset({"4.2.0"})
UPSTREAM_LOAD_STREAM = TransformWithStateInPandasSerializer.load_stream


def _run_starts(keys: pd.DataFrame) -> np.ndarray:
    """Row positions where the grouping key differs from the row before (0 included)."""
    import numpy as np
    import pandas as pd

    changed = np.zeros(len(keys), dtype=bool)
    changed[0] = True
    for column in range(keys.shape[1]):
        codes, _ = pd.factorize(keys.iloc[:, column], use_na_sentinel=True)
        changed[1:] |= codes[1:] != codes[:-1]
    return np.flatnonzero(changed)


def _chunk_rows(serializer: TransformWithStateInPandasSerializer) -> int:
    """Rows per frame: PySpark's record cap, and its byte cap at the average row size so far."""
    limit = serializer.arrow_max_records_per_batch
    if serializer.average_arrow_row_size > 0:
        by_bytes = math.ceil(serializer.arrow_max_bytes_per_batch
                             / serializer.average_arrow_row_size)
        limit = min(limit, max(by_bytes, 1))
    return limit


def _frames_by_key(serializer: TransformWithStateInPandasSerializer,
                   stream: Any) -> Iterator[tuple[tuple[Any, ...], pd.DataFrame]]:
    """(key, frame) for each run of one key in each Arrow batch, in stream order."""
    import numpy as np
    import pandas as pd

    for batch in ArrowStreamSerializer.load_stream(serializer, stream):
        serializer._update_batch_size_stats(batch)
        if batch.num_rows == 0:
            continue
        frame = pd.concat(_to_pandas_columns(serializer, batch), axis=1)
        # The column names PySpark's frames get: itertuples' namedtuple fields.
        frame.columns = collections.namedtuple("Pandas", list(frame.columns), rename=True)._fields
        keys = frame.iloc[:, list(serializer.key_offsets)]
        starts = _run_starts(keys)
        ends = np.append(starts[1:], len(frame))
        step = _chunk_rows(serializer)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            # Iterating a one-row slice gives the Python scalars itertuples would.
            key = tuple(next(iter(keys.iloc[start:start + 1, i])) for i in range(keys.shape[1]))
            for chunk_start in range(start, end, step):
                chunk = frame.iloc[chunk_start:min(chunk_start + step, end)]
                yield key, chunk.reset_index(drop=True)


def _to_pandas_columns(serializer: TransformWithStateInPandasSerializer,
                       batch: Any) -> list[pd.Series]:
    """The batch's columns as pandas, converted exactly as PySpark's own method does."""
    from pyspark.sql.conversion import ArrowBatchTransformer

    return ArrowBatchTransformer.to_pandas(
        batch,
        timezone=serializer._timezone,
        schema=serializer._input_type,
        struct_in_pandas=serializer._struct_in_pandas,
        ndarray_as_list=serializer._ndarray_as_list,
        prefer_int_ext_dtype=serializer._prefer_int_ext_dtype,
        df_for_struct=serializer._df_for_struct,
    )


def load_stream_by_key_runs(serializer: TransformWithStateInPandasSerializer,
                            stream: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Drop-in for ``TransformWithStateInPandasSerializer.load_stream``: the same modes, keys
    and groups of frames, one call per run of equal keys."""
    frames = _frames_by_key(serializer, stream)
    for key, group in itertools.groupby(frames, key=lambda item: item[0]):
        yield TransformWithStateInPandasFuncMode.PROCESS_DATA, key, group
    yield TransformWithStateInPandasFuncMode.PROCESS_TIMER, None, None
    yield TransformWithStateInPandasFuncMode.COMPLETE, None, None


def install() -> bool:
    """Use ``load_stream_by_key_runs`` in this process if PySpark is a verified version."""
    if pyspark.__version__ not in VERIFIED_PYSPARK:
        return False
    TransformWithStateInPandasSerializer.load_stream = load_stream_by_key_runs
    return True
