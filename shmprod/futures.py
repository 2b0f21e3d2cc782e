"""Futures of records sent through the shared producer, resolved in the process that sent.

The sender answers ONE ``Done`` per Kafka record batch, so completion is per batch too:

* :class:`BatchOutcome` is the single completion of one Kafka batch (base offset or
  error). Every record of the batch shares it; resolving a batch costs O(1) plus the
  callbacks somebody registered, never O(records).
* :class:`RecordFuture` (from ``send``) is one small object: the record's stage and its
  row (:mod:`shmprod.worker.staging`). Once the stage is flushed, the stage maps each
  row to its batch's outcome and its index in that batch: its offset is
  ``base_offset + index`` (offsetDelta is the index), computed when asked.
* :class:`BatchFuture` (from ``send_batch``) spans the Kafka batches of one call and
  fills ``offsets`` / ``partitions`` / ``timestamps_ms`` arrays, in the caller's row
  order, with numpy once every batch is done.

Both futures follow :class:`concurrent.futures.Future`'s API (``result``, ``exception``,
``done``, ``add_done_callback``, ``cancel`` -> False) but are not subclasses: a real
``Future`` builds a Condition per instance, too heavy for one per record. Use
:meth:`RecordFuture.to_concurrent` where a real one is needed (``concurrent.futures.wait``,
``asyncio.wrap_future``).

Callbacks run in the worker's I/O thread of the process that sent (or at once in the
calling thread when the future is already done); an exception in a callback is logged
and does not affect other callbacks. The first outcome of a batch sticks.

Runs in: worker (process-local objects, never in shared memory). Locking: every
outcome of one Worker shares that Worker's ``done_lock``, held only for a few field
updates; waiting uses a :class:`threading.Event` created on demand.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from shmprod.speedups import FutureCore

__all__ = [
    "BatchFailure",
    "BatchFuture",
    "BatchMetadata",
    "BatchOutcome",
    "OutcomePiece",
    "RecordFuture",
    "RecordMetadata",
]

if TYPE_CHECKING:
    from shmprod.worker.staging import Stage

log = logging.getLogger(__name__)

PENDING: Final = 0
SUCCEEDED: Final = 1
FAILED: Final = 2

I32Array = npt.NDArray[np.int32]
I64Array = npt.NDArray[np.int64]


class RecordMetadata(NamedTuple):
    """Where one record landed. ``offset`` is -1 with ``acks=0`` (no answer)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(frozen=True, slots=True, eq=False)
class BatchMetadata:
    """Where the rows of one ``send_batch`` call landed, in the caller's row order.

    ``offsets`` is -1 for rows not acknowledged (``acks=0``, or the rows of failed
    batches in :meth:`BatchFuture.partial_result`). ``timestamps_ms`` is each record's
    CreateTime, or the broker's LogAppendTime when the topic uses it.
    """

    topic: str
    partitions: I32Array
    offsets: I64Array
    timestamps_ms: I64Array

    def __len__(self) -> int:
        return len(self.offsets)


Listener = Callable[["BatchOutcome"], object]


class OutcomePiece(NamedTuple):
    """The outcome of records ``[first_index, first_index + record_count)`` of a batch
    the sender had to split (the broker refused it as too large)."""

    first_index: int
    record_count: int
    base_offset: int
    log_append_time_ms: int
    error: BaseException | None


