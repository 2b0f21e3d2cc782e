"""The sender's record of one sealed batch (its bytes stay in shared memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shmprod import ipc

NO_SEQUENCE = -1
NO_BUFFER = -1


@dataclass(slots=True, eq=False)
class SplitGroup:
    """The pieces of one sealed batch that the sender split (MESSAGE_TOO_LARGE).

    ``pending`` pieces are still queued or in flight; once it reaches 0 the worker gets
    one ``DoneSplit`` with every piece's outcome in record order. Runs in: sender.
    """

    pending: int = 1
    results: list[ipc.Piece] = field(default_factory=list)
    message: str = ""  # the first failed piece's


@dataclass(slots=True, eq=False)
class Batch:
    """A sealed batch from ``origin`` (a worker connection), owned by the sender until
    its Done is sent and its buffers are freed. Runs in: sender.

    A piece of a split batch has no buffer (``buffer`` is NO_BUFFER): its bytes are in
    ``data``, the sender's own memory, and ``group`` gathers the pieces' outcomes;
    ``first_index`` is its first record's index in the batch the worker sealed.
    """

    buffer: int  # first buffer of the run holding the batch
    run: int
    partition_slot: int
    batch_id: int  # the worker's id, echoed in Done
    length: int
    record_count: int
    origin: int
    sealed_ns: int
    deadline_ns: int  # opened (by the worker) + delivery_timeout_ms (KIP-91)
    arrival: int = 0  # order in which the sender received the batch
    attempts: int = 0  # sends answered with a retriable error so far
    retry_at_ns: int = 0  # not before this (backoff), once attempts > 0
    sequence: int = NO_SEQUENCE  # base sequence assigned at drain (idempotence)
    producer_id: int = -1  # the identity the sequence belongs to
    producer_epoch: int = -1
    # a request carried it with its current sequence and was never answered (lost with
    # its connection, or timed out): the broker may hold it (idempotence)
    maybe_written: bool = False
    unresolved: bool = False  # sent with its sequence, never answered: fate unknown
    reported: bool = False  # its outcome went to the worker (early: deadline in flight)
    last_error: int = 0
    data: bytearray | None = None
    group: SplitGroup | None = None
    first_index: int = 0

    @property
    def is_retry(self) -> bool:
        return self.attempts > 0
