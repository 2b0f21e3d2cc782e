"""The sender's broker connections, Java's ``NetworkClient``: one
:class:`~shmprod.sender.network.NodeConnection` per node id and lane (lanes 0 to
``connections_per_broker - 1``, keys from :func:`~shmprod.sender.network.lane_key`; lane
0's key is the node id), and per bootstrap server (keys -1, -2, ..., until metadata
names the nodes), opened on demand, a reconnect backoff
per key, host names resolved off the loop, request timeouts, and each request's outcome
handed to the handler it carries (:class:`Handler`): written (acks=0), answered, or lost
with its connection.

Runs in: sender (one thread; no lock). The loop's selector is reached only through the
``watch`` and ``forget`` callbacks.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from typing import Protocol

from shmprod.config import ProducerConfig, parse_bootstrap
from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import Response
from shmprod.sender.metadata import Metadata
from shmprod.sender.network import ConnectionLost, InFlight, NodeConnection, lane_key
from shmprod.sender.policy import backoff_ns
from shmprod.sender.resolver import Resolver
from shmprod.sender.units import MS

__all__ = ["Handler", "Nodes", "handler_of"]

log = logging.getLogger("shmprod.sender")

BOOTSTRAP_FALLBACK_FAILURES = 3  # consecutive failures of every known node
CONN_LOG_EVERY_NS = 10_000 * MS  # connection failures are logged at most this often


class Handler(Protocol):
    """What becomes of one request: the object a request carries as its context, one
    class per request kind (produce, metadata, producer id, the acks=0 fence)."""

    def on_written(self) -> None:
        """Fully written and no answer will come (acks=0 produce)."""

    def on_response(self, resp: Response, now: int) -> None:
        """The broker's answer."""

    def on_lost(self, code: int, reason: str, now: int) -> None:
        """The connection ended or the request timed out: no answer will come."""

    def on_abort(self, code: int, message: str) -> None:
        """The sender is ending: fail what the request carries."""


def handler_of(req: InFlight) -> Handler:
    handler: Handler = req.context
    return handler


