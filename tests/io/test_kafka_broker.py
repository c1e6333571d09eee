"""The embedded broker and the Kafka client helpers, against the real librdkafka mock (no fakes)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    Consumer,
    KafkaException,
    Producer,
    TopicPartition,
)

from clickstream.config import Config, parse_options
from clickstream.errors import (
    BrokerError,
    BrokerUnavailableError,
    ClickstreamError,
    ConfigError,
    DataLossError,
    DeliveryError,
    KafkaRefusedError,
)
from clickstream.io.kafka_broker import DEFAULT_TOPICS, EmbeddedBroker, _Forwarder, main
from clickstream.io.kafka_clients import (
    LIBRDKAFKA_LOG,
    RepeatedLogFilter,
    consumer_config,
    gc_paused,
    make_consumer,
    make_producer,
    producer_config,
)
from clickstream.io.kafka_produce import (
    BULK_LINGER_MS,
    PACED_LINGER_MS,
    TIMED_OUT_REPORT_GRACE_S,
    flush_or_raise,
    produce_json,
    produce_records,
    produce_to_topics,
    produce_waiting,
    send_linger,
)
from clickstream.io.kafka_read import check_no_data_loss, read_compacted
from clickstream.io.kafka_topics import topic_id, topic_watermarks

REPO = Path(__file__).resolve().parents[2]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _consume(config: Config, topic: str, count: int, timeout_s: float = 20.0) -> list:
    consumer = Consumer(consumer_config(config))
    partitions = topic_watermarks(config, topic)
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    messages = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(messages) < count and time.monotonic() < deadline:
            messages += [m for m in consumer.consume(count, 0.5) if m.error() is None]
    finally:
        consumer.close()
    return messages


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ------------------------------------------------------------------------------------------
# Broker
# ------------------------------------------------------------------------------------------


def test_default_topics_have_configured_partitions(broker: EmbeddedBroker,
                                                   kafka_config: Config) -> None:
    for topic, partitions in DEFAULT_TOPICS.items():
        watermarks = topic_watermarks(kafka_config, topic)
        assert sorted(watermarks) == list(range(partitions)), topic
    assert set(DEFAULT_TOPICS.values()) == {16}


def test_create_topic_partitions_and_duplicates(broker: EmbeddedBroker, kafka_config: Config,
                                                make_topic: Callable[..., str]) -> None:
    topic = make_topic(7)
    assert sorted(topic_watermarks(kafka_config, topic)) == list(range(7))
    with pytest.raises(BrokerError, match="already exists"):
        broker.create_topic(topic, 7)
    broker.create_topic(topic, 7, exist_ok=True)
    with pytest.raises(BrokerError, match="at least 1 partition"):
        broker.create_topic("zero-" + uuid.uuid4().hex, 0)


def test_round_trip_keys_headers_timestamps(kafka_config: Config,
                                            make_topic: Callable[..., str]) -> None:
    topic = make_topic(3)
    producer = make_producer(kafka_config)
    ts = 1_714_567_890_123
    produce_json(producer, topic, "client-1/user-1", {"n": 1, "txt": "héllo"},
                 timestamp_ms=ts, headers={"source": "test", "raw": b"\x00\x01"}, partition=2)
    produce_json(producer, topic, b"client-1/user-2", {"n": 2}, timestamp_ms=ts + 1, partition=2)
    produce_json(producer, topic, "client-1/user-1", None, timestamp_ms=ts + 2, partition=2)
    flush_or_raise(producer, 10)

    messages = _consume(kafka_config, topic, 3)
    assert [(m.partition(), m.offset()) for m in messages] == [(2, 0), (2, 1), (2, 2)]
    first, second, tomb = messages
    assert first.key() == b"client-1/user-1"
    assert first.value() == '{"n":1,"txt":"héllo"}'.encode()
    assert first.timestamp() == (TIMESTAMP_CREATE_TIME, ts)
    assert first.headers() == [("source", b"test"), ("raw", b"\x00\x01")]
    assert second.key() == b"client-1/user-2" and second.timestamp()[1] == ts + 1
    assert tomb.key() == b"client-1/user-1" and tomb.value() is None
    assert topic_watermarks(kafka_config, topic) == {0: (0, 0), 1: (0, 0), 2: (0, 3)}


def test_many_connects_and_disconnects_leave_no_leaks(broker: EmbeddedBroker,
                                                      kafka_config: Config,
                                                      make_topic: Callable[..., str]) -> None:
    topic = make_topic(1)
    host, port = broker.bootstrap_servers.split(":")
    header = struct.pack(">hhih", 18, 0, 1, -1)  # ApiVersions v0, correlation 1, no client id
    request = struct.pack(">i", len(header)) + header

    def raw_client(i: int) -> None:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            if i % 3 == 0:  # abrupt close: RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif i % 3 == 1:  # a real request/response, then an orderly close
                sock.sendall(request)
                size = struct.unpack(">i", sock.recv(4))[0]
                assert size > 0

    def kafka_client() -> None:
        consumer = Consumer(consumer_config(kafka_config))
        assert topic in consumer.list_topics(topic, timeout=5).topics
        consumer.close()

    raw_client(1)  # warm-up: lazily opened fds (librdkafka globals) are not leaks
    kafka_client()
    assert _wait_for(lambda: broker.open_connections == 0)
    before = _open_fds()
    for i in range(200):
        raw_client(i)
        if i % 4 == 0:  # 50 full librdkafka clients: bootstrap through the forwarder
            kafka_client()
    assert _wait_for(lambda: broker.open_connections == 0), broker.open_connections
    assert _wait_for(lambda: _open_fds() <= before), (before, _open_fds())

    producer = make_producer(kafka_config)
    produce_json(producer, topic, "k", {"still": "healthy"})
    flush_or_raise(producer, 10)
    assert read_compacted(kafka_config, topic) == {"k": {"still": "healthy"}}


OUT_OF_DESCRIPTORS = """
import os, resource, socket, sys, time
from confluent_kafka.admin import AdminClient
from clickstream.io.kafka_broker import EmbeddedBroker

