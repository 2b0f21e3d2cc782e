"""A SCRAM-SHA-256 / SCRAM-SHA-512 client (RFC 5802, RFC 7677), sans-IO.

Kafka carries the four SCRAM messages in SaslAuthenticate requests and responses
(KIP-84, KIP-152)::

    client-first   n,,n=<user>,r=<client nonce>
    server-first   r=<client nonce + server nonce>,s=<base64 salt>,i=<iterations>
    client-final   c=biws,r=<nonce>,p=<base64 ClientProof>
    server-final   v=<base64 ServerSignature>   or   e=<error>

The client proves it knows the password without sending it, and checks the server's
signature, which only a holder of the stored credential can compute. No channel binding
(``n,,``): Kafka does not use it.

Malformed server messages raise :class:`DecodeError`; well-formed ones that refuse or
cannot be trusted (``e=``, a wrong nonce or signature, too few iterations) raise
:class:`AuthenticationError`. Nothing else escapes, whatever the bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Final

from shmprod.errors import AuthenticationError, DecodeError

MIN_ITERATIONS: Final = 4096
"""Fewest PBKDF2 iterations accepted (Kafka's minimum for SCRAM credentials, RFC 7677)."""
MAX_ITERATIONS: Final = 1_000_000
"""Most iterations accepted: a hostile server must not make the client hash for minutes."""
MAX_MESSAGE: Final = 4096
"""Longest server message accepted, in bytes."""

MECHANISMS: Final[dict[str, str]] = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
"""SCRAM mechanism name to its ``hashlib`` hash."""


def escape_username(name: str) -> str:
    """A user name as a SCRAM ``saslname``: ``=`` becomes ``=3D`` and ``,`` ``=2C``."""
    return name.replace("=", "=3D").replace(",", "=2C")


def _attributes(message: bytes, what: str) -> list[tuple[str, str]]:
    """``k=v,k=v`` into pairs, checked: one ASCII letter before each ``=``."""
    if len(message) > MAX_MESSAGE:
        raise DecodeError(f"SCRAM {what} longer than {MAX_MESSAGE} bytes")
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"SCRAM {what} is not UTF-8") from None
    pairs: list[tuple[str, str]] = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or len(key) != 1 or not ("a" <= key <= "z" or "A" <= key <= "Z"):
            raise DecodeError(f"SCRAM {what}: malformed attribute {part[:40]!r}")
        pairs.append((key, value))
    return pairs


def _b64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise DecodeError(f"SCRAM {what} is not base64") from None


@dataclass(frozen=True, slots=True)
class ServerFirst:
    """The parsed server-first message."""

    nonce: str
    salt: bytes
    iterations: int


def parse_server_first(message: bytes) -> ServerFirst:
    """Parses ``[m=...,]r=...,s=...,i=...[,ext...]`` (RFC 5802 section 7)."""
    pairs = _attributes(message, "server-first message")
    if pairs[0][0] == "m":
        raise AuthenticationError("SCRAM server asks for an unsupported mandatory extension")
    if pairs[0][0] == "e":
        raise AuthenticationError(f"SCRAM authentication failed: {pairs[0][1][:200]}")
    if len(pairs) < 3 or [k for k, _ in pairs[:3]] != ["r", "s", "i"]:
        raise DecodeError("SCRAM server-first message must start with r=, s=, i=")
    nonce, salt_b64, iterations_s = (v for _, v in pairs[:3])
    if not nonce or not nonce.isprintable() or any(c == "," for c in nonce):
        raise DecodeError("SCRAM server nonce is empty or not printable")
    salt = _b64(salt_b64, "salt")
    if not salt:
        raise DecodeError("SCRAM salt is empty")
    if not iterations_s.isascii() or not iterations_s.isdigit() or len(iterations_s) > 10:
        raise DecodeError(f"SCRAM iteration count {iterations_s[:20]!r} is not a number")
    return ServerFirst(nonce, salt, int(iterations_s))