class BatchOutcome:
    """The one completion of one Kafka record batch, shared by all its records.

    Resolved once, by :meth:`succeed` or :meth:`fail`; later calls are ignored (the
    first outcome sticks). Runs in: worker.
    """

    __slots__ = (
        "_base_offset",
        "_error",
        "_event",
        "_listeners",
        "_lock",
        "_log_append_time_ms",
        "_pieces",
        "_state",
        "partition",
        "topic",
    )

    def __init__(self, lock: threading.Lock, topic: str, partition: int) -> None:
        self._lock = lock
        self.topic = topic
        self.partition = partition
        self._state = PENDING
        self._base_offset = -1
        self._log_append_time_ms = -1
        self._error: BaseException | None = None
        self._pieces: tuple[OutcomePiece, ...] | None = None
        self._event: threading.Event | None = None
        self._listeners: list[Listener] | None = None

    # --- reading ----------------------------------------------------------------------

    def done(self) -> bool:
        return self._state != PENDING

    @property
    def succeeded(self) -> bool:
        return self._state == SUCCEEDED

    @property
    def base_offset(self) -> int:
        """The broker's offset of the batch's first record (-1 unknown or ``acks=0``)."""
        return self._base_offset

    @property
    def log_append_time_ms(self) -> int:
        """The broker's LogAppendTime of the batch, -1 when the topic uses CreateTime."""
        return self._log_append_time_ms

    @property
    def error(self) -> BaseException | None:
        """The error, or the first failed piece's error of a split batch."""
        return self._error

    @property
    def pieces(self) -> tuple[OutcomePiece, ...] | None:
        """The pieces of a batch the sender split, in record order; None otherwise."""
        return self._pieces

    def record_outcome(self, index: int) -> tuple[int, int, BaseException | None]:
        """``(offset, log_append_time_ms, error)`` of record ``index`` once resolved."""
        pieces = self._pieces
        if pieces is None:
            base = self._base_offset
            return (base + index if base >= 0 else -1), self._log_append_time_ms, self._error
        for p in pieces:
            if index < p.first_index + p.record_count:
                base = p.base_offset
                off = base + index - p.first_index if p.error is None and base >= 0 else -1
                return off, p.log_append_time_ms, p.error
        raise IndexError(f"record {index} is beyond the batch's pieces")

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until resolved or ``timeout`` seconds passed; True once resolved."""
        if self._state != PENDING:
            return True
        with self._lock:
            if self._state != PENDING:
                return True
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        return event.wait(timeout)

    def add_listener(self, fn: Listener) -> None:
        """Calls ``fn(self)`` once resolved: now, in this thread, if it already is."""
        with self._lock:
            if self._state == PENDING:
                if self._listeners is None:
                    self._listeners = [fn]
                else:
                    self._listeners.append(fn)
                return
        _call(fn, self)

    # --- resolving --------------------------------------------------------------------

    def succeed(self, base_offset: int, log_append_time_ms: int = -1) -> None:
        """Resolves the batch as written at ``base_offset``. Runs in: worker I/O thread."""
        with self._lock:
            if self._state != PENDING:
                return
            self._base_offset = base_offset
            self._log_append_time_ms = log_append_time_ms
            self._state = SUCCEEDED
            event, listeners = self._event, self._listeners
            self._listeners = None
        self._notify(event, listeners)

    def resolve_pieces(self, pieces: tuple[OutcomePiece, ...]) -> None:
        """Resolves a batch the sender split: each piece succeeded or failed on its own.

        The batch counts as failed (``error``: the first failed piece's) when any piece
        failed; records of the pieces that succeeded still have their offsets.
        Runs in: worker I/O thread.
        """
        first_error = next((p.error for p in pieces if p.error is not None), None)
        with self._lock:
            if self._state != PENDING:
                return
            self._pieces = pieces
            self._base_offset = pieces[0].base_offset if pieces[0].error is None else -1
            self._log_append_time_ms = pieces[0].log_append_time_ms
            self._error = first_error
            self._state = SUCCEEDED if first_error is None else FAILED
            event, listeners = self._event, self._listeners
            self._listeners = None
        self._notify(event, listeners)

    def fail(self, error: BaseException) -> None:
        """Resolves the batch as failed with ``error``. Runs in: worker (any thread)."""
        with self._lock:
            if self._state != PENDING:
                return
            self._error = error
            self._state = FAILED
            event, listeners = self._event, self._listeners
            self._listeners = None
        self._notify(event, listeners)

    def _notify(self, event: threading.Event | None, listeners: list[Listener] | None) -> None:
        if event is not None:
            event.set()
        if listeners:
            for fn in listeners:
                _call(fn, self)


def _call(fn: Callable[[Any], object], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:
        log.exception("exception in a shmprod future callback %r", fn)


def _timeout_error(timeout: float | None) -> concurrent.futures.TimeoutError:
    return concurrent.futures.TimeoutError(f"no outcome within {timeout} s")


class RecordFuture(FutureCore):
    """The outcome of one record sent with ``send``: its stage and its row in it.

    Behaves like :class:`concurrent.futures.Future` (``result``, ``exception``,
    ``done``, ``add_done_callback``); a record cannot be cancelled once sent. Until its
    stage is flushed (at most ``linger_ms``) it is pending; then it reads its batch's
    outcome: offset ``base_offset + index``. ``RecordFuture(stage, row)``: the stage and
    row are :class:`~shmprod.speedups.FutureCore`'s, so the C path of ``send()`` makes
    one without running Python.
    """

    __slots__ = ()
    _stage: Stage

    def __reduce__(self) -> Any:
        raise TypeError("a RecordFuture belongs to the process that sent; it cannot be pickled")

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error() else "succeeded")
        return f"<RecordFuture {self._stage.topic} row {self._row} {state}>"

    def _outcome(self) -> BatchOutcome | None:
        s = self._stage
        if not s.flushed or s.error is not None:
            return None
        assert s.row_batch is not None
        return s.outcomes[int(s.row_batch[self._row])]

    def _error(self) -> BaseException | None:
        s = self._stage
        if s.error is not None:
            return s.error
        o = self._outcome()
        if o is None or not o.done():
            return None
        assert s.row_index is not None
        return o.record_outcome(int(s.row_index[self._row]))[2]

    def _wait(self, timeout: float | None) -> BatchOutcome | None:
        """Waits (bounded) until done; the outcome, or None when the stage failed."""
        s = self._stage
        if not s.flushed:
            start = time.monotonic()
            if not s.wait_flushed(timeout):
                raise _timeout_error(timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        if s.error is not None:
            return None
        o = self._outcome()
        assert o is not None
        if not o.done() and not o.wait(timeout):
            raise _timeout_error(timeout)
        return o

    def done(self) -> bool:
        s = self._stage
        if not s.flushed:
            return False
        o = self._outcome()
        return o is None or o.done()

    def running(self) -> bool:
        return not self.done()

    def cancel(self) -> bool:
        """Always False: a record handed to the producer cannot be taken back."""
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> RecordMetadata:
        """The record's metadata; raises its error, or TimeoutError after ``timeout`` s."""
        o = self._wait(timeout)
        s = self._stage
        if o is None:
            assert s.error is not None
            raise s.error
        assert s.row_index is not None
        offset, lat, error = o.record_outcome(int(s.row_index[self._row]))
        if error is not None:
            raise error
        ts = lat if lat >= 0 else s.timestamp_of(self._row)
        return RecordMetadata(s.topic, o.partition, offset, ts)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The record's error, or None once it succeeded; TimeoutError after ``timeout``."""
        o = self._wait(timeout)
        if o is None:
            return self._stage.error
        assert self._stage.row_index is not None
        return o.record_outcome(int(self._stage.row_index[self._row]))[2]

    def add_done_callback(self, fn: Callable[[RecordFuture], object]) -> None:
        """Calls ``fn(self)`` once done (in the worker's I/O thread, or now if done)."""
        self._stage.add_callback(self._row, fn, self)

    def to_concurrent(self) -> concurrent.futures.Future[RecordMetadata]:
        """A real :class:`concurrent.futures.Future` resolved with this one."""
        return _chain(self)


def _chain(fut: RecordFuture | BatchFuture) -> concurrent.futures.Future[Any]:
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()
    out.set_running_or_notify_cancel()

    def copy(f: Any) -> None:
        exc = f.exception(0)
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result(0))

    fut.add_done_callback(copy)
    return out


