"""The Spark Kafka source on the embedded broker: layout, offsets in the checkpoint, rate limit."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka import KafkaError, Message, Producer
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.datasource import CaseInsensitiveDict
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from clickstream.config import Config
from clickstream.errors import (
    BrokerUnavailableError,
    DataLossError,
    KafkaRefusedError,
)
from clickstream.events.contract import CLOCK_PARTITION, LOST_OFFSETS_HEADER
from clickstream.io import kafka_source
from clickstream.io.kafka_broker import EmbeddedBroker
from clickstream.io.kafka_clients import make_producer
from clickstream.io.kafka_produce import flush_or_raise
from clickstream.io.kafka_read import (
    ReadErrors,
    read_compacted,
    read_offset_range,
    read_offset_ranges,
)
from clickstream.io.kafka_source import (
    PLANNED_FROM,
    TOPIC_ID,
    ClockTick,
    KafkaRange,
    KafkaStreamReader,
    _rate_limit,
    group_ranges,
    native_client_options,
    read_kafka_stream,
    read_range,
)
from clickstream.io.kafka_topics import topic_watermarks
from clickstream.io.stream_clock import CLOCK_OFFSET, IdleClock
from clickstream.tables import KAFKA_SCHEMA

CREATED_MS = 1_763_640_000_000  # the producer's timestamps: CREATED_MS + i for record i


def produce(config: Config, topic: str, count: int, start: int = 0) -> None:
    """Record i: key k<i % 3> (none when i % 3 == 2), value v<i>, header h=<i> when i is even."""
    producer = make_producer(config)
    for i in range(start, start + count):
        producer.produce(topic, key=f"k{i % 3}".encode() if i % 3 != 2 else None,
                         value=f"v{i}".encode(), timestamp=CREATED_MS + i,
                         headers=[("h", f"{i}".encode())] if i % 2 == 0 else None)
    flush_or_raise(producer, 30)


def run_once(spark: SparkSession, config: Config, topic: str, checkpoint: Path) -> list[list]:
    """One availableNow run; returns the rows of every micro-batch."""
    batches: list[list] = []

    def collect(df: DataFrame, batch_id: int) -> None:
        batches.append(df.collect())

    query = (read_kafka_stream(spark, config, topic).writeStream.foreachBatch(collect)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    return batches


def test_records_arrive_in_kafka_layout_exactly_once_across_runs(
    spark: SparkSession, kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 7)
    first = [row for batch in run_once(spark, kafka_config, topic, tmp_path / "ck")
             for row in batch]
    produce(kafka_config, topic, 5, start=7)
    second = [row for batch in run_once(spark, kafka_config, topic, tmp_path / "ck")
              for row in batch]
    assert sorted(r.value.decode() for r in first) == sorted(f"v{i}" for i in range(7))
    assert sorted(r.value.decode() for r in second) == sorted(f"v{i}" for i in range(7, 12))
    assert list(first[0].asDict()) == KAFKA_SCHEMA.fieldNames()
    for row in first + second:
        i = int(row.value.decode()[1:])
        assert row.topic == topic and row.partition in (0, 1) and row.offset >= 0
        assert row.key == (f"k{i % 3}".encode() if i % 3 != 2 else None)
        assert row.timestamp.astimezone(UTC) == datetime.fromtimestamp(
            (CREATED_MS + i) / 1000, tz=UTC)
        assert row.timestampType == 0  # CreateTime
        assert row.headers == ([Row(key="h", value=f"{i}".encode())] if i % 2 == 0 else None)


def test_rate_limit_splits_work_into_micro_batches(
    spark: SparkSession, kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 20)
    limited = kafka_config.replace(max_events_per_trigger=6)
    batches = [b for b in run_once(spark, limited, topic, tmp_path / "ck") if b]
    assert len(batches) >= 4 and all(len(b) <= 6 for b in batches)
    assert sorted(r.value.decode() for b in batches for r in b) == sorted(
        f"v{i}" for i in range(20))


def test_rate_limit_gives_every_partition_with_backlog_a_share() -> None:
    start = {"0": 0, "1": 100, "2": 5}
    latest = {"0": 1000, "1": 101, "2": 5}
    limited = _rate_limit(start, latest, 10)
    assert limited["1"] == 101 and limited["2"] == 5 and 0 < limited["0"] <= 10


def test_rate_limit_counts_a_partition_added_since_from_its_offset_0() -> None:
    """(K3, K4) A partition added to the topic is planned from offset 0: its backlog counted
    as none, it was read whole in one micro-batch, whatever maxOffsetsPerTrigger said."""
    limited = _rate_limit({"0": 0}, {"0": 10, "1": 1000}, 20)
    assert 0 < limited["0"] <= 10 and 0 < limited["1"] <= 20


def test_read_tasks_cover_every_range_once_balanced_by_rows() -> None:
    ranges = {0: (0, 100), 1: (5, 15), 2: (0, 60), 3: (40, 90), 4: (7, 8)}
    tasks = group_ranges("t", ranges, 2)
    assert len(tasks) == 2
    assert sorted(p for t in tasks for p in t.ranges) == [0, 1, 2, 3, 4]
    assert {p: r for t in tasks for p, r in t.ranges.items()} == ranges
    assert sorted(t.rows for t in tasks) == [110, 111]  # 100+10+1 vs 60+50
    assert len(group_ranges("t", ranges, 8)) == 5  # never an empty task
    assert group_ranges("t", {}, 2) == []


def _two_partitions_of_four_records(kafka_config: Config, make_topic
                                    ) -> tuple[str, KafkaStreamReader]:
    topic = make_topic(partitions=2)
    producer = make_producer(kafka_config)
    for i in range(8):
        producer.produce(topic, value=f"v{i}".encode(), partition=i % 2)
    flush_or_raise(producer, 30)
    return topic, KafkaStreamReader(_source_options(kafka_config, topic))


def test_a_quiet_topics_reader_plans_a_clock_tick_once_and_a_catch_up_none(
    kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    """(stream_clock T1, T6) Nothing new for a period: the end offsets name a tick, whose
    micro-batch reads one row and no record (not the first micro-batch's range again, K9);
    later end offsets carry it on without reading it again; a catch-up never ticks."""
    topic, _ = _two_partitions_of_four_records(kafka_config, make_topic)
    clock = IdleClock(after_ms=1, delay_ms=1_000, gap_ms=60_000, checkpoint=tmp_path)
    (tmp_path / "commits").mkdir()
    (tmp_path / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":5000}')
    reader = KafkaStreamReader(_source_options(kafka_config, topic, **clock.options()))
    first = reader.initialOffset()
    end = reader.latestOffset(first, ReadAllAvailable())
    assert PLANNED_FROM in end and CLOCK_OFFSET not in end  # records: no tick
    time.sleep(0.01)
    ticked = reader.latestOffset(end, ReadAllAvailable())
    assert {k: v for k, v in ticked.items() if k != CLOCK_OFFSET} == {
        k: v for k, v in end.items() if k != PLANNED_FROM}
    assert ticked[CLOCK_OFFSET] > 6_000  # the latest event time (5,000 + the delay), and on
    tasks = reader.partitions(end, ticked)
    assert [type(task) for task in tasks] == [ClockTick]
    # A restart replaying that micro-batch from the checkpoint's offsets reads the same tick.
    restarted = KafkaStreamReader(_source_options(kafka_config, topic, **clock.options()))
    assert [(type(t), t.event_time_ms) for t in restarted.partitions(end, ticked)] == [
        (ClockTick, ticked[CLOCK_OFFSET])]
    assert pa.Table.from_batches(list(reader.read(tasks[0]))).to_pylist() == [{
        "key": None, "value": None, "topic": topic, "partition": CLOCK_PARTITION, "offset": 0,
        "timestamp": datetime.fromtimestamp(ticked[CLOCK_OFFSET] / 1000, UTC),
        "timestampType": 0, "headers": None}]
    producer = make_producer(kafka_config)
    producer.produce(topic, value=b"v8", partition=0)
    flush_or_raise(producer, 30)
    after = reader.latestOffset(ticked, ReadAllAvailable())
    assert after[CLOCK_OFFSET] == ticked[CLOCK_OFFSET]
    assert [task.ranges for task in reader.partitions(ticked, after)] == [{0: (4, 5)}]
    reader.prepareForTriggerAvailableNow()
    time.sleep(0.01)
    assert reader.latestOffset(after, ReadAllAvailable()) is after


def test_a_partition_the_planned_start_does_not_know_is_read_from_offset_0(
    kafka_config: Config, make_topic
) -> None:
    """A partition added to the topic after the start offsets were planned (K3): the batch
    reads it from offset 0 (its log start here), not from where it ends (which read nothing
    and skipped it)."""
    topic, reader = _two_partitions_of_four_records(kafka_config, make_topic)
    marks = topic_watermarks(kafka_config, topic)
    end = reader.latestOffset({"0": 1}, ReadAllAvailable())
    assert {k: v for k, v in end.items() if k != TOPIC_ID} == {"0": marks[0][1], "1": marks[1][1]}
    planned = {p: r for task in reader.partitions({"0": 1}, end) for p, r in task.ranges.items()}
    assert planned == {0: (1, 4), 1: (0, 4)} and marks == {0: (0, 4), 1: (0, 4)}


def test_a_partition_one_metadata_answer_leaves_out_keeps_its_offset(
    kafka_config: Config, make_topic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(K3) A broker's stale metadata may leave a partition out of one answer (the embedded
    broker never does, so its answer is cut here). Dropped from the planned offsets, the
    partition was planned from offset 0 again once it was back, and read twice."""
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 8)
    reader = KafkaStreamReader(_source_options(kafka_config, topic))
    first = reader.initialOffset()
    end = reader.latestOffset(first, ReadAllAvailable())
    stops = {k: v for k, v in end.items() if k.isdigit()}
    answer = kafka_source._watermarks

    def without_partition_1(options: Mapping[str, str], name: str) -> dict:
        return {p: marks for p, marks in answer(options, name).items() if p != 1}

    monkeypatch.setattr(kafka_source, "_watermarks", without_partition_1)
    produce(kafka_config, topic, 8, start=8)
    cut = reader.latestOffset(end, ReadAllAvailable())
    assert cut.get("1") == stops["1"]
    monkeypatch.undo()
    after = reader.latestOffset(cut, ReadAllAvailable())
    ranges = {p: r for task in reader.partitions(cut, after) for p, r in task.ranges.items()}
    assert ranges[1][0] == stops["1"]


