"""Embedded Kafka-protocol broker: librdkafka's in-process mock cluster behind a fixed port.

No real Kafka can be installed where the embedded profile runs, but the librdkafka shipped in
the confluent-kafka wheel contains a mock cluster that speaks the Kafka protocol on loopback
TCP. This module (the only one that touches librdkafka through ctypes) starts that mock,
creates the product's topics, and puts a small TCP forwarder on a fixed port (default 9092) so
``KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:9092`` works like for a real broker.

Advertised address (decision): Metadata advertises the mock's own random loopback port, so
clients bootstrap through the fixed port and then talk to the mock directly; only short
bootstrap connections pass through the forwarder. The alternative, ``advertise="forwarder"``,
calls ``rd_kafka_mock_broker_set_host_port`` (which, checked empirically and in librdkafka's
source, only rewrites the host/port that Metadata and FindCoordinator return; the mock keeps
listening on its random port) so that every byte goes through the forwarder. Measured on the
2-CPU build machine, one producer then one consumer in the broker's own process, 16
partitions:

- 1M JSON events of ~280 bytes, lz4: ~450k msg/s produce and ~180-550k msg/s consume in
  both modes (the clients' Python loop is the bottleneck, not the relay);
- 60k random 1,000-byte values, uncompressed: direct ~570k msg/s (~545 MiB/s) produce and
  ~670k msg/s consume; through the forwarder ~365k msg/s (~350 MiB/s) and ~470k msg/s.

Direct is faster for large records and keeps a Python thread (and the GIL of whichever process
hosts the broker) out of the data path; restarts are equally safe (a producer reconnected to a
restarted broker on the same fixed port in ~1 s in both modes, since librdkafka re-bootstraps
once every known broker is down). ``advertise="forwarder"`` remains for clients that can only
reach one port.

Known limits (measured with librdkafka 2.16.0; limit 2 is exercised by the io tests):

1. Memory only: everything is lost when the broker stops.
2. Each partition keeps at most 5 MiB (5 * 1024 * 1024 bytes) of stored record batches
   (compressed size) or 100,000 batches, whichever is hit first; older batches are dropped
   silently and the partition's log start offset moves up. Measured: 1,000 uncompressed
   batches of 10,000 bytes keep the newest 520 (4.99 MiB); 130,000 single-record batches keep
   the newest 75,983 (the size cap binds first: a batch costs at least ~69 bytes, so the
   100k-batch cap is practically unreachable). With the product's producer settings (lz4,
   linger 5 ms, idempotence) a 1-partition topic fed 400k pageview events of ~256 bytes in
   bulk kept the newest 65,577 (lz4 packs a random-id event to ~80 bytes); fed one event per
   batch (a slow trickle) it kept 16,900. With 16 partitions per topic that is ~1M (bulk) to
   ~270k (trickle) events a reader may lag behind before the oldest are dropped. Readers
   detect a drop with :func:`clickstream.io.kafka_read.check_no_data_loss` and fail, as
   Spark's ``failOnDataLoss`` does, instead of skipping silently (or, for the sessionizer with
   ``CLICKSTREAM_FAIL_ON_DATA_LOSS=false``, record the lost offsets in quarantine and go on).
3. There is no log compaction: the ``sessions``/``attributions`` changelogs keep every
   revision, so their compacted view is complete only while nothing was dropped (partition
   low watermark 0); :func:`clickstream.io.kafka_read.read_compacted` checks that.
4. Topics are created through the mock API only (:meth:`EmbeddedBroker.create_topic`); admin
   CreateTopics and DeleteRecords are unsupported; a producer writing to an unknown topic
   auto-creates it with 4 partitions.
5. Offset lookup by timestamp (``offsets_for_times``) returns -1; per the project brief's
   measurements ``read_committed`` is not honoured (records of open and of aborted
   transactions are read like any other) and ``send_offsets_to_transaction`` stores
   nothing. So offsets are kept with the outputs, never in Kafka.
6. Classic consumer groups wait ``session.timeout.ms`` on rejoin; the client helpers use a
   small session timeout. The mock's initial group rebalance delay (3 s, like Kafka's
   ``group.initial.rebalance.delay.ms``) is set to 0 here so a group's first join is quick.
7. Reading costs grow with the number of stored batches: the mock keeps each produce
   request's record batch as is, answers a Fetch with one stored batch per partition, and
   finds it by a linear scan of the partition's batches (librdkafka's ``FIXME: Maintain an
   index``). A producer that trickles (one record per batch) therefore makes reading
   quadratic: 15,000 one-record batches in a partition read back in 2.8 s (187 µs a record)
   against 0.02 s for the same records produced in bulk; in the sessionizer's memory
   benchmark the mock's thread spent 82% of its time in that scan and the sessionizer,
   starved of records, fell behind at 2,500 events/s. Producers therefore linger
   (:data:`clickstream.io.kafka_produce.PACED_LINGER_MS`, and ``BULK_LINGER_MS`` for sends
   fed from Spark: with 5 ms, the full backfill benchmark's publish gate read its 1M records
   back in 16.6 s, with 100 ms in 6.2 s); real Kafka returns many batches per fetch and
   indexes its log.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import glob
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Literal

import confluent_kafka

from clickstream.errors import BrokerError

_log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
DEFAULT_HOST = "127.0.0.1"
TOPIC_PARTITIONS = 16
DEFAULT_TOPICS: Mapping[str, int] = dict.fromkeys(("events", "sessions", "attributions"),
                                                TOPIC_PARTITIONS)

_RD_KAFKA_PRODUCER = 0
_RESP_ERR_TOPIC_ALREADY_EXISTS = 36
_API_KEY_PRODUCE = 0  # the Kafka protocol's request type numbers of Produce, Fetch,
_API_KEY_FETCH = 1  # ListOffsets and Metadata
_API_KEY_LIST_OFFSETS = 2
_API_KEY_METADATA = 3
_BUFFER_LIMIT = 1 << 20  # bytes buffered per direction before reading from that side pauses
_RECV_SIZE = 1 << 18
ACCEPT_PAUSE_S = 0.1  # out of descriptors: how long new connections wait in the backlog
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

Advertise = Literal["direct", "forwarder"]


# --------------------------------------------------------------------------------------------
# librdkafka through ctypes
# --------------------------------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _librdkafka() -> ctypes.CDLL:
    """Load the librdkafka that confluent-kafka itself uses (same file, so one copy in memory)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        site = os.path.dirname(os.path.dirname(os.path.abspath(confluent_kafka.__file__)))
        found = sorted(glob.glob(os.path.join(site, "confluent_kafka.libs", "librdkafka-*.so*")))
        if not found:
            raise BrokerError(
                f"librdkafka not found next to confluent_kafka in {site}; the embedded broker "
                "needs the confluent-kafka manylinux wheel (pip install confluent-kafka==2.16.1)"
            )
        lib = ctypes.CDLL(found[0])
        vp, cp, i32, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int64
        signatures: dict[str, tuple[list[object], object]] = {
            "rd_kafka_conf_new": ([], vp),
            "rd_kafka_conf_set": ([vp, cp, cp, cp, ctypes.c_size_t], ctypes.c_int),
            "rd_kafka_conf_destroy": ([vp], None),
            "rd_kafka_new": ([ctypes.c_int, vp, cp, ctypes.c_size_t], vp),
            "rd_kafka_destroy": ([vp], None),
            "rd_kafka_mock_cluster_new": ([vp, ctypes.c_int], vp),
            "rd_kafka_mock_cluster_destroy": ([vp], None),
            "rd_kafka_mock_cluster_bootstraps": ([vp], cp),
            "rd_kafka_mock_topic_create": ([vp, cp, ctypes.c_int, ctypes.c_int], ctypes.c_int),
            "rd_kafka_mock_set_controller_id": ([vp, i32], None),
            "rd_kafka_mock_broker_set_host_port": ([vp, i32, cp, ctypes.c_int], None),
            "rd_kafka_mock_partition_delete_records": ([vp, cp, i32, i64], ctypes.c_int),
            "rd_kafka_mock_group_initial_rebalance_delay_ms": ([vp, i32], None),
            "rd_kafka_mock_push_request_errors_array": (
                [vp, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)], None),
            "rd_kafka_err2str": ([ctypes.c_int], cp),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
        _lib = lib
        return lib


