"""The SASL exchange of one broker connection, sans-IO (KIP-43, KIP-152).

After ApiVersions, a connection to a SASL listener sends SaslHandshake v1 naming the
mechanism, then one SaslAuthenticate request per client token until the mechanism is
done; only then may it send anything else. :class:`SaslExchange` decides what to send
next from what was answered; the caller moves the bytes (the blocking
``BrokerConnection`` and the sender's non-blocking ``NodeConnection`` share it)::

    exchange = SaslExchange(credentials, api_versions, peer)
    step = exchange.start()                # SaslHandshake
    while step is not None:
        response = send_and_wait(step)     # step.request at step.version
        step = exchange.on_response(response)

Every refusal raises :class:`AuthenticationError` (fatal: the same credentials will be
refused again); malformed SCRAM messages raise :class:`DecodeError`.

Mechanisms: ``PLAIN`` (RFC 4616: ``authzid NUL user NUL password`` in one token; use it
only over TLS) and ``SCRAM-SHA-256`` / ``SCRAM-SHA-512`` (:mod:`.scram`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from shmprod.errors import AuthenticationError
from shmprod.protocol import error_codes as ec
from shmprod.protocol.frames import ApiKey, UnsupportedVersionError
from shmprod.protocol.messages.codec import version_for
from shmprod.protocol.messages.sasl import (
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
)
from shmprod.protocol.messages.schema import Request, Response
from shmprod.protocol.scram import MECHANISMS as SCRAM_MECHANISMS
from shmprod.protocol.scram import ScramClient

SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""The SASL mechanisms shmprod speaks."""

HANDSHAKE_VERSION: Final = 1
"""SaslHandshake v1: tokens travel in SaslAuthenticate requests (v0 sends them raw)."""


@dataclass(frozen=True, slots=True)
class SaslCredentials:
    """A mechanism, user name and password. Its repr never shows the password."""

    mechanism: str
    username: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"SaslCredentials({self.mechanism!r}, username={self.username!r}, password='***')"


@dataclass(frozen=True, slots=True)
class SaslStep:
    """The next request to send and the type of its answer."""

    request: Request
    response_cls: type[Response]
    version: int


class SaslExchange:
    """What to send next during authentication. Runs in: the connection's owner."""

    def __init__(
        self,
        credentials: SaslCredentials,
        api_versions: Mapping[int, tuple[int, int]],
        peer: str,
        *,
        nonce: str | None = None,
    ) -> None:
        mechanism = credentials.mechanism
        if mechanism not in SASL_MECHANISMS:
            raise AuthenticationError(f"unsupported SASL mechanism {mechanism!r}")
        self.peer = peer
        self.mechanism = mechanism
        self._credentials = credentials
        self._scram = (
            ScramClient(mechanism, credentials.username, credentials.password, nonce=nonce)
            if mechanism in SCRAM_MECHANISMS
            else None
        )
        handshake = api_versions.get(ApiKey.SASL_HANDSHAKE)
        if handshake is None or not handshake[0] <= HANDSHAKE_VERSION <= handshake[1]:
            raise AuthenticationError(
                f"broker {peer} does not offer SaslHandshake v1: no SASL on this listener?"
            )
        try:
            self._auth_version = version_for(api_versions, ApiKey.SASL_AUTHENTICATE, peer)
        except UnsupportedVersionError as exc:
            raise AuthenticationError(f"broker {peer}: no usable SaslAuthenticate: {exc}") from None
        self._round = 0
        self.done = False

    def __repr__(self) -> str:
        return f"SaslExchange({self.mechanism}, {self.peer}, round={self._round})"

    def start(self) -> SaslStep:
        """The SaslHandshake request that opens the exchange."""
        return SaslStep(
            SaslHandshakeRequest(mechanism=self.mechanism),
            SaslHandshakeResponse,
            HANDSHAKE_VERSION,
        )

    def _token(self, token: bytes) -> SaslStep:
        self._round += 1
        return SaslStep(
            SaslAuthenticateRequest(auth_bytes=token), SaslAuthenticateResponse, self._auth_version
        )

    def on_response(self, response: Response) -> SaslStep | None:
        """The next request, or None once authenticated. Raises AuthenticationError."""
        if self.done:
            raise AuthenticationError(f"{self.peer}: answer after SASL authentication finished")
        if isinstance(response, SaslHandshakeResponse):
            return self._on_handshake(response)
        if isinstance(response, SaslAuthenticateResponse):
            return self._on_authenticate(response)
        raise AuthenticationError(f"{self.peer}: unexpected {type(response).__name__} in SASL")

    def _on_handshake(self, resp: SaslHandshakeResponse) -> SaslStep:
        if self._round != 0:
            raise AuthenticationError(f"{self.peer}: SaslHandshake answered twice")
        if resp.error_code == ec.UNSUPPORTED_SASL_MECHANISM:
            raise AuthenticationError(
                f"broker {self.peer} does not enable SASL mechanism {self.mechanism} "
                f"(it offers: {', '.join(resp.mechanisms) or 'none'})"
            )
        if resp.error_code:
            raise AuthenticationError(
                f"SaslHandshake to {self.peer} answered {ec.error_name(resp.error_code)}"
            )
        creds = self._credentials
        if self._scram is not None:
            return self._token(self._scram.first())
        token = b"\0" + creds.username.encode("utf-8") + b"\0" + creds.password.encode("utf-8")
        return self._token(token)

    def _on_authenticate(self, resp: SaslAuthenticateResponse) -> SaslStep | None:
        if self._round == 0:
            raise AuthenticationError(f"{self.peer}: SaslAuthenticate answer before handshake")
        if resp.error_code:
            detail = f": {resp.error_message[:200]}" if resp.error_message else ""
            raise AuthenticationError(
                f"broker {self.peer} refused {self.mechanism} authentication of user "
                f"{self._credentials.username!r}: [{resp.error_code}] "
                f"{ec.error_name(resp.error_code)}{detail}"
            )
        scram = self._scram
        if scram is None:  # PLAIN: one round
            self._finish()
            return None
        token = bytes(resp.auth_bytes)
        if self._round == 1:
            return self._token(scram.final(token))
        try:
            scram.verify(token)
        except AuthenticationError as exc:
            raise AuthenticationError(
                f"broker {self.peer} refused {self.mechanism} authentication of user "
                f"{self._credentials.username!r}: {exc}"
            ) from None
        self._finish()
        return None

    def _finish(self) -> None:
        self.done = True
        self._scram = None