with EmbeddedBroker(port=0, topics={"t": 1}) as broker:
    clients = [socket.socket() for _ in range(8)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The forwarder's accept takes the last descriptor: none is left for the mock's side.
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
    for client in clients:
        client.settimeout(2)
        client.connect(("127.0.0.1", broker.port))
    time.sleep(1)
    for client in clients:
        client.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    print("relaying:", broker.relaying, "topics:", sorted(admin.list_topics(timeout=10).topics))
"""


def test_a_moment_without_descriptors_does_not_stop_the_port_relaying() -> None:
    """The forwarder's thread died on the EMFILE of its connection to the broker: the port
    listened on, answering no one, and ``clickstream broker`` ran on as if healthy."""
    finished = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS], capture_output=True,
                              text=True, timeout=120)
    assert finished.stdout.strip() == "relaying: True topics: ['t']", finished.stderr[-3000:]
    assert finished.stderr.count("cannot accept a connection ([Errno 24]") == 1


def test_port_in_use_raises_broker_error(broker: EmbeddedBroker) -> None:
    with pytest.raises(BrokerError) as caught:
        EmbeddedBroker(port=broker.port, topics={}).start()
    message = str(caught.value)
    assert f"127.0.0.1:{broker.port}" in message and "already in use" in message
    assert "--port" in message


def test_stop_releases_port_and_fds(kafka_config: Config) -> None:
    EmbeddedBroker(port=0, topics={"t": 1}).start().stop()  # warm-up
    before = _open_fds()
    with EmbeddedBroker(port=0, topics={"t": 2}) as embedded:
        port = embedded.port
        config = kafka_config.replace(kafka_bootstrap_servers=embedded.bootstrap_servers)
        assert sorted(topic_watermarks(config, "t")) == [0, 1]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert _wait_for(lambda: _open_fds() <= before), (before, _open_fds())
    with pytest.raises(BrokerError, match="not running"):
        embedded.create_topic("late", 1)


def test_forwarder_advertise_mode_relays_all_traffic(kafka_config: Config) -> None:
    with EmbeddedBroker(port=0, topics={"t": 2}, advertise="forwarder") as embedded:
        config = kafka_config.replace(kafka_bootstrap_servers=embedded.bootstrap_servers)
        producer = make_producer(config)
        for i in range(500):
            produce_json(producer, "t", f"k{i % 10}", {"i": i})
        flush_or_raise(producer, 10)
        assert embedded.open_connections >= 1  # the producer's connection stays relayed
        assert read_compacted(config, "t") == {f"k{k}": {"i": 490 + k} for k in range(10)}


def test_clients_the_upstream_does_not_take_yet_hold_up_no_relayed_connection() -> None:
    """The forwarder connected each new client upstream on its one thread, waiting: while the
    mock's accept backlog (5) was full, every relayed connection stood still, ~1 s per connect
    (a burst of 30: 4 s). Here the upstream takes one connection and never accepts again, so
    the connects of the clients after it hang (up to 5 s each, before)."""
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(1)
    forwarder = _Forwarder("127.0.0.1", 0)
    forwarder.start(upstream.getsockname()[:2])
    clients: list[socket.socket] = []
    try:
        clients.append(socket.create_connection(forwarder.address, timeout=10))
        relayed, _ = upstream.accept()
        relayed.settimeout(3)
        clients += [socket.create_connection(forwarder.address, timeout=10) for _ in range(4)]
        time.sleep(0.5)  # the forwarder accepts them, and connects each upstream
        clients[0].sendall(b"ping")
        assert relayed.recv(4) == b"ping"
        relayed.close()
    finally:
        for client in clients:
            client.close()
        forwarder.stop()
        upstream.close()


@contextlib.contextmanager
def broker_process(command: list[str], env: dict[str, str]) -> Iterator[str]:
    """A broker started as ``command``; yields its ready line, then it must stop on SIGTERM
    with exit 0."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 30)
        assert ready, "broker did not print its ready line within 30 s"
        yield process.stdout.readline().strip()  # type: ignore[union-attr]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_cli_broker_creates_the_configured_topic_names() -> None:
    port = _free_port()
    env = {**os.environ, "CLICKSTREAM_EVENTS_TOPIC": "clicks",
           "CLICKSTREAM_ATTRIBUTIONS_TOPIC": "order-sessions"}
    with broker_process([sys.executable, "-m", "clickstream.cli", "broker", "--port", str(port)],
                        env) as line:
        assert line == (f"embedded broker ready on 127.0.0.1:{port} "
                        "(topics: clicks=16, sessions=16, order-sessions=16)")


def test_the_cli_broker_reads_only_its_topic_names_and_warns_of_another_kafka() -> None:
    """A malformed job setting stopped the broker (naming a --warehouse flag it does not
    take), and one pointing the jobs at another port started it without a word."""
    port = _free_port()
    env = {**os.environ, "CLICKSTREAM_SESSION_GAP": "abc",
           "CLICKSTREAM_WAREHOUSE": "/tmp/wh[1]", "CLICKSTREAM_SESSIONS_TOPIC": "visits",
           "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port + 1}"}
    process = subprocess.Popen([sys.executable, "-m", "clickstream.cli", "broker", "--port",
                                str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        assert select.select([process.stdout], [], [], 30)[0], "no ready line within 30 s"
        assert process.stdout.readline().strip() == (  # type: ignore[union-attr]
            f"embedded broker ready on 127.0.0.1:{port} "
            "(topics: events=16, visits=16, attributions=16)")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert (f"clickstream broker: warning: KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{port + 1} is not "
            f"this broker's address (127.0.0.1:{port}): the other commands in this environment "
            "will use that Kafka") in stderr


def test_module_runs_as_subprocess_and_exits_zero_on_sigterm(kafka_config: Config) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "spark")}
    command = [sys.executable, "-m", "clickstream.io.kafka_broker", "--port", str(port)]
    with broker_process(command, env) as line:
        assert line == (f"embedded broker ready on 127.0.0.1:{port} "
                        "(topics: events=16, sessions=16, attributions=16)")

        config = kafka_config.replace(kafka_bootstrap_servers=f"127.0.0.1:{port}")
        producer = make_producer(config)
        produce_json(producer, "events", "c/u", {"event_id": "e1"})
        flush_or_raise(producer, 10)
        assert sum(high for _, high in topic_watermarks(config, "events").values()) == 1

        second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=30)
        assert second.returncode == 1
        assert f"127.0.0.1:{port}" in second.stderr and "already in use" in second.stderr