def _err2str(lib: ctypes.CDLL, code: int) -> str:
    return (lib.rd_kafka_err2str(code) or b"unknown error").decode()


class _MockCluster:
    """Owns one rd_kafka_t handle and the one-broker mock cluster attached to it."""

    def __init__(self) -> None:
        lib = _librdkafka()
        err = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        # The handle only hosts the mock; it never connects anywhere, so silence the notice
        # "No bootstrap.servers configured" (level 5) while keeping warnings and errors.
        lib.rd_kafka_conf_set(conf, b"log_level", b"4", err, len(err))
        lib.rd_kafka_conf_set(conf, b"client.id", b"clickstream-embedded-broker", err, len(err))
        rk = lib.rd_kafka_new(_RD_KAFKA_PRODUCER, conf, err, len(err))
        if not rk:  # on failure the conf is still ours to free
            lib.rd_kafka_conf_destroy(conf)
            raise BrokerError(f"embedded broker: rd_kafka_new failed: {err.value.decode()}")
        mcluster = lib.rd_kafka_mock_cluster_new(rk, 1)
        if not mcluster:
            lib.rd_kafka_destroy(rk)
            raise BrokerError("embedded broker: rd_kafka_mock_cluster_new failed (see stderr)")
        lib.rd_kafka_mock_set_controller_id(mcluster, 1)
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms(mcluster, 0)
        self._lib, self._rk, self._mcluster = lib, rk, mcluster
        self.bootstraps: str = lib.rd_kafka_mock_cluster_bootstraps(mcluster).decode()
        host, _, port = self.bootstraps.split(",")[0].rpartition(":")
        self.host, self.port = host, int(port)

    def create_topic(self, name: str, partitions: int) -> int:
        return int(self._lib.rd_kafka_mock_topic_create(self._mcluster, name.encode(),
                                                        partitions, 1))

    def advertise(self, host: str, port: int) -> None:
        self._lib.rd_kafka_mock_broker_set_host_port(self._mcluster, 1, host.encode(), port)

    def delete_records(self, topic: str, partition: int, before_offset: int) -> int:
        return int(self._lib.rd_kafka_mock_partition_delete_records(
            self._mcluster, topic.encode(), partition, before_offset))

    def fail_requests(self, api_key: int, codes: Sequence[int]) -> None:
        errors = (ctypes.c_int * len(codes))(*codes)
        self._lib.rd_kafka_mock_push_request_errors_array(self._mcluster, api_key, len(codes),
                                                         errors)

    def error_text(self, code: int) -> str:
        return _err2str(self._lib, code)

    def destroy(self) -> None:
        if self._mcluster:
            self._lib.rd_kafka_mock_cluster_destroy(self._mcluster)
            self._mcluster = None
        if self._rk:
            self._lib.rd_kafka_destroy(self._rk)
            self._rk = None


