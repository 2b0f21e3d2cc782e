"""Records sent one at a time, staged per topic and encoded in bulk.

``send()`` does the least it can per record: check the input, append the key, the value
(immutable ``bytes`` or None) and the timestamp to three lists of this process's
:class:`Stage` of the topic (no copy, no encoding, no partitioning, no shared memory),
and return a :class:`~shmprod.futures.RecordFuture` that names the stage and the row. A
row sent with headers also gets its encoded headers section, in a fourth list the stage
keeps once any row has headers. A stage is flushed -- partitioned as ``send_batch`` is
(murmur2 of every key at once, one stable sort by partition), cut into whole Kafka
batches and written record by record from the staged ``bytes`` straight into granted
buffers by the C extension (:mod:`shmprod.worker.direct`; no extension: each list joined
into an Arrow column for ``send_batch``'s vectorized encoder), then handed to the
sender -- when:

* it holds about ``batch_size`` bytes per partition of the topic (every partition's batch
  would be full if keys spread evenly), or ``batch_size`` bytes for one explicit
  partition, in the thread that filled it;
* its first record is ``linger_ms`` old: the worker's I/O thread flushes it, so linger
  holds when the caller stops sending;
* the process calls ``flush``/``close``, or ``send_batch`` to the same topic (records of
  a process reach each partition in the order it sent them).

Why (measured, ARCHITECTURE.md "The per-record path"): appending each record into a
shared-memory batch of its partition cost 7-14 us of Python per record (murmur2 and the
varint header in Python), and every new batch waited for a buffer from the sender; the
staged path costs about a microsecond of Python per record plus a fraction in the bulk
encoder, and its common case runs in C (:mod:`shmprod.speedups`: about a quarter).
Lists rather than a ``bytearray`` of the bytes and ``array`` offsets (measured: three
list appends about 35 ns a record, two extends and three ``array`` appends about 250
ns); writing from the lists copies each value once, where joining them into columns,
reordering those by partition and encoding a records section copied it four times
(ARCHITECTURE.md, "Staged rows written straight into the pool").

Runs in: worker. A stage is process-local memory, changed only under the Worker's state
lock; it becomes immutable once taken for a flush.
"""

from __future__ import annotations

import struct
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from shmprod import speedups
from shmprod.errors import ProducerError
from shmprod.futures import BatchFuture, BatchOutcome, RecordFuture, _call, smallest_index
from shmprod.protocol.records import Header
from shmprod.speedups import StageCore, append_row
from shmprod.worker.inputs import NO_HEADERS

if TYPE_CHECKING:
    import pyarrow as pa
else:
    from shmprod.arrow import pa


I64 = npt.NDArray[np.int64]

__all__ = [
    "RECORD_OVERHEAD_MAX",
    "STAGED_MAX_BYTES",
    "STAGED_OVERHEAD",
    "STAGE_MAX_BYTES",
    "AnyStage",
    "HeldCalls",
    "Stage",
]

# Largest varint overhead of one record besides key, value and headers: length (5),
# attributes (1), timestampDelta (10), offsetDelta (5), keyLength (5), valueLength (5).
RECORD_OVERHEAD_MAX: Final = 31
STAGED_OVERHEAD: Final = 12  # about the varint bytes of a staged record, for sizing
STAGE_MAX_BYTES: Final = 8 << 20  # a stage is flushed by this size at the latest
STAGED_MAX_BYTES: Final = 32 << 20  # ... and every stage of the process by this total
_I64: Final = struct.Struct("=q")  # one partition's staged bytes in Stage.part_bytes