# ------------------------------------------------------------------------------------------
# Client helpers
# ------------------------------------------------------------------------------------------


def test_client_configs_layer_defaults_options_and_extra(config: Config) -> None:
    cfg = config.replace(kafka_bootstrap_servers="h:1",
                         kafka_options={"linger.ms": "50", "security.protocol": "SSL"})
    produced = producer_config(cfg, **{"linger.ms": 0})
    assert produced["bootstrap.servers"] == "h:1"
    assert produced["compression.type"] == "lz4" and produced["acks"] == "all"
    assert produced["enable.idempotence"] is True
    assert produced["linger.ms"] == 0 and produced["security.protocol"] == "SSL"
    consumed = consumer_config(cfg, group_id="g1")
    assert consumed["group.id"] == "g1" and consumed["enable.auto.commit"] is False
    assert consumed["session.timeout.ms"] <= 10_000 and consumed["linger.ms"] == "50"
    assert consumer_config(cfg)["group.id"] != consumer_config(cfg)["group.id"]


def test_the_next_gen_group_protocol_an_operator_chooses_starts_every_reader(
    kafka_config: Config, make_topic: Callable[..., str]
) -> None:
    """``group.protocol=consumer`` (the brief's other cure for slow rejoins): librdkafka
    refused the product's classic-group defaults, so no reader started, and the error blamed
    the operator's option. A session timeout the operator sets is still theirs to answer for."""
    topic = make_topic(partitions=1)
    produce_records(kafka_config, topic, [("k", "v")])
    chosen = kafka_config.replace(kafka_options={"group.protocol": "consumer"})
    assert topic_watermarks(chosen, topic) == {0: (0, 1)}
    assert read_compacted(chosen, topic, value_decoder=bytes) == {"k": b"v"}
    both = chosen.replace(kafka_options={"group.protocol": "consumer",
                                         "session.timeout.ms": "6000"})
    with pytest.raises(ConfigError, match=r"librdkafka refused 'session\.timeout\.ms' "
                                          r"\(Failed to create consumer: `session\.timeout"):
        make_consumer(both)


