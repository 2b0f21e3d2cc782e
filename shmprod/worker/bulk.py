"""``send_batch``: many records at once, with no per-row Python in the hot path.

1. **Check and convert** every column once, before anything touches shared memory:
   values/keys become Arrow binary arrays (:func:`vectorized.to_binary_array`),
   timestamps an int64 array or one int, headers one encoded section for all rows or
   one list per row. Bad input raises a typed error at the call, nothing written.
2. **Partition**: explicit partitions (one int or one per row) are range-checked;
   otherwise the configured partitioner hashes the key column
   (:func:`partitioner.partitions_for_keys`, Java's murmur2). Rows without a key are
   cut into runs of about one batch of bytes (a cumulative sum over row sizes), and
   the runs go round robin over the partitions, starting where this process's
   previous ``send_batch`` to the topic stopped: a small call stays on one partition
   (sticky), a large one spreads over all of them in whole batches.
3. **Group** rows by partition with one stable ``argsort`` (input order is kept inside
   each partition); the vectorised encoder also takes one Arrow ``take`` per column.
4. **Hold** a small call (:mod:`shmprod.worker.held`: no explicit partitions or
   headers, smaller than about a batch per partition): it waits, with the next such
   calls to the topic, to be written as one call, so batches fill across calls (steps
   2-3 then run when they are written). Otherwise **flush first** what this process
   staged or held for the topic, under the process's flush turn, so that the records
   of a process reach each partition in the order it sent them. Staged records are
   flushed through steps 2-6 too (:func:`flush_stage`), their batches written by the C
   extension straight from the staged ``bytes`` when no row has headers
   (:func:`_write_direct`).
5. **Encode and write**: per partition, full batches of at most ``batch_size`` bytes,
   each written straight into a granted buffer, record by record from the Arrow buffers
   by the C extension (:mod:`shmprod.worker.direct`; per-row headers or no extension:
   :func:`vectorized.iter_encoded_batches` and :meth:`EncodedBatch.write_into`),
   compressed by this worker when a codec is set (each run keeps the codec's worst-case
   growth free, :attr:`AppendPort.slack`, so the compressed form fits in one pass;
   uncompressed when a snappy section outgrows its run); its DESCRIPTOR marked SEALED
   and one ``Sealed`` message sent. A few batches (at most 8, or an eighth of the pool)
   take all their buffers first, all or nothing, so a full pool hands nothing over;
   more are asked for in windows (``Alloc`` with count = k).
   A row larger than ``batch_size`` goes alone in a run of adjacent buffers.
6. The :class:`BatchFuture` maps rows to (batch, index in batch) and fills the offsets
   with numpy when every batch is ``Done``.

Per-row headers take a slower path (one Python call per row to encode them, and a
list reorder); one headers list for all rows is encoded once and broadcast. The
configured key/value serializers are not applied here: pass encoded columns.

If a failure happens after some batches were already handed over (the pool stayed
exhausted past ``max_block_ms``, the sender died), the call does not raise: the rows
not handed over fail in the returned future with that error (``partial_result`` shows
which rows made it). A failure before anything was handed over raises at the call.

Runs in: worker. Shared memory is written only in buffers granted to this worker; the
Worker's state lock is held only to register and send ``Sealed`` messages.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import numpy as np
import numpy.typing as npt

from shmprod import speedups
from shmprod.errors import (
    BufferExhaustedError,
    CompressionError,
    EncodeError,
    InvalidRecordError,
    ProducerError,
    RecordTooLargeError,
    ShmprodError,
    UnknownPartitionError,
)
from shmprod.futures import BatchFuture, BatchOutcome, Stamps
from shmprod.partitioner import (
    Murmur2Partitioner,
    PartitionerError,
    check_partition,
    check_partitions,
)
from shmprod.protocol import vectorized as V
from shmprod.protocol.columns import binary_lengths, index_array, join_binary
from shmprod.protocol.records import HEADER_SIZE, Header
from shmprod.worker import append as A
from shmprod.worker import held
from shmprod.worker.direct import DirectBatch, arrow_source, staged_source
from shmprod.worker.direct import plan as direct_plan
from shmprod.worker.inputs import check_timestamp, encoded_headers
from shmprod.worker.port import AppendPort, Written
from shmprod.worker.staging import I64, Columns, HeldCalls, Stage, stamp_runs
from shmprod.worker.topics import TopicEntry, validate_topic

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
else:
    from shmprod.arrow import pa, pc


__all__ = ["Columns", "flush_stage", "flush_stages", "prepare_columns", "send_batch"]

I32 = npt.NDArray[np.int32]

_ROW_OVERHEAD: Final = 16  # rough per-row varint bytes, for spreading null keys
_MAX_WINDOW: Final = 64  # most buffers asked for in one Alloc
_ATOMIC_MIN: Final = 8  # up to this many batches (or an eighth of the pool): all or none


def _binary(column: Any, what: str) -> pa.Array:
    try:
        return V.to_binary_array(column, what)
    except EncodeError as exc:
        raise InvalidRecordError(str(exc)) from None


def _lengths(arr: pa.Array) -> I64:
    """Byte length of each row (null: 0), as a numpy array of this call's own (Arrow's
    zero-copy views are read-only)."""
    return binary_lengths(arr)


def _is_pair(item: object) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)


def _headers(headers: Any, n: int) -> tuple[Any, bool, int]:
    """(headers for the encoder, per row?, encoded size bound): one list of pairs shared
    by every row, or each row's encoded section."""
    if headers is None:
        return None, False, 1
    if isinstance(headers, Mapping):
        headers = list(headers.items())
    if not isinstance(headers, list | tuple):
        raise InvalidRecordError(
            f"headers must be a list of (str, bytes | None) pairs, a dict, or one such "
            f"list per row; got {type(headers).__name__}"
        )
    if not headers:
        return None, False, 1
    if all(_is_pair(h) for h in headers):
        return list(headers), False, len(encoded_headers(list(headers)))
    if len(headers) != n:
        raise InvalidRecordError(f"per-row headers: {len(headers)} lists for {n} rows")
    # each row's encoded section: in C for the common forms, in Python for the rest
    # (which converts them or raises the typed error)
    rows = list(headers)
    encode = speedups.header_sections
    sections: list[bytes | None] = [None] * n if encode is None else encode(rows)
    for i, section in enumerate(sections):
        if section is None:
            sections[i] = encoded_headers(rows[i])
    done = cast("list[bytes]", sections)
    return done, True, max(map(len, done), default=1)


