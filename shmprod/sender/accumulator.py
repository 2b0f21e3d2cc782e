"""Per-partition FIFO queues of sealed batches (sender memory, mirrored in shm).

A batch is ready as soon as it is sealed: the workers already applied linger by deciding
when to seal. Each PARTITION slot has one queue; ``P_QUEUE_DEPTH`` mirrors its length.

Order: new batches go to the tail. A batch answered with a retriable error goes back to
the HEAD, among the other retried batches in sequence order (when idempotent) or ahead
of them in arrival order, so a partition's batches are resent in their original order
and nothing newer for that partition leaves while a retry waits (see drain.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from shmprod.sender.batch import NO_SEQUENCE, Batch
from shmprod.sender.shmstate import SharedState


class Accumulator:
    """Queues by partition slot. Runs in: sender (no lock: one thread)."""

    __slots__ = ("_count", "_queues", "_shared")

    def __init__(self, shared: SharedState | None = None) -> None:
        self._queues: dict[int, deque[Batch]] = {}
        self._shared = shared
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def depth(self, slot: int) -> int:
        q = self._queues.get(slot)
        return len(q) if q else 0

    def ready_slots(self) -> Iterator[int]:
        """Partition slots with at least one queued batch."""
        return iter(self._queues)

    def head(self, slot: int) -> Batch | None:
        q = self._queues.get(slot)
        return q[0] if q else None

    def append(self, batch: Batch) -> None:
        """A newly sealed batch joins the tail of its partition's queue."""
        q = self._queues.get(batch.partition_slot)
        if q is None:
            q = self._queues[batch.partition_slot] = deque()
        q.append(batch)
        self._count += 1
        self._mirror(batch.partition_slot, len(q))

    def requeue(self, batch: Batch) -> None:
        """A retried batch goes back to the head of its queue, in sequence order.

        Retried batches sit before every never-sent batch. Among retried batches of one
        partition, the one with the lower sequence goes first; without sequences
        (idempotence off), a later-requeued batch goes after earlier-requeued ones only
        if it arrived later.
        """
        slot = batch.partition_slot
        q = self._queues.get(slot)
        if q is None:
            q = self._queues[slot] = deque()
        pos = 0
        for other in q:
            if not other.is_retry or _before(batch, other):
                break
            pos += 1
        q.insert(pos, batch)
        self._count += 1
        self._mirror(slot, len(q))

    def pop_head(self, slot: int) -> Batch:
        q = self._queues[slot]
        batch = q.popleft()
        self._count -= 1
        if not q:
            del self._queues[slot]
        self._mirror(slot, len(q))
        return batch

    def remove_slot(self, slot: int) -> list[Batch]:
        """Removes and returns every batch queued for one partition slot."""
        q = self._queues.pop(slot, None)
        if not q:
            return []
        self._count -= len(q)
        self._mirror(slot, 0)
        return list(q)

    def expire(self, now_ns: int) -> list[Batch]:
        """Removes and returns every queued batch whose delivery deadline has passed."""
        expired: list[Batch] = []
        for slot in list(self._queues):
            q = self._queues[slot]
            if not any(b.deadline_ns <= now_ns for b in q):
                continue
            keep = deque(b for b in q if b.deadline_ns > now_ns)
            expired.extend(b for b in q if b.deadline_ns <= now_ns)
            if keep:
                self._queues[slot] = keep
            else:
                del self._queues[slot]
            self._mirror(slot, len(keep))
        self._count -= len(expired)
        return expired

    def remove_all(self) -> list[Batch]:
        """Empties every queue (shutdown, owner death)."""
        out: list[Batch] = []
        for slot, q in self._queues.items():
            out.extend(q)
            self._mirror(slot, 0)
        self._queues.clear()
        self._count = 0
        return out

    def clear_sequences(self) -> None:
        """Forgets every queued batch's sequence (a new producer id or epoch)."""
        for q in self._queues.values():
            for b in q:
                b.sequence = NO_SEQUENCE

    def next_retry_ns(self) -> int | None:
        """Earliest backoff end among queue heads, if any head is waiting."""
        best: int | None = None
        for q in self._queues.values():
            head = q[0]
            if head.is_retry and (best is None or head.retry_at_ns < best):
                best = head.retry_at_ns
        return best

    def _mirror(self, slot: int, depth: int) -> None:
        if self._shared is not None:
            self._shared.set_queue_depth(slot, depth)


def _before(a: Batch, b: Batch) -> bool:
    """Whether retried batch ``a`` must be resent before retried batch ``b``: by sequence
    when both have one under the same producer id and epoch, else by arrival and, for
    pieces of one split batch, by their first record. (Sequences of two identities do
    not compare: a batch already renumbered from 0 under a new id would go before an
    older one still holding its old sequence.)"""
    if (
        a.sequence != NO_SEQUENCE
        and b.sequence != NO_SEQUENCE
        and a.producer_id == b.producer_id
        and a.producer_epoch == b.producer_epoch
    ):
        return _seq_before(a.sequence, b.sequence)
    return (a.arrival, a.first_index) < (b.arrival, b.first_index)


def _seq_before(a: int, b: int) -> bool:
    """Sequence order with wrap-around at INT32_MAX (distance under half the space)."""
    return a != b and ((b - a) & 0x7FFFFFFF) < 0x40000000
