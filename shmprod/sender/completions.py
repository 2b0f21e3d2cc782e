"""Completions: what becomes of a batch once the broker answered, its request was lost,
its deadline passed or it was refused before sending -- the one place a batch's outcome
is decided and reported, its buffers given back and its counters kept.

- :meth:`Completions.on_answer` applies the retry policy (:func:`~shmprod.sender.policy.
  decide`) to a broker's answer: success, retry with backoff (requeued at its
  partition's head), split in two (MESSAGE_TOO_LARGE), or failure; and the producer
  resets idempotence asks for.
- :meth:`Completions.finish` is the one completion: the outcome to the worker that
  sealed the batch (``Done``, or ``DoneSplit`` once every piece of a split batch is
  done), counters, buffers back to the pool.
- :meth:`Completions.expire` reports delivery timeouts: queued batches fail, batches in
  flight at their deadline are reported then (KIP-91) and complete when their request
  ends.

Runs in: sender (one thread; no lock). It reaches the workers and the pool's waiters
only through the two callbacks it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import CorruptBatchError, DeliveryTimeoutError, ProtocolError
from shmprod.protocol import error_codes as ec
from shmprod.protocol import records
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import NO_BUFFER, NO_SEQUENCE, Batch, SplitGroup
from shmprod.sender.idempotence import ProducerIdentity
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.metadata import Metadata
from shmprod.sender.policy import Action, backoff_ns, decide
from shmprod.sender.pool import AllocResult, BufferPool
from shmprod.sender.produce import BatchAnswer
from shmprod.sender.producer_id import ProducerIdDriver
from shmprod.sender.shmstate import SharedState

__all__ = ["Completions"]

log = logging.getLogger("shmprod.sender")


class Completions:
    """See the module docstring."""

    def __init__(
        self,
        cfg: ProducerConfig,
        view: memoryview,
        geo: L.Geometry,
        shared: SharedState,
        pool: BufferPool,
        acc: Accumulator,
        metadata: Metadata,
        identity: ProducerIdentity,
        pid: ProducerIdDriver,
        in_flight: InFlightLedger,
        *,
        post_to: Callable[[int, ipc.Message], None],
        send_grants: Callable[[Iterable[AllocResult]], None],
        connection_trouble: Callable[[], str],
    ) -> None:
        self.cfg = cfg
        self.view = view
        self.geo = geo
        self.shared = shared
        self.pool = pool
        self.acc = acc
        self.metadata = metadata
        self.identity = identity
        self.pid = pid
        self.in_flight = in_flight
        self.post_to = post_to  # (worker slot, message): to that worker if still attached
        self._send_grants = send_grants  # grants the freed buffers made possible
        self._connection_trouble = connection_trouble  # the last connection failure, or ""

    def expire(self, now: int) -> None:
        """Delivery timeouts (KIP-91): queued batches past their deadline fail; a batch
        in flight at its deadline is reported then, as failed and retriable (it may still
        be written), and keeps its buffers and its place until its request ends."""
        for batch in self.acc.expire(now):
            self.expired(batch)
        for batch in self.in_flight:
            if batch.deadline_ns <= now and not batch.reported:
                self.report(
                    batch,
                    DeliveryTimeoutError.code,
                    retriable=True,
                    message=(
                        f"not acknowledged within delivery_timeout_ms="
                        f"{self.cfg.delivery_timeout_ms}{self.last_error(batch)}; it was "
                        "in flight and may still be written"
                    ),
                )

    def finish(
        self,
        batch: Batch,
        code: int,
        base_offset: int = -1,
        log_append_time_ms: int = -1,
        *,
        retriable: bool = False,
        message: str = "",
    ) -> None:
        """The one completion of a batch: its outcome to the worker (unless already
        reported, see :meth:`report`), counters, and its buffers back to the pool."""
        self.report(
            batch, code, base_offset, log_append_time_ms, retriable=retriable, message=message
        )
        if code == 0:
            self.shared.add(L.S_BATCHES_SENT, 1)
            self.shared.add(L.S_RECORDS_SENT, batch.record_count)
            self.shared.add(L.S_BYTES_SENT, batch.length)
            self.shared.add_partition_sent(batch.partition_slot, batch.record_count, batch.length)
        else:
            self.shared.add(L.S_BATCHES_FAILED, 1)
            if self.metadata.locate(batch.partition_slot) is not None:
                self.shared.set_partition_error(batch.partition_slot, code)
        if batch.data is None:
            self._send_grants(self.pool.free(batch.buffer, batch.run))

    def report(
        self,
        batch: Batch,
        code: int,
        base_offset: int = -1,
        log_append_time_ms: int = -1,
        *,
        retriable: bool = False,
        message: str = "",
    ) -> None:
        """The batch's one outcome to the worker that sealed it (if still attached):
        ``Done``; a piece of a split batch reports into its group, whose last piece sends
        ``DoneSplit``. Once only: a batch reported early (its delivery deadline passed
        in flight) reports nothing when its answer comes."""
        if batch.reported:
            return
        batch.reported = True
        group = batch.group
        if group is None:
            self.post_to(
                batch.origin,
                ipc.Done(batch.batch_id, code, base_offset, log_append_time_ms, retriable, message),
            )
        else:
            group.results.append(
                ipc.Piece(
                    batch.first_index,
                    batch.record_count,
                    code,
                    base_offset,
                    log_append_time_ms,
                    retriable,
                )
            )
            if code and not group.message:
                group.message = message
            group.pending -= 1
            if group.pending == 0:
                pieces = tuple(sorted(group.results, key=lambda p: p.first_index))
                self.post_to(batch.origin, ipc.DoneSplit(batch.batch_id, pieces, group.message))

    def expired(self, batch: Batch) -> None:
        if batch.sequence != NO_SEQUENCE:
            self.identity.request_reset()
        self.finish(
            batch,
            DeliveryTimeoutError.code,
            retriable=True,
            message=(
                f"not delivered within delivery_timeout_ms={self.cfg.delivery_timeout_ms}"
                f"{self.last_error(batch)}"
            ),
        )

    def last_error(self, batch: Batch) -> str:
        """Why a batch was not delivered: its last error answer, else (never answered)
        the last broker connection failure."""
        if batch.last_error:
            return f" (last error {ec.error_name(batch.last_error)})"
        trouble = self._connection_trouble()
        return f" (last error: {trouble})" if trouble else ""

    def fail_gone_partitions(self) -> None:
        """Fails the queued batches of partitions a topic no longer has (it was created
        again with fewer): retrying them could only end in their delivery timeout."""
        for slot in [s for s in self.acc.ready_slots() if self.metadata.gone(s)]:
            for batch in self.acc.remove_slot(slot):
                self.finish_gone(batch)

    def finish_gone(self, batch: Batch) -> None:
        """Fails ``batch``: its partition is gone. A sequence it carried is now a gap."""
        if batch.sequence != NO_SEQUENCE and self.identity.is_current(batch):
            self.identity.request_reset()
        self.finish(
            batch,
            ec.UNKNOWN_TOPIC_OR_PARTITION,
            retriable=True,
            message=f"{self.where(batch)} no longer exists (the topic has fewer partitions now)",
        )

    def on_answer(self, ans: BatchAnswer, now: int) -> None:
        batch = ans.batch
        code = ans.code
        if code:
            self.shared.add(L.S_ERRORS, 1)
            batch.last_error = code
            if self.metadata.gone(batch.partition_slot):
                self.finish_gone(batch)
                return
        d = decide(code, batch, self.identity, self.cfg.retries, now)
        if d.action is Action.SUCCEED:
            self.pid.batch_acknowledged()
            self.identity.acknowledge(batch)
            self.finish(batch, 0, ans.base_offset, ans.log_append_time_ms)
            return
        if d.refresh_metadata:
            self.metadata.request_refresh(now)
        if d.action is Action.SPLIT:
            self.split(batch, now)
            return
        if d.action is Action.RETRY:
            if d.refuse_bump and not self.identity.bump_refused:
                log.warning("the broker fenced a bumped epoch: new producer ids from now on")
                self.identity.refuse_bump()
            elif d.new_id:
                self.identity.request_new_id()
            elif d.reset_producer:
                self.identity.request_reset()
            batch.attempts += 1
            batch.retry_at_ns = now + backoff_ns(
                batch.attempts, self.cfg.retry_backoff_ms, self.cfg.retry_backoff_max_ms
            )
            self.shared.add(L.S_RETRIES, 1)
            if batch.data is None:
                self.shared.set_descriptor_state(batch.buffer, L.BUF_SEALED)
            self.acc.requeue(batch)
            return
        if batch.sequence != NO_SEQUENCE:
            self.identity.request_reset()  # its sequence is now a gap
        detail = f"{ec.error_name(code)}: {ans.message}" if ans.message else ec.error_name(code)
        if code == ec.DUPLICATE_SEQUENCE_NUMBER:
            detail = (
                f"the broker already holds sequence {batch.sequence} of "
                f"{self.where(batch)} from producer id {batch.producer_id} epoch "
                f"{batch.producer_epoch}, but this batch was never sent with it before: "
                "not written (the producer resets its sequences)"
            )
            log.error("%s", detail)
        self.finish(batch, d.code, retriable=d.retriable, message=detail)

    def where(self, batch: Batch) -> str:
        where = self.metadata.locate(batch.partition_slot)
        return f"partition {where[1]} of topic {where[0]!r}" if where else "its partition"

    def split(self, batch: Batch, now: int) -> None:
        """The broker refused ``batch`` as too large: re-encode its records as two
        batches in the sender's memory, free its buffers, and queue both halves at the
        head of the partition, in order. With a sequence, the halves take exactly the
        sequences of the batch (records.split_batch), so nothing else is renumbered."""
        try:
            halves = records.split_batch(self.bytes_of(batch))
        except ProtocolError as exc:
            self.finish(batch, ec.MESSAGE_TOO_LARGE, message=f"cannot split: {exc}")
            return
        group = batch.group
        if group is None:
            group = SplitGroup()
        group.pending += len(halves) - 1
        first = batch.first_index
        pieces: list[Batch] = []
        for raw in halves:
            hdr = records.read_batch_header(raw)
            pieces.append(
                Batch(
                    buffer=NO_BUFFER,
                    run=0,
                    partition_slot=batch.partition_slot,
                    batch_id=batch.batch_id,
                    length=len(raw),
                    record_count=hdr.record_count,
                    origin=batch.origin,
                    sealed_ns=batch.sealed_ns,
                    deadline_ns=batch.deadline_ns,
                    arrival=batch.arrival,
                    attempts=max(batch.attempts, 1),
                    retry_at_ns=now,
                    sequence=hdr.base_sequence if batch.sequence != NO_SEQUENCE else NO_SEQUENCE,
                    producer_id=batch.producer_id,
                    producer_epoch=batch.producer_epoch,
                    data=bytearray(raw),
                    group=group,
                    first_index=first,
                )
            )
            first += hdr.record_count
        if batch.data is None:
            self._send_grants(self.pool.free(batch.buffer, batch.run))
        for piece in pieces:
            self.acc.requeue(piece)
        self.shared.add(L.S_BATCHES_SPLIT, 1)
        log.info(
            "batch of %d records split in %d after MESSAGE_TOO_LARGE",
            batch.record_count,
            len(pieces),
        )

    def still_intact(self, batch: Batch) -> bool:
        """Whether a queued batch's shared-memory bytes match the CRC its worker wrote:
        framing, CRC and record count, checked right before each send (the check at
        sealing reads the header only, so this is the one pass over the bytes). Patching
        the producer state then updates the CRC from the changed fields alone, so it
        never blesses other bytes. A batch written wrong, or scribbled over after sealing,
        fails alone (CorruptBatchError); if it carried a sequence, that sequence is now a
        gap (reset). A scribble landing while the request is being written cannot be seen
        without a copy."""
        if batch.data is not None:
            return True  # a piece of a split batch: the sender's own memory
        try:
            hdr = records.validate_batch(self.view, self.geo.buffer(batch.buffer), batch.length)
            if hdr.record_count != batch.record_count:
                raise ProtocolError(f"record count {hdr.record_count} != {batch.record_count}")
        except ProtocolError as exc:
            log.warning("a queued batch does not match its CRC in shared memory: %s", exc)
            if batch.sequence != NO_SEQUENCE and self.identity.is_current(batch):
                self.identity.request_reset()
            self.finish(
                batch,
                CorruptBatchError.code,
                message=f"batch written wrong or changed after sealing: {exc}",
            )
            return False
        return True

    def bytes_of(self, batch: Batch) -> memoryview:
        """A batch's bytes: in shared memory, or the sender's own for a piece."""
        if batch.data is not None:
            return memoryview(batch.data)
        off = self.geo.buffer(batch.buffer)
        return self.view[off : off + batch.length]
