"""``clickstream inspect`` against real Delta tables (no Spark on its side)."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import pytest

from clickstream.errors import ClickstreamError
from clickstream.io.delta_tables import open_tables
from clickstream.io.kafka_broker import EmbeddedBroker
from clickstream.io.kafka_produce import produce_records
from clickstream.io.kafka_topics import topic_id, topic_watermarks
from clickstream.jobs import sessionize
from clickstream.jobs.inspect import (
    describe_lag,
    describe_sessionizer,
    describe_tables,
    describe_topic,
)
from clickstream.jobs.sessionize import run_sessionizer
from clickstream.tables import ALL_TABLES, ORDERS
from tests.jobs.test_sessionize import pageview, produce


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
    after = lines[orders[0] + 1:]
    block = after[:next((i for i, line in enumerate(after) if not line.lstrip().startswith("{")),
                        len(after))]
    sampled = [json.loads(line) for line in block]  # as many as asked, not more
    assert len(sampled) == 2 and {row["client_id"] for row in sampled} == {"c1"}
    assert len({row["order_id"] for row in sampled} & {"o0", "o1", "o2"}) == 2
    missing = [line.split()[0] for line in lines if line.endswith("(not created yet)")]
    assert sorted(missing) == sorted(set(ALL_TABLES) - {"orders"})


def test_describe_sessionizer_shows_the_committed_micro_batch_its_watermark_and_the_lag(
        stream_config, spark):
    config = stream_config
    assert describe_sessionizer(config) == [
        f"sessionizer checkpoint {config.checkpoint_path('sessionize')}: no micro-batch yet"]
    assert describe_lag(config) == [
        f"  lag: 0 records of {config.events_topic}, none read yet (no micro-batch committed)"]
    start = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    produce(config, [pageview(f"u{i}", start + dt.timedelta(minutes=i)) for i in range(6)])
    assert describe_lag(config) == [  # waiting for the sessionizer's first micro-batch
        f"  lag: 6 records of {config.events_topic}, none read yet (no micro-batch committed)"]
    run_sessionizer(config, until_caught_up=True, spark=spark)

    lines = describe_sessionizer(config) + describe_lag(config)
    commits = config.checkpoint_path("sessionize") / "commits"
    last = max(int(p.name) for p in commits.glob("[0-9]*"))
    assert lines[1].startswith(f"  last committed micro-batch {last}, triggered 20")
    watermark = start + dt.timedelta(minutes=5 - config.watermark_delay_minutes)  # latest ts
    assert lines[2].startswith(f"  event-time watermark {watermark:%Y-%m-%d %H:%M:%S} UTC: ")
    offsets = lines[3].removeprefix(f"  {config.events_topic}: next offsets ").split(", ")
    assert sum(int(o.split()[1]) for o in offsets) == 6  # all it read of a new topic
    assert lines[4] == f"  lag: 0 records of {config.events_topic} not yet committed"

    produce(config, [pageview("u9", start + dt.timedelta(hours=1))] * 3)
    assert describe_lag(config)[0].startswith(
        f"  lag: 3 records of {config.events_topic} not yet committed (p")

    # A broker that restarted empty and grew back past the committed offsets: its records
    # look like lag, but the sessionizer stops on the other log (its topic id) instead.
    with EmbeddedBroker(port=0) as restarted:
        restarted.create_topic(config.events_topic, 4)
        again = config.replace(kafka_bootstrap_servers=restarted.bootstrap_servers)
        produce(again, [pageview(f"v{i}", start) for i in range(40)])
        lines = describe_lag(again)
    assert lines[0] == (f"  lag: unknown: the committed offsets name records of another log "
                        f"than {config.events_topic}'s")
    assert lines[1].startswith(f"  topic {config.events_topic} is not the log its stored "
                               "offsets were read from (topic id ")
    assert len(lines) == 2


def test_lag_of_a_partition_the_checkpoint_does_not_name_is_counted_from_offset_0(config):
    """(kafka_source K3) The sessionizer reads such a partition (added to the topic since)
    from offset 0 and stops on records the broker dropped: inspect counted it from its log
    start and showed no loss."""
    with EmbeddedBroker(port=0, topics={config.events_topic: 2}) as broker:
        here = config.replace(kafka_bootstrap_servers=broker.bootstrap_servers)
        produce_records(here, config.events_topic, [(f"k{i}", "v") for i in range(200)])
        low = {p: lo for p, (lo, _) in topic_watermarks(here, config.events_topic).items()}
        broker.delete_records(config.events_topic, 0, 5)
        committed = {"1": low[1], "topicId": topic_id(here, config.events_topic)}  # no p0
        checkpoint = here.checkpoint_path("sessionize")
        (checkpoint / "offsets").mkdir(parents=True)
        (checkpoint / "commits").mkdir()
        (checkpoint / "offsets" / "0").write_text("v1\n" + json.dumps(
            {"batchWatermarkMs": 0, "batchTimestampMs": 0}) + "\n" + json.dumps(committed)
            + "\n" + json.dumps(committed) + "\n")
        # The first micro-batch in flight: a new checkpoint reads from the log's start (K8).
        assert not any("dropped" in line for line in describe_lag(here)), describe_lag(here)
        (checkpoint / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        lines = describe_lag(here)
    assert any(f"topic {config.events_topic} partition 0: records 0..4 were dropped" in line
               for line in lines), lines


def test_the_events_topic_is_shown_with_the_malformed_records_clients_sent(config):
    """A keyed record that is not JSON, or not UTF-8, is what the sessionizer quarantines;
    ``inspect --topic events`` failed on it with an unexpected error instead of showing it."""
    with EmbeddedBroker(port=0, topics={config.events_topic: 1}) as broker:
        here = config.replace(kafka_bootstrap_servers=broker.bootstrap_servers)
        produce_records(here, config.events_topic, [
            ("c/u1", '{"event_id": "e1"}'), ("c/u2", '{"event_id": "e2", truncated'),
            (b"c/\xff", b"\xfe not text")])
        lines = describe_topic(here, config.events_topic, sample=3)
    assert lines[1:] == ['  c/\\xff: "\\\\xfe not text"',  # sorted: "\\" before "u"
                         '  c/u1: {"event_id": "e1"}',
                         '  c/u2: "{\\"event_id\\": \\"e2\\", truncated"'], lines


def test_an_unknown_topic_from_a_flag_is_named_with_the_products_topics(config):
    """``inspect --topic sesions``: the advice was to "fix the topic name setting", though
    the name came from the flag and every setting was right."""
    with EmbeddedBroker(port=0, topics={config.sessions_topic: 1}) as broker:
        here = config.replace(kafka_bootstrap_servers=broker.bootstrap_servers)
        with pytest.raises(ClickstreamError) as unknown:
            describe_topic(here, "sesions")
    message = str(unknown.value)
    assert message.startswith(f"topic 'sesions' does not exist on {broker.bootstrap_servers}")
    assert message.endswith(f"or check its name (the product's topics: {config.events_topic}, "
                            f"{config.sessions_topic}, {config.attributions_topic})")


def test_lag_before_the_first_commit_counts_from_where_the_first_micro_batch_starts(
        stream_config, spark, broker, monkeypatch):
    """(``kafka_source`` K9) The first micro-batch was planned and failed before it
    committed; the broker then dropped records it planned. Its replay reads from where it was
    planned and stops on them; inspect counted from the log's start and showed a plain lag."""
    start = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    produce(stream_config, [pageview("u", start + dt.timedelta(minutes=i), f"e{i}")
                            for i in range(6)])

    def failing(*args, **kwargs):
        raise RuntimeError("the first micro-batch fails")

    monkeypatch.setattr(sessionize, "gate_raw_events", failing)
    with pytest.raises(ClickstreamError, match="the first micro-batch fails"):
        run_sessionizer(stream_config, until_caught_up=True, spark=spark)
    (partition,) = [p for p, (_low, high) in
                    topic_watermarks(stream_config, stream_config.events_topic).items() if high]
    broker.delete_records(stream_config.events_topic, partition, 2)
    lines = describe_lag(stream_config)
    assert any(f"partition {partition}: records 0..1 were dropped" in line for line in lines), \
        lines


