"""Kafka RecordBatch v2 (magic 2): encode one record at a time, patch, validate, decode.

Batch layout (big-endian; offsets from the batch start)::

    0  baseOffset           int64   0 from a producer; the broker assigns offsets
    8  batchLength          int32   size of everything after this field (total - 12)
    12 partitionLeaderEpoch int32   -1 from a producer
    16 magic                int8    2
    17 crc                  uint32  CRC-32C of bytes [21, end)
    21 attributes           int16   bits 0-2 codec, 3 timestamp type, 4 transactional, 5 control
    23 lastOffsetDelta      int32   record count - 1
    27 baseTimestamp        int64
    35 maxTimestamp         int64
    43 producerId           int64   -1 unless idempotent
    51 producerEpoch        int16   -1 unless idempotent
    53 baseSequence         int32   -1 unless idempotent
    57 recordCount          int32
    61 records ...                  one compressed blob when a codec is set

The CRC covers producerId/epoch/baseSequence, so the sender, which assigns sequences at
drain time, rewrites them with :func:`patch_producer_state` and the CRC goes last.

Record: ``length varint | attributes int8 | timestampDelta varlong | offsetDelta varint |
keyLength varint | key | valueLength varint | value | headerCount varint | headers``
(header: ``keyLength varint | UTF-8 key | valueLength varint | value``; -1 = null).

Encoding writes into a caller-owned buffer (``*_into(buf, offset, ...) -> end``); decoding
raises :class:`DecodeError` or :class:`CompressionError` for every malformed input.
The vectorized column encoder in :mod:`shmprod.protocol.vectorized` produces the same bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from shmprod.errors import CompressionError, DecodeError, EncodeError
from shmprod.native import load_crc32c
from shmprod.protocol import compression as _codecs
from shmprod.protocol import crc as _crc
from shmprod.protocol.compression import DEFAULT_MAX_DECOMPRESSED, NONE
from shmprod.protocol.primitives import INT32_MAX, Reader, encode_uvarint
from shmprod.protocol.values import as_bytes

__all__ = [
    "ATTRIBUTES",
    "BASE_OFFSET",
    "BASE_SEQUENCE",
    "BASE_TIMESTAMP",
    "BATCH_LENGTH",
    "CRC",
    "HEADER_SIZE",
    "LAST_OFFSET_DELTA",
    "LOG_OVERHEAD",
    "MAGIC",
    "MAX_TIMESTAMP",
    "MIN_RECORD_SIZE",
    "PARTITION_LEADER_EPOCH",
    "PLAIN",
    "PRODUCER_EPOCH",
    "PRODUCER_ID",
    "RECORDS",
    "RECORD_COUNT",
    "BatchHeader",
    "BatchSettings",
    "Header",
    "NewRecord",
    "Record",
    "RecordBatch",
    "batch_attributes",
    "batch_crc",
    "decode_batches",
    "encode_batch",
    "encode_batch_into",
    "encode_headers",
    "encode_record_into",
    "iter_batches",
    "patch_producer_state",
    "read_batch_header",
    "record_size",
    "split_batch",
    "validate_batch",
    "write_batch_header",
]

# --- header field offsets ----------------------------------------------------------------
BASE_OFFSET: Final = 0
BATCH_LENGTH: Final = 8
PARTITION_LEADER_EPOCH: Final = 12
MAGIC: Final = 16
CRC: Final = 17
ATTRIBUTES: Final = 21  # the CRC covers [ATTRIBUTES, end of batch)
LAST_OFFSET_DELTA: Final = 23
BASE_TIMESTAMP: Final = 27
MAX_TIMESTAMP: Final = 35
PRODUCER_ID: Final = 43
PRODUCER_EPOCH: Final = 51
BASE_SEQUENCE: Final = 53
RECORD_COUNT: Final = 57
RECORDS: Final = 61
HEADER_SIZE: Final = 61
LOG_OVERHEAD: Final = 12  # baseOffset + batchLength: not counted in batchLength

CURRENT_MAGIC: Final = 2
# length, attributes, timestampDelta, offsetDelta, keyLength, valueLength, headerCount
MIN_RECORD_SIZE: Final = 7

# --- attributes bits ---------------------------------------------------------------------
COMPRESSION_MASK: Final = 0x07
TIMESTAMP_TYPE_BIT: Final = 0x08  # 0 CreateTime, 1 LogAppendTime
TRANSACTIONAL_BIT: Final = 0x10
CONTROL_BIT: Final = 0x20
CREATE_TIME: Final = 0
LOG_APPEND_TIME: Final = 1

# The whole header, field order as on the wire (CRC packed as 0 then patched).
_HEADER = struct.Struct(">qiibIhiqqqhii")
_CRC = struct.Struct(">I")
_crc32c = load_crc32c()  # crc32c.crc32c, without the package's other imports
_I32 = struct.Struct(">i")
_PRODUCER_STATE = struct.Struct(">qhi")  # producerId, producerEpoch, baseSequence (43..57)

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
INT32_MIN: Final = -(2**31)

Header = tuple[str, bytes | None]
Bytes = bytes | bytearray | memoryview
WritableBuffer = bytearray | memoryview


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """How a batch is written, apart from its records: the codec (and its level) and
    the idempotent producer's fields (-1: none; the sender patches them in)."""

    compression: int = NONE
    level: int | None = None
    producer_id: int = -1
    producer_epoch: int = -1
    base_sequence: int = -1
    transactional: bool = False


