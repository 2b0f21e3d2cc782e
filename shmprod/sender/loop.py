"""The sender's single-threaded selector loop, and the parts it is made of.

:class:`Sender` builds the parts and runs them from one select loop: the control plane
(:class:`~shmprod.sender.workers.Workers`: worker connections, grants, topic answers,
sealed batches), the broker connections (:class:`~shmprod.sender.nodes.Nodes`), the
completions (:class:`~shmprod.sender.completions.Completions`), the in-flight ledger,
metadata and the producer-id driver, the buffer pool and the per-partition queues, and
the lifecycle. Itself it keeps the select loop and its timers, what drives metadata and
the producer id, the drain into ProduceRequests, and the endings. Every socket is
non-blocking; control messages are buffered per connection, so no peer can stall the
loop.

One iteration: wait in ``select`` (until the earliest timer), handle the events
(accept, control messages, broker answers, writable sockets), then :meth:`Sender._tick`:
owner liveness, request timeouts, delivery timeouts and topic waits (every
``HOUSEKEEPING_NS``), metadata and producer id, drain, shutdown progress, and writing
the control messages produced.

Phases (:class:`shmprod.sender.lifecycle.Lifecycle`): BOOTSTRAP (until metadata, and the
producer id when idempotent, arrived; then ``Ready(0)`` to the owner) -> RUNNING ->
CLOSING (after the owner's ``Shutdown``) -> ENDED. Every ending goes through
:meth:`Sender._terminate`. See :mod:`shmprod.sender.lifecycle` for exit statuses.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections.abc import Callable

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import (
    CorruptBatchError,
    MetadataTimeoutError,
    OwnerDiedError,
    ProducerClosedError,
    ProducerError,
    ProtocolError,
)
from shmprod.handle import SenderSpec
from shmprod.protocol import error_codes as ec
from shmprod.protocol import records
from shmprod.protocol.frames import UnsupportedVersionError
from shmprod.protocol.messages import (
    InitProducerIdRequest,
    InitProducerIdResponse,
    MetadataRequest,
    MetadataResponse,
    ProduceResponse,
)
from shmprod.sender import lifecycle
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import Batch
from shmprod.sender.completions import Completions
from shmprod.sender.control import ControlConn
from shmprod.sender.drain import Drainer
from shmprod.sender.idempotence import MAX_IN_FLIGHT_PER_PARTITION, ProducerIdentity
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.lifecycle import Lifecycle, Phase
from shmprod.sender.metadata import Metadata
from shmprod.sender.network import ConnState, NodeConnection
from shmprod.sender.nodes import Nodes
from shmprod.sender.pool import BufferPool
from shmprod.sender.produce import build_request
from shmprod.sender.producer_id import PidStep, ProducerIdDriver
from shmprod.sender.requests import (
    FenceHandler,
    MetadataHandler,
    ProduceHandler,
    ProducerIdHandler,
)
from shmprod.sender.resolver import Resolver
from shmprod.sender.shmstate import SharedState
from shmprod.sender.workers import Workers

log = logging.getLogger("shmprod.sender")

MS = 1_000_000
HOUSEKEEPING_NS = 50 * MS
IDLE_WAIT_NS = 250 * MS
MIN_BOOTSTRAP_WAIT_MS = 1_000


class Sender:
    """The sender process's state and loop. Runs in: sender (one thread)."""

    def __init__(
        self,
        spec: SenderSpec,
        view: memoryview,
        listen: socket.socket,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        owner_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.cfg = ProducerConfig(**spec.config)
        self.clock = clock
        self.view = view
        self.geo = L.read_geometry(view)
        self.shared = SharedState(view, self.geo)
        self.pool = BufferPool(self.shared)
        self.acc = Accumulator(self.shared)
        self.identity = ProducerIdentity(self.cfg.enable_idempotence)
        self.pid = ProducerIdDriver(
            self.identity, self.cfg.retry_backoff_ms, self.cfg.retry_backoff_max_ms
        )
        self.metadata = Metadata(
            self.shared,
            max_age_ms=self.cfg.metadata_max_age_ms,
            retry_backoff_ms=self.cfg.retry_backoff_ms,
            retry_backoff_max_ms=self.cfg.retry_backoff_max_ms,
            max_block_ms=self.cfg.max_block_ms,
        )
        self.max_in_flight = self.cfg.max_in_flight_requests_per_connection
        partition_limit = self.max_in_flight
        if self.identity.enabled:
            partition_limit = min(partition_limit, MAX_IN_FLIGHT_PER_PARTITION)
        self.drainer = Drainer(self.cfg.max_request_size, partition_limit)
        self._owner_alive = owner_alive or lifecycle.owner_watch(
            spec.owner_pid, spec.owner_start_us
        )

        self._listen = listen
        listen.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listen, selectors.EVENT_READ, None)
        resolver = Resolver()
        self._sel.register(resolver.wake_socket, selectors.EVENT_READ, resolver)
        self._masks: dict[int, int] = {}
        self.nodes = Nodes(
            self.cfg,
            self.metadata,
            resolver,
            watch=self._set_mask,
            forget=self._forget_socket,
            on_fatal=self._security_failed,
            bootstrapping=lambda: self.life.phase is Phase.BOOTSTRAP,
            note_bootstrap_error=self._note_bootstrap_error,
        )

        self._owner_gone = False
        self.life = Lifecycle(self.shared)
        self.in_flight = InFlightLedger(self.shared)
        self.done = Completions(
            self.cfg,
            view,
            self.geo,
            self.shared,
            self.pool,
            self.acc,
            self.metadata,
            self.identity,
            self.pid,
            self.in_flight,
            post_to=lambda origin, msg: self.workers.post_to(origin, msg),
            send_grants=lambda results: self.workers.send_grants(results),
            connection_trouble=self.nodes.trouble,
        )
        self.workers = Workers(
            self.cfg,
            listen,
            bytes.fromhex(spec.secret_hex),
            spec.owner_pid,
            view,
            self.geo,
            self.shared,
            self.pool,
            self.metadata,
            self.acc,
            self.done,
            self.life,
            clock,
            watch=self._set_mask,
            forget=self._forget_socket,
            on_shutdown=self._begin_shutdown,
            on_owner_lost=self._owner_lost,
        )

        self._fences: set[int] = set()  # acks=0 close: connections not yet past their fence
        self._fenced = False

        now = clock()
        self._metadata_handler = MetadataHandler(self.metadata, self.workers, self.done, self.nodes)
        self._pid_handler = ProducerIdHandler(self.pid, self._on_producer_id)
        wait_ms = max(self.cfg.max_block_ms, MIN_BOOTSTRAP_WAIT_MS)
        self._bootstrap_deadline = now + wait_ms * MS
        self._bootstrap_error = ""
        self._shutdown_deadline = 0
        self._next_housekeeping = now

    # =====================================================================================
    # The loop
    # =====================================================================================

    def run(self) -> int:
        """Runs until shutdown, owner death, bootstrap failure or a crash; returns the
        exit status. An unexpected exception sends Fatal to every worker first."""
        try:
            while not self.life.ended:
                self.step()
        except Exception as exc:
            self._crash(exc)
        finally:
            self._close_everything()
        assert self.life.exit_status is not None
        return self.life.exit_status

    def step(self) -> None:
        """One iteration: select, handle events, run timers."""
        now = self.clock()
        timeout_s = max(0, self._next_wakeup(now) - now) / 1e9
        events = self._sel.select(timeout_s)
        now = self.clock()
        for key, mask in events:
            data = key.data
            if data is None:
                self.workers.accept(now)
            elif data is self.nodes.resolver:
                self.nodes.resolver.on_readable(now)
            elif isinstance(data, ControlConn):
                if not data.closed:
                    if mask & selectors.EVENT_READ:
                        self.workers.on_readable(data, now)
                    if mask & selectors.EVENT_WRITE and not data.closed:
                        self.workers.dirty.add(data)
            elif isinstance(data, NodeConnection) and data.state != ConnState.CLOSED:
                if mask & selectors.EVENT_WRITE:
                    self.nodes.on_writable(data, now)
                if mask & selectors.EVENT_READ and data.sock is not None:
                    self.nodes.on_readable(data, now)
            if self.life.ended:
                return
        self._tick(now)

    def _tick(self, now: int) -> None:
        if not self._owner_gone and not self._owner_alive():
            log.warning("the owner process is gone")
            self._owner_lost(now)
        if self.life.ended:
            return
        self.nodes.check_timeouts(now)
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_NS
            self._housekeeping(now)
        if self.life.ended:
            return
        if self.life.phase is Phase.BOOTSTRAP and now >= self._bootstrap_deadline:
            self._bootstrap_failed(now)
            return
        self._drive_metadata(now)
        self._drive_producer_id(now)
        self._maybe_ready()
        self._drain(now)
        if self.life.phase is Phase.CLOSING:
            self._progress_shutdown(now)
        self.workers.flush()
        self._sync_interest()

    def _next_wakeup(self, now: int) -> int:
        busy = (
            len(self.acc)
            or self.in_flight.requests
            or self.pool.n_waiting
            or self.metadata.has_waiters
            or self.life.phase is not Phase.RUNNING
        )
        at = now + (HOUSEKEEPING_NS if busy else IDLE_WAIT_NS)
        candidates: list[int | None] = [
            self.metadata.next_due_ns(),
            self.acc.next_retry_ns(),
        ]
        candidates.append(self.nodes.next_deadline_ns())
        if self.life.phase is Phase.BOOTSTRAP:
            candidates.append(self._bootstrap_deadline)
        if self.life.phase is Phase.CLOSING:
            candidates.append(self._shutdown_deadline)
        candidates.append(self.pid.next_due_ns(now))
        for c in candidates:
            if c is not None and c < at:
                at = c
        return at

    def _sync_interest(self) -> None:
        """Asks for EVENT_WRITE exactly on the sockets with bytes waiting to go out."""
        for conn in list(self.workers.conns.values()):
            if not conn.closed:
                self._set_mask(conn.sock, conn, conn.wants_write)
        for node in self.nodes.conns.values():
            if node.sock is not None:
                self._set_mask(node.sock, node, node.wants_write)

    def _set_mask(self, sock: socket.socket, data: object, write: bool) -> None:
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        fd = sock.fileno()
        old = self._masks.get(fd)
        if old == mask:
            return
        try:
            if old is None:
                self._sel.register(sock, mask, data)
            else:
                self._sel.modify(sock, mask, data)
        except KeyError:  # the selector and our map disagree (an fd number reused)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(fd)
            self._sel.register(sock, mask, data)
        self._masks[fd] = mask

    def _forget_socket(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        fd = sock.fileno()
        if fd >= 0 and self._masks.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)

    def _housekeeping(self, now: int) -> None:
        """Timers checked every HOUSEKEEPING_NS: Hello timeouts, delivery timeouts, topic
        waits."""
        self.workers.drop_silent(now)
        self.done.expire(now)
        self.workers.send_topic_answers(self.metadata.expire_waiters(now))

    def _note_bootstrap_error(self, reason: str) -> None:
        self._bootstrap_error = reason

    # -- metadata and producer id --------------------------------------------------------

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
            self._bootstrap_error = str(exc)
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
            self._bootstrap_error = self.pid.error
            return
        self.pid.sent()
        self.nodes.flush(conn, now)

    def _on_producer_id(self, resp: InitProducerIdResponse, now: int) -> None:
        renewed = self.identity.has_id
        if not self.pid.on_response(resp, now):
            self._bootstrap_error = self.pid.error
            log.warning("%s", self._bootstrap_error)
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

    def _maybe_ready(self) -> None:
        if self.life.phase is not Phase.BOOTSTRAP or not self.metadata.bootstrapped:
            return
        if self.identity.enabled and not self.identity.has_id:
            return
        self.life.to_running()
        if self.workers.owner is not None:
            self.workers.post(self.workers.owner, ipc.Ready(0))
        log.info("ready")

    def _bootstrap_failed(self, now: int) -> None:
        code = MetadataTimeoutError.code
        message = (
            f"no broker of {self.cfg.bootstrap_servers!r} answered within "
            f"max_block_ms={self.cfg.max_block_ms}"
        )
        if self._bootstrap_error:
            message += (
                f" (last error: {self._bootstrap_error}; {self.nodes.errors} connection failure(s))"
            )
        log.error("%s", message)
        self._terminate(code, message, lifecycle.EXIT_BOOTSTRAP_FAILED)

    def _security_failed(self, error: Exception) -> None:
        """TLS or SASL refused by a broker: at start the owner's ``Ready`` carries the
        error (``Producer()`` raises it); later every worker gets ``Fatal``. Queued and
        in-flight batches fail with it; the sender exits (with the bootstrap status only
        while bootstrapping)."""
        code = getattr(error, "code", ProducerError.code)
        message = str(error)
        log.error("%s", message)
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        status = lifecycle.EXIT_BOOTSTRAP_FAILED if bootstrapping else lifecycle.EXIT_FAILED
        self._terminate(code, message, status)

    # -- drain ---------------------------------------------------------------------------

    def _drain(self, now: int) -> None:
        if self.life.phase is Phase.BOOTSTRAP or not len(self.acc) or not self.identity.can_drain:
            return
        only = self.identity.resolving if self.identity.reset_pending else None
        by_node, no_leader = self.drainer.ready_by_leader(
            self.acc, self.metadata.leader, self.in_flight.per_partition, now, only
        )
        if no_leader:
            self.metadata.request_refresh(now)
        for node, slots in by_node.items():
            conn = self.nodes.for_node(node, now)
            if conn is None or not conn.ready:
                continue
            while conn.ready and conn.in_flight < self.max_in_flight:
                batches = self.drainer.drain(
                    node, slots, self.acc, self.in_flight.per_partition, now, only
                )
                if not batches:
                    break
                self._send_produce(conn, batches, now)

    def _send_produce(self, conn: NodeConnection, batches: list[Batch], now: int) -> None:
        """Checks each batch's bytes again, assigns sequences (idempotence), then queues
        one ProduceRequest and writes it."""
        ident = self.identity
        batches = [b for b in batches if self.done.still_intact(b)]
        if not batches:
            return
        if ident.enabled:
            ok: list[Batch] = []
            for batch in batches:
                try:
                    if batch.unresolved:  # the last request with it was never answered
                        batch.maybe_written = True
                    if ident.assign(batch):
                        batch.maybe_written = False  # a new sequence: never sent with it
                        records.patch_producer_state(
                            self.view if batch.data is None else batch.data,
                            self.geo.buffer(batch.buffer) if batch.data is None else 0,
                            ident.producer_id,
                            ident.producer_epoch,
                            batch.sequence,
                        )
                except ProtocolError as exc:
                    self.done.finish(batch, CorruptBatchError.code, message=str(exc))
                    continue
                ok.append(batch)
            batches = ok
            if not batches:
                return

        def locate(slot: int) -> tuple[str, int]:
            where = self.metadata.locate(slot)
            assert where is not None  # checked when sealed; slots are never unmapped
            return where

        req, ctx = build_request(
            conn.node_id,
            batches,
            locate,
            self.done.bytes_of,
            acks=self.cfg.acks,
            timeout_ms=self.cfg.request_timeout_ms,
        )
        try:
            answer = ProduceResponse if self.cfg.acks != 0 else None
            conn.send(req, answer, ProduceHandler(ctx, self.in_flight, self.done), now)
        except UnsupportedVersionError as exc:
            for batch in batches:
                self.done.finish(batch, ec.UNSUPPORTED_VERSION, message=str(exc))
            return
        for batch in batches:
            batch.unresolved = ident.enabled
            if batch.data is None:
                self.shared.set_descriptor_state(batch.buffer, L.BUF_IN_FLIGHT)
        self.in_flight.sent(batches)
        self.nodes.flush(conn, now)

    # =====================================================================================
    # Endings
    # =====================================================================================

    def _begin_shutdown(self, timeout_ms: int, now: int) -> None:
        """The owner's Shutdown: stop granting, send what is queued until the deadline."""
        if self.life.phase is Phase.CLOSING:
            return
        was_bootstrapping = self.life.phase is Phase.BOOTSTRAP
        self.life.to_closing()
        self._shutdown_deadline = now + timeout_ms * MS
        if was_bootstrapping:
            self._shutdown_deadline = now  # nothing can be sent: finish at once
        self.workers.send_grants(self.pool.close())
        self.workers.send_topic_answers(self.metadata.fail_waiters(ProducerClosedError.code))
        log.info("shutting down (timeout %d ms)", timeout_ms)

    def _progress_shutdown(self, now: int) -> None:
        idle = not len(self.acc) and not self.in_flight.requests
        if idle and self.cfg.acks == 0 and not self._fenced and now < self._shutdown_deadline:
            self._send_fences(now)
        if (not idle or self._fences) and now < self._shutdown_deadline:
            return
        self._terminate(
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
                    FenceHandler(self._fences, conn.node_id),
                    now,
                )
            except UnsupportedVersionError:
                continue
            self._fences.add(conn.node_id)
            self.nodes.flush(conn, now)

    def _owner_lost(self, now: int) -> None:
        """The owner's connection ended without Shutdown, or its process is gone."""
        if self._owner_gone:
            return
        self._owner_gone = True
        if self.life.phase is Phase.CLOSING:
            return  # finish the shutdown, then remove the files the owner would have
        message = "the process that created the producer died"
        log.warning("%s: shutting down and removing the segment", message)
        self._terminate(OwnerDiedError.code, message, lifecycle.EXIT_OWNER_DIED)

    def _terminate(
        self, code: int, message: str, exit_status: int, *, batch_message: str = ""
    ) -> None:
        """The one ending. H_STATE says how it ended (STATE_CLOSED for a clean shutdown,
        else STATE_FAILED with ``code``); no grant or topic answer is left waiting; every
        batch queued or in flight completes with ``code`` (``batch_message``, default
        ``message``); during bootstrap the owner's pending ``Producer()`` gets
        ``Ready(code, message)``; every worker gets ``Fatal(code, message)``; the files
        go when the owner is gone; the loop then ends with ``exit_status``. Runs in:
        sender."""
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        closed = exit_status == lifecycle.EXIT_OK
        self.life.to_ended(L.STATE_CLOSED if closed else L.STATE_FAILED, code, exit_status)
        self.workers.send_grants(self.pool.close())
        self.workers.send_topic_answers(self.metadata.fail_waiters(code))
        self._abort_all(code, batch_message or message)
        ready = ipc.Ready(code, message) if bootstrapping else None
        self.workers.post_all(ipc.Fatal(code, message), ready=ready)
        self.workers.flush_bounded()
        if self._owner_gone:
            lifecycle.remove_producer_files(self.spec.segment, self.spec.socket_path)

    def _abort_all(self, code: int, message: str) -> None:
        """Completes every batch in flight or queued with ``code``."""
        self.nodes.abort_all(code, message)
        for batch in self.acc.remove_all():
            self.done.finish(batch, code, message=message)

    def _crash(self, exc: BaseException) -> None:
        """An unexpected error: the usual ending when it can still run, else at least
        H_STATE and Fatal to every worker (no future may hang); exit status 1."""
        log.critical("sender failed", exc_info=exc)
        code = ProducerError.code
        message = f"the sender process failed: {type(exc).__name__}: {exc}"
        bootstrapping = self.life.phase is Phase.BOOTSTRAP
        if not self.life.ended:
            try:
                self._terminate(code, message, lifecycle.EXIT_CRASHED)
                return
            except Exception:
                log.exception("ending after that failure failed too")
        with contextlib.suppress(Exception):
            self.life.to_ended(L.STATE_FAILED, code, lifecycle.EXIT_CRASHED)
        self.life.exit_status = lifecycle.EXIT_CRASHED
        for conn in list(self.workers.conns.values()):
            if conn.authenticated and not conn.closed:
                with contextlib.suppress(Exception):
                    if conn is self.workers.owner and bootstrapping:
                        conn.queue(ipc.Ready(code, message))
                    conn.queue(ipc.Fatal(code, message))
                    self.workers.dirty.add(conn)
        with contextlib.suppress(Exception):
            self.workers.flush_bounded()

    def _close_everything(self) -> None:
        self.nodes.close_all()
        self.workers.close_all()
        with contextlib.suppress(Exception):
            self._sel.close()
        with contextlib.suppress(OSError):
            self._listen.close()