def prepare_columns(
    values: Any, keys: Any, timestamps_ms: Any, headers: Any, now_ms: int
) -> Columns:
    """Checks and converts the columns of one call. Runs in: worker, no lock."""
    vals = _binary(values, "values")
    n = len(vals)
    karr: pa.Array | None = None
    row_bytes = _lengths(vals)
    if keys is not None:
        karr = _binary(keys, "keys")
        if len(karr) != n:
            raise InvalidRecordError(f"{len(karr)} keys for {n} values")
        if karr.null_count == n:
            karr = None
        else:
            row_bytes += _lengths(karr)
    ts: I64 | int
    if timestamps_ms is None:
        ts = now_ms
    elif np.ndim(timestamps_ms) == 0:
        ts = check_timestamp(timestamps_ms)
    else:
        try:
            ts = V._timestamps(timestamps_ms, n)
        except EncodeError as exc:
            raise InvalidRecordError(str(exc)) from None
        if n and int(ts.min()) < 0:
            raise InvalidRecordError(f"timestamps_ms must be >= 0, got {int(ts.min())}")
    hdrs, per_row, hbytes = _headers(headers, n)
    return Columns(n, vals, karr, ts, hdrs, per_row, hbytes, row_bytes)


@dataclass(slots=True)
class KeyRows:
    """What the partitioner needs of rows: their count, keys and sizes (a
    :class:`Columns` has the same fields)."""

    n: int
    keys: pa.Array | list[bytes | None] | None  # a stage's own list: hashed in place
    row_bytes: I64  # value + key bytes per row (nulls count 0)
    header_bytes: int


def _partitions(
    port: AppendPort, cols: Columns, entry: TopicEntry, partitions: Any, budget: int
) -> I32:
    """Every row's partition (input order). ``partitions``: None, one int, or one per
    row (an Arrow integer array may hold nulls: those rows are partitioned as if none
    was given). Null-key rows: runs of ~one batch, round robin over the partitions from
    ``entry.next_bulk``. Runs in: worker, state lock held (it advances
    ``entry.next_bulk``)."""
    n, nparts = cols.n, entry.partitions
    unset: npt.NDArray[np.bool_] | None = None
    if isinstance(partitions, pa.ChunkedArray):
        partitions = partitions.combine_chunks()
    if isinstance(partitions, pa.Array):
        if not (pa.types.is_integer(partitions.type) or pa.types.is_null(partitions.type)):
            raise InvalidRecordError(f"partitions must be integers, got {partitions.type}")
        if partitions.null_count == len(partitions) and len(partitions) == n:
            partitions = None
        elif partitions.null_count:
            unset = np.asarray(partitions.is_null().to_numpy(zero_copy_only=False), bool)
            partitions = pc.fill_null(partitions, 0).to_numpy(zero_copy_only=False)
        else:
            partitions = partitions.to_numpy(zero_copy_only=False)
    if partitions is None:
        return _default_partitions(port, cols, entry, budget, None)
    if np.ndim(partitions) == 0:
        return np.full(n, check_partition(partitions, nparts, entry.name), np.int32)
    arr = np.asarray(partitions)
    if arr.ndim == 1 and len(arr) != n:
        raise InvalidRecordError(f"partitions must be one int or one per row ({n})")
    out = check_partitions(arr, nparts, entry.name, unset)
    if unset is not None:
        rows = np.flatnonzero(unset)
        out[rows] = _default_partitions(port, cols, entry, budget, rows)
    return out


