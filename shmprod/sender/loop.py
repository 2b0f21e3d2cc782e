"""The sender's single-threaded select loop: it builds the parts, ticks their timers,
drains ready batches into ProduceRequests and sends them.

The parts, each with one job:

- the control plane (:class:`~shmprod.sender.workers.Workers`: worker connections,
  grants, topic answers, sealed batches);
- the broker connections (:class:`~shmprod.sender.nodes.Nodes`);
- the completions (:class:`~shmprod.sender.completions.Completions`) and the in-flight
  ledger;
- metadata and the producer id (:class:`~shmprod.sender.driver.MetadataIdDriver` acting
  on the sans-IO state machines);
- the buffer pool and the per-partition queues;
- the lifecycle and the endings (:class:`~shmprod.sender.endings.Endings`);
- the selector (:class:`~shmprod.sender.poller.Poller`).

Every socket is non-blocking; control messages are buffered per connection, so no peer
can stall the loop.

One iteration: wait in ``select`` (until the earliest timer), handle the events
(accept, control messages, broker answers, writable sockets), then :meth:`Sender._tick`:
owner liveness, request timeouts, delivery timeouts and topic waits (every
``HOUSEKEEPING_NS``), metadata and producer id, drain, shutdown progress, and writing
the control messages produced.

Phases (:class:`shmprod.sender.lifecycle.Lifecycle`): BOOTSTRAP (until metadata, and the
producer id when idempotent, arrived; then ``Ready(0)`` to the owner) -> RUNNING ->
CLOSING (after the owner's ``Shutdown``) -> ENDED. Every ending goes through
:meth:`Endings.terminate <shmprod.sender.endings.Endings.terminate>`.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections.abc import Callable, Iterator

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import CorruptBatchError, ProtocolError
from shmprod.handle import SenderSpec
from shmprod.protocol import error_codes as ec
from shmprod.protocol import records
from shmprod.protocol.frames import UnsupportedVersionError
from shmprod.protocol.messages import ProduceResponse
from shmprod.sender import lifecycle
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import Batch
from shmprod.sender.completions import Completions
from shmprod.sender.control import ControlConn
from shmprod.sender.drain import Drainer
from shmprod.sender.driver import MetadataIdDriver
from shmprod.sender.endings import Endings
from shmprod.sender.idempotence import MAX_IN_FLIGHT_PER_PARTITION, ProducerIdentity
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.lifecycle import Lifecycle, Phase
from shmprod.sender.metadata import Metadata
from shmprod.sender.network import ConnState, NodeConnection
from shmprod.sender.nodes import Nodes
from shmprod.sender.poller import Poller
from shmprod.sender.pool import BufferPool, spare_target
from shmprod.sender.produce import build_request
from shmprod.sender.producer_id import ProducerIdDriver
from shmprod.sender.requests import ProduceHandler
from shmprod.sender.resolver import Resolver
from shmprod.sender.shmstate import SharedState
from shmprod.sender.units import MS
from shmprod.sender.workers import Workers

log = logging.getLogger("shmprod.sender")

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
        self.cfg = cfg = ProducerConfig(**spec.config)
        self.clock = clock
        self.view = view
        self.geo = L.read_geometry(view)
        self.shared = SharedState(view, self.geo)
        self.pool = BufferPool(self.shared, spare_target(self.geo.n_buffers))
        self.acc = Accumulator(self.shared)
        self.identity = ProducerIdentity(cfg.enable_idempotence)
        self.pid = ProducerIdDriver(self.identity, cfg.retry_backoff_ms, cfg.retry_backoff_max_ms)
        self.metadata = Metadata(
            self.shared,
            max_age_ms=cfg.metadata_max_age_ms,
            retry_backoff_ms=cfg.retry_backoff_ms,
            retry_backoff_max_ms=cfg.retry_backoff_max_ms,
            max_block_ms=cfg.max_block_ms,
        )
        self.max_in_flight = cfg.max_in_flight_requests_per_connection
        partition_limit = self.max_in_flight
        if self.identity.enabled:
            partition_limit = min(partition_limit, MAX_IN_FLIGHT_PER_PARTITION)
        self.drainer = Drainer(cfg.max_request_size, partition_limit)
        self._owner_alive = owner_alive or lifecycle.owner_watch(
            spec.owner_pid, spec.owner_start_us
        )

        self._listen = listen
        listen.setblocking(False)
        self.poller = Poller()
        self.poller.add_reader(listen, None)
        resolver = Resolver()
        self.poller.add_reader(resolver.wake_socket, resolver)
        self.nodes = Nodes(
            cfg,
            self.metadata,
            resolver,
            watch=self.poller.watch,
            forget=self.poller.forget,
            on_fatal=lambda error: self.endings.security_failed(error),
            bootstrapping=lambda: self.life.phase is Phase.BOOTSTRAP,
            note_bootstrap_error=self._note_bootstrap_error,
        )

        self.life = Lifecycle(self.shared)
        self.in_flight = InFlightLedger(self.shared)
        self.done = Completions(
            cfg,
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
            cfg,
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
            watch=self.poller.watch,
            forget=self.poller.forget,
            on_shutdown=lambda timeout_ms, now: self.endings.begin_shutdown(timeout_ms, now),
            on_owner_lost=lambda now: self.endings.owner_lost(now),
        )
        self.driver = MetadataIdDriver(
            self.shared,
            self.metadata,
            self.identity,
            self.pid,
            self.acc,
            self.in_flight,
            self.nodes,
            self.workers,
            self.done,
        )
        self.endings = Endings(
            cfg,
            spec,
            self.life,
            self.workers,
            self.pool,
            self.metadata,
            self.nodes,
            self.acc,
            self.done,
            self.in_flight,
        )

        now = clock()
        wait_ms = max(cfg.max_block_ms, MIN_BOOTSTRAP_WAIT_MS)
        self._bootstrap_deadline = now + wait_ms * MS
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
            self.endings.crash(exc)
        finally:
            self.close_everything()
        assert self.life.exit_status is not None
        return self.life.exit_status

    def step(self) -> None:
        """One iteration: select, handle events, run timers."""
        now = self.clock()
        timeout_s = max(0, self.next_wakeup(now) - now) / 1e9
        events = self.poller.select(timeout_s)
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
        if not self.endings.owner_gone and not self._owner_alive():
            log.warning("the owner process is gone")
            self.endings.owner_lost(now)
        if self.life.ended:
            return
        self.nodes.check_timeouts(now)
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_NS
            self._housekeeping(now)
        if self.life.ended:
            return
        if self.life.phase is Phase.BOOTSTRAP and now >= self._bootstrap_deadline:
            self.endings.bootstrap_failed(self.driver.last_error)
            return
        self.driver.tick(now)
        if self.life.phase is Phase.BOOTSTRAP and self.driver.ready:
            self.life.to_running()
            if self.workers.owner is not None:
                self.workers.post(self.workers.owner, ipc.Ready(0))
            log.info("ready")
        self._drain(now)
        if self.life.phase is Phase.CLOSING:
            self.endings.progress_shutdown(now)
        self.workers.flush()
        self.poller.sync(self._peers())

    def next_wakeup(self, now: int) -> int:
        """When the loop must run again at the latest: the earliest timer of any part."""
        busy = (
            len(self.acc)
            or self.in_flight.requests
            or self.pool.n_waiting
            or self.metadata.has_waiters
            or self.life.phase is not Phase.RUNNING
        )
        at = now + (HOUSEKEEPING_NS if busy else IDLE_WAIT_NS)
        candidates = [
            self.driver.next_due_ns(now),
            self.acc.next_retry_ns(),
            self.nodes.next_deadline_ns(),
        ]
        if self.life.phase is Phase.BOOTSTRAP:
            candidates.append(self._bootstrap_deadline)
        if self.life.phase is Phase.CLOSING:
            candidates.append(self.endings.shutdown_deadline)
        for c in candidates:
            if c is not None and c < at:
                at = c
        return at

    def _peers(self) -> Iterator[tuple[socket.socket, object, bool]]:
        """Every open socket with whether bytes wait to go out on it."""
        for conn in list(self.workers.conns.values()):
            if not conn.closed:
                yield conn.sock, conn, conn.wants_write
        for node in self.nodes.conns.values():
            if node.sock is not None:
                yield node.sock, node, node.wants_write

    def _housekeeping(self, now: int) -> None:
        """Timers checked every HOUSEKEEPING_NS: Hello timeouts, delivery timeouts, topic
        waits."""
        self.workers.drop_silent(now)
        self.done.expire(now)
        self.workers.send_topic_answers(self.metadata.expire_waiters(now))

    def _note_bootstrap_error(self, reason: str) -> None:
        self.driver.last_error = reason

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
        lanes = self.cfg.connections_per_broker
        for node, slots in by_node.items():
            if lanes == 1:
                self._drain_lane(node, 0, slots, now, only)
                continue
            # each partition's requests always take the same one of the node's
            # connections, so its batches stay in order on one connection
            by_lane: dict[int, list[int]] = {}
            for slot in slots:
                by_lane.setdefault(slot % lanes, []).append(slot)
            for lane, lane_slots in by_lane.items():
                self._drain_lane(node, lane, lane_slots, now, only)

    def _drain_lane(
        self,
        node: int,
        lane: int,
        slots: list[int],
        now: int,
        only: Callable[[Batch], bool] | None,
    ) -> None:
        """Fills connection ``lane`` to ``node`` with requests of ``slots``' batches, up
        to its in-flight limit."""
        conn = self.nodes.for_node(node, now, lane)
        if conn is None or not conn.ready:
            return
        while conn.ready and conn.in_flight < self.max_in_flight:
            batches = self.drainer.drain(
                conn.key, slots, self.acc, self.in_flight.per_partition, now, only
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
    # Closing the sockets
    # =====================================================================================

    def close_everything(self) -> None:
        self.nodes.close_all()
        self.workers.close_all()
        self.poller.close()
        with contextlib.suppress(OSError):
            self._listen.close()
