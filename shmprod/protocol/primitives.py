"""Kafka protocol primitive types.

Encoding appends to a caller-owned ``bytearray`` (franz-go style ``append``) or packs
into a caller-owned buffer at an offset (``*_into``: returns the new offset).
Decoding goes through :class:`Reader`, which raises :class:`DecodeError` for every
malformed input and never any other exception.
"""

from __future__ import annotations

import builtins
import struct
import uuid
from collections.abc import Callable
from typing import TypeVar

from shmprod.errors import DecodeError, EncodeError

T = TypeVar("T")

_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")

INT16_MAX = 2**15 - 1
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# A decoded array or string may not claim more elements than this; bounds a hostile length.
MAX_ARRAY_LEN = 1 << 24


# ---------------------------------------------------------------------------
# varints (zig-zag signed, and unsigned LEB128)
# ---------------------------------------------------------------------------


def zigzag32(v: int) -> int:
    return ((v << 1) ^ (v >> 31)) & 0xFFFFFFFF


def zigzag64(v: int) -> int:
    return ((v << 1) ^ (v >> 63)) & 0xFFFFFFFFFFFFFFFF


def unzigzag(u: int) -> int:
    return (u >> 1) ^ -(u & 1)


def encode_uvarint(u: int) -> bytes:
    """Unsigned LEB128 of a non-negative int."""
    if u < 0:
        raise EncodeError(f"unsigned varint of negative value {u}")
    if u < 0x80:
        return bytes((u,))
    out = bytearray()
    while u >= 0x80:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def encode_varint(v: int) -> bytes:
    """Zig-zag varint of a signed 32-bit int."""
    if not -(2**31) <= v < 2**31:
        raise EncodeError(f"varint out of int32 range: {v}")
    return encode_uvarint(zigzag32(v))


def encode_varlong(v: int) -> bytes:
    """Zig-zag varint of a signed 64-bit int."""
    if not -(2**63) <= v < 2**63:
        raise EncodeError(f"varlong out of int64 range: {v}")
    return encode_uvarint(zigzag64(v))


def varint_size(v: int) -> int:
    """Encoded size of a zig-zag varint/varlong."""
    u = zigzag64(v)
    n = 1
    while u >= 0x80:
        u >>= 7
        n += 1
    return n


# ---------------------------------------------------------------------------
# Encoding (append to a bytearray)
# ---------------------------------------------------------------------------