PLAIN: Final = BatchSettings()
"""Uncompressed, no producer state: what workers write."""


class NewRecord(NamedTuple):
    """A record to encode; ``timestamp_ms=None`` takes the batch's base timestamp."""

    key: Bytes | None
    value: Bytes | None
    headers: Sequence[Header] = ()
    timestamp_ms: int | None = None


class Record(NamedTuple):
    """A decoded record with its absolute offset and timestamp."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[Header]


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The 61-byte header of a RecordBatch v2, field by field."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def compression(self) -> int:
        """Codec id (0 none .. 4 zstd)."""
        return self.attributes & COMPRESSION_MASK

    @property
    def timestamp_type(self) -> int:
        """0 CreateTime, 1 LogAppendTime."""
        return 1 if self.attributes & TIMESTAMP_TYPE_BIT else 0

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL_BIT)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL_BIT)

    @property
    def size(self) -> int:
        """Bytes the whole batch occupies, header included."""
        return self.batch_length + LOG_OVERHEAD

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta


@dataclass(frozen=True, slots=True)
class RecordBatch(BatchHeader):
    """A decoded batch: every header field plus its records."""

    records: list[Record]


# ---------------------------------------------------------------------------------------
# Varints: cached encodings of small values (the common case) and a checked slow path.
# ---------------------------------------------------------------------------------------

_UVARINT_CACHE_SIZE: Final = 1 << 14
# Built once per process that imports this module (the sender, every worker): under
# 128 one byte, above it u = hi << 7 | lo as the two bytes lo | 0x80, hi; 4 ms,
# against 11-19 ms calling encode_uvarint for each.
_UVARINTS: Final[tuple[bytes, ...]] = tuple(
    [bytes((u,)) for u in range(0x80)]
    + [bytes((lo | 0x80, hi)) for hi in range(1, _UVARINT_CACHE_SIZE >> 7) for lo in range(0x80)]
)


def _varint32(v: int) -> bytes:
    """Zig-zag varint of a signed int32 (lengths, offsetDelta, counts)."""
    u = (v << 1) ^ (v >> 63)
    if 0 <= u < _UVARINT_CACHE_SIZE:
        return _UVARINTS[u]
    if not INT32_MIN <= v <= INT32_MAX:
        raise EncodeError(f"varint out of int32 range: {v}")
    return encode_uvarint(((v << 1) ^ (v >> 31)) & 0xFFFFFFFF)


def _varlong(v: int) -> bytes:
    """Zig-zag varint of a signed int64 (timestampDelta)."""
    u = (v << 1) ^ (v >> 63)
    if 0 <= u < _UVARINT_CACHE_SIZE:
        return _UVARINTS[u]
    if not INT64_MIN <= v <= INT64_MAX:
        raise EncodeError(f"timestamp delta out of int64 range: {v}")
    return encode_uvarint(u & 0xFFFFFFFFFFFFFFFF)


def _varint_size(v: int) -> int:
    """Bytes a zig-zag varint of ``v`` takes."""
    u = ((v << 1) ^ (v >> 63)) & 0xFFFFFFFFFFFFFFFF
    return 1 if u < 0x80 else (u.bit_length() + 6) // 7


# ---------------------------------------------------------------------------------------
# Per-record encoding
# ---------------------------------------------------------------------------------------

_EMPTY_HEADERS: Final = b"\x00"  # headerCount 0
_ATTRIBUTES: Final = b"\x00"  # record attributes: unused, always 0
_NO_BYTES: Final = b""  # a null key/value contributes no bytes (its length is -1)
_HEADER_PLACEHOLDER: Final = bytes(HEADER_SIZE)


def _as_bytes(b: object, what: str) -> Bytes | None:
    """A key, value or header value as flat bytes by the input rule of
    :mod:`shmprod.protocol.values` (bytes-like, str as UTF-8, None); EncodeError else."""
    return as_bytes(b, what)


def _check_bytes(b: object, what: str) -> int:
    """Length in bytes of a bytes-like key/value, -1 for None."""
    mb = _as_bytes(b, what)
    return -1 if mb is None else len(mb)


def encode_headers(headers: Sequence[Header]) -> bytes:
    """The headers section of one record: count varint then each (key, value) pair.

    Encoded once and reused when every record carries the same headers.
    """
    if not headers:
        return _EMPTY_HEADERS
    parts = [_varint32(len(headers))]
    for item in headers:
        try:
            hkey, hval = item
        except (TypeError, ValueError):
            raise EncodeError(
                f"a header must be a (str, bytes | None) pair, got {item!r}"
            ) from None
        if not isinstance(hkey, str):
            raise EncodeError(f"header key must be str, got {type(hkey).__name__}")
        try:
            kb = hkey.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise EncodeError(f"header key is not encodable as UTF-8: {exc}") from None
        parts.append(_varint32(len(kb)))
        parts.append(kb)
        hv = _as_bytes(hval, "header value")
        parts.append(_varint32(-1 if hv is None else len(hv)))
        if hv:
            parts.append(bytes(hv))
    return b"".join(parts)


def _record_parts(
    offset_delta: int,
    timestamp_delta: int,
    key: Bytes | None,
    value: Bytes | None,
    headers: Sequence[Header] | bytes,
) -> tuple[bytes, Bytes, bytes, Bytes, bytes]:
    """The five pieces of a record: length..keyLength, key, valueLength, value, headers.

    A null key/value comes back as empty bytes (its -1 length is in the varints).
    """
    kb = _as_bytes(key, "key")
    vb = _as_bytes(value, "value")
    hdrs = headers if isinstance(headers, bytes) else encode_headers(headers)
    if kb is None:
        pre = _ATTRIBUTES + _varlong(timestamp_delta) + _varint32(offset_delta) + b"\x01"
        kb = _NO_BYTES
    else:
        pre = _ATTRIBUTES + _varlong(timestamp_delta) + _varint32(offset_delta) + _varint32(len(kb))
    if vb is None:
        mid = b"\x01"
        vb = _NO_BYTES
    else:
        mid = _varint32(len(vb))
    body = len(pre) + len(kb) + len(mid) + len(vb) + len(hdrs)
    if body > INT32_MAX:
        raise EncodeError(f"record of {body} bytes is too large")
    return _varint32(body) + pre, kb, mid, vb, hdrs


def record_size(
    offset_delta: int,
    timestamp_delta: int,
    key: Bytes | None,
    value: Bytes | None,
    headers: Sequence[Header] | bytes = (),
) -> int:
    """Encoded size of one record, its length varint included.

    ``headers`` may be the pre-encoded headers section (:func:`encode_headers`).
    """
    klen = _check_bytes(key, "key")
    vlen = _check_bytes(value, "value")
    hlen = len(headers) if isinstance(headers, bytes) else len(encode_headers(headers))
    body = (
        1
        + _varint_size(timestamp_delta)
        + _varint_size(offset_delta)
        + _varint_size(klen)
        + max(klen, 0)
        + _varint_size(vlen)
        + max(vlen, 0)
        + hlen
    )
    return _varint_size(body) + body


def encode_record_into(
    buf: WritableBuffer,
    offset: int,
    offset_delta: int,
    timestamp_delta: int,
    key: Bytes | None,
    value: Bytes | None,
    headers: Sequence[Header] | bytes = (),
) -> int:
    """Writes one record at ``buf[offset:]``; returns the offset just past it.

    ``headers`` may be the pre-encoded headers section (:func:`encode_headers`).
    Raises :class:`EncodeError` (and writes nothing) if the record does not fit.
    Runs in: worker.
    """
    head, kb, mid, vb, hdrs = _record_parts(offset_delta, timestamp_delta, key, value, headers)
    klen = len(kb)
    vlen = len(vb)
    end = offset + len(head) + klen + len(mid) + vlen + len(hdrs)
    if offset < 0 or end > len(buf):
        raise EncodeError(f"record of {end - offset} bytes does not fit at offset {offset}")
    p = offset + len(head)
    buf[offset:p] = head
    if klen:
        buf[p : p + klen] = kb
        p += klen
    buf[p : p + len(mid)] = mid
    p += len(mid)
    if vlen:
        buf[p : p + vlen] = vb
        p += vlen
    buf[p:end] = hdrs
    return end


def _append_record(
    out: bytearray,
    offset_delta: int,
    timestamp_delta: int,
    key: Bytes | None,
    value: Bytes | None,
    headers: Sequence[Header] | bytes,
) -> None:
    """Appends one record to a growing scratch buffer (the pre-compression path)."""
    head, kb, mid, vb, hdrs = _record_parts(offset_delta, timestamp_delta, key, value, headers)
    out += head
    out += kb
    out += mid
    out += vb
    out += hdrs


# ---------------------------------------------------------------------------------------
# Batch encoding
# ---------------------------------------------------------------------------------------


def batch_attributes(compression_codec: int, *, transactional: bool = False) -> int:
    """The attributes int16 a producer writes (CreateTime, never control)."""
    if compression_codec not in _codecs.CODEC_NAMES:
        raise CompressionError(f"unknown compression codec id {compression_codec!r}")
    return compression_codec | (TRANSACTIONAL_BIT if transactional else 0)


def _byte_view(buf: Bytes) -> memoryview:
    """A flat unsigned-byte view of any bytes-like buffer."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError as exc:
            raise DecodeError(f"buffer is not a flat byte buffer: {exc}") from None
    return mv


