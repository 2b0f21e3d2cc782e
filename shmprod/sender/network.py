"""Non-blocking broker connections for the sender's selector loop.

One :class:`NodeConnection` per broker node (and one per bootstrap server until the
cluster's nodes are known). Lifecycle::

    CONNECTING (non-blocking connect)
      -> TLS_HANDSHAKE       SSL / SASL_SSL only: ssl.SSLObject over two MemoryBIOs
      -> HANDSHAKE           ApiVersions v3, falling back to what the broker offers (KIP-511)
      -> AUTHENTICATING      SASL_* only: SaslHandshake + SaslAuthenticate (SaslExchange)
      -> READY -> CLOSED

Requests are pipelined; the loop caps them at ``max_in_flight_requests_per_connection``.
Everything before READY is bounded by one deadline (``request_timeout_ms`` from the
connect). A refused TLS handshake (untrusted certificate, wrong host name, not TLS) or
refused credentials raise :class:`ConnectionLost` with ``fatal`` set: the loop fails the
producer instead of reconnecting, since the same settings would be refused again. A
broker that closes the connection during SASL is treated the same way (brokers do that
for a mechanism they do not enable).

Plaintext writes are gathered: each request is a list of segments (our header bytes,
then memoryviews of shared-memory batches, never copied) written with ``socket.sendmsg``
and resumed after partial writes. With TLS the socket only ever carries ciphertext: each
segment is handed to ``SSLObject.write`` straight from shared memory (the encryption
pass reads it in place), the ciphertext is read out of the outgoing BIO (one copy, into
a ``bytes``) and sent with ``socket.send``; at most ``TLS_ENCRYPT_CHUNK`` bytes are
encrypted ahead of what the socket took. Reads go socket -> incoming BIO ->
``SSLObject.read`` -> the frame decoder. So TLS costs the cipher plus one extra copy of
every byte each way; the zero-copy ``sendmsg`` path is for plaintext only.

Reads go through a :class:`FrameDecoder`; Kafka answers in request order, so a response
whose correlation id is not the oldest outstanding one is a protocol error. One
exception: a broker that answers acks=0 produce requests, which Kafka never does (tansu
does: measured, every one of them). Those answers are dropped (the last
``QUIET_IDS`` such correlation ids are remembered), rather than closing the connection
with requests the broker had not read yet.

Every request carries a deadline (``request_timeout_ms`` from when it was queued); the
loop asks :meth:`NodeConnection.expired` and closes a connection whose oldest request is
late. Any failure raises :class:`ConnectionLost`; :meth:`NodeConnection.close` then
returns every request still outstanding so the loop can fail or retry it.

Host names are resolved before a connection is opened, off the loop
(:mod:`shmprod.sender.resolver`).
"""

from __future__ import annotations

import errno
import itertools
import socket
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from shmprod import __version__
from shmprod.errors import (
    AuthenticationError,
    DecodeError,
    KafkaError,
    ProtocolError,
    ShmprodError,
    SslAuthenticationError,
)
from shmprod.protocol.frames import (
    FrameDecoder,
    UnsupportedVersionError,
    peek_correlation_id,
)
from shmprod.protocol.messages import (
    ApiVersionsResponse,
    Request,
    Response,
    VersionsHandshake,
    decode_response,
    encode_request_segments,
    version_for,
)
from shmprod.sender.resolver import Address
from shmprod.sender.units import MS

if TYPE_CHECKING:
    import ssl  # at run time only with TLS: a producer without it never loads ssl

    # at run time only with SASL (with SCRAM's hashing)
    from shmprod.protocol.sasl_exchange import SaslCredentials, SaslExchange, SaslStep

IOV_MAX = 1024
RECV_SIZE = 1 << 20
MAX_READS_PER_EVENT = 8
QUIET_IDS = 4096  # acks=0 requests remembered in case the broker answers them
TLS_ENCRYPT_CHUNK = 256 * 1024


class ConnectionLost(Exception):
    """The connection failed and must be closed (refused, reset, EOF, bad bytes, late).

    ``fatal`` is set when reconnecting cannot help (TLS or SASL refused): the error to
    fail the producer with."""

    def __init__(
        self, message: str, *, timed_out: bool = False, fatal: ShmprodError | None = None
    ) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.fatal = fatal