def _default_partitions(
    port: AppendPort,
    cols: Columns | KeyRows,
    entry: TopicEntry,
    budget: int,
    rows: npt.NDArray[np.intp] | None,
) -> I32:
    """The partitioner's choice for ``rows`` (None: every row). Runs in: worker, state
    lock held."""
    nparts = entry.partitions
    n = cols.n if rows is None else len(rows)
    keys = cols.keys
    if keys is not None and rows is not None:
        keys = [keys[i] for i in rows] if isinstance(keys, list) else keys.take(pa.array(rows))
    part = port.partitioner
    if keys is None and isinstance(part, Murmur2Partitioner):
        out = np.full(n, -1, np.int32)
    else:
        keys = keys if keys is not None else pa.nulls(n, pa.binary())
        try:
            out = np.asarray(part.partition_many(keys, nparts), dtype=np.int32).copy()
        except PartitionerError as exc:
            raise InvalidRecordError(f"partitioner: {exc}") from None
    null = out < 0
    if null.any():
        row_bytes = cols.row_bytes if rows is None else cols.row_bytes[rows]
        sizes = row_bytes[null] + (_ROW_OVERHEAD + cols.header_bytes)
        run = (np.cumsum(sizes) - 1) // max(budget, 1)
        if entry.next_bulk < 0:
            entry.next_bulk = port.rand() % nparts
        start = entry.next_bulk
        out[null] = (start + run) % nparts
        entry.next_bulk = int((start + int(run[-1]) + 1) % nparts)
    return out


@dataclass(slots=True)
class _Group:
    """Rows sorted by partition: ``ranges`` of (partition, lo, hi) over sorted rows."""

    order: npt.NDArray[np.intp] | None
    values: pa.Array
    keys: pa.Array | None
    timestamps: I64 | int
    headers: Any
    ranges: list[tuple[int, int, int]]


def _order(parts: I32) -> tuple[npt.NDArray[np.intp] | None, list[tuple[int, int, int]]]:
    """Rows sorted by partition, input order kept inside each: (order, ranges of
    (partition, lo, hi) over the sorted rows). ``order`` is None when every partition's
    rows are one run already (null keys: runs of about a batch each). In C where built
    (``speedups.partition_order``, a counting sort), else numpy. Runs in: worker."""
    if speedups.partition_order is not None:
        order = np.empty(len(parts), np.intp)
        try:
            rows_moved, ranges = speedups.partition_order(
                np.ascontiguousarray(parts, np.int32), order
            )
        except (TypeError, ValueError) as exc:  # our own partitions: a bug if so
            raise ProducerError(f"grouping rows by partition: {exc}") from None
        return (order if rows_moved else None), ranges
    return _order_numpy(parts)


