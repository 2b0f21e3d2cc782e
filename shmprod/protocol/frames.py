"""Kafka request/response framing: size prefixes and headers, no message bodies.

Every Kafka message on the wire is ``int32 size | header | body``. Which header a
message carries depends on whether its (api key, version) is *flexible*
(compact strings and tagged fields, KIP-482):

- request header v1: api_key int16, api_version int16, correlation_id int32,
  client_id nullable int16-prefixed string (never compact, even in v2, so old brokers
  can read any ApiVersions request);
- request header v2: v1 plus a tagged-field section;
- response header v0: correlation_id int32;
- response header v1: v0 plus a tagged-field section. ApiVersions responses always use
  v0, even for flexible versions, so a client can read the answer to a version it sent
  before it knows what the broker supports.

:class:`FrameDecoder` splits a byte stream into frames. Everything here is sans-IO.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from shmprod.errors import DecodeError, EncodeError, ProtocolError
from shmprod.protocol.primitives import (
    INT32_MAX,
    Reader,
    append_empty_tagged_fields,
    append_int16,
    append_int32,
    append_nullable_string,
)

_I32 = struct.Struct(">i")

DEFAULT_MAX_FRAME_SIZE: Final = 100 * 1024 * 1024
"""Largest frame payload :class:`FrameDecoder` accepts unless told otherwise (100 MiB)."""


NEVER_FLEXIBLE: Final = 0x8000
"""First flexible version of an API that has none (above every int16 version)."""


class ApiKey(IntEnum):
    """The Kafka API keys shmprod speaks."""

    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    INIT_PRODUCER_ID = 22
    SASL_AUTHENTICATE = 36


FIRST_FLEXIBLE_VERSION: Final[Mapping[int, int]] = {
    ApiKey.PRODUCE: 9,
    ApiKey.FETCH: 12,
    ApiKey.LIST_OFFSETS: 6,
    ApiKey.METADATA: 9,
    ApiKey.API_VERSIONS: 3,
    ApiKey.CREATE_TOPICS: 5,
    ApiKey.INIT_PRODUCER_ID: 2,
    ApiKey.SASL_HANDSHAKE: NEVER_FLEXIBLE,
    ApiKey.SASL_AUTHENTICATE: 2,
}
"""First flexible version of each known API (``flexibleVersions`` in the Kafka schemas;
:data:`NEVER_FLEXIBLE` for ``"none"``)."""

SUPPORTED_VERSIONS: Final[Mapping[int, tuple[int, int]]] = {
    ApiKey.PRODUCE: (3, 11),
    ApiKey.FETCH: (4, 12),
    ApiKey.METADATA: (1, 12),
    ApiKey.API_VERSIONS: (0, 3),
    ApiKey.CREATE_TOPICS: (0, 7),
    ApiKey.INIT_PRODUCER_ID: (0, 5),
    ApiKey.SASL_HANDSHAKE: (0, 1),
    ApiKey.SASL_AUTHENTICATE: (0, 2),
}
"""The (min, max) versions shmprod speaks, by API key: each message class's
``VERSIONS``. Kept here, apart from the classes, so a process learns them without
loading the codecs of APIs it never calls (the sender never fetches or creates
topics)."""


class UnsupportedVersionError(ProtocolError):
    """No usable version: an unknown API key, or no version both sides support."""

    def __init__(self, message: str, *, api_key: int | None = None) -> None:
        super().__init__(message)
        self.api_key = api_key


# ---------------------------------------------------------------------------
# Header versions
# ---------------------------------------------------------------------------


def is_flexible(api_key: int, api_version: int) -> bool:
    """Whether ``api_version`` of ``api_key`` uses compact types and tagged fields."""
    first = FIRST_FLEXIBLE_VERSION.get(api_key)
    if first is None:
        raise UnsupportedVersionError(f"unknown api key {api_key}", api_key=api_key)
    return api_version >= first


def request_header_version(api_key: int, api_version: int) -> int:
    """Request header version (1 or 2) for a request of this API and version."""
    return 2 if is_flexible(api_key, api_version) else 1


def response_header_version(api_key: int, api_version: int) -> int:
    """Response header version (0 or 1); ApiVersions responses always use 0."""
    flexible = is_flexible(api_key, api_version)
    return 1 if flexible and api_key != ApiKey.API_VERSIONS else 0


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------


def append_request_header(
    out: bytearray, api_key: int, api_version: int, correlation_id: int, client_id: str | None
) -> None:
    """Appends the request header (v1 or v2, chosen from the API and version) to ``out``."""
    append_int16(out, api_key)
    append_int16(out, api_version)
    append_int32(out, correlation_id)
    append_nullable_string(out, client_id)
    if request_header_version(api_key, api_version) == 2:
        append_empty_tagged_fields(out)


def append_response_header(
    out: bytearray, api_key: int, api_version: int, correlation_id: int
) -> None:
    """Appends the response header (v0 or v1, chosen from the API and version) to ``out``."""
    append_int32(out, correlation_id)
    if response_header_version(api_key, api_version) == 1:
        append_empty_tagged_fields(out)


def patch_size_prefix(frame: bytearray, total_size: int | None = None) -> None:
    """Writes the int32 size prefix at ``frame[0:4]``: the size of everything after it.

    ``total_size`` is the whole frame's size when ``frame`` is only its first segment.
    """
    size = (len(frame) if total_size is None else total_size) - 4
    if not 0 <= size <= INT32_MAX:
        raise EncodeError(f"frame size {size} out of range")
    _I32.pack_into(frame, 0, size)


def build_request_frame(
    api_key: int,
    api_version: int,
    correlation_id: int,
    client_id: str | None,
    body: bytes | bytearray | memoryview,
) -> bytes:
    """A complete size-prefixed request frame around an already-encoded body."""
    out = bytearray(4)
    append_request_header(out, api_key, api_version, correlation_id, client_id)
    out += body
    patch_size_prefix(out)
    return bytes(out)


def build_response_frame(
    api_key: int, api_version: int, correlation_id: int, body: bytes | bytearray | memoryview
) -> bytes:
    """A complete size-prefixed response frame around an already-encoded body."""
    out = bytearray(4)
    append_response_header(out, api_key, api_version, correlation_id)
    out += body
    patch_size_prefix(out)
    return bytes(out)


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestHeader:
    """A decoded request header; the body starts at ``body_offset`` in the frame payload."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body_offset: int


