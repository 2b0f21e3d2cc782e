"""One Spark task's deliveries: its ``send_batch`` futures, waited for in order.

A task keeps at most :data:`MAX_PENDING` futures, waiting for the oldest beyond that
(so a failure stops the task early rather than after its last row), and at the end
seals this process's open batches (``flush``) and takes every result: a task that
returns had every one of its records acknowledged. Spark runs one task at a time in a
Python worker process, so the process's batches are the task's own: it never waits
for another task's records. Runs in: Spark's Python workers.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Final

import numpy as np

from shmprod.errors import OwnerDiedError, ProducerClosedError, SenderDiedError
from shmprod.extras import require
from shmprod.futures import BatchFuture
from shmprod.worker import Worker

__all__ = ["BROKEN", "MAX_PENDING", "Deliveries", "task_identity"]

MAX_PENDING: Final = 64
BROKEN: Final = (ProducerClosedError, SenderDiedError, OwnerDiedError)
"""Errors after which a process's attachment is useless: drop it, attach anew next time."""


class Deliveries:
    """The futures of one task and the records acknowledged per (topic, partition)."""

    def __init__(self, w: Worker, timeout_s: float | None) -> None:
        self.w = w
        self.timeout_s = timeout_s
        self.pending: deque[BatchFuture] = deque()
        self.counts: Counter[tuple[str, int]] = Counter()

    def submit(self, fut: BatchFuture) -> None:
        """Keeps ``fut``; takes the results already in, and waits for the oldest while
        more than :data:`MAX_PENDING` are pending."""
        self.pending.append(fut)
        while self.pending and (self.pending[0].done() or len(self.pending) > MAX_PENDING):
            self._take(self.pending.popleft())

    def _take(self, fut: BatchFuture) -> None:
        md = fut.result(timeout=self.timeout_s)
        counts = np.bincount(md.partitions)
        for p in np.flatnonzero(counts):
            self.counts[fut.topic, int(p)] += int(counts[p])

    def finish(self) -> None:
        """Seals the process's open batches and waits for every result; raises the
        first failure as the typed shmprod error."""
        self.w.flush(self.timeout_s)
        while self.pending:
            self._take(self.pending.popleft())


def task_identity() -> tuple[int, int]:
    """(Spark partition id, attempt number) of the running task, or (-1, 0) outside Spark."""
    try:
        TaskContext = require("pyspark", "spark").TaskContext
    except ImportError:
        return -1, 0
    ctx = TaskContext.get()
    return (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (-1, 0)
