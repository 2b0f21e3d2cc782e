"""The Worker: one attachment of one process to the shared producer (public API).

``attach(handle)`` maps the segment, connects to the sender's control socket, says
``Hello`` (secret, pid, process start time, owner flag) and gets ``Welcome`` (its WORKER
slot); the machinery behind it (state lock, buffers, batches, the I/O thread) is
:class:`shmprod.worker.core.WorkerCore`.

* :meth:`Worker.send`: one record is checked (nothing staged on a bad input) and staged
  for its topic in process memory; stages are partitioned (explicit, murmur2 of the key,
  else sticky) and encoded in bulk into shared memory (:mod:`.staging`, :mod:`.bulk`);
* :meth:`Worker.send_batch`: whole columns, vectorized (:mod:`.bulk`);
* :meth:`Worker.flush`, :meth:`Worker.close`, :meth:`Worker.stats`; for the owner,
  :meth:`Worker.wait_ready` and :meth:`Worker.shutdown_producer`.

Exit: a process that exits normally (atexit, or the end of a ``multiprocessing`` /
``multiprocess`` child's target) flushes and detaches its open Workers, at most 30 s.

Fork safety: a Worker belongs to the process that attached. In a forked child every
method raises :class:`ShmprodError` asking to call ``attach(handle)`` there (an
``os.register_at_fork`` hook marks inherited Workers, so the hot path pays nothing).

Runs in: worker.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from shmprod import ipc, speedups
from shmprod import layout as L
from shmprod.errors import (
    FlushTimeoutError,
    ProducerClosedError,
    ProducerError,
    ProducerHostError,
    RecordTooLargeError,
    SenderDiedError,
    ShmprodError,
    error_from_code,
)
from shmprod.futures import BatchFuture, RecordFuture
from shmprod.handle import Handle
from shmprod.partitioner import check_partition
from shmprod.protocol.records import HEADER_SIZE, record_size
from shmprod.protocol.values import frozen
from shmprod.shm import Segment, SharedMemoryError
from shmprod.worker import bulk, shmstats
from shmprod.worker.cause import cause_after_break, cause_from_header, cause_without_segment
from shmprod.worker.core import _BUSY, CLOSED, CLOSING, FORKED, IO_MAX_SLEEP, OPEN, WorkerCore
from shmprod.worker.inputs import (
    NO_HEADERS,
    as_bytes,
    check_timestamp,
    encoded_headers,
    serialize,
    serialized,
)
from shmprod.worker.staging import (
    RECORD_OVERHEAD_MAX,
    STAGE_MAX_BYTES,
    STAGED_MAX_BYTES,
    STAGED_OVERHEAD,
    Stage,
)
from shmprod.worker.topics import TopicEntry, validate_topic

__all__ = ["Worker", "attach"]

log = logging.getLogger(__name__)


_time_ns = time.time_ns
_HANDSHAKE_MIN_S: Final = 5.0
_FLUSH_MARGIN_S: Final = 10.0  # flush(None) gives up this long after delivery_timeout_ms
_RECV_SIZE: Final = 1 << 16

_EPOCH: Final = L.U64
_H_EPOCH: Final = L.H_METADATA_EPOCH

_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def _mark_forked() -> None:
    """In a forked child: every inherited Worker refuses further use (no locks touched),
    and the child closes its copies of the Worker's sockets. The control socket then
    stays open only in the process that attached, so the sender sees that process die
    when it dies, not when its last forked child exits too. Runs in: a forked child,
    single-threaded, right after ``fork``."""
    for w in list(_LIVE):
        w._state = FORKED
        w._fast = None  # send() goes through Python, which refuses
        for name in ("_sock", "_wake_r", "_wake_w"):
            sock = getattr(w, name, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    os.close(sock.detach())


os.register_at_fork(after_in_child=_mark_forked)

_EXIT_CLOSE_S: Final = 30.0  # how long an exiting process flushes its Workers
_exit_hooks_pid = 0


def _close_at_exit() -> None:
    """At a normal exit, flushes and detaches this process's open Workers (bounded), so
    records still in open batches are delivered, as kafka-python's atexit close does."""
    pid = os.getpid()
    for w in list(_LIVE):
        if w._pid == pid and w._state == OPEN:
            try:
                w.close(timeout=_EXIT_CLOSE_S)
            except Exception:
                log.exception("closing %r at exit failed", w)