def batch_crc(buf: Bytes, offset: int, end: int) -> int:
    """CRC-32C of a batch's bytes from ATTRIBUTES to its end."""
    mv = _byte_view(buf)
    return int(_crc32c(mv[offset + ATTRIBUTES : end]))


def write_batch_header(
    buf: WritableBuffer,
    offset: int,
    end: int,
    *,
    record_count: int,
    base_timestamp_ms: int,
    max_timestamp_ms: int,
    settings: BatchSettings = PLAIN,
) -> None:
    """Writes the 61-byte header of the batch occupying ``buf[offset:end]``, CRC last.

    The records must already be in place (know sizes first, patch headers last); the
    attributes say ``settings.compression``, whether or not the records were compressed.
    """
    attributes = batch_attributes(settings.compression, transactional=settings.transactional)
    try:
        _HEADER.pack_into(
            buf,
            offset,
            0,  # baseOffset
            end - offset - LOG_OVERHEAD,
            -1,  # partitionLeaderEpoch
            CURRENT_MAGIC,
            0,  # crc, patched below
            attributes,
            record_count - 1,
            base_timestamp_ms,
            max_timestamp_ms,
            settings.producer_id,
            settings.producer_epoch,
            settings.base_sequence,
            record_count,
        )
    except (struct.error, TypeError) as exc:
        raise EncodeError(f"batch header field out of range: {exc}") from None
    _CRC.pack_into(buf, offset + CRC, batch_crc(buf, offset, end))


