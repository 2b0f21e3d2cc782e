"""Produce's frames in a few struct calls: the request the sender writes for every set
of batches it drains, and the answer it reads for each.

The generic codec (:mod:`.schema`) runs a closure per field and builds each value
through a field map: at version 11, 51 us to encode a request of 8 partitions and 96 us
to decode its answer. These two functions give the same bytes and the same objects in
18-35 and 19-25 us for the shapes the sender sends and a broker answers with success or
a plain error code. Anything else (unknown tags, per-record errors, an error message, a
leader hint, a value out of range, a type the generic codec would refuse, malformed
bytes) returns None, and the caller falls back to the generic codec, which encodes it or
raises its typed error. The tests check that both give the same bytes and objects, and
fuzz the decoder against the generic one.

Sans-IO: bytes in, objects out.
"""

from __future__ import annotations

import struct
from typing import Final

from shmprod.errors import EncodeError
from shmprod.protocol import primitives as p
from shmprod.protocol.frames import ApiKey
from shmprod.protocol.messages import produce as m
from shmprod.protocol.messages.schema import Segment, as_byte_view

__all__ = ["decode_response_body", "encode_request_segments"]

FIRST_FLEXIBLE: Final = 9  # Produce's first flexible version (frames.FIRST_FLEXIBLE_VERSION)
_VERSIONS: Final = m.ProduceRequest.VERSIONS

_HEADER = struct.Struct(">ihhi")  # size (patched), api key, version, correlation id
_ACKS_TIMEOUT = struct.Struct(">hi")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_NULL_RECORDS: Final = (b"\xff\xff\xff\xff", b"\x00")  # by flexible
# a partition's answer: index, error code, base offset, log append time (v2+), log
# start offset (v5+)
_PARTITION_V3 = struct.Struct(">ihqq")
_PARTITION_V5 = struct.Struct(">ihqqq")
# what follows the fixed part from v8 on when the broker reports no record errors and
# no error message (and, flexible, no tags): records errors [] and message null
_PLAIN_TAIL: Final = (b"\x00\x00\x00\x00\xff\xff", b"\x01\x00\x00")  # by flexible
_ENCODE_FALLBACK = (struct.error, EncodeError, OverflowError, TypeError, ValueError)


def encode_request_segments(
    request: m.ProduceRequest, version: int, correlation_id: int, client_id: str | None
) -> list[Segment] | None:
    """A Produce request frame as segments, record batches spliced in uncopied, exactly
    as :func:`shmprod.protocol.messages.encode_request_segments` writes it; None when
    the generic codec must handle ``request`` (see the module docstring)."""
    if type(request) is not m.ProduceRequest or request.unknown_tags:
        return None
    if not _VERSIONS[0] <= version <= _VERSIONS[1]:
        return None
    flexible = version >= FIRST_FLEXIBLE
    try:
        return _encode(request, version, flexible, correlation_id, client_id)
    except _ENCODE_FALLBACK:
        return None


def _encode(
    request: m.ProduceRequest,
    version: int,
    flexible: bool,
    correlation_id: int,
    client_id: str | None,
) -> list[Segment] | None:
    first = out = bytearray(_HEADER.pack(0, ApiKey.PRODUCE, version, correlation_id))
    p.append_nullable_string(out, client_id)  # header v1 and v2 alike
    transactional_id = request.transactional_id
    if transactional_id is not None and type(transactional_id) is not str:
        return None
    if flexible:
        out.append(0)  # the header's tags
        p.append_compact_nullable_string(out, transactional_id)
    else:
        p.append_nullable_string(out, transactional_id)
    out += _ACKS_TIMEOUT.pack(request.acks, request.timeout_ms)
    topics = request.topic_data
    if type(topics) is not list:
        return None
    chunks: list[bytearray | Segment] = []
    size = 0
    p.append_array_len(out, len(topics), compact=flexible)
    null_records = _NULL_RECORDS[flexible]
    for topic in topics:
        if type(topic) is not m.TopicProduceData or topic.unknown_tags:
            return None
        name = topic.name
        if type(name) is not str:
            return None
        if flexible:
            p.append_compact_string(out, name)
        else:
            p.append_string(out, name)
        parts = topic.partition_data
        if type(parts) is not list:
            return None
        p.append_array_len(out, len(parts), compact=flexible)
        for part in parts:
            if type(part) is not m.PartitionProduceData or part.unknown_tags:
                return None
            out += _I32.pack(part.index)
            records = part.records
            if records is None:
                out += null_records
            else:
                if not isinstance(records, bytes | bytearray | memoryview):
                    return None
                seg = as_byte_view(records)
                n = len(seg)
                if flexible:
                    p.append_uvarint(out, n + 1)
                else:
                    out += _I32.pack(n)
                if n:
                    chunks.append(out)
                    chunks.append(seg)
                    size += len(out) + n
                    out = bytearray()
            if flexible:
                out.append(0)  # the partition's tags
        if flexible:
            out.append(0)  # the topic's tags
    if flexible:
        out.append(0)  # the request's tags
    chunks.append(out)
    size += len(out)
    _I32.pack_into(first, 0, size - 4)
    return [bytes(c) if isinstance(c, bytearray) else c for c in chunks if len(c)]


