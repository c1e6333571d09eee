"""The stateful processor Spark runs for the sessionizer: its state variables and its calls.

Spark pickles the processor and unpickles it in a fresh Python process every time the query
starts, only to run ``init`` and learn the state variables (PySpark's
``transform_with_state_driver_worker``). So this module imports no pandas, NumPy or Arrow, and
neither does unpickling: the calls' work, which needs them, is in ``stream_adapter``, imported
by the first call, in the executors' Python workers. Importing ``stream_adapter`` there cost
the driver worker ~0.34 CPU-s per query start, a third of its time (BENCHMARKS.md, session 85).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import BinaryType, LongType, StructField, StructType

from clickstream.sessions import tws_input

if TYPE_CHECKING:
    import pandas as pd

STATE_SCHEMA = StructType([StructField("blob", BinaryType(), True)])
ID_SLICE_KEY_SCHEMA = StructType([StructField("min_ts_ms", LongType(), False),
                                  StructField("max_ts_ms", LongType(), False)])  # (S6)


class SessionProcessor(StatefulProcessor):
    """``transformWithStateInPandas`` processor keyed by user bucket, event-time mode; what a
    call does is ``stream_adapter``'s (its edge cases S1-S8 are listed there)."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in the Python worker, before it reads any input: read it by key runs.
        tws_input.install()
        self.__dict__.update(state)

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.span_state = handle.getValueState("open_sessions", STATE_SCHEMA)
        self.order_state = handle.getValueState("open_orders", STATE_SCHEMA)
        self.recent_id_slices = handle.getMapState("recent_pageview_id_slices",
                                                   ID_SLICE_KEY_SCHEMA, STATE_SCHEMA)
        self.legacy_recent_id_state = handle.getValueState("recent_pageview_ids", STATE_SCHEMA)
        self.legacy_pageview_state = handle.getValueState("open_pageviews", STATE_SCHEMA)

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        from clickstream.sessions import stream_adapter

        return stream_adapter.handle_input_rows(self, rows, timerValues)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        from clickstream.sessions import stream_adapter

        return stream_adapter.handle_expired_timer(self, timerValues)

    def close(self) -> None:
        """No resources to release."""
