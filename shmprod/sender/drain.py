"""Which batches go into the next ProduceRequest to a node.

Rules (Java's RecordAccumulator.drain, restated):

- One batch per partition per request (v3+), taken from the head of its queue.
- Only partitions whose leader is that node.
- A request holds batches up to ``max_request_size`` bytes; a single batch larger than
  that still goes, alone (the broker answers MESSAGE_TOO_LARGE if it must).
- Fairness: the partitions of a node are visited in slot order starting after where the
  previous drain of that node stopped, so a full request does not always favour the
  same partitions.
- A partition is skipped while its head waits for its retry backoff, while its head is
  a retry and any batch of the partition is still in flight (a retry is resent only
  when nothing of its partition is outstanding, so order is kept), and while it has
  ``partition_in_flight_limit`` batches in flight (5 with idempotence).
- While a producer reset waits, only heads that pass the caller's filter go (batches
  resent to learn their fate; see idempotence.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import Batch


def sendable(
    batch: Batch,
    in_flight: int,
    partition_in_flight_limit: int,
    now_ns: int,
    only: Callable[[Batch], bool] | None = None,
) -> bool:
    """Whether ``batch``, the head of its partition's queue, may be sent now (and, with
    ``only``, passes that filter: while a producer reset waits)."""
    if in_flight >= partition_in_flight_limit:
        return False
    if only is not None and not only(batch):
        return False
    if batch.is_retry:
        return in_flight == 0 and batch.retry_at_ns <= now_ns
    return True


class Drainer:
    """Builds the batch lists of produce requests. Runs in: sender."""

    __slots__ = ("_rotation", "max_request_size", "partition_in_flight_limit")

    def __init__(self, max_request_size: int, partition_in_flight_limit: int) -> None:
        self.max_request_size = max_request_size
        self.partition_in_flight_limit = partition_in_flight_limit
        self._rotation: dict[int, int] = {}

    def ready_by_leader(
        self,
        acc: Accumulator,
        leader_of: Callable[[int], int],
        in_flight: Mapping[int, int],
        now_ns: int,
        only: Callable[[Batch], bool] | None = None,
    ) -> tuple[dict[int, list[int]], list[int]]:
        """Sendable partition slots grouped by leader node, and the queued partitions
        whose leader is unknown (they need a metadata refresh)."""
        by_node: dict[int, list[int]] = {}
        no_leader: list[int] = []
        limit = self.partition_in_flight_limit
        for slot in acc.ready_slots():
            head = acc.head(slot)
            if head is None or not sendable(head, in_flight.get(slot, 0), limit, now_ns, only):
                continue
            node = leader_of(slot)
            if node < 0:
                no_leader.append(slot)
            else:
                by_node.setdefault(node, []).append(slot)
        return by_node, no_leader

    def drain(
        self,
        node: int,
        slots: list[int],
        acc: Accumulator,
        in_flight: Mapping[int, int],
        now_ns: int,
        only: Callable[[Batch], bool] | None = None,
    ) -> list[Batch]:
        """Pops at most one batch per partition of ``slots`` (all led by ``node``) for one
        request. The caller marks them in flight before draining again."""
        if not slots:
            return []
        ordered = sorted(slots)
        n = len(ordered)
        start = self._rotation.get(node, 0) % n
        out: list[Batch] = []
        size = 0
        limit = self.partition_in_flight_limit
        stopped_at = start
        for i in range(n):
            idx = (start + i) % n
            slot = ordered[idx]
            head = acc.head(slot)
            if head is None or not sendable(head, in_flight.get(slot, 0), limit, now_ns, only):
                continue
            if out and size + head.length > self.max_request_size:
                stopped_at = idx
                break
            out.append(acc.pop_head(slot))
            size += head.length
            stopped_at = idx + 1
        self._rotation[node] = stopped_at % n if n else 0
        return out
