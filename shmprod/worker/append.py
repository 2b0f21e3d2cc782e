"""The single-record path: one open batch per partition, written in a granted buffer.

A granted buffer (or run of adjacent buffers) is written by its worker alone until the
worker seals it, so nothing here needs a cross-process lock. An :class:`OpenBatch` keeps
a memoryview over its buffer's capacity; each record is encoded straight into shared
memory at the batch's write position with :func:`records.encode_record_into`
(offsetDelta = index in the batch, timestampDelta relative to the batch's first record).
A record that does not fit raises inside the encoder before writing anything, which is
how a full batch is detected without sizing every record twice.

:func:`seal` turns the batch into a complete RecordBatch v2 in place: with a codec it
compresses the records section into a process-local scratch and copies the result back
(the buffer is still this worker's), keeping the records uncompressed when compression
does not shrink them; then it writes the 61-byte header with the CRC last, updates the
DESCRIPTOR and returns the ``Sealed`` message that hands the batch to the sender.

Runs in: worker, under the Worker's state lock (process-local; it serialises the
threads of one process, never processes).

Test hook: :data:`fault_hook` is None in normal use and costs one global load per batch
(never per record). A fault test sets it, in the worker process it wants to break, to a
callable ``hook(point, view, end)`` called inside the critical section, with the state
lock held and the batch's buffer still this worker's alone:

* ``"seal"``: :func:`seal` was called; records are written in the buffer, the header is
  not (the half-made batch a worker killed while appending leaves behind);
* ``"sealed"``: header and CRC are written and the DESCRIPTOR says SEALED, the
  ``Sealed`` message is not sent yet;
* ``"bulk"``: ``send_batch`` wrote a whole batch into a granted buffer, not yet handed
  over (:mod:`shmprod.worker.bulk`).

``view`` starts at the batch's first byte and ``end`` is how many bytes are written; the
hook may write into it (a buggy worker scribbling) or stop or kill the process (a worker
dying mid-append), and must not keep the view after it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from shmprod import layout as L
from shmprod.futures import BatchOutcome
from shmprod.ipc import Sealed
from shmprod.protocol import compression as C
from shmprod.protocol.records import HEADER_SIZE, batch_attributes, write_batch_header

__all__ = ["FaultHook", "OpenBatch", "describe_batch", "fault_hook", "open_batch", "seal"]

_D_STATE: Final = L.D_STATE

FaultHook = Callable[[str, memoryview, int], None]

#: Tests only: see the module docstring. None in normal use.
fault_hook: FaultHook | None = None


class OpenBatch:
    """A batch being appended to; positions are relative to ``view`` (the batch start)."""

    __slots__ = (
        "base_ts",
        "batch_id",
        "buffer",
        "count",
        "created_ns",
        "deadline_ns",
        "max_ts",
        "outcome",
        "pos",
        "run",
        "slot",
        "start",
        "view",
    )

    def __init__(
        self,
        view: memoryview,
        start: int,
        buffer: int,
        run: int,
        slot: int,
        batch_id: int,
        outcome: BatchOutcome,
        created_ns: int,
        deadline_ns: int,
    ) -> None:
        self.view = view
        self.start = start
        self.buffer = buffer
        self.run = run
        self.slot = slot
        self.batch_id = batch_id
        self.outcome = outcome
        self.created_ns = created_ns
        self.deadline_ns = deadline_ns
        self.pos = HEADER_SIZE
        self.count = 0
        self.base_ts = 0
        self.max_ts = 0

    @property
    def records_bytes(self) -> int:
        return self.pos - HEADER_SIZE

    def release(self) -> None:
        """Drops the view over shared memory (needed before the segment is unmapped)."""
        self.view.release()


def open_batch(
    seg: memoryview,
    geo: L.Geometry,
    worker_slot: int,
    buffer: int,
    run: int,
    capacity: int,
    partition_slot: int,
    batch_id: int,
    outcome: BatchOutcome,
    now_ns: int,
    linger_ns: int,
) -> OpenBatch:
    """Starts a batch in granted ``buffer`` (+ ``run - 1`` adjacent ones) with room for
    ``capacity`` bytes, header included, and marks its DESCRIPTORs OPEN / CONT.

    Runs in: worker; the buffers are this worker's alone (granted, not yet sealed).
    """
    geo.check_run(buffer, run)
    start = geo.buffer(buffer)
    capacity = min(capacity, geo.run_bytes(run))
    d = geo.descriptor(buffer)
    L.U32.pack_into(seg, d + L.D_STATE, L.BUF_OPEN)
    L.I32.pack_into(seg, d + L.D_OWNER, worker_slot)
    L.I32.pack_into(seg, d + L.D_PARTITION, partition_slot)
    L.U32.pack_into(seg, d + L.D_RUN, run)
    L.U64.pack_into(seg, d + L.D_BATCH_ID, batch_id)
    L.U32.pack_into(seg, d + L.D_LENGTH, 0)
    L.U32.pack_into(seg, d + L.D_RECORD_COUNT, 0)
    L.U64.pack_into(seg, d + L.D_CREATED_NS, now_ns)
    for cont in range(buffer + 1, buffer + run):
        c = geo.descriptor(cont)
        L.U32.pack_into(seg, c + L.D_STATE, L.BUF_CONT)
        L.I32.pack_into(seg, c + L.D_OWNER, worker_slot)
    view = seg[start : start + capacity]
    return OpenBatch(
        view, start, buffer, run, partition_slot, batch_id, outcome, now_ns, now_ns + linger_ns
    )


def seal(
    seg: memoryview,
    geo: L.Geometry,
    batch: OpenBatch,
    codec: int,
    level: int | None,
    scratch: bytearray,
) -> tuple[Sealed, int]:
    """Completes ``batch`` in place and returns (the ``Sealed`` message, compressed size).

    With a codec the records section is compressed into ``scratch`` (grown as needed)
    and copied back over itself; when that would not be smaller the batch stays
    uncompressed (a per-batch choice every broker accepts). Header last, CRC last of
    all, then the DESCRIPTOR says SEALED. The caller sends the message and must not
    touch the buffer afterwards. Runs in: worker, before ownership passes to the sender.
    """
    view = batch.view
    end = batch.pos
    if fault_hook is not None:
        fault_hook("seal", view, end)
    attributes = 0
    if codec != C.NONE and batch.count:
        raw = end - HEADER_SIZE
        need = C.compress_bound(codec, raw)
        if len(scratch) < need:
            scratch.extend(bytes(need - len(scratch)))
        with memoryview(scratch) as out:
            n = C.compress_into(codec, view[HEADER_SIZE:end], out, level)
            if n < raw:
                view[HEADER_SIZE : HEADER_SIZE + n] = out[:n]
                end = HEADER_SIZE + n
                attributes = batch_attributes(codec)
    write_batch_header(
        view,
        0,
        end,
        attributes=attributes,
        record_count=batch.count,
        base_timestamp_ms=batch.base_ts,
        max_timestamp_ms=batch.max_ts,
    )
    d = geo.descriptor(batch.buffer)
    L.U32.pack_into(seg, d + L.D_LENGTH, end)
    L.U32.pack_into(seg, d + L.D_RECORD_COUNT, batch.count)
    L.U32.pack_into(seg, d + _D_STATE, L.BUF_SEALED)
    if fault_hook is not None:
        fault_hook("sealed", view, end)
    batch.release()
    msg = Sealed(batch.buffer, batch.run, batch.slot, batch.batch_id, end, batch.count)
    return msg, end


def describe_batch(
    seg: memoryview,
    geo: L.Geometry,
    worker_slot: int,
    buffer: int,
    run: int,
    partition_slot: int,
    batch_id: int,
    length: int,
    record_count: int,
    now_ns: int,
) -> None:
    """Writes the DESCRIPTORs of a batch written whole (``send_batch``), as SEALED.

    Runs in: worker, after the batch bytes are complete and before ``Sealed`` is sent.
    """
    d = geo.descriptor(buffer)
    L.I32.pack_into(seg, d + L.D_OWNER, worker_slot)
    L.I32.pack_into(seg, d + L.D_PARTITION, partition_slot)
    L.U32.pack_into(seg, d + L.D_RUN, run)
    L.U64.pack_into(seg, d + L.D_BATCH_ID, batch_id)
    L.U32.pack_into(seg, d + L.D_LENGTH, length)
    L.U32.pack_into(seg, d + L.D_RECORD_COUNT, record_count)
    L.U64.pack_into(seg, d + L.D_CREATED_NS, now_ns)
    for cont in range(buffer + 1, buffer + run):
        c = geo.descriptor(cont)
        L.U32.pack_into(seg, c + L.D_STATE, L.BUF_CONT)
        L.I32.pack_into(seg, c + L.D_OWNER, worker_slot)
    L.U32.pack_into(seg, d + L.D_STATE, L.BUF_SEALED)
