"""What to do with a batch's answer: succeed, retry (after a backoff), reset, or fail.

Pure functions: the error code, the batch, the producer identity and ``now_ns`` in, a
decision out. The loop applies it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

from shmprod.errors import DeliveryTimeoutError
from shmprod.protocol import error_codes as ec
from shmprod.sender.batch import Batch
from shmprod.sender.idempotence import ProducerIdentity
from shmprod.sender.units import MS


class Action(Enum):
    SUCCEED = "succeed"
    RETRY = "retry"
    SPLIT = "split"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    code: int  # the code to report when failing (Kafka's, or a shmprod one)
    retriable: bool = False  # reported with a failure: could a later send succeed?
    refresh_metadata: bool = False
    reset_producer: bool = False
    refuse_bump: bool = False  # the broker fenced a self-bumped epoch: take new ids
    new_id: bool = False  # the broker does not know the producer id: take a new one


def decide(
    code: int, batch: Batch, identity: ProducerIdentity, retries: int, now_ns: int
) -> Decision:
    """The decision for ``batch`` answered with ``code`` (0 = written).

    - 0: success. 46 DUPLICATE_SEQUENCE_NUMBER when idempotent: success only for a
      batch that an earlier request carried with this sequence and never answered (it
      may have been written, its answer lost); otherwise another batch holds the
      sequence: fail, loudly.
    - 45 OUT_OF_ORDER_SEQUENCE_NUMBER: fallout of an earlier batch's failure (retry), or
      when the batch is the first unacknowledged one, a broken sequence: retry under a
      new epoch (reset). 59 UNKNOWN_PRODUCER_ID: the same reset, or a new producer id
      when the batch already started from sequence 0 (the broker does not know the id).
    - 90 PRODUCER_FENCED / 47 INVALID_PRODUCER_EPOCH for a batch under an epoch the
      producer bumped itself: the broker does not take such bumps; retry under a new
      producer id (refuse_bump). Otherwise they are fatal for the batch.
    - Retriable codes (protocol.error_codes): retry, refreshing metadata when the code
      calls for it, while ``attempts < retries`` and the delivery deadline has not
      passed; then fail with the code (deadline passed: DeliveryTimeoutError's code).
    - 10 MESSAGE_TOO_LARGE: split the batch in two and send both (a batch of one record
      cannot be split: fail with the code), until the delivery deadline.
    - Anything else: fail with the code.
    """
    if code == ec.NONE:
        return Decision(Action.SUCCEED, 0)
    if code == ec.DUPLICATE_SEQUENCE_NUMBER and identity.enabled:
        if batch.maybe_written:
            return Decision(Action.SUCCEED, 0)  # an earlier send of it was written
        # No earlier send of it can have been written (none, or each was answered with
        # an error): the broker holds ANOTHER batch under this sequence. Success would
        # lose this one: fail, loudly.
        return Decision(Action.FAIL, code, retriable=True, reset_producer=True)
    reset = False
    retriable = True
    special: Decision | None = None  # a retry or split that does not count against retries
    if identity.enabled and code == ec.OUT_OF_ORDER_SEQUENCE_NUMBER:
        reset = identity.is_next_expected(batch)
    elif identity.enabled and code == ec.UNKNOWN_PRODUCER_ID:
        reset = True
        if identity.id_unknown(code, batch):
            special = Decision(Action.RETRY, code, retriable=True, reset_producer=True, new_id=True)
    elif identity.refuses_bump(code, batch):
        special = Decision(
            Action.RETRY, code, retriable=True, reset_producer=True, refuse_bump=True
        )
    elif code == ec.MESSAGE_TOO_LARGE and batch.record_count > 1:
        special = Decision(Action.SPLIT, code, retriable=True)
    else:
        retriable = ec.is_retriable(code)
    if not retriable:
        return Decision(Action.FAIL, code)
    if now_ns >= batch.deadline_ns:
        return Decision(Action.FAIL, DeliveryTimeoutError.code, retriable=True)
    if special is not None:
        return special
    if batch.attempts >= retries:
        return Decision(Action.FAIL, code, retriable=True)
    return Decision(
        Action.RETRY,
        code,
        retriable=True,
        refresh_metadata=ec.needs_metadata_refresh(code),
        reset_producer=reset,
    )


def backoff_ns(attempts: int, base_ms: int, max_ms: int, rng: random.Random | None = None) -> int:
    """Exponential backoff with +-20% jitter: base * 2^(attempts-1), capped at ``max_ms``."""
    if attempts <= 0 or base_ms <= 0:
        return 0
    term = base_ms * (2 ** min(attempts - 1, 32))
    jitter = (rng or random).uniform(0.8, 1.2)
    return int(min(term * jitter, max(max_ms, base_ms)) * MS)