def decode_response_body(
    payload: bytes | bytearray | memoryview, offset: int, version: int
) -> m.ProduceResponse | None:
    """The body of a Produce response at ``payload[offset:]``, equal to what
    :func:`shmprod.protocol.messages.decode_response` gives; None when the generic
    codec must read it (see the module docstring), malformed bytes included."""
    if not _VERSIONS[0] <= version <= _VERSIONS[1]:
        return None
    data = payload if type(payload) is bytes else bytes(payload)
    try:
        return _decode(data, offset, version)
    except (struct.error, IndexError, UnicodeDecodeError):
        return None


def _decode(data: bytes, pos: int, version: int) -> m.ProduceResponse | None:
    flexible = version >= FIRST_FLEXIBLE
    fixed = _PARTITION_V5 if version >= 5 else _PARTITION_V3
    tail = _PLAIN_TAIL[flexible] if version >= 8 else b""
    end = len(data)
    n_topics, pos = _read_count(data, pos, flexible)
    if n_topics < 0 or n_topics > end - pos:
        return None
    topics: list[m.TopicProduceResponse] = []
    for _ in range(n_topics):
        if flexible:
            n, pos = _uvarint(data, pos)
            n -= 1  # -1: null, which a topic name may not be
        else:
            (n,) = _I16.unpack_from(data, pos)
            pos += 2
        if n < 0 or pos + n > end:
            return None
        name = str(data[pos : pos + n], "utf-8")
        pos += n
        n_parts, pos = _read_count(data, pos, flexible)
        if n_parts < 0 or n_parts > end - pos:
            return None
        parts: list[m.PartitionProduceResponse] = []
        for _ in range(n_parts):
            if version >= 5:
                index, code, base, appended, start = _PARTITION_V5.unpack_from(data, pos)
            else:
                index, code, base, appended = _PARTITION_V3.unpack_from(data, pos)
                start = -1
            pos += fixed.size
            if tail:
                if data[pos : pos + len(tail)] != tail:
                    return None
                pos += len(tail)
            parts.append(
                m.PartitionProduceResponse(
                    index=index,
                    error_code=code,
                    base_offset=base,
                    log_append_time_ms=appended,
                    log_start_offset=start,
                )
            )
        if flexible:
            if data[pos] != 0:  # the topic's tags
                return None
            pos += 1
        topics.append(m.TopicProduceResponse(name=name, partition_responses=parts))
    (throttle,) = _I32.unpack_from(data, pos)
    pos += 4
    if flexible:
        if data[pos] != 0:  # the response's tags
            return None
        pos += 1
    if pos != end:
        return None
    return m.ProduceResponse(responses=topics, throttle_time_ms=throttle)


def _read_count(data: bytes, pos: int, flexible: bool) -> tuple[int, int]:
    """An array's element count and the position after it; -1 for a null array."""
    if flexible:
        n, pos = _uvarint(data, pos)
        return n - 1, pos
    (n,) = _I32.unpack_from(data, pos)
    return (n if n >= 0 else -1), pos + 4


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned varint of at most 5 bytes that fits 32 bits; IndexError otherwise (the
    generic codec then says what is wrong)."""
    result = 0
    for shift in (0, 7, 14, 21, 28):
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if shift == 28 and b > 0x0F:
                raise IndexError("varint overflows 32 bits")
            return result, pos
    raise IndexError("varint longer than 5 bytes")
