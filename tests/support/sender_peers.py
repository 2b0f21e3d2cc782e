"""The peers of a sender in tests: what ``Producer(...)`` does around it (:class:`Owner`:
segment, control socket, spawn) and a worker reduced to the protocol
(:class:`FakeWorker`: Hello, Alloc, write into granted buffers, Sealed, wait for Done),
speaking shmprod.ipc over the socket and writing batches with
protocol.records.encode_batch_into."""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from shmprod import ipc
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.config import ProducerConfig
from shmprod.errors import ProducerClosedError
from shmprod.handle import SenderSpec
from shmprod.ipc import process_start_us
from shmprod.producer import spawn_sender
from shmprod.protocol.records import NewRecord, encode_batch_into
from shmprod.sender import lifecycle
from shmprod.shm import Segment
from tests.support.kafka_proxy import KafkaProxy

M = TypeVar("M", bound=ipc.Message)
# the sender tests' producer: a small pool and small batches, nothing lingers
SMALL: dict[str, Any] = {
    "buffer_memory": 64 * 1024,
    "batch_size": 1024,
    "linger_ms": 0,
    "request_timeout_ms": 5_000,
}
WAIT = 20.0  # upper bound of any single wait in these tests


@dataclass
class Endpoint:
    """What a worker needs to attach: the segment's view and the control socket."""

    geo: L.Geometry
    view: memoryview
    socket_path: str
    secret: bytes
    start_us: int = 0


class SenderHome:
    """What a sender is given by its owner: the segment (header written), the control
    socket listening in a private directory, the secret, and the spec naming them."""

    def __init__(self, cfg: ProducerConfig) -> None:
        self.cfg = cfg
        self.geo = L.Geometry.for_pool(cfg.buffer_memory, cfg.batch_size)
        self.segment = Segment.create(self.geo.segment_size)
        self.view = self.segment.view
        self.start_us = process_start_us()
        L.write_header(self.view, self.geo, os.getpid(), self.start_us)
        self.dir = tempfile.mkdtemp(prefix="shmprod-test-")
        self.socket_path = os.path.join(self.dir, "ctl.sock")
        self.listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listen.bind(self.socket_path)
        self.listen.listen(64)
        self.secret = secrets.token_bytes(ipc.SECRET_SIZE)
        self.spec = SenderSpec(
            segment=self.segment.name,
            socket_path=self.socket_path,
            secret_hex=self.secret.hex(),
            owner_pid=os.getpid(),
            owner_start_us=self.start_us,
            listen_fd=self.listen.fileno(),
            config=cfg.to_wire(),
        )

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.geo, self.view, self.socket_path, self.secret, self.start_us)

    def stat(self, field: int) -> int:
        return int(L.U64.unpack_from(self.view, self.geo.stats + field)[0])

    def remove(self) -> None:
        """Unmaps and unlinks the segment, removes the socket's directory."""
        self.view = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.segment.close()
        self.segment.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)


class Owner(SenderHome):
    """What Producer(...) does before and around the sender: segment, socket, spawn."""

    def __init__(self, bootstrap: str, **options: Any) -> None:
        options = {**SMALL, "max_block_ms": 10_000, "delivery_timeout_ms": 15_000, **options}
        super().__init__(ProducerConfig(bootstrap_servers=bootstrap, **options))
        try:
            self.proc = spawn_sender(self.spec)
        finally:
            self.listen.close()

    def wait_exit(self, timeout: float = WAIT) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.remove()