def decode_request_header(
    payload: bytes | bytearray | memoryview, *, flexible: bool | None = None
) -> RequestHeader:
    """Decodes the header of a request frame payload (the bytes after the size prefix).

    The header version comes from :data:`FIRST_FLEXIBLE_VERSION`; pass ``flexible`` to
    decode the header of an API not in that table. Unknown header tags are skipped.
    """
    r = Reader(payload)
    api_key = r.int16()
    api_version = r.int16()
    correlation_id = r.int32()
    client_id = r.nullable_string()
    if flexible is None:
        flexible = is_flexible(api_key, api_version)
    if flexible:
        r.tagged_fields()
    return RequestHeader(api_key, api_version, correlation_id, client_id, r.pos)


def decode_response_header(
    payload: bytes | bytearray | memoryview, api_key: int, api_version: int
) -> tuple[int, int]:
    """Decodes a response header: returns ``(correlation_id, body_offset)``.

    The caller knows ``api_key`` and ``api_version`` from the request it sent (look it
    up by :func:`peek_correlation_id`). Unknown header tags are skipped.
    """
    r = Reader(payload)
    correlation_id = r.int32()
    if response_header_version(api_key, api_version) == 1:
        r.tagged_fields()
    return correlation_id, r.pos


def peek_correlation_id(payload: bytes | bytearray | memoryview) -> int:
    """The correlation id of a response payload: its first four bytes, in every version."""
    return Reader(payload).int32()


class FrameDecoder:
    """Splits a byte stream into frames: feed it what the socket returned, get payloads.

    Each frame is ``int32 size | payload``; :meth:`feed` returns the complete payloads
    (without the size prefix) in order and keeps any partial frame for the next call.
    A negative size or one above ``max_frame_size`` raises :class:`DecodeError`; the
    stream cannot be resynchronised after that, so later calls raise it again.
    """

    __slots__ = ("_buf", "_error", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if not 0 <= max_frame_size <= INT32_MAX:
            raise ValueError(f"max_frame_size must be in [0, {INT32_MAX}], got {max_frame_size}")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._error: DecodeError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Adds ``data`` to the stream and returns every frame payload it completed."""
        if self._error is not None:
            raise DecodeError(f"frame stream already failed: {self._error}")
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        pos = 0
        end_of_data = len(buf)
        with memoryview(buf) as view:
            while end_of_data - pos >= 4:
                size: int = _I32.unpack_from(view, pos)[0]
                if not 0 <= size <= self.max_frame_size:
                    self._error = DecodeError(
                        f"frame size {size} outside [0, {self.max_frame_size}]"
                    )
                    raise self._error
                end = pos + 4 + size
                if end > end_of_data:
                    break
                frames.append(bytes(view[pos + 4 : end]))
                pos = end
        if pos:
            del buf[:pos]
        return frames
