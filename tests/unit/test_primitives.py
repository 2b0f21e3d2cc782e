"""Kafka primitive types: Hypothesis round trips, known vectors, malformed input."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.errors import DecodeError, EncodeError
from shmprod.protocol import primitives as p
from shmprod.protocol.primitives import Reader

I8 = (-(2**7), 2**7 - 1)
I16 = (-(2**15), 2**15 - 1)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


def ints(bounds: tuple[int, int]) -> st.SearchStrategy[int]:
    """Integers in ``bounds``, with the boundaries and their neighbours drawn often."""
    lo, hi = bounds
    edges = [e for e in (lo, lo + 1, -1, 0, 1, hi - 1, hi) if lo <= e <= hi]
    return st.sampled_from(edges) | st.integers(lo, hi)


short_text = st.text(max_size=40)
short_bytes = st.binary(max_size=40)

# (name, append into a bytearray, read from a Reader, values)
CODECS: list[tuple[str, Callable[[bytearray, Any], None], Callable[[Reader], Any], Any]] = [
    ("int8", p.append_int8, Reader.int8, ints(I8)),
    ("bool", p.append_bool, Reader.bool, st.booleans()),
    ("int16", p.append_int16, Reader.int16, ints(I16)),
    ("int32", p.append_int32, Reader.int32, ints(I32)),
    ("uint32", p.append_uint32, Reader.uint32, ints((0, 2**32 - 1))),
    ("int64", p.append_int64, Reader.int64, ints(I64)),
    ("float64", p.append_float64, Reader.float64, st.floats(allow_nan=False)),
    ("uuid", p.append_uuid, Reader.uuid, st.uuids()),
    ("uvarint", p.append_uvarint, Reader.uvarint, ints((0, 2**64 - 1))),
    ("uvarint32", p.append_uvarint, Reader.uvarint32, ints((0, 2**32 - 1))),
    ("varint", p.append_varint, Reader.varint, ints(I32)),
    ("varlong", p.append_varlong, Reader.varlong, ints(I64)),
    ("string", p.append_string, Reader.string, short_text),
    ("nullable_string", p.append_nullable_string, Reader.nullable_string, st.none() | short_text),
    ("compact_string", p.append_compact_string, Reader.compact_string, short_text),
    (
        "compact_nullable_string",
        p.append_compact_nullable_string,
        Reader.compact_nullable_string,
        st.none() | short_text,
    ),
    ("bytes", p.append_bytes, Reader.bytes_, short_bytes),
    ("nullable_bytes", p.append_nullable_bytes, Reader.nullable_bytes, st.none() | short_bytes),
    ("compact_bytes", p.append_compact_bytes, Reader.compact_bytes, short_bytes),
    (
        "compact_nullable_bytes",
        p.append_compact_nullable_bytes,
        Reader.compact_nullable_bytes,
        st.none() | short_bytes,
    ),
    (
        "tagged_fields",
        p.append_tagged_fields,
        Reader.tagged_fields,
        st.dictionaries(ints((0, 2**32 - 1)), short_bytes, max_size=5),
    ),
]


@pytest.mark.parametrize(("name", "append", "read", "values"), CODECS, ids=[c[0] for c in CODECS])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(
    name: str,
    append: Callable[[bytearray, Any], None],
    read: Callable[[Reader], Any],
    values: st.SearchStrategy[Any],
    data: st.DataObject,
) -> None:
    """encode -> decode gives the value back and consumes exactly what was written,
    also when the value sits between other bytes."""
    value = data.draw(values)
    prefix = data.draw(st.binary(max_size=3))
    out = bytearray(prefix)
    append(out, value)
    end = len(out)
    out += b"\x99"
    r = Reader(out, len(prefix), end)
    assert read(r) == value
    r.expect_end()


@pytest.mark.parametrize(("name", "append", "read", "values"), CODECS, ids=[c[0] for c in CODECS])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_truncated_encoding_raises_decode_error(
    name: str,
    append: Callable[[bytearray, Any], None],
    read: Callable[[Reader], Any],
    values: st.SearchStrategy[Any],
    data: st.DataObject,
) -> None:
    """Every strict prefix of an encoding is rejected with DecodeError."""
    out = bytearray()
    append(out, data.draw(values))
    cut = data.draw(st.integers(0, len(out) - 1))
    with pytest.raises(DecodeError):
        read(Reader(bytes(out[:cut])))


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (-1, "01"),
        (1, "02"),
        (-2, "03"),
        (63, "7e"),
        (-64, "7f"),
        (64, "8001"),
        (300, "d804"),
        (2**31 - 1, "feffffff0f"),
        (-(2**31), "ffffffff0f"),
    ],
)
def test_varint_known_vectors(value: int, encoded: str) -> None:
    """Zig-zag then LEB128, as in the Kafka record format."""
    assert p.encode_varint(value).hex() == encoded
    assert Reader(bytes.fromhex(encoded)).varint() == value
    assert p.varint_size(value) == len(encoded) // 2


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (-1, "01"),
        (300, "d804"),
        (2**63 - 1, "feffffffffffffffff01"),
        (-(2**63), "ffffffffffffffffff01"),
    ],
)
def test_varlong_known_vectors(value: int, encoded: str) -> None:
    assert p.encode_varlong(value).hex() == encoded
    assert Reader(bytes.fromhex(encoded)).varlong() == value


@pytest.mark.parametrize(
    ("value", "encoded"),
    [(0, "00"), (1, "01"), (127, "7f"), (128, "8001"), (300, "ac02"), (16384, "808001")],
)
def test_uvarint_known_vectors(value: int, encoded: str) -> None:
    assert p.encode_uvarint(value).hex() == encoded
    assert Reader(bytes.fromhex(encoded)).uvarint() == value


def test_fixed_width_known_vectors() -> None:
    out = bytearray()
    p.append_int8(out, -2)
    p.append_int16(out, 0x1234)
    p.append_int32(out, -2)
    p.append_uint32(out, 0xDEADBEEF)
    p.append_int64(out, 1)
    p.append_bool(out, True)
    assert out == bytes.fromhex("fe 1234 fffffffe deadbeef 0000000000000001 01")


def test_string_and_bytes_known_vectors() -> None:
    out = bytearray()
    p.append_string(out, "ab")
    p.append_nullable_string(out, None)
    p.append_compact_string(out, "ab")
    p.append_compact_nullable_string(out, None)
    p.append_bytes(out, b"\x01")
    p.append_nullable_bytes(out, None)
    p.append_compact_bytes(out, b"")
    p.append_compact_nullable_bytes(out, None)
    assert out == bytes.fromhex("0002 6162 ffff 03 6162 00 00000001 01 ffffffff 01 00")


def test_utf8_is_counted_in_bytes() -> None:
    out = bytearray()
    p.append_compact_string(out, "é")
    assert out.hex() == "03c3a9"


def test_tagged_fields_known_vector_and_order() -> None:
    out = bytearray()
    p.append_tagged_fields(out, {5: b"\xaa", 0: b""})
    assert out == bytes.fromhex("02 00 00 05 01 aa")
    assert Reader(bytes(out)).tagged_fields() == {0: b"", 5: b"\xaa"}
    empty = bytearray()
    p.append_empty_tagged_fields(empty)
    assert empty == b"\x00"
    with pytest.raises(DecodeError):
        Reader(bytes.fromhex("02 05 01 aa 00 00")).tagged_fields()  # descending tags


@settings(max_examples=60, deadline=None)
@given(
    items=st.none() | st.lists(ints(I32), max_size=20),
    compact=st.booleans(),
)
def test_array_round_trip(items: list[int] | None, compact: bool) -> None:
    out = bytearray()
    p.append_array_len(out, None if items is None else len(items), compact=compact)
    for v in items or []:
        p.append_int32(out, v)
    assert Reader(bytes(out)).nullable_array(Reader.int32, compact=compact) == items
    r = Reader(bytes(out))
    assert r.array(Reader.int32, compact=compact) == (items or [])
    r.expect_end()


def test_array_length_known_vectors() -> None:
    out = bytearray()
    p.append_array_len(out, 2, compact=False)
    p.append_array_len(out, None, compact=False)
    p.append_array_len(out, 2, compact=True)
    p.append_array_len(out, None, compact=True)
    assert out == bytes.fromhex("00000002 ffffffff 03 00")


def test_uuid_known_vector() -> None:
    u = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
    out = bytearray()
    p.append_uuid(out, u)
    assert out.hex() == "00112233445566778899aabbccddeeff"
    assert Reader(bytes(out)).uuid() == u


@pytest.mark.parametrize(
    ("append", "value"),
    [
        (p.append_int8, 128),
        (p.append_int8, -129),
        (p.append_int16, 2**15),
        (p.append_int32, 2**31),
        (p.append_int32, -(2**31) - 1),
        (p.append_uint32, -1),
        (p.append_uint32, 2**32),
        (p.append_int64, 2**63),
        (p.append_int32, True),
        (p.append_int32, "1"),
        (p.append_varint, 2**31),
        (p.append_varlong, -(2**63) - 1),
        (p.append_uvarint, -1),
        (p.append_string, "x" * 2**15),
        (p.append_string, "\ud800"),
    ],
)
def test_out_of_range_values_raise_encode_error(append: Callable[..., None], value: Any) -> None:
    with pytest.raises(EncodeError):
        append(bytearray(), value)


def test_longest_int16_string_is_accepted() -> None:
    out = bytearray()
    p.append_string(out, "x" * (2**15 - 1))
    assert Reader(bytes(out)).string() == "x" * (2**15 - 1)


@pytest.mark.parametrize(
    ("read", "data"),
    [
        (Reader.uvarint32, "ffffffff1f"),  # 5 bytes but above 2**32 - 1
        (Reader.uvarint32, "8080808080"),  # 5 bytes, continuation never ends
        (Reader.varint, "ffffffffff01"),  # 6 bytes
        (Reader.uvarint, "ffffffffffffffffff02"),  # above 2**64 - 1
        (Reader.uvarint, "80808080808080808080"),  # 10 continuation bytes
        (Reader.string, "ffff"),  # null where not nullable
        (Reader.nullable_string, "fffe"),  # -2 is no valid length
        (Reader.nullable_bytes, "fffffffe"),
        (Reader.bytes_, "ffffffff"),
        (Reader.compact_string, "00"),
        (Reader.compact_bytes, "00"),
        (Reader.string, "0002c328"),  # invalid UTF-8
        (Reader.compact_nullable_string, "03ffff"),
        (Reader.tagged_fields, "05"),  # more fields than bytes
        (Reader.tagged_fields, "01 00 05 aa"),  # value shorter than its size
    ],
)
def test_malformed_input_raises_decode_error(read: Callable[[Reader], Any], data: str) -> None:
    with pytest.raises(DecodeError):
        read(Reader(bytes.fromhex(data)))


@pytest.mark.parametrize("compact", [False, True])
def test_array_length_beyond_input_is_rejected(compact: bool) -> None:
    """A hostile element count fails before anything is allocated."""
    out = bytearray()
    p.append_array_len(out, 1_000_000, compact=compact)
    with pytest.raises(DecodeError):
        Reader(bytes(out)).array(Reader.int8, compact=compact)
    bad = b"\xff\xff\xff\xfe" if not compact else b""
    if bad:
        with pytest.raises(DecodeError):
            Reader(bad).array_len(compact=False)


def test_reader_bounds_and_trailing_bytes() -> None:
    with pytest.raises(DecodeError):
        Reader(b"abc", 4)
    with pytest.raises(DecodeError):
        Reader(b"abc", 0, 4)
    r = Reader(b"\x00\x01\x02", 1, 2)
    assert r.remaining == 1
    with pytest.raises(DecodeError):
        r.int16()
    assert r.int8() == 1
    r.expect_end()
    with pytest.raises(DecodeError):
        Reader(b"\x00\x00").expect_end()
    with pytest.raises(DecodeError):
        Reader(b"ab").raw(3)
    with pytest.raises(DecodeError):
        Reader(b"ab").view(-1)


def test_reader_views_do_not_copy() -> None:
    data = bytearray(b"abcdef")
    view = Reader(data, 1).view(3)
    data[2] = ord("X")
    assert bytes(view) == b"bXd"


@settings(max_examples=100, deadline=None)
@given(v=ints(I64))
def test_zigzag_is_a_bijection(v: int) -> None:
    assert p.unzigzag(p.zigzag64(v)) == v
    if I32[0] <= v <= I32[1]:
        assert p.zigzag32(v) == p.zigzag64(v)
        assert p.unzigzag(p.zigzag32(v)) == v
    assert p.varint_size(v) == len(p.encode_varlong(v))
