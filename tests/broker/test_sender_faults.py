"""The sender under broker faults: a lost connection, a request that never gets an
answer, an answer lost after the broker wrote the batch. A small proxy in a thread sits
between the sender and a broker of the test's own that advertises the proxy's port."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shmprod import ipc
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker, free_port
from shmprod.connection import BrokerConnection
from shmprod.errors import CorruptBatchError, DeliveryTimeoutError
from shmprod.protocol.records import decode_batches
from tests.support.readback import consume_all
from tests.support.sender_peers import WAIT, FakeWorker, Owner, shutdown, values

pytestmark = pytest.mark.broker

PRODUCE = 0
_HEAD = struct.Struct(">ihhi")  # size, api key, api version, correlation id


class FaultProxy:
    """Forwards TCP to the broker; misbehaves on Produce requests as ``mode`` says:

    - "close": the first Produce closes the connection instead of being forwarded;
    - "hold": every Produce is swallowed (no answer ever comes);
    - "lose_answer": the first Produce is forwarded, its answer dropped and the
      connection closed (the broker did write the batch).
    """

    def __init__(self, port: int, target: int, mode: str) -> None:
        self.port = port
        self.target = target
        self.mode = mode
        self.faults = 0
        self._listen = socket.create_server(("127.0.0.1", port))
        self._listen.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ)
        self._peer: dict[socket.socket, socket.socket] = {}
        self._buf: dict[socket.socket, bytearray] = {}
        self._upstream: set[socket.socket] = set()
        self._doomed: dict[socket.socket, int] = {}  # broker side -> correlation id to drop
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._thread.join(10)
        for s in list(self._peer):
            s.close()
        self._listen.close()
        self._sel.close()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listen:
                    self._accept()
                elif sock in self._peer:
                    self._pump(sock)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError):
            client, _ = self._listen.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            for s in (client, upstream):
                s.setblocking(True)
                self._buf[s] = bytearray()
                self._sel.register(s, selectors.EVENT_READ)
            self._peer[client] = upstream
            self._peer[upstream] = client
            self._upstream.add(upstream)

    def _drop(self, sock: socket.socket) -> None:
        other = self._peer.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            self._peer.pop(s, None)
            self._doomed.pop(s, None)
            self._upstream.discard(s)
            s.close()

    def _pump(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        buf = self._buf[sock]
        buf += data
        while len(buf) >= 4:
            size = struct.unpack_from(">i", buf)[0]
            if len(buf) < 4 + size:
                break
            frame = bytes(buf[: 4 + size])
            del buf[: 4 + size]
            if not self._frame(sock, frame):
                return

    def _frame(self, sock: socket.socket, frame: bytes) -> bool:
        """Forwards or misbehaves; False when the connection was dropped."""
        peer = self._peer[sock]
        if sock in self._upstream:  # an answer from the broker
            corr = struct.unpack_from(">i", frame, 4)[0]
            if self._doomed.get(sock) == corr:
                self._drop(sock)
                return False
            peer.sendall(frame)
            return True
        _, api_key, _, corr = _HEAD.unpack_from(frame)
        if api_key == PRODUCE:
            if self.mode == "hold":
                self.faults += 1
                return True
            if self.mode == "close" and not self.faults:
                self.faults += 1
                self._drop(sock)
                return False
            if self.mode == "lose_answer" and not self.faults:
                self.faults += 1
                self._doomed[peer] = corr
        peer.sendall(frame)
        return True


@contextlib.contextmanager
def faulty(
    mode: str, **options: Any
) -> Iterator[tuple[EmbeddedBroker, FaultProxy, Owner, FakeWorker]]:
    proxy_port = free_port()
    with EmbeddedBroker(advertised_port=proxy_port) as broker:
        proxy = FaultProxy(proxy_port, broker.port, mode)
        options.setdefault("retry_backoff_ms", 20)
        options.setdefault("retry_backoff_max_ms", 100)
        owner = Owner(broker.bootstrap, **options)
        w: FakeWorker | None = None
        try:
            w = FakeWorker(owner, as_owner=True)
            assert w.expect(ipc.Ready).error == 0
            yield broker, proxy, owner, w
        finally:
            if w is not None:
                w.close()
            owner.close()
            proxy.close()


def _records_in_log(broker: EmbeddedBroker, topic: str) -> list[Any]:
    with BrokerConnection("127.0.0.1", broker.port) as conn:
        resp = conn.fetch({(topic, 0): 0})
    data = resp.responses[0].partitions[0].records
    return decode_batches(data or b"", allow_truncated_tail=True)


def test_lost_connection_is_retried(topic_name: str) -> None:
    with faulty("close") as (broker, proxy, owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        d = w.done(w.produce(base, values("r", 3)))
        assert (d.error, d.base_offset) == (0, 0), d
        assert proxy.faults == 1
        assert owner.stat(L.S_RETRIES) == 1
        shutdown(owner, w)
        got = consume_all(broker.bootstrap, topic_name, 1, 3, timeout_s=20)
        assert [r.value for r in got[0]] == values("r", 3)


def test_lost_answer_is_not_duplicated(topic_name: str) -> None:
    """The broker wrote the batch but the answer was lost: the retry carries the same
    sequence, the broker recognises it, and the log holds the records once."""
    with faulty("lose_answer") as (broker, proxy, owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        d = w.done(w.produce(base, values("once", 3)))
        # delivered; the broker recognised the resend (DUPLICATE_SEQUENCE_NUMBER) and
        # may not say at which offset (tansu answers -1): Done carries what it said
        assert d.error == 0 and d.base_offset in (-1, 0), d
        d2 = w.done(w.produce(base, values("then", 2)))
        assert d2.error == 0, d2
        assert proxy.faults == 1 and owner.stat(L.S_RETRIES) == 1
        shutdown(owner, w)
        batches = _records_in_log(broker, topic_name)
        assert [r.value for b in batches for r in b.records] == values("once", 3) + values(
            "then", 2
        )
        assert [b.base_sequence for b in batches] == [0, 3]


def opened_ago(w: FakeWorker, partition_slot: int, value: bytes, ago_s: float) -> ipc.Sealed:
    """A one-record batch whose DESCRIPTOR says the worker opened it ``ago_s`` ago, as
    a real worker records it; returns its Sealed message, not yet sent."""
    buf = w.alloc().buffers[0]
    length = w.write(buf, [value])
    opened = time.monotonic_ns() - int(ago_s * 1e9)
    L.U64.pack_into(w.view, w.geo.descriptor(buf) + L.D_CREATED_NS, opened)
    return w.sealed(buf, partition_slot, length, 1)[1]


def test_delivery_time_counts_from_when_the_worker_opened_the_batch(topic_name: str) -> None:
    """KIP-91: the deadline is the batch's creation + delivery_timeout_ms, not its arrival
    at the sender: a batch opened 5 s before it was sealed has 1 s left of 6."""
    options = {"request_timeout_ms": 300, "delivery_timeout_ms": 6_000, "linger_ms": 0}
    with faulty("hold", **options) as (broker, _proxy, _owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        msg = opened_ago(w, base, b"old", 5.0)
        started = time.monotonic()
        w.send(msg)
        d = w.done(msg.batch_id)
        elapsed = time.monotonic() - started
        assert d.error == DeliveryTimeoutError.code and d.retriable, d
        assert 0.9 < elapsed < 4, elapsed


def test_a_batch_in_flight_at_its_deadline_is_reported_then(topic_name: str) -> None:
    """KIP-91 as Java: the future fails at the delivery deadline even while the request
    is in flight (saying it may still be written), not when the request times out."""
    options = {"request_timeout_ms": 2_000, "delivery_timeout_ms": 2_500, "linger_ms": 0}
    with faulty("hold", **options) as (broker, _proxy, owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        msg = opened_ago(w, base, b"late", 2.2)  # 300 ms left
        started = time.monotonic()
        w.send(msg)
        d = w.done(msg.batch_id)
        elapsed = time.monotonic() - started
        assert d.error == DeliveryTimeoutError.code and d.retriable, d
        assert "may still be written" in d.message, d
        assert 0.2 < elapsed < 1.5, elapsed  # not the 2 s request timeout
        w.nothing(ipc.Done, within=2.5)  # the request's end reports nothing more
        assert owner.stat(L.S_BATCHES_FAILED) == 1
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers  # freed once it ended


def test_a_queued_batch_scribbled_over_fails_alone_without_idempotence(topic_name: str) -> None:
    """Bytes changed after the sender checked and queued a batch are caught right before
    its send (a recomputed CRC must not bless them), with idempotence off too."""
    options = {
        "request_timeout_ms": 300,
        "delivery_timeout_ms": 5_000,
        "linger_ms": 0,
        "enable_idempotence": False,
        "max_in_flight_requests_per_connection": 1,
    }
    with faulty("hold", **options) as (broker, _proxy, _owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        first_msg = opened_ago(w, base, b"held", 4.5)  # in flight, never answered: fails first
        held = first_msg.batch_id
        w.send(first_msg)
        buf = w.alloc().buffers[0]
        length = w.write(buf, values("queued", 2))
        bid, msg = w.sealed(buf, base, length, 2)
        w.send(msg)
        owner_at = w.geo.descriptor(buf) + L.D_OWNER
        deadline = time.monotonic() + WAIT
        while L.I32.unpack_from(w.view, owner_at)[0] != -1:  # the sender took it over
            assert time.monotonic() < deadline
            time.sleep(0.01)
        at = w.geo.buffer(buf) + length - 3
        w.view[at] ^= 0xFF  # a buggy process, after the check at hand-over
        d = w.done(bid)
        assert d.error == CorruptBatchError.code and "changed after sealing" in d.message, d
        assert w.done(held).error == DeliveryTimeoutError.code


def test_unanswered_request_times_out_then_delivery_times_out(topic_name: str) -> None:
    options = {"request_timeout_ms": 300, "delivery_timeout_ms": 700, "linger_ms": 0}
    with faulty("hold", **options) as (broker, proxy, owner, w):
        broker.create_topic(topic_name, 1)
        base, _ = w.topic(topic_name)
        started = time.monotonic()
        w.produce(base, values("late", 1))
        d = w.expect(ipc.Done, timeout=WAIT)
        elapsed = time.monotonic() - started
        assert d.error == DeliveryTimeoutError.code and d.retriable, d
        assert "REQUEST_TIMED_OUT" in d.message
        assert 0.6 < elapsed < 5, elapsed
        assert proxy.faults >= 2  # sent, timed out, resent
        # a batch reported while in flight ends (counted, freed) when its request does
        deadline = time.monotonic() + WAIT
        while owner.stat(L.S_BATCHES_FAILED) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert owner.stat(L.S_BATCHES_FAILED) == 1
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers
