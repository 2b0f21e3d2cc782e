"""How the sender ends: the owner's shutdown (queued batches are still sent until its
deadline, acks=0 connections fenced first), the owner's death, a bootstrap that timed
out, a broker refusing TLS or SASL, and a crash. Every ending goes through
:meth:`Endings.terminate`; see :mod:`shmprod.sender.lifecycle` for the exit statuses.

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

import contextlib
import logging

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import MetadataTimeoutError, OwnerDiedError, ProducerClosedError, ProducerError
from shmprod.handle import SenderSpec
from shmprod.protocol.frames import UnsupportedVersionError
from shmprod.protocol.messages import MetadataRequest, MetadataResponse
from shmprod.sender import lifecycle
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.completions import Completions
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.lifecycle import Lifecycle, Phase
from shmprod.sender.metadata import Metadata
from shmprod.sender.nodes import Nodes
from shmprod.sender.pool import BufferPool
from shmprod.sender.requests import FenceHandler
from shmprod.sender.units import MS
from shmprod.sender.workers import Workers

__all__ = ["Endings"]

log = logging.getLogger("shmprod.sender")


class Endings:
    """Shutdown, owner loss, failures and crashes, each ending in :meth:`terminate`."""

    def __init__(
        self,
        cfg: ProducerConfig,
        spec: SenderSpec,
        life: Lifecycle,
        workers: Workers,
        pool: BufferPool,
        metadata: Metadata,
        nodes: Nodes,
        acc: Accumulator,
        done: Completions,
        in_flight: InFlightLedger,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.life = life
        self.workers = workers
        self.pool = pool
        self.metadata = metadata
        self.nodes = nodes
        self.acc = acc
        self.done = done
        self.in_flight = in_flight
        self.owner_gone = False
        self.shutdown_deadline = 0
        self._fences: set[int] = set()  # acks=0 close: connections not yet past their fence
        self._fenced = False

    # -- the owner's shutdown -------------------------------------------------------------

    def begin_shutdown(self, timeout_ms: int, now: int) -> None:
        """The owner's Shutdown: stop granting, send what is queued until the deadline."""
        if self.life.phase is Phase.CLOSING:
            return
        was_bootstrapping = self.life.phase is Phase.BOOTSTRAP
        self.life.to_closing()
        self.shutdown_deadline = now + timeout_ms * MS
        if was_bootstrapping:
            self.shutdown_deadline = now  # nothing can be sent: finish at once
        self.workers.send_grants(self.pool.close())
        self.workers.send_topic_answers(self.metadata.fail_waiters(ProducerClosedError.code))
        log.info("shutting down (timeout %d ms)", timeout_ms)

    def progress_shutdown(self, now: int) -> None:
        """Ends the shutdown once nothing is queued or in flight (and, with acks=0, every
        connection is past its fence), or at the deadline."""
        idle = not len(self.acc) and not self.in_flight.requests
        if idle and self.cfg.acks == 0 and not self._fenced and now < self.shutdown_deadline:
            self._send_fences(now)
        if (not idle or self._fences) and now < self.shutdown_deadline:
            return
        self.terminate(
            ProducerClosedError.code,
            "the producer was closed by its owner",
            lifecycle.EXIT_OK,
            batch_message="the producer closed before this batch was delivered",
        )
        log.info("closed")

    def _send_fences(self, now: int) -> None:
        """acks=0: a batch is complete once written, but a broker may drop requests it
        had not read yet when the connection closes. Before closing, one Metadata request
        (brokers only) per connection; a broker answers requests of a connection in
        order, so its answer means every produce request before it was read."""
        self._fenced = True
        for conn in list(self.nodes.conns.values()):
            if not conn.ready:
                continue
            try:
                conn.send(
                    MetadataRequest(topics=[], allow_auto_topic_creation=False),
                    MetadataResponse,
                    FenceHandler(self._fences, conn.key),
                    now,
                )
            except UnsupportedVersionError:
                continue
            self._fences.add(conn.key)
            self.nodes.flush(conn, now)

    # -- failures -------------------------------------------------------------------------

    def owner_lost(self, now: int) -> None:
        """The owner's connection ended without Shutdown, or its process is gone."""
        if self.owner_gone:
            return
        self.owner_gone = True
        if self.life.phase is Phase.CLOSING:
            return  # finish the shutdown, then remove the files the owner would have
        message = "the process that created the producer died"
        log.warning("%s: shutting down and removing the segment", message)
        self.terminate(OwnerDiedError.code, message, lifecycle.EXIT_OWNER_DIED)

    def bootstrap_failed(self, last_error: str) -> None:
        """No metadata (or producer id) within max_block_ms."""
        message = (
            f"no broker of {self.cfg.bootstrap_servers!r} answered within "
            f"max_block_ms={self.cfg.max_block_ms}"
        )
        if last_error:
            message += f" (last error: {last_error}; {self.nodes.errors} connection failure(s))"
        log.error("%s", message)
        self.terminate(MetadataTimeoutError.code, message, lifecycle.EXIT_BOOTSTRAP_FAILED)

    def security_failed(self, error: Exception) -> None:
        """TLS or SASL refused by a broker: at start the owner's ``Ready`` carries the
        error (``Producer()`` raises it); later every worker gets ``Fatal``. Queued and
        in-flight batches fail with it; the sender exits (with the bootstrap status only
        while bootstrapping)."""
        code = getattr(error, "code", ProducerError.code)
        message = str(error)
        log.error("%s", message)
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        status = lifecycle.EXIT_BOOTSTRAP_FAILED if bootstrapping else lifecycle.EXIT_FAILED
        self.terminate(code, message, status)

    # -- the one ending ---------------------------------------------------------------------

    def terminate(
        self, code: int, message: str, exit_status: int, *, batch_message: str = ""
    ) -> None:
        """The one ending. H_STATE says how it ended (STATE_CLOSED for a clean shutdown,
        else STATE_FAILED with ``code``); no grant or topic answer is left waiting; every
        batch queued or in flight completes with ``code`` (``batch_message``, default
        ``message``); during bootstrap the owner's pending ``Producer()`` gets
        ``Ready(code, message)``; every worker gets ``Fatal(code, message)``; the files
        go when the owner is gone or closed the producer (so an owner killed once its
        sender exited leaves none behind: measured, a host producer's daemon killed
        while it closed); the loop then ends with ``exit_status``."""
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        closed = exit_status == lifecycle.EXIT_OK
        self.life.to_ended(L.STATE_CLOSED if closed else L.STATE_FAILED, code, exit_status)
        self.workers.send_grants(self.pool.close())
        self.workers.send_topic_answers(self.metadata.fail_waiters(code))
        self._abort_all(code, batch_message or message)
        ready = ipc.Ready(code, message) if bootstrapping else None
        self.workers.post_all(ipc.Fatal(code, message), ready=ready)
        self.workers.flush_bounded()
        if self.owner_gone or closed:
            lifecycle.remove_producer_files(self.spec.segment, self.spec.socket_path)

    def _abort_all(self, code: int, message: str) -> None:
        """Completes every batch in flight or queued with ``code``."""
        self.nodes.abort_all(code, message)
        for batch in self.acc.remove_all():
            self.done.finish(batch, code, message=message)

    def crash(self, exc: BaseException) -> None:
        """An unexpected error: the usual ending when it can still run, else at least
        H_STATE and Fatal to every worker (no future may hang); exit status 1."""
        log.critical("sender failed", exc_info=exc)
        code = ProducerError.code
        message = f"the sender process failed: {type(exc).__name__}: {exc}"
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        if not self.life.ended:
            try:
                self.terminate(code, message, lifecycle.EXIT_CRASHED)
                return
            except Exception:
                log.exception("ending after that failure failed too")
        with contextlib.suppress(Exception):
            self.life.to_ended(L.STATE_FAILED, code, lifecycle.EXIT_CRASHED)
        self.life.exit_status = lifecycle.EXIT_CRASHED
        workers = self.workers
        for conn in list(workers.conns.values()):
            if conn.authenticated and not conn.closed:
                with contextlib.suppress(Exception):
                    if conn is workers.owner and bootstrapping:
                        conn.queue(ipc.Ready(code, message))
                    conn.queue(ipc.Fatal(code, message))
                    workers.dirty.add(conn)
        with contextlib.suppress(Exception):
            workers.flush_bounded()