def _row_places(
    order: npt.NDArray[np.intp] | None, counts: list[int], n: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Each of ``n`` rows' batch and its index in it, the sorted rows (``order``; None:
    as they are) cut into batches of ``counts`` rows. In C where built
    (``speedups.row_places``), else numpy. Runs in: worker."""
    if speedups.row_places is not None:
        row_batch = np.empty(n, np.int32)
        row_index = np.empty(n, np.int32)
        try:
            speedups.row_places(order, counts, row_batch, row_index)
        except (TypeError, ValueError, IndexError) as exc:  # our own rows: a bug if so
            raise ProducerError(f"placing rows in their batches: {exc}") from None
        return row_batch, row_index
    return _row_places_numpy(order, counts, n)


def _row_places_numpy(
    order: npt.NDArray[np.intp] | None, counts: list[int], n: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """:func:`_row_places` in numpy (no extension). Runs in: worker."""
    counts_a = np.array(counts, dtype=np.int64)
    starts = np.cumsum(counts_a) - counts_a
    sorted_batch = np.repeat(np.arange(len(counts), dtype=np.int32), counts_a)
    sorted_index = (np.arange(n, dtype=np.int64) - np.repeat(starts, counts_a)).astype(np.int32)
    if order is None:
        return sorted_batch, sorted_index
    row_batch = np.empty(n, np.int32)
    row_index = np.empty(n, np.int32)
    row_batch[order] = sorted_batch
    row_index[order] = sorted_index
    return row_batch, row_index


def _order_numpy(
    parts: I32,
) -> tuple[npt.NDArray[np.intp] | None, list[tuple[int, int, int]]]:
    """:func:`_order` in numpy (no extension). Runs in: worker."""
    n = len(parts)
    changes = np.diff(parts) != 0
    if int(np.count_nonzero(changes)) < 4096:  # few runs (keyed rows have about n)
        starts = [0, *(np.flatnonzero(changes) + 1).tolist()]
        run_parts = parts[starts].tolist()
        if len(set(run_parts)) == len(run_parts):  # grouped already
            bounds = [*starts, n]
            return None, [(p, bounds[i], bounds[i + 1]) for i, p in enumerate(run_parts)]
    # numpy's stable sort is a radix sort for 16-bit keys: linear, several times faster
    keys16 = parts.astype(np.uint16) if int(parts.max()) <= 0xFFFF else parts
    order = np.argsort(keys16, kind="stable")
    sp = parts[order]
    cuts = (np.flatnonzero(np.diff(sp)) + 1).tolist()
    bounds = [0, *cuts, n]
    return order, [(int(sp[lo]), lo, hi) for lo, hi in itertools.pairwise(bounds)]


def _group(cols: Columns, parts: I32) -> _Group:
    """:func:`_order`, then one take per column (no copy when already grouped). Runs
    in: worker."""
    order, ranges = _order(parts)
    if order is None:
        return _Group(None, cols.values, cols.keys, cols.timestamps, cols.headers, ranges)
    idx = index_array(order)
    values = cols.values.take(idx)
    keys = cols.keys.take(idx) if cols.keys is not None else None
    ts = cols.timestamps if isinstance(cols.timestamps, int) else cols.timestamps[order]
    headers = cols.headers
    if cols.per_row_headers:
        assert isinstance(headers, list)
        headers = [headers[i] for i in order.tolist()]  # per-row headers: slow path
    return _Group(order, values, keys, ts, headers, ranges)


def _check_sizes(port: AppendPort, cols: Columns) -> None:
    """RecordTooLargeError at the call for a row beyond max_request_size or the pool."""
    limit = min(port.max_request_size, port.geo.n_buffers * port.geo.buffer_size)
    if cols.n == 0:
        return
    bound = int(cols.row_bytes.max()) + cols.header_bytes + 31 + HEADER_SIZE
    if bound <= limit:
        return
    try:
        sizes = V.record_sizes(
            cols.values,
            cols.keys,
            cols.timestamps,
            cols.headers,
            base_timestamp_ms=cols.timestamps if isinstance(cols.timestamps, int) else None,
        )
    except EncodeError as exc:
        raise InvalidRecordError(str(exc)) from None
    big = np.flatnonzero(sizes + HEADER_SIZE > limit)
    if len(big):
        row = int(big[0])
        raise RecordTooLargeError(
            f"row {row}: a record of {int(sizes[row]) + HEADER_SIZE} bytes (with batch "
            f"header) is larger than max_request_size={port.max_request_size} or the pool"
        )


def _run_for(port: AppendPort, section_size: int) -> int:
    """Buffers for a batch of ``section_size`` record bytes: the header, the records and
    the codec's slack (:attr:`AppendPort.slack`), except where the slack would make the
    run longer than the pool (a row as large as the pool: it goes compressed only if its
    compressed form fits)."""
    geo = port.geo
    bare = geo.buffers_for(HEADER_SIZE + section_size)
    return min(geo.buffers_for(HEADER_SIZE + section_size + port.slack), max(bare, geo.n_buffers))


class _Writer:
    """Writes encoded batches into granted buffers and hands them over in windows."""

    def __init__(
        self,
        port: AppendPort,
        entry: TopicEntry,
        slots: list[int],
        estimate: int,
        hook: str,
        created_ns: int,
    ) -> None:
        self.port = port
        self.entry = entry
        self.slots = slots  # home slot per partition, as when the rows were partitioned
        self.hook = hook  # the fault_hook point after a batch is written (tests)
        self.created_ns = created_ns  # when its records were first sent (KIP-91)
        self.used = 0  # buffers written
        self.estimate = estimate  # batches still expected (for Alloc windows)
        # run length -> batches still to write that need it, when the batches are known
        # (Alloc windows then ask for no more runs of a length than will be used)
        self.need: Counter[int] | None = None
        self.buffers: dict[int, list[int]] = {}  # run length -> runs in hand (first buffers)
        self.pending: list[Written] = []
        self.outcomes: list[BatchOutcome] = []
        self.counts: list[int] = []
        self.deadline = time.monotonic_ns() + port.max_block_ms * 1_000_000

    def reserve(self, runs: Counter[int]) -> None:
        """Takes ``runs`` (run length -> how many) now, all or nothing
        (BufferExhaustedError after max_block_ms, nothing taken). Runs in: worker, state
        lock NOT held."""
        got: dict[int, list[int]] = {}
        with self.port.lock:
            try:
                for run, count in sorted(runs.items()):
                    got[run] = self.port.obtain_locked(run, count, self.deadline, False)
            except BaseException:
                for run, firsts in got.items():
                    self.port.give_back_locked(firsts, run)
                raise
        self.buffers = got

    def buffer(self, run: int) -> tuple[int, int]:
        """A granted run for a batch of ``run`` buffers, as (first buffer, its length):
        one of ``run`` in hand, else the head of a longer one in hand (the batch takes
        its first ``run`` buffers; the rest go back with its Sealed), else a window of
        runs asked for at once, after handing over what is written so the sender can
        free buffers meanwhile. The window's runs have the longest length the batches
        still expected need when this batch's is more than half of it, so one window
        serves batches of both lengths: a call's full batches and its partitions'
        shorter last ones came in turn, and each change of length gave the runs in hand
        back and waited for a Grant (measured: 1 KB records, 336 waits for 360 batches).
        The window counts the batches still expected that its runs serve this way,
        bounded.

        When the pool is more than half used, the runs in hand of other lengths go back
        first, so a process that may wait holds no unused run: with several processes
        each holding runs of one length while waiting for another, the pool ran dry and
        every one of them waited out max_block_ms. When the batches are encoded as they
        go (their lengths not known ahead), runs of several buffers come one at a time:
        a window of the estimate held runs the shorter last batches did not use, given
        back unused. Runs in: worker, state lock NOT held."""
        held = self.buffers.get(run)
        if held:
            return held.pop(), run
        longer = [r for r, firsts in self.buffers.items() if r > run and firsts]
        if longer:
            r = min(longer)
            return self.buffers[r].pop(), r
        self.hand_over()
        if self.port.pool_free() * 2 < self.port.geo.n_buffers:
            self.give_back()
        with self.port.lock:
            if self.need is None:
                # batches not known ahead (nor their lengths): runs of several one at a time
                length, want = run, self.estimate if run == 1 else 1
            else:
                longest = max(r for r, n in self.need.items() if n > 0)
                length = longest if 2 * run > longest else run
                want = sum(n for r, n in self.need.items() if length < 2 * r <= 2 * length)
            window = max(
                1, min(want, _MAX_WINDOW // length, self.port.geo.n_buffers // (8 * length))
            )
            held = self.buffers[length] = self.port.obtain_locked(
                length, window, self.deadline, True
            )
        return held.pop(), length

    def write(self, batch: V.EncodedBatch | DirectBatch, partition: int) -> None:
        """Writes one whole batch into a granted buffer (compressed here when a codec is
        set). Runs in: worker, no lock: the buffer is this call's alone until handed over."""
        geo = self.port.geo
        run = _run_for(self.port, batch.section_size)
        buf, granted = self.buffer(run)
        if self.need is not None:
            self.need[run] -= 1
        start = geo.buffer(buf)
        mv = self.port.view[start : start + geo.run_bytes(run)]
        self.used += run
        try:
            if A.fault_hook is not None and self.hook == "sealed":  # tests only
                A.fault_hook("seal", mv, 0)
            try:
                end = batch.write_into(mv, 0, settings=self.port.settings)
            except (EncodeError, CompressionError):
                end = batch.write_into(mv, 0)  # the compressed form outgrew the run: as is
            if A.fault_hook is not None:  # tests only (see worker.append)
                A.fault_hook(self.hook, mv, end)
        except BaseException:
            with self.port.lock:
                self.port.give_back_locked([buf], granted)  # whole, as it was granted
            raise
        finally:
            mv.release()
        outcome = BatchOutcome(self.port.done_lock, self.entry.name, partition)
        slot = self.slots[partition]
        self.pending.append(
            Written(
                buf,
                run,
                slot,
                end,
                batch.record_count,
                outcome,
                batch.section_size,
                granted - run,
            )
        )
        self.outcomes.append(outcome)
        self.counts.append(batch.record_count)
        self.estimate = max(1, self.estimate - 1)

    def hand_over(self) -> None:
        """Hands the written batches over (:attr:`AppendPort.hand_over_locked`). Runs in:
        worker, taking the state lock once."""
        if not self.pending:
            return
        with self.port.lock:
            # Once the producer failed (the I/O thread may have failed every pending
            # outcome and exited), an outcome registered now would never resolve: raise,
            # and the caller fails these rows as never handed over.
            self.port.check_alive()
            batches, self.pending = self.pending, []  # from here on the sender's
            self.port.hand_over_locked(batches, self.created_ns)

    def give_back(self) -> None:
        """Returns the runs in hand that no batch took. Runs in: worker, lock NOT held."""
        held = {run: firsts for run, firsts in self.buffers.items() if firsts}
        self.buffers = {}
        if held:
            with self.port.lock:
                for run, firsts in held.items():
                    self.port.give_back_locked(firsts, run)