def _check(lo: int, hi: int, v: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise EncodeError(f"{what} out of range: {v!r}")
    return v


def append_int8(out: bytearray, v: int) -> None:
    out += _I8.pack(_check(-128, 127, v, "int8"))


def append_bool(out: bytearray, v: bool) -> None:
    out.append(1 if v else 0)


def append_int16(out: bytearray, v: int) -> None:
    out += _I16.pack(_check(-(2**15), 2**15 - 1, v, "int16"))


def append_int32(out: bytearray, v: int) -> None:
    out += _I32.pack(_check(-(2**31), INT32_MAX, v, "int32"))


def append_uint32(out: bytearray, v: int) -> None:
    out += _U32.pack(_check(0, 2**32 - 1, v, "uint32"))


def append_int64(out: bytearray, v: int) -> None:
    out += _I64.pack(_check(-(2**63), INT64_MAX, v, "int64"))


def append_float64(out: bytearray, v: float) -> None:
    out += _F64.pack(v)


def append_uuid(out: bytearray, v: uuid.UUID) -> None:
    out += v.bytes


def append_uvarint(out: bytearray, u: int) -> None:
    out += encode_uvarint(u)


def append_varint(out: bytearray, v: int) -> None:
    out += encode_varint(v)


def append_varlong(out: bytearray, v: int) -> None:
    out += encode_varlong(v)


def _utf8(s: str) -> bytes:
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EncodeError(f"string is not encodable as UTF-8: {exc}") from None


def append_string(out: bytearray, s: str) -> None:
    b = _utf8(s)
    if len(b) > 2**15 - 1:
        raise EncodeError(f"string too long for int16 length: {len(b)} bytes")
    out += _I16.pack(len(b))
    out += b


def append_nullable_string(out: bytearray, s: str | None) -> None:
    if s is None:
        out += _I16.pack(-1)
    else:
        append_string(out, s)


def append_compact_string(out: bytearray, s: str) -> None:
    b = _utf8(s)
    out += encode_uvarint(len(b) + 1)
    out += b


def append_compact_nullable_string(out: bytearray, s: str | None) -> None:
    if s is None:
        out += b"\x00"
    else:
        append_compact_string(out, s)


def append_bytes(out: bytearray, b: bytes | bytearray | memoryview) -> None:
    out += _I32.pack(len(b))
    out += b


def append_nullable_bytes(out: bytearray, b: bytes | bytearray | memoryview | None) -> None:
    if b is None:
        out += _I32.pack(-1)
    else:
        append_bytes(out, b)


def append_compact_bytes(out: bytearray, b: bytes | bytearray | memoryview) -> None:
    out += encode_uvarint(len(b) + 1)
    out += b


def append_compact_nullable_bytes(out: bytearray, b: bytes | bytearray | memoryview | None) -> None:
    if b is None:
        out += b"\x00"
    else:
        append_compact_bytes(out, b)


def append_array_len(out: bytearray, n: int | None, *, compact: bool) -> None:
    """Array length prefix; ``None`` is a null array."""
    if compact:
        out += encode_uvarint(0 if n is None else n + 1)
    else:
        out += _I32.pack(-1 if n is None else n)


def append_empty_tagged_fields(out: bytearray) -> None:
    out.append(0)


def append_tagged_fields(out: bytearray, fields: dict[int, bytes]) -> None:
    """Tagged fields in ascending tag order; values are already-encoded bytes."""
    out += encode_uvarint(len(fields))
    for tag in sorted(fields):
        out += encode_uvarint(tag)
        out += encode_uvarint(len(fields[tag]))
        out += fields[tag]


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


class Reader:
    """A bounds-checked cursor over bytes. Every failure is a :class:`DecodeError`."""

    __slots__ = ("_buf", "_end", "pos")

    def __init__(
        self, data: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None
    ) -> None:
        self._buf = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self.pos = pos
        self._end = len(self._buf) if end is None else end
        if not 0 <= pos <= self._end <= len(self._buf):
            raise DecodeError(
                f"reader bounds out of range: pos={pos} end={end} len={len(self._buf)}"
            )

    @property
    def remaining(self) -> int:
        return self._end - self.pos

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self._end:
            raise DecodeError(f"need {n} bytes at offset {self.pos}, have {self._end - self.pos}")
        view = self._buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def _unpack(self, s: struct.Struct) -> int:
        if self.pos + s.size > self._end:
            raise DecodeError(
                f"need {s.size} bytes at offset {self.pos}, have {self._end - self.pos}"
            )
        v: int = s.unpack_from(self._buf, self.pos)[0]
        self.pos += s.size
        return v

    def int8(self) -> int:
        return self._unpack(_I8)

    def bool(self) -> bool:
        return self._unpack(_I8) != 0

    def int16(self) -> int:
        return self._unpack(_I16)

    def int32(self) -> int:
        return self._unpack(_I32)

    def uint32(self) -> int:
        return self._unpack(_U32)

    def int64(self) -> int:
        return self._unpack(_I64)

    def float64(self) -> float:
        if self.pos + 8 > self._end:
            raise DecodeError(f"need 8 bytes at offset {self.pos}, have {self._end - self.pos}")
        v: float = _F64.unpack_from(self._buf, self.pos)[0]
        self.pos += 8
        return v

    def uuid(self) -> uuid.UUID:
        return uuid.UUID(bytes=bytes(self._take(16)))

    def uvarint(self, max_bytes: int = 10) -> int:
        result = 0
        shift = 0
        buf = self._buf
        for i in range(max_bytes):
            if self.pos >= self._end:
                raise DecodeError("truncated varint")
            b = buf[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                if i == max_bytes - 1 and b > (0x0F if max_bytes == 5 else 0x01):
                    raise DecodeError("varint overflows its type")
                return result
            shift += 7
        raise DecodeError(f"varint longer than {max_bytes} bytes")

    def uvarint32(self) -> int:
        return self.uvarint(5)

    def varint(self) -> int:
        return unzigzag(self.uvarint(5))

    def varlong(self) -> int:
        return unzigzag(self.uvarint(10))

    def raw(self, n: int) -> bytes:
        return bytes(self._take(n))

    def view(self, n: int) -> memoryview:
        return self._take(n)

    def _decode_utf8(self, b: memoryview) -> str:
        try:
            return str(b, "utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError(f"invalid UTF-8 in string: {exc.reason}") from None

    def string(self) -> str:
        n = self.int16()
        if n < 0:
            raise DecodeError(f"negative length {n} for non-nullable string")
        return self._decode_utf8(self._take(n))

    def nullable_string(self) -> str | None:
        n = self.int16()
        if n < 0:
            if n != -1:
                raise DecodeError(f"invalid string length {n}")
            return None
        return self._decode_utf8(self._take(n))

    def compact_string(self) -> str:
        n = self.uvarint32()
        if n == 0:
            raise DecodeError("null compact string where a string is required")
        return self._decode_utf8(self._take(n - 1))

    def compact_nullable_string(self) -> str | None:
        n = self.uvarint32()
        if n == 0:
            return None
        return self._decode_utf8(self._take(n - 1))

    def bytes_(self) -> bytes:
        n = self.int32()
        if n < 0:
            raise DecodeError(f"negative length {n} for non-nullable bytes")
        return bytes(self._take(n))

    def nullable_bytes(self) -> bytes | None:
        n = self.int32()
        if n < 0:
            if n != -1:
                raise DecodeError(f"invalid bytes length {n}")
            return None
        return bytes(self._take(n))

    def compact_bytes(self) -> bytes:
        n = self.uvarint32()
        if n == 0:
            raise DecodeError("null compact bytes where bytes are required")
        return bytes(self._take(n - 1))

    def compact_nullable_bytes(self) -> bytes | None:
        n = self.uvarint32()
        if n == 0:
            return None
        return bytes(self._take(n - 1))

    def array_len(self, *, compact: builtins.bool) -> int | None:
        """Element count of an array, or ``None`` for a null array."""
        if compact:
            n = self.uvarint32()
            if n == 0:
                return None
            n -= 1
        else:
            n = self.int32()
            if n < 0:
                if n != -1:
                    raise DecodeError(f"invalid array length {n}")
                return None
        # Every element takes at least one byte: a longer claim is malformed.
        if n > MAX_ARRAY_LEN or n > self.remaining:
            raise DecodeError(f"array length {n} exceeds the {self.remaining} bytes left")
        return n

    def array(self, item: Callable[[Reader], T], *, compact: builtins.bool) -> list[T]:
        n = self.array_len(compact=compact)
        return [] if n is None else [item(self) for _ in range(n)]

    def nullable_array(
        self, item: Callable[[Reader], T], *, compact: builtins.bool
    ) -> list[T] | None:
        n = self.array_len(compact=compact)
        return None if n is None else [item(self) for _ in range(n)]

    def tagged_fields(self) -> dict[int, bytes]:
        """Reads a tagged-field section; returns raw values by tag."""
        n = self.uvarint32()
        if n > self.remaining:
            raise DecodeError(f"{n} tagged fields exceed the {self.remaining} bytes left")
        fields: dict[int, bytes] = {}
        last = -1
        for _ in range(n):
            tag = self.uvarint32()
            if tag <= last:
                raise DecodeError(f"tagged fields out of order: {tag} after {last}")
            last = tag
            size = self.uvarint32()
            fields[tag] = self.raw(size)
        return fields

    def expect_end(self) -> None:
        if self.pos != self._end:
            raise DecodeError(f"{self._end - self.pos} trailing bytes")