class FakeWorker:
    """A worker reduced to the protocol: Hello, Alloc, write, Sealed, wait for Done."""

    def __init__(
        self,
        owner: Owner | Endpoint,
        *,
        as_owner: bool = False,
        secret: bytes | None = None,
        pid: int | None = None,
    ) -> None:
        self.geo = owner.geo
        self.view = owner.view
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(owner.socket_path)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.reader = ipc.MessageReader()
        self.stash: list[ipc.Message] = []
        self.eof = False
        self._ids = iter(range(1, 1 << 30))
        self.send(ipc.Hello(secret or owner.secret, pid or os.getpid(), owner.start_us, as_owner))
        self.slot = -1
        if secret is None:
            self.slot = self.expect(ipc.Welcome).worker_slot

    def send(self, *msgs: ipc.Message) -> None:
        self.sock.sendall(b"".join(ipc.encode(m) for m in msgs))

    def _read(self, timeout: float) -> bool:
        """Reads what arrives within ``timeout`` seconds into the stash; False if none."""
        if self.eof or not self.sel.select(timeout):
            return False
        data = self.sock.recv(1 << 20)
        if not data:
            self.eof = True
            return False
        self.stash.extend(self.reader.feed(data))
        return True

    def _pump(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        return remaining > 0 and self._read(remaining)

    def _take(self, cls: type[M], pred: Callable[[M], bool]) -> M | None:
        """The first stashed message of ``cls`` matching ``pred``, taken out."""
        for i, msg in enumerate(self.stash):
            if isinstance(msg, cls) and pred(msg):
                del self.stash[i]
                return msg
        return None

    def expect(
        self, cls: type[M], pred: Callable[[M], bool] = lambda m: True, timeout: float = WAIT
    ) -> M:
        deadline = time.monotonic() + timeout
        while True:
            found = self._take(cls, pred)
            if found is not None:
                return found
            if not self._pump(deadline) and (self.eof or time.monotonic() >= deadline):
                raise AssertionError(f"no {cls.__name__} (eof={self.eof}); got {self.stash!r}")

    def nothing(self, cls: type[ipc.Message], within: float) -> None:
        deadline = time.monotonic() + within
        while self._pump(deadline):
            pass
        assert not any(isinstance(m, cls) for m in self.stash), self.stash

    def topic(self, name: str) -> tuple[int, int]:
        """(first partition slot, partitions) of ``name``."""
        rid = next(self._ids)
        self.send(ipc.TopicRequest(rid, name))
        info = self.expect(ipc.TopicInfo, lambda m: m.request_id == rid)
        assert info.error == 0, info
        base = L.U32.unpack_from(self.view, self.geo.topic(info.topic_slot) + L.T_PARTITION_BASE)[0]
        return int(base), info.partitions

    def alloc(self, run: int = 1, count: int = 1) -> ipc.Grant:
        rid = next(self._ids)
        self.send(ipc.Alloc(rid, run, count))
        return self.expect(ipc.Grant, lambda m: m.request_id == rid)

    def write(self, buffer: int, values: list[bytes], key: bytes | None = None) -> int:
        off = self.geo.buffer(buffer)
        end = encode_batch_into(
            self.view,
            off,
            [NewRecord(key, v) for v in values],
            base_timestamp_ms=int(time.time() * 1000),
        )
        return end - off

    def sealed(
        self, buffer: int, partition_slot: int, length: int, count: int, run: int = 1
    ) -> tuple[int, ipc.Sealed]:
        bid = next(self._ids)
        return bid, ipc.Sealed(buffer, run, partition_slot, bid, length, count)

    def produce(self, partition_slot: int, values: list[bytes]) -> int:
        """Alloc, write, seal one batch; returns its batch id (Done comes later)."""
        grant = self.alloc()
        assert grant.error == 0, grant
        buf = grant.buffers[0]
        length = self.write(buf, values)
        bid, msg = self.sealed(buf, partition_slot, length, len(values))
        self.send(msg)
        return bid

    def done(self, batch_id: int) -> ipc.Done:
        return self.expect(ipc.Done, lambda m: m.batch_id == batch_id)

    def close(self) -> None:
        self.sel.close()
        self.sock.close()


@contextlib.contextmanager
def running(
    broker: EmbeddedBroker | KafkaProxy, **options: Any
) -> Iterator[tuple[Owner, FakeWorker]]:
    """A sender (for the broker, or the proxy in front of it) and its owner, ready."""
    owner = Owner(broker.bootstrap, **options)
    worker: FakeWorker | None = None
    try:
        worker = FakeWorker(owner, as_owner=True)
        ready = worker.expect(ipc.Ready)
        assert ready.error == 0, ready
        yield owner, worker
    finally:
        if worker is not None:
            worker.close()
        owner.close()


def shutdown(owner: Owner, worker: FakeWorker, timeout_ms: int = 5000) -> None:
    worker.send(ipc.Shutdown(timeout_ms))
    fatal = worker.expect(ipc.Fatal)
    assert fatal.error == ProducerClosedError.code
    assert owner.wait_exit() == lifecycle.EXIT_OK


def values(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]