def test_a_transactional_send_covers_its_topics_and_one_that_fails_publishes_nothing(
    kafka_config: Config, make_topic: Callable[..., str]
) -> None:
    """``produce_to_topics`` with a transactional id (CLICKSTREAM_KAFKA_TRANSACTIONS): both
    topics' records in one transaction, whose commit marker takes an offset of each; a send
    whose records fail midway raises their error, and what it queued reaches no topic; the
    same id then sends again (a rerun after a crash)."""
    first, second = make_topic(partitions=1), make_topic(partitions=1)

    def failing() -> Iterator[tuple[str, str]]:
        yield "lost", "queued, then purged"
        raise RuntimeError("the frame being sent failed")

    with pytest.raises(RuntimeError, match="the frame being sent failed"):
        produce_to_topics(kafka_config, [(first, failing())], transactional_id="t-1")
    assert produce_to_topics(kafka_config, [(first, [("a", "1"), ("b", None)]),
                                            (second, [("c", "3")])], transactional_id="t-1") == 3
    assert read_compacted(kafka_config, first, value_decoder=bytes) == {"a": b"1"}
    assert read_compacted(kafka_config, second, value_decoder=bytes) == {"c": b"3"}
    assert topic_watermarks(kafka_config, first) == {0: (0, 3)}  # 2 records and a marker
    assert topic_watermarks(kafka_config, second) == {0: (0, 2)}


def test_a_transactional_send_whose_records_time_out_fails_as_retryable(
    kafka_config: Config
) -> None:
    """A broker that cannot take records for a while (NOT_ENOUGH_REPLICAS until they time
    out): librdkafka then refuses the transaction's next record as 'Erroneous state', which
    read as the record itself refused (KafkaRefusedError, not retried) and hid the cause
    (review, session 78). Now the transaction is aborted and the failure is a DeliveryError
    (retried) naming the records' timeout."""
    def slowly(count: int) -> Iterator[tuple[str, str]]:
        for number in range(count):
            time.sleep(0.05)
            yield f"k{number}", "v"

    # A broker of its own: the failures it is told to answer outlast the test.
    with EmbeddedBroker(port=0, topics={"first": 1, "second": 1}) as failing:
        quick = kafka_config.replace(kafka_bootstrap_servers=failing.bootstrap_servers,
                                     kafka_options={"message.timeout.ms": "1500"})
        failing.fail_produces(19, 400)  # NOT_ENOUGH_REPLICAS: retried until records time out
        with pytest.raises(DeliveryError, match="Message timed out"):
            produce_to_topics(quick, [("first", slowly(60)), ("second", slowly(5))],
                              transactional_id="t-slow")


def test_sends_linger_by_kind_unless_the_operator_chose_a_linger(config: Config) -> None:
    """Bulk sends fed from Spark linger longest (the embedded broker serves one stored batch
    per fetch: small batches made reading back quadratic); paced live feeds less; an operator's
    ``linger.ms`` (or its alias) in ``CLICKSTREAM_KAFKA_OPTIONS`` wins over both."""
    assert send_linger(config, paced=False) == {"linger.ms": BULK_LINGER_MS}
    assert send_linger(config, paced=True) == {"linger.ms": PACED_LINGER_MS}
    assert PACED_LINGER_MS < BULK_LINGER_MS
    for name in ("linger.ms", "queue.buffering.max.ms"):
        chosen = config.replace(kafka_options={name: "7"})
        assert producer_config(chosen, **send_linger(chosen, paced=False))[name] == "7"


def test_a_setting_librdkafka_refuses_is_named_with_its_variable(config: Config) -> None:
    unknown = config.replace(kafka_options={"linger.ms": "5", "foo.bar": "1"})
    with pytest.raises(ConfigError, match=r"^CLICKSTREAM_KAFKA_OPTIONS: librdkafka refused "
                                          r"item 2 \(after 'linger\.ms'\) \(not named here: "
                                          r".*\) \(No such configuration property\)"):
        make_consumer(unknown)
    # A password cut at an unescaped comma before an "=" reads as a setting of its own: the
    # name librdkafka does not know is part of the password, and is not repeated; nor where
    # librdkafka named none of them (a setting before it refused under its alias's name).
    for options, culprit in (("sasl.password=Tr0ub4dor,Horse=Battery",
                              r"item 2 \(after 'sasl\.password'\) \(not named here"),
                             ("linger.ms=abc,sasl.password=Tr0ub4dor,Horse=Battery",
                              r"'linger\.ms' \(Invalid value for configuration property"),
                             ("sasl.jaas.config=x,sasl.password=Tr0ub4dor,Horse=Battery",
                              r"one of items 1-3 \(not named here")):
        cut = config.replace(kafka_options=parse_options(options, "CLICKSTREAM_KAFKA_OPTIONS"))
        with pytest.raises(ConfigError, match=rf"refused {culprit}") as err:
            make_producer(cut)
        assert "Horse" not in str(err.value) and "Tr0ub4dor" not in str(err.value)
    java = config.replace(kafka_options={"sasl.jaas.config": "x"})  # the native source's name
    with pytest.raises(ConfigError, match=r"the Java client's names, for Spark's native source, "
                                          r"go in CLICKSTREAM_SPARK_KAFKA_OPTIONS\)$"):
        make_consumer(java)
    malformed = config.replace(kafka_options={"linger.ms": "soon"})  # alias of another name
    with pytest.raises(ConfigError, match=r"refused 'linger\.ms' \(Invalid value"):
        make_producer(malformed)  # reported under its alias's name
    with pytest.raises(KafkaException, match="No such configuration property"):
        make_consumer(config, **{"no.such.setting": 1})  # the code's own: not the operator's


def test_gc_paused_restores_the_collectors_state_even_on_errors() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a loop failed")
    assert gc.isenabled()
    gc.disable()  # a caller that runs without the collector keeps it off
    try:
        with gc_paused(), gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_read_compacted_keeps_last_value_per_key_without_tombstones(
        kafka_config: Config, make_topic: Callable[..., str]) -> None:
    topic = make_topic(4)
    producer = make_producer(kafka_config)
    expected: dict[str, dict[str, int]] = {}
    for revision in range(1, 4):
        for n in range(50):
            key = f"session-{n}"
            if revision == 3 and n % 5 == 0:
                produce_json(producer, topic, key, None)
                expected.pop(key, None)
            else:
                produce_json(producer, topic, key, {"revision": revision})
                expected[key] = {"revision": revision}
    producer.produce(topic, b'{"keyless": true}')  # not part of a compacted view
    flush_or_raise(producer, 10)
    assert read_compacted(kafka_config, topic) == expected
    assert len(expected) == 40


def test_read_compacted_gives_a_large_topic_time_by_its_size(
        kafka_config: Config, make_topic: Callable[..., str]) -> None:
    """A fixed time limit ended a large read (republish's read-back, `inspect`) as a broker
    that does not answer: 25,000 records add 5 s to a limit of none."""
    topic = make_topic(2)
    producer = make_producer(kafka_config)
    for n in range(25_000):
        producer.produce(topic, key=f"k{n % 1_000}".encode(), value=b"1")
        if n % 5_000 == 0:
            producer.poll(0)
    flush_or_raise(producer, 30)
    assert len(read_compacted(kafka_config, topic, value_decoder=bytes, timeout_s=0)) == 1_000


def test_read_compacted_stops_at_once_with_the_cause_of_a_permanent_fetch_error(
    config: Config
) -> None:
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:  # own: the errors answer any client
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        producer = make_producer(own_config)
        producer.produce("t", key=b"k", value=b'{"v": 1}')
        flush_or_raise(producer, 30)
        own.fail_fetches(29, 1)  # TOPIC_AUTHORIZATION_FAILED, for the next Fetch only
        with pytest.raises(ClickstreamError, match=r"topic t partition 0 at offset 0 .*"
                           r"Topic authorization failed"):
            read_compacted(own_config, "t", timeout_s=60)
        assert read_compacted(own_config, "t") == {"k": {"v": 1}}  # the errors were the cause

def test_check_no_data_loss_messages() -> None:
    check_no_data_loss("events", 3, 150, 150)
    check_no_data_loss("events", 3, 200, 150, 200)
    with pytest.raises(DataLossError) as caught:
        check_no_data_loss("events", 3, 100, 150)
    assert str(caught.value).startswith(
        "topic events partition 3: records 100..149 were dropped by the broker before they "
        "were consumed (log start offset is now 150);")
    with pytest.raises(DataLossError, match="reader is at offset 300 but the log ends at 10"):
        check_no_data_loss("events", 3, 300, 0, 10)
    with pytest.raises(ValueError):
        check_no_data_loss("events", 3, -2, 0)


def test_deleted_records_are_detected_as_data_loss(broker: EmbeddedBroker, kafka_config: Config,
                                                   make_topic: Callable[..., str]) -> None:
    # AdminClient.delete_records is unsupported by the mock; its own API does the same.
    topic = make_topic(1)
    producer = make_producer(kafka_config)
    for i in range(200):
        produce_json(producer, topic, f"k{i}", {"i": i})
    flush_or_raise(producer, 10)
    broker.delete_records(topic, 0, 150)
    low, high = topic_watermarks(kafka_config, topic)[0]
    assert (low, high) == (150, 200)
    with pytest.raises(DataLossError, match=r"records 100\.\.149 were dropped"):
        check_no_data_loss(topic, 0, 100, low, high)
    with pytest.raises(DataLossError, match=rf"topic {topic} partition 0: records 0\.\.149") \
            as lost:
        read_compacted(kafka_config, topic)
    # A changelog's view: the sessionizer's setting and re-sending were advice for no one.
    assert "compacted view needs every record since offset 0" in str(lost.value)
    assert "FAIL_ON_DATA_LOSS" not in str(lost.value)


def test_partition_size_cap_drops_old_records_and_is_detected(
        kafka_config: Config, make_topic: Callable[..., str]) -> None:
    topic = make_topic(1)
    producer = make_producer(kafka_config, **{"compression.type": "none"})
    payload = os.urandom(50_000).hex()  # 100 kB of JSON string, one record per batch
    for i in range(80):  # 8 MB > the mock's 5 MiB per partition
        produce_json(producer, topic, f"k{i}", {"blob": payload}, partition=0)
        flush_or_raise(producer, 10)
    low, high = topic_watermarks(kafka_config, topic)[0]
    assert high == 80
    assert 25 <= low <= 35, low  # ~52 records of ~100 kB fit in 5 MiB
    with pytest.raises(DataLossError, match=rf"records 0\.\.{low - 1} were dropped"):
        read_compacted(kafka_config, topic)


