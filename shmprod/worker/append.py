"""Handing a written batch over: its DESCRIPTORs, and the fault hook of the tests; and
claiming the sender's spare buffers.

Every batch -- records ``send`` staged, or rows of ``send_batch`` -- is encoded whole
(:mod:`shmprod.worker.bulk`) straight into a granted buffer, which its worker alone
writes until it hands the batch over; nothing here needs a cross-process lock.
:func:`describe_batch` marks the DESCRIPTORs SEALED right before the ``Sealed``
message passes the batch to the sender.

Runs in: worker, in the thread holding the Worker's flush turn.

Test hook: :data:`fault_hook` is None in normal use and costs one global load per batch
(never per record). A fault test sets it, in the worker process it wants to break, to a
callable ``hook(point, view, end)`` called inside the critical section, with granted
buffers held and the batch's buffer still this worker's alone:

* ``"seal"``: a batch of staged records is about to be written (``end`` 0): the buffer
  is granted, nothing is handed over (a worker killed while appending);
* ``"sealed"``: that batch is complete, header and CRC written, not handed over yet;
* ``"bulk"``: ``send_batch`` wrote a whole batch into a granted buffer, not yet handed
  over.

``view`` starts at the batch's first byte and ``end`` is how many bytes are written; the
hook may write into it (a buggy worker scribbling) or stop or kill the process (a worker
dying mid-append), and must not keep the view after it returns.
"""

from __future__ import annotations

from collections.abc import Callable

from shmprod import layout as L
from shmprod import speedups

__all__ = ["FaultHook", "claim_spares", "describe_batch", "fault_hook"]

FaultHook = Callable[[str, memoryview, int], None]

#: Tests only: see the module docstring. None in normal use.
fault_hook: FaultHook | None = None


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
    L.I32.pack_into(seg, d + L.D_PARTITION, partition_slot)
    L.U32.pack_into(seg, d + L.D_RUN, run)
    L.U64.pack_into(seg, d + L.D_BATCH_ID, batch_id)
    L.U32.pack_into(seg, d + L.D_LENGTH, length)
    L.U32.pack_into(seg, d + L.D_RECORD_COUNT, record_count)
    L.U64.pack_into(seg, d + L.D_CREATED_NS, now_ns)
    # State and owner as one word each (speedups.write_word): a buffer claimed as a spare
    # is read by the sender meanwhile (its Claimed, or taking its spares back), and
    # struct.pack_into would show it owner 0 or state FREE for a moment.
    cont = L.descriptor_word(L.BUF_CONT, worker_slot)
    for b in range(buffer + 1, buffer + run):
        speedups.write_word(seg, geo.descriptor(b) + L.D_WORD, cont)
    speedups.write_word(seg, d + L.D_WORD, L.descriptor_word(L.BUF_SEALED, worker_slot))


def claim_spares(seg: memoryview, geo: L.Geometry, worker_slot: int, count: int) -> list[int]:
    """Up to ``count`` spare buffers, each DESCRIPTOR word swapped from SPARE to GRANTED
    by ``worker_slot`` (of two claimers, one wins); [] without the C extension. The
    caller then tells the sender (``Claimed``) before it seals any of them.

    Runs in: worker, state lock held (the claim and its message go out in order).
    """
    claim = speedups.claim_words
    if claim is None or count <= 0:
        return []
    return claim(
        seg,
        geo.descriptors + L.D_WORD,
        L.DESCRIPTOR_SIZE,
        geo.n_buffers,
        L.SPARE_WORD,
        L.descriptor_word(L.BUF_GRANTED, worker_slot),
        count,
        0,
    )