class BatchFailure(NamedTuple):
    """Rows of one ``send_batch`` call that failed together (see
    :meth:`BatchFuture.failures`)."""

    rows: npt.NDArray[np.intp]  # input rows, ascending
    error: BaseException
    handed_over: bool  # False: the rows never left the process that sent


class Stamps:
    """Each row's CreateTime, kept small until it is asked for: runs of rows in input
    order, each run one timestamp for all its rows (an int: a ``send_batch`` call without
    per-row timestamps) or one per row (an array). A call's future then holds no
    per-row timestamps, and the future of held calls written as one holds one run per
    call. Runs in: worker."""

    __slots__ = ("n", "runs")

    def __init__(self, runs: list[tuple[int, I64Array | int]]) -> None:
        self.runs = runs
        self.n = sum(count for count, _ in runs)

    @classmethod
    def of(cls, n: int, timestamps_ms: I64Array | int) -> Stamps:
        """``n`` rows with ``timestamps_ms``: one for all (an int) or one per row."""
        if not isinstance(timestamps_ms, int) and len(timestamps_ms) != n:
            raise ValueError("one timestamp per row, or one for every row")
        return cls([(n, timestamps_ms)])

    def rows(self) -> I64Array:
        """Every row's timestamp, in a new array: one slice assignment per run, that is
        per call (held calls joined their columns per call too)."""
        out = np.empty(self.n, np.int64)
        at = 0
        for count, ts in self.runs:
            out[at : at + count] = ts
            at += count
        return out


