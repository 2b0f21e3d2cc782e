"""A TLS- and SASL-terminating front for tansu, to test security end to end.

tansu 0.6.0 cannot be the other end of these tests (ARCHITECTURE.md, "Security"): it
serves no TLS, does not offer PLAIN, and with memory storage keeps no SCRAM credential,
so no SCRAM exchange can succeed. This proxy listens on the port tansu advertises and,
per client connection:

1. completes a TLS handshake with ``ssl_context`` (Python's ``ssl``, i.e. OpenSSL), if
   given;
2. if ``users`` is given, plays a Kafka broker's SASL side: relays ApiVersions to tansu,
   answers SaslHandshake and SaslAuthenticate itself (PLAIN, SCRAM-SHA-256/512 server
   written here from RFC 5802, independently of the client in ``shmprod.protocol``) and
   refuses anything else before authentication, like Kafka does; a refusal is answered
   with 58 SASL_AUTHENTICATION_FAILED, then the connection is closed;
3. then pipes bytes both ways to tansu's real listener.

confluent-kafka (librdkafka's own TLS and SCRAM client) reads back through the same
proxy, so the server side here is checked by a client that is not ours.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import socket
import ssl
import struct
import threading
from collections.abc import Mapping

from shmprod.protocol import error_codes as ec
from shmprod.protocol.frames import ApiKey
from shmprod.protocol.messages import (
    SaslAuthenticateResponse,
    SaslHandshakeResponse,
    decode_request,
    encode_response,
)
from shmprod.protocol.messages.sasl import SaslAuthenticateRequest, SaslHandshakeRequest

HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
ITERATIONS = 4096
IO_TIMEOUT_S = 10.0


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">i", head)
    if not 0 <= size <= 1 << 20:
        return None
    return _read_exact(sock, size)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _ScramServer:
    """The broker's half of one SCRAM exchange (RFC 5802 section 3)."""

    def __init__(self, mechanism: str, users: Mapping[str, str]) -> None:
        self.hash = HASHES[mechanism]
        self.users = users
        self.first_bare = ""
        self.server_first = ""
        self.nonce = ""
        self.salted = b""

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.hash).digest()

    def first(self, token: bytes) -> bytes | None:
        text = token.decode()
        if not text.startswith("n,,"):
            return None
        self.first_bare = text[3:]
        attrs = dict(part.split("=", 1) for part in self.first_bare.split(","))
        user = attrs["n"].replace("=2C", ",").replace("=3D", "=")
        password = self.users.get(user)
        if password is None:
            return None
        salt = os.urandom(16)
        self.salted = hashlib.pbkdf2_hmac(self.hash, password.encode(), salt, ITERATIONS)
        self.nonce = attrs["r"] + base64.b64encode(os.urandom(18)).decode()
        self.server_first = f"r={self.nonce},s={base64.b64encode(salt).decode()},i={ITERATIONS}"
        return self.server_first.encode()

    def final(self, token: bytes) -> bytes | None:
        text = token.decode()
        without_proof, _, proof_b64 = text.rpartition(",p=")
        if f"r={self.nonce}" not in without_proof.split(","):
            return None
        auth_message = ",".join((self.first_bare, self.server_first, without_proof)).encode()
        client_key_expected = self._hmac(self.salted, b"Client Key")
        stored_key = hashlib.new(self.hash, client_key_expected).digest()
        signature = self._hmac(stored_key, auth_message)
        proof = base64.b64decode(proof_b64)
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=False))
        if len(proof) != len(signature) or hashlib.new(self.hash, client_key).digest() != (
            stored_key
        ):
            return None
        server_key = self._hmac(self.salted, b"Server Key")
        verifier = base64.b64encode(self._hmac(server_key, auth_message)).decode()
        return f"v={verifier}".encode()