def test_a_partition_the_planned_start_does_not_know_that_lost_records_is_data_loss(
    kafka_config: Config, make_topic, broker: EmbeddedBroker
) -> None:
    """(K3) A partition first seen with its log start above 0 lost records nobody read:
    planning stops with DataLossError instead of reading on from the log start, and a batch
    planned before the records went is read from offset 0, so its read stops too."""
    topic, reader = _two_partitions_of_four_records(kafka_config, make_topic)
    end = reader.latestOffset({"0": 1}, ReadAllAvailable())
    broker.delete_records(topic, 1, 2)
    with pytest.raises(DataLossError, match=(
            rf"topic {topic} partition 1: records 0\.\.1 were dropped by the broker before "
            r"they were consumed \(log start offset is now 2\)")):
        reader.latestOffset({"0": 1}, ReadAllAvailable())
    tasks = reader.partitions({"0": 1}, end)
    assert {p: r for task in tasks for p, r in task.ranges.items()} == {0: (1, 4), 1: (0, 4)}
    added = next(task for task in tasks if 1 in task.ranges)
    with pytest.raises(DataLossError, match=r"partition 1: records 0\.\.1 were dropped"):
        list(read_range(_source_options(kafka_config, topic), added))


def test_offsets_from_another_log_are_refused_before_any_batch_is_planned(
    kafka_config: Config, make_topic
) -> None:
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 3)
    reader = KafkaStreamReader(_source_options(kafka_config, topic))
    first = reader.initialOffset()
    assert first[TOPIC_ID] and {k: v for k, v in first.items() if k != TOPIC_ID} == {"0": 0}
    end = reader.latestOffset(first, ReadAllAvailable())
    assert end[TOPIC_ID] == first[TOPIC_ID] and end["0"] == 3
    other = {**end, TOPIC_ID: "AAAAAAAAAAAAAAAAAAAAAQ"}
    for plan in (lambda: reader.latestOffset(other, ReadAllAvailable()),
                 lambda: reader.partitions(first, other),  # a restart's replay of its last batch
                 lambda: reader.partitions(other, end)):
        with pytest.raises(DataLossError, match=f"topic {topic} is not the log"):
            plan()
    # Offsets without an id (a checkpoint from before K7) are taken as they are.
    legacy = {k: v for k, v in end.items() if k not in (TOPIC_ID, PLANNED_FROM)}
    assert [t.ranges for t in reader.partitions({"0": 1}, legacy)] == [{0: (1, 3)}]