class Nodes:
    """See the module docstring."""

    def __init__(
        self,
        cfg: ProducerConfig,
        metadata: Metadata,
        resolver: Resolver,
        *,
        watch: Callable[[socket.socket, object, bool], None],
        forget: Callable[[socket.socket | None], None],
        on_fatal: Callable[[Exception], None],
        bootstrapping: Callable[[], bool],
        note_bootstrap_error: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.metadata = metadata
        self.resolver = resolver
        self._watch = watch  # (socket, data, want write): select on it
        self._forget = forget  # stop selecting on a socket
        self._on_fatal = on_fatal  # TLS or SASL refused: the producer fails
        self._bootstrapping = bootstrapping
        self._note_bootstrap_error = note_bootstrap_error
        self.max_in_flight = cfg.max_in_flight_requests_per_connection
        self._bootstrap = parse_bootstrap(cfg.bootstrap_servers)
        self._ssl_context = cfg.ssl_context()  # TLS and SASL of every broker connection
        self._sasl = cfg.sasl_credentials()
        self.conns: dict[int, NodeConnection] = {}  # lane_key (bootstrap: -1 - index)
        self._reconnect: dict[int, tuple[int, int]] = {}  # key -> (failures, not before)
        self._bootstrap_failures = 0
        self.errors = 0  # broker connection failures, and the last one's reason
        self.last_error = ""
        self._conn_logged = 0
        self._conn_log_at = 0

    def __iter__(self) -> Iterator[NodeConnection]:
        return iter(list(self.conns.values()))

    def trouble(self) -> str:
        """The last connection failure and how many there were, or ""."""
        if not self.last_error:
            return ""
        return f"{self.last_error}; {self.errors} connection failure(s) so far"

    def next_deadline_ns(self) -> int | None:
        """The earliest request or connect deadline of any connection."""
        deadlines = [d for c in self.conns.values() if (d := c.next_deadline_ns()) is not None]
        return min(deadlines, default=None)

    def abort_all(self, code: int, message: str) -> None:
        """Closes every connection; what each request carried fails with ``code``."""
        for conn in list(self.conns.values()):
            self._forget(conn.sock)
            for req in conn.close():
                handler_of(req).on_abort(code, message)
        self.conns.clear()

    def close_all(self) -> None:
        self.resolver.close()
        for conn in list(self.conns.values()):
            conn.close()
        self.conns.clear()

    def connect(
        self, node: int, host: str, port: int, now: int, lane: int = 0
    ) -> NodeConnection | None:
        """Opens connection ``lane`` to ``node`` (a node id, or -1-i for bootstrap
        server i) unless its key is in reconnect backoff."""
        key = lane_key(node, lane)
        not_before = self._reconnect.get(key, (0, 0))[1]
        if now < not_before:
            return None
        address = self.resolver.lookup(host, port, now)
        if address is None:
            return None  # resolving off the loop: the loop wakes when it is done
        if isinstance(address, str):
            self.failed(key, f"cannot resolve {host}:{port}: {address}", now)
            return None
        conn = NodeConnection(
            node,
            host,
            port,
            client_id=self.cfg.client_id,
            request_timeout_ms=self.cfg.request_timeout_ms,
            now_ns=now,
            ssl_context=self._ssl_context,
            sasl=self._sasl,
            lane=lane,
        )
        try:
            conn.open(address)
        except ConnectionLost as exc:
            self.failed(key, str(exc), now)
            return None
        self.conns[key] = conn
        assert conn.sock is not None
        self._watch(conn.sock, conn, True)
        return conn

    def failed(self, key: int, reason: str, now: int) -> None:
        failures = self._reconnect.get(key, (0, 0))[0] + 1
        delay = backoff_ns(failures, self.cfg.retry_backoff_ms, self.cfg.retry_backoff_max_ms)
        self._reconnect[key] = (failures, now + delay)
        if key < 0:
            self._bootstrap_failures += 1
            self._note_bootstrap_error(reason)
        self.errors += 1
        self.last_error = reason
        # at WARNING: the first failure at once, then at most one line per
        # CONN_LOG_EVERY_NS with how many happened meanwhile
        if now >= self._conn_log_at:
            waiting = " (retrying; sends wait, up to delivery_timeout_ms)"
            if self._bootstrapping():
                waiting = f" (retrying until max_block_ms={self.cfg.max_block_ms} for metadata)"
            more = self.errors - self._conn_logged
            log.warning(
                "broker connection failed: %s%s%s",
                reason,
                f"; {more} failure(s) since the last report" if more > 1 else "",
                waiting,
            )
            self._conn_logged = self.errors
            self._conn_log_at = now + CONN_LOG_EVERY_NS

    def for_node(self, node: int, now: int, lane: int = 0) -> NodeConnection | None:
        """Connection ``lane`` to ``node``, opened (connecting) when there is none yet."""
        conn = self.conns.get(lane_key(node, lane))
        if conn is not None:
            return conn
        address = self.metadata.address(node)
        if address is None:
            self.metadata.request_refresh(now)
            return None
        return self.connect(node, address[0], address[1], now, lane)

    def any_ready(self, now: int) -> NodeConnection | None:
        """The least busy ready connection; when there is none, starts one (a known
        node, else the next bootstrap server) and returns None."""
        best: NodeConnection | None = None
        for conn in self.conns.values():
            usable = conn.ready and conn.in_flight < self.max_in_flight
            if usable and (best is None or conn.in_flight < best.in_flight):
                best = conn
        if best is not None or any(c.connecting for c in self.conns.values()):
            return best
        for node in sorted(self.metadata.nodes):
            if node not in self.conns and self.for_node(node, now) is not None:
                return None
        # Known nodes only in a short reconnect backoff: wait for them. Fall back to the
        # bootstrap servers when none is known or every one keeps failing.
        if any(
            self._reconnect.get(node, (0, 0))[0] < BOOTSTRAP_FALLBACK_FAILURES
            for node in self.metadata.nodes
        ):
            return None
        i = self._bootstrap_failures % len(self._bootstrap)
        key = -1 - i
        if key not in self.conns:
            host, port = self._bootstrap[i]
            self.connect(key, host, port, now)
        return None

    def on_writable(self, conn: NodeConnection, now: int) -> None:
        try:
            written = conn.on_writable(now)
        except ConnectionLost as exc:
            self.lost(conn, exc, now)
            return
        self._on_written(written)

    def flush(self, conn: NodeConnection, now: int) -> None:
        try:
            written = conn.flush()
        except ConnectionLost as exc:
            self.lost(conn, exc, now)
            return
        self._on_written(written)

    def _on_written(self, written: list[InFlight]) -> None:
        """acks=0: a fully written request is the batches' completion (no offsets)."""
        for req in written:
            handler_of(req).on_written()

    def on_readable(self, conn: NodeConnection, now: int) -> None:
        was_ready = conn.ready
        try:
            answers = conn.on_readable(now)
        except ConnectionLost as exc:
            self.lost(conn, exc, now)
            return
        if conn.ready and not was_ready:
            self._reconnect.pop(conn.key, None)
            log.debug("connected to %r", conn)
        for req, resp in answers:
            handler_of(req).on_response(resp, now)
        if conn.ready and conn.wants_write:
            self.flush(conn, now)

    def check_timeouts(self, now: int) -> None:
        for conn in list(self.conns.values()):
            try:
                conn.check_expired(now)
            except ConnectionLost as exc:
                self.lost(conn, exc, now)

    def lost(self, conn: NodeConnection, exc: ConnectionLost, now: int) -> None:
        """Closes ``conn``; its produce requests come back as retriable errors. TLS or
        SASL refused (``exc.fatal``) fails the whole producer: reconnecting cannot help."""
        if exc.fatal is not None:
            self._on_fatal(exc.fatal)
            return
        key = conn.key
        self._forget(conn.sock)
        lost = conn.close()
        if self.conns.get(key) is conn:
            del self.conns[key]
        self.failed(key, str(exc), now)
        code = ec.REQUEST_TIMED_OUT if exc.timed_out else ec.NETWORK_EXCEPTION
        for req in lost:
            handler_of(req).on_lost(code, str(exc), now)
        if self.metadata.bootstrapped:
            self.metadata.request_refresh(now)

    def adopt_bootstrap(self) -> None:
        """A bootstrap connection to a node's advertised address becomes that node's
        connection (tansu is fastest over one connection); others close when idle."""
        by_address = {addr: node for node, addr in self.metadata.nodes.items()}
        for key in [k for k in self.conns if k < 0]:
            conn = self.conns[key]
            node = by_address.get((conn.host, conn.port))
            if node is not None and node not in self.conns:
                del self.conns[key]
                conn.node_id = node
                self.conns[node] = conn
            elif conn.in_flight == 0:
                del self.conns[key]
                self._forget(conn.sock)
                conn.close()