def test_unreachable_broker_gives_clear_errors(config: Config, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch,
                                              refusing_port: int) -> None:
    unreachable = config.replace(kafka_bootstrap_servers=f"127.0.0.1:{refusing_port}")
    attempted: list[str] = []  # every librdkafka log record, before the repeat filter

    def count(record: logging.LogRecord) -> bool:
        attempted.append(record.getMessage())
        return True

    monkeypatch.setattr(LIBRDKAFKA_LOG, "filters", [count, *LIBRDKAFKA_LOG.filters])
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError) as caught:
        topic_watermarks(unreachable, "events", attempts=2, timeout_s=1)
    assert time.monotonic() - started < 30  # ~2-3 s; unbounded retries would never end
    message = str(caught.value)
    assert unreachable.kafka_bootstrap_servers in message and "2 attempts" in message
    assert "clickstream broker" in message
    # librdkafka retried the connection many times; the log shows it once, saying so.
    failed_connects = [m for m in attempted if "Connect to" in m and "failed" in m]
    shown = [r.getMessage() for r in caplog.records if r.name == LIBRDKAFKA_LOG.name]
    assert len(failed_connects) > 5, attempted
    assert len(shown) == 1 and "Connect to" in shown[0], shown
    assert "repeats of this message are shown once every 60 s" in shown[0]

    producer = make_producer(unreachable, **{"message.timeout.ms": 1000})
    produce_json(producer, "events", "c/u", {"event_id": "e1"})
    with pytest.raises(DeliveryError) as failed:
        flush_or_raise(producer, 10)
    assert "1 of 1 records were not acknowledged" in str(failed.value)
    assert unreachable.kafka_bootstrap_servers in str(failed.value)


OUT_OF_ORDER_SEQUENCE_NUMBER = 45  # Kafka's code: fatal to an idempotent producer


def test_a_producer_stopped_by_a_fatal_error_raises_a_delivery_error(config: Config) -> None:
    """confluent-kafka raises a fatal error from flush() with the delivery reports of that call
    still to run: each report failed with a bare SystemError, so the CLI printed a traceback
    and no caller took it for a failed send. Now a DeliveryError (a rerun's new producer
    sends them) naming the cause."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:  # own: the error answers any client
        own_config = config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        own.fail_produces(OUT_OF_ORDER_SEQUENCE_NUMBER, 1)
        with pytest.raises(DeliveryError, match=r"the producer to .* stopped on a fatal error: "
                           r".*sequence .*\(OUT_OF_ORDER_SEQUENCE_NUMBER\)"):
            produce_records(own_config, "t", [(f"k{i}", f"v{i}") for i in range(5)],
                            flush_timeout_s=20)
        assert topic_watermarks(own_config, "t") == {0: (0, 0)}
        assert produce_records(own_config, "t", [("k", "v")]) == 1  # the rerun's producer


def test_a_dropped_producer_is_destroyed_at_once_not_at_the_next_cyclic_gc(
        config: Config) -> None:
    """Its delivery callback was its own bound method: a reference cycle, so every dropped
    producer kept librdkafka's threads and its connections, retrying a stopped broker's port,
    until Python's cyclic GC ran. Such a client connects to whatever binds that port next: the
    likely cause of a CI run's sessionizer query failing where Spark's Python worker callback
    port met a connection that was not its worker ("Authentication failed")."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:
        producer = make_producer(config.replace(kafka_bootstrap_servers=own.bootstrap_servers))
        producer.produce("t", key="k", value="v")
        flush_or_raise(producer, 20)
        assert producer.delivered == 0  # counted, then reset by the flush that checked them
        dropped = weakref.ref(producer)
        gc.disable()
        try:
            del producer
            assert dropped() is None
        finally:
            gc.enable()