def _fatal(exc: ShmprodError) -> ConnectionLost:
    return ConnectionLost(str(exc), fatal=exc)


class ConnState(IntEnum):
    CONNECTING = 0
    HANDSHAKE = 1
    READY = 2
    CLOSED = 3
    TLS_HANDSHAKE = 4
    AUTHENTICATING = 5


_OPENING = (
    ConnState.CONNECTING,
    ConnState.TLS_HANDSHAKE,
    ConnState.HANDSHAKE,
    ConnState.AUTHENTICATING,
)
"""States before READY: bounded by the connect deadline."""


@dataclass(slots=True, eq=False)
class InFlight:
    """A request queued or written and not yet answered (or, for acks=0, not yet
    written). ``context`` is the loop's: the handler of what becomes of the request
    (:class:`shmprod.sender.nodes.Handler`)."""

    correlation_id: int
    api_key: int
    version: int
    response_cls: type[Response] | None  # None: the broker will not answer (acks=0)
    context: Any
    deadline_ns: int
    written: bool = False


_HANDSHAKE = object()

LANE_KEY_BASE = 1 << 32  # above every node id (int32) in the keys of lanes 1, 2, ...


def lane_key(node_id: int, lane: int) -> int:
    """The key of connection ``lane`` to a node: the node id for lane 0 (and for the
    bootstrap servers' keys, -1, -2, ...), ``lane * LANE_KEY_BASE + node_id`` above."""
    return node_id if lane == 0 else lane * LANE_KEY_BASE + node_id