def _check_room(buf_len: int, offset: int, need: int) -> None:
    if offset < 0 or offset + need > buf_len:
        raise EncodeError(f"{need} bytes do not fit at offset {offset} of a {buf_len}-byte buffer")


def _section_parts(records: Iterable[NewRecord], base: int, parts: list[Bytes]) -> tuple[int, int]:
    """Appends every record's pieces to ``parts``; returns (count, max timestamp).

    The hot loop of the per-record encoder: cached varints, no per-record function call
    for plain bytes keys/values, one join of all pieces by the caller.
    """
    uv = _UVARINTS
    cached = _UVARINT_CACHE_SIZE
    half = cached >> 1  # non-negative values below this have a cached zig-zag varint
    add = parts.extend
    count = 0
    max_ts: int | None = None
    try:
        for key, value, headers, ts in records:
            if ts is None:
                ts = base
                tsb = b"\x00"
            else:
                delta = ts - base
                u = (delta << 1) ^ (delta >> 63)
                tsb = uv[u] if 0 <= u < cached else _varlong(delta)
            if max_ts is None or ts > max_ts:
                max_ts = ts
            if key is None:
                key = _NO_BYTES
                pre = (
                    b"\x00" + tsb + (uv[count << 1] if count < half else _varint32(count)) + b"\x01"
                )
            else:
                if type(key) is not bytes:
                    key = _as_bytes(key, "key")
                    assert key is not None
                kl = len(key)
                pre = (
                    b"\x00"
                    + tsb
                    + (uv[count << 1] if count < half else _varint32(count))
                    + (uv[kl << 1] if kl < half else _varint32(kl))
                )
            if value is None:
                value = _NO_BYTES
                mid = b"\x01"
            else:
                if type(value) is not bytes:
                    value = _as_bytes(value, "value")
                    assert value is not None
                vl = len(value)
                mid = uv[vl << 1] if vl < half else _varint32(vl)
            hdrs = _EMPTY_HEADERS if not headers else encode_headers(headers)
            body = len(pre) + len(key) + len(mid) + len(value) + len(hdrs)
            add((uv[body << 1] if body < half else _varint32(body), pre, key, mid, value, hdrs))
            count += 1
    except (TypeError, ValueError) as exc:
        raise EncodeError(
            f"record {count}: expected NewRecord(key, value, headers, timestamp_ms) with "
            f"bytes-like key/value and int timestamp: {exc}"
        ) from None
    if max_ts is None:
        raise EncodeError("a record batch needs at least one record")
    return count, max_ts