def test_a_fatal_error_confluent_kafka_reports_as_a_bare_system_error_is_named(
        config: Config) -> None:
    """Under the suite's load confluent-kafka once raised the fatal error from flush() as a
    ``SystemError`` with no ``KafkaException`` attached (not reproducible alone): the send
    failed with a traceback instead of a DeliveryError. The producer's own failed delivery
    report then names the cause. The reports here are real; only the racy bare
    ``SystemError`` is raised by hand, in the call that would have served them."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:
        producer = make_producer(config.replace(kafka_bootstrap_servers=own.bootstrap_servers))
        own.fail_produces(OUT_OF_ORDER_SEQUENCE_NUMBER, 1)
        for i in range(5):
            producer.produce("t", key=f"k{i}", value=f"v{i}")
        with pytest.raises(DeliveryError):  # the usual report: the fatal KafkaException
            producer.flush(20)
        assert producer.failed >= 1

        def bare_system_error(*_: object) -> int:
            raise SystemError("<built-in method flush> returned a result with an exception set")

        with pytest.raises(DeliveryError, match=r"the producer to .* stopped on a fatal error: "
                           r".*sequence .*\(OUT_OF_ORDER_SEQUENCE_NUMBER\)"):
            producer._guarded(bare_system_error)
        producer.reset_counts()  # no failed report: a bare SystemError is not ours to name
        with pytest.raises(SystemError):
            producer._guarded(bare_system_error)


def test_a_send_the_broker_never_acknowledged_leaves_no_record_pending(
        config: Config, refusing_port: int) -> None:
    """When ``produce_records`` gives up, every record has failed, none is still queued: a
    producer still retrying could deliver it after a rerun's newer revision of its key."""
    unreachable = config.replace(kafka_bootstrap_servers=f"127.0.0.1:{refusing_port}")
    started = time.monotonic()
    with pytest.raises(DeliveryError) as failed:
        produce_records(unreachable, "sessions", [("s1", "{}"), ("s2", None)],
                        flush_timeout_s=1)
    assert "(2 failed, 0 still queued" in str(failed.value), failed.value
    # Bounds with room for a busy machine, well below the 60 s default budget they rule out.
    assert time.monotonic() - started < 1 + TIMED_OUT_REPORT_GRACE_S + 15
    # A delivery timeout the user sets wins over the send's default budget (60 s here).
    patient = unreachable.replace(kafka_options={"delivery.timeout.ms": "1500"})
    started = time.monotonic()
    with pytest.raises(DeliveryError, match="1 failed, 0 still queued"):
        produce_records(patient, "sessions", [("s1", "{}")])
    assert time.monotonic() - started < 1.5 + TIMED_OUT_REPORT_GRACE_S + 15
    # A large send stops at its first failed record: it kept producing, each 100k records
    # queued waiting one more budget (a 1M-record changelog to a Kafka that is down: ~10 min).
    yielded = 0

    def many() -> Iterator[tuple[str, str]]:
        nonlocal yielded
        for i in range(300_000):
            yielded += 1
            yield f"s{i}", "{}"

    with pytest.raises(DeliveryError, match="were not acknowledged"):
        produce_records(unreachable, "sessions", many(), flush_timeout_s=1)
    assert yielded < 300_000
    for bad in ("0", "soon"):
        with pytest.raises(ConfigError, match=f"delivery.timeout.ms='{bad}' must be a positive"):
            produce_records(unreachable.replace(kafka_options={
                "delivery.timeout.ms": bad}), "sessions", [("s1", "{}")])


def test_a_send_that_fails_midway_leaves_nothing_queued_to_land_after_it(
    kafka_config: Config, make_topic: Callable[..., str]
) -> None:
    """A record the producer refuses (over ``message.max.bytes``), or records whose source
    fails (the Spark job behind a changelog), end the send with nothing still queued: the
    records queued before reached the topic after the call had failed, behind whatever a
    rerun sends. The refused record's error was librdkafka's own, not the product's."""
    topic = make_topic(partitions=1)
    oversized = [*((f"k{i}", "x") for i in range(5)), ("big", "y" * 1_200_000), ("k9", "z")]
    with pytest.raises(KafkaRefusedError, match=r"record 6 to .* \(key b'big', 1200000 "
                       r"bytes\) was refused by the producer: .*too large"):
        produce_records(kafka_config, topic, oversized)

    def failing() -> Iterator[tuple[str, str]]:
        yield from ((f"s{i}", "{}") for i in range(500))
        raise RuntimeError("the job behind the records failed")

    with pytest.raises(RuntimeError, match="the job behind the records failed"):
        produce_records(kafka_config, topic, failing())
    time.sleep(1)  # the linger (100 ms) and a round trip, with room
    assert topic_watermarks(kafka_config, topic) == {0: (0, 0)}


def test_repeated_librdkafka_messages_are_counted_not_printed() -> None:
    repeats = RepeatedLogFilter(window_s=0.2)

    def record(client: str, text: str) -> logging.LogRecord:  # as confluent-kafka logs them
        return logging.LogRecord("clickstream.librdkafka", logging.ERROR, __file__, 0,
                                 "%s [%s] %s", ("FAIL", client, text), None)

    refused = ("h:1/bootstrap: Connect to ipv4#h:1 failed: Connection refused "
               "(after {}ms in state CONNECT)")
    first = record("c#consumer-1", refused.format(0))
    assert repeats.filter(first) and "shown once every 0.2 s" in first.getMessage()
    assert not repeats.filter(record("c#consumer-2", refused.format(3)))  # same, other client
    assert repeats.filter(record("c#consumer-2", "h:2/bootstrap: Connect to ipv4#h:2 failed"))
    assert not repeats.filter(record("c#consumer-3", refused.format(1)))
    time.sleep(0.25)
    again = record("c#consumer-4", refused.format(0))
    assert repeats.filter(again)
    assert again.getMessage().endswith("(2 more like it since it was last shown)")

    # Messages naming offsets are each new: a sessionizer running for weeks kept them all.
    most = RepeatedLogFilter.MAX_REMEMBERED
    for window in range(4):
        for offset in range(most):
            repeats.filter(record("c#consumer-5", f"fetch at offset {window}-{offset} failed"))
        time.sleep(0.25)
    assert len(repeats._seen) <= 3 * most  # 4 windows of them, and 2 more, kept before