def test_a_changelog_topic_is_shown_with_its_tombstoned_keys(config):
    """A retraction's tombstone showed only as a key fewer: a user checking that a backfill
    retracted a session had to read the topic with a consumer of their own."""
    with EmbeddedBroker(port=0, topics={config.sessions_topic: 1}) as broker:
        here = config.replace(kafka_bootstrap_servers=broker.bootstrap_servers)
        produce_records(here, config.sessions_topic, [
            ("s1", '{"revision": 1}'), ("s2", '{"revision": 1}'), ("s2", None), ("s3", None),
            ("s3", '{"revision": 1}')])
        lines = describe_topic(here, config.sessions_topic, sample=5)
    assert lines == [f"topic {config.sessions_topic} at {broker.bootstrap_servers}: 2 live keys "
                     "(last value per key), 1 tombstoned (their last record is a tombstone: "
                     "retracted)", '  s1: {"revision": 1}', '  s3: {"revision": 1}']


def test_a_warehouse_that_does_not_exist_is_said_so(config, tmp_path):
    """``inspect --warehouse`` with a mistyped folder showed every table as not created yet."""
    lines = describe_tables(config.replace(warehouse=tmp_path / "nowhere"))
    assert lines[0] == (f"warehouse {tmp_path / 'nowhere'} (no such folder: nothing was written "
                        "there yet, or the setting names another one)")
