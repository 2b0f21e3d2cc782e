"""SaslHandshake (key 17, versions 0-1) and SaslAuthenticate (key 36, versions 0-2).

Schemas: ``SaslHandshake{Request,Response}.json`` and
``SaslAuthenticate{Request,Response}.json`` in apache/kafka. A client sends SaslHandshake
v1 to pick a mechanism, then wraps each SASL token in a SaslAuthenticate request
(KIP-152); v0 of SaslHandshake, where raw tokens follow without Kafka framing, is not
spoken. SaslHandshake is never flexible; SaslAuthenticate is from version 2.

``auth_bytes`` is Kafka's ``bytes`` type, declared with the ``RECORDS`` kind (same wire
form): encoding splices the caller's buffer, decoding returns a memoryview into the
frame. Copy it (``bytes(...)``) before the frame goes away.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey
from shmprod.protocol.messages.schema import (
    INT16,
    INT64,
    RECORDS,
    STRING,
    RecordsBuffer,
    Request,
    Response,
    array,
    fld,
)


@dataclass(kw_only=True, slots=True)
class SaslHandshakeRequest(Request):
    """The SASL mechanism the client wants (``"SCRAM-SHA-512"``, ``"PLAIN"``)."""

    API_KEY: ClassVar[int] = ApiKey.SASL_HANDSHAKE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.SASL_HANDSHAKE]

    mechanism: str = fld(STRING, "0+")


@dataclass(kw_only=True, slots=True)
class SaslHandshakeResponse(Response):
    """An error code (33 UNSUPPORTED_SASL_MECHANISM) and the mechanisms the broker offers."""

    API_KEY: ClassVar[int] = ApiKey.SASL_HANDSHAKE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.SASL_HANDSHAKE]

    error_code: int = fld(INT16, "0+")
    mechanisms: list[str] = fld(array(STRING), "0+")


@dataclass(kw_only=True, slots=True)
class SaslAuthenticateRequest(Request):
    """One SASL token from the client."""

    API_KEY: ClassVar[int] = ApiKey.SASL_AUTHENTICATE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.SASL_AUTHENTICATE]

    auth_bytes: RecordsBuffer = fld(RECORDS, "0+", default=b"")


@dataclass(kw_only=True, slots=True)
class SaslAuthenticateResponse(Response):
    """One SASL token from the broker, or an error (58 SASL_AUTHENTICATION_FAILED)."""

    API_KEY: ClassVar[int] = ApiKey.SASL_AUTHENTICATE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.SASL_AUTHENTICATE]

    error_code: int = fld(INT16, "0+")
    error_message: str | None = fld(STRING, "0+", nullable="0+", default=None)
    auth_bytes: RecordsBuffer = fld(RECORDS, "0+", default=b"")
    session_lifetime_ms: int = fld(INT64, "1+")