def _flat(segment: bytes | memoryview) -> memoryview:
    """A segment as a flat unsigned-byte memoryview (no copy)."""
    view = segment if isinstance(segment, memoryview) else memoryview(segment)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class NodeConnection:
    """One non-blocking TCP connection. Runs in: sender (the loop thread only)."""

    def __init__(
        self,
        node_id: int,
        host: str,
        port: int,
        *,
        client_id: str,
        request_timeout_ms: int,
        now_ns: int,
        ssl_context: ssl.SSLContext | None = None,
        sasl: SaslCredentials | None = None,
        lane: int = 0,
    ) -> None:
        self.node_id = node_id
        self.lane = lane  # which of the node's connections (connections_per_broker)
        self.host = host
        self.port = port
        self.client_id = client_id
        self.request_timeout_ns = request_timeout_ms * MS
        self.state = ConnState.CONNECTING
        self.api_versions: dict[int, tuple[int, int]] = {}
        self.sock: socket.socket | None = None
        self._connect_deadline_ns = now_ns + self.request_timeout_ns
        self._decoder = FrameDecoder()
        self._correlation = itertools.count(1)
        self._pending: dict[int, InFlight] = {}
        # correlation ids of written requests that expect no answer (acks=0): a broker
        # that answers them anyway (tansu does) is not a protocol error
        self._quiet: dict[int, None] = {}
        # (segment, request, last segment of that request)
        self._out: deque[tuple[memoryview, InFlight, bool]] = deque()
        self._handshake = VersionsHandshake(f"{host}:{port}", __version__)
        self._ssl_context = ssl_context
        self._sasl = sasl
        self._sasl_exchange: SaslExchange | None = None
        self._tls: ssl.SSLObject | None = None
        self._tls_in: ssl.MemoryBIO | None = None  # both made with the TLS session
        self._tls_out: ssl.MemoryBIO | None = None
        self._cipher: memoryview | None = None  # ciphertext the socket has not taken yet

    @property
    def key(self) -> int:
        """This connection's key among the sender's connections (:func:`lane_key`)."""
        return lane_key(self.node_id, self.lane)

    def __repr__(self) -> str:
        lane = f", lane {self.lane}" if self.lane else ""
        return (
            f"NodeConnection(node={self.node_id}{lane}, {self.host}:{self.port}, {self.state.name})"
        )

    # -- lifecycle -----------------------------------------------------------------------

    def open(self, address: Address) -> None:
        """Starts a non-blocking connect to ``address`` (resolved by the loop's
        :class:`~shmprod.sender.resolver.Resolver`). Raises ConnectionLost if it fails at
        once."""
        family, socktype, proto, addr = address
        sock = socket.socket(family, socktype, proto)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = sock.connect_ex(addr)
        except OSError as exc:
            sock.close()
            raise ConnectionLost(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            raise ConnectionLost(
                f"cannot connect to {self.host}:{self.port}: {errno.errorcode.get(err, err)}"
            )
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    @property
    def ready(self) -> bool:
        return self.state == ConnState.READY

    @property
    def connecting(self) -> bool:
        """Connecting, in TLS, in ApiVersions or authenticating: not READY yet."""
        return self.state in _OPENING

    @property
    def in_flight(self) -> int:
        """Requests queued or awaiting an answer (the handshake excluded)."""
        opening = self.state in (ConnState.HANDSHAKE, ConnState.AUTHENTICATING)
        return len(self._pending) - (1 if opening else 0)

    @property
    def wants_write(self) -> bool:
        if self.state == ConnState.CONNECTING or self._out:
            return True
        bio = self._tls_out
        if self._tls is None or bio is None:
            return False
        return self._cipher is not None or bio.pending > 0

    def close(self) -> list[InFlight]:
        """Closes the socket; returns every request not answered (handshake excluded)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        self.state = ConnState.CLOSED
        lost = [r for r in self._pending.values() if r.context is not _HANDSHAKE]
        self._pending.clear()
        self._out.clear()  # drops every memoryview of shared memory it held
        self._tls = None
        self._cipher = None
        self._sasl_exchange = None
        return lost

    # -- timers --------------------------------------------------------------------------

    def next_deadline_ns(self) -> int | None:
        if self.state in _OPENING:
            return self._connect_deadline_ns
        for req in self._pending.values():
            return req.deadline_ns
        return None

    def check_expired(self, now_ns: int) -> None:
        """Raises ConnectionLost(timed_out=True) if connecting or the oldest request is late."""
        if self.state in _OPENING:
            if now_ns >= self._connect_deadline_ns:
                raise ConnectionLost(
                    f"connecting to {self.host}:{self.port} timed out (in {self.state.name})",
                    timed_out=True,
                )
            return
        for req in self._pending.values():
            if now_ns >= req.deadline_ns:
                raise ConnectionLost(
                    f"request to node {self.node_id} ({self.host}:{self.port}) timed out",
                    timed_out=True,
                )
            return

    # -- versions ------------------------------------------------------------------------

    def version_for(self, api_key: int) -> int:
        """Highest version of ``api_key`` both sides speak (UnsupportedVersionError if none)."""
        return version_for(self.api_versions, api_key, f"{self.host}:{self.port}")

    # -- sending -------------------------------------------------------------------------

    def send(
        self,
        request: Request,
        response_cls: type[Response] | None,
        context: Any,
        now_ns: int,
        version: int | None = None,
    ) -> InFlight:
        """Queues ``request`` (written by :meth:`flush`). ``response_cls`` None: no answer
        is expected (acks=0); the request completes once written."""
        if version is None:
            version = self.version_for(request.API_KEY)
        corr = next(self._correlation) & 0x7FFFFFFF
        segments = encode_request_segments(request, version, corr, self.client_id)
        req = InFlight(
            corr, request.API_KEY, version, response_cls, context, now_ns + self.request_timeout_ns
        )
        self._pending[corr] = req
        views = [_flat(s) for s in segments if len(s)]
        for i, v in enumerate(views):
            self._out.append((v, req, i == len(views) - 1))
        return req

    def flush(self) -> list[InFlight]:
        """Writes as much as the socket takes. Returns the requests that needed no
        answer and are now fully written (acks=0). Raises ConnectionLost."""
        sock = self.sock
        out = self._out
        done: list[InFlight] = []
        if sock is None or self.state == ConnState.CONNECTING:
            return done
        if self._tls is not None:
            return self._flush_tls(sock, self._tls)
        while out:
            views = [seg for seg, _, _ in itertools.islice(out, IOV_MAX)]
            want = sum(len(v) for v in views)
            try:
                sent = sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise ConnectionLost(f"send to {self.host}:{self.port} failed: {exc}") from None
            full = sent < want  # the socket buffer is full: wait for EVENT_WRITE
            while sent:
                seg, req, last = out[0]
                if sent < len(seg):
                    out[0] = (seg[sent:], req, last)
                    break
                sent -= len(seg)
                out.popleft()
                if last:
                    self._segment_written(req, done)
            if full:
                break
        return done

    def _segment_written(self, req: InFlight, done: list[InFlight]) -> None:
        req.written = True
        if req.response_cls is None:
            self._pending.pop(req.correlation_id, None)
            done.append(req)
            self._quiet[req.correlation_id] = None
            if len(self._quiet) > QUIET_IDS:
                del self._quiet[next(iter(self._quiet))]  # the oldest: never answered

    def _flush_tls(self, sock: socket.socket, tls: ssl.SSLObject) -> list[InFlight]:
        """Encrypts queued segments (read in place) and sends the ciphertext."""
        import ssl  # loaded already with the TLS session

        out = self._out
        done: list[InFlight] = []
        while self._send_cipher(sock) and out:
            budget = TLS_ENCRYPT_CHUNK
            while out and budget > 0:
                seg, req, last = out[0]
                n = min(len(seg), budget)
                try:
                    tls.write(seg[:n] if n < len(seg) else seg)
                except ssl.SSLError as exc:
                    raise ConnectionLost(f"TLS to {self.host}:{self.port}: {exc}") from None
                budget -= n
                if n < len(seg):
                    out[0] = (seg[n:], req, last)
                    continue
                out.popleft()
                if last:
                    self._segment_written(req, done)
        return done

    def _send_cipher(self, sock: socket.socket) -> bool:
        """Sends ciphertext until the socket is full (False) or none is left (True)."""
        while True:
            data = self._cipher
            if data is None:
                bio = self._tls_out
                assert bio is not None
                if not bio.pending:
                    return True
                data = memoryview(bio.read())
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                self._cipher = data
                return False
            except OSError as exc:
                raise ConnectionLost(f"send to {self.host}:{self.port} failed: {exc}") from None
            self._cipher = data[sent:] if sent < len(data) else None
            if self._cipher is not None:
                return False

    # -- events --------------------------------------------------------------------------

    def on_writable(self, now_ns: int) -> list[InFlight]:
        """Finishes a connect (then starts the handshake) and writes what is queued."""
        if self.state == ConnState.CONNECTING:
            assert self.sock is not None
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise ConnectionLost(
                    f"cannot connect to {self.host}:{self.port}: {errno.errorcode.get(err, err)}"
                )
            if self._ssl_context is not None:
                import ssl  # loaded already: the context is one of its objects

                self.state = ConnState.TLS_HANDSHAKE
                self._tls_in, self._tls_out = ssl.MemoryBIO(), ssl.MemoryBIO()
                self._tls = self._ssl_context.wrap_bio(
                    self._tls_in, self._tls_out, server_hostname=self.host
                )
                self._tls_step(now_ns)
            else:
                self.state = ConnState.HANDSHAKE
                self._send_api_versions(now_ns)
        return self.flush()

    def on_readable(self, now_ns: int) -> list[tuple[InFlight, Response]]:
        """Reads what arrived; returns the decoded answers to the loop's requests."""
        sock = self.sock
        if sock is None:
            return []
        answers: list[tuple[InFlight, Response]] = []
        for _ in range(MAX_READS_PER_EVENT):
            try:
                data = sock.recv(RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise ConnectionLost(f"receive from {self.host}:{self.port}: {exc}") from None
            if not data:
                self._on_eof()
            plain = data if self._tls is None else self._decrypt(data, now_ns)
            try:
                frames = self._decoder.feed(plain) if plain else []
            except DecodeError as exc:
                raise ConnectionLost(f"bad frame from {self.host}:{self.port}: {exc}") from None
            for payload in frames:
                answer = self._on_frame(payload, now_ns)
                if answer is not None:
                    answers.append(answer)
            if len(data) < RECV_SIZE:
                break
        return answers

    def _on_eof(self) -> None:
        message = f"{self.host}:{self.port} closed the connection"
        if self.state == ConnState.AUTHENTICATING and self._sasl is not None:
            raise _fatal(
                AuthenticationError(
                    f"{message} during SASL {self._sasl.mechanism} authentication "
                    "(brokers close the connection on a mechanism they do not enable)"
                )
            )
        if self.state == ConnState.TLS_HANDSHAKE:
            message += " during the TLS handshake"
        raise ConnectionLost(message)

    def _decrypt(self, data: bytes, now_ns: int) -> bytes:
        """Ciphertext in, plaintext out (advancing the TLS handshake first if needed)."""
        import ssl  # loaded already with the TLS session

        tls, bio = self._tls, self._tls_in
        assert tls is not None and bio is not None
        bio.write(data)
        if self.state == ConnState.TLS_HANDSHAKE and not self._tls_step(now_ns):
            return b""
        chunks: list[bytes] = []
        while True:
            try:
                chunk = tls.read(RECV_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                raise ConnectionLost(f"{self.host}:{self.port} closed the TLS session") from None
            except ssl.SSLError as exc:
                raise ConnectionLost(f"TLS from {self.host}:{self.port}: {exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def _tls_step(self, now_ns: int) -> bool:
        """Advances the TLS handshake; True once done (ApiVersions is then queued)."""
        import ssl  # loaded already with the TLS session

        tls = self._tls
        assert tls is not None
        peer = f"{self.host}:{self.port}"
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLCertVerificationError as exc:
            raise _fatal(
                SslAuthenticationError(
                    f"TLS to {peer}: certificate not trusted: {exc.verify_message}"
                )
            ) from None
        except ssl.SSLError as exc:
            raise _fatal(
                SslAuthenticationError(f"TLS handshake with {peer} failed: {exc.reason or exc}")
            ) from None
        self.state = ConnState.HANDSHAKE
        self._send_api_versions(now_ns)
        return True

    def _on_frame(self, payload: bytes, now_ns: int) -> tuple[InFlight, Response] | None:
        try:
            corr = peek_correlation_id(payload)
        except ProtocolError as exc:
            raise ConnectionLost(f"bad response from {self.host}:{self.port}: {exc}") from None
        req = self._pending.pop(corr, None)
        if req is None and corr in self._quiet:
            del self._quiet[corr]
            return None  # an answer to an acks=0 request: nothing waits for it
        if req is None or req.response_cls is None:
            raise ConnectionLost(
                f"response with unexpected correlation id {corr} from {self.host}:{self.port}"
            )
        try:
            _, resp = decode_response(req.response_cls, payload, req.version)
        except ProtocolError as exc:
            raise ConnectionLost(
                f"undecodable answer to api {req.api_key} v{req.version} from "
                f"{self.host}:{self.port}: {exc}"
            ) from None
        if req.context is _HANDSHAKE:
            if self.state == ConnState.AUTHENTICATING:
                self._on_sasl(resp, now_ns)
                return None
            assert isinstance(resp, ApiVersionsResponse)
            self._on_api_versions(resp, now_ns)
            return None
        return req, resp

    # -- handshake -----------------------------------------------------------------------

    def _send_api_versions(self, now_ns: int) -> None:
        hs = self._handshake
        self.send(hs.request(), ApiVersionsResponse, _HANDSHAKE, now_ns, hs.version)

    def _on_api_versions(self, resp: ApiVersionsResponse, now_ns: int) -> None:
        try:
            offered = self._handshake.answer(resp)
        except (KafkaError, UnsupportedVersionError) as exc:
            raise ConnectionLost(str(exc)) from None
        if offered is None:  # asked again at a lower version
            self._send_api_versions(now_ns)
            return
        self.api_versions = offered
        if self._sasl is None:
            self.state = ConnState.READY
            return
        self.state = ConnState.AUTHENTICATING
        try:
            from shmprod.protocol.sasl_exchange import SaslExchange

            self._sasl_exchange = SaslExchange(self._sasl, offered, f"{self.host}:{self.port}")
        except AuthenticationError as exc:
            raise _fatal(exc) from None
        self._send_sasl(self._sasl_exchange.start(), now_ns)

    # -- SASL ----------------------------------------------------------------------------

    def _send_sasl(self, step: SaslStep, now_ns: int) -> None:
        self.send(step.request, step.response_cls, _HANDSHAKE, now_ns, step.version)

    def _on_sasl(self, resp: Response, now_ns: int) -> None:
        exchange = self._sasl_exchange
        assert exchange is not None
        try:
            step = exchange.on_response(resp)
        except AuthenticationError as exc:
            raise _fatal(exc) from None
        except ProtocolError as exc:
            raise _fatal(
                AuthenticationError(f"{self.host}:{self.port}: bad SASL answer: {exc}")
            ) from None
        if step is not None:
            self._send_sasl(step, now_ns)
            return
        self._sasl_exchange = None  # holds the password: drop it as soon as done
        self.state = ConnState.READY
