"""The Worker: one attachment of one process to the shared producer.

``attach(handle)`` maps the segment, connects to the sender's control socket, says
``Hello`` (secret, pid, process start time, owner flag) and gets ``Welcome`` (its WORKER
slot). From then on:

* user threads call :meth:`Worker.send` / :meth:`Worker.send_batch`: records are checked,
  partitioned and encoded straight into this worker's granted pool buffers (see
  :mod:`.append` and :mod:`.bulk`); a sealed batch costs one ``Sealed`` message;
* one background I/O thread per Worker selects on the control socket and a wake-up
  socketpair, with a timeout equal to the next linger deadline: it seals batches whose
  linger expired, receives ``Grant`` / ``TopicInfo`` / ``Done`` / ``Fatal`` / ``Ready``,
  resolves futures (their callbacks run in this thread), and on EOF (the sender died)
  fails every pending future with :class:`SenderDiedError` at once.

Buffers: the sender owns every free buffer. A thread that needs one takes it from this
worker's small stock or asks with ``Alloc(request_id, run, count)`` and waits for the
``Grant`` on a Condition, at most ``max_block_ms`` (then :class:`BufferExhaustedError`;
a Grant that arrives later goes to the stock, or back with ``Release`` for runs). When a
batch fills, one buffer is requested ahead (prefetch) so the next batch rarely waits;
the stock is given back after ``_IDLE_RELEASE_NS`` without a new batch, and on flush
and close.

Ordering: one process-local lock guards the worker state; records are appended and
``Sealed`` messages sent while holding it, so batches of one partition reach the sender
in the order this process appended them. Waiting (grants, topics, flush) releases the
lock through a Condition with a timeout; no wait is unbounded. Callbacks never run
under the lock.

Fork safety: a Worker belongs to the process that attached. In a forked child every
method raises :class:`ShmprodError` asking to call ``attach(handle)`` there (an
``os.register_at_fork`` hook marks inherited Workers, so the hot path pays nothing).

Runs in: worker. Shared memory is touched only on buffers this worker was granted and
its own WORKER slot (single writer each, no cross-process lock); the TOPIC, STATS and
PARTITION regions are only read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final

import psutil

from shmprod import ipc
from shmprod import layout as L
from shmprod.errors import (
    BufferExhaustedError,
    EncodeError,
    FlushTimeoutError,
    InvalidRecordError,
    ProducerClosedError,
    ProducerError,
    RecordTooLargeError,
    SenderDiedError,
    ShmprodError,
    error_from_code,
)
from shmprod.futures import BatchFuture, BatchOutcome, RecordFuture
from shmprod.handle import Handle
from shmprod.partitioner import (
    NO_PARTITION,
    Murmur2Partitioner,
    PartitionerError,
    default_random_source,
    get_partitioner,
)
from shmprod.protocol.records import HEADER_SIZE, encode_record_into, record_size
from shmprod.shm import Segment
from shmprod.worker import append as A
from shmprod.worker import shmstats
from shmprod.worker.inputs import (
    NO_HEADERS,
    as_bytes,
    check_partition,
    check_timestamp,
    encoded_headers,
    serialize,
)
from shmprod.worker.topics import TopicEntry, TopicTable, validate_topic

__all__ = ["Worker", "attach"]

log = logging.getLogger(__name__)

_OPEN: Final = 0
_CLOSING: Final = 1
_CLOSED: Final = 2
_FORKED: Final = 3

# Largest varint overhead of one record besides key, value and headers: length (5),
# attributes (1), timestampDelta (10), offsetDelta (5), keyLength (5), valueLength (5).
_RECORD_OVERHEAD_MAX: Final = 31
_IDLE_RELEASE_NS: Final = 200_000_000  # give spare buffers back after 200 ms without a batch
_IO_MAX_SLEEP: Final = 1.0
_HANDSHAKE_MIN_S: Final = 5.0
_FLUSH_MARGIN_S: Final = 10.0  # flush(None) gives up this long after delivery_timeout_ms
_RECV_SIZE: Final = 1 << 16

_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def _mark_forked() -> None:
    """In a forked child: every inherited Worker refuses further use (no locks touched)."""
    for w in list(_LIVE):
        w._state = _FORKED


os.register_at_fork(after_in_child=_mark_forked)

_start_us_cache: dict[int, int] = {}


def process_start_us(pid: int | None = None) -> int:
    """A process's start time in microseconds since the epoch (identifies it with its pid)."""
    pid = os.getpid() if pid is None else pid
    cached = _start_us_cache.get(pid)
    if cached is None:
        cached = int(psutil.Process(pid).create_time() * 1_000_000)
        _start_us_cache[pid] = cached
    return cached