def smallest_index(a: npt.NDArray[Any], bound: int) -> npt.NDArray[Any]:
    """``a``, whose entries are in ``[0, bound)``, in the smallest type that holds them
    (uint8, uint16, int32; as it is beyond): row numbers and batch indexes a future
    keeps, at a quarter to a half of int32's or int64's bytes. Only ever an index."""
    if bound <= 1 << 8:
        return a.astype(np.uint8)
    if bound <= 1 << 16:
        return a.astype(np.uint16)
    if bound <= 1 << 31 and a.dtype != np.int32:
        return a.astype(np.int32)
    return a


class BatchFuture:
    """The outcome of one ``send_batch`` call: the Kafka batches it was split into.

    Rows were grouped by partition with a stable sort (``order[j]`` is the input row
    at sorted position ``j``) and cut into consecutive batches of ``counts[b]`` rows, in
    sorted order. A row's offset is ``base_offset[b] + (j - start[b])``: filled for all
    rows at once with numpy when the last batch resolves. The first error sticks.

    A call that was held to be written with the next ones (:mod:`shmprod.worker.held`)
    gets a future made by :meth:`held`: pending until the held calls are written, then
    bound to rows ``[lo, hi)`` of their one future (:meth:`_bind`), or failed with
    nothing handed over (:meth:`_fail`). Its error is the first failed batch's among
    those holding its rows.
    """

    __slots__ = (
        "_callbacks",
        "_counts",
        "_error",
        "_event",
        "_failed",
        "_lock",
        "_metadata",
        "_n",
        "_order",
        "_outcomes",
        "_partitions",
        "_remaining",
        "_stamps",
        "_whole",
        "topic",
    )

    def __init__(
        self,
        lock: threading.Lock,
        topic: str,
        partitions: I32Array | None,
        timestamps_ms: I64Array | Stamps,
        order: npt.NDArray[np.intp] | None,
        outcomes: list[BatchOutcome],
        counts: list[int],
    ) -> None:
        """``partitions``/``timestamps_ms``: per input row (the timestamps as an array or
        as :class:`Stamps`); ``order``: sorted position -> input row (None: identity);
        ``outcomes[b]`` covers ``counts[b]`` sorted rows. ``partitions`` None: a held
        call's future (see :meth:`held`).

        Until it resolves a future keeps 4 bytes a row for the partitions and 4 for
        ``order`` (int32), and its timestamps as the call gave them (one int for every
        row unless given per row); then its :class:`BatchMetadata` (8 more for offsets
        and 8 for timestamps). Held futures keep views of their whole's."""
        stamps = (
            timestamps_ms
            if isinstance(timestamps_ms, Stamps)
            else Stamps.of(len(timestamps_ms), timestamps_ms)
        )
        n = stamps.n
        if partitions is not None and len(partitions) != n:
            raise ValueError("one partition per row")
        if sum(counts) != (0 if partitions is None else n) or len(counts) != len(outcomes):
            raise ValueError("batch counts must cover every row exactly once")
        self._lock = lock
        self.topic = topic
        self._n = n
        self._partitions = partitions  # None: held, not bound yet
        self._stamps = stamps
        self._order = None if order is None else smallest_index(order, len(order))
        self._outcomes = outcomes
        self._counts = counts
        self._remaining = len(outcomes)
        self._error: BaseException | None = None
        self._metadata: BatchMetadata | None = None
        self._event = threading.Event()
        self._callbacks: list[Callable[[BatchFuture], object]] = []
        self._failed: list[BatchFailure] | None = None
        self._whole: tuple[BatchFuture, int, int] | None = None  # held: (whole, lo, hi)
        if partitions is None:  # held: bound or failed later
            return
        if not outcomes:
            self._finish()
            return
        for o in outcomes:
            o.add_listener(self._on_batch)

    @classmethod
    def held(
        cls, lock: threading.Lock, topic: str, timestamps_ms: I64Array | Stamps
    ) -> BatchFuture:
        """The future of a held call of as many rows as ``timestamps_ms`` has, pending
        until :meth:`_bind` or :meth:`_fail`. Runs in: worker."""
        return cls(lock, topic, None, timestamps_ms, None, [], [])

    def _bind(self, whole: BatchFuture, lo: int, hi: int) -> None:
        """This held call is rows ``[lo, hi)`` of ``whole``: resolved with it. Runs in:
        worker, the thread that wrote the held calls."""
        self._whole = (whole, lo, hi)

        def done(w: BatchFuture) -> None:
            error = w._range_error(lo, hi)
            with self._lock:
                self._error = error
            m = w._metadata
            assert m is not None
            self._metadata = BatchMetadata(
                self.topic, m.partitions[lo:hi], m.offsets[lo:hi], m.timestamps_ms[lo:hi]
            )
            self._partitions = m.partitions[lo:hi]
            self._resolve()

        whole.add_done_callback(done)

    def _fail(self, error: BaseException) -> None:
        """This held call was never handed over: every row fails with ``error``."""
        if self._event.is_set():
            return
        with self._lock:
            self._error = error
        n = self._n
        if self._partitions is None:
            self._partitions = np.full(n, -1, np.int32)
        self._metadata = BatchMetadata(
            self.topic, self._partitions, np.full(n, -1, np.int64), self._stamps.rows()
        )
        self._resolve()

    def _range_error(self, lo: int, hi: int) -> BaseException | None:
        """The first failed batch's error among those holding rows ``[lo, hi)``, once
        done (the order of the batches, then of a split batch's pieces)."""
        for f in self._all_failures():
            if int(np.count_nonzero((f.rows >= lo) & (f.rows < hi))):
                return f.error
        return None

    def _all_failures(self) -> list[BatchFailure]:
        """:meth:`failures` once done, computed once (batch order, then piece order)."""
        if self._failed is not None:
            return self._failed
        out: list[BatchFailure] = []
        if self._error is not None and self._whole is not None:
            whole, lo, hi = self._whole
            for f in whole._all_failures():
                rows = f.rows[(f.rows >= lo) & (f.rows < hi)]
                if len(rows):
                    out.append(BatchFailure(rows - lo, f.error, f.handed_over))
        elif self._error is not None and not self._outcomes:  # held, never handed over
            out.append(BatchFailure(np.arange(self._n), self._error, False))
        elif self._error is not None:
            errors: list[tuple[BaseException | None, bool]] = []
            counts: list[int] = []
            for o, count in zip(self._outcomes, self._counts, strict=True):
                if o.pieces is None:
                    errors.append((o.error, o.partition >= 0))
                    counts.append(count)
                else:
                    errors.extend((p.error, True) for p in o.pieces)
                    counts.extend(p.record_count for p in o.pieces)
            ids = np.arange(len(counts), dtype=np.intp)
            row_piece = np.repeat(ids, np.array(counts, dtype=np.int64))
            if self._order is not None:
                sorted_piece, row_piece = row_piece, np.empty(len(row_piece), np.intp)
                row_piece[self._order] = sorted_piece
            for k, (error, handed) in enumerate(errors):
                if error is not None:
                    rows = np.flatnonzero(row_piece == k)
                    if len(rows):
                        out.append(BatchFailure(rows, error, handed))
        self._failed = out
        return out

    def failures(self, timeout: float | None = None) -> list[BatchFailure]:
        """The failed rows once done, one entry per failed Kafka batch (or piece of a
        batch the sender split): its rows (input order, ascending), its error, and
        whether they were handed over to the sender (False: they never left this
        process, e.g. the pool stayed full); empty when every row succeeded."""
        if not self._event.wait(timeout):
            raise _timeout_error(timeout)
        return self._all_failures()

    def __reduce__(self) -> Any:
        raise TypeError("a BatchFuture belongs to the process that sent; it cannot be pickled")

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "succeeded")
        return f"<BatchFuture {self.topic} rows={self._n} {state}>"

    def _on_batch(self, outcome: BatchOutcome) -> None:
        with self._lock:
            if self._error is None and outcome.error is not None:
                self._error = outcome.error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self._metadata = self._build()
        self._resolve()

    def _resolve(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._event.set()
        for fn in callbacks:
            _call(fn, self)

    def _build(self) -> BatchMetadata:
        """Offsets and timestamps of every row, in input order (numpy, no row loop)."""
        n = self._n
        assert self._partitions is not None
        parts: list[tuple[int, int, bool, int]] = []  # count, base offset, ok, append time
        for o, count in zip(self._outcomes, self._counts, strict=True):
            if o.pieces is None:
                parts.append((count, o.base_offset, o.succeeded, o.log_append_time_ms))
            else:  # a batch the sender split: each piece has its own offsets
                parts.extend(
                    (p.record_count, p.base_offset, p.error is None, p.log_append_time_ms)
                    for p in o.pieces
                )
        counts = np.array([p[0] for p in parts], dtype=np.int64)
        starts = np.cumsum(counts) - counts
        base = np.array([p[1] for p in parts], dtype=np.int64)
        ok = np.array([p[2] for p in parts], dtype=bool)
        lat = np.array([p[3] for p in parts], dtype=np.int64)
        valid = ok & (base >= 0)
        shift = np.where(valid, base - starts, 0)
        sorted_offsets = np.arange(n, dtype=np.int64) + np.repeat(shift, counts)
        if not valid.all():
            sorted_offsets[~np.repeat(valid, counts)] = -1
        timestamps = self._stamps.rows()
        use_lat = ok & (lat >= 0)
        if use_lat.any():
            rows = np.repeat(use_lat, counts)
            sorted_lat = np.repeat(lat, counts)
            pos = np.flatnonzero(rows)
            target = pos if self._order is None else self._order[pos]
            timestamps[target] = sorted_lat[pos]
        if self._order is None:
            offsets = sorted_offsets
        else:
            offsets = np.empty(n, dtype=np.int64)
            offsets[self._order] = sorted_offsets
        return BatchMetadata(self.topic, self._partitions, offsets, timestamps)

    def done(self) -> bool:
        return self._event.is_set()

    def running(self) -> bool:
        return not self._event.is_set()

    def cancel(self) -> bool:
        """Always False: rows handed to the producer cannot be taken back."""
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> BatchMetadata:
        """Every row's partition and offset; raises the first batch error."""
        if not self._event.wait(timeout):
            raise _timeout_error(timeout)
        if self._error is not None:
            raise self._error
        assert self._metadata is not None
        return self._metadata

    def partial_result(self, timeout: float | None = None) -> BatchMetadata:
        """Like :meth:`result` but never raises a batch error: rows of failed batches
        have offset -1 (see :meth:`exception` for the first error)."""
        if not self._event.wait(timeout):
            raise _timeout_error(timeout)
        assert self._metadata is not None
        return self._metadata

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._event.wait(timeout):
            raise _timeout_error(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[BatchFuture], object]) -> None:
        """Calls ``fn(self)`` once every batch is done (I/O thread, or now if done)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def to_concurrent(self) -> concurrent.futures.Future[BatchMetadata]:
        """A real :class:`concurrent.futures.Future` resolved with this one."""
        return _chain(self)