# --------------------------------------------------------------------------------------------
# TCP forwarder
# --------------------------------------------------------------------------------------------


class _Pipe:
    """One proxied connection: client socket <-> upstream socket, with a buffer per direction."""

    __slots__ = ("client", "closing", "pending", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        # pending[s] holds bytes waiting to be written to socket s.
        self.pending: dict[socket.socket, bytearray] = {client: bytearray(),
                                                        upstream: bytearray()}
        self.closing = False

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class _Forwarder:
    """Single-threaded selectors loop accepting on a fixed port and relaying to the mock.

    Every accepted connection gets its own upstream connection. When either side ends or
    fails, bytes already read are flushed to the other side and both sockets are closed, so
    connects/disconnects leave no file descriptors behind.
    """

    def __init__(self, host: str, port: int) -> None:
        self._listener = _listen(host, port)  # bind first: a taken port fails before anything
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._upstream: tuple[str, int] = ("127.0.0.1", 0)
        self._sel = selectors.DefaultSelector()
        self._pipes: dict[socket.socket, _Pipe] = {}
        self._events: dict[socket.socket, int] = {}  # current selector interest, 0 = none
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._accept_again_at: float | None = None  # accepting paused until then
        self._paused_since_accepting = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kafka-forwarder-{self.address[1]}")

    def start(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for pipe in {id(p): p for p in self._pipes.values()}.values():
            self._close(pipe)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            sock.close()
        self._sel.close()

    @property
    def open_connections(self) -> int:
        return len(self._pipes) // 2

    @property
    def relaying(self) -> bool:
        return self._thread.is_alive()

    def _pause_accepting(self, error: OSError) -> None:
        """Out of descriptors: the listener stays readable, and accepting at once again would
        spin; relayed connections go on, and new ones wait in the backlog a moment."""
        if not self._paused_since_accepting:  # once until a connection is accepted again
            _log.warning("embedded broker forwarder: cannot accept a connection (%s); "
                         "new connections wait until it can", error)
        self._paused_since_accepting = True
        self._sel.unregister(self._listener)
        self._accept_again_at = time.monotonic() + ACCEPT_PAUSE_S

    def _run(self) -> None:
        while not self._stopping:
            if self._accept_again_at is not None and time.monotonic() >= self._accept_again_at:
                self._sel.register(self._listener, selectors.EVENT_READ, None)
                self._accept_again_at = None
            timeout = 1.0 if self._accept_again_at is None else ACCEPT_PAUSE_S
            for key, mask in self._sel.select(timeout=timeout):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                else:
                    assert isinstance(sock, socket.socket)
                    self._serve(sock, mask)

    def _serve(self, sock: socket.socket, mask: int) -> None:
        pipe = self._pipes.get(sock)
        try:
            if pipe is not None and mask & selectors.EVENT_WRITE:
                self._flush(pipe, sock)
            pipe = self._pipes.get(sock)  # the flush may have closed it
            if pipe is not None and mask & selectors.EVENT_READ:
                self._read(pipe, sock)
        except Exception:  # one broken connection must never stop the relay for the others
            _log.exception("embedded broker forwarder: dropping a connection after an error")
            if pipe is not None:
                self._close(pipe)

    def _accept(self) -> None:
        for _ in range(64):  # drain the backlog without starving established connections
            try:
                client, _ = self._listener.accept()
            except OSError as error:  # nothing pending, or no descriptor left: it waits
                if error.errno in _OUT_OF_DESCRIPTORS:
                    self._pause_accepting(error)
                return
            # Connect without waiting: on this one thread, a blocking connect stalled every
            # relayed connection ~1 s whenever the mock's accept backlog (5) was full (a burst
            # of clients, as a micro-batch's read tasks). The client's bytes wait in
            # pending[upstream] until the connection is writable; a refused connect fails the
            # first send and closes the pipe.
            try:
                upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as error:  # the client took the last descriptor: it is let go
                client.close()
                self._pause_accepting(error)
                return
            upstream.setblocking(False)
            code = upstream.connect_ex(self._upstream)
            if code not in (0, errno.EINPROGRESS):
                upstream.close()
                client.close()
                continue
            self._paused_since_accepting = False
            client.setblocking(False)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(client, upstream)
            for sock in (client, upstream):
                self._pipes[sock] = pipe
                self._events[sock] = selectors.EVENT_READ
                self._sel.register(sock, selectors.EVENT_READ, None)

    def _read(self, pipe: _Pipe, sock: socket.socket) -> None:
        peer = pipe.peer(sock)
        try:
            data = sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(pipe)
            return
        if not data:
            # End of stream: deliver what is buffered for the other side, then close both.
            pipe.closing = True
            if any(pipe.pending.values()):
                self._update(pipe)
            else:
                self._close(pipe)
            return
        buffer = pipe.pending[peer]
        if not buffer:
            try:
                sent = peer.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(pipe)
                return
            data = data[sent:]
        if data:
            buffer += data
            self._update(pipe)

    def _flush(self, pipe: _Pipe, sock: socket.socket) -> None:
        buffer = pipe.pending[sock]
        if buffer:
            try:
                sent = sock.send(buffer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(pipe)
                return
            del buffer[:sent]
        if pipe.closing and not any(pipe.pending.values()):
            self._close(pipe)
        else:
            self._update(pipe)

    def _update(self, pipe: _Pipe) -> None:
        """Re-arm interest: write while bytes wait; read while the peer's buffer has room."""
        for sock in (pipe.client, pipe.upstream):
            events = selectors.EVENT_WRITE if pipe.pending[sock] else 0
            if not pipe.closing and len(pipe.pending[pipe.peer(sock)]) < _BUFFER_LIMIT:
                events |= selectors.EVENT_READ
            current = self._events[sock]
            if events == current:
                continue
            if not current:
                self._sel.register(sock, events, None)
            elif not events:
                self._sel.unregister(sock)
            else:
                self._sel.modify(sock, events, None)
            self._events[sock] = events

    def _close(self, pipe: _Pipe) -> None:
        for sock in (pipe.client, pipe.upstream):
            self._pipes.pop(sock, None)
            if self._events.pop(sock, 0):
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # SO_REUSEADDR only skips TIME_WAIT leftovers of a previous run; on Linux it still refuses
    # a port some other socket is listening on, which is what we want to detect.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            reason = "is already in use" if exc.errno == errno.EADDRINUSE else "is not permitted"
            raise BrokerError(
                f"embedded broker cannot listen on {host}:{port}: the port {reason} "
                f"(another broker or program holds it); stop that program, or choose another "
                f"port with --port and set KAFKA_BOOTSTRAP_SERVERS={host}:<port>"
            ) from None
        raise BrokerError(f"embedded broker cannot listen on {host}:{port}: {exc}") from None
    sock.setblocking(False)
    return sock


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


class EmbeddedBroker:
    """A one-broker Kafka-protocol server in this process, reachable on ``host:port``.

    Delivery guarantee: whatever the mock acknowledges (acks=all) is readable until the broker
    stops or the partition's size cap drops it (see the module's known limits); nothing
    survives a stop.

    Example:
        >>> with EmbeddedBroker(port=0, topics={"events": 4}) as broker:
        ...     cfg = Config(kafka_bootstrap_servers=broker.bootstrap_servers)

    Args:
        port: Fixed TCP port of the forwarder; 0 picks a free one (see ``bootstrap_servers``).
        host: Interface to listen on. Keep it on loopback: the mock has no authentication.
        topics: Topic name -> partition count, created at start.
        advertise: ``"direct"`` (default) lets clients talk to the mock's own port after
            bootstrapping; ``"forwarder"`` advertises the fixed port so all traffic passes
            through it (slower; for clients that can only reach one port).
    """

    def __init__(self, port: int = DEFAULT_PORT, host: str = DEFAULT_HOST,
                 topics: Mapping[str, int] = DEFAULT_TOPICS,
                 advertise: Advertise = "direct") -> None:
        if advertise not in ("direct", "forwarder"):
            raise BrokerError(f"advertise={advertise!r}: use 'direct' or 'forwarder'")
        self._port = port
        self._host = host
        self._topics = dict(topics)
        self._advertise = advertise
        self._mock: _MockCluster | None = None
        self._forwarder: _Forwarder | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> EmbeddedBroker:
        """Start the mock, create the topics, open the fixed port.

        Raises:
            BrokerError: The port is taken, or the mock or a topic could not be created.
        """
        with self._lock:
            if self._mock is not None:
                return self
            forwarder = _Forwarder(self._host, self._port)  # raises on a taken port
            try:
                mock = _MockCluster()
            except BaseException:
                forwarder.stop()
                raise
            self._port = forwarder.address[1]  # resolves port 0 to the one picked
            if self._advertise == "forwarder":
                mock.advertise(self._host, self._port)
            self._mock, self._forwarder = mock, forwarder
            self._finalizer = weakref.finalize(self, _shutdown, forwarder, mock)
        try:
            for name, partitions in self._topics.items():
                self.create_topic(name, partitions)
            # Only now: a client's request for a topic not created yet made the mock create
            # it with its default partitions, and creating it then failed the start. Clients
            # that connected before wait in the backlog.
            forwarder.start((mock.host, mock.port))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close the fixed port and every relayed connection, then destroy the mock (data too)."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
            self._mock = self._forwarder = None
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- properties and admin ------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` to put in ``KAFKA_BOOTSTRAP_SERVERS``."""
        return f"{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def topics(self) -> dict[str, int]:
        """Topics created through this object (name -> partitions)."""
        return dict(self._topics)

    @property
    def mock_bootstraps(self) -> str:
        """The mock's own random ``host:port`` (what Metadata advertises in direct mode)."""
        return self._running()[0].bootstraps

    @property
    def open_connections(self) -> int:
        """Connections currently relayed by the forwarder (for leak checks)."""
        return self._running()[1].open_connections

    @property
    def relaying(self) -> bool:
        """Whether the fixed port still relays to the broker (its thread has not died)."""
        return self._running()[1].relaying

    def create_topic(self, name: str, partitions: int, *, exist_ok: bool = False) -> None:
        """Create a topic (the mock's only way: admin CreateTopics is unsupported).

        Raises:
            BrokerError: Not running, bad arguments, or the topic exists and not ``exist_ok``.
        """
        mock, _ = self._running()
        if not name or partitions < 1:
            raise BrokerError(f"cannot create topic {name!r} with {partitions} partitions: "
                              "need a name and at least 1 partition")
        code = mock.create_topic(name, partitions)
        if code == _RESP_ERR_TOPIC_ALREADY_EXISTS and exist_ok:
            return
        if code:
            raise BrokerError(f"embedded broker could not create topic {name!r} "
                              f"({partitions} partitions): {mock.error_text(code)}")
        self._topics[name] = partitions

    def delete_records(self, topic: str, partition: int, before_offset: int) -> None:
        """Drop records below ``before_offset``, as retention would (to test data-loss checks).

        Raises:
            BrokerError: Unknown topic/partition or an offset beyond the log end.
        """
        mock, _ = self._running()
        code = mock.delete_records(topic, partition, before_offset)
        if code:
            raise BrokerError(f"delete_records {topic} [{partition}] before {before_offset}: "
                              f"{mock.error_text(code)}")

    def fail_fetches(self, error_code: int, count: int) -> None:
        """Answer the next ``count`` Fetch requests with ``error_code`` (a Kafka protocol error
        code), as a real broker's failures would (to test how readers take them)."""
        self._fail_requests(_API_KEY_FETCH, error_code, count)

    def fail_metadata(self, error_code: int, count: int) -> None:
        """Answer the next ``count`` Metadata requests with ``error_code``, as
        :meth:`fail_fetches` does Fetch requests (to test how topic lookups take them)."""
        self._fail_requests(_API_KEY_METADATA, error_code, count)

    def fail_offset_lookups(self, error_code: int, count: int) -> None:
        """Answer the next ``count`` ListOffsets requests (a log's start or end) with
        ``error_code``, as :meth:`fail_fetches` does Fetch requests."""
        self._fail_requests(_API_KEY_LIST_OFFSETS, error_code, count)

    def fail_produces(self, error_code: int, count: int) -> None:
        """Answer the next ``count`` Produce requests with ``error_code``, as
        :meth:`fail_fetches` does Fetch requests (to test how a publish takes them)."""
        self._fail_requests(_API_KEY_PRODUCE, error_code, count)

    def _fail_requests(self, api_key: int, error_code: int, count: int) -> None:
        if count < 1:
            raise BrokerError(f"a request failure needs a count of at least 1, got {count}")
        self._running()[0].fail_requests(api_key, [error_code] * count)

    def _running(self) -> tuple[_MockCluster, _Forwarder]:
        mock, forwarder = self._mock, self._forwarder
        if mock is None or forwarder is None:
            raise BrokerError("embedded broker is not running; call start() first")
        return mock, forwarder


def _shutdown(forwarder: _Forwarder, mock: _MockCluster) -> None:
    """Stop order matters: no new relayed connections, then the mock, then its handle."""
    forwarder.stop()
    mock.destroy()


@contextlib.contextmanager
def _signals_set(event: threading.Event) -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        event.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_broker_forever(port: int = DEFAULT_PORT,
                       topics: Mapping[str, int] = DEFAULT_TOPICS,
                       host: str = DEFAULT_HOST) -> None:
    """Run the embedded broker in the foreground until SIGTERM or SIGINT, then return.

    Prints one line ``embedded broker ready on HOST:PORT (topics: ...)`` to stdout once clients
    can connect. Must run in the main thread (it installs signal handlers).

    Raises:
        BrokerError: The port is in use or the broker could not start.
    """
    stop = threading.Event()
    with _signals_set(stop), EmbeddedBroker(port=port, host=host, topics=topics) as broker:
        listed = ", ".join(f"{name}={n}" for name, n in broker.topics.items())
        print(f"embedded broker ready on {broker.bootstrap_servers} (topics: {listed})",
              flush=True)
        while not stop.wait(timeout=1.0):
            if not broker.relaying:
                raise BrokerError(f"the embedded broker's port {broker.bootstrap_servers} "
                                  "stopped relaying to the broker after an error (logged "
                                  "above); its data is gone with it: start it again")


def port_number(text: str) -> int:
    """argparse type of a listening port: 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return port


def host_address(text: str) -> str:
    """argparse type of the address the port binds: an empty one binds every interface."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "an empty address binds every interface, and the broker has no authentication; "
            f"give one (default {DEFAULT_HOST})")
    return text


def topic_spec(text: str) -> tuple[str, int]:
    """argparse type of ``NAME=PARTITIONS`` (``NAME`` alone: its default partition count)."""
    name, _, count = text.partition("=")
    partitions = count or str(DEFAULT_TOPICS.get(name, TOPIC_PARTITIONS))
    if not name or not partitions.isdigit() or int(partitions) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=PARTITIONS (a topic name, and a whole number of partitions "
            "of at least 1)")
    return name, int(partitions)


def main(argv: list[str] | None = None) -> int:
    """``python -m clickstream.io.kafka_broker --port 9092``; the CLI wires the same function."""
    parser = argparse.ArgumentParser(prog="python -m clickstream.io.kafka_broker",
                                     description="Run the embedded Kafka-protocol broker.")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    parser.add_argument("--host", type=host_address, default=DEFAULT_HOST)
    parser.add_argument("--topic", action="append", type=topic_spec, default=[],
                        metavar="NAME=PARTITIONS",
                        help="topic to create (repeatable); default: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_TOPICS.items()))
    args = parser.parse_args(argv)
    try:
        run_broker_forever(port=args.port, topics=dict(args.topic) or dict(DEFAULT_TOPICS),
                           host=args.host)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