def encode_batch_into(
    buf: WritableBuffer,
    offset: int,
    records: Iterable[NewRecord],
    *,
    base_timestamp_ms: int,
    settings: BatchSettings = PLAIN,
) -> int:
    """Encodes a whole batch at ``buf[offset:]``; returns the offset just past it.

    Records without a timestamp take ``base_timestamp_ms``; timestampDelta is relative to
    it (negative deltas are fine) and maxTimestamp is the largest record timestamp.
    The records section is encoded first (one copy into ``buf``, or compressed as one
    blob straight into ``buf``), then the header, CRC last. Raises
    :class:`EncodeError` if the batch does not fit or a field is invalid.
    Runs in: worker.
    """
    parts: list[Bytes] = []
    count, max_ts = _section_parts(records, base_timestamp_ms, parts)
    return write_batch(
        buf,
        offset,
        b"".join(parts),
        record_count=count,
        base_timestamp_ms=base_timestamp_ms,
        max_timestamp_ms=max_ts,
        settings=settings,
    )


def write_batch(
    buf: WritableBuffer,
    offset: int,
    section: Bytes,
    *,
    record_count: int,
    base_timestamp_ms: int,
    max_timestamp_ms: int,
    settings: BatchSettings = PLAIN,
) -> int:
    """Writes a batch around an encoded records ``section`` at ``buf[offset:]``.

    The section goes in as is (one copy) or compressed as one blob straight into ``buf``;
    then the header, CRC last. Returns the offset just past the batch; EncodeError if it
    does not fit. Every batch encoder ends here. Runs in: worker.
    """
    mv = _byte_view(buf)
    _check_room(len(mv), offset, HEADER_SIZE)
    start = offset + RECORDS
    if settings.compression == NONE:
        _check_room(len(mv), start, len(section))
        end = start + len(section)
        mv[start:end] = section
    else:
        end = start + _compress_into(settings.compression, section, mv[start:], settings.level)
    write_batch_header(
        mv,
        offset,
        end,
        record_count=record_count,
        base_timestamp_ms=base_timestamp_ms,
        max_timestamp_ms=max_timestamp_ms,
        settings=settings,
    )
    return end


def _compress_into(codec: int, data: Bytes, out: memoryview, level: int | None) -> int:
    """Compresses a records section into ``out``; EncodeError if it does not fit."""
    if _codecs.compress_bound(codec, len(data)) > len(out):
        blob = _codecs.compress(codec, data, level)
        if len(blob) > len(out):
            raise EncodeError(f"compressed batch of {len(blob)} bytes does not fit in {len(out)}")
        out[: len(blob)] = blob
        return len(blob)
    return _codecs.compress_into(codec, data, out, level)


def encode_batch(
    records: Iterable[NewRecord],
    *,
    base_timestamp_ms: int,
    settings: BatchSettings = PLAIN,
) -> bytes:
    """Encodes a whole batch to new bytes (see :func:`encode_batch_into`)."""
    batch_attributes(settings.compression)  # an unknown codec fails before any work
    parts: list[Bytes] = [_HEADER_PLACEHOLDER]
    count, max_ts = _section_parts(records, base_timestamp_ms, parts)
    if settings.compression == NONE:
        out = bytearray().join(parts)
    else:
        section = b"".join(parts[1:])
        blob = _codecs.compress(settings.compression, section, settings.level)
        out = bytearray().join((_HEADER_PLACEHOLDER, blob))
    write_batch_header(
        out,
        0,
        len(out),
        record_count=count,
        base_timestamp_ms=base_timestamp_ms,
        max_timestamp_ms=max_ts,
        settings=settings,
    )
    return bytes(out)


