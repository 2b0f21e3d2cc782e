"""What keeps metadata fresh and the producer id valid: when each is due, the request is
built here and sent on any ready broker connection; answers come back through the
request handlers (:mod:`shmprod.sender.requests`), and the producer-id answer is applied
here. The state machines themselves are sans-IO: :class:`~shmprod.sender.metadata.Metadata`
says when a refresh is due, :class:`~shmprod.sender.producer_id.ProducerIdDriver` when to
ask for an id or bump the epoch; this module only acts on what they say.

``last_error`` keeps the most recent reason bootstrap could not finish (a broker that
refused a request version, an InitProducerId error), for the message the owner gets if
bootstrap times out.

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

import logging

from shmprod import layout as L
from shmprod.protocol.frames import UnsupportedVersionError
from shmprod.protocol.messages import (
    InitProducerIdRequest,
    InitProducerIdResponse,
    MetadataResponse,
)
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.completions import Completions
from shmprod.sender.idempotence import ProducerIdentity
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.metadata import Metadata
from shmprod.sender.nodes import Nodes
from shmprod.sender.producer_id import PidStep, ProducerIdDriver
from shmprod.sender.requests import MetadataHandler, ProducerIdHandler
from shmprod.sender.shmstate import SharedState
from shmprod.sender.workers import Workers

__all__ = ["MetadataIdDriver"]

log = logging.getLogger("shmprod.sender")


class MetadataIdDriver:
    """Sends Metadata and InitProducerId requests when they are due and applies the
    producer-id answers."""

    def __init__(
        self,
        shared: SharedState,
        metadata: Metadata,
        identity: ProducerIdentity,
        pid: ProducerIdDriver,
        acc: Accumulator,
        in_flight: InFlightLedger,
        nodes: Nodes,
        workers: Workers,
        done: Completions,
    ) -> None:
        self.shared = shared
        self.metadata = metadata
        self.identity = identity
        self.pid = pid
        self.acc = acc
        self.in_flight = in_flight
        self.nodes = nodes
        self.last_error = ""
        self._metadata_handler = MetadataHandler(metadata, workers, done, nodes)
        self._pid_handler = ProducerIdHandler(pid, self.on_producer_id)

    @property
    def ready(self) -> bool:
        """Metadata arrived, and the producer id too when idempotent."""
        if not self.metadata.bootstrapped:
            return False
        return not self.identity.enabled or self.identity.has_id

    def next_due_ns(self, now: int) -> int | None:
        """The earliest time either needs the loop again (None: nothing scheduled)."""
        due = [t for t in (self.metadata.next_due_ns(), self.pid.next_due_ns(now)) if t is not None]
        return min(due, default=None)

    def tick(self, now: int) -> None:
        """Sends what is due. Runs in: sender."""
        self._drive_metadata(now)
        self._drive_producer_id(now)

    def _drive_metadata(self, now: int) -> None:
        if not self.metadata.due(now):
            return
        conn = self.nodes.any_ready(now)
        if conn is None:
            return
        try:
            req = self.metadata.build_request()
            conn.send(req, MetadataResponse, self._metadata_handler, now)
        except UnsupportedVersionError as exc:
            self.metadata.on_failure(now)
            self.last_error = str(exc)
            log.error("%s", exc)
            return
        self.shared.add(L.S_METADATA_REFRESHES, 1)
        self.nodes.flush(conn, now)

    def _drive_producer_id(self, now: int) -> None:
        step = self.pid.step(now, self._reset_may_proceed, self.metadata.bootstrapped)
        ident = self.identity
        if step is PidStep.BUMPED:
            self.acc.clear_sequences()
            self.shared.add(L.S_EPOCH_BUMPS, 1)
            log.info("producer id %d: epoch bumped to %d", ident.producer_id, ident.producer_epoch)
            return
        if step is not PidStep.REQUEST:
            return
        conn = self.nodes.any_ready(now)
        if conn is None:
            return
        try:
            conn.send(InitProducerIdRequest(), InitProducerIdResponse, self._pid_handler, now)
        except UnsupportedVersionError as exc:
            self.pid.refused(f"InitProducerId: {exc}", now)
            self.last_error = self.pid.error
            return
        self.pid.sent()
        self.nodes.flush(conn, now)

    def on_producer_id(self, resp: InitProducerIdResponse, now: int) -> None:
        """Applies an InitProducerId answer: sequences restart under the new id."""
        renewed = self.identity.has_id
        if not self.pid.on_response(resp, now):
            self.last_error = self.pid.error
            log.warning("%s", self.last_error)
            return
        if renewed:
            self.shared.add(L.S_PRODUCER_ID_RESETS, 1)
        self.acc.clear_sequences()
        log.info("producer id %d epoch %d", resp.producer_id, resp.producer_epoch)

    def _reset_may_proceed(self) -> bool:
        """Nothing in flight, and no queued batch was sent under the current identity and
        never answered (a reset waits until the broker has answered for each: see
        idempotence.py). Only queue heads count: behind a head the broker answered,
        nothing can be written."""
        if self.in_flight.requests:
            return False
        resolving = self.identity.resolving
        return not any(
            (head := self.acc.head(slot)) is not None and resolving(head)
            for slot in self.acc.ready_slots()
        )
