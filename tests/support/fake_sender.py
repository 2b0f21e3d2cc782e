"""A small fake sender for the worker tests (its own tests: test_worker_fakesender.py).

:class:`FakeSender` owns a real segment and a listening UNIX socket and speaks
``shmprod.ipc`` in a background thread: it grants buffers (FIFO, runs first-fit),
answers ``TopicRequest`` from a fixed table it writes into the TOPIC slots, and on
``Sealed`` validates and decodes the batch from shared memory, then answers ``Done``
with made-up base offsets (a counter per partition). Tests can hold Done answers or
Grants (a busy sender), push a partition count change, send ``Fatal``, or "die" (close
every socket).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import selectors
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import ProducerClosedError, RecordTooLargeError
from shmprod.handle import Handle
from shmprod.protocol import records as R
from shmprod.shm import Segment


@dataclass
class Landed:
    """One batch the fake received: where it went and what it held."""

    topic: str
    partition: int
    batch_id: int
    worker_slot: int
    base_offset: int
    header: R.BatchHeader
    records: list[R.Record]
    length: int
    run: int
    buffer: int = -1  # the first buffer of its run


@dataclass
class _Conn:
    sock: socket.socket
    reader: ipc.MessageReader = field(default_factory=ipc.MessageReader)
    out: bytearray = field(default_factory=bytearray)
    slot: int = -1
    owner: bool = False
    bye: bool = False
    granted: set[int] = field(default_factory=set)  # first buffers of runs granted
    runs: dict[int, int] = field(default_factory=dict)


class FakeSender:
    """See the module docstring. Use as a context manager; always cleans up."""

    def __init__(
        self,
        *,
        topics: dict[str, int] | None = None,
        topic_errors: dict[str, int] | None = None,
        batch_size: int = 4096,
        buffer_memory: int = 64 * 1024,
        decode: bool = True,
        hold_done: bool = False,
        log_append_time: int = -1,
        done_error: int = 0,
        **config: Any,
    ) -> None:
        cfg = ProducerConfig(
            bootstrap_servers="127.0.0.1:9",
            batch_size=batch_size,
            buffer_memory=buffer_memory,
            **config,
        )
        self.config = cfg
        self.geo = L.Geometry.for_pool(buffer_memory, batch_size)
        self.geo = L.Geometry(
            self.geo.n_buffers, self.geo.buffer_size, max_workers=8, max_topics=8, max_partitions=64
        )
        self.seg = Segment.create(self.geo.segment_size, pretouch=False)
        self.view = self.seg.view
        L.write_header(self.view, self.geo, os.getpid(), 0)
        L.U32.pack_into(self.view, L.H_STATE, L.STATE_RUNNING)
        self.tmpdir = tempfile.mkdtemp(prefix="shmprod-fake-")
        self.path = os.path.join(self.tmpdir, "ctl.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.secret = os.urandom(ipc.SECRET_SIZE)
        self.handle = Handle(self.seg.name, self.path, self.secret, os.getpid(), cfg.to_wire())
        self.topics = dict(topics if topics is not None else {"events": 4})
        self.topic_errors = dict(topic_errors or {})
        self.decode = decode
        self.hold_done = hold_done
        self.hold_grants = False  # Alloc requests queue unanswered while set
        self.log_append_time = log_append_time
        self.done_error = done_error
        self.lock = threading.Lock()
        self.landed: list[Landed] = []
        self.corrupt: list[str] = []
        self.allocs: list[ipc.Alloc] = []
        self.releases: list[ipc.Release] = []
        self.held: list[tuple[_Conn, ipc.Done, int, int]] = []
        self.topic_requests: list[str] = []
        self.free = set(range(self.geo.n_buffers))
        self.waiting: collections.deque[tuple[_Conn, ipc.Alloc]] = collections.deque()
        self.offsets: dict[int, int] = collections.defaultdict(int)
        self.slots: dict[str, tuple[int, int, int]] = {}  # name -> (topic slot, n, base)
        self.homes: dict[str, list[int]] = {}  # name -> home slot per partition
        self.next_base = 0
        self.conns: dict[int, _Conn] = {}
        self.byes = 0
        self.deaths = 0
        self.reclaimed = 0
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._dead = False
        self._publish()
        self._thread = threading.Thread(target=self._run, name="fake-sender", daemon=True)
        self._thread.start()

    # --- test controls (thread-safe) ------------------------------------------------

    def call(self, fn: Callable[[], None], timeout: float = 5.0) -> None:
        """Runs ``fn`` in the fake's thread and waits for it."""
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._calls.append(run)
        self._wake_w.send(b"\0")
        assert done.wait(timeout), "fake sender did not run the call"

    def die(self) -> None:
        """Closes every socket at once, like a killed sender."""

        def kill() -> None:
            for c in list(self.conns.values()):
                self._drop(c)
            self._dead = True

        self.call(kill)

    def fatal(self, code: int, message: str = "") -> None:
        def send() -> None:
            for c in list(self.conns.values()):
                self._queue(c, ipc.Fatal(code, message))
                self._flush_out(c)
                self._drop(c)

        self.call(send)

    def release_held(self) -> None:
        self.call(self._release_held)

    def release_grants(self) -> None:
        """Stops holding Grants and answers the Alloc requests queued meanwhile."""

        def serve() -> None:
            self.hold_grants = False
            self._serve()
            for c in list(self.conns.values()):
                self._flush_out(c)

        self.call(serve)

    def set_partitions(self, topic: str, n: int) -> None:
        """A partition count change: new range, epoch bumped, TopicInfo pushed."""

        def change() -> None:
            self.topics[topic] = n
            tslot, _, _ = self.slots[topic]
            self._write_topic(topic, tslot, n)
            for c in list(self.conns.values()):
                self._queue(c, ipc.TopicInfo(0, tslot, n, 0, topic))
                self._flush_out(c)

        self.call(change)

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred():
                    return True
            time.sleep(0.002)
        with self.lock:
            return pred()

    def records(self, topic: str | None = None) -> dict[int, list[R.Record]]:
        """Records received per partition, in the order batches arrived."""
        out: dict[int, list[R.Record]] = collections.defaultdict(list)
        with self.lock:
            for b in self.landed:
                if topic is None or b.topic == topic:
                    out[b.partition].extend(b.records)
        return dict(out)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(5)
        for c in list(self.conns.values()):
            with contextlib.suppress(OSError):
                c.sock.close()
        self._sel.close()
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.tmpdir)
        with contextlib.suppress(BufferError):
            self.seg.close()
        self.seg.unlink()

    def __enter__(self) -> FakeSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.2):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    while self._calls:
                        self._calls.popleft()()
                else:
                    self._read(key.data)
            self._publish()

    def _publish(self) -> None:
        """The STATS a worker reads to size its lease, as the real sender keeps them."""
        stats = self.geo.stats
        L.U64.pack_into(self.view, stats + L.S_BUFFERS_FREE, len(self.free))
        L.U64.pack_into(self.view, stats + L.S_WORKERS_ATTACHED, len(self.conns))

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if self._dead:
            sock.close()
            return
        sock.setblocking(False)
        c = _Conn(sock)
        self.conns[sock.fileno()] = c
        self._sel.register(sock, selectors.EVENT_READ, c)

    def _drop(self, c: _Conn) -> None:
        if self.conns.pop(c.sock.fileno(), None) is None:
            return
        self._sel.unregister(c.sock)
        c.sock.close()

    def _queue(self, c: _Conn, msg: ipc.Message) -> None:
        c.out += ipc.encode(msg)

    def _flush_out(self, c: _Conn) -> None:
        while c.out:
            try:
                n = c.sock.send(c.out)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:
                c.out.clear()
                return
            del c.out[:n]

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._eof(c)
            return
        for msg in c.reader.feed(data):
            self._on(c, msg)
            if c.sock.fileno() < 0:
                return
        self._serve()
        for other in list(self.conns.values()):
            self._flush_out(other)

    def _eof(self, c: _Conn) -> None:
        if not c.bye:
            self.deaths += 1
            for first in list(c.granted):
                self._free(first, c.runs.get(first, 1))
                self.reclaimed += 1
        else:
            for first in list(c.granted):
                self._free(first, c.runs.get(first, 1))
        self._drop(c)
        self._serve()

    def _on(self, c: _Conn, msg: ipc.Message) -> None:
        if c.slot < 0:
            if not isinstance(msg, ipc.Hello) or not hmac.compare_digest(msg.secret, self.secret):
                self._drop(c)
                return
            used = {o.slot for o in self.conns.values()}
            c.slot = min(set(range(self.geo.max_workers)) - used)
            c.owner = msg.owner
            base = self.geo.worker(c.slot)
            L.U32.pack_into(self.view, base + L.W_STATE, L.WORKER_ACTIVE)
            L.U64.pack_into(self.view, base + L.W_PID, msg.pid)
            self._queue(c, ipc.Welcome(c.slot))
            if c.owner:
                self._queue(c, ipc.Ready(0))
            return
        if isinstance(msg, ipc.Alloc):
            with self.lock:
                self.allocs.append(msg)
            if msg.run > self.geo.n_buffers:
                self._queue(c, ipc.Grant(msg.request_id, msg.run, RecordTooLargeError.code))
            else:
                self.waiting.append((c, msg))
        elif isinstance(msg, ipc.Sealed):
            self._sealed(c, msg)
        elif isinstance(msg, ipc.Release):
            with self.lock:
                self.releases.append(msg)
            for b in msg.buffers:
                self._hand_back(c, b, msg.run)
                self._free(b, msg.run)
        elif isinstance(msg, ipc.TopicRequest):
            self._topic(c, msg)
        elif isinstance(msg, ipc.Bye):
            c.bye = True
            self.byes += 1
        elif isinstance(msg, ipc.Shutdown):
            self._release_held()
            for o in list(self.conns.values()):
                self._queue(o, ipc.Fatal(ProducerClosedError.code, "closing"))
                self._flush_out(o)
                self._drop(o)

    def _free(self, first: int, run: int) -> None:
        for b in range(first, first + run):
            L.U32.pack_into(self.view, self.geo.descriptor(b) + L.D_STATE, L.BUF_FREE)
            self.free.add(b)

    def _take_run(self, run: int) -> int | None:
        for first in range(self.geo.n_buffers - run + 1):
            if all(b in self.free for b in range(first, first + run)):
                for b in range(first, first + run):
                    self.free.discard(b)
                    L.U32.pack_into(self.view, self.geo.descriptor(b) + L.D_STATE, L.BUF_GRANTED)
                return first
        return None

    def _serve(self) -> None:
        while self.waiting and not self.hold_grants:
            c, a = self.waiting[0]
            if c.sock.fileno() < 0:
                self.waiting.popleft()
                continue
            if len(self.free) < a.run * a.count:
                return
            got: list[int] = []
            for _ in range(a.count):
                first = self._take_run(a.run)
                if first is None:
                    for f in got:
                        self._free(f, a.run)
                    return
                got.append(first)
            self.waiting.popleft()
            for f in got:
                c.granted.add(f)
                c.runs[f] = a.run
            self._queue(c, ipc.Grant(a.request_id, a.run, 0, tuple(got)))

    def _write_topic(self, name: str, tslot: int, n: int) -> None:
        base = self.next_base
        self.next_base += n
        homes = self.homes.setdefault(name, [])
        for i in range(n):  # a partition keeps its first slot as its home (growth)
            if i == len(homes):
                homes.append(base + i)
            L.U32.pack_into(self.view, self.geo.partition(base + i) + L.P_HOME, homes[i])
        off = self.geo.topic(tslot)
        raw = name.encode()
        epoch = L.U64.unpack_from(self.view, L.H_METADATA_EPOCH)[0]
        L.U64.pack_into(self.view, L.H_METADATA_EPOCH, epoch + 1)  # odd: writing (seqlock)
        L.U32.pack_into(self.view, off + L.T_N_PARTITIONS, n)
        L.U32.pack_into(self.view, off + L.T_PARTITION_BASE, base)
        L.I32.pack_into(self.view, off + L.T_ERROR, 0)
        L.U16.pack_into(self.view, off + L.T_NAME_LEN, len(raw))
        self.view[off + L.T_NAME : off + L.T_NAME + len(raw)] = raw
        L.U32.pack_into(self.view, off + L.T_STATE, L.TOPIC_READY)
        L.U64.pack_into(self.view, L.H_METADATA_EPOCH, epoch + 2)  # even: written
        self.slots[name] = (tslot, n, base)

    def _topic(self, c: _Conn, msg: ipc.TopicRequest) -> None:
        with self.lock:
            self.topic_requests.append(msg.name)
        if msg.name in self.topic_errors:
            self._queue(
                c, ipc.TopicInfo(msg.request_id, -1, 0, self.topic_errors[msg.name], msg.name)
            )
            return
        if msg.name not in self.topics:
            return  # stays unknown: the worker times out
        if msg.name not in self.slots:
            self._write_topic(msg.name, len(self.slots), self.topics[msg.name])
        tslot, n, _ = self.slots[msg.name]
        self._queue(c, ipc.TopicInfo(msg.request_id, tslot, n, 0, msg.name))

    def _where(self, pslot: int) -> tuple[str, int]:
        for name, homes in self.homes.items():
            if pslot in homes:
                return name, homes.index(pslot)
        return "?", pslot

    @staticmethod
    def _hand_back(c: _Conn, first: int, run: int) -> None:
        """``first``'s run leaves the worker; the head of a longer granted run leaves
        the rest granted as single buffers (as the real sender's pool does)."""
        c.granted.discard(first)
        granted = c.runs.pop(first, run)
        for b in range(first + run, first + granted):
            c.granted.add(b)
            c.runs[b] = 1

    def _sealed(self, c: _Conn, msg: ipc.Sealed) -> None:
        self._hand_back(c, msg.buffer, msg.run)
        off = self.geo.buffer(msg.buffer)
        state = L.U32.unpack_from(self.view, self.geo.descriptor(msg.buffer) + L.D_STATE)[0]
        topic, partition = self._where(msg.partition_slot)
        try:
            assert state == L.BUF_SEALED, f"descriptor state {state}"
            hdr = R.validate_batch(self.view, off, msg.length)
            assert hdr.record_count == msg.record_count
            recs: list[R.Record] = []
            if self.decode:
                (batch,) = R.decode_batches(bytes(self.view[off : off + msg.length]))
                recs = batch.records
        except Exception as exc:
            with self.lock:
                self.corrupt.append(f"{type(exc).__name__}: {exc}")
            self._queue(c, ipc.Done(msg.batch_id, -1011, -1, -1, False, str(exc)))
            self._free(msg.buffer, msg.run)
            return
        base = self.offsets[msg.partition_slot]
        self.offsets[msg.partition_slot] += msg.record_count
        with self.lock:
            self.landed.append(
                Landed(
                    topic,
                    partition,
                    msg.batch_id,
                    c.slot,
                    base,
                    hdr,
                    recs,
                    msg.length,
                    msg.run,
                    msg.buffer,
                )
            )
        if self.done_error:
            done = ipc.Done(msg.batch_id, self.done_error, -1, -1, False, "made-up failure")
        else:
            done = ipc.Done(msg.batch_id, 0, base, self.log_append_time, False)
        if self.hold_done:
            self.held.append((c, done, msg.buffer, msg.run))
        else:
            self._queue(c, done)
            self._free(msg.buffer, msg.run)

    def _release_held(self) -> None:
        held, self.held = self.held, []
        for c, done, buf, run in held:
            if c.sock.fileno() >= 0:
                self._queue(c, done)
                self._flush_out(c)
            self._free(buf, run)
        self._serve()
        for o in list(self.conns.values()):
            self._flush_out(o)
