"""Idempotence: ONE producer id/epoch for the whole host pool, sequences per partition.

- The id comes from InitProducerId at start; when to ask, bump or wait is
  :mod:`shmprod.sender.producer_id`.
- Sequences are assigned at drain time, in queue order, and written into the batch in
  shared memory with :func:`shmprod.protocol.records.patch_producer_state` (the CRC
  covers them, so it is recomputed there). A retried batch keeps its sequence.
- A batch acknowledged (or answered DUPLICATE_SEQUENCE_NUMBER) moves the partition's
  "next expected" sequence past it.
- When a sequence can no longer be trusted -- a batch that carried one failed for good,
  or the broker answered UNKNOWN_PRODUCER_ID or an OUT_OF_ORDER_SEQUENCE_NUMBER for the
  first unacknowledged batch -- :meth:`ProducerIdentity.request_reset` stops sending
  new batches. Batches whose fate is unknown (sent, then the connection dropped or the
  request timed out) are first resent under the current identity until the broker
  answers for each (written, a duplicate, or out of order: not written), because under
  a new identity the broker could no longer recognise them and would write them twice.
  Once none is left and nothing is in flight the sender bumps the epoch itself, as Java's
  idempotent producer does (KIP-360, :meth:`ProducerIdentity.bump_epoch`): same producer
  id, epoch + 1, every sequence back to 0. Queued batches get fresh sequences when
  drained again.
- A broker may refuse a bumped epoch (PRODUCER_FENCED or INVALID_PRODUCER_EPOCH for a
  batch under it; tansu does). Then bumping is given up for good
  (:meth:`ProducerIdentity.refuse_bump`) and every later reset takes a NEW producer id
  from InitProducerId instead -- also what happens when the epoch is at its maximum.
- UNKNOWN_PRODUCER_ID for a batch that starts its partition's sequences (0) means the
  broker does not know the id at all (a broker that lost its state, or never issued
  it): bumping cannot help, so that reset takes a new id
  (:meth:`ProducerIdentity.request_new_id`).
"""

from __future__ import annotations

from shmprod.protocol import error_codes as ec
from shmprod.protocol.primitives import INT16_MAX, INT32_MAX
from shmprod.sender.batch import NO_SEQUENCE, Batch

MAX_IN_FLIGHT_PER_PARTITION = 5
"""The broker remembers the last 5 batches of a producer-partition (idempotence)."""


def next_sequence(sequence: int, increment: int) -> int:
    """``sequence + increment`` wrapping past INT32_MAX to 0 (Kafka's rule)."""
    if sequence > INT32_MAX - increment:
        return increment - (INT32_MAX - sequence) - 1
    return sequence + increment


class ProducerIdentity:
    """Producer id, epoch and per-partition sequences. Runs in: sender."""

    __slots__ = (
        "_acked",
        "_next",
        "bump_refused",
        "bumped",
        "enabled",
        "new_id_pending",
        "producer_epoch",
        "producer_id",
        "reset_pending",
    )

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.producer_id = -1
        self.producer_epoch = -1
        self.reset_pending = False
        self.bumped = False  # the current epoch is one this producer bumped itself
        self.bump_refused = False  # the broker fenced a bumped epoch: take new ids instead
        self.new_id_pending = False  # the pending reset must take a new id (id unknown)
        self._next: dict[int, int] = {}  # partition slot -> next sequence to assign
        self._acked: dict[int, int] = {}  # partition slot -> next sequence the broker expects

    @property
    def has_id(self) -> bool:
        return self.producer_id >= 0

    @property
    def can_drain(self) -> bool:
        """False while an id is missing (batches wait for one)."""
        return not self.enabled or self.has_id

    def resolving(self, batch: Batch) -> bool:
        """Whether ``batch`` may be sent while a reset waits: only to learn the fate of
        a batch sent under the current identity and never answered."""
        return batch.unresolved and self.is_current(batch)

    def set_identity(self, producer_id: int, producer_epoch: int) -> None:
        """A new id/epoch from InitProducerId: every sequence restarts at 0."""
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self._next.clear()
        self._acked.clear()
        self.reset_pending = False
        self.new_id_pending = False
        self.bumped = False

    def bump_epoch(self) -> bool:
        """KIP-360 for an idempotent producer: the same id with epoch + 1, sequences
        from 0. False (nothing changed) when the broker refused a bump before or the
        epoch is at its maximum: the caller must take a new producer id instead."""
        if (
            not self.has_id
            or self.bump_refused
            or self.new_id_pending
            or self.producer_epoch >= INT16_MAX
        ):
            return False
        self.set_identity(self.producer_id, self.producer_epoch + 1)
        self.bumped = True
        return True

    def refuses_bump(self, code: int, batch: Batch) -> bool:
        """Whether ``code`` for ``batch`` means the broker does not accept epochs the
        producer bumped itself (it fenced the bumped epoch the batch carries)."""
        return (
            self.enabled
            and self.bumped
            and code in (ec.PRODUCER_FENCED, ec.INVALID_PRODUCER_EPOCH)
            and self.is_current(batch)
        )

    def request_new_id(self) -> None:
        """Resets under a new producer id, not a bump: the broker does not know the id."""
        if self.enabled:
            self.new_id_pending = True
            self.reset_pending = True

    def id_unknown(self, code: int, batch: Batch) -> bool:
        """UNKNOWN_PRODUCER_ID for the batch that starts its partition's sequences under
        the current identity: the broker refuses the id itself, whatever the epoch."""
        return (
            self.enabled
            and code == ec.UNKNOWN_PRODUCER_ID
            and self.is_current(batch)
            and batch.sequence == 0
        )

    def refuse_bump(self) -> None:
        """Never bump again; the pending reset takes a new producer id."""
        self.bump_refused = True
        self.request_reset()

    def request_reset(self) -> None:
        if self.enabled:
            self.reset_pending = True

    def assign(self, batch: Batch) -> bool:
        """Gives ``batch`` its sequence if it has none under the current identity.

        Returns True when the batch's producer fields must be (re)written in shm.
        """
        if (
            batch.sequence != NO_SEQUENCE
            and batch.producer_id == self.producer_id
            and batch.producer_epoch == self.producer_epoch
        ):
            return False
        slot = batch.partition_slot
        seq = self._next.get(slot, 0)
        self._next[slot] = next_sequence(seq, batch.record_count)
        batch.sequence = seq
        batch.producer_id = self.producer_id
        batch.producer_epoch = self.producer_epoch
        return True

    def is_current(self, batch: Batch) -> bool:
        return batch.producer_id == self.producer_id and batch.producer_epoch == self.producer_epoch

    def acknowledge(self, batch: Batch) -> None:
        """``batch`` is in the log: the broker now expects the sequence after it."""
        if self.enabled and batch.sequence != NO_SEQUENCE and self.is_current(batch):
            self._acked[batch.partition_slot] = next_sequence(batch.sequence, batch.record_count)

    def is_next_expected(self, batch: Batch) -> bool:
        """Whether ``batch`` is the first unacknowledged one of its partition: an
        OUT_OF_ORDER_SEQUENCE_NUMBER for it is real, not fallout of an earlier failure."""
        return self.is_current(batch) and batch.sequence == self._acked.get(batch.partition_slot, 0)
