"""What parsing the stream's records costs: ``parse_kafka_records`` over N generated pageview
records (cached first), timed as one aggregate over its output, for a code tree given as
its ``spark`` folder, so two commits can be alternated:

    git archive <commit> spark/clickstream | tar -x -C /tmp/base
    for i in 1 2 3; do
      .venv/bin/python bench/parse_bench.py /tmp/base/spark
      .venv/bin/python bench/parse_bench.py spark
    done

Prints the tree, the aggregate (to see both parsed alike) and the seconds of each round; the
least is the one to compare. Spark ``local[2]``, one process per tree: ~1 min each.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", help="the spark/ folder whose clickstream package to time")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--without-referrer", action="store_true",
                        help="records without a referrer key (a direct visit's pageview), "
                        "which the check of keys in other letter case looks at")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    from pyspark.sql import SparkSession

    from clickstream.config import Config
    from clickstream.events.parse import parse_kafka_records
    from clickstream.tables import KAFKA_SCHEMA

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    generated = spark.range(args.records).selectExpr(
        "cast(concat('client-0', id % 3, '/u', id % 5000) as binary) as key",
        "cast(to_json(named_struct('event_id', concat('3f', hex(id * 7919)), 'client_id', "
        "concat('client-0', id % 3), 'user_id', concat('u', id % 5000), 'event_type', "
        "'pageview', 'ts', '2026-11-01T09:00:00Z', 'url', concat('/p/', id % 97)"
        + ("" if args.without_referrer else ", 'referrer', 'https://www.google.com/'")
        + ")) as binary) as value",
        "'events' as topic", "cast(id % 4 as int) as partition", "id as offset",
        "timestamp'2026-11-01 09:00:00' as timestamp", "0 as timestampType",
        "cast(null as array<struct<key:string,value:binary>>) as headers")
    records = spark.createDataFrame(generated.rdd, KAFKA_SCHEMA).cache()
    records.count()
    parsed = parse_kafka_records(records, max_ts_ahead_ms=Config().max_ts_ahead_ms)
    aggregate = parsed.selectExpr("count(error) as bad", "count(*) as records",
                                  "sum(hash(event_id, user_id, url)) as fingerprint")
    seconds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        row = aggregate.first()
        seconds.append(round(time.perf_counter() - started, 2))
    shape = " (no referrer key)" if args.without_referrer else ""
    print(f"{args.tree}{shape}: {row.asDict()} seconds {seconds} least {min(seconds)}")
    spark.stop()


if __name__ == "__main__":
    main()
