"""``send_batch`` calls held, so that batches fill across calls.

Java's ``RecordAccumulator`` appends every record to its partition's open batch, so a
stream of small sends still fills whole batches. ``send_batch`` writes a call's rows as
batches of their own: a call of 10,000 keyed 100 B rows over 12 partitions made batches
of about 80 KB where ``batch_size`` is 512 KiB, and the broker's cost per batch and per
request set the pace (measured: 1.45-1.53 M records/s, where calls of 50,000 rows make
1.9-2.0 M). So a call smaller than its topic's stage (about 7/8 of a batch per
partition, as for ``send()``) is held: its checked columns wait in a
:class:`~shmprod.worker.staging.HeldCalls` in the topic's list of stages, with the next
small calls to the topic, and are written together -- partitioned, grouped and encoded
as one call (:func:`shmprod.worker.bulk.flush_stage`; the extension reads the values
from each call's own array, only the keys are joined) -- when

* the next call would overflow it: it is written first, then that call is held anew;
* its first call is ``linger_ms`` old (the worker's I/O thread);
* the process calls ``flush``/``close``, or ``send()`` to the topic (a process's
  records reach each partition in the order it sent them).

Held are calls without explicit partitions or headers, when ``linger_ms`` > 0; the
others are written at the call, after what is staged for the topic. A held call's
future resolves with its rows' batches; a failure after the call (no pool buffer within
``max_block_ms`` when written, the sender died) goes to the future, as with ``send()``.
The columns are kept as converted: Arrow arrays by reference (Arrow data is immutable),
the other forms were copied by the conversion; per-row timestamps are copied here.

Runs in: worker. A held set is process-local memory, changed under the Worker's state
lock until taken for a flush.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from shmprod import speedups
from shmprod.futures import BatchFuture, Stamps
from shmprod.protocol.columns import join_binary
from shmprod.worker.port import AppendPort
from shmprod.worker.staging import (
    STAGE_MAX_BYTES,
    STAGED_MAX_BYTES,
    STAGED_OVERHEAD,
    Columns,
    HeldCalls,
)

if TYPE_CHECKING:
    import pyarrow as pa
else:
    from shmprod.arrow import pa

__all__ = ["concat", "hold"]


def hold(port: AppendPort, topic: str, cols: Columns) -> BatchFuture | None:
    """Holds a small call (see the module docstring) and returns its future; None when
    it is to be written now: not held by its kind or size, or the topic's stages must
    be written first (then call again). Runs in: worker, takes the state lock."""
    if port.linger_ns <= 0 or cols.headers is not None or cols.n == 0:
        return None
    nbytes = int(cols.row_bytes.sum()) + cols.n * STAGED_OVERHEAD
    with port.lock:
        port.check_alive()
        entry = port.topic_locked(topic)
        room = min(STAGE_MAX_BYTES, max(1, port.batch_size * entry.partitions * 7 // 8))
        if nbytes >= room or port.staged_total_locked() + nbytes > STAGED_MAX_BYTES:
            return None
        stages = port.stages.get(topic)
        if stages is None:
            held = HeldCalls(topic, time.monotonic_ns() + port.linger_ns, room)
            port.stages[topic] = [held]
            port.stage_added_locked(held.deadline_ns)
        else:
            last = stages[-1]
            if len(stages) > 1 or not isinstance(last, HeldCalls) or last.nbytes + nbytes > room:
                return None
            held = last
        if not isinstance(cols.timestamps, int):  # the caller may change its array
            cols.timestamps = cols.timestamps.copy()
        future = BatchFuture.held(port.done_lock, topic, Stamps.of(cols.n, cols.timestamps))
        held.add(cols, future, nbytes)
        return future


def concat(chunks: list[Columns]) -> Columns:
    """The held calls' columns as one call's (no headers; per-row timestamps). The keys
    are joined (the partitioner reads one column); the values stay in their calls'
    arrays when the extension writes them (one chunk each), else are joined too."""
    if len(chunks) == 1:
        return chunks[0]
    n = sum(c.n for c in chunks)
    arrays = [c.values for c in chunks]
    values: pa.Array | pa.ChunkedArray
    if speedups.plan_batches is None:
        values = join_binary(arrays)
    else:
        if len({a.type for a in arrays}) > 1:
            arrays = [a.cast(pa.large_binary()) for a in arrays]
        values = pa.chunked_array(arrays)
    keys = None
    if any(c.keys is not None for c in chunks):
        keys = join_binary(
            [c.keys if c.keys is not None else pa.nulls(c.n, pa.binary()) for c in chunks]
        )
    timestamps = Stamps([(c.n, c.timestamps) for c in chunks]).rows()
    row_bytes = np.concatenate([c.row_bytes for c in chunks])
    return Columns(n, values, keys, timestamps, None, False, 1, row_bytes)
