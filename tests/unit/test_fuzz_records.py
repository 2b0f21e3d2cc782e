"""Fuzzing the batch decoder and validator (h11's rule: accepted, or DecodeError /
CompressionError -- never another exception, never a hang, never a huge allocation).

Seeded and bounded: random bytes, and valid batches mutated by bit flips, truncation,
length and count corruption, varint garbage, and corrupted compressed blobs -- many with
the CRC recomputed afterwards so the mutation reaches the record parser and the
decompressors instead of stopping at the CRC check.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from collections.abc import Callable
from contextlib import suppress

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.errors import CompressionError, DecodeError, EncodeError
from shmprod.protocol import compression as C
from shmprod.protocol import records as R

SEED = 0x5EED
LIMIT = 1 << 20  # max_uncompressed for every decode here
EXPECTED = (DecodeError, CompressionError)
pytestmark = pytest.mark.timeout(60)


def _fix_crc(data: bytearray) -> bytearray:
    """Recomputes the CRC of the batch at offset 0 so a mutation gets past it."""
    if len(data) >= R.HEADER_SIZE:
        struct.pack_into(">I", data, R.CRC, crc32c.crc32c(bytes(data[R.ATTRIBUTES :])))
    return data


def _seed_batches() -> list[bytes]:
    """Valid batches of every codec and shape the decoder must handle."""
    rnd = random.Random(SEED)
    out = []
    for codec in (C.NONE, C.GZIP, C.SNAPPY, C.LZ4, C.ZSTD):
        for n in (1, 3, 70):
            recs = []
            for i in range(n):
                key = None if i % 3 == 0 else rnd.randbytes(rnd.randrange(0, 12))
                value = None if i % 5 == 4 else rnd.randbytes(rnd.randrange(0, 60)) * 2
                hdrs = [("k\u00e9", rnd.randbytes(3)), ("n", None)][: i % 3]
                recs.append(R.NewRecord(key, value, hdrs, 1000 + rnd.randrange(-50, 50)))
            out.append(
                R.encode_batch(recs, base_timestamp_ms=1000, settings=R.BatchSettings(codec))
            )
    return out


SEEDS = _seed_batches()


def check(data: bytes | bytearray) -> None:
    """The property: every entry point accepts ``data`` or raises an expected error."""
    for strict in (True, False):
        with suppress(*EXPECTED):
            R.decode_batches(data, LIMIT, strict=strict, allow_truncated_tail=not strict)
    with suppress(*EXPECTED):
        R.validate_batch(data, 0, len(data))
    with suppress(*EXPECTED):
        R.read_batch_header(data, 0)
    with suppress(DecodeError, EncodeError):
        R.patch_producer_state(bytearray(data), 0, 1, 2, 3)
    with suppress(*EXPECTED, EncodeError):
        R.split_batch(data, LIMIT)


# --- mutators ----------------------------------------------------------------------------


def flip_bits(rnd: random.Random, data: bytes) -> bytearray:
    out = bytearray(data)
    for _ in range(rnd.randrange(1, 9)):
        i = rnd.randrange(len(out))
        out[i] ^= 1 << rnd.randrange(8)
    return out


def truncate(rnd: random.Random, data: bytes) -> bytearray:
    return bytearray(data[: rnd.randrange(len(data))])


def splice(rnd: random.Random, data: bytes) -> bytearray:
    out = bytearray(data)
    i = rnd.randrange(len(out) + 1)
    if rnd.random() < 0.5:
        out[i:i] = rnd.randbytes(rnd.randrange(1, 20))
    else:
        del out[i : i + rnd.randrange(1, 20)]
    return out


INT32_EDGES = [-(2**31), -2, -1, 0, 1, 48, 49, 60, 61, 2**31 - 1]


def corrupt_field(rnd: random.Random, data: bytes) -> bytearray:
    """batchLength, recordCount, lastOffsetDelta or attributes set to an edge value."""
    out = bytearray(data)
    field, fmt = rnd.choice(
        [
            (R.BATCH_LENGTH, ">i"),
            (R.RECORD_COUNT, ">i"),
            (R.LAST_OFFSET_DELTA, ">i"),
            (R.ATTRIBUTES, ">h"),
        ]
    )
    if fmt == ">h":
        value = rnd.choice([0, 5, 6, 7, 0x08, 0x20, -1, rnd.randrange(-(2**15), 2**15)])
    else:
        value = rnd.choice(
            [*INT32_EDGES, len(data) - 12 + rnd.randrange(-3, 4), rnd.randrange(2**31)]
        )
    struct.pack_into(fmt, out, field, value)
    return out


def garbage_records(rnd: random.Random, data: bytes) -> bytearray:
    """Overwrites part of the records section with varint-hostile bytes."""
    out = bytearray(data)
    if len(out) <= R.HEADER_SIZE:
        return out
    i = rnd.randrange(R.HEADER_SIZE, len(out))
    pattern = rnd.choice([b"\xff", b"\x80", b"\x7f", b"\x01", b"\x00", rnd.randbytes(1)])
    out[i : i + rnd.randrange(1, 12)] = pattern * rnd.randrange(1, 12)
    return out


def recompress_mutated(rnd: random.Random, data: bytes) -> bytearray:
    """Decompresses the records, mutates them, recompresses: reaches the record parser."""
    hdr = R.read_batch_header(data, 0)
    raw = bytearray(C.decompress(hdr.compression, data[R.RECORDS :]))
    if raw:
        for _ in range(rnd.randrange(1, 4)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
    return bytearray(data[: R.RECORDS]) + C.compress(hdr.compression, bytes(raw))


def fixed_length(
    mutate: Callable[[random.Random, bytes], bytearray],
) -> Callable[[random.Random, bytes], bytearray]:
    """Keeps batchLength consistent with the mutated size (so framing passes)."""

    def wrapped(rnd: random.Random, data: bytes) -> bytearray:
        out = mutate(rnd, data)
        if len(out) >= R.HEADER_SIZE:
            struct.pack_into(">i", out, R.BATCH_LENGTH, len(out) - R.LOG_OVERHEAD)
        return out

    return wrapped


MUTATORS = [flip_bits, truncate, splice, corrupt_field, garbage_records, recompress_mutated]
DEEP = [
    fixed_length(m) for m in (flip_bits, splice, garbage_records, recompress_mutated, corrupt_field)
]


@pytest.mark.parametrize("deep", [False, True], ids=["crc-as-is", "crc-fixed"])
def test_mutated_batches_raise_only_protocol_errors(deep: bool) -> None:
    rnd = random.Random(SEED + deep)
    mutators = DEEP if deep else MUTATORS
    for _ in range(1500):
        seed = rnd.choice(SEEDS)
        data = rnd.choice(mutators)(rnd, seed)
        if deep:
            data = _fix_crc(data)
        check(data)
        check(bytes(data) + rnd.choice(SEEDS))  # a corrupt batch followed by a good one


def test_random_bytes_raise_only_protocol_errors() -> None:
    rnd = random.Random(SEED)
    for _ in range(1500):
        n = rnd.choice([0, 1, 11, 12, 60, 61, 62, rnd.randrange(200)])
        data = bytearray(rnd.randbytes(n))
        if n >= R.HEADER_SIZE and rnd.random() < 0.7:  # plausible framing, random body
            struct.pack_into(">ib", data, R.BATCH_LENGTH, n - 12, 2)
            struct.pack_into(">h", data, R.ATTRIBUTES, rnd.randrange(8))
            _fix_crc(data)
        check(data)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=300), st.sampled_from(range(len(SEEDS))), st.integers(0, 400))
def test_hypothesis_splices_into_valid_batches(blob: bytes, which: int, at: int) -> None:
    seed = SEEDS[which]
    at = min(at, len(seed))
    data = bytearray(seed[:at] + blob + seed[at + len(blob) :])
    check(data)
    check(_fix_crc(fixed_length(lambda _r, d: bytearray(d))(random.Random(0), bytes(data))))


# --- decompression bombs and hostile sizes -------------------------------------------------


def _batch_with_section(section: bytes, codec: int, count: int = 1) -> bytearray:
    """A framed batch around an arbitrary records section, CRC valid."""
    data = bytearray(R.HEADER_SIZE) + section
    R.write_batch_header(
        data, 0, len(data), record_count=count, base_timestamp_ms=0,
        max_timestamp_ms=0, settings=R.BatchSettings(codec),
    )  # fmt: skip
    return data


@pytest.mark.parametrize("codec", [C.GZIP, C.SNAPPY, C.LZ4, C.ZSTD])
def test_decompression_bomb_is_bounded(codec: int) -> None:
    bomb = C.compress(codec, bytes(16 << 20))  # 16 MiB of zeros, a few KiB compressed
    data = _batch_with_section(bomb, codec, count=1000)
    tracemalloc.start()
    try:
        with pytest.raises(CompressionError, match="limit"):
            R.decode_batches(data, max_uncompressed=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * LIMIT


def test_hostile_declared_sizes_raise_before_allocating() -> None:
    tracemalloc.start()
    try:
        snappy_4g = b"\xff\xff\xff\xff\x0f" + b"\x00" * 16  # raw snappy claiming 4 GiB
        xerial = C.XERIAL_MAGIC + struct.pack(">iii", 1, 1, len(snappy_4g)) + snappy_4g
        zstd_1t = (
            b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (1 << 40).to_bytes(8, "little") + b"\x00" * 8
        )
        for codec, blob in [(C.SNAPPY, snappy_4g), (C.SNAPPY, xerial), (C.ZSTD, zstd_1t)]:
            with pytest.raises(CompressionError):
                C.decompress(codec, blob, max_size=LIMIT)
            with pytest.raises(CompressionError):
                R.decode_batches(_batch_with_section(blob, codec), max_uncompressed=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LIMIT


def test_record_count_beyond_the_bytes_is_rejected_up_front() -> None:
    seed = bytearray(SEEDS[0])
    struct.pack_into(">i", seed, R.LAST_OFFSET_DELTA, 2**31 - 2)
    struct.pack_into(">i", seed, R.RECORD_COUNT, 2**31 - 1)
    with pytest.raises(DecodeError, match="cannot fit"):
        R.decode_batches(_fix_crc(seed))
