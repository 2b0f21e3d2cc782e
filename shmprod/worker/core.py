"""The worker's machinery: state, buffers, stages, flushes and the control-socket I/O thread.

:class:`WorkerCore` holds everything one attachment keeps in its process -- the state
lock and its Condition, the records ``send`` staged per topic
(:mod:`shmprod.worker.staging`), outcomes waiting for ``Done``, the lease of granted
buffers and the ``Alloc`` requests being waited for -- and runs the background I/O
thread. :class:`shmprod.worker.client.Worker` builds the public API on top of it
(attach, send, send_batch, flush, close, stats).

The I/O thread selects on the control socket and a wake-up socketpair, with a timeout
equal to the next linger deadline: it flushes stages whose linger expired, receives
``Grant`` / ``TopicInfo`` / ``Done`` / ``Fatal`` / ``Ready``, resolves futures (their
callbacks run in this thread, never under the state lock), gives idle stock back after
200 ms, and on EOF (the sender died) fails every pending future with
:class:`SenderDiedError` at once. A callback may call ``send``: if that must wait (a
buffer, a topic), the I/O thread reads the socket itself meanwhile and keeps ``Done``
messages for after the callback (no nesting).

Buffers: the sender owns every free buffer. A process keeps a lease (a stock of granted
buffers) ahead of need, asked for without waiting (:meth:`WorkerCore._replenish_locked`).
A flush takes buffers from the stock, or asks ``Alloc(request_id, run, count)`` and
waits for the ``Grant``, at most ``max_block_ms`` (then :class:`BufferExhaustedError`);
a Grant that arrives after its waiter gave up goes to the stock (runs go back with
``Release``).

Ordering: one flush at a time per process (the flush turn, :meth:`_begin_flush`), and
``Sealed`` messages are sent under the state lock, so the batches of one partition reach
the sender in the order this process sent their records. Every wait has a timeout.

Runs in: worker. Shared memory is written only in buffers granted to this worker and in
its own WORKER slot (one writer each, no cross-process lock); TOPIC, STATS and
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
from typing import Final

import numpy as np

from shmprod import ipc, speedups
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import (
    BufferExhaustedError,
    DeliveryTimeoutError,
    ProducerClosedError,
    ProducerError,
    SenderDiedError,
    ShmprodError,
    error_from_code,
)
from shmprod.futures import BatchOutcome, OutcomePiece, RecordFuture
from shmprod.partitioner import Murmur2Partitioner, default_random_source, get_partitioner
from shmprod.protocol.compression import slack
from shmprod.protocol.records import HEADER_SIZE, BatchSettings
from shmprod.shm import Segment
from shmprod.speedups import Stager
from shmprod.worker import bulk, shmstats
from shmprod.worker.append import claim_spares, describe_batch
from shmprod.worker.port import AppendPort, Written
from shmprod.worker.staging import RECORD_OVERHEAD_MAX, STAGED_OVERHEAD, AnyStage
from shmprod.worker.topics import TopicEntry, TopicTable

__all__ = ["CLOSED", "CLOSING", "FORKED", "OPEN", "WorkerCore"]

log = logging.getLogger(__name__)

OPEN: Final = 0
CLOSING: Final = 1
CLOSED: Final = 2
FORKED: Final = 3

IDLE_RELEASE_NS: Final = 200_000_000  # give spare buffers back after 200 ms without a batch
# ... and 2 s after attach while it has not flushed yet: a process that attached has
# things to send, and its first topic lookup can take a while on a loaded machine
# (measured: a stock given back 200 ms after attach, just before the first flush)
FIRST_IDLE_RELEASE_NS: Final = 2_000_000_000
INITIAL_LEASE: Final = 32  # buffers asked for ahead at attach (at most a fair share)
LEASE_FLUSHES: Final = 4  # the lease grows to cover this many of the largest flush seen
LEASE_ASKS: Final = 4  # lease asks in flight at once (each flush tops the lease up)
LEASE_WAIT_S: Final = 0.5  # attach waits at most this long for its first lease
FLUSH_WAIT_S: Final = 0.05  # a thread waiting for another's flush looks again this often

# Workers with records staged or batches pending, held here so that one its process
# dropped without close() still delivers them; the I/O thread takes it out once idle.
_BUSY: set[WorkerCore] = set()
IO_MAX_SLEEP: Final = 1.0
RECV_SIZE: Final = 1 << 16


class _Request:
    """An ``Alloc`` a thread is waiting for."""

    __slots__ = ("buffers", "count", "error", "run")

    def __init__(self, run: int, count: int) -> None:
        self.run = run
        self.count = count
        self.buffers: list[int] = []
        self.error = 0


class WorkerCore:
    """State and machinery of one attachment (see the module docstring)."""

    _seg: Segment
    _view: memoryview
    _geo: L.Geometry
    _sock: socket.socket
    _slot: int
    _wake_r: socket.socket
    _wake_w: socket.socket
    _topics: TopicTable
    _thread: threading.Thread

    def __init__(self, cfg: ProducerConfig, owner: bool) -> None:
        """Process-local state only; the subclass maps the segment and connects, then
        calls :meth:`_start_io`."""
        self._pid = os.getpid()
        self._state = CLOSED  # until attached
        self._owner = owner
        self._config = cfg
        self._key_ser = cfg.key_serializer
        self._value_ser = cfg.value_serializer
        self._partitioner = get_partitioner(cfg.partitioner)
        self._murmur = isinstance(self._partitioner, Murmur2Partitioner)
        # what each batch is written with (the sender patches in the producer state)
        self._settings = BatchSettings(
            compression=cfg.compression_codec, level=cfg.compression_level
        )
        self._batch_size = cfg.batch_size
        self._records_room = cfg.batch_size - HEADER_SIZE
        # kept free in each batch's run so that its compressed form fits in place
        self._slack = slack(cfg.compression_codec, self._records_room)
        self._linger_ns = int(cfg.linger_ms * 1_000_000)
        self._max_block_ms = cfg.max_block_ms
        self._max_block_ns = cfg.max_block_ms * 1_000_000
        self._max_request_size = cfg.max_request_size
        self._delivery_timeout_ns = cfg.delivery_timeout_ms * 1_000_000

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._done_lock = threading.Lock()
        # topic -> records send() staged and send_batch calls held, oldest stage first;
        # only the last takes more (earlier ones are stages a flush could not get
        # buffers for, first in line)
        self._stages: dict[str, list[AnyStage]] = {}
        # send()'s common case (shmprod.speedups); with serializers, send() runs them in
        # Python and then calls it
        self._stager = Stager(
            self._stages,
            self._lock,
            RecordFuture,
            self._records_room,
            self._max_request_size,
            HEADER_SIZE,
            RECORD_OVERHEAD_MAX,
            STAGED_OVERHEAD,
            np.integer,  # numpy partitions and timestamps, as the Python path takes
        )
        # what send()'s C method stages with: the stager while open and without
        # serializers, else None (shmprod.speedups.SendMethod); every way out of OPEN
        # sets it to None
        self._fast: Stager | None = None
        self._serializing = self._key_ser is not None or self._value_ser is not None
        self._flushing = False  # one flush (or send_batch) at a time: partition order
        self._inflight: dict[int, tuple[BatchOutcome, int]] = {}
        self._stock: list[int] = []
        self._stock_target = INITIAL_LEASE  # buffers to keep in stock (grows with demand)
        self._requests: dict[int, _Request] = {}
        self._prefetches: dict[int, int] = {}  # lease asks not yet granted: id -> buffers
        self._request_ids = itertools.count(1)
        self._next_batch_id = 1
        self._fatal: tuple[int, str] | None = None
        self._ready: ipc.Ready | None = None
        self._flush_waiters = 0
        self._io_deadline_ns = 2**63  # when the I/O thread will look at linger next
        self._last_open_ns = time.monotonic_ns()
        self._stop = False
        self._scratch = bytearray()
        self._reader = ipc.MessageReader()
        self._early: list[ipc.Message] = []
        self._deferred: list[ipc.Message] = []  # received, not yet applied (I/O thread)
        self._read_lock = threading.Lock()  # one reader of the control socket at a time
        self._eof = False
        self._eof_message = "the sender closed the control connection (it died or exited)"
        # this worker's counters (mirrored into its WORKER slot per batch)
        self._records_appended = 0
        self._bytes_appended = 0
        self._batches_sealed = 0
        self._send_errors = 0
        self._records_acked = 0
        self._records_failed = 0
        self._buffer_waits = 0  # times a thread waited for the sender to grant buffers
        self._buffer_wait_ns = 0
        self._buffer_waits_pool_free = 0  # ... while at least half the pool was free
        self._spares_claimed = 0  # spare buffers taken without asking

        self._rand = default_random_source()

    def _start_io(self) -> None:
        """Zeroes this worker's counters and starts the I/O thread. Runs in: worker, once
        the segment is mapped and Welcome received."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        os.set_blocking(self._sock.fileno(), False)  # as with its timeout: reads never wait
        self._deferred.extend(self._early)  # came with Welcome: the I/O thread's first
        self._early = []
        self._topics = TopicTable(self._view, self._geo, self._batch_size, self._rand)
        base = self._geo.worker(self._slot)
        for _, off in shmstats.WORKER_FIELDS:
            L.U64.pack_into(self._view, base + off, 0)
        self._state = OPEN
        self._fast = None if self._serializing else self._stager
        with self._lock, contextlib.suppress(ShmprodError):
            self._replenish_locked()  # the first lease, before the first flush needs it
        self._thread = threading.Thread(
            target=_io_loop,
            args=(weakref.ref(self),),
            name=f"shmprod-worker-io-{self._slot}",
            daemon=True,
        )
        # A Worker dropped without close() is freed when it is garbage: the I/O thread
        # holds it only weakly, and this releases what it held (see _release).
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._sock,
            (self._wake_r, self._wake_w),
            self._seg,
            self._stages,
            self._inflight,
        )
        self._thread.start()
        self._await_first_lease()

    def _await_first_lease(self) -> None:
        """The first flush takes its buffers from the first lease: waits for its Grant
        here (one round trip at attach, bounded), not in that flush; the stock counts as
        idle from then (the owner calls it again once the sender is ready). Measured: a
        process that sent right after attach waited for the sender in its first flush.
        Runs in: worker, not the I/O thread; takes the state lock."""
        deadline = time.monotonic() + min(self._max_block_ms / 1000.0, LEASE_WAIT_S)
        with self._lock:
            while self._prefetches and self._fatal is None and not self._eof:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break  # the grant goes to the stock when it comes
                self._cond.wait(remaining)
            self._last_open_ns = time.monotonic_ns()  # idle from now, not from attach

    # ------------------------------------------------------------------------------
    # state checks
    # ------------------------------------------------------------------------------

    def _refuse(self) -> None:
        """Raises why this Worker cannot send (called when ``_state`` or ``_fatal`` is set)."""
        if self._state == FORKED:
            raise ShmprodError(
                f"this Worker was attached in process {self._pid}, not in this one "
                f"({os.getpid()}): call shmprod.worker.attach(handle) in this process"
            )
        if self._fatal is not None:
            raise error_from_code(*self._fatal)
        raise ProducerClosedError("send after close: this Worker is closed or closing")

    def _check_alive(self) -> None:
        """Raises the fatal error once the producer failed or closed. Lock held or not."""
        if self._fatal is not None or self._state in (CLOSED, FORKED):
            self._refuse()

    def _check_process(self) -> None:
        """Raises in a forked child that inherited this Worker."""
        if self._state == FORKED:
            self._refuse()

    def _topic_locked(self, topic: str) -> TopicEntry:
        """The topic's cached entry, asking the sender if needed (up to max_block_ms).

        Runs in: worker, state lock held (released while waiting)."""
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

    def _publish_locked(self) -> None:
        """Mirrors this worker's counters into its WORKER slot. Runs in: worker, state
        lock held (the slot has one writer, this worker; readers may see it one update old)."""
        v = self._view
        base = self._geo.worker(self._slot)
        pack = speedups.write_word  # one store each: a reader sees no 0 between updates
        pack(v, base + L.W_RECORDS_APPENDED, self._records_appended)
        pack(v, base + L.W_BYTES_APPENDED, self._bytes_appended)
        pack(v, base + L.W_BATCHES_SEALED, self._batches_sealed)
        pack(v, base + L.W_SEND_ERRORS, self._send_errors)
        pack(v, base + L.W_RECORDS_ACKED, self._records_acked)
        pack(v, base + L.W_RECORDS_FAILED, self._records_failed)
        pack(v, base + L.W_BUFFER_WAITS, self._buffer_waits)
        pack(v, base + L.W_BUFFER_WAIT_NS, self._buffer_wait_ns)
        pack(v, base + L.W_BUFFER_WAITS_POOL_FREE, self._buffer_waits_pool_free)
        pack(v, base + L.W_SPARES_CLAIMED, self._spares_claimed)

    # ------------------------------------------------------------------------------
    # flushes: stages and send_batch hand batches over one at a time
    # ------------------------------------------------------------------------------

    def _begin_flush(self, block: bool) -> bool:
        """Takes the flush turn: one thread at a time encodes and hands batches over, so
        batches of a partition reach the sender in the order their records were sent.
        ``block`` False (the I/O thread, which must keep reading the socket for the
        flushing thread's grants): False when another thread flushes. Runs in: worker,
        state lock NOT held."""
        deadline = time.monotonic() + self._max_block_ms / 1000.0 + IO_MAX_SLEEP
        with self._lock:
            while self._flushing:
                if not block:
                    return False
                self._check_alive()
                if time.monotonic() >= deadline:
                    raise BufferExhaustedError(
                        "another thread's flush did not finish within max_block_ms="
                        f"{self._max_block_ms}"
                    )
                self._wait_locked(FLUSH_WAIT_S)
            self._flushing = True
            self._last_open_ns = time.monotonic_ns()
            return True

    def _end_flush(self) -> None:
        with self._lock:
            self._flushing = False
            self._cond.notify_all()

    def _staged_total_locked(self) -> int:
        """Bytes staged over every topic. State lock held."""
        return sum(st.nbytes for sts in self._stages.values() for st in sts)

    def _stage_added_locked(self, deadline_ns: int) -> None:
        """A new stage is to be flushed at ``deadline_ns``: the I/O thread wakes for it.
        State lock held."""
        self._mark_busy_locked()
        if deadline_ns < self._io_deadline_ns:
            self._io_deadline_ns = deadline_ns
            self._wake()

    def _mark_busy_locked(self) -> None:
        """Keeps this Worker alive until what it holds is delivered (see _BUSY). State
        lock held."""
        _BUSY.add(self)

    def _take_stages_locked(self, topics: Sequence[str] | None) -> list[AnyStage]:
        """Removes the stages of ``topics`` (None: all) for a flush. State lock held."""
        names = list(self._stages) if topics is None else [t for t in topics if t in self._stages]
        out = [st for t in names for st in self._stages.pop(t)]
        return out

    def _flush_stages(
        self,
        topics: Sequence[str] | None = None,
        *,
        block: bool = True,
        keep_when_full: bool = False,
    ) -> bool:
        """Encodes and hands over the staged records of ``topics`` (None: all). Returns
        False when ``block`` is False and another thread was flushing. Errors go to the
        stages' futures, except: ``keep_when_full`` and no pool buffers within
        max_block_ms: the stages stay staged, untouched, and BufferExhaustedError is
        raised (``send`` refuses its record). Runs in: worker, state lock NOT held."""
        if not self._begin_flush(block):
            return False
        try:
            bulk.flush_stages(self._port(), topics, keep_when_full=keep_when_full)
        finally:
            self._end_flush()
        return True

    def _expire_stages(self, stages: list[AnyStage]) -> None:
        """Fails staged records older than delivery_timeout_ms (no buffer came for them).
        Runs in: worker I/O thread, state lock NOT held."""
        with self._lock:
            gone = [st for st in stages if st in self._stages.get(st.topic, ())]
            for st in gone:
                rest = [other for other in self._stages[st.topic] if other is not st]
                if rest:
                    self._stages[st.topic] = rest
                else:
                    del self._stages[st.topic]
                self._records_failed += st.n
        for st in gone:
            st.fail(
                DeliveryTimeoutError(
                    f"staged {st.n} record(s) for {st.topic!r} got no pool buffer within "
                    f"delivery_timeout_ms={self._delivery_timeout_ns // 1_000_000}"
                )
            )

    def _restore_stages(self, stages: list[AnyStage]) -> None:
        """Stages a flush could not get buffers for go back, first in line for their
        topic, ahead of any stage records went to meanwhile. State lock NOT held."""
        with self._lock:
            for stage in reversed(stages):
                self._stages[stage.topic] = [stage, *self._stages.get(stage.topic, ())]

    # ------------------------------------------------------------------------------
    # the append paths' view of this worker (worker.port)
    # ------------------------------------------------------------------------------

    def _port(self) -> AppendPort:
        """What ``send_batch``, held calls and stage flushes may use of this worker; one
        per call, so it never keeps the Worker alive. Runs in: worker, any lock."""
        return AppendPort(
            view=self._view,
            geo=self._geo,
            settings=self._settings,
            batch_size=self._batch_size,
            budget=self._records_room - self._slack,
            slack=self._slack,
            linger_ns=self._linger_ns,
            max_block_ms=self._max_block_ms,
            max_request_size=self._max_request_size,
            partitioner=self._partitioner,
            murmur=self._murmur,
            rand=self._rand,
            lock=self._lock,
            done_lock=self._done_lock,
            stages=self._stages,
            check_alive=self._check_alive,
            topic_locked=self._topic_locked,
            obtain_locked=self._obtain_locked,
            give_back_locked=self._give_back_locked,
            hand_over_locked=self._hand_over_locked,
            failed_locked=self._failed_locked,
            lease_used_locked=self._lease_used_locked,
            stage_added_locked=self._stage_added_locked,
            staged_total_locked=self._staged_total_locked,
            take_stages_locked=self._take_stages_locked,
            pool_free=self._pool_free,
            begin_flush=self._begin_flush,
            end_flush=self._end_flush,
            restore_stages=self._restore_stages,
        )

    def _hand_over_locked(self, batches: list[Written], created_ns: int) -> None:
        """The one hand-over of written batches, whatever appended them: DESCRIPTORs
        marked SEALED, outcomes registered for ``Done``, counters, and one ``Sealed``
        message each, sent together with a ``Release`` of the buffers their runs did not
        need (a batch put in the head of a longer run). ``created_ns``: when their first
        record was sent (the sender's delivery timeout counts from it). Runs in: worker,
        state lock held and the flush turn taken (so a partition's batches go in order)."""
        msgs = []
        for b in batches:
            bid = self._next_batch_id
            self._next_batch_id = bid + 1
            describe_batch(
                self._view, self._geo, self._slot, b.buffer, b.run, b.slot, bid, b.length,
                b.count, created_ns,
            )  # fmt: skip
            self._inflight[bid] = (b.outcome, b.count)
            self._records_appended += b.count
            self._bytes_appended += b.raw
            self._batches_sealed += 1
            msgs.append(ipc.encode(ipc.Sealed(b.buffer, b.run, b.slot, bid, b.length, b.count)))
        tails = tuple(
            t for b in batches for t in range(b.buffer + b.run, b.buffer + b.run + b.tail)
        )
        if tails:  # after the Sealed, which leaves them granted to this worker one by one
            msgs.append(ipc.encode(ipc.Release(1, tails)))
        self._mark_busy_locked()
        self._publish_locked()
        self._send_locked(b"".join(msgs))

    def _failed_locked(self, n: int) -> None:
        """``n`` records failed before any of their batches was handed over. Runs in:
        worker, state lock held."""
        self._records_failed += n
        self._publish_locked()

    def _lease_used_locked(self, used: int, grow: bool) -> None:
        """A flush wrote ``used`` buffers: the lease grows to cover such flushes
        (``grow``) and is topped up without waiting. Runs in: worker, state lock held."""
        if grow:
            self._grow_lease(used)
        with contextlib.suppress(ShmprodError):
            self._replenish_locked()

    # ------------------------------------------------------------------------------
    # buffers
    # ------------------------------------------------------------------------------

    def _obtain_locked(self, run: int, count: int, deadline_ns: int, partial: bool) -> list[int]:
        """``count`` granted runs of ``run`` buffers (first buffer of each), from the stock,
        the sender's spares, or by ``Alloc``; waits at most until ``deadline_ns``
        (BufferExhaustedError). ``partial``: single buffers the stock holds are enough,
        fewer than ``count`` (the caller asks again when it has used them; the refill may
        have come by then). What the stock gives is asked for again at once, while the
        caller writes into it, not after its flush. (Measured: a refill asked after one
        flush came, on a loaded machine, just after the next flush had found the stock
        short.)

        Runs in: worker, state lock held; the lock is released while waiting.
        """
        got: list[int] = []
        if self._prefetches and len(self._stock) < run * count:
            self._take_arrived_grants_locked()  # a refill asked for may be here, unread
        if run == 1 and self._stock:
            take = min(len(self._stock), count)
            got = self._stock[-take:]
            del self._stock[-take:]
            if take == count or partial:
                self._grow_lease(count)
                with contextlib.suppress(ShmprodError):
                    self._replenish_locked()
                return got
        elif run > 1:
            got = self._stock_runs_locked(run, count)
            got += self._spare_runs_locked(run, count - len(got))
            if len(got) == count:
                return got
        if run == 1:
            got += self._claim_spares_locked(count - len(got))
            if got and (len(got) == count or partial):
                self._grow_lease(count)
                with contextlib.suppress(ShmprodError):
                    self._replenish_locked()
                return got
        need = count - len(got)
        if run > 1 and self._stock and self._pool_free() < run * need:
            # the stock may be what the pool lacks for these runs: it goes back first
            # (Release comes before the Alloc), or the ask would wait for it
            self._release_stock_locked()
        rid = next(self._request_ids)
        req = _Request(run, need)
        self._requests[rid] = req
        waited_from = time.monotonic_ns()
        self._buffer_waits += 1
        if self._pool_free() * 2 >= self._geo.n_buffers:
            self._buffer_waits_pool_free += 1  # the stock was short, not the pool
        if run == 1:
            self._grow_lease(count)
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
        except BaseException as exc:
            del self._requests[rid]
            self._buffer_wait_ns += time.monotonic_ns() - waited_from
            self._give_back_locked(got + req.buffers, run)
            if isinstance(exc, BufferExhaustedError):
                # a process that cannot get all it needs holds nothing back: with a
                # stock kept, two processes short of a few buffers each waited for the
                # other's until their records' delivery timeout
                self._release_stock_locked()
            raise
        del self._requests[rid]
        self._buffer_wait_ns += time.monotonic_ns() - waited_from
        got += req.buffers
        if len(got) > count:
            self._give_back_locked(got[count:], run)
        return got[:count]

    def _claim_spares_locked(self, count: int) -> list[int]:
        """Up to ``count`` of the sender's spare buffers, claimed without asking: each
        DESCRIPTOR word swapped from SPARE to GRANTED by this slot (one claimer wins),
        then ``Claimed`` tells the sender, before any Sealed of them. A flush short of
        stock takes these instead of waiting for a Grant, however late the sender runs.
        (Measured: a flush waited 10.5 ms for a refill while half the pool was free, on
        a machine whose two cores ran four sending processes and the broker.) Nothing
        without the C extension (no atomic swap); nothing while a request waits (the
        sender keeps no spares then). Runs in: worker, state lock held."""
        if self._fatal is not None:
            return []
        got = claim_spares(self._view, self._geo, self._slot, count)
        if got:
            self._spares_claimed += len(got)
            self._send_msg_locked(ipc.Claimed(tuple(got)))
        return got

    def _spare_runs_locked(self, run: int, count: int) -> list[int]:
        """Up to ``count`` runs of ``run`` adjacent buffers made of spares claimed now
        and the stock: ``run * count`` spares join the stock, and the runs are taken
        from it as :meth:`_stock_runs_locked` does (the sender makes its spares as one
        adjacent block where the pool has one, and the claim takes the lowest first).
        Claimed spares no run took stay in the stock. (Measured: a flush of batches of
        two buffers each, staged records beyond one buffer, found 9 of the 11 pairs it
        needed in a stock of 19 and waited for a Grant while half the pool was free:
        spares served single buffers only.) Runs in: worker, state lock held."""
        if count <= 0:
            return []
        claimed = self._claim_spares_locked(run * count)
        if not claimed:
            return []
        self._stock.extend(claimed)
        return self._stock_runs_locked(run, count)

    def _take_arrived_grants_locked(self) -> None:
        """Applies, as a waiter does (:meth:`_apply_for_waiters_locked`), what reached
        the control socket but the I/O thread has not read yet, so a flush takes a refill
        (Grant) that is already here instead of asking again and waiting. The I/O thread
        reads only when it gets the GIL, which a thread sending in a loop holds for up to
        the switch interval (5 ms) at a time. ``Done`` messages and a Fatal stay, in
        order, for the I/O thread, woken to apply them. Never waits: when the I/O thread
        is reading, it applies them itself.
        Runs in: worker, any thread; state lock held, read lock taken if free."""
        if self._eof or not self._read_lock.acquire(blocking=False):
            return
        try:
            self._receive_held()
            self._apply_for_waiters_locked()
        finally:
            self._read_lock.release()
        if self._deferred or self._eof:
            self._wake()

    def _stock_runs_locked(self, run: int, count: int) -> list[int]:
        """Up to ``count`` runs of ``run`` adjacent buffers taken from the stock (first
        buffer of each). They were granted one by one; the sender takes them sealed or
        released as one run. Runs in: worker, state lock held."""
        stock = sorted(self._stock)
        firsts: list[int] = []
        i = 0
        while i + run <= len(stock) and len(firsts) < count:
            if stock[i + run - 1] - stock[i] == run - 1:  # sorted, distinct: adjacent
                firsts.append(stock[i])
                del stock[i : i + run]
            else:
                i += 1
        if firsts:
            self._stock = stock
        return firsts

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

    def _pool_free(self) -> int:
        """Free buffers in the sender's pool (its STATS counter; a moment old)."""
        free: int = L.U64.unpack_from(self._view, self._geo.stats + L.S_BUFFERS_FREE)[0]
        return free

    def _fair_share(self) -> int:
        """The most buffers this process keeps in stock: half the pool split over the
        attached processes (0 in a pool too small to share: every flush then asks). The
        other half stays free for flushes, so leases never starve one another."""
        workers = int(L.U64.unpack_from(self._view, self._geo.stats + L.S_WORKERS_ATTACHED)[0])
        return self._geo.n_buffers // (2 * max(1, workers))

    def _grow_lease(self, flush_buffers: int) -> None:
        """The lease covers the next few flushes as large as ``flush_buffers``, so one
        flush never waits for the grant that refills after the one before."""
        target = max(self._stock_target, LEASE_FLUSHES * flush_buffers)
        self._stock_target = min(self._fair_share(), target)

    def _replenish_locked(self) -> None:
        """Keeps a lease of buffers ahead of need, so a flush takes them from the stock
        and never waits for a round trip to the sender unless the pool is short. Asks
        (without waiting: the Grant goes to the stock) for what the stock and the asks
        in flight lack of its target, which grows to four times the largest flush seen,
        capped at a fair share; never more than a quarter of what the pool has free (an
        ask the pool cannot answer at once would wait at the head of its queue). Each
        flush asks again, up to LEASE_ASKS asks in flight: with one ask at a time, a
        flush that came before the last refill asked for nothing, and a third flush
        within one slow round trip found the stock short.
        Runs in: worker, state lock held."""
        if self._fatal is not None or self._state != OPEN:
            return
        target = min(self._stock_target, self._fair_share())
        excess = len(self._stock) - target
        if excess > 0:  # more than its share (late grants, fewer processes now): back
            back, self._stock = self._stock[:excess], self._stock[excess:]
            self._send_msg_locked(ipc.Release(1, tuple(back)))
            return
        if len(self._prefetches) >= LEASE_ASKS:
            return
        asked = sum(self._prefetches.values())
        want = min(target - len(self._stock) - asked, self._pool_free() // 4)
        if want <= 0:
            return
        rid = next(self._request_ids)
        self._prefetches[rid] = want
        self._send_msg_locked(ipc.Alloc(rid, 1, want))

    def _on_grant_locked(self, g: ipc.Grant) -> None:
        try:
            for b in g.buffers:
                self._geo.check_run(b, g.run)
        except IndexError as exc:
            log.error("ignoring a Grant with buffers outside the pool: %s", exc)
            return
        req = self._requests.get(g.request_id)
        if req is None:
            prefetch = self._prefetches.pop(g.request_id, None) is not None
            if prefetch:
                self._cond.notify_all()  # attach waits for the first lease
            if g.error:
                return
            if prefetch:  # the lease asked for it: the stock
                self._give_back_locked(list(g.buffers), g.run)
            elif self._fatal is None:  # a request given up (max_block_ms): not hoarded
                with contextlib.suppress(ShmprodError):
                    self._send_msg_locked(ipc.Release(g.run, tuple(g.buffers)))
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
            assert self._fatal is not None
            raise error_from_code(*self._fatal) from None  # closed, owner or sender dead

    def _mark_dead_locked(self, message: str) -> None:
        """Records why the producer cannot be reached (closed by its owner, owner or
        sender dead: the segment says which) and shuts the socket so the I/O thread fails
        all."""
        if self._fatal is None:
            self._fatal = self._cause(message)
            self._fast = None  # send() goes through Python, which refuses
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._cond.notify_all()

    def _cause(self, what: str) -> tuple[int, str]:
        """(code, message) of why the control connection ended, from the HEADER."""
        from shmprod.worker.cause import cause_after_break

        cause = cause_after_break(self._view)
        if type(cause) is ProducerError:  # nothing recorded: the sender is gone somehow
            return SenderDiedError.code, what
        return int(getattr(cause, "code", SenderDiedError.code)), f"{cause} ({what})"

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # ------------------------------------------------------------------------------
    # the I/O thread
    # ------------------------------------------------------------------------------

    def _io_main(self) -> None:
        """Runs in: the worker's I/O thread (one per Worker). See :func:`_io_loop`."""
        _io_loop(weakref.ref(self))

    def _receive(self) -> None:
        """Reads what the control socket has into ``_deferred``; notes EOF in ``_eof``.

        Runs in: worker I/O thread (the main loop, or a wait inside a callback); takes the
        read lock (:meth:`_take_arrived_grants_locked` reads from other threads).
        """
        with self._read_lock:
            self._receive_held()

    def _receive_held(self) -> None:
        """:meth:`_receive` with the read lock held. Never waits: the descriptor is
        non-blocking (a socket with a timeout is, underneath), and ``os.read`` is one
        ``read`` where ``socket.recv`` would first poll for up to the timeout -- data
        another reader took since this one's poll must not stall it."""
        try:
            # fileno() each time: -1 once the socket is closed (EBADF, read as EOF), never
            # a number the process may have reused for another file
            data = os.read(self._sock.fileno(), RECV_SIZE)
        except (BlockingIOError, InterruptedError):
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
                poller = select.poll()
                poller.register(self._sock.fileno(), select.POLLIN)
                if poller.poll(max(0.0, timeout) * 1000.0):
                    self._receive()
            finally:
                self._lock.acquire()
        if self._eof and self._fatal is None:
            self._fatal = self._cause(self._eof_message)
            self._fast = None  # send() goes through Python, which refuses
        self._apply_for_waiters_locked()

    def _apply_for_waiters_locked(self) -> None:
        """Applies at once what a waiter needs of the messages received (Grant,
        TopicInfo, Ready; a Fatal is noted) and keeps ``Done`` messages and the Fatal, in
        order, for :meth:`_handle`. Runs in: the I/O thread waiting in a callback, or a
        flush taking arrived Grants; state lock held (no other thread reads or swaps
        ``_deferred`` then, but the I/O thread's own ``_receive``, under the read lock
        the flush holds)."""
        keep: list[ipc.Message] = []
        for m in self._deferred:
            if type(m) is ipc.Done or type(m) is ipc.DoneSplit:
                keep.append(m)
            elif isinstance(m, ipc.Fatal):
                if self._fatal is None:
                    self._fatal = (m.error, m.message or "the producer failed or closed")
                    self._fast = None  # send() goes through Python, which refuses
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
        """Flushes stages whose linger expired, gives idle stock back; returns how long
        the I/O thread may sleep. Runs in: worker I/O thread."""
        with self._lock:
            if self._fatal is not None or self._state >= CLOSED:
                self._io_deadline_ns = now + int(IO_MAX_SLEEP * 1e9)
                return IO_MAX_SLEEP
            due = [t for t, sts in self._stages.items() if sts[0].deadline_ns <= now]
            expired = [
                st
                for sts in self._stages.values()
                for st in sts
                if now - (st.deadline_ns - self._linger_ns) >= self._delivery_timeout_ns
            ]
        if expired:  # the pool stayed full since they were sent (KIP-91)
            self._expire_stages(expired)
        if due:
            try:
                if not self._flush_stages(due, block=False, keep_when_full=True):
                    return FLUSH_WAIT_S  # a thread is flushing: look again soon
            except BufferExhaustedError:
                return FLUSH_WAIT_S  # the pool is full: they wait, up to delivery_timeout_ms
            except ShmprodError:
                return 0.0
        with self._lock:
            nxt = now + int(IO_MAX_SLEEP * 1e9)
            for sts in self._stages.values():
                if sts[0].deadline_ns < nxt:
                    nxt = sts[0].deadline_ns
            if self._stock and not self._stages and not self._requests and not self._flushing:
                idle_at = self._last_open_ns + (
                    IDLE_RELEASE_NS if self._batches_sealed else FIRST_IDLE_RELEASE_NS
                )
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
        done: list[tuple[ipc.Done | ipc.DoneSplit, BatchOutcome]] = []
        fatal: ipc.Fatal | None = None
        with self._lock:
            msgs, self._deferred = self._deferred, []
            inflight = self._inflight
            for m in msgs:
                if type(m) is ipc.Done or type(m) is ipc.DoneSplit:
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
            if isinstance(m, ipc.DoneSplit):
                outcome.resolve_pieces(_outcome_pieces(m))
            elif m.error == 0:
                outcome.succeed(m.base_offset, m.log_append_time_ms)
            else:
                outcome.fail(error_from_code(m.error, m.message, m.retriable))
        if done:
            with self._lock:
                for m, _ in done:
                    item = inflight.pop(m.batch_id, None)
                    if item is None:
                        continue
                    if isinstance(m, ipc.DoneSplit):
                        acked = sum(p.record_count for p in m.pieces if p.error == 0)
                        self._records_acked += acked
                        self._records_failed += item[1] - acked
                    elif m.error == 0:
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
                self._fast = None  # send() goes through Python, which refuses
            code, message = self._fatal
            stages = self._take_stages_locked(None)
            outcomes = list(self._inflight.values())
            _BUSY.discard(self)  # everything pending fails now
            self._stock.clear()
            self._topics.forget_pending()
            self._cond.notify_all()
        if outcomes or stages:
            error = error_from_code(code, message)
            for stage in stages:
                stage.fail(error)
            for outcome, _ in outcomes:
                outcome.fail(error)
            with self._lock:
                self._records_failed += sum(n for _, n in outcomes) + sum(st.n for st in stages)
                self._inflight.clear()
                with contextlib.suppress(ValueError):
                    self._publish_locked()
                self._cond.notify_all()


def _outcome_pieces(m: ipc.DoneSplit) -> tuple[OutcomePiece, ...]:
    """The futures' view of a split batch's pieces (errors built from their codes)."""
    return tuple(
        OutcomePiece(
            p.first_index,
            p.record_count,
            p.base_offset,
            p.log_append_time_ms,
            error_from_code(p.error, m.message, p.retriable) if p.error else None,
        )
        for p in m.pieces
    )


def _io_loop(ref: weakref.ref[WorkerCore]) -> None:
    """The I/O thread's loop (see the module docstring). It holds its Worker weakly,
    never while it sleeps in ``poll``. A Worker with records staged or batches pending
    is kept alive by :data:`_BUSY`: one its process dropped without ``close()`` delivers
    what it had, then becomes garbage, and its finalizer (:func:`_release`) detaches it.

    Runs in: the worker's I/O thread (one per Worker).
    """
    w = ref()
    if w is None:
        return
    sock, wake = w._sock, w._wake_r
    # poll, not select: a process may hold descriptors numbered past FD_SETSIZE (1024)
    poller = select.poll()
    sock_fd, wake_fd = sock.fileno(), wake.fileno()
    poller.register(sock_fd, select.POLLIN)
    poller.register(wake_fd, select.POLLIN)
    try:
        while not w._stop:
            if w._deferred:
                w._handle()
            if w._eof:
                if not w._stop:
                    w._fail_everything(*w._cause(w._eof_message))
                return
            timeout = w._tick(time.monotonic_ns())
            with w._lock:
                if not (w._stages or w._inflight or w._flushing):
                    _BUSY.discard(w)  # nothing to deliver: the process may drop it now
            del w  # not held while asleep
            try:
                ready = {fd for fd, _ in poller.poll(timeout * 1000.0)}
            except (OSError, ValueError):
                ready = set()
            w = ref()
            if w is None or w._stop:
                return
            if wake_fd in ready:
                with contextlib.suppress(OSError):
                    wake.recv(4096)
            if sock_fd in ready:
                w._receive()
    except BaseException as exc:
        w = ref()
        if w is not None:
            log.exception("shmprod worker I/O thread failed")
            w._fail_everything(ProducerError.code, f"the worker's I/O thread failed: {exc!r}")


def _release(
    sock: socket.socket,
    wakes: tuple[socket.socket, socket.socket],
    seg: Segment,
    stages: dict[str, list[AnyStage]],
    inflight: dict[int, tuple[BatchOutcome, int]],
) -> None:
    """A Worker became garbage without ``close()``: its pending futures fail, it says
    ``Bye`` (the sender frees its slot and takes its buffers back), and its sockets and
    mapping close; its I/O thread then ends on its own. Runs in: whichever thread drops
    the last reference (or at exit); never touches the Worker itself."""
    error = ProducerClosedError(
        "the Worker was garbage-collected without close(): call close() (or use it as a "
        "context manager) to deliver what it staged"
    )
    for sts in list(stages.values()):
        for st in sts:
            st.fail(error)
    for outcome, _ in list(inflight.values()):
        outcome.fail(error)
    with contextlib.suppress(OSError):
        sock.sendall(ipc.encode(ipc.Bye()))
    for s in (sock, *wakes):
        with contextlib.suppress(OSError):
            s.close()
    with contextlib.suppress(BufferError, OSError):
        seg.close()