def attach(handle: Handle, *, owner: bool = False) -> Worker:
    """Attaches this process to the producer described by ``handle``.

    Call it in every process that sends (after fork, spawn, forkserver, ``multiprocess``).
    ``owner=True`` is for the process that created the producer.
    """
    return Worker(handle, owner=owner)


class _Request:
    """An ``Alloc`` a thread is waiting for."""

    __slots__ = ("buffers", "count", "error", "run")

    def __init__(self, run: int, count: int) -> None:
        self.run = run
        self.count = count
        self.buffers: list[int] = []
        self.error = 0


class Worker:
    """This process's handle on the shared producer (see the module docstring)."""

    def __init__(self, handle: Handle, *, owner: bool = False) -> None:
        self._pid = os.getpid()
        self._state = _CLOSED  # until attached
        self._owner = owner
        cfg = handle.producer_config()
        self._config = cfg
        self._key_ser = cfg.key_serializer
        self._value_ser = cfg.value_serializer
        self._partitioner = get_partitioner(cfg.partitioner)
        self._murmur = isinstance(self._partitioner, Murmur2Partitioner)
        self._codec = cfg.compression_codec
        self._level = cfg.compression_level
        self._batch_size = cfg.batch_size
        self._records_room = cfg.batch_size - HEADER_SIZE
        self._linger_ns = int(cfg.linger_ms * 1_000_000)
        self._max_block_ms = cfg.max_block_ms
        self._max_block_ns = cfg.max_block_ms * 1_000_000
        self._max_request_size = cfg.max_request_size

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._done_lock = threading.Lock()
        self._open: dict[int, A.OpenBatch] = {}
        self._inflight: dict[int, tuple[BatchOutcome, int]] = {}
        self._stock: list[int] = []
        self._requests: dict[int, _Request] = {}
        self._prefetch_rid = 0
        self._request_ids = itertools.count(1)
        self._next_batch_id = 1
        self._fatal: tuple[int, str] | None = None
        self._ready: ipc.Ready | None = None
        self._flush_waiters = 0
        self._io_deadline_ns = 0
        self._last_open_ns = time.monotonic_ns()
        self._stop = False
        self._scratch = bytearray()
        self._reader = ipc.MessageReader()
        self._early: list[ipc.Message] = []
        self._deferred: list[ipc.Message] = []  # received, not yet applied (I/O thread)
        self._eof = False
        self._eof_message = "the sender closed the control connection (it died or exited)"
        # this worker's counters (mirrored into its WORKER slot per batch)
        self._records_appended = 0
        self._bytes_appended = 0
        self._batches_sealed = 0
        self._send_errors = 0
        self._records_acked = 0
        self._records_failed = 0

        self._seg = Segment.attach(handle.segment)
        try:
            self._view = self._seg.view
            self._geo = L.read_geometry(self._view)
            state = L.U32.unpack_from(self._view, L.H_STATE)[0]
            if state in (L.STATE_CLOSED, L.STATE_FAILED):
                raise ProducerClosedError("the producer is closed (its segment says so)")
            self._sock = self._connect(handle, owner)
        except BaseException:
            self._seg.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._rand = default_random_source()
        self._topics = TopicTable(self._view, self._geo, cfg.batch_size, self._rand)
        base = self._geo.worker(self._slot)
        for _, off in shmstats.WORKER_FIELDS:
            L.U64.pack_into(self._view, base + off, 0)
        self._state = _OPEN
        _LIVE.add(self)
        self._thread = threading.Thread(
            target=self._io_main, name=f"shmprod-worker-io-{self._slot}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------
    # attaching
    # ------------------------------------------------------------------------------

    def _connect(self, handle: Handle, owner: bool) -> socket.socket:
        """Connects, says Hello, and waits for Welcome. Runs in: worker, at attach."""
        timeout = max(self._max_block_ms / 1000.0, _HANDSHAKE_MIN_S)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            try:
                sock.connect(handle.socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise ProducerClosedError(
                    f"cannot reach the producer's control socket ({exc.strerror}): "
                    "the producer was closed or its owner died"
                ) from None
            hello = ipc.Hello(handle.secret, self._pid, process_start_us(self._pid), owner)
            sock.sendall(ipc.encode(hello))
            deadline = time.monotonic() + timeout
            while True:
                if time.monotonic() > deadline:
                    raise SenderDiedError(f"no Welcome from the sender within {timeout:.0f} s")
                try:
                    data = sock.recv(_RECV_SIZE)
                except TimeoutError:
                    continue
                if not data:
                    raise SenderDiedError(
                        "the sender closed the control connection at attach "
                        "(wrong secret, or the producer is closing)"
                    )
                msgs = self._reader.feed(data)
                for i, msg in enumerate(msgs):
                    if isinstance(msg, ipc.Welcome):
                        if not 0 <= msg.worker_slot < self._geo.max_workers:
                            raise ShmprodError(f"Welcome with bad worker slot {msg.worker_slot}")
                        self._slot = msg.worker_slot
                        self._early = msgs[i + 1 :]
                        sock.settimeout(timeout)
                        return sock
                    if isinstance(msg, ipc.Fatal):
                        raise error_from_code(msg.error, msg.message)
                    if isinstance(msg, ipc.Ready):
                        self._ready = msg
        except BaseException:
            sock.close()
            raise

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Worker cannot be pickled: pass the producer's Handle and call "
            "shmprod.worker.attach(handle) in the other process"
        )

    def __repr__(self) -> str:
        state = ("open", "closing", "closed", "forked")[self._state]
        return f"<Worker pid={self._pid} slot={getattr(self, '_slot', None)} {state}>"

    @property
    def worker_slot(self) -> int:
        return self._slot

    @property
    def geometry(self) -> L.Geometry:
        return self._geo

    # ------------------------------------------------------------------------------
    # state checks
    # ------------------------------------------------------------------------------

    def _refuse(self) -> None:
        """Raises why this Worker cannot send (called when ``_state`` or ``_fatal`` is set)."""
        if self._state == _FORKED:
            raise ShmprodError(
                f"this Worker was attached in process {self._pid}, not in this one "
                f"({os.getpid()}): call shmprod.worker.attach(handle) in this process"
            )
        if self._fatal is not None:
            raise error_from_code(*self._fatal)
        raise ProducerClosedError("send after close: this Worker is closed or closing")

    def _check_alive(self) -> None:
        """Raises the fatal error once the producer failed or closed. Lock held or not."""
        if self._fatal is not None or self._state in (_CLOSED, _FORKED):
            self._refuse()

    def _check_process(self) -> None:
        if self._state == _FORKED:
            self._refuse()

    # ------------------------------------------------------------------------------
    # send
    # ------------------------------------------------------------------------------

    def send(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        headers: Any = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> RecordFuture:
        """Appends one record to this process's open batch for its partition.

        ``value``/``key``: bytes-like or None (or anything the configured serializers
        take). ``headers``: list of (str, bytes | None) pairs or a dict. ``partition``:
        explicit, else murmur2 of the key, else sticky. ``timestamp_ms``: None = now.
        Blocks only for a free buffer or a topic's metadata, at most ``max_block_ms``.
        Raises a typed error at the call, with nothing written, for bad input.
        """
        if self._state or self._fatal is not None:
            self._refuse()
        try:
            if self._key_ser is None:
                kb = key if key is None or type(key) is bytes else as_bytes(key, "key")
            else:
                kb = serialize(self._key_ser, key, "key")
            if self._value_ser is None:
                vb = value if value is None or type(value) is bytes else as_bytes(value, "value")
            else:
                vb = serialize(self._value_ser, value, "value")
            hdrs = NO_HEADERS if headers is None else encoded_headers(headers)
            ts = (
                time.time_ns() // 1_000_000
                if timestamp_ms is None
                else check_timestamp(timestamp_ms)
            )
            if type(topic) is not str:
                validate_topic(topic)
            bound = (
                (0 if kb is None else len(kb))
                + (0 if vb is None else len(vb))
                + len(hdrs)
                + _RECORD_OVERHEAD_MAX
            )
            run = 0
            if bound > self._records_room:
                run = self._large_run(record_size(0, 0, kb, vb, hdrs))
            with self._lock:
                return self._append_locked(topic, kb, vb, hdrs, ts, partition, bound, run)
        except ShmprodError:
            with self._lock:
                self._send_errors += 1
            raise

    def _large_run(self, size: int) -> int:
        """0 when a record of ``size`` bytes fits a normal batch, else the buffers of its
        own run; RecordTooLargeError past max_request_size or the whole pool."""
        total = size + HEADER_SIZE
        if total > self._max_request_size:
            raise RecordTooLargeError(
                f"record of {total} bytes (with batch header) is larger than "
                f"max_request_size={self._max_request_size}"
            )
        if size <= self._records_room:
            return 0
        run = self._geo.buffers_for(total)
        if run > self._geo.n_buffers:
            raise RecordTooLargeError(
                f"record of {total} bytes is larger than the whole pool "
                f"({self._geo.n_buffers} x {self._geo.buffer_size} bytes)"
            )
        return run

    def _partition_locked(self, entry: TopicEntry, kb: Any, partition: Any, nbytes: int) -> int:
        n = entry.partitions
        if partition is not None:
            return check_partition(partition, n, entry.name)
        try:
            if kb is not None or not self._murmur:
                key = kb if kb is None or type(kb) is bytes else bytes(kb)
                p = self._partitioner.partition(key, n)
                if p != NO_PARTITION:
                    return p
            return entry.sticky.partition(n, nbytes)
        except PartitionerError as exc:
            raise InvalidRecordError(f"partitioner: {exc}") from None

    def _append_locked(
        self,
        topic: str,
        kb: Any,
        vb: Any,
        hdrs: bytes,
        ts: int,
        partition: int | None,
        nbytes: int,
        run: int,
    ) -> RecordFuture:
        """Runs in: worker, state lock held (released only while waiting)."""
        entry = self._topics.entries.get(topic)
        if entry is None or self._topics.read_epoch() != self._topics.epoch:
            entry = self._topic_locked(topic)
        slot = entry.base + self._partition_locked(entry, kb, partition, nbytes)
        if run:
            return self._append_large_locked(entry, slot, kb, vb, hdrs, ts, run)
        deadline = 0
        while True:
            b = self._open.get(slot)
            if b is not None:
                count = b.count
                if not count:
                    b.base_ts = b.max_ts = ts
                start = b.pos
                try:
                    b.pos = encode_record_into(b.view, start, count, ts - b.base_ts, kb, vb, hdrs)
                except EncodeError as exc:
                    if not count:  # cannot happen for a record sized to fit; never seal empty
                        del self._open[slot]
                        b.release()
                        self._stock.append(b.buffer)
                        raise InvalidRecordError(f"record cannot be encoded: {exc}") from None
                    self._send_locked(self._seal_locked(b))
                    if not self._stock and not self._prefetch_rid:
                        self._prefetch_locked()
                    continue
                b.count = count + 1
                if ts > b.max_ts:
                    b.max_ts = ts
                self._records_appended += 1
                self._bytes_appended += b.pos - start
                return RecordFuture(b.outcome, count, ts)
            if self._stock:
                buf = self._stock.pop()
            else:
                if not deadline:
                    deadline = time.monotonic_ns() + self._max_block_ns
                buf = self._obtain_locked(1, 1, deadline)[0]
                if slot in self._open:  # another thread opened one while we waited
                    self._stock.append(buf)
                    continue
            self._open_locked(entry, slot, buf, 1, self._batch_size)

    def _append_large_locked(
        self, entry: TopicEntry, slot: int, kb: Any, vb: Any, hdrs: bytes, ts: int, run: int
    ) -> RecordFuture:
        """A record larger than batch_size: alone in its own run of adjacent buffers."""
        b = self._open.get(slot)
        if b is not None:
            self._send_locked(self._seal_locked(b))
        deadline = time.monotonic_ns() + self._max_block_ns
        buf = self._obtain_locked(run, 1, deadline)[0]
        big = self._new_batch_locked(entry, slot, buf, run, self._geo.run_bytes(run))
        big.base_ts = big.max_ts = ts
        try:
            big.pos = encode_record_into(big.view, HEADER_SIZE, 0, 0, kb, vb, hdrs)
        except BaseException:
            big.release()
            self._give_back_locked([buf], run)
            raise
        big.count = 1
        self._records_appended += 1
        self._bytes_appended += big.pos - HEADER_SIZE
        self._send_locked(self._seal_locked(big))
        return RecordFuture(big.outcome, 0, ts)

    def _topic_locked(self, topic: str) -> TopicEntry:
        return self._topics.get(
            topic,
            self._wait_locked,
            self._send_msg_locked,
            self._new_request_id,
            self._check_alive,
            self._max_block_ms,
        )

    def _new_request_id(self) -> int:
        return next(self._request_ids)

    # ------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------

    def _new_batch_locked(
        self, entry: TopicEntry, slot: int, buf: int, run: int, capacity: int
    ) -> A.OpenBatch:
        bid = self._next_batch_id
        self._next_batch_id = bid + 1
        outcome = BatchOutcome(self._done_lock, entry.name, slot - entry.base)
        now = time.monotonic_ns()
        self._last_open_ns = now
        return A.open_batch(
            self._view,
            self._geo,
            self._slot,
            buf,
            run,
            capacity,
            slot,
            bid,
            outcome,
            now,
            self._linger_ns,
        )

    def _open_locked(self, entry: TopicEntry, slot: int, buf: int, run: int, capacity: int) -> None:
        b = self._new_batch_locked(entry, slot, buf, run, capacity)
        self._open[slot] = b
        if b.deadline_ns < self._io_deadline_ns:
            self._io_deadline_ns = b.deadline_ns
            self._wake()

    def _seal_locked(self, b: A.OpenBatch) -> bytes:
        """Seals ``b`` and registers its outcome; returns the ``Sealed`` message to send
        (the caller sends it under the same lock hold, keeping partition order)."""
        if self._open.get(b.slot) is b:
            del self._open[b.slot]
        msg, _length = A.seal(self._view, self._geo, b, self._codec, self._level, self._scratch)
        self._inflight[b.batch_id] = (b.outcome, b.count)
        self._batches_sealed += 1
        self._publish_locked()
        return ipc.encode(msg)

    def _publish_locked(self) -> None:
        """Mirrors this worker's counters into its WORKER slot (single writer)."""
        v = self._view
        base = self._geo.worker(self._slot)
        pack = L.U64.pack_into
        pack(v, base + L.W_RECORDS_APPENDED, self._records_appended)
        pack(v, base + L.W_BYTES_APPENDED, self._bytes_appended)
        pack(v, base + L.W_BATCHES_SEALED, self._batches_sealed)
        pack(v, base + L.W_SEND_ERRORS, self._send_errors)
        pack(v, base + L.W_RECORDS_ACKED, self._records_acked)
        pack(v, base + L.W_RECORDS_FAILED, self._records_failed)

    def _seal_all_locked(self, slots: Sequence[int] | None = None) -> None:
        """Seals this process's open batches (of ``slots``, or all) and sends them."""
        todo = (
            list(self._open.values())
            if slots is None
            else [self._open[s] for s in slots if s in self._open]
        )
        if todo:
            self._send_locked(b"".join(self._seal_locked(b) for b in todo))

    # ------------------------------------------------------------------------------
    # buffers
    # ------------------------------------------------------------------------------

    def _obtain_locked(self, run: int, count: int, deadline_ns: int) -> list[int]:
        """``count`` granted runs of ``run`` buffers (first buffer of each), from the stock
        or by ``Alloc``; waits at most until ``deadline_ns`` (BufferExhaustedError).

        Runs in: worker, state lock held; the lock is released while waiting.
        """
        got: list[int] = []
        if run == 1 and self._stock:
            take = min(len(self._stock), count)
            got = self._stock[-take:]
            del self._stock[-take:]
            if take == count:
                return got
        need = count - len(got)
        rid = next(self._request_ids)
        req = _Request(run, need)
        self._requests[rid] = req
        try:
            self._send_msg_locked(ipc.Alloc(rid, run, need))
            while len(got) + len(req.buffers) < count:
                self._check_alive()
                if req.error:
                    raise error_from_code(
                        req.error, f"the sender refused {need} run(s) of {run} buffer(s)"
                    )
                if run == 1 and self._stock:
                    # a buffer came back to the stock (a prefetch, a late grant): use it;
                    # what this request still gets later goes to the stock
                    take = min(len(self._stock), count - len(got) - len(req.buffers))
                    got += self._stock[-take:]
                    del self._stock[-take:]
                    continue
                remaining = deadline_ns - time.monotonic_ns()
                if remaining <= 0:
                    raise BufferExhaustedError(
                        f"no free pool buffer within max_block_ms={self._max_block_ms} "
                        f"({count - len(got) - len(req.buffers)} run(s) of {run} buffer(s) "
                        "still wanted)"
                    )
                self._wait_locked(remaining / 1e9)
        except BaseException:
            del self._requests[rid]
            self._give_back_locked(got + req.buffers, run)
            raise
        del self._requests[rid]
        got += req.buffers
        if len(got) > count:
            self._give_back_locked(got[count:], run)
        return got[:count]

    def _give_back_locked(self, buffers: list[int], run: int) -> None:
        """Unused granted buffers: single ones to the stock, runs back to the sender."""
        if not buffers:
            return
        if run == 1:
            self._stock.extend(buffers)
            return
        if self._fatal is None:
            with contextlib.suppress(ShmprodError):
                self._send_msg_locked(ipc.Release(run, tuple(buffers)))

    def _prefetch_locked(self) -> None:
        """Asks for one buffer ahead of need (the Grant goes to the stock)."""
        rid = next(self._request_ids)
        self._prefetch_rid = rid
        self._send_msg_locked(ipc.Alloc(rid, 1, 1))

    def _on_grant_locked(self, g: ipc.Grant) -> None:
        try:
            for b in g.buffers:
                self._geo.check_run(b, g.run)
        except IndexError as exc:
            log.error("ignoring a Grant with buffers outside the pool: %s", exc)
            return
        req = self._requests.get(g.request_id)
        if req is None:
            if g.request_id == self._prefetch_rid:
                self._prefetch_rid = 0
            if not g.error:
                self._give_back_locked(list(g.buffers), g.run)
            return
        if g.error:
            req.error = g.error
        else:
            req.buffers.extend(g.buffers)
        self._cond.notify_all()

    # ------------------------------------------------------------------------------
    # control socket
    # ------------------------------------------------------------------------------

    def _send_msg_locked(self, msg: ipc.Message) -> None:
        self._send_locked(ipc.encode(msg))

    def _send_locked(self, data: bytes) -> None:
        """Writes control bytes (state lock held, so messages keep their order)."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._mark_dead_locked(f"the control connection failed: {exc!r}")
            raise SenderDiedError(f"the sender is unreachable: {exc!r}") from None

    def _mark_dead_locked(self, message: str) -> None:
        """Records the sender as gone and shuts the socket so the I/O thread fails all."""
        if self._fatal is None:
            self._fatal = (SenderDiedError.code, message)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._cond.notify_all()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # ------------------------------------------------------------------------------
    # the I/O thread
    # ------------------------------------------------------------------------------

    def _io_main(self) -> None:
        """Runs in: the worker's I/O thread (one per Worker)."""
        sock, wake = self._sock, self._wake_r
        try:
            self._deferred.extend(self._early)
            self._early = []
            while not self._stop:
                if self._deferred:
                    self._handle()
                if self._eof:
                    if not self._stop:
                        self._fail_everything(SenderDiedError.code, self._eof_message)
                    return
                timeout = self._tick(time.monotonic_ns())
                try:
                    ready, _, _ = select.select([sock, wake], [], [], timeout)
                except (OSError, ValueError):
                    if self._stop:
                        return
                    raise
                if wake in ready:
                    with contextlib.suppress(OSError):
                        wake.recv(4096)
                if sock in ready:
                    self._receive()
        except BaseException as exc:
            log.exception("shmprod worker I/O thread failed")
            self._fail_everything(ProducerError.code, f"the worker's I/O thread failed: {exc!r}")

    def _receive(self) -> None:
        """Reads what the control socket has into ``_deferred``; notes EOF in ``_eof``.

        Runs in: worker I/O thread only (the main loop, or a wait inside a callback).
        """
        try:
            data = self._sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data:
            self._eof = True
            return
        try:
            self._deferred.extend(self._reader.feed(data))
        except ipc.IpcError as exc:
            self._eof = True
            self._eof_message = f"bad control message from the sender: {exc}"

    def _wait_locked(self, timeout: float) -> None:
        """Waits for the state to change (state lock held, released while waiting).

        In the I/O thread -- a future callback that sends and must wait for a buffer or a
        topic -- nobody else would read the socket, so this reads it and applies what a
        waiter needs (Grant, TopicInfo, Ready, Fatal) at once; ``Done`` messages are kept
        until the callback returns, so callbacks never nest.
        """
        if threading.current_thread() is not self._thread:
            self._cond.wait(timeout)
            return
        if not self._eof:
            self._lock.release()
            try:
                ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
                if ready:
                    self._receive()
            finally:
                self._lock.acquire()
        if self._eof and self._fatal is None:
            self._fatal = (SenderDiedError.code, self._eof_message)
        keep: list[ipc.Message] = []
        for m in self._deferred:
            if type(m) is ipc.Done:
                keep.append(m)
            elif isinstance(m, ipc.Fatal):
                if self._fatal is None:
                    self._fatal = (m.error, m.message or "the producer failed or closed")
                keep.append(m)
            else:
                self._apply_locked(m)
        self._deferred = keep

    def _apply_locked(self, m: ipc.Message) -> None:
        """Applies one control message other than Done and Fatal. State lock held."""
        if isinstance(m, ipc.Grant):
            self._on_grant_locked(m)
        elif isinstance(m, ipc.TopicInfo):
            if self._topics.on_info(m):
                self._cond.notify_all()
        elif isinstance(m, ipc.Ready):
            self._ready = m
            self._cond.notify_all()
        else:
            log.warning("unexpected control message %s", type(m).__name__)

    def _tick(self, now: int) -> float:
        """Seals batches whose linger expired, gives idle stock back; returns how long
        the I/O thread may sleep. Runs in: worker I/O thread."""
        with self._lock:
            if self._fatal is not None or self._state >= _CLOSED:
                self._io_deadline_ns = now + int(_IO_MAX_SLEEP * 1e9)
                return _IO_MAX_SLEEP
            due = [b for b in self._open.values() if b.deadline_ns <= now]
            if due:
                try:
                    self._seal_all_locked([b.slot for b in due])
                except SenderDiedError:
                    return 0.0
            nxt = now + int(_IO_MAX_SLEEP * 1e9)
            for b in self._open.values():
                if b.deadline_ns < nxt:
                    nxt = b.deadline_ns
            if self._stock and not self._open and not self._requests:
                idle_at = self._last_open_ns + _IDLE_RELEASE_NS
                if idle_at <= now:
                    self._release_stock_locked()
                elif idle_at < nxt:
                    nxt = idle_at
            self._io_deadline_ns = nxt
        return max(0.0, (nxt - now) / 1e9)

    def _release_stock_locked(self) -> None:
        if self._stock and self._fatal is None:
            stock, self._stock = self._stock, []
            with contextlib.suppress(SenderDiedError):
                self._send_msg_locked(ipc.Release(1, tuple(stock)))

    def _handle(self) -> None:
        """Applies the received control messages; resolves futures outside the lock.

        Runs in: worker I/O thread.
        """
        done: list[tuple[ipc.Done, BatchOutcome]] = []
        fatal: ipc.Fatal | None = None
        with self._lock:
            msgs, self._deferred = self._deferred, []
            inflight = self._inflight
            for m in msgs:
                if type(m) is ipc.Done:
                    item = inflight.get(m.batch_id)
                    if item is not None:
                        done.append((m, item[0]))
                    else:
                        log.debug("Done for unknown batch %d", m.batch_id)
                elif isinstance(m, ipc.Fatal):
                    fatal = m
                else:
                    self._apply_locked(m)
        for m, outcome in done:
            if m.error == 0:
                outcome.succeed(m.base_offset, m.log_append_time_ms)
            else:
                outcome.fail(error_from_code(m.error, m.message, m.retriable))
        if done:
            with self._lock:
                for m, _ in done:
                    item = inflight.pop(m.batch_id, None)
                    if item is not None:
                        if m.error == 0:
                            self._records_acked += item[1]
                        else:
                            self._records_failed += item[1]
                self._publish_locked()
                if self._flush_waiters:
                    self._cond.notify_all()
        if fatal is not None:
            self._fail_everything(fatal.error, fatal.message or "the producer failed or closed")

    def _fail_everything(self, code: int, message: str) -> None:
        """Fails every pending record of this worker (sender death, Fatal, shutdown).

        Runs in: worker (I/O thread or closing thread); callbacks run outside the lock.
        """
        with self._lock:
            if self._fatal is None:
                self._fatal = (code, message)
            code, message = self._fatal
            outcomes = [(b.outcome, b.count) for b in self._open.values()]
            for b in self._open.values():
                b.release()
            self._open.clear()
            outcomes += self._inflight.values()
            self._stock.clear()
            self._topics.forget_pending()
            self._cond.notify_all()
        if outcomes:
            error = error_from_code(code, message)
            for outcome, _ in outcomes:
                outcome.fail(error)
            with self._lock:
                self._records_failed += sum(n for _, n in outcomes)
                self._inflight.clear()
                with contextlib.suppress(ValueError):
                    self._publish_locked()
                self._cond.notify_all()

    # ------------------------------------------------------------------------------
    # send_batch, flush, close, stats
    # ------------------------------------------------------------------------------

    def send_batch(
        self,
        topic: str,
        values: Any,
        keys: Any = None,
        partitions: Any = None,
        timestamps_ms: Any = None,
        headers: Any = None,
    ) -> BatchFuture:
        """Sends many records at once, vectorized (see :mod:`shmprod.worker.bulk`).

        ``values``/``keys``: sequences of bytes/None, numpy object arrays or Arrow
        binary/string arrays (serializers are NOT applied here). ``partitions``: one int
        or one per row; default murmur2 of the key, null keys spread in whole batches.
        ``timestamps_ms``: one int or one per row (None = now). ``headers``: one list of
        (str, bytes | None) for all rows, or one list per row (slower path).
        """
        from shmprod.worker import bulk

        if self._state or self._fatal is not None:
            self._refuse()
        try:
            return bulk.send_batch(self, topic, values, keys, partitions, timestamps_ms, headers)
        except ShmprodError:
            with self._lock:
                self._send_errors += 1
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Seals this process's open batches and waits until every batch it sealed so far
        has its outcome (futures resolved). Raises FlushTimeoutError after ``timeout``
        seconds (None: delivery_timeout_ms + 10 s, by which a live sender has answered
        every batch); returns early, futures failed, if the sender dies."""
        self._check_process()
        if threading.current_thread() is self._thread:
            raise ShmprodError("flush() cannot run in a future callback (the worker's I/O thread)")
        if timeout is None:  # a safety net: a live sender answers within delivery_timeout_ms
            timeout = self._config.delivery_timeout_ms / 1000.0 + _FLUSH_MARGIN_S
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._state == _CLOSED:
                return
            if self._fatal is None:
                with contextlib.suppress(SenderDiedError):
                    self._seal_all_locked()
            target = self._next_batch_id
            self._flush_waiters += 1
            try:
                while self._fatal is None and self._inflight and min(self._inflight) < target:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        pending = sum(1 for b in self._inflight if b < target)
                        raise FlushTimeoutError(
                            f"{pending} batch(es) still without outcome after {timeout} s"
                        )
                    self._cond.wait(min(left, _IO_MAX_SLEEP))
            finally:
                self._flush_waiters -= 1
            self._release_stock_locked()

    def close(self, timeout: float | None = None) -> None:
        """Flushes (up to ``timeout`` s), says Bye and detaches. The shared producer keeps
        running for other processes; outcomes still missing fail with
        ProducerClosedError (the sender still delivers those batches)."""
        if self._state == _FORKED:
            self._state = _CLOSED
            return
        with self._lock:
            if self._state != _OPEN:
                return
            self._state = _CLOSING
        if threading.current_thread() is not self._thread:
            try:
                self.flush(timeout)
            except FlushTimeoutError as exc:
                log.warning("closing with batches still pending: %s", exc)
        self._detach()

    def _detach(self) -> None:
        with self._lock:
            self._state = _CLOSED
            self._stop = True
            if self._fatal is None:
                with contextlib.suppress(SenderDiedError):
                    self._seal_all_locked()
                    self._release_stock_locked()
                    self._send_msg_locked(ipc.Bye())
            self._cond.notify_all()
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        if self._fatal is None:
            self._fatal = (ProducerClosedError.code, "the worker closed before the outcome arrived")
        self._fail_everything(*self._fatal)
        _LIVE.discard(self)
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()
        try:
            self._seg.close()
        except BufferError:
            log.warning("shared memory still referenced at close; left mapped until exit")

    def shutdown_producer(self, timeout_ms: int) -> bool:
        """Owner only: asks the sender to finish what is queued (``Shutdown``) and waits
        for it to close the control connection, up to ``timeout_ms`` + 5 s. Returns True
        when the sender finished in time. Call :meth:`close` afterwards."""
        self._check_process()
        if not self._owner:
            raise ProducerError("only the producer's owner may shut the sender down")
        deadline = time.monotonic() + timeout_ms / 1000.0 + 5.0
        with self._lock:
            if self._fatal is None and self._state != _CLOSED:
                with contextlib.suppress(SenderDiedError):
                    self._seal_all_locked()
                    self._send_msg_locked(ipc.Shutdown(timeout_ms))
            while self._fatal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wait_locked(min(left, _IO_MAX_SLEEP))
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return True

    def wait_ready(self, timeout: float) -> None:
        """Owner: waits for the sender's ``Ready``; raises its error, or ProducerError
        after ``timeout`` seconds."""
        self._check_process()
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._ready is None:
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProducerError(f"the sender did not report ready within {timeout} s")
                self._wait_locked(min(left, _IO_MAX_SLEEP))
            ready = self._ready
        if ready.error:
            raise error_from_code(ready.error, ready.message)

    def stats(self) -> dict[str, Any]:
        """This worker's counters, the sender's STATS, pool occupancy and per-partition
        queue depth, all read from shared memory."""
        self._check_process()
        with self._lock:
            if self._state == _CLOSED:
                raise ProducerClosedError("stats() after close")
            self._publish_locked()
            local = {
                "open_batches": len(self._open),
                "pending_batches": len(self._inflight),
                "stock_buffers": len(self._stock),
            }
        view, geo = self._view, self._geo
        return {
            "worker": {**shmstats.read_worker(view, geo, self._slot), **local},
            "sender": shmstats.read_sender_stats(view, geo),
            "pool": shmstats.read_pool(view, geo),
            "topics": shmstats.read_topics(view, geo),
        }

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
