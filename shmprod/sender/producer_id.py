"""When the sender asks for a producer id, when it bumps the epoch, and how long it
waits between attempts: every piece of producer-id state beside the identity itself
(:class:`~shmprod.sender.idempotence.ProducerIdentity`) lives here.

Sans-IO: the loop asks :meth:`ProducerIdDriver.step` what to do now, sends the
InitProducerId request itself when told to, and reports what became of it
(:meth:`~ProducerIdDriver.sent`, :meth:`~ProducerIdDriver.on_response`,
:meth:`~ProducerIdDriver.on_lost`, :meth:`~ProducerIdDriver.refused`). The clock is
passed in, so tests drive it.

- At start (no id yet, metadata known): ask; a failure or an error answer waits a
  backoff growing with the failures in a row.
- A reset (``identity.reset_pending``) proceeds only when the loop says it is quiet: no
  request in flight and no queued batch of unknown fate. Then the epoch is bumped in
  place when the broker allows it (``identity.bump_epoch``), else a new id is asked for.
- After a bump or a new id, the next reset waits a backoff that grows while resets
  follow each other with no batch acknowledged between them
  (:meth:`~ProducerIdDriver.batch_acknowledged` ends the run).

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import InitProducerIdResponse
from shmprod.sender.idempotence import ProducerIdentity
from shmprod.sender.policy import backoff_ns

__all__ = ["PidStep", "ProducerIdDriver"]


class PidStep(Enum):
    WAIT = "wait"  # nothing to do now
    BUMPED = "bumped"  # the epoch was bumped in place: sequences restart at 0
    REQUEST = "request"  # send InitProducerId now


class ProducerIdDriver:
    """The producer-id state machine around a :class:`ProducerIdentity`."""

    __slots__ = (
        "_backoff_max_ms",
        "_backoff_ms",
        "error",
        "failures",
        "identity",
        "in_flight",
        "resets_in_a_row",
        "retry_at",
    )

    def __init__(
        self, identity: ProducerIdentity, retry_backoff_ms: int, retry_backoff_max_ms: int
    ) -> None:
        self.identity = identity
        self._backoff_ms = retry_backoff_ms
        self._backoff_max_ms = retry_backoff_max_ms
        self.in_flight = False  # an InitProducerId request is out
        self.failures = 0  # InitProducerId failures in a row
        self.retry_at = 0  # no attempt (request or bump) before this
        self.resets_in_a_row = 0  # bumps / new ids with no batch acknowledged between
        self.error = ""  # the last failure, for the bootstrap message

    def step(self, now: int, quiet: Callable[[], bool], bootstrapped: bool) -> PidStep:
        """What to do now. ``quiet()``: nothing in flight and no batch of unknown fate
        (asked only when a reset waits); ``bootstrapped``: metadata arrived."""
        ident = self.identity
        if not ident.enabled or self.in_flight or now < self.retry_at:
            return PidStep.WAIT
        if ident.has_id and not (ident.reset_pending and quiet()):
            return PidStep.WAIT
        if ident.has_id and ident.bump_epoch():
            self._reset_done(now)
            return PidStep.BUMPED
        if not bootstrapped:
            return PidStep.WAIT
        return PidStep.REQUEST

    def sent(self) -> None:
        """The request is out."""
        self.in_flight = True

    def refused(self, message: str, now: int) -> None:
        """The request could not be sent (no version in common): try again later."""
        self.error = message
        self._failed(now)

    def on_lost(self, now: int) -> None:
        """The request's connection ended or it timed out: try again later."""
        self.in_flight = False
        self._failed(now)

    def on_response(self, resp: InitProducerIdResponse, now: int) -> bool:
        """The answer; True when it gave the identity its (new) id and epoch."""
        self.in_flight = False
        if resp.error_code:
            self.error = f"InitProducerId answered {ec.error_name(resp.error_code)}"
            self._failed(now)
            return False
        self.failures = 0
        if self.identity.has_id:
            self._reset_done(now)
        self.identity.set_identity(resp.producer_id, resp.producer_epoch)
        return True

    def batch_acknowledged(self) -> None:
        """A batch was written under the current identity: resets no longer follow each
        other."""
        self.resets_in_a_row = 0

    def next_due_ns(self, now: int) -> int | None:
        """When :meth:`step` may next act on its own (a backoff ending), if later."""
        if self.identity.enabled and self.retry_at > now:
            return self.retry_at
        return None

    def _reset_done(self, now: int) -> None:
        self.resets_in_a_row += 1
        self.retry_at = now + backoff_ns(
            self.resets_in_a_row, self._backoff_ms, self._backoff_max_ms
        )

    def _failed(self, now: int) -> None:
        self.failures += 1
        self.retry_at = now + backoff_ns(self.failures, self._backoff_ms, self._backoff_max_ms)