def _register_exit_hooks() -> None:
    """Once per process: atexit, and the finalizers ``multiprocessing`` (and the
    ``multiprocess`` package) run when a child process returns from its target, which
    skips atexit."""
    global _exit_hooks_pid
    pid = os.getpid()
    if _exit_hooks_pid == pid:
        return
    _exit_hooks_pid = pid
    atexit.register(_close_at_exit)
    for name in ("multiprocessing.util", "multiprocess.util"):
        util = sys.modules.get(name)
        if util is not None:
            util.Finalize(None, _close_at_exit, exitpriority=10)


def attach(handle: Handle, *, owner: bool = False) -> Worker:
    """Attaches this process to the producer described by ``handle``.

    Call it in every process that sends (after fork, spawn, forkserver, ``multiprocess``).
    ``owner=True`` is for the process that created the producer.
    """
    return Worker(handle, owner=owner)


class Worker(WorkerCore):
    """This process's handle on the shared producer (see the module docstring)."""

    def __init__(self, handle: Handle, *, owner: bool = False) -> None:
        super().__init__(handle.producer_config(), owner)
        try:
            self._seg = Segment.attach(handle.segment)
        except SharedMemoryError as exc:
            here = socket.gethostname()
            if handle.host and handle.host != here:
                raise ProducerHostError(
                    f"{exc}; the handle was made on host {handle.host!r} and this is "
                    f"{here!r}: shared memory is host-local, attach on the producer's host"
                ) from None
            if "does not exist" in str(exc):  # removed: closed, or its owner died
                raise cause_without_segment(handle.owner_pid) from None
            raise
        try:
            self._view = self._seg.view
            self._geo = L.read_geometry(self._view)
            state = L.U32.unpack_from(self._view, L.H_STATE)[0]
            if state in (L.STATE_CLOSED, L.STATE_CLOSING, L.STATE_FAILED):
                raise cause_from_header(self._view)
            self._sock = self._connect(handle, owner)
        except BaseException:
            self._seg.close()
            raise
        self._start_io()
        _LIVE.add(self)
        _register_exit_hooks()

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
                cause = cause_after_break(self._view)
                if type(cause) is ProducerError:  # it looks alive, but not there
                    cause = ProducerClosedError(
                        "nothing listens at the handle's socket path (a handle of another "
                        "producer, or its files were removed)"
                    )
                raise type(cause)(
                    f"cannot reach the producer's control socket ({exc.strerror}): {cause}"
                ) from None
            except OSError as exc:  # a full listen backlog, a timeout, ...: still typed
                raise self._attach_failed(
                    f"connecting to the control socket failed ({exc})"
                ) from None
            hello = ipc.Hello(handle.secret, self._pid, ipc.process_start_us(self._pid), owner)
            deadline = time.monotonic() + timeout
            try:
                sock.sendall(ipc.encode(hello))
            except OSError as exc:  # the producer closing as we connect
                raise self._attach_failed(f"saying Hello failed ({exc})") from None
            while True:
                if time.monotonic() > deadline:
                    raise SenderDiedError(f"no Welcome from the sender within {timeout:.0f} s")
                try:
                    data = sock.recv(_RECV_SIZE)
                except TimeoutError:
                    continue
                except OSError as exc:  # e.g. ConnectionResetError: closing meanwhile
                    raise self._attach_failed(f"the connection broke at attach ({exc})") from None
                if not data:
                    raise self._attach_failed(
                        "the sender closed the control connection at attach (a wrong "
                        "secret, or the producer is closing)"
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

    def _attach_failed(self, what: str) -> ShmprodError:
        """A typed error for an attach that broke off: what the segment says happened
        (closed by its owner, owner or sender dead), else SenderDiedError."""
        cause = cause_after_break(self._view)
        if type(cause) is ProducerError:  # the producer looks alive: it refused us
            return SenderDiedError(what)
        return type(cause)(f"{what}: {cause}")

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

    @property
    def segment_name(self) -> str:
        """The producer's shared-memory segment: names the producer this Worker uses."""
        return self._seg.name

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
        """Stages one record for its topic (see :mod:`shmprod.worker.staging`).

        ``value``/``key``: bytes-like, str (UTF-8) or None (or anything the configured
        serializers take). ``headers``: list of (str, bytes | str | None) pairs or a
        dict. ``partition``: explicit, else murmur2 of the key, else sticky.
        ``timestamp_ms``: None = now. Blocks only for a topic's metadata, or to flush
        when the stage is full, at most ``max_block_ms``. Raises a typed error at the
        call, with nothing staged, for bad input.
        """
        if self._state or self._fatal is not None:
            self._refuse()
        key_what, value_what = "key", "value"
        if self._key_ser is not None or self._value_ser is not None:
            # each serializer runs once, here: the stager and the checks below take
            # what it made
            try:
                if self._key_ser is not None:
                    key, key_what = serialize(self._key_ser, key, "key"), serialized("key")
                if self._value_ser is not None:
                    value = serialize(self._value_ser, value, "value")
                    value_what = serialized("value")
            except ShmprodError:
                with self._lock:
                    self._send_errors += 1
                raise
        # the common case (bytes, bytearray, str or None key and value, headers none or
        # str -> bytes pairs, no partition or one the stage knows, the topic's stage has
        # room), in C where built: shmprod.speedups
        fut = self._stager(topic, value, key, headers, partition, timestamp_ms)
        if fut is not None:
            return fut  # type: ignore[no-any-return]
        try:
            # staged as bytes: a mutable buffer is copied now, so a caller that reuses
            # it after send() returns cannot change what is sent
            kb = key if key is None or type(key) is bytes else frozen(as_bytes(key, key_what))
            vb = (
                value
                if value is None or type(value) is bytes
                else frozen(as_bytes(value, value_what))
            )
            section: bytes | None = None
            if headers is not None:
                section = encoded_headers(headers)  # checks them
                if len(section) <= 1:
                    section = None
            hlen = 1 if section is None else len(section)
            ts = _time_ns() // 1_000_000 if timestamp_ms is None else check_timestamp(timestamp_ms)
            if type(topic) is not str:
                topic = validate_topic(topic)
            klen = 0 if kb is None else len(kb)
            vlen = 0 if vb is None else len(vb)
            bound = klen + vlen + hlen + RECORD_OVERHEAD_MAX
            if bound > self._records_room or bound + HEADER_SIZE > self._max_request_size:
                self._check_size(record_size(0, 0, kb, vb, section or NO_HEADERS))
            size = klen + vlen + hlen + STAGED_OVERHEAD
            while True:
                fut = self._stage_record(topic, kb, vb, section, ts, partition, size)
                if fut is not None:
                    return fut
                # the stage is full: flush it first (a full pool refuses this record:
                # BufferExhaustedError, with nothing of it staged)
                with self._lock:  # the I/O thread changes the stages meanwhile
                    room = self._staged_total_locked() + size < STAGED_MAX_BYTES
                self._flush_stages([topic] if room else None, keep_when_full=True)
        except ShmprodError:
            with self._lock:
                self._send_errors += 1
            raise

    # With the extension, ``send`` is a C method descriptor around the method above: it
    # stages the common case without a Python frame (``_fast``; shmprod.speedups) and
    # calls the method for everything else.
    if not TYPE_CHECKING and speedups.SendMethod is not None:
        send = speedups.SendMethod(send)

    def _stage_record(
        self,
        topic: str,
        kb: Any,
        vb: Any,
        section: bytes | None,
        ts: int,
        partition: int | None,
        size: int,
    ) -> RecordFuture | None:
        """Appends one checked record to its topic's stage; None (nothing staged) when
        the stage must be flushed first. Runs in: worker, takes the state lock."""
        with self._lock:
            topics = self._topics
            entry = topics.entries.get(topic)
            if entry is None or _EPOCH.unpack_from(self._view, _H_EPOCH)[0] != topics.epoch:
                entry = self._topic_locked(topic)
            if self._fatal is not None:
                self._refuse()
            p = -1 if partition is None else check_partition(partition, entry.partitions, topic)
            stages = self._stages.get(topic)
            if stages is None:
                stage = self._new_stage_locked(topic, entry)
            else:
                last = stages[-1]
                if not isinstance(last, Stage):  # held send_batch calls: written first
                    return None
                stage = last
                if (
                    len(stages) > 1  # older stages wait for buffers: flush them first
                    or stage.nbytes + size > stage.limit
                    or self._staged_total_locked() + size > STAGED_MAX_BYTES
                    or (p >= 0 and stage.partition_room(p) < size)
                ):
                    return None
            row = stage.n
            if p >= 0:
                stage.set_partition(row, p, size, self._batch_size, entry.partitions)
            elif stage.partitions is not None:
                stage.pad_partition()
            if section is not None:
                stage.set_headers(row, section)
            elif stage.headers is not None:
                stage.pad_headers()
            return RecordFuture(stage, stage.append(kb, vb, ts, size))

    def _new_stage_locked(self, topic: str, entry: TopicEntry) -> Stage:
        """A new stage for ``topic``; the I/O thread flushes it ``linger_ms`` from now.
        It is full at about 7/8 of a batch per partition: keys spread a little unevenly,
        and a partition that got just over ``batch_size`` would make a second, tiny
        batch. Runs in: worker, state lock held."""
        deadline = time.monotonic_ns() + self._linger_ns
        limit = min(STAGE_MAX_BYTES, max(1, self._batch_size * entry.partitions * 7 // 8))
        stage = Stage(topic, deadline, self._done_lock, limit)
        self._stages[topic] = [stage]
        self._stage_added_locked(deadline)
        return stage

    def _check_size(self, size: int) -> None:
        """RecordTooLargeError for a record of ``size`` bytes that no batch can hold."""
        total = size + HEADER_SIZE
        if total > self._max_request_size:
            raise RecordTooLargeError(
                f"record of {total} bytes (with batch header) is larger than "
                f"max_request_size={self._max_request_size}"
            )
        if self._geo.buffers_for(total) > self._geo.n_buffers:
            raise RecordTooLargeError(
                f"record of {total} bytes is larger than the whole pool "
                f"({self._geo.n_buffers} x {self._geo.buffer_size} bytes)"
            )

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
        or one per row (nulls of an Arrow array: as if none was given); default murmur2
        of the key, null keys spread in whole batches.
        ``timestamps_ms``: one int or one per row (None = now). ``headers``: one list of
        (str, bytes | None) for all rows, or one list per row (slower path).

        A call smaller than about a batch per partition of the topic, without explicit
        partitions or headers, is held up to ``linger_ms`` and written with the next
        such calls, so batches fill across calls (:mod:`shmprod.worker.held`); its
        future resolves once they are written and acknowledged. Arrow columns are kept
        by reference meanwhile (Arrow data is immutable); other forms are copied.
        """
        if self._state or self._fatal is not None:
            self._refuse()
        try:
            return bulk.send_batch(
                self._port(), topic, values, keys, partitions, timestamps_ms, headers
            )
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
        if self._state == CLOSED:
            return
        if self._fatal is None:
            with contextlib.suppress(ShmprodError):
                self._flush_stages()
        with self._lock:
            if self._state == CLOSED:
                return
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
                    self._cond.wait(min(left, IO_MAX_SLEEP))
            finally:
                self._flush_waiters -= 1

    def close(self, timeout: float | None = None) -> None:
        """Flushes (up to ``timeout`` s), says Bye and detaches. The shared producer keeps
        running for other processes; outcomes still missing fail with
        ProducerClosedError (the sender still delivers those batches)."""
        if self._state == FORKED:
            self._state = CLOSED
            return
        with self._lock:
            if self._state != OPEN:
                return
            self._state = CLOSING
            self._fast = None  # send() goes through Python, which refuses
        if threading.current_thread() is not self._thread:
            try:
                self.flush(timeout)
            except FlushTimeoutError as exc:
                log.warning("closing with batches still pending: %s", exc)
        self._detach()

    def _detach(self) -> None:
        self._finalizer.detach()  # closed by hand: nothing left for the garbage collector
        if self._fatal is None and threading.current_thread() is not self._thread:
            with contextlib.suppress(ShmprodError):
                self._flush_stages()
        with self._lock:
            self._state = CLOSED
            self._fast = None
            self._stop = True
            if self._fatal is None:
                with contextlib.suppress(SenderDiedError):
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
        _BUSY.discard(self)
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
        if self._fatal is None and self._state != CLOSED:
            with contextlib.suppress(ShmprodError):
                self._flush_stages()
        with self._lock:
            if self._fatal is None and self._state != CLOSED:
                with contextlib.suppress(SenderDiedError):
                    self._send_msg_locked(ipc.Shutdown(timeout_ms))
            while self._fatal is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wait_locked(min(left, IO_MAX_SLEEP))
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
                self._wait_locked(min(left, IO_MAX_SLEEP))
            ready = self._ready
        if ready.error:
            raise error_from_code(ready.error, ready.message)
        self._await_first_lease()

    def stats(self) -> dict[str, Any]:
        """This worker's counters, the sender's STATS, pool occupancy and per-partition
        queue depth, all read from shared memory."""
        self._check_process()
        with self._lock:
            if self._state == CLOSED:
                raise ProducerClosedError("stats() after close")
            self._publish_locked()
            local = {
                "staged_records": sum(st.n for sts in self._stages.values() for st in sts),
                "staged_bytes": self._staged_total_locked(),
                "pending_batches": len(self._inflight),
                "stock_buffers": len(self._stock),
            }
        view, geo = self._view, self._geo
        worker = {**shmstats.read_worker(view, geo, self._slot), **local}
        sender = shmstats.read_sender_stats(view, geo)
        return {
            "worker": worker,
            "sender": sender,
            "batching": shmstats.batching(worker, sender),
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