def test_a_new_checkpoint_starts_at_the_log_start_and_warns_of_the_records_before_it(
    kafka_config: Config, make_topic, broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """(K8) Records deleted before the query's first start (retention, the embedded broker's
    cap) were skipped without a word."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 10)
    broker.delete_records(topic, 0, 4)
    reader = KafkaStreamReader(_source_options(kafka_config, topic))
    first = reader.initialOffset()
    assert reader.initialOffset() == first  # Spark asks at every trigger: warned once
    assert {k: v for k, v in first.items() if k != TOPIC_ID} == {"0": 4}
    assert [r.getMessage() for r in caplog.records if "new checkpoint" in r.getMessage()] == [
        f"topic {topic} partition 0: a new checkpoint starts at the log's start, offset 4: "
        "records 0..3 were deleted by the broker before (its retention, or the embedded "
        "broker's cap) and are not read"]


def test_a_first_micro_batch_replayed_after_a_crash_reads_the_range_it_planned(
    spark: SparkSession, kafka_config: Config, make_topic, broker: EmbeddedBroker,
    tmp_path: Path
) -> None:
    """(K9) The first micro-batch planned offsets 0..10 and crashed before it committed; the
    broker then dropped 0..3 while nothing ran. The replay took its start from the log's
    start again and read 4..10: four records skipped without an error, where a later batch's
    replay stops on them."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 10)
    checkpoint = tmp_path / "checkpoint"

    def crash(df: DataFrame, batch_id: int) -> None:
        raise RuntimeError(f"killed in micro-batch {batch_id}")

    query = (read_kafka_stream(spark, kafka_config, topic).writeStream.foreachBatch(crash)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    with pytest.raises(StreamingQueryException, match="killed in micro-batch 0"):
        query.awaitTermination()
    broker.delete_records(topic, 0, 4)
    with pytest.raises(StreamingQueryException, match=r"records 0\.\.3 were dropped"):
        run_once(spark, kafka_config, topic, checkpoint)

    # Planned once, the range goes with the batch; and nothing new plans no batch.
    reader = KafkaStreamReader(_source_options(kafka_config, topic))
    first = reader.initialOffset()
    produce(kafka_config, topic, 2, start=10)
    end = reader.latestOffset(first, ReadAllAvailable())
    assert end[PLANNED_FROM] == {"0": 4} and end["0"] == 12
    assert reader.latestOffset(end, ReadAllAvailable()) is end
    restarted = KafkaStreamReader(_source_options(kafka_config, topic))
    broker.delete_records(topic, 0, 6)
    assert [t.ranges for t in restarted.partitions(restarted.initialOffset(), end)] == [
        {0: (4, 12)}]


def test_a_new_checkpoints_first_read_starts_where_the_log_starts_when_it_reads(
    kafka_config: Config, make_topic, broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """(K10) The broker drops the oldest records between the first micro-batch's planning
    and its read (the embedded broker's cap, a full partition still written to). They were
    never read: the read began where the log then began. It stopped with DataLossError, and
    so did every restart, as the replay reads the range it planned (K9); the replay still
    stops, as the first attempt may have stored what it read."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 10)
    reader = KafkaStreamReader(_source_options(kafka_config, topic))
    first = reader.initialOffset()
    broker.delete_records(topic, 0, 2)  # before the planning: it starts the batch at 2
    with caplog.at_level("WARNING"):
        end = reader.latestOffset(first, ReadAllAvailable())
    assert end[PLANNED_FROM] == {"0": 2}
    assert (f"topic {topic} partition 0: the broker dropped records 0..1 while a new "
            "checkpoint planned its first micro-batch") in caplog.text
    broker.delete_records(topic, 0, 4)  # after it: the read starts at 4
    with caplog.at_level("WARNING", logger="clickstream.io.kafka_read"):
        (task,) = reader.partitions(first, end)
        offsets = [o for batch in reader.read(task) for o in batch.column("offset").to_pylist()]
    assert offsets == list(range(4, 10))
    assert (f"topic {topic} partition 0: the broker dropped records 2..3 after the first "
            "micro-batch of a new checkpoint was planned") in caplog.text

    restarted = KafkaStreamReader(_source_options(kafka_config, topic))
    (replayed,) = restarted.partitions(restarted.initialOffset(), end)
    with pytest.raises(DataLossError, match=r"records 2\.\.3 were dropped"):
        list(restarted.read(replayed))


def test_reading_a_range_the_broker_dropped_raises_data_loss(
    kafka_config: Config, make_topic, broker: EmbeddedBroker
) -> None:
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 10)
    broker.delete_records(topic, 0, 4)
    with pytest.raises(DataLossError, match=r"records 2\.\.3 were dropped"):
        list(read_offset_range(kafka_config, topic, 0, 2, 10))


def test_a_range_past_the_logs_end_raises_data_loss_at_once(
    kafka_config: Config, make_topic
) -> None:
    """A planned range beyond the log's end now (a log truncated under the same topic id):
    the read waited for records no wait brings back, then blamed the broker's reachability."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 5)
    with pytest.raises(DataLossError, match=r"offsets 5\.\.7 were to be read, but the log "
                                            r"now ends at 5"):
        # before: BrokerUnavailableError once the idle timeout ran out
        list(read_offset_range(kafka_config, topic, 0, 2, 8, idle_timeout_s=30))


def test_ranges_of_many_partitions_are_read_with_one_consumer_exactly(
    kafka_config: Config, make_topic, broker: EmbeddedBroker
) -> None:
    topic = make_topic(partitions=6)
    produce(kafka_config, topic, 120)  # keys k0..k2: three partitions at most get records
    ends = {p: high for p, (_low, high) in topic_watermarks(kafka_config, topic).items()}
    ranges = {p: (min(1, end), end) for p, end in ends.items()}
    got: dict[int, list[int]] = {}
    for batch in read_offset_ranges(kafka_config, topic, ranges):
        for message in batch:
            got.setdefault(message.partition(), []).append(message.offset())
    assert got == {p: list(range(start, end)) for p, (start, end) in ranges.items()
                   if end > start}
    busy = max(ends, key=ends.get)
    broker.delete_records(topic, busy, 3)
    with pytest.raises(DataLossError, match=r"records 1\.\.2 were dropped"):
        list(read_offset_ranges(kafka_config, topic, ranges))


NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT, TOPIC_AUTHORIZATION_FAILED = 6, 7, 29  # Kafka's codes


def test_fetch_errors_the_client_gets_past_are_waited_out_and_permanent_ones_stop_the_read(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    # Own brokers: the errors answer whichever Fetch reaches the broker next. The permanent
    # error has a broker of its own, answering a few Fetches: once, on a loaded machine, an
    # earlier reader's last Fetch (or one librdkafka then dropped as outdated) took the one
    # failure, and the read never saw it (CI, session 75).
    with EmbeddedBroker(port=0, topics={"t": 2}) as own:
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        produce(own_config, "t", 40)
        ranges = {p: (0, high) for p, (_low, high) in topic_watermarks(own_config, "t").items()}
        own.fail_fetches(TOPIC_AUTHORIZATION_FAILED, 3)
        started = time.monotonic()
        with pytest.raises(KafkaRefusedError, match=r"reading topic t partition \d at offset 0 "
                           r"from .*Topic authorization failed \(TOPIC_AUTHORIZATION_FAILED\)"):
            list(read_offset_ranges(own_config, "t", ranges, idle_timeout_s=60))
        assert time.monotonic() - started < 30  # at once, not after the idle time limit

    with EmbeddedBroker(port=0, topics={"t": 2}) as own:
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        produce(own_config, "t", 40)
        ranges = {p: (0, high) for p, (_low, high) in topic_watermarks(own_config, "t").items()}
        every_offset = [(p, o) for p, (start, end) in sorted(ranges.items())
                        for o in range(start, end)]
        own.fail_fetches(REQUEST_TIMED_OUT, 4)
        with caplog.at_level("WARNING", logger="clickstream.io.kafka_read"):
            read = sorted((m.partition(), m.offset())
                          for batch in read_offset_ranges(own_config, "t", ranges) for m in batch)
        assert read == every_offset
        assert "Request timed out; librdkafka retries it" in caplog.text

        # Timeouts that go on (librdkafka reports each fetch's): no progress, so the time
        # limit ends the read, naming the last error. They used to keep it waiting.
        own.fail_fetches(REQUEST_TIMED_OUT, 500)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match=r"no records from topic t .* for 3 s "
                           r"\(last error: topic t partition \d at offset 0: .*Request timed out"):
            list(read_offset_ranges(own_config, "t", ranges, idle_timeout_s=3))
        assert time.monotonic() - started < 30

OFFSET_OUT_OF_RANGE = 1  # Kafka's code


def test_an_out_of_range_answer_at_an_offset_the_log_holds_is_fetched_again(
    config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """(K11) A broker may answer 'offset out of range' at an offset its log holds (a leader
    moving); librdkafka then fetches the partition no more. The range read waited out its
    time limit and blamed Kafka's reachability; the changelog read took it for data loss."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        produce(own_config, "t", 10)
        ranges = {0: (0, 10)}

        own.fail_fetches(OFFSET_OUT_OF_RANGE, 1)
        with caplog.at_level("WARNING", logger="clickstream.io.kafka_read"):
            read = [m for batch in read_offset_ranges(own_config, "t", ranges, idle_timeout_s=20)
                    for m in batch]
        assert [m.offset() for m in read] == list(range(10))
        assert "holds that offset (" in caplog.text and "fetching it again (1 of 5)" in caplog.text

        last_by_key = {m.key().decode(): m.value() for m in read if m.key() is not None}
        own.fail_fetches(OFFSET_OUT_OF_RANGE, 1)
        assert read_compacted(own_config, "t", value_decoder=bytes, timeout_s=20) == last_by_key

        own.fail_fetches(OFFSET_OUT_OF_RANGE, 500)  # a broker that does not settle
        with pytest.raises(BrokerUnavailableError, match=r"topic t partition 0 at offset 0 .*"
                           r"'offset out of range' 6 times in a row although its log holds"):
            list(read_offset_ranges(own_config, "t", ranges, idle_timeout_s=60))


@pytest.mark.parametrize("code", [KafkaError._BAD_MSG, KafkaError._BAD_COMPRESSION,
                                  KafkaError._NOT_IMPLEMENTED])
def test_a_batch_the_client_cannot_decode_stops_the_read(config: Config, code: int) -> None:
    """librdkafka reports a batch it cannot decode, then skips it: taken for an error it gets
    past, the read went on and the gap passed for transaction markers (no embedded broker
    can send a corrupt batch, so the client's error is made here)."""
    with pytest.raises(KafkaRefusedError, match=r"reading topic t partition 3 at offset 7 .* "
                       r"fix the cause"):
        ReadErrors(config, "t").handle(KafkaError(code), 3, 7)


def _offsets(messages: list[Message]) -> list[tuple[int, bytes | None, list | None]]:
    return [(m.offset(), m.value(), m.headers()) for m in messages]


def _marker(first: int, last: int) -> tuple[int, None, list[tuple[str, bytes]]]:
    return first, None, [(LOST_OFFSETS_HEADER, f"{first}-{last}".encode())]


def test_accepting_data_loss_a_range_below_the_log_start_reads_a_marker_then_the_rest(
    kafka_config: Config, make_topic, broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """(K1) With fail_on_data_loss=False the dropped offsets come out as one marker record in
    their place (no key or value, a header naming the run), then the records that are left;
    a range the broker dropped whole is just its marker. An offset beyond the log end still
    fails: it names another log."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 10)
    broker.delete_records(topic, 0, 4)

    def read(start: int, end: int) -> list[tuple]:
        return _offsets([m for batch in read_offset_range(
            kafka_config, topic, 0, start, end, fail_on_data_loss=False) for m in batch])

    with caplog.at_level("WARNING", logger="clickstream.io.kafka_read"):
        got = read(2, 10)
    assert got == [_marker(2, 3), *((i, f"v{i}".encode(), [("h", f"{i}".encode())] if i % 2 == 0
                                     else None) for i in range(4, 10))]
    assert f"topic {topic} partition 0: records 2..3 were dropped by the broker" in caplog.text
    assert read(0, 3) == [_marker(0, 2)]
    (marker, *_rest) = [m for batch in read_offset_range(kafka_config, topic, 0, 2, 10,
                                                         fail_on_data_loss=False) for m in batch]
    assert (marker.key(), marker.partition(), marker.topic()) == (None, 0, topic)
    with pytest.raises(DataLossError, match=(r"reader is at offset 12 but the log ends at 10.*"
                                             r"CLICKSTREAM_FAIL_ON_DATA_LOSS=false does not "
                                             r"apply")):
        read(12, 15)


def test_offsets_of_transaction_markers_are_no_loss_and_a_range_may_end_with_them(
    kafka_config: Config, make_topic
) -> None:
    """(K2) A transactional producer's commit markers (control records, which no consumer
    sees) leave offsets without records: here records at 0, 2, 4, control records at 1, 3, 5.
    They were read as lost records (DataLossError, or a quarantine row each when accepted),
    and a range ending on one waited for a record that never comes, then failed."""
    topic = make_topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka_config.kafka_bootstrap_servers,
                         "transactional.id": f"gaps-{topic}"})
    producer.init_transactions(30)
    for i in range(3):
        producer.begin_transaction()
        producer.produce(topic, value=f"t{i}".encode(), partition=0)
        producer.commit_transaction(30)

    def read(start: int, end: int, **options: bool) -> list[tuple]:
        return _offsets([m for batch in read_offset_range(
            kafka_config, topic, 0, start, end, idle_timeout_s=10, **options) for m in batch])

    every_record = [(0, b"t0", None), (2, b"t1", None), (4, b"t2", None)]
    started = time.monotonic()
    assert read(0, 6) == every_record  # ends on the last commit marker, at the log's end
    assert time.monotonic() - started < 5, "waited for the idle timeout"
    assert read(0, 6, fail_on_data_loss=False) == every_record
    assert read(0, 4) == every_record[:2]  # ends on a marker, a record after it
    assert read(1, 2) == []


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_log_start_passing_a_commit_marker_already_fetched_is_no_loss(
    config: Config, fail_on_data_loss: bool
) -> None:
    """(K2) Records at 0, 2, 4, commit markers at 1, 3, 5. Record 0 is read while the next
    ones are fetched already; then the log's start moves to 2 (retention, the embedded
    broker's cap). The jump 0 -> 2 was checked against the log's start, asked after it, and
    marker 1 read as a lost record: a DataLossError, or a quarantine row when accepted. Its
    lookups failing for a while stops nothing either: a range needs none to end on a marker."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        producer = Producer({"bootstrap.servers": own.bootstrap_servers,
                             "transactional.id": "passed"})
        producer.init_transactions(30)
        for i in range(3):
            producer.begin_transaction()
            producer.produce("t", value=f"t{i}".encode(), partition=0)
            producer.commit_transaction(30)
        own.fail_offset_lookups(NOT_LEADER_OR_FOLLOWER, 3)
        read: list[tuple] = []
        for batch in read_offset_range(own_config, "t", 0, 0, 6, batch_size=1,
                                       fail_on_data_loss=fail_on_data_loss, idle_timeout_s=30):
            if not read:  # the consumer fetched past record 0 meanwhile
                time.sleep(1.0)
                own.delete_records("t", 0, 2)
            read += _offsets(batch)
        assert read == [(0, b"t0", None), (2, b"t1", None), (4, b"t2", None)]


def test_accepting_data_loss_planning_goes_on_and_the_read_marks_the_lost_run(
    kafka_config: Config, make_topic, broker: EmbeddedBroker, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """(K1, K3) With failOnDataLoss=false a partition first seen with its log start above 0
    is planned from offset 0 and read as a marker for 0..1 and then its records, also
    through a kept read (K6). Lost offsets do not count against the rate limit (K4): the
    micro-batch planned from below the log start takes the whole lost run, one marker."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    topic, _reader = _two_partitions_of_four_records(kafka_config, make_topic)
    broker.delete_records(topic, 1, 2)
    options = _source_options(kafka_config, topic, failOnDataLoss="false", shareReads="run-1")
    reader = KafkaStreamReader(options)
    end = reader.latestOffset({"0": 1}, ReadAllAvailable())
    tasks = reader.partitions({"0": 1}, end)
    assert {p: r for task in tasks for p, r in task.ranges.items()} == {0: (1, 4), 1: (0, 4)}
    added = next(task for task in tasks if 1 in task.ranges)
    # The second read takes the first's batches (K6): with no Kafka behind its address, it
    # can succeed only from the kept read.
    reads = [pa.Table.from_batches(list(read_range(o, added, fail_on_data_loss=False)))
             for o in (options, unreachable(kafka_config, topic, "run-1",
                                            failOnDataLoss="false"))]
    assert reads[1].equals(reads[0])
    rows = [r for r in reads[0].to_pylist() if r["partition"] == 1]
    assert [(r["offset"], r["value"], r["headers"]) for r in rows] == [
        (0, None, [{"key": LOST_OFFSETS_HEADER, "value": b"0-1"}]),
        (2, b"v5", None), (3, b"v7", None)]
    assert rows[0]["key"] is None and rows[0]["topic"] == topic
    # A rate limit of 1 record: partition 1's lost offsets come whole with its first record.
    limited = reader.latestOffset({"0": 4, "1": 0}, ReadMaxRows(1))
    assert {k: v for k, v in limited.items() if k != TOPIC_ID} == {"0": 4, "1": 3}
    with pytest.raises(DataLossError, match="the log ends at 4"):  # another log: still fails
        reader.latestOffset({"0": 9, "1": 4}, ReadAllAvailable())


def test_extra_kafka_options_reach_the_source_consumers(
    spark: SparkSession, kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    """CLICKSTREAM_KAFKA_OPTIONS (credentials, TLS on real Kafka) go to every consumer the
    source makes: an option librdkafka does not know fails the query instead of vanishing."""
    topic = make_topic(partitions=1)
    produce(kafka_config, topic, 3)
    with pytest.raises(StreamingQueryException, match=(  # a name librdkafka does not know is
            r"CLICKSTREAM_KAFKA_OPTIONS: librdkafka refused item 1 \(not named here: .*\) "
            r"\(No such configuration property\)")):  # named by its place (session 78)
        run_once(spark, kafka_config.replace(kafka_options={"no.such.librdkafka.option": "1"}),
                 topic, tmp_path / "ck")


def test_the_native_source_takes_the_java_clients_names_over_the_librdkafka_ones() -> None:
    """One variable fed both clients, and each refuses or ignores the other's names for
    credentials (librdkafka ``sasl.username``; Java ``sasl.jaas.config``): a secured Kafka was
    unreachable for the native source. Its own variable is laid over the shared one."""
    config = Config.from_env({
        "CLICKSTREAM_KAFKA_OPTIONS": "security.protocol=SASL_SSL,sasl.mechanisms=PLAIN,"
                                     "sasl.username=u,sasl.password=p\\,w",
        "CLICKSTREAM_SPARK_KAFKA_OPTIONS": "sasl.mechanism=PLAIN,security.protocol=SASL_SSL,"
                                           "ssl.truststore.location=/etc/ca.jks"})
    assert native_client_options(config) == {
        "kafka.security.protocol": "SASL_SSL", "kafka.sasl.mechanisms": "PLAIN",
        "kafka.sasl.username": "u", "kafka.sasl.password": "p,w",
        "kafka.sasl.mechanism": "PLAIN", "kafka.ssl.truststore.location": "/etc/ca.jks"}
    assert native_client_options(config.replace(kafka_options={"security.protocol": "SSL"},
                                                spark_kafka_options={})) == {
        "kafka.security.protocol": "SSL"}  # shared settings reach the native source too
    assert "ssl.truststore.location" not in config.kafka_options  # librdkafka never sees it


def test_a_secret_in_the_kafka_options_stays_out_of_plans_progress_and_checkpoint(
    spark: SparkSession, kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    """The options travel to the source as one option of the query (kafkaOptions): a password
    there must not reach what Spark prints or keeps (plans, the query's progress, its
    checkpoint), which operators read, paste and archive."""
    secret = "s3cr3t-of-this-test"
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 5)
    config = kafka_config.replace(kafka_options={"sasl.password": secret})
    name = f"secret_{topic.replace('-', '_')}"
    query = (read_kafka_stream(spark, config, topic).writeStream.format("memory")
             .queryName(name)
             .option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    assert spark.table(name).count() == 5
    printed = {"plans": query._jsq.explainInternal(True),
               "progress": "\n".join(p.json for p in query.recentProgress)}
    kept = {str(f): f.read_bytes().decode("latin-1")
            for f in (tmp_path / "ck").rglob("*") if f.is_file()}
    assert "StreamingDataSourceV2ScanRelation" in printed["plans"]
    assert '"numInputRows":5' in printed["progress"].replace(" ", "")
    assert any("offsets" in name for name in kept), kept.keys()
    assert [name for name, text in {**printed, **kept}.items() if secret in text] == []


@pytest.mark.parametrize("new_records", [3, 10], ids=["ends-below", "grew-back-past"])
def test_a_broker_that_restarted_empty_stops_the_query(
    spark: SparkSession, tmp_path: Path, new_records: int
) -> None:
    """The embedded broker restarted empty (or the topic was recreated) while no query ran.
    Its new log either ends below the checkpoint's offsets or grew back past them (offsets
    alone then look fine); reading on from them would skip the new log's records below them.
    Its topic id is not the one the checkpoint's offsets were planned on (K7)."""
    config = Config.from_env({})
    with EmbeddedBroker(port=0) as before:
        before.create_topic("restarted", 1)
        first = config.replace(kafka_bootstrap_servers=before.bootstrap_servers)
        produce(first, "restarted", 7)
        assert sum(len(b) for b in run_once(spark, first, "restarted", tmp_path / "ck")) == 7
    with EmbeddedBroker(port=0) as after:
        after.create_topic("restarted", 1)
        second = config.replace(kafka_bootstrap_servers=after.bootstrap_servers)
        produce(second, "restarted", new_records, start=100)
        with pytest.raises(StreamingQueryException, match=(
                r"(?s)topic restarted is not the log its stored offsets were read from \(topic "
                r"id \S+, now \S+\).*delete the reader's checkpoint")):
            run_once(spark, second, "restarted", tmp_path / "ck")
        # Reading the new log from its start, as the error says: a new checkpoint reads it all.
        rows = [r for b in run_once(spark, second, "restarted", tmp_path / "ck2") for r in b]
        assert sorted(r.value for r in rows) == sorted(
            f"v{i}".encode() for i in range(100, 100 + new_records))


def _source_options(config: Config, topic: str, **more: str) -> CaseInsensitiveDict:
    """The options as Spark hands them to the source (case-insensitive)."""
    return CaseInsensitiveDict({"bootstrap": config.kafka_bootstrap_servers, "topic": topic,
                                "kafkaOptions": "{}", **more})


def unreachable(config: Config, topic: str, run: str, **more: str) -> CaseInsensitiveDict:
    """Source options with no Kafka behind the address: a read of run ``run`` can only
    succeed from a kept read (K6)."""
    return _source_options(config.replace(kafka_bootstrap_servers="127.0.0.1:9"), topic,
                           shareReads=run, readTimeoutSeconds="2", **more)


def test_a_second_read_of_the_same_ranges_takes_the_first_reads_records(
    kafka_config: Config, make_topic
) -> None:
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 12)
    ranges = {p: (0, high) for p, (_low, high) in topic_watermarks(kafka_config, topic).items()}
    task = KafkaRange(topic, ranges)
    shared = _source_options(kafka_config, topic, shareReads="run-1")
    first = pa.Table.from_batches(list(read_range(shared, task)))
    assert first.num_rows == 12

    with pytest.raises(BrokerUnavailableError):  # another query run's read is not served
        list(read_range(unreachable(kafka_config, topic, "run-2"), task))
    second = pa.Table.from_batches(list(read_range(unreachable(kafka_config, topic, "run-1"),
                                                   task)))
    assert second.equals(first)
    with pytest.raises(BrokerUnavailableError):  # taken once: a third read goes to Kafka
        list(read_range(unreachable(kafka_config, topic, "run-1"), task))


def test_a_read_that_cannot_be_kept_still_reads_everything(
    kafka_config: Config, make_topic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeping a read is only a saving: where its file cannot be written (here the folder
    is a file), the first read returns every record and the second reads Kafka again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"clickstream-kafka-reads-{os.geteuid()}").write_text("not a folder")
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 8)
    ranges = {p: (0, high) for p, (_low, high) in topic_watermarks(kafka_config, topic).items()}
    options = _source_options(kafka_config, topic, shareReads="run-1")
    task = KafkaRange(topic, ranges)
    first = pa.Table.from_batches(list(read_range(options, task)))
    assert first.num_rows == 8
    with pytest.raises(BrokerUnavailableError):  # nothing was kept: the second goes to Kafka
        list(read_range(unreachable(kafka_config, topic, "run-1"), task))
    assert pa.Table.from_batches(list(read_range(options, task))).equals(first)
    assert [p.name for p in tmp_path.iterdir()] == [f"clickstream-kafka-reads-{os.geteuid()}"]


@pytest.mark.parametrize("folder", ["missing", "open to others", "a link"])
def test_kept_reads_sit_in_a_folder_of_the_users_alone(
    kafka_config: Config, make_topic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    folder: str
) -> None:
    """Another local user must neither read the events a first read keeps nor plant a file
    the second read takes: only a folder this user made for itself is used (K6)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reads = tmp_path / f"clickstream-kafka-reads-{os.geteuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if folder == "open to others":
        reads.mkdir()
        reads.chmod(0o777)
    elif folder == "a link":
        reads.symlink_to(elsewhere, target_is_directory=True)
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 8)
    ranges = {p: (0, high) for p, (_low, high) in topic_watermarks(kafka_config, topic).items()}
    task = KafkaRange(topic, ranges)
    first = pa.Table.from_batches(list(read_range(
        _source_options(kafka_config, topic, shareReads="run-1"), task)))
    assert first.num_rows == 8
    if folder == "missing":
        assert stat.S_IMODE(reads.lstat().st_mode) == 0o700
        second = read_range(unreachable(kafka_config, topic, "run-1"), task)
        assert pa.Table.from_batches(list(second)).equals(first)
    else:  # nothing kept where it is not the user's alone: the second read goes to Kafka
        assert not any(reads.iterdir()) and not any(elsewhere.iterdir())
        with pytest.raises(BrokerUnavailableError):
            list(read_range(unreachable(kafka_config, topic, "run-1"), task))


def test_a_producer_time_past_sparks_range_is_read_as_no_time(
    kafka_config: Config, make_topic
) -> None:
    """A producer sets CreateTime to any int64 of milliseconds; one past Spark's microsecond
    range failed the read (and every replay). Read as Kafka's -1, the parser judges the
    record by the micro-batch's time, as any record without a timestamp."""
    topic = make_topic(partitions=1)
    producer = make_producer(kafka_config)
    for stamp in (CREATED_MS, 2**62, -(2**62), 9_223_372_036_854_775):
        producer.produce(topic, value=b"v", timestamp=stamp)
    flush_or_raise(producer, 30)
    read = pa.Table.from_batches(list(read_range(
        _source_options(kafka_config, topic), KafkaRange(topic, {0: (0, 4)}))))
    micros = read.column("timestamp").cast(pa.int64()).to_pylist()  # the last: past datetime's
    assert micros == [CREATED_MS * 1000, -1000, -1000, 9_223_372_036_854_775_000]


def _native_kafka_available(spark: SparkSession) -> bool:
    try:
        spark.sparkContext._jvm.java.lang.Class.forName(
            "org.apache.spark.sql.kafka010.KafkaSourceProvider")
        return True
    except Exception:
        return False


@pytest.mark.needs_jars
def test_native_kafka_source_reads_the_same_layout(
    spark: SparkSession, kafka_config: Config, make_topic, tmp_path: Path
) -> None:
    if not _native_kafka_available(spark):
        pytest.skip("Spark's native Kafka source needs the spark-sql-kafka-0-10 jar, which "
                    "comes from Maven (unreachable on this machine)")
    topic = make_topic(partitions=2)
    produce(kafka_config, topic, 4)
    rows = [r for b in run_once(spark, kafka_config.replace(kafka_source="native"), topic,
                                tmp_path / "ck") for r in b]
    assert sorted(r.value.decode() for r in rows) == [f"v{i}" for i in range(4)]