def send_batch(
    port: AppendPort,
    topic: str,
    values: Any,
    keys: Any,
    partitions: Any,
    timestamps_ms: Any,
    headers: Any,
) -> BatchFuture:
    """See :meth:`shmprod.worker.client.Worker.send_batch` and the module docstring. Runs in: worker, state
    lock NOT held (it takes the flush turn: records this process staged with ``send``
    for the topic are flushed first, so each partition gets them in order)."""
    if type(topic) is not str:
        topic = validate_topic(topic)
    cols = prepare_columns(values, keys, timestamps_ms, headers, time.time_ns() // 1_000_000)
    _check_sizes(port, cols)
    stamps = Stamps.of(cols.n, cols.timestamps)  # the future's: no per-row copy of one
    with port.lock:
        port.check_alive()
        port.topic_locked(topic)  # unknown topics fail here, before the flush turn
    if cols.n == 0:
        return BatchFuture(port.done_lock, topic, np.zeros(0, np.int32), stamps, None, [], [])
    holdable = partitions is None
    future = held.hold(port, topic, cols) if holdable else None
    if future is not None:
        return future
    created = time.monotonic_ns()
    port.begin_flush(True)
    try:
        # what this process staged or held for the topic goes first; a full pool: it
        # waits, this raises
        flush_stages(port, [topic], keep_when_full=True)
        future = held.hold(port, topic, cols) if holdable else None
        if future is not None:
            return future
        with port.lock:
            port.check_alive()
            entry = port.topic_locked(topic)
            parts = _partitions(port, cols, entry, partitions, port.budget)
            slots = entry.slots  # replaced, never changed in place, when the topic changes
        order, outcomes, counts = _write(port, entry, slots, cols, parts, "bulk", created)
    finally:
        port.end_flush()
    return BatchFuture(port.done_lock, topic, parts, stamps, order, outcomes, counts)


def _write(
    port: AppendPort,
    entry: TopicEntry,
    slots: list[int],
    cols: Columns,
    parts: I32,
    hook: str,
    created_ns: int,
) -> tuple[npt.NDArray[np.intp] | None, list[BatchOutcome], list[int]]:
    """Groups rows by partition, encodes whole batches into granted buffers and hands
    them over; returns (sorted position -> input row, outcome per batch, rows per batch
    in sorted order). Raises when nothing was handed over; otherwise rows never handed
    over share one failed outcome at the end. Runs in: worker, holding the flush turn,
    state lock NOT held."""
    budget = port.budget
    # straight from the Arrow buffers (worker.direct), with one shared headers list or
    # each row's encoded section
    source = arrow_source(
        cols.values,
        cols.keys,
        cols.timestamps,
        None if cols.per_row_headers else cast("list[Header] | None", cols.headers),
        cast("list[bytes]", cols.headers) if cols.per_row_headers else None,
    )
    if source is not None:
        order, ranges = _order(parts)
        todo = direct_plan(source, order, ranges, budget)
        outcomes, counts = _hand(port, entry, slots, todo, len(todo), cols.n, hook, created_ns)
        return order, outcomes, counts
    if isinstance(cols.values, pa.ChunkedArray):  # the encoder below reads one array
        cols.values = join_binary(cols.values.chunks)
    group = _group(cols, parts)
    approx = int(cols.row_bytes.sum()) + cols.n * (_ROW_OVERHEAD + cols.header_bytes)

    def encoded() -> Iterator[tuple[int, V.EncodedBatch]]:
        # one encoder call for every partition (no batch crosses a partition's rows):
        # per call overhead is a few hundred microseconds, per row a few nanoseconds
        ranges = group.ranges
        k = 0
        row = 0
        for batch in V.iter_encoded_batches(
            group.values,
            group.keys,
            group.timestamps,
            group.headers,
            batch_size=port.budget + HEADER_SIZE,
            groups=[hi for _, _, hi in ranges],
        ):
            while row >= ranges[k][2]:
                k += 1
            yield ranges[k][0], batch
            row += batch.record_count

    estimate = -(-approx // budget) + len(group.ranges)
    outcomes, counts = _hand(port, entry, slots, encoded(), estimate, cols.n, hook, created_ns)
    return group.order, outcomes, counts


def _write_direct(
    port: AppendPort,
    entry: TopicEntry,
    slots: list[int],
    stage: Stage,
    parts: I32,
    keep: npt.NDArray[np.intp] | None,
    created_ns: int,
) -> tuple[npt.NDArray[np.intp] | None, list[BatchOutcome], list[int]] | None:
    """:func:`_write` for the rows ``keep`` (None: all) of a stage without headers,
    written straight from the staged bytes (:mod:`shmprod.worker.direct`); None when
    the stage cannot go that way. ``parts``: the partition of each kept row. Runs in:
    worker, holding the flush turn, state lock NOT held."""
    source = staged_source(stage)
    if source is None:
        return None
    order, ranges = _order(parts)
    rows = order if keep is None else (keep if order is None else keep[order])
    todo = direct_plan(source, rows, ranges, port.budget)
    outcomes, counts = _hand(port, entry, slots, todo, len(todo), len(parts), "sealed", created_ns)
    return order, outcomes, counts


def _hand(
    port: AppendPort,
    entry: TopicEntry,
    slots: list[int],
    todo: Iterable[tuple[int, V.EncodedBatch | DirectBatch]],
    estimate: int,
    n: int,
    hook: str,
    created_ns: int,
) -> tuple[list[BatchOutcome], list[int]]:
    """Writes (partition, batch) pairs of ``n`` rows into granted buffers and hands them
    over; returns (outcome per batch, rows per batch). See :func:`_write`. Runs in:
    worker, holding the flush turn, state lock NOT held."""
    writer = _Writer(port, entry, slots, estimate, hook, created_ns)
    geo = port.geo
    small = max(_ATOMIC_MIN, geo.n_buffers // 8)
    if writer.estimate <= small:
        todo = list(todo)
    if isinstance(todo, list):  # every batch known: windows of exactly what is needed
        sizes = [HEADER_SIZE + b.section_size + port.slack for _, b in todo]
        writer.need = Counter(_run_for(port, b.section_size) for _, b in todo)
        # a few batches: every buffer first (all or nothing, waiting at most
        # max_block_ms), so a full pool hands nothing over: send() keeps its records
        # staged and refuses the new one, send_batch raises at the call
        if (
            writer.estimate <= small
            and len(todo) <= small
            and max(sizes, default=0) <= max(geo.buffer_size, port.batch_size)
            and sum(run * count for run, count in writer.need.items()) <= small
        ):
            writer.reserve(writer.need)
    try:
        for p, batch in todo:
            writer.write(batch, p)
        writer.hand_over()
    except BaseException as exc:
        handed = len(writer.outcomes) - len(writer.pending)
        writer.give_back()
        with port.lock:
            for item in writer.pending:  # written, never handed over: still ours, whole
                port.give_back_locked([item.buffer], item.run + item.tail)
        writer.pending.clear()
        if isinstance(exc, EncodeError) and handed == 0:
            raise InvalidRecordError(str(exc)) from None
        if handed == 0 or not isinstance(exc, ShmprodError | EncodeError):
            raise
        del writer.outcomes[handed:]
        del writer.counts[handed:]
        rest = BatchOutcome(port.done_lock, entry.name, -1)  # the rows never handed over
        rest.fail(exc)
        writer.outcomes.append(rest)
        writer.counts.append(n - sum(writer.counts))
    writer.give_back()
    with port.lock:
        port.lease_used_locked(writer.used, writer.hook != "bulk" or writer.used > 1)
    return writer.outcomes, writer.counts


# ---------------------------------------------------------------------------------------
# Staged records (send): one stage at a time, through the same path
# ---------------------------------------------------------------------------------------


def _stage_columns(stage: Stage, rows: KeyRows) -> Columns:
    return Columns(
        stage.n,
        stage.value_column(),
        stage.key_column() if isinstance(rows.keys, list) else rows.keys,  # built once
        stage.timestamp_column(),
        stage.headers,
        stage.headers is not None,
        rows.header_bytes,
        rows.row_bytes,
    )


def flush_stages(port: AppendPort, topics: Sequence[str] | None, *, keep_when_full: bool) -> None:
    """Takes the stages and held calls of ``topics`` (None: all) and flushes them in
    order (:func:`flush_stage`). With ``keep_when_full``, when the pool has no buffers
    for one within max_block_ms, it and the ones after it go back, first in line, and
    BufferExhaustedError is raised. Runs in: worker, holding the flush turn, state lock
    NOT held."""
    with port.lock:
        stages = port.take_stages_locked(topics)
    for i, stage in enumerate(stages):
        try:
            flush_stage(port, stage, keep_when_full=keep_when_full)
        except BufferExhaustedError:
            port.restore_stages(stages[i:])
            raise


def flush_stage(
    port: AppendPort, stage: Stage | HeldCalls, *, keep_when_full: bool = False
) -> None:
    """Encodes the records ``send`` staged for one topic, or the ``send_batch`` calls
    held for it (:mod:`shmprod.worker.held`), and hands them over; resolves the
    futures (a failure before anything was handed over fails every row).
    ``keep_when_full``: when the pool has no buffers for it within max_block_ms, raise
    BufferExhaustedError with the stage untouched (nothing handed over) instead.
    Runs in: worker, holding the flush turn, state lock NOT held."""
    try:
        if isinstance(stage, HeldCalls):
            _write_held(port, stage)
        else:
            _flush_stage(port, stage)
    except BufferExhaustedError:
        if keep_when_full:
            raise
        with port.lock:
            port.failed_locked(stage.n)
        stage.fail(
            BufferExhaustedError(
                f"no free pool buffer within max_block_ms={port.max_block_ms} for records "
                "staged since linger_ms ago"
            )
        )
    except ShmprodError as exc:
        with port.lock:
            port.failed_locked(stage.n)
        stage.fail(exc)
    except BaseException as exc:  # a bug: no future may hang on it
        stage.fail(ProducerError(f"flushing staged records failed: {exc!r}"))
        raise


def _flush_stage(port: AppendPort, stage: Stage) -> None:
    n = stage.n
    stamps = stamp_runs(stage.timestamps)  # what the futures keep; before any hand-over
    keys: pa.Array | list[bytes | None] | None = None
    # a keyed stage answers at its first row (count(None) compares every key with None)
    if n and (stage.keys[0] is not None or stage.keys.count(None) != n):
        c_hash = port.murmur and speedups.murmur2_partitions is not None
        keys = stage.keys if c_hash else stage.key_column()  # the list: hashed in C
    rows = KeyRows(
        n,
        keys,
        stage.row_lengths(),
        stage.header_max if stage.headers is not None else 1,
    )
    with port.lock:
        port.check_alive()
        entry = port.topic_locked(stage.topic)
        parts = _default_partitions(port, rows, entry, port.budget, None)
        explicit = stage.partition_column()
        if explicit is not None:
            parts = np.where(explicit >= 0, explicit, parts).astype(np.int32)
        slots = entry.slots
    gone = parts >= len(slots)  # an explicit partition the topic no longer has
    keep: npt.NDArray[np.intp] | None = None
    if gone.any():
        keep = np.flatnonzero(~gone)
    kept = n if keep is None else len(keep)
    created = stage.deadline_ns - port.linger_ns
    written = None
    if kept:
        written = _write_direct(port, entry, slots, stage, parts[~gone], keep, created)
    if written is None and kept:
        cols = _stage_columns(stage, rows)
        if keep is not None:
            cols = _take_rows(cols, keep)
        written = _write(port, entry, slots, cols, parts[~gone], "sealed", created)
    order, outcomes, counts = written if written is not None else (None, [], [])
    row_batch, row_index = _row_places(order, counts, kept)
    if keep is not None:  # rows of gone partitions: one failed outcome of their own
        lost = BatchOutcome(port.done_lock, stage.topic, -1)
        lost.fail(
            UnknownPartitionError(
                f"topic {stage.topic!r} has {len(slots)} partitions now: the partition these "
                "records were sent to no longer exists"
            )
        )
        all_batch = np.full(n, len(outcomes), np.int32)
        all_index = np.zeros(n, np.int32)
        all_batch[keep] = row_batch
        all_index[keep] = row_index
        outcomes = [*outcomes, lost]
        row_batch, row_index = all_batch, all_index
    stage.resolve(outcomes, row_batch, row_index, stamps)


def _take_rows(cols: Columns, rows: npt.NDArray[np.intp]) -> Columns:
    idx = index_array(rows)
    headers = cols.headers
    if cols.per_row_headers:
        assert isinstance(headers, list)
        headers = [headers[i] for i in rows.tolist()]
    return Columns(
        len(rows),
        cols.values.take(idx),
        None if cols.keys is None else cols.keys.take(idx),
        cols.timestamps if isinstance(cols.timestamps, int) else cols.timestamps[rows],
        headers,
        cols.per_row_headers,
        cols.header_bytes,
        cols.row_bytes[rows],
    )


def _write_held(port: AppendPort, calls: HeldCalls) -> None:
    """Writes the held calls (:mod:`shmprod.worker.held`) as one call and binds their
    futures to their rows; raises what :func:`_write` raises when nothing was handed
    over. Runs in: worker, holding the flush turn, state lock NOT held."""
    sizes = [c.n for c in calls.chunks]
    stamps = Stamps([(c.n, c.timestamps) for c in calls.chunks])  # a run per call
    cols = held.concat(calls.chunks)
    with port.lock:
        port.check_alive()
        entry = port.topic_locked(calls.topic)
        parts = _default_partitions(port, cols, entry, port.budget, None)
        slots = entry.slots
    created = calls.deadline_ns - port.linger_ns
    order, outcomes, counts = _write(port, entry, slots, cols, parts, "bulk", created)
    whole = BatchFuture(port.done_lock, calls.topic, parts, stamps, order, outcomes, counts)
    calls.flushed = True
    calls.chunks = []
    lo = 0
    for future, n in zip(calls.futures, sizes, strict=True):
        future._bind(whole, lo, lo + n)
        lo += n
