"""The one ledger of produce requests in flight: which batches are out, how many per
partition (the drain's limit of 5 with idempotence), how many requests, and the
counters workers read in shared memory (``S_REQUESTS_IN_FLIGHT``,
``S_BATCHES_IN_FLIGHT``, each partition's in-flight count).

A batch is in flight from the moment its request is queued on a connection until the
request is answered, lost or aborted; it is in at most one request at a time.

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from shmprod import layout as L
from shmprod.sender.batch import Batch
from shmprod.sender.shmstate import SharedState

__all__ = ["InFlightLedger"]


class InFlightLedger:
    """Produce requests and their batches between sending and their end."""

    __slots__ = ("_batches", "_per_partition", "_requests", "_shared")

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        self._batches: set[Batch] = set()
        self._per_partition: dict[int, int] = {}
        self._requests = 0

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def per_partition(self) -> Mapping[int, int]:
        """Batches in flight per partition slot (absent: none)."""
        return self._per_partition

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._batches)

    def __contains__(self, batch: object) -> bool:
        return batch in self._batches

    def sent(self, batches: Iterable[Batch]) -> None:
        """One request with ``batches`` was queued on a connection."""
        n = 0
        for batch in batches:
            assert batch not in self._batches, "a batch in two requests at once"
            self._batches.add(batch)
            slot = batch.partition_slot
            k = self._per_partition.get(slot, 0) + 1
            self._per_partition[slot] = k
            self._shared.set_partition_in_flight(slot, k)
            n += 1
        self._requests += 1
        self._shared.add(L.S_REQUESTS_SENT, 1)
        self._shared.add(L.S_BATCHES_REQUESTED, n)
        self._publish()

    def done(self, batches: Iterable[Batch]) -> None:
        """The request with ``batches`` ended: answered, lost or aborted."""
        for batch in batches:
            self._batches.discard(batch)
            slot = batch.partition_slot
            k = self._per_partition.get(slot, 1) - 1
            if k > 0:
                self._per_partition[slot] = k
            else:
                self._per_partition.pop(slot, None)
            self._shared.set_partition_in_flight(slot, max(k, 0))
        self._requests -= 1
        self._publish()

    def _publish(self) -> None:
        self._shared.set(L.S_REQUESTS_IN_FLIGHT, self._requests)
        self._shared.set(L.S_BATCHES_IN_FLIGHT, len(self._batches))