def parse_server_final(message: bytes) -> bytes:
    """The server signature of ``v=...``; ``e=...`` raises AuthenticationError."""
    pairs = _attributes(message, "server-final message")
    key, value = pairs[0]
    if key == "e":
        raise AuthenticationError(f"SCRAM authentication failed: {value[:200]}")
    if key != "v":
        raise DecodeError("SCRAM server-final message must start with v= or e=")
    return _b64(value, "server signature")


class _Step(Enum):
    START = 0
    SENT_FIRST = 1
    SENT_FINAL = 2
    DONE = 3


class ScramClient:
    """One SCRAM exchange: ``first()``, ``final(server_first)``, ``verify(server_final)``.

    ``nonce`` is for tests (RFC 7677's vector); by default 24 random bytes, URL-safe
    base64. The password lives only in this object for the exchange's duration.
    """

    __slots__ = (
        "_auth_message",
        "_client_first_bare",
        "_hash",
        "_nonce",
        "_password",
        "_server_signature",
        "_step",
        "username",
    )

    def __init__(
        self, mechanism: str, username: str, password: str, *, nonce: str | None = None
    ) -> None:
        hash_name = MECHANISMS.get(mechanism)
        if hash_name is None:
            raise ValueError(f"not a SCRAM mechanism: {mechanism!r}")
        self._hash = hash_name
        self.username = username
        self._password = password.encode("utf-8")
        self._nonce = nonce if nonce is not None else secrets.token_urlsafe(24)
        self._client_first_bare = f"n={escape_username(username)},r={self._nonce}"
        self._auth_message = b""
        self._server_signature = b""
        self._step = _Step.START

    def __repr__(self) -> str:  # never the password
        return f"ScramClient({self._hash}, username={self.username!r})"

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self._hash).digest()

    def first(self) -> bytes:
        """The client-first message (GS2 header ``n,,``: no channel binding, no authzid)."""
        if self._step is not _Step.START:
            raise AuthenticationError("SCRAM client-first message sent twice")
        self._step = _Step.SENT_FIRST
        return b"n,," + self._client_first_bare.encode("utf-8")

    def final(self, server_first: bytes) -> bytes:
        """The client-final message (with the proof) for the server-first message."""
        if self._step is not _Step.SENT_FIRST:
            raise AuthenticationError("SCRAM server-first message out of order")
        sf = parse_server_first(server_first)
        if not sf.nonce.startswith(self._nonce) or len(sf.nonce) == len(self._nonce):
            raise AuthenticationError("SCRAM server nonce does not extend the client nonce")
        if not MIN_ITERATIONS <= sf.iterations <= MAX_ITERATIONS:
            raise AuthenticationError(
                f"SCRAM iteration count {sf.iterations} outside "
                f"[{MIN_ITERATIONS}, {MAX_ITERATIONS}]"
            )
        salted = hashlib.pbkdf2_hmac(self._hash, self._password, sf.salt, sf.iterations)
        client_key = self._hmac(salted, b"Client Key")
        stored_key = hashlib.new(self._hash, client_key).digest()
        without_proof = f"c=biws,r={sf.nonce}"
        auth_message = b",".join(
            (
                self._client_first_bare.encode("utf-8"),
                bytes(server_first),
                without_proof.encode("utf-8"),
            )
        )
        signature = self._hmac(stored_key, auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_signature = self._hmac(self._hmac(salted, b"Server Key"), auth_message)
        self._auth_message = auth_message
        self._step = _Step.SENT_FINAL
        return f"{without_proof},p={base64.b64encode(proof).decode('ascii')}".encode("ascii")

    def verify(self, server_final: bytes) -> None:
        """Checks the server signature; raises AuthenticationError unless it is right."""
        if self._step is not _Step.SENT_FINAL:
            raise AuthenticationError("SCRAM server-final message out of order")
        signature = parse_server_final(server_final)
        if not hmac.compare_digest(signature, self._server_signature):
            raise AuthenticationError("SCRAM server signature is wrong: not the real broker?")
        self._step = _Step.DONE
        self._password = b""

    @property
    def done(self) -> bool:
        return self._step is _Step.DONE
