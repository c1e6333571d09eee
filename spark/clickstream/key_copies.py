"""An entity's copies of one key, and how two sides of a comparison pair them (C14).

An order id may be reused for two users, or sent again under another time: each is a copy of
the key, stored as its own row. The plan's diff, the applied check and the correction report
must pair the copies of a key alike, or they disagree on what moved; so they share this.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

# What tells apart an entity's copies of one key: an order id reused for two users, or sent
# again under another time (C14).
COPIES_BY: dict[str, tuple[str, ...]] = {"session": (), "attribution": ("user_id", "order_ts")}
COPY_COUNT = "_copies_of_key"  # a side's number of copies of a row's key


def same_columns(columns: tuple[str, ...], left: str, right: str) -> Column:
    """``left`` and ``right`` (aliases) agree on every one of ``columns``."""
    return F.expr(" AND ".join(f"({left}.{c} = {right}.{c})" for c in columns))


def count_copies(frame: DataFrame, key: str) -> DataFrame:
    """``frame`` with COPY_COUNT, partitioned by the key as a join on it is: no shuffle of its
    own for the join."""
    return frame.withColumn(COPY_COUNT, F.count(F.lit(1)).over(Window.partitionBy(key)))


def pair_copies(old: DataFrame, new: DataFrame, key: str, copies_by: tuple[str, ...]
                ) -> tuple[DataFrame, DataFrame, Column]:
    """``old`` and ``new`` (to be aliased "o" and "n") and the condition pairing their rows:
    by key, and where a side holds a key more than once, by ``copies_by`` too."""
    on = F.col(f"o.{key}") == F.col(f"n.{key}")
    if not copies_by:
        return old, new, on
    old, new = count_copies(old, key), count_copies(new, key)
    return old, new, on & (same_columns(copies_by, "o", "n")
                           | ((F.col(f"o.{COPY_COUNT}") == 1) & (F.col(f"n.{COPY_COUNT}") == 1)))