class Stage(StageCore):
    """The staged records of one topic in one process (see the module docstring).

    The fields ``send()`` touches (``values``, ``keys``, ``timestamps``, ``n``,
    ``nbytes``, ``limit``, ``headers``, ``header_max``, ``partitions``, ``part_bytes``,
    ``batch_size``) are :class:`~shmprod.speedups.StageCore`'s, so the C path of
    ``send()`` reaches them without attribute lookups."""

    __slots__ = (
        "_callbacks",
        "_event",
        "_lock",
        "deadline_ns",
        "error",
        "flushed",
        "outcomes",
        "row_batch",
        "row_index",
        "sizes",
        "stamp_starts",
        "stamp_values",
        "topic",
    )

    def __init__(
        self, topic: str, deadline_ns: int, lock: threading.Lock, limit: int = 1 << 62
    ) -> None:
        self.topic = topic
        self.deadline_ns = deadline_ns
        self.limit = limit  # staged bytes at which it is flushed
        self._lock = lock  # the Worker's done lock (futures' lock)
        # one entry per row: bytes (never a mutable buffer: send copies those) or None
        self.values: list[bytes | None] = []
        self.keys: list[bytes | None] = []
        self.timestamps: list[int] = []
        self.partitions: list[int] | None = None  # explicit partition per row, -1 none
        # bytes staged per explicit partition (native int64 each), for the partitions
        # the topic had when the first row with one came
        self.part_bytes: bytearray | None = None
        self.batch_size = 0
        # each row's encoded headers section, once any row has headers (b"\x00": none)
        self.headers: list[bytes] | None = None
        self.header_max = 1  # largest encoded headers section of a row
        self.n = 0
        self.nbytes = 0  # key + value + header bytes staged
        # set once flushed (or failed before anything was handed over)
        self.flushed = False
        self.error: BaseException | None = None
        self.outcomes: list[BatchOutcome] = []
        # once flushed: each row's batch (an index into outcomes) and its index there,
        # in the smallest type that holds them (futures.smallest_index)
        self.row_batch: npt.NDArray[Any] | None = None
        self.row_index: npt.NDArray[Any] | None = None
        # once flushed: the timestamps as runs (stamp_starts[r]: the first row of run r,
        # whose rows have stamp_values[r]), or one per row (stamp_starts None)
        self.stamp_starts: array[int] | None = None
        self.stamp_values: array[int] | None = None
        # each row's key and value length (two int32, -1: None), set by row_lengths
        self.sizes: npt.NDArray[np.int32] | None = None
        self._event: threading.Event | None = None
        self._callbacks: list[tuple[int, Callable[[RecordFuture], object], RecordFuture]] = []

    # -- appending (worker, state lock held) -------------------------------------------

    def append(self, key: bytes | None, value: bytes | None, timestamp_ms: int, size: int) -> int:
        """Stages one checked record's key, value and timestamp; returns its row. An
        explicit partition or headers of the row are set before (their row is ``n``)."""
        return append_row(self, key, value, timestamp_ms, size)

    def set_partition(
        self, row: int, partition: int, nbytes: int, batch_size: int, partitions: int
    ) -> None:
        """Row ``row`` goes to ``partition`` (explicit, checked against the topic's
        ``partitions``); counts its bytes against the partition's batch
        (:meth:`partition_room`)."""
        if self.partitions is None or self.part_bytes is None:
            self.partitions = [-1] * row
            self.part_bytes = bytearray(8 * partitions)
            self.batch_size = batch_size
        used = self.part_bytes
        if len(used) < 8 * partitions:  # the topic grew
            used.extend(bytes(8 * partitions - len(used)))
        self.partitions.append(partition)
        _I64.pack_into(used, 8 * partition, _I64.unpack_from(used, 8 * partition)[0] + nbytes)

    def partition_room(self, partition: int) -> int:
        """Bytes an explicit partition's batch still takes before it is full."""
        used = self.part_bytes
        if used is None or 8 * partition >= len(used):
            return 1 << 62
        staged: int = _I64.unpack_from(used, 8 * partition)[0]
        return (1 << 62) if staged == 0 else self.batch_size - staged

    def pad_partition(self) -> None:
        """Called for a row without an explicit partition once some row had one."""
        if self.partitions is not None:
            self.partitions.append(-1)

    def set_headers(self, row: int, section: bytes) -> None:
        """Row ``row`` carries the encoded headers section ``section``."""
        if self.headers is None:
            self.headers = [NO_HEADERS] * row
        self.headers.append(section)
        self.header_max = max(self.header_max, len(section))

    def pad_headers(self) -> None:
        """Called for a row without headers once some row had them."""
        if self.headers is not None:
            self.headers.append(NO_HEADERS)

    # -- columns (worker, the stage taken for a flush) ---------------------------------

    def value_column(self) -> pa.Array:
        return _column(self.values, self.values.count(None))

    def key_column(self) -> pa.Array | None:
        nulls = self.keys.count(None)
        if nulls == self.n:
            return None  # no row has a key
        return _column(self.keys, nulls)

    def row_lengths(self) -> npt.NDArray[np.int64]:
        """Key + value bytes of every row (a null counts 0). With the extension it also
        keeps each row's key and value length in ``sizes``, read in the same pass, for
        cutting the rows into batches without reading the objects again."""
        out = np.empty(self.n, np.int64)
        if speedups.staged_lengths is not None:
            sizes = np.empty(2 * self.n, np.int32)
            speedups.staged_lengths(self.values, self.keys, out, sizes)
            self.sizes = sizes
        else:
            out[:] = [
                len(v or b"") + len(k or b"") for v, k in zip(self.values, self.keys, strict=True)
            ]
        return out

    def timestamp_column(self) -> npt.NDArray[np.int64]:
        return np.array(self.timestamps, dtype=np.int64)

    def partition_column(self) -> npt.NDArray[np.int32] | None:
        if self.partitions is None:
            return None
        return np.array(self.partitions, dtype=np.int32)

    def release_rows(self) -> None:
        """Drops the staged keys and values once they are encoded (the futures need
        only the timestamps and the outcomes)."""
        self.keys = []
        self.values = []
        self.sizes = None

    def timestamp_of(self, row: int) -> int:
        """Row ``row``'s CreateTime (ms), from the runs kept once flushed."""
        values = self.stamp_values
        assert values is not None, "asked before the stage was resolved"
        starts = self.stamp_starts
        if starts is None:
            return values[row]
        return values[bisect_right(starts, row) - 1]

    # -- resolving (worker, the flushing thread) ---------------------------------------

    def resolve(
        self,
        outcomes: list[BatchOutcome],
        row_batch: npt.NDArray[np.int32],
        row_index: npt.NDArray[np.int32],
        stamps: StampRuns,
    ) -> None:
        """The stage was flushed: row ``r`` is record ``row_index[r]`` of the batch whose
        outcome is ``outcomes[row_batch[r]]`` (its partition is the outcome's). Wakes
        waiters; attaches callbacks.

        Every future of the stage points at it, so one future kept pins what is kept
        here for all its rows: each row's batch and index in the smallest type that
        holds them (a byte and two for a stage of a few partitions), and the
        timestamps as runs of rows with the same one (``send`` stamps a millisecond's
        rows alike; ``stamps``, from :func:`stamp_runs`). It was about 20 bytes a
        row: the timestamps' list, and the batch, the index and the partition as int32."""
        self.outcomes = outcomes
        self.row_batch = smallest_index(row_batch, len(outcomes))
        self.row_index = smallest_index(
            row_index, int(row_index.max()) + 1 if len(row_index) else 0
        )
        self.stamp_starts, self.stamp_values = stamps
        self.timestamps = []
        self._finish()

    def fail(self, error: BaseException) -> None:
        """Nothing of the stage was handed over: every row fails with ``error``."""
        if self.flushed:
            return
        self.error = error
        self._finish()

    def _finish(self) -> None:
        self.release_rows()
        with self._lock:
            self.flushed = True
            event, callbacks = self._event, self._callbacks
            self._callbacks = []
        if event is not None:
            event.set()
        for row, fn, fut in callbacks:
            self._attach(row, fn, fut)

    def _attach(self, row: int, fn: Callable[[RecordFuture], object], fut: RecordFuture) -> None:
        if self.error is not None:
            _call(fn, fut)
            return
        assert self.row_batch is not None
        self.outcomes[int(self.row_batch[row])].add_listener(lambda _o: fn(fut))

    def wait_flushed(self, timeout: float | None) -> bool:
        if self.flushed:
            return True
        with self._lock:
            if self.flushed:
                return True
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        return event.wait(timeout)

    def add_callback(
        self, row: int, fn: Callable[[RecordFuture], object], fut: RecordFuture
    ) -> None:
        with self._lock:
            if not self.flushed:
                self._callbacks.append((row, fn, fut))
                return
        self._attach(row, fn, fut)


