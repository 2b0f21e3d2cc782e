"""Whole frames of the supported APIs: size prefix, header and body in one call.

The sender encodes requests with :func:`encode_request_segments` (record batches are
spliced in uncopied, ready for ``socket.sendmsg``) and decodes answers with
:func:`decode_response`; a test proxy does the reverse with :func:`decode_request` and
:func:`encode_response`. Negotiated versions are passed in as values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar, cast

from shmprod.errors import DecodeError
from shmprod.protocol.frames import (
    SUPPORTED_VERSIONS,
    ApiKey,
    RequestHeader,
    UnsupportedVersionError,
    append_request_header,
    append_response_header,
    decode_request_header,
    decode_response_header,
    patch_size_prefix,
)
from shmprod.protocol.messages import produce_fast
from shmprod.protocol.messages.api_versions import ApiVersionsRequest, ApiVersionsResponse
from shmprod.protocol.messages.init_producer_id import (
    InitProducerIdRequest,
    InitProducerIdResponse,
)
from shmprod.protocol.messages.metadata import MetadataRequest, MetadataResponse
from shmprod.protocol.messages.produce import ProduceRequest, ProduceResponse
from shmprod.protocol.messages.schema import (
    Request,
    Response,
    Segment,
    Writer,
    check_version,
    decode_body,
    encode_body_into,
)

R = TypeVar("R", bound=Response)

if TYPE_CHECKING:  # built at first use (see __getattr__)
    REQUEST_TYPES: Mapping[int, type[Request]]
    RESPONSE_TYPES: Mapping[int, type[Response]]


@functools.cache
def _registries() -> tuple[Mapping[int, type[Request]], Mapping[int, type[Response]]]:
    """Every API's request and response classes by API key (``REQUEST_TYPES``,
    ``RESPONSE_TYPES``). The codecs of the APIs a producer's processes never call
    (Fetch, CreateTopics; SASL's without SASL) are loaded here, at the first use: by a
    test proxy, the blocking connection or a test."""
    from shmprod.protocol.messages.create_topics import CreateTopicsRequest, CreateTopicsResponse
    from shmprod.protocol.messages.fetch import FetchRequest, FetchResponse
    from shmprod.protocol.messages.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )

    requests: tuple[type[Request], ...] = (
        ProduceRequest,
        FetchRequest,
        MetadataRequest,
        ApiVersionsRequest,
        CreateTopicsRequest,
        InitProducerIdRequest,
        SaslHandshakeRequest,
        SaslAuthenticateRequest,
    )
    responses: tuple[type[Response], ...] = (
        ProduceResponse,
        FetchResponse,
        MetadataResponse,
        ApiVersionsResponse,
        CreateTopicsResponse,
        InitProducerIdResponse,
        SaslHandshakeResponse,
        SaslAuthenticateResponse,
    )
    return {c.API_KEY: c for c in requests}, {c.API_KEY: c for c in responses}


def __getattr__(name: str) -> object:
    if name == "REQUEST_TYPES":
        return _registries()[0]
    if name == "RESPONSE_TYPES":
        return _registries()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


def _request_writer(
    request: Request, version: int, correlation_id: int, client_id: str | None
) -> Writer:
    """Encodes a whole request frame (size prefix patched) into a :class:`Writer`."""
    check_version(type(request), version)
    w = Writer(reserve=4)
    append_request_header(w.buf, request.API_KEY, version, correlation_id, client_id)
    encode_body_into(w, request, version)
    patch_size_prefix(w.first, w.nbytes())
    return w


def encode_request_segments(
    request: Request, version: int, correlation_id: int, client_id: str | None
) -> list[Segment]:
    """A complete request frame as segments; ``records`` buffers are passed through.

    The first segment starts with the int32 size prefix and the header. Each non-empty
    ``records`` field is its own segment: the caller's object itself (bytes or
    memoryview; a bytearray is wrapped in a memoryview), so keep it unchanged until
    the segments are sent. A Produce request takes the short path of
    :mod:`.produce_fast` (the same bytes) where it can.
    """
    if type(request) is ProduceRequest:
        fast = produce_fast.encode_request_segments(request, version, correlation_id, client_id)
        if fast is not None:
            return fast
    return _request_writer(request, version, correlation_id, client_id).segments()


def encode_request(
    request: Request, version: int, correlation_id: int, client_id: str | None
) -> bytes:
    """A complete size-prefixed request frame as one ``bytes``."""
    return _request_writer(request, version, correlation_id, client_id).getvalue()


def encode_produce_request_segments(
    request: ProduceRequest, version: int, correlation_id: int, client_id: str | None
) -> list[Segment]:
    """A Produce request frame as segments, record batches uncopied (see above)."""
    return encode_request_segments(request, version, correlation_id, client_id)


def encode_produce_request(
    request: ProduceRequest, version: int, correlation_id: int, client_id: str | None
) -> bytes:
    """A Produce request frame as one ``bytes`` (copies the record batches once)."""
    return encode_request(request, version, correlation_id, client_id)


def decode_request(payload: bytes | bytearray | memoryview) -> tuple[RequestHeader, Request]:
    """Decodes a request frame payload (after the size prefix): header and body.

    Raises :class:`UnsupportedVersionError` for an API or version shmprod does not
    speak, :class:`DecodeError` for malformed bytes. ``records`` in a decoded Produce
    request are memoryviews into ``payload``.
    """
    header = decode_request_header(payload)
    cls = _registries()[0].get(header.api_key)
    if cls is None:
        raise UnsupportedVersionError(f"no codec for api key {header.api_key}")
    return header, decode_body(cls, payload, header.api_version, header.body_offset)


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


def encode_response(response: Response, version: int, correlation_id: int) -> bytes:
    """A complete size-prefixed response frame (header v0 or v1 as the API requires)."""
    check_version(type(response), version)
    w = Writer(reserve=4)
    append_response_header(w.buf, response.API_KEY, version, correlation_id)
    encode_body_into(w, response, version)
    patch_size_prefix(w.first, w.nbytes())
    return w.getvalue()


def decode_response(
    cls: type[R], payload: bytes | bytearray | memoryview, version: int
) -> tuple[int, R]:
    """Decodes a response frame payload: returns ``(correlation_id, body)``.

    ``cls`` and ``version`` are those of the request sent. A broker that does not
    support the ApiVersions version asked answers in version 0 (KIP-511), so an
    ApiVersions response that does not parse at ``version`` is retried as version 0;
    its ``error_code`` is then UNSUPPORTED_VERSION (35) and ``api_keys`` says which
    ApiVersions versions the broker supports. A Produce response takes the short path
    of :mod:`.produce_fast` (the same object) where it can.
    """
    correlation_id, offset = decode_response_header(payload, cls.API_KEY, version)
    if cls is ProduceResponse:
        fast = produce_fast.decode_response_body(payload, offset, version)
        if fast is not None:
            return correlation_id, cast(R, fast)
    try:
        return correlation_id, decode_body(cls, payload, version, offset)
    except DecodeError as first:
        if cls.API_KEY != ApiKey.API_VERSIONS or version == 0:
            raise
        try:
            return correlation_id, decode_body(cls, payload, 0, offset)
        except DecodeError:
            raise first from None


# ---------------------------------------------------------------------------
# Version negotiation
# ---------------------------------------------------------------------------


def choose_version(
    api_key: int, broker_min: int, broker_max: int, ours: tuple[int, int] | None = None
) -> int:
    """The highest version of ``api_key`` both sides support.

    ``ours`` defaults to :data:`SUPPORTED_VERSIONS`. Raises
    :class:`UnsupportedVersionError` when the ranges do not overlap.
    """
    if ours is None:
        if api_key not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(f"shmprod has no codec for api key {api_key}")
        ours = SUPPORTED_VERSIONS[api_key]
    lo, hi = ours
    best = min(hi, broker_max)
    if best < max(lo, broker_min):
        raise UnsupportedVersionError(
            f"api key {api_key}: we support versions {lo}-{hi}, "
            f"the broker {broker_min}-{broker_max}",
            api_key=api_key,
        )
    return best


def version_for(offered: Mapping[int, tuple[int, int]], api_key: int, peer: str) -> int:
    """The version of ``api_key`` to use with a broker (``peer``) that ``offered`` these
    ranges in ApiVersions; UnsupportedVersionError when it lacks the API or no version is
    common."""
    theirs = offered.get(api_key)
    if theirs is None:
        raise UnsupportedVersionError(
            f"broker {peer} does not offer api key {api_key}", api_key=api_key
        )
    return choose_version(api_key, *theirs, ours=SUPPORTED_VERSIONS.get(api_key))


def negotiate_versions(
    response: ApiVersionsResponse,
    wanted: Iterable[int] | None = None,
    ours: Mapping[int, tuple[int, int]] = SUPPORTED_VERSIONS,
) -> dict[int, int]:
    """The version to use for each ``wanted`` API key (default: all of ``ours``).

    Raises :class:`UnsupportedVersionError` if the broker lacks one of them or no
    version of it is common to both sides.
    """
    broker = {k.api_key: (k.min_version, k.max_version) for k in response.api_keys}
    chosen: dict[int, int] = {}
    for key in ours if wanted is None else wanted:
        if key not in broker:
            raise UnsupportedVersionError(f"broker does not support api key {key}", api_key=key)
        chosen[key] = choose_version(key, *broker[key], ours=ours.get(key))
    return chosen
