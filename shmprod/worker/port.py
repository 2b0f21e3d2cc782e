"""What the append paths need of their worker, and nothing else.

:mod:`shmprod.worker.bulk` (``send_batch`` and staged records) and
:mod:`shmprod.worker.held` (held calls) work through an :class:`AppendPort`: the batch
settings, where buffers live, the two locks, and the worker operations they call. The
worker (:class:`~shmprod.worker.core.WorkerCore`) builds one per flush or call
(:meth:`~shmprod.worker.core.WorkerCore._port`), so a port never outlives the call and
never keeps a dropped Worker alive.

Every batch, whether its records were staged by ``send`` or came as columns to
``send_batch``, is handed over the same way: written into granted buffers, then
:attr:`AppendPort.hand_over_locked` marks the DESCRIPTORs SEALED, registers the
outcomes and sends one ``Sealed`` message per batch.

Runs in: worker. Each callable says which lock it needs: ``*_locked`` ones run with
:attr:`AppendPort.lock` (the state lock) held, the others without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shmprod import layout as L
from shmprod.futures import BatchOutcome
from shmprod.partitioner import Partitioner
from shmprod.protocol.records import BatchSettings
from shmprod.worker.staging import AnyStage
from shmprod.worker.topics import TopicEntry

__all__ = ["AppendPort", "Written"]


@dataclass(slots=True)
class Written:
    """A batch written into granted buffers, not yet handed over."""

    buffer: int  # first buffer of its run
    run: int  # buffers in the run
    slot: int  # partition slot
    length: int  # bytes written
    count: int  # records
    outcome: BatchOutcome
    raw: int  # record bytes before compression (the worker's counters)
    # buffers granted with the run, after it, that the batch did not need: given back
    # with its Sealed (it was put in the head of a longer run)
    tail: int = 0


@dataclass(frozen=True, slots=True)
class AppendPort:
    """The worker as the append paths see it (see the module docstring)."""

    # -- where batches are written, and how ----------------------------------------------
    view: memoryview  # the segment
    geo: L.Geometry
    settings: BatchSettings  # compression of each batch
    batch_size: int
    # record bytes one batch holds: batch_size less the batch header and ``slack``
    budget: int
    # bytes kept free after a batch's records in its run, so that their compressed form
    # always fits in place (protocol.compression.slack; 0 uncompressed). Measured: lz4
    # batches of 1 KB keyed records filled their runs to within 5 bytes, and each was
    # encoded, compressed to new bytes, then encoded again and written uncompressed
    slack: int
    linger_ns: int
    max_block_ms: int
    max_request_size: int
    partitioner: Partitioner
    murmur: bool  # the partitioner is the default murmur2 (the extension hashes keys)
    rand: Callable[[], int]  # where null-key runs start on a topic's first call

    # -- locks and the stages -----------------------------------------------------------------
    lock: threading.Lock  # the state lock
    done_lock: threading.Lock  # the outcomes' lock (futures)
    stages: dict[str, list[AnyStage]]  # topic -> stages and held calls; state lock held

    # -- state lock held ------------------------------------------------------------------
    check_alive: Callable[[], None]  # raises once the producer failed or closed (any lock)
    topic_locked: Callable[[str], TopicEntry]  # may wait for the sender (lock released)
    obtain_locked: Callable[[int, int, int, bool], list[int]]  # (run, count, deadline_ns, partial)
    give_back_locked: Callable[[list[int], int], None]  # (first buffers, run)
    hand_over_locked: Callable[[list[Written], int], None]  # (batches, created_ns)
    failed_locked: Callable[[int], None]  # records that failed before a hand-over
    lease_used_locked: Callable[[int, bool], None]  # (buffers written, grow the lease)
    stage_added_locked: Callable[[int], None]  # a new stage's flush deadline
    staged_total_locked: Callable[[], int]  # bytes staged over every topic
    take_stages_locked: Callable[[Sequence[str] | None], list[AnyStage]]

    # -- state lock NOT held --------------------------------------------------------------
    pool_free: Callable[[], int]  # free buffers in the pool (a moment old)
    begin_flush: Callable[[bool], bool]  # the flush turn (block?)
    end_flush: Callable[[], None]
    restore_stages: Callable[[list[AnyStage]], None]  # back, first in line