@pytest.mark.parametrize("ask", [topic_watermarks, topic_id])
def test_unknown_topic_is_not_reported_as_unavailable(kafka_config: Config,
                                                      ask: Callable[..., object]) -> None:
    with pytest.raises(ClickstreamError, match="does not exist") as caught:
        ask(kafka_config, "missing-" + uuid.uuid4().hex, attempts=1)
    assert not isinstance(caught.value, BrokerUnavailableError)


def test_a_topic_lookup_the_broker_refuses_stops_at_once_with_the_cause(
    kafka_config: Config
) -> None:
    """An authorization error on the topic's metadata was retried for ~30 s and then
    reported as a broker that "did not answer" ("start the broker")."""
    with EmbeddedBroker(port=0, topics={"t": 1}) as own:
        config = kafka_config.replace(kafka_bootstrap_servers=own.bootstrap_servers)
        own.fail_metadata(29, 20)  # TOPIC_AUTHORIZATION_FAILED
        started = time.monotonic()
        with pytest.raises(ClickstreamError, match=r"about topic 't' failed: .*Topic "
                           r"authorization failed \(TOPIC_AUTHORIZATION_FAILED\); fix the "
                           r"cause") as caught:
            topic_watermarks(config, "t", attempts=5, timeout_s=2)
        assert isinstance(caught.value, KafkaRefusedError)  # exit 3: Airflow does not retry
        assert time.monotonic() - started < 5  # at once, not after the retries


def test_a_topic_id_names_one_log(kafka_config: Config, make_topic: Callable[..., str]) -> None:
    first, second = make_topic(1), make_topic(1)
    assert topic_id(kafka_config, first) == topic_id(kafka_config, first)
    assert topic_id(kafka_config, first) != topic_id(kafka_config, second)


def test_no_broker_for_a_topic_id_is_reported_as_unavailable() -> None:
    nowhere = Config.from_env({}).replace(kafka_bootstrap_servers="127.0.0.1:1")
    with pytest.raises(BrokerUnavailableError, match="did not answer for topic 'events'"):
        topic_id(nowhere, "events", attempts=2, timeout_s=0.5)


def test_plain_producer_is_flushed_too(kafka_config: Config,
                                       make_topic: Callable[..., str]) -> None:
    topic = make_topic(1)
    producer = Producer(producer_config(kafka_config))
    produce_json(producer, topic, "k", {"v": 1})
    flush_or_raise(producer, 10)
    assert read_compacted(kafka_config, topic) == {"k": {"v": 1}}


def test_produce_waiting_rides_out_a_full_local_queue(kafka_config: Config,
                                                      make_topic: Callable[..., str]) -> None:
    topic = make_topic(1)
    producer = Producer(producer_config(kafka_config, **{"queue.buffering.max.messages": 5,
                                                         "linger.ms": 200}))
    for i in range(5):
        producer.produce(topic, value=str(i).encode())
    with pytest.raises(BufferError):  # the queue is full until the lingering batch is sent
        producer.produce(topic, value=b"5")
    for i in range(5, 30):
        produce_waiting(producer, topic, value=str(i).encode())
    flush_or_raise(producer, 10)
    assert [m.value() for m in _consume(kafka_config, topic, 30)] == [
        str(i).encode() for i in range(30)]


def test_produce_records_sends_raw_values_at_a_rate(kafka_config: Config,
                                                    make_topic: Callable[..., str]) -> None:
    topic = make_topic(2)
    records = [("c/u1", '{"event_id":"e1"}'), (None, "not json {"), ("c/u1", None),
               (b"c/u2", b'{"event_id":"e2"}')] * 5
    started = time.monotonic()
    assert produce_records(kafka_config, topic, records, rate_per_second=100) == 20
    assert time.monotonic() - started >= 0.15  # 20 records at 100/s
    # At a low rate each record waits its turn (a wait ended at its first delivery report,
    # and 5/s sent 18/s).
    started = time.monotonic()
    assert produce_records(kafka_config, make_topic(1), [(None, "x")] * 6,
                           rate_per_second=5) == 6
    assert time.monotonic() - started >= 1.0  # the 6th record is due 1 s after the first
    values = sorted((m.key(), m.value()) for m in _consume(kafka_config, topic, 20)
                    if m.key() is None)
    assert values == [(None, b"not json {")] * 5
    assert read_compacted(kafka_config, topic) == {"c/u2": {"event_id": "e2"}}


@pytest.mark.parametrize(("argv", "reason"), [
    (["--port", "99999"], "argument --port: '99999' is not a port (0-65535)"),
    (["--topic", "events=x"], "argument --topic: 'events=x' is not NAME=PARTITIONS"),
    (["--topic", "=4"], "argument --topic: '=4' is not NAME=PARTITIONS"),
    (["--host", " "], "argument --host: an empty address binds every interface, and the "
     "broker has no authentication; give one (default 127.0.0.1)")])
def test_the_broker_module_refuses_a_bad_port_or_topic_in_one_line(
        argv: list[str], reason: str, capsys: pytest.CaptureFixture) -> None:
    """A port past 65535 ended in an OverflowError traceback from bind()."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"python -m clickstream.io.kafka_broker: error: {reason}" + (
            "" if "--topic" not in reason else " (a topic name, and a whole number of "
            "partitions of at least 1)")
