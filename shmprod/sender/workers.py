"""The control plane: the worker processes attached to the producer, over their control
connections -- Hello and Welcome (the handle's secret, one slot each), grants of pool
buffers, topic answers, sealed batches taken into the partition queues, Bye, and a
worker's death (its buffers reclaimed) -- and the owner among them, whose Shutdown or
death ends the producer.

Runs in: sender (one thread; no lock). The loop's selector is reached only through the
``watch`` and ``forget`` callbacks; the owner's Shutdown and death go back to the loop
through ``on_shutdown`` and ``on_owner_lost``.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Callable, Iterable

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import (
    CorruptBatchError,
    InvalidTopicError,
    ProducerClosedError,
    ProducerError,
    ProtocolError,
)
from shmprod.protocol import records
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import Batch
from shmprod.sender.completions import Completions
from shmprod.sender.control import ControlClosed, ControlConn
from shmprod.sender.lifecycle import Lifecycle, Phase
from shmprod.sender.metadata import Metadata, TopicAnswer
from shmprod.sender.pool import AllocResult, BufferPool
from shmprod.sender.shmstate import SharedState
from shmprod.sender.units import MS

__all__ = ["Workers"]

log = logging.getLogger("shmprod.sender")

HELLO_TIMEOUT_NS = 10_000 * MS  # a connection that sends no Hello within this is closed
EXIT_FLUSH_NS = 1_000 * MS  # at the end, control messages get this long to go out
MAX_ACCEPTS_PER_EVENT = 64


class Workers:
    """See the module docstring."""

    def __init__(
        self,
        cfg: ProducerConfig,
        listen: socket.socket,
        secret: bytes,
        owner_pid: int,
        view: memoryview,
        geo: L.Geometry,
        shared: SharedState,
        pool: BufferPool,
        metadata: Metadata,
        acc: Accumulator,
        done: Completions,
        life: Lifecycle,
        clock: Callable[[], int],
        *,
        watch: Callable[[socket.socket, object, bool], None],
        forget: Callable[[socket.socket | None], None],
        on_shutdown: Callable[[int, int], None],
        on_owner_lost: Callable[[int], None],
    ) -> None:
        self.cfg = cfg
        self._listen = listen
        self._secret = secret
        self._owner_pid = owner_pid
        self.view = view
        self.geo = geo
        self.shared = shared
        self.pool = pool
        self.metadata = metadata
        self.acc = acc
        self.done = done
        self.life = life
        self.clock = clock
        self._watch = watch
        self._forget = forget
        self._on_shutdown = on_shutdown  # (timeout_ms, now): the owner's Shutdown
        self._on_owner_lost = on_owner_lost  # (now): the owner's connection ended
        self.conns: dict[int, ControlConn] = {}
        self.dirty: set[ControlConn] = set()  # connections with messages to write
        self.owner: ControlConn | None = None
        self._slots = [False] * geo.max_workers
        self._arrival = 0  # order in which batches were sealed, over every worker

    def post_to(self, origin: int, msg: ipc.Message) -> None:
        """Posts ``msg`` to the worker connection ``origin`` if it is still attached."""
        conn = self.conns.get(origin)
        if conn is not None and not conn.closed:
            self.post(conn, msg)

    def post_all(self, msg: ipc.Message, *, ready: ipc.Ready | None = None) -> None:
        """``msg`` to every attached worker; ``ready`` first to the owner if given."""
        for conn in list(self.conns.values()):
            if conn.authenticated:
                if ready is not None and conn is self.owner:
                    self.post(conn, ready)
                self.post(conn, msg)

    def drop_silent(self, now: int) -> None:
        """Closes connections that sent no Hello within HELLO_TIMEOUT_NS."""
        for conn in list(self.conns.values()):
            if not conn.authenticated and now - conn.accepted_ns > HELLO_TIMEOUT_NS:
                log.warning("closing a control connection that sent no Hello")
                self.drop(conn, now)

    def flush_bounded(self) -> None:
        """Writes pending control messages, waiting at most EXIT_FLUSH_NS in total."""
        deadline = self.clock() + EXIT_FLUSH_NS
        pending = [c for c in self.conns.values() if c.wants_write]
        while pending:
            for conn in pending:
                try:
                    conn.flush()
                except ControlClosed:
                    conn.close()
            pending = [c for c in pending if c.wants_write]
            if not pending or self.clock() >= deadline:
                return
            time.sleep(0.002)

    def close_all(self) -> None:
        for conn in list(self.conns.values()):
            conn.close()
        self.conns.clear()

    def accept(self, now: int) -> None:
        for _ in range(MAX_ACCEPTS_PER_EVENT):
            try:
                sock, _ = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            conn = ControlConn(sock, now)
            self.conns[conn.id] = conn
            self._watch(conn.sock, conn, False)

    def post(self, conn: ControlConn, msg: ipc.Message) -> None:
        if not conn.closed:
            conn.queue(msg)
            self.dirty.add(conn)

    def flush(self) -> None:
        dirty, self.dirty = self.dirty, set()
        now = self.clock()
        for conn in dirty:
            if conn.closed:
                continue
            try:
                conn.flush()
            except ControlClosed as exc:
                log.info("%r: control connection broke: %s", conn, exc)
                self.gone(conn, now)

    def on_readable(self, conn: ControlConn, now: int) -> None:
        try:
            msgs = conn.read()
        except ControlClosed:
            self.gone(conn, now)
            return
        except ipc.IpcError as exc:
            log.warning("%r sent a malformed control message: %s", conn, exc)
            self.gone(conn, now)
            return
        for msg in msgs:
            if conn.closed or self.life.ended:
                return
            self._on_message(conn, msg, now)

    def _on_message(self, conn: ControlConn, msg: ipc.Message, now: int) -> None:
        if not conn.authenticated:
            if isinstance(msg, ipc.Hello) and hmac.compare_digest(msg.secret, self._secret):
                self._welcome(conn, msg)
            else:
                log.warning("closing a control connection: its first message was not a valid Hello")
                self.drop(conn, now)
            return
        if isinstance(msg, ipc.Sealed):
            self._on_sealed(conn, msg, now)
        elif isinstance(msg, ipc.Alloc):
            result = self.pool.alloc(conn.id, conn.slot, msg.request_id, msg.run, msg.count, now)
            if result is not None:
                self.send_grants([result])
        elif isinstance(msg, ipc.Claimed):
            seen: dict[int, str] = {}
            refused = self.pool.claim(conn.id, conn.slot, msg.buffers, seen)
            if refused:
                held = "; ".join(
                    self.pool.explain(b) + (f" (when refused: {seen[b]})" if b in seen else "")
                    for b in refused
                )
                log.warning("%r claimed buffers that were not spares it took (%s)", conn, held)
        elif isinstance(msg, ipc.Release):
            for first in msg.buffers:
                served = self.pool.release(conn.id, first, msg.run)
                if served is None:
                    log.warning("%r released buffer %d+%d it does not hold", conn, first, msg.run)
                else:
                    self.send_grants(served)
        elif isinstance(msg, ipc.TopicRequest):
            self._on_topic_request(conn, msg, now)
        elif isinstance(msg, ipc.Bye):
            conn.bye = True
            self.gone(conn, now)
        elif isinstance(msg, ipc.Shutdown):
            if conn.owner:
                self._on_shutdown(msg.timeout_ms, now)
            else:
                log.warning("%r sent Shutdown; only the owner may close the producer", conn)
        else:
            log.warning("%r sent an unexpected %s; closing it", conn, type(msg).__name__)
            self.gone(conn, now)

    def _welcome(self, conn: ControlConn, hello: ipc.Hello) -> None:
        if hello.owner and (self.owner is not None or hello.pid != self._owner_pid):
            log.warning("refusing a second or foreign owner Hello (pid %d)", hello.pid)
            self.drop(conn, self.clock())
            return
        try:
            slot = self._slots.index(False)
        except ValueError:
            self.post(
                conn,
                ipc.Fatal(
                    ProducerError.code,
                    f"too many processes attached (max_workers={self.geo.max_workers})",
                ),
            )
            self.flush()
            self.drop(conn, self.clock())
            return
        self._slots[slot] = True
        conn.slot = slot
        conn.pid = hello.pid
        conn.start_us = hello.start_us
        conn.owner = hello.owner
        self.shared.claim_worker_slot(slot, hello.pid, hello.start_us)
        self.shared.add(L.S_WORKERS_ATTACHED, 1)
        self.post(conn, ipc.Welcome(slot))
        if conn.owner:
            self.owner = conn
            if self.life.phase is not Phase.BOOTSTRAP:
                self.post(conn, ipc.Ready(0))
        if self.life.phase is Phase.CLOSING:
            self.post(
                conn,
                ipc.Fatal(ProducerClosedError.code, "the producer is being closed by its owner"),
            )
        log.debug("attached %r", conn)

    def gone(self, conn: ControlConn, now: int) -> None:
        """A control connection ended: Bye (clean) or EOF/error (the worker died)."""
        if conn.closed:
            return
        self.drop(conn, now)
        if not conn.authenticated:
            return
        died = not conn.bye
        reclaimed, served = self.pool.reclaim(conn.id, conn.slot)
        self.metadata.drop_owner(conn.id)
        self._slots[conn.slot] = False
        self.shared.add(L.S_WORKERS_ATTACHED, -1)
        if died:
            self.shared.set_worker_state(conn.slot, L.WORKER_DEAD)
            self.shared.add(L.S_WORKERS_DIED, 1)
            self.shared.add(L.S_BUFFERS_RECLAIMED, reclaimed)
            log.info("%r died; %d buffers reclaimed", conn, reclaimed)
        else:
            self.shared.set_worker_state(conn.slot, L.WORKER_FREE)
        self.send_grants(served)
        if conn is self.owner:
            self._on_owner_lost(now)

    def drop(self, conn: ControlConn, now: int) -> None:
        self._forget(conn.sock)
        conn.close()
        self.conns.pop(conn.id, None)
        self.dirty.discard(conn)

    def send_grants(self, results: Iterable[AllocResult]) -> None:
        for r in results:
            conn = self.conns.get(r.owner)
            if conn is None or conn.closed:
                if r.buffers:  # its worker left meanwhile: take them back
                    _, served = self.pool.reclaim(r.owner)
                    self.send_grants(served)
                continue
            self.post(conn, ipc.Grant(r.request_id, r.run, r.error, r.buffers))

    def send_topic_answers(self, answers: Iterable[TopicAnswer]) -> None:
        for a in answers:
            if a.owner is None:
                for conn in self.conns.values():
                    if conn.authenticated:
                        self.post(conn, a.info)
            else:
                target = self.conns.get(a.owner)
                if target is not None:
                    self.post(target, a.info)

    def _on_topic_request(self, conn: ControlConn, msg: ipc.TopicRequest, now: int) -> None:
        if self.life.phase is Phase.CLOSING:
            code = ProducerClosedError.code
        elif not 0 < len(msg.name.encode("utf-8")) <= L.MAX_TOPIC_NAME:
            code = InvalidTopicError.code
        else:
            info = self.metadata.topic_request(conn.id, msg.request_id, msg.name, now)
            if info is not None:
                self.post(conn, info)
            return
        self.post(conn, ipc.TopicInfo(msg.request_id, -1, 0, code, msg.name))

    # -- sealed batches ------------------------------------------------------------------

    def _on_sealed(self, conn: ControlConn, msg: ipc.Sealed, now: int) -> None:
        """A worker hands over a batch: validate it, then queue it for its partition."""
        if not self.pool.seal(conn.id, msg.buffer, msg.run):
            self.shared.add(L.S_BATCHES_FAILED, 1)
            self.post(
                conn,
                ipc.Done(
                    msg.batch_id,
                    CorruptBatchError.code,
                    -1,
                    -1,
                    False,
                    f"buffer run {msg.buffer}+{msg.run} is not granted to this worker",
                ),
            )
            return
        self.shared.add(L.S_BATCHES_RECEIVED, 1)
        problem = self._check_sealed(msg)
        # One queue, one sequence space and one in-flight count per topic-partition: a
        # slot of a range made by growth is an alias of the partition's home slot
        home = self.metadata.home(msg.partition_slot)
        self._arrival += 1
        # KIP-91: a batch's delivery time counts from when the worker opened it. Not
        # recorded (0) or in the future (a scribbled descriptor): from now.
        born = self.shared.created_ns(msg.buffer) or now
        born = min(born, now)
        batch = Batch(
            buffer=msg.buffer,
            run=msg.run,
            partition_slot=msg.partition_slot if home is None else home,
            batch_id=msg.batch_id,
            length=msg.length,
            record_count=msg.record_count,
            origin=conn.id,
            sealed_ns=now,
            deadline_ns=born + self.cfg.delivery_timeout_ms * MS,
            arrival=self._arrival,
        )
        if problem:
            log.warning("%r sealed a corrupt batch: %s", conn, problem)
            self.done.finish(batch, CorruptBatchError.code, message=problem)
            return
        if self.metadata.gone(batch.partition_slot):
            self.done.finish_gone(batch)
            return
        self.shared.describe_batch(
            msg.buffer,
            L.BUF_SEALED,
            batch.partition_slot,
            msg.batch_id,
            msg.length,
            msg.record_count,
        )
        self.acc.append(batch)

    def _check_sealed(self, msg: ipc.Sealed) -> str:
        """Why the sealed batch cannot be sent ("" when it can): framing and counts. The
        CRC is checked once, right before each send (``Completions.still_intact``): one
        pass over the bytes, at the latest moment."""
        if self.metadata.locate(msg.partition_slot) is None:
            return f"partition slot {msg.partition_slot} belongs to no known topic"
        if not records.HEADER_SIZE <= msg.length <= self.geo.run_bytes(msg.run):
            return f"length {msg.length} does not fit a run of {msg.run} buffers"
        try:
            hdr = records.validate_batch(
                self.view, self.geo.buffer(msg.buffer), msg.length, check_crc=False
            )
        except ProtocolError as exc:
            return f"invalid record batch: {exc}"
        if hdr.record_count != msg.record_count:
            return f"batch holds {hdr.record_count} records, Sealed says {msg.record_count}"
        if hdr.attributes & (records.TRANSACTIONAL_BIT | records.CONTROL_BIT):
            return "transactional or control batch from a worker"
        return ""
