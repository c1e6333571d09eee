"""``clickstream inspect`` against real Delta tables (no Spark on its side)."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

from clickstream.io.delta_tables import open_tables
from clickstream.jobs.inspect import describe_tables
from clickstream.tables import ALL_TABLES, ORDERS


def test_describe_tables_counts_each_table_and_samples_its_rows(config, spark):
    ts = dt.datetime(2024, 3, 1, 12, tzinfo=dt.UTC)
    rows = [(f"o{i}", "c1", "u1", ts, Decimal("1.50"), "EUR", None, "test", ts.date())
            for i in range(3)]
    tables = open_tables(config, spark)
    for _ in range(2):  # the second append is a replay: nothing is added
        tables.append_once("orders", spark.createDataFrame(rows, ORDERS.schema), app_id="a",
                           version=1, partition_by=list(ORDERS.partition_by),
                           metadata={"run_id": "r", "cause": "test"})

    lines = describe_tables(config, sample=2)

    assert lines[0] == f"warehouse {config.warehouse}"
    orders = [i for i, line in enumerate(lines) if line.split()[0] == "orders"]
    assert len(orders) == 1
    assert lines[orders[0]].split() == ["orders", "version", str(tables.version("orders")),
                                        "rows", "3"]
    sampled = [json.loads(line) for line in lines[orders[0] + 1:orders[0] + 3]]
    assert all(row["client_id"] == "c1" and row["order_id"].startswith("o") for row in sampled)
    missing = [line.split()[0] for line in lines if line.endswith("(not created yet)")]
    assert sorted(missing) == sorted(set(ALL_TABLES) - {"orders"})