class SecurityProxy:
    """Listens on ``listen_port``, forwards to ``upstream_port`` (see the module doc)."""

    def __init__(
        self,
        listen_port: int,
        upstream_port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        users: Mapping[str, str] | None = None,
        mechanisms: tuple[str, ...] = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.ssl_context = ssl_context
        self.users = users
        self.mechanisms = mechanisms
        self.authenticated = 0  # connections that passed SASL
        self.refused = 0
        self._listener = socket.create_server((host, listen_port))
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept_loop, name="security-proxy", daemon=True)
        self._threads.append(accept)
        accept.start()

    def __enter__(self) -> SecurityProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() below (Linux)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        for t in list(self._threads):
            t.join(5)

    def drop_connections(self) -> None:
        """Cuts every open connection (clients reconnect and authenticate again)."""
        with self._lock:
            socks = list(self._sockets)  # closed by stop()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._track(client)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            client.settimeout(IO_TIMEOUT_S)
            if self.ssl_context is not None:
                try:
                    client = self.ssl_context.wrap_socket(client, server_side=True)
                except (ssl.SSLError, OSError):
                    return  # the client refused our certificate, or is not TLS
                self._track(client)
            upstream = socket.create_connection((self.host, self.upstream_port), IO_TIMEOUT_S)
            self._track(upstream)
            if self.users is not None and not self._authenticate(client, upstream):
                return
            client.settimeout(None)
            upstream.settimeout(None)
            self._spawn(self._pump, upstream, client)
            self._pump(client, upstream)
        except OSError:
            pass
        finally:
            if upstream is not None and self._stopping.is_set():
                upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _authenticate(self, client: socket.socket, upstream: socket.socket) -> bool:
        """Kafka's SASL server side; True once the client is authenticated."""
        mechanism: str | None = None
        scram: _ScramServer | None = None
        rounds = 0
        while True:
            payload = _read_frame(client)
            if payload is None:
                return False
            (api_key,) = struct.unpack_from(">h", payload)
            if api_key == ApiKey.API_VERSIONS:
                upstream.sendall(struct.pack(">i", len(payload)) + payload)
                answer = _read_frame(upstream)
                if answer is None:
                    return False
                client.sendall(struct.pack(">i", len(answer)) + answer)
                continue
            if api_key not in (ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE):
                return False  # Kafka closes a connection that skips authentication
            header, req = decode_request(payload)
            corr, version = header.correlation_id, header.api_version
            if isinstance(req, SaslHandshakeRequest):
                ok = req.mechanism in self.mechanisms
                mechanism = req.mechanism if ok else None
                if mechanism in HASHES:
                    scram = _ScramServer(mechanism, self.users or {})
                resp = SaslHandshakeResponse(
                    error_code=0 if ok else ec.UNSUPPORTED_SASL_MECHANISM,
                    mechanisms=list(self.mechanisms),
                )
                client.sendall(encode_response(resp, version, corr))
                continue
            assert isinstance(req, SaslAuthenticateRequest)
            token = bytes(req.auth_bytes)
            reply: bytes | None
            done = False
            if mechanism == "PLAIN":
                parts = token.split(b"\0")
                ok = len(parts) == 3 and (self.users or {}).get(parts[1].decode()) == (
                    parts[2].decode()
                )
                reply, done = (b"", True) if ok else (None, False)
            elif scram is not None and rounds == 0:
                reply = scram.first(token)
            elif scram is not None and rounds == 1:
                reply = scram.final(token)
                done = True
            else:
                reply = None
            rounds += 1
            if reply is None:
                self.refused += 1
                failed = SaslAuthenticateResponse(
                    error_code=ec.SASL_AUTHENTICATION_FAILED,
                    error_message=f"Authentication failed: invalid credentials with {mechanism}",
                )
                client.sendall(encode_response(failed, version, corr))
                return False
            client.sendall(
                encode_response(SaslAuthenticateResponse(auth_bytes=reply), version, corr)
            )
            if done:
                self.authenticated += 1
                return True