def split_batch(data: Bytes, max_uncompressed: int = DEFAULT_MAX_DECOMPRESSED) -> list[bytes]:
    """Splits the producer batch ``data`` into two batches of about half its bytes each.

    For a batch the broker refused with MESSAGE_TOO_LARGE: the records (keys, values,
    headers, timestamps) and the codec are kept; each half is re-encoded (re-compressed).
    Producer id and epoch are copied; when the batch carries a base sequence ``s``, the
    halves carry ``s`` and ``s + len(first half)``, so together they take exactly the
    sequences of the original (Java's split does the same). A split happens at the record
    where the running size passes half, and always leaves at least one record per half.
    Raises :class:`DecodeError` for anything but exactly one valid batch of two or more
    records. Runs in: sender (sans-IO).
    """
    batches = decode_batches(data, max_uncompressed)
    if len(batches) != 1:
        raise DecodeError(f"expected one batch to split, found {len(batches)}")
    batch = batches[0]
    recs = batch.records
    if len(recs) < 2:
        raise DecodeError("a batch of one record cannot be split")
    sizes = [len(r.key or b"") + len(r.value or b"") + 16 for r in recs]
    half = sum(sizes) / 2
    cut, running = 1, sizes[0]
    while cut < len(recs) - 1 and running + sizes[cut] <= half:
        running += sizes[cut]
        cut += 1
    out: list[bytes] = []
    for first, part in ((0, recs[:cut]), (cut, recs[cut:])):
        sequence = batch.base_sequence
        if sequence >= 0:
            sequence = (sequence + first) % (INT32_MAX + 1)
        out.append(
            encode_batch(
                [NewRecord(r.key, r.value, r.headers, r.timestamp_ms) for r in part],
                base_timestamp_ms=part[0].timestamp_ms,
                settings=BatchSettings(
                    compression=batch.compression,
                    producer_id=batch.producer_id,
                    producer_epoch=batch.producer_epoch,
                    base_sequence=sequence,
                    transactional=batch.is_transactional,
                ),
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Patching and validation (sender side)
# ---------------------------------------------------------------------------------------


def read_batch_header(buf: Bytes, offset: int = 0) -> BatchHeader:
    """The header fields of the batch at ``buf[offset:]``; checks only that 61 bytes exist."""
    mv = _byte_view(buf)
    if offset < 0 or offset + HEADER_SIZE > len(mv):
        raise DecodeError(f"no room for a {HEADER_SIZE}-byte batch header at offset {offset}")
    try:
        return BatchHeader(*_HEADER.unpack_from(mv, offset))
    except (struct.error, TypeError, ValueError) as exc:
        raise DecodeError(f"unreadable batch header: {exc}") from None


def _framed_end(mv: memoryview, offset: int) -> int:
    """End offset of the batch at ``offset`` from its batchLength; DecodeError if bogus."""
    if offset < 0 or offset + HEADER_SIZE > len(mv):
        raise DecodeError(f"no room for a {HEADER_SIZE}-byte batch header at offset {offset}")
    length: int = _I32.unpack_from(mv, offset + BATCH_LENGTH)[0]
    if length < HEADER_SIZE - LOG_OVERHEAD:
        raise DecodeError(f"batchLength {length} is below the header size")
    end = offset + LOG_OVERHEAD + length
    if end > len(mv):
        raise DecodeError(f"batch of {length + LOG_OVERHEAD} bytes overruns the buffer")
    if mv[offset + MAGIC] != CURRENT_MAGIC:
        raise DecodeError(f"unsupported magic {mv[offset + MAGIC]}")
    return end


def patch_producer_state(
    buf: WritableBuffer,
    offset: int,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
) -> None:
    """Rewrites producerId/epoch/baseSequence of an encoded batch in place, then its CRC.

    The sender assigns sequences at drain time; this is the only rewrite it needs. The
    CRC is updated from the changed bytes alone (:mod:`shmprod.protocol.crc`): the batch
    is not read again, and a batch whose CRC did not match its bytes still does not.
    Raises DecodeError if ``buf[offset:]`` is not a framed v2 batch, EncodeError if a
    value is out of range. Runs in: sender.
    """
    mv = _byte_view(buf)
    if mv.readonly:
        raise EncodeError("cannot patch a read-only buffer")
    end = _framed_end(mv, offset)
    try:
        new = _PRODUCER_STATE.pack(producer_id, producer_epoch, base_sequence)
    except (struct.error, TypeError) as exc:
        raise EncodeError(f"producer state out of range: {exc}") from None
    at = offset + PRODUCER_ID
    stop = at + _PRODUCER_STATE.size
    old = int.from_bytes(mv[at:stop], "big")
    delta = (old ^ int.from_bytes(new, "big")).to_bytes(_PRODUCER_STATE.size, "big")
    (crc,) = _CRC.unpack_from(mv, offset + CRC)
    mv[at:stop] = new
    _CRC.pack_into(mv, offset + CRC, _crc.patched(crc, delta, end - stop))


def validate_batch(
    buf: Bytes, offset: int, length: int, *, strict: bool = True, check_crc: bool = True
) -> BatchHeader:
    """Checks the framing and CRC of the batch at ``buf[offset:offset+length]``.

    Does not decode records: the sender runs it on bytes read back from shared memory.
    Checks batchLength == length - 12, magic 2, the CRC, a known codec, recordCount >= 0,
    lastOffsetDelta, and that an uncompressed records section can hold recordCount
    records. ``strict`` (producer batches) also requires recordCount >= 1 and
    lastOffsetDelta == recordCount - 1; non-strict allows compacted batches. Without
    ``check_crc`` only the header is read (the CRC is checked later, before the send).
    Returns the header; raises :class:`DecodeError` on any mismatch. Runs in: sender.
    """
    mv = _byte_view(buf)
    if length < HEADER_SIZE:
        raise DecodeError(f"a batch of {length} bytes is shorter than its header")
    if offset < 0 or offset + length > len(mv):
        raise DecodeError(f"batch [{offset}, {offset + length}) outside a {len(mv)}-byte buffer")
    hdr = read_batch_header(mv, offset)
    if hdr.batch_length != length - LOG_OVERHEAD:
        raise DecodeError(f"batchLength {hdr.batch_length} != {length - LOG_OVERHEAD}")
    if hdr.magic != CURRENT_MAGIC:
        raise DecodeError(f"unsupported magic {hdr.magic}")
    crc = batch_crc(mv, offset, offset + length) if check_crc else hdr.crc
    if crc != hdr.crc:
        raise DecodeError(f"CRC mismatch: header says {hdr.crc:#010x}, bytes give {crc:#010x}")
    _check_counts(hdr, length - HEADER_SIZE, strict)
    return hdr


def _check_counts(hdr: BatchHeader, records_len: int, strict: bool) -> None:
    """Sanity of codec, recordCount and lastOffsetDelta against each other."""
    codec = hdr.compression
    if codec not in _codecs.CODEC_NAMES:
        raise CompressionError(f"unknown compression codec id {codec}")
    count = hdr.record_count
    if count < 0:
        raise DecodeError(f"negative recordCount {count}")
    if strict:
        if count == 0:
            raise DecodeError("empty record batch")
        if hdr.last_offset_delta != count - 1:
            raise DecodeError(f"lastOffsetDelta {hdr.last_offset_delta} != recordCount - 1")
    elif hdr.last_offset_delta < count - 1:
        raise DecodeError(f"lastOffsetDelta {hdr.last_offset_delta} < recordCount - 1")
    if codec == NONE and count > records_len // MIN_RECORD_SIZE:
        raise DecodeError(f"{count} records cannot fit in {records_len} bytes")


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


def decode_batches(
    data: Bytes,
    max_uncompressed: int = DEFAULT_MAX_DECOMPRESSED,
    *,
    strict: bool = True,
    allow_truncated_tail: bool = False,
) -> list[RecordBatch]:
    """Decodes consecutive RecordBatch v2 (see :func:`iter_batches`)."""
    return list(
        iter_batches(
            data, max_uncompressed, strict=strict, allow_truncated_tail=allow_truncated_tail
        )
    )


def iter_batches(
    data: Bytes,
    max_uncompressed: int = DEFAULT_MAX_DECOMPRESSED,
    *,
    strict: bool = True,
    allow_truncated_tail: bool = False,
) -> Iterator[RecordBatch]:
    """Yields each batch of ``data`` with its records decoded.

    Verifies magic, CRC, batchLength, recordCount, every varint and length, and the
    offsetDelta sequence (``strict``: exactly 0..count-1 as a producer writes; otherwise
    strictly increasing and at most lastOffsetDelta, as in compacted logs). A compressed
    records section may not decompress beyond ``max_uncompressed`` bytes. A fetch
    response may end in a partial batch: ``allow_truncated_tail`` skips it instead of
    raising. Raises only :class:`DecodeError` / :class:`CompressionError`.
    """
    mv = _byte_view(data)
    pos = 0
    end = len(mv)
    while pos < end:
        if end - pos < LOG_OVERHEAD:
            if allow_truncated_tail:
                return
            raise DecodeError(f"{end - pos} trailing bytes are not a batch")
        (length,) = _I32.unpack_from(mv, pos + BATCH_LENGTH)
        if length < HEADER_SIZE - LOG_OVERHEAD:
            raise DecodeError(f"batchLength {length} is below the header size")
        size = length + LOG_OVERHEAD
        if pos + size > end:
            if allow_truncated_tail:
                return
            raise DecodeError(f"batch of {size} bytes overruns the {end - pos} bytes left")
        yield _decode_batch(mv, pos, size, max_uncompressed, strict)
        pos += size


def _decode_batch(
    mv: memoryview, offset: int, size: int, max_uncompressed: int, strict: bool
) -> RecordBatch:
    """Validates and decodes the batch at ``mv[offset:offset+size]``."""
    hdr = validate_batch(mv, offset, size, strict=strict)
    section: Bytes = mv[offset + RECORDS : offset + size]
    if hdr.compression != NONE:
        section = _codecs.decompress(hdr.compression, section, max_uncompressed)
        if hdr.record_count > len(section) // MIN_RECORD_SIZE:
            raise DecodeError(f"{hdr.record_count} records cannot fit in {len(section)} bytes")
    records = _decode_records(section, hdr, strict)
    return RecordBatch(
        hdr.base_offset,
        hdr.batch_length,
        hdr.partition_leader_epoch,
        hdr.magic,
        hdr.crc,
        hdr.attributes,
        hdr.last_offset_delta,
        hdr.base_timestamp,
        hdr.max_timestamp,
        hdr.producer_id,
        hdr.producer_epoch,
        hdr.base_sequence,
        hdr.record_count,
        records,
    )


def _read_nullable(r: Reader, what: str) -> bytes | None:
    """A varint-length-prefixed byte string; -1 is null."""
    n = r.varint()
    if n < 0:
        if n != -1:
            raise DecodeError(f"invalid {what} length {n}")
        return None
    return r.raw(n)


def _read_header(r: Reader) -> Header:
    n = r.varint()
    if n < 0:
        raise DecodeError(f"invalid header key length {n}")
    raw = r.view(n)
    try:
        hkey = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"header key is not UTF-8: {exc.reason}") from None
    return hkey, _read_nullable(r, "header value")


def _decode_records(section: Bytes, hdr: BatchHeader, strict: bool) -> list[Record]:
    """Parses exactly ``hdr.record_count`` records filling the whole ``section``."""
    r = Reader(section)
    log_append = hdr.timestamp_type == LOG_APPEND_TIME
    base_ts = hdr.base_timestamp
    base_offset = hdr.base_offset
    prev_delta = -1
    records: list[Record] = []
    for i in range(hdr.record_count):
        length = r.varint()
        if length < MIN_RECORD_SIZE - 1 or length > r.remaining:
            raise DecodeError(f"record {i}: length {length} with {r.remaining} bytes left")
        rec_end = r.pos + length
        r.int8()  # record attributes: unused
        ts_delta = r.varlong()
        offset_delta = r.varint()
        if strict:
            if offset_delta != i:
                raise DecodeError(f"record {i}: offsetDelta {offset_delta}, expected {i}")
        elif not prev_delta < offset_delta <= hdr.last_offset_delta:
            raise DecodeError(f"record {i}: offsetDelta {offset_delta} out of sequence")
        prev_delta = offset_delta
        key = _read_nullable(r, "key")
        value = _read_nullable(r, "value")
        n_headers = r.varint()
        if n_headers < 0 or n_headers > (rec_end - r.pos) // 2:
            raise DecodeError(f"record {i}: invalid header count {n_headers}")
        headers = [_read_header(r) for _ in range(n_headers)]
        if r.pos != rec_end:
            raise DecodeError(f"record {i}: length {length} disagrees with its fields")
        ts = hdr.max_timestamp if log_append else base_ts + ts_delta
        records.append(Record(base_offset + offset_delta, ts, key, value, headers))
    if r.remaining:
        raise DecodeError(f"{r.remaining} bytes after the last of {hdr.record_count} records")
    return records