# (starts, values): run r of rows from starts[r] has values[r]; starts None: one a row.
# Python arrays: a future reads its row's with bisect and an index, a few hundred ns,
# where numpy's searchsorted and scalars took over a microsecond of every result().
StampRuns = tuple["array[int] | None", "array[int]"]


def stamp_runs(timestamps: list[int]) -> StampRuns:
    """Staged timestamps as (starts, values), int32 and int64 arrays: run ``r`` of rows
    from ``starts[r]`` has ``values[r]``; when runs would take more than one int64 a
    row, (None, every row's). In C where built (``speedups.stamp_runs``: a pointer
    compare a row, where numpy copies every row to int64 first), else numpy. Runs in:
    worker."""
    if speedups.stamp_runs is None:
        return stamp_runs_numpy(timestamps)
    n = len(timestamps)
    starts = np.empty(n, np.int32)
    values = np.empty(n, np.int64)
    try:
        runs = speedups.stamp_runs(timestamps, starts, values)
    except (TypeError, ValueError, OverflowError) as exc:  # staged ints: a bug if so
        raise ProducerError(f"keeping the staged timestamps: {exc}") from None
    if _runs_cost_more(runs, n):
        return None, array("q", timestamps)  # every one an int64: checked in C above
    return array("i", starts[:runs].tobytes()), array("q", values[:runs].tobytes())


def stamp_runs_numpy(timestamps: list[int]) -> StampRuns:
    """:func:`stamp_runs` in numpy (no extension). Runs in: worker."""
    try:
        every = np.array(timestamps, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProducerError(f"keeping the staged timestamps: {exc}") from None
    cuts = np.flatnonzero(every[1:] != every[:-1]) + 1
    starts = np.concatenate([np.zeros(min(len(every), 1), np.int64), cuts]).astype(np.int32)
    if _runs_cost_more(len(starts), len(every)):
        return None, array("q", every.tobytes())
    return array("i", starts.tobytes()), array("q", every[starts].tobytes())


def _runs_cost_more(runs: int, rows: int) -> bool:
    return 3 * runs > 2 * rows  # 12 bytes a run against 8 a row


@dataclass(slots=True)
class Columns:
    """Checked and converted ``send_batch`` inputs (no shared memory touched yet):
    written at the call (:mod:`shmprod.worker.bulk`) or held (:class:`HeldCalls`)."""

    n: int
    values: pa.Array | pa.ChunkedArray  # chunked: held calls (worker.held), not joined
    keys: pa.Array | None
    timestamps: I64 | int  # one per row, or one for all
    # one list shared by every row, or each row's encoded section
    headers: list[Header] | list[bytes] | None
    per_row_headers: bool
    header_bytes: int  # encoded headers section size (largest row when per row)
    row_bytes: I64  # value + key bytes per row (nulls count 0)


class HeldCalls:
    """Small ``send_batch`` calls of one topic, held until they are written together
    (:mod:`shmprod.worker.held`). It sits in the topic's list of stages like a
    :class:`Stage` (``send()`` never appends to it: a record sent after it starts a new
    stage, behind it), flushed by the same triggers. ``chunks`` are the calls' checked
    columns (:class:`Columns`), ``futures`` their futures.

    Runs in: worker; changed only under the Worker's state lock until taken for a flush.
    """

    __slots__ = (
        "chunks",
        "deadline_ns",
        "error",
        "flushed",
        "futures",
        "n",
        "nbytes",
        "room",
        "topic",
    )

    def __init__(self, topic: str, deadline_ns: int, room: int) -> None:
        self.topic = topic
        self.deadline_ns = deadline_ns
        self.room = room  # staged bytes it takes at most
        self.chunks: list[Any] = []
        self.futures: list[BatchFuture] = []
        self.n = 0
        self.nbytes = 0
        self.flushed = False
        self.error: BaseException | None = None

    def add(self, columns: Any, future: BatchFuture, nbytes: int) -> None:
        """Holds one call's checked columns (state lock held)."""
        self.chunks.append(columns)
        self.futures.append(future)
        self.n += columns.n
        self.nbytes += nbytes

    def fail(self, error: BaseException) -> None:
        """Nothing of the held calls was handed over: every row fails with ``error``."""
        if self.flushed:
            return
        self.flushed = True
        self.error = error
        self.chunks = []
        for fut in self.futures:
            fut._fail(error)


AnyStage = Stage | HeldCalls
"""What a topic's list of stages holds (oldest first)."""


def _column(items: list[bytes | None], nulls: int) -> pa.Array:
    """A large_binary Arrow array of ``items``, ``nulls`` of them None (one copy of the
    bytes). Built from buffers: ``pa.array`` on a list would import pandas into every
    worker."""
    n = len(items)
    validity = None
    if nulls:
        valid = np.fromiter((x is not None for x in items), dtype=bool, count=n)
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    data: list[bytes] = [b"" if x is None else x for x in items] if nulls else items  # type: ignore[assignment]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(map(len, data), np.int64, n), out=offsets[1:])
    return pa.Array.from_buffers(
        pa.large_binary(),
        n,
        [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))],
        null_count=nulls,
    )
