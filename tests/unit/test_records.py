"""RecordBatch v2: round trips under every codec, the vectorized encoder against the
per-record one byte for byte, producer-state patching, and kafka-python interop."""

from __future__ import annotations

import itertools
import random
import struct
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import cramjam
import crc32c
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmprod.errors import CompressionError, DecodeError, EncodeError
from shmprod.protocol import compression as C
from shmprod.protocol import records as R
from shmprod.protocol import vectorized as V

with warnings.catch_warnings():  # kafka-python 3 imports with a DeprecationWarning
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka.codec  # type: ignore[import-untyped]
    from kafka.record.default_records import (  # type: ignore[import-untyped]
        DefaultRecordBatch,
        DefaultRecordBatchBuilder,
    )

CODECS = [C.NONE, C.GZIP, C.SNAPPY, C.LZ4, C.ZSTD]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------

blobs = st.one_of(st.none(), st.just(b""), st.binary(max_size=300))
header_pairs = st.lists(
    st.tuples(st.text(max_size=12), st.one_of(st.none(), st.binary(max_size=20))), max_size=3
)
BASE_TS = st.integers(min_value=-(2**40), max_value=2**42)


@st.composite
def new_records(draw: st.DrawFn, max_size: int = 25) -> tuple[int, list[R.NewRecord]]:
    """(base timestamp, records) with null/empty keys and values, 0-3 headers and
    optional timestamps on either side of the base."""
    base = draw(BASE_TS)
    ts = st.one_of(st.none(), st.integers(-(2**33), 2**33).map(lambda d: base + d))
    recs = draw(
        st.lists(
            st.builds(R.NewRecord, blobs, blobs, header_pairs, ts), min_size=1, max_size=max_size
        )
    )
    return base, recs


def expected_ts(base: int, rec: R.NewRecord) -> int:
    return base if rec.timestamp_ms is None else rec.timestamp_ms


def assert_decoded(batch: R.RecordBatch, base: int, recs: Sequence[R.NewRecord]) -> None:
    """Every record of ``batch`` matches what was encoded, header fields included."""
    assert batch.record_count == len(recs) == len(batch.records)
    assert batch.last_offset_delta == len(recs) - 1
    assert batch.base_timestamp == base
    assert batch.max_timestamp == max(expected_ts(base, r) for r in recs)
    for i, (got, want) in enumerate(zip(batch.records, recs, strict=True)):
        assert got.offset == i
        assert got.timestamp_ms == expected_ts(base, want)
        assert got.key == (None if want.key is None else bytes(want.key))
        assert got.value == (None if want.value is None else bytes(want.value))
        assert got.headers == [(k, v) for k, v in want.headers]


# ---------------------------------------------------------------------------------------
# per-record encoder and batch round trips
# ---------------------------------------------------------------------------------------


def test_header_offsets_match_the_struct_layout() -> None:
    fields = [
        (R.BASE_OFFSET, "q"), (R.BATCH_LENGTH, "i"), (R.PARTITION_LEADER_EPOCH, "i"),
        (R.MAGIC, "b"), (R.CRC, "I"), (R.ATTRIBUTES, "h"), (R.LAST_OFFSET_DELTA, "i"),
        (R.BASE_TIMESTAMP, "q"), (R.MAX_TIMESTAMP, "q"), (R.PRODUCER_ID, "q"),
        (R.PRODUCER_EPOCH, "h"), (R.BASE_SEQUENCE, "i"), (R.RECORD_COUNT, "i"),
    ]  # fmt: skip
    pos = 0
    for offset, fmt in fields:
        assert offset == pos
        pos += struct.calcsize(">" + fmt)
    assert pos == R.RECORDS == R.HEADER_SIZE == 61


@SETTINGS
@given(
    st.integers(0, 10_000),
    st.integers(-(2**40), 2**40),
    blobs,
    blobs,
    header_pairs,
    st.integers(0, 7),
)
def test_record_size_matches_encode_record_into(
    od: int, td: int, key: bytes | None, value: bytes | None, hdrs: list[Any], at: int
) -> None:
    size = R.record_size(od, td, key, value, hdrs)
    buf = bytearray(at + size)
    assert R.encode_record_into(buf, at, od, td, key, value, hdrs) == at + size
    assert R.record_size(od, td, key, value, R.encode_headers(hdrs)) == size
    with pytest.raises(EncodeError):
        R.encode_record_into(bytearray(at + size - 1), at, od, td, key, value, hdrs)


@SETTINGS
@given(new_records(), st.sampled_from(CODECS), st.integers(0, 9))
def test_batch_round_trip_every_codec(
    case: tuple[int, list[R.NewRecord]], codec: int, at: int
) -> None:
    base, recs = case
    data = R.encode_batch(recs, base_timestamp_ms=base, settings=R.BatchSettings(codec))
    [batch] = R.decode_batches(data)
    assert_decoded(batch, base, recs)
    assert batch.compression == codec and batch.magic == 2
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (-1, -1, -1)
    assert batch.partition_leader_epoch == -1 and batch.base_offset == 0
    # the same bytes when encoded into a buffer at an offset
    buf = bytearray(at + len(data) + 64)
    end = R.encode_batch_into(
        buf, at, recs, base_timestamp_ms=base, settings=R.BatchSettings(codec)
    )
    assert bytes(buf[at:end]) == data
    assert R.validate_batch(buf, at, end - at).record_count == len(recs)
    assert list(R.iter_batches(data + data))[1].records == batch.records


@SETTINGS
@given(new_records(), st.sampled_from(CODECS), st.integers(-1, 2**31 - 1))
def test_split_batch_keeps_records_codec_and_sequences(
    case: tuple[int, list[R.NewRecord]], codec: int, sequence: int
) -> None:
    base, recs = case
    settings = R.BatchSettings(codec, producer_id=77, producer_epoch=3, base_sequence=sequence)
    data = R.encode_batch(recs, base_timestamp_ms=base, settings=settings)
    if len(recs) < 2:
        with pytest.raises(DecodeError):
            R.split_batch(data)
        return
    halves = R.split_batch(data)
    decoded = [R.decode_batches(h)[0] for h in halves]
    first, second = decoded
    assert first.record_count >= 1 and second.record_count >= 1
    assert [(r.key, r.value, r.headers, r.timestamp_ms) for b in decoded for r in b.records] == [
        (r.key, r.value, list(r.headers), expected_ts(base, r)) for r in recs
    ]
    for b in decoded:
        assert (b.compression, b.producer_id, b.producer_epoch) == (codec, 77, 3)
    if sequence < 0:
        assert first.base_sequence == second.base_sequence == -1
    else:
        assert first.base_sequence == sequence
        assert second.base_sequence == (sequence + first.record_count) % 2**31


def test_split_batch_refuses_what_is_not_one_batch() -> None:
    one = R.encode_batch([R.NewRecord(b"k", b"v")] * 2, base_timestamp_ms=0)
    for bad in (one + one, one[:-1], b""):
        with pytest.raises(DecodeError):
            R.split_batch(bad)


def test_offset_delta_varint_widths_and_memoryview_inputs() -> None:
    """offsetDelta crosses the 1- and 2-byte varint boundaries; memoryviews are bytes."""
    recs = [R.NewRecord(None, memoryview(b"v%d" % i), (), None) for i in range(8300)]
    data = R.encode_batch(recs, base_timestamp_ms=0)
    [batch] = R.decode_batches(data)
    assert [r.offset for r in batch.records] == list(range(8300))
    assert batch.records[8299].value == b"v8299"


def test_transactional_and_producer_fields() -> None:
    recs = [R.NewRecord(b"k", b"v")]
    data = R.encode_batch(
        recs, base_timestamp_ms=5, settings=R.BatchSettings(
            C.LZ4, producer_id=7, producer_epoch=3, base_sequence=11, transactional=True
        ),
    )  # fmt: skip
    hdr = R.validate_batch(data, 0, len(data))
    assert hdr.is_transactional and not hdr.is_control and hdr.compression == C.LZ4
    assert (hdr.producer_id, hdr.producer_epoch, hdr.base_sequence) == (7, 3, 11)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: R.encode_batch([], base_timestamp_ms=0),
        lambda: R.encode_batch([R.NewRecord(5, b"v")], base_timestamp_ms=0),  # type: ignore[arg-type]
        lambda: R.encode_batch([R.NewRecord(None, b"v", [(b"k", b"v")])], base_timestamp_ms=0),  # type: ignore[list-item]
        lambda: R.encode_batch([R.NewRecord(None, b"v", (), 2**63)], base_timestamp_ms=-5),
        lambda: R.encode_batch(
            [R.NewRecord(None, b"v")],
            base_timestamp_ms=0,
            settings=R.BatchSettings(producer_epoch=2**15),
        ),
        lambda: R.encode_batch([(b"k", b"v")], base_timestamp_ms=0),  # type: ignore[list-item]
        lambda: R.encode_batch_into(
            bytearray(70), 0, [R.NewRecord(None, b"x" * 10)], base_timestamp_ms=0
        ),
        lambda: R.encode_batch_into(
            bytearray(80),
            0,
            [R.NewRecord(None, bytes(range(100)))],
            base_timestamp_ms=0,
            settings=R.BatchSettings(C.ZSTD),
        ),
    ],
)
def test_encode_errors_are_encode_errors(bad: Any) -> None:
    with pytest.raises(EncodeError):
        bad()


def test_unknown_codec_is_a_compression_error() -> None:
    with pytest.raises(CompressionError):
        R.encode_batch([R.NewRecord(None, b"v")], base_timestamp_ms=0, settings=R.BatchSettings(5))
    with pytest.raises(CompressionError):
        C.codec_id("brotli")
    assert [C.codec_id(n) for n in ("none", "GZIP", "snappy", "lz4", "zstd")] == CODECS
    assert [C.codec_name(c) for c in CODECS] == ["none", "gzip", "snappy", "lz4", "zstd"]


def test_log_append_time_takes_max_timestamp() -> None:
    data = bytearray(R.encode_batch([R.NewRecord(None, b"a", (), 10)], base_timestamp_ms=3))
    struct.pack_into(">h", data, R.ATTRIBUTES, R.TIMESTAMP_TYPE_BIT)
    struct.pack_into(">q", data, R.MAX_TIMESTAMP, 999)
    struct.pack_into(">I", data, R.CRC, crc32c.crc32c(bytes(data[R.ATTRIBUTES :])))
    [batch] = R.decode_batches(data)
    assert batch.timestamp_type == R.LOG_APPEND_TIME and batch.records[0].timestamp_ms == 999


# ---------------------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(st.sampled_from(CODECS[1:]), st.binary(max_size=5000), st.integers(0, 3))
def test_compress_round_trip_and_bound(codec: int, data: bytes, repeat: int) -> None:
    data = data * (1 + 30 * repeat)
    blob = C.compress(codec, data)
    assert len(blob) <= C.compress_bound(codec, len(data))
    assert C.decompress(codec, blob) == data
    out = bytearray(C.compress_bound(codec, len(data)))
    n = C.compress_into(codec, data, memoryview(out))
    assert C.decompress(codec, out[:n]) == data
    if data:
        with pytest.raises(CompressionError):
            C.decompress(codec, blob, max_size=len(data) - 1)


@SETTINGS
@given(st.sampled_from(CODECS), st.integers(1, 1 << 20), st.integers(0, 1 << 20))
def test_slack_keeps_room_for_any_compressed_form(codec: int, n: int, m: int) -> None:
    # what a writer keeps free after at most n bytes of records: the worst growth of any
    # section up to n when it is small, else nothing (snappy's loose bound)
    kept = C.slack(codec, n)
    assert 0 <= kept <= n // 64
    if kept:
        m = min(m, n)
        assert C.compress_bound(codec, m) <= m + kept
    assert (kept == 0) == (codec in (C.NONE, C.SNAPPY) or C.compress_bound(codec, n) - n > n // 64)


@pytest.mark.parametrize("level", [None, 1, 2, 6, 9])
def test_gzip_levels_write_standard_gzip(level: int | None) -> None:
    import gzip

    data = b"gzip me " * 5000
    blob = C.compress(C.GZIP, data, level)
    assert gzip.decompress(blob) == data == C.decompress(C.GZIP, blob)


def test_wire_formats_are_what_java_writes() -> None:
    data = b"abc" * 50_000
    lz = C.compress(C.LZ4, data)
    # magic, FLG 0x60 (v1, independent blocks, no checksums, no size), BD 0x40 (64 KiB)
    assert lz[:7] == b"\x04\x22\x4d\x18\x60\x40\x82" and lz[-4:] == b"\x00\x00\x00\x00"
    import lz4.frame

    info = lz4.frame.get_frame_info(lz)
    assert info["block_linked"] is False and info["content_checksum"] is False
    assert lz4.frame.decompress(lz) == data  # liblz4 verifies the header checksum byte
    sn = C.compress(C.SNAPPY, data)
    assert sn[:16] == b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    assert C.compress(C.GZIP, data)[:2] == b"\x1f\x8b"
    assert C.compress(C.ZSTD, data)[:4] == b"\x28\xb5\x2f\xfd"


def _lz4_blocks(frame: bytes) -> list[bool]:
    """Whether each block of one of our lz4 frames is stored compressed."""
    pos, kinds = 7, []
    while (word := struct.unpack_from("<I", frame, pos)[0]) != 0:
        kinds.append(not word & 0x80000000)
        pos += 4 + (word & 0x7FFFFFFF)
    assert pos + 4 == len(frame)
    return kinds


@pytest.mark.parametrize("level", [None, 4])
def test_lz4_stops_trying_after_a_block_that_saves_little(level: int | None) -> None:
    block = C.LZ4_BLOCK_SIZE
    noise = random.Random(5).randbytes(block)
    text = b"compress me, I repeat myself " * (3 * block // 29 + 1)
    # an incompressible first block: the next 7 are stored without trying, the 9th is
    # tried (and compresses), and so are the ones after it
    data = noise + text[:block] * 9 + text[:100]
    lz = C.compress(C.LZ4, data, level)
    assert _lz4_blocks(lz) == [False] * 8 + [True] * 3
    assert C.decompress(C.LZ4, lz) == data
    import lz4.frame

    assert lz4.frame.decompress(lz) == data  # what another reader makes of it
    # one that saves little (under 1/32) is kept compressed, but the next is not tried;
    # one that saves enough does not stop the next
    slight = noise[: block - block // 40] + b"\0" * (block // 40)
    assert _lz4_blocks(C.compress(C.LZ4, slight + text[:block], level)) == [True, False]
    ample = noise[: block - block // 20] + b"\0" * (block // 20)
    assert _lz4_blocks(C.compress(C.LZ4, ample + text[:block], level)) == [True, True]
    # compressible from the start: every block is compressed
    assert _lz4_blocks(C.compress(C.LZ4, text[: 3 * block], level)) == [True] * 3


def _in_place(data: bytes, level: int | None = None, room: int = 0) -> bytes:
    """``data`` encoded where its frame goes, then made that frame in place."""
    out = bytearray(room or C.compress_bound(C.LZ4, len(data)))
    out[C.LZ4_SECTION_OFFSET : C.LZ4_SECTION_OFFSET + len(data)] = data
    return bytes(out[: C.lz4_frame_in_place(memoryview(out), len(data), level)])


@pytest.mark.parametrize(
    ("n", "bd"),
    [
        (1, 0x40),
        (64 * 1024, 0x40),
        (64 * 1024 + 1, 0x50),
        (256 * 1024, 0x50),
        (256 * 1024 + 1, 0x60),
        (1 << 20, 0x60),
        ((1 << 20) + 1, 0x70),
        (4 << 20, 0x70),
    ],
)
def test_an_incompressible_section_becomes_one_stored_block_where_it_is(n: int, bd: int) -> None:
    import lz4.frame

    data = random.Random(n).randbytes(n)
    frame = _in_place(data)
    assert len(frame) == n + 15
    assert frame[4] == 0x60 and frame[5] == bd  # the smallest maximum block size that holds it
    assert _lz4_blocks(frame) == [False]
    assert C.decompress(C.LZ4, frame, max_size=n) == data
    assert lz4.frame.decompress(frame) == data  # liblz4 checks the header checksum
    # what a reader is told about the frame agrees with its bytes
    info = lz4.frame.get_frame_info(frame)
    assert info["block_size"] >= n and not info["block_linked"]
    if n <= C.LZ4_BLOCK_SIZE:  # one block of at most 64 KiB: what compress() makes too
        assert frame == C.compress(C.LZ4, data)


@pytest.mark.parametrize("level", [None, 4])
def test_a_section_that_compresses_or_outgrows_one_block_is_framed_as_compress_does(
    level: int | None,
) -> None:
    block = C.LZ4_BLOCK_SIZE
    rng = random.Random(9)
    text = b"compress me, I repeat myself " * (20 * block // 29)
    noise = rng.randbytes(9 * block)
    cases = [
        text[: 3 * block],  # compressible from the start
        noise[: 8 * block] + text[:block],  # the second block tried (the 9th) compresses
        rng.randbytes((4 << 20) + 1),  # incompressible, but no block holds it
    ]
    for data in cases:
        frame = _in_place(data, level)
        assert frame == C.compress(C.LZ4, data, level)
        assert C.decompress(C.LZ4, frame, max_size=len(data)) == data
    # an untried block that would compress does not stop a stored frame: only the
    # blocks compress() tries are tried
    data = noise[:block] + text[:block] + noise[: 6 * block]
    assert _lz4_blocks(C.compress(C.LZ4, data, level)) == [False] * 8
    assert _lz4_blocks(_in_place(data, level)) == [False]


def test_lz4_in_place_refuses_too_little_room_and_bad_levels() -> None:
    data = random.Random(1).randbytes(1000)
    with pytest.raises(CompressionError):
        _in_place(data, room=C.compress_bound(C.LZ4, 1000) - 1)
    with pytest.raises(CompressionError):
        _in_place(data, level=99)
    assert _in_place(b"") == C.compress(C.LZ4, b"")  # nothing to store: header, end mark


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["noise", "text"]), st.integers(1, 200_000)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([None, 3]),
)
def test_lz4_in_place_always_decodes_to_its_section(
    parts: list[tuple[str, int]], level: int | None
) -> None:
    rng = random.Random(len(parts))
    data = b"".join(
        rng.randbytes(n) if kind == "noise" else (b"abc" * (n // 3 + 1))[:n] for kind, n in parts
    )
    frame = _in_place(data, level)
    assert len(frame) <= C.compress_bound(C.LZ4, len(data))
    assert C.decompress(C.LZ4, frame, max_size=len(data)) == data
    # stored whole exactly when it is one stored block (no section here outgrows one)
    assert C.lz4_stored_whole(len(data), len(frame)) == (_lz4_blocks(frame) == [False])


def test_lz4_stored_whole_tells_a_frame_of_stored_blocks_that_one_block_holds() -> None:
    n = 300_000
    noise = random.Random(2).randbytes(n)
    assert C.lz4_stored_whole(n, len(C.compress(C.LZ4, noise)))  # 5 stored blocks
    assert C.lz4_stored_whole(n, len(_in_place(noise)))  # one
    assert not C.lz4_stored_whole(n, len(C.compress(C.LZ4, b"a" * n)))
    big = (4 << 20) + 1
    assert not C.lz4_stored_whole(big, C.compress_bound(C.LZ4, big))


def test_decompress_reads_other_producers_framings() -> None:
    import gzip

    import lz4.frame

    data = bytes(range(256)) * 300
    assert C.decompress(C.SNAPPY, bytes(cramjam.snappy.compress_raw(data))) == data  # librdkafka
    assert C.decompress(C.LZ4, lz4.frame.compress(data, content_checksum=True)) == data
    assert C.decompress(C.GZIP, gzip.compress(data[:100]) + gzip.compress(data[100:])) == data
    stream = cramjam.zstd.Compressor()  # a streamed frame declares no content size
    stream.compress(data)
    assert C.decompress(C.ZSTD, bytes(stream.finish())) == data


# ---------------------------------------------------------------------------------------
# patching the producer state (sender side)
# ---------------------------------------------------------------------------------------


@SETTINGS
@given(
    new_records(max_size=5),
    st.sampled_from(CODECS),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**15 - 1),
    st.integers(0, 2**31 - 1),
)
def test_patch_producer_state_rewrites_fields_and_crc(
    case: tuple[int, list[R.NewRecord]], codec: int, pid: int, epoch: int, seq: int
) -> None:
    base, recs = case
    buf = bytearray(R.HEADER_SIZE + 20_000)
    end = R.encode_batch_into(buf, 7, recs, base_timestamp_ms=base, settings=R.BatchSettings(codec))
    before = bytes(buf[7 + R.RECORDS : end])
    R.patch_producer_state(memoryview(buf), 7, pid, epoch, seq)
    hdr = R.validate_batch(buf, 7, end - 7)
    assert (hdr.producer_id, hdr.producer_epoch, hdr.base_sequence) == (pid, epoch, seq)
    assert hdr.crc == crc32c.crc32c(bytes(buf[7 + R.ATTRIBUTES : end]))  # independent recheck
    assert bytes(buf[7 + R.RECORDS : end]) == before
    assert R.encode_batch(
        recs, base_timestamp_ms=base, settings=R.BatchSettings(
            codec, producer_id=pid, producer_epoch=epoch, base_sequence=seq
        ),
    ) == bytes(buf[7:end])  # fmt: skip
    if codec in (C.NONE, C.GZIP, C.LZ4):
        kb = DefaultRecordBatch(bytes(buf[7:end]))
        assert kb.validate_crc() and kb.producer_id == pid and kb.base_sequence == seq


def test_patch_and_validate_reject_bad_framing() -> None:
    data = bytearray(R.encode_batch([R.NewRecord(None, b"v")], base_timestamp_ms=0))
    with pytest.raises(DecodeError):
        R.patch_producer_state(data, 1, 1, 1, 1)  # not at a batch start
    with pytest.raises(EncodeError):
        R.patch_producer_state(data, 0, 1, 2**15, 1)
    with pytest.raises(EncodeError):
        R.patch_producer_state(memoryview(bytes(data)), 0, 1, 1, 1)  # read-only
    with pytest.raises(DecodeError):
        R.validate_batch(data, 0, len(data) - 1)
    data[-1] ^= 1
    with pytest.raises(DecodeError, match="CRC"):
        R.validate_batch(data, 0, len(data))


# ---------------------------------------------------------------------------------------
# kafka-python interop (an encoder and decoder we did not write)
# ---------------------------------------------------------------------------------------


class _SnappyShim:
    """python-snappy's two calls, via cramjam: kafka-python's xerial framing is its own."""

    @staticmethod
    def compress(data: bytes) -> bytes:
        return bytes(cramjam.snappy.compress_raw(data))

    @staticmethod
    def decompress(data: bytes) -> bytes:
        return bytes(cramjam.snappy.decompress_raw(data))


@pytest.fixture(params=[C.NONE, C.GZIP, C.LZ4, C.SNAPPY])
def kp_codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Codecs kafka-python handles here; snappy through a raw-snappy shim (no
    python-snappy installed), which still exercises kafka-python's xerial code."""
    codec: int = request.param
    if codec == C.SNAPPY and not kafka.codec.has_snappy():
        monkeypatch.setattr(kafka.codec, "snappy", _SnappyShim)
    return codec


def _kp_records(seed: int, n: int) -> tuple[int, list[R.NewRecord]]:
    rnd = random.Random(seed)
    base = 1_700_000_000_000 + rnd.randrange(10**6)
    recs = []
    for i in range(n):
        key = None if i % 4 == 0 else b"key-%d" % rnd.randrange(50)
        value = None if i % 7 == 3 else b"value %d " % i * rnd.randrange(0, 20)
        hdrs = [("h\u00e9", b"x" * (i % 3)), ("n", None)][: i % 3]
        recs.append(R.NewRecord(key, value, hdrs, base + rnd.randrange(-500, 500)))
    return base, recs


@pytest.mark.parametrize("seed", range(3))
def test_kafka_python_decodes_ours(kp_codec: int, seed: int) -> None:
    base, recs = _kp_records(seed, 200)
    data = R.encode_batch(
        recs, base_timestamp_ms=base, settings=R.BatchSettings(kp_codec, base_sequence=3)
    )
    batch = DefaultRecordBatch(bytearray(data))
    assert batch.validate_crc() and batch.compression_type == kp_codec
    assert batch.max_timestamp == max(r.timestamp_ms for r in recs)  # type: ignore[type-var]
    got = list(batch)
    assert len(got) == len(recs)
    for i, (g, w) in enumerate(zip(got, recs, strict=True)):
        assert (g.offset, g.timestamp, g.key, g.value) == (i, w.timestamp_ms, w.key, w.value)
        assert [tuple(h) for h in g.headers] == list(w.headers)


@pytest.mark.parametrize("seed", range(3))
def test_we_decode_kafka_python(kp_codec: int, seed: int) -> None:
    _, recs = _kp_records(seed, 200)
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=kp_codec, is_transactional=False, producer_id=9,
        producer_epoch=1, base_sequence=40, batch_size=1 << 24,
    )  # fmt: skip
    for i, r in enumerate(recs):
        builder.append(i, r.timestamp_ms, r.key, r.value, list(r.headers))
    data = bytes(builder.build())
    [batch] = R.decode_batches(data)
    assert batch.compression == kp_codec and batch.base_sequence == 40
    first = recs[0].timestamp_ms
    assert first is not None
    assert_decoded(batch, first, recs)


def test_vectorized_batches_decode_in_kafka_python(kp_codec: int) -> None:
    vals = [b"row %d " % i * (i % 9) for i in range(3000)]
    keys = [None if i % 5 else b"k%d" % i for i in range(3000)]
    ts = 1_700_000_000_000 + np.arange(3000, dtype=np.int64) * 3
    for b in V.iter_encoded_batches(vals, keys, ts, batch_size=16384):
        kb = DefaultRecordBatch(bytearray(b.to_bytes(R.BatchSettings(kp_codec))))
        assert kb.validate_crc()
        rows = list(kb)
        first = rows[0].timestamp
        i0 = int(np.searchsorted(ts, first))
        assert [r.value for r in rows] == vals[i0 : i0 + len(rows)]
        assert [r.key for r in rows] == keys[i0 : i0 + len(rows)]


# ---------------------------------------------------------------------------------------
# vectorized encoder == per-record encoder
# ---------------------------------------------------------------------------------------


@contextmanager
def fast_path_only() -> Iterator[None]:
    """Fails the test if the vectorized encoder falls back to the per-record one."""
    with mock.patch.object(V, "_row_args", side_effect=AssertionError("per-record fallback")):
        yield


KINDS = ["binary", "large_binary", "string", "binary_view", "chunked", "sliced", "numpy", "list"]


def as_column(items: list[bytes | None], kind: str) -> Any:
    """The same bytes as one of the input kinds the vectorized encoder accepts."""
    if kind == "binary":
        return pa.array(items, pa.binary())
    if kind == "large_binary":
        return pa.array(items, pa.large_binary())
    if kind == "string":
        return pa.array([None if b is None else b.decode() for b in items], pa.string())
    if kind == "binary_view":
        return pa.array(items, pa.binary()).cast(pa.binary_view())
    if kind == "chunked":
        half = len(items) // 2
        return pa.chunked_array(
            [pa.array(items[:half], pa.binary()), pa.array(items[half:], pa.binary())]
        )
    if kind == "sliced":  # a zero-copy slice of a longer array, nulls around it
        return pa.array([b"junk", None, *items, None, b"junk"], pa.large_binary()).slice(
            2, len(items)
        )
    if kind == "numpy":
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr
    return list(items)


@st.composite
def columns(draw: st.DrawFn) -> dict[str, Any]:
    """Rows for the vectorized encoder, in one of the accepted input kinds, with the
    expected per-record input alongside."""
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.one_of(st.integers(1, 20), st.integers(60, 140)))
    item = st.one_of(
        st.none(), st.just(b""), st.binary(max_size=40), st.binary(min_size=13, max_size=200)
    )
    if kind == "string":
        item = st.one_of(st.none(), st.text(max_size=30).map(str.encode))
    values = draw(st.lists(item, min_size=n, max_size=n))
    keys = draw(st.one_of(st.none(), st.lists(item, min_size=n, max_size=n)))
    base = draw(BASE_TS)
    ts_kind = draw(st.sampled_from(["none", "array", "array+base", "scalar", "datetime"]))
    deltas = draw(st.lists(st.integers(-(2**36), 2**36), min_size=n, max_size=n))
    ts = np.array([base + d for d in deltas], dtype=np.int64)
    hkind = draw(st.sampled_from(["none", "shared", "long", "rows"]))
    shared = draw(header_pairs)
    headers: Any = None
    if hkind == "shared":
        headers = shared
    elif hkind == "long":
        headers = [("a-long-header-key", b"and a value longer than twelve bytes")]
    elif hkind == "rows":
        headers = [draw(header_pairs) for _ in range(n)]
    return {
        "kind": kind, "values": values, "keys": keys, "base": base, "ts_kind": ts_kind,
        "ts": ts, "headers": headers,
    }  # fmt: skip


def vector_args(
    c: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any], int, list[R.NewRecord]]:
    """(positional args, keyword args) for the vectorized call, the base timestamp and
    the equivalent per-record input."""
    n = len(c["values"])
    kw: dict[str, Any] = {}
    ts_arg: Any = None
    row_ts: list[int | None] = [None] * n
    base = c["base"]
    if c["ts_kind"] == "none":
        kw["base_timestamp_ms"] = base
    elif c["ts_kind"] == "scalar":
        ts_arg = base
    else:
        ts_arg = c["ts"]
        row_ts = [int(t) for t in c["ts"]]
        if c["ts_kind"] == "array+base":
            kw["base_timestamp_ms"] = base
        else:
            base = row_ts[0]
            if c["ts_kind"] == "datetime":
                ts_arg = c["ts"].astype("datetime64[ms]")
    keys = c["keys"] or [None] * n
    hdrs = c["headers"]
    per_row = (
        hdrs if isinstance(hdrs, list) and hdrs and isinstance(hdrs[0], list) else [hdrs or []] * n
    )
    if not hdrs:
        per_row = [[]] * n
    recs = [
        R.NewRecord(k, v, h, t)
        for k, v, h, t in zip(keys, c["values"], per_row, row_ts, strict=True)
    ]
    vals = as_column(c["values"], c["kind"])
    kcol = None if c["keys"] is None else as_column(c["keys"], c["kind"])
    return (vals, kcol, ts_arg, hdrs), kw, base, recs


@SETTINGS
@given(columns(), st.sampled_from(CODECS))
def test_vectorized_is_byte_identical_to_per_record(c: dict[str, Any], codec: int) -> None:
    args, kw, base, recs = vector_args(c)
    want = R.encode_batch(recs, base_timestamp_ms=base, settings=R.BatchSettings(codec))
    with fast_path_only():
        assert V.encode_columns(*args, settings=R.BatchSettings(codec), **kw) == want
        sizes = V.record_sizes(*args, **kw)
    per_record = [
        R.record_size(
            i,
            (r.timestamp_ms if r.timestamp_ms is not None else base) - base,
            r.key,
            r.value,
            r.headers,
        )
        for i, r in enumerate(recs)
    ]
    assert sizes.tolist() == per_record
    reserve = V.encoded_size(*args, compression=codec, **kw)
    assert reserve >= len(want) and (codec != C.NONE or reserve == len(want))
    buf = bytearray(reserve + 3)
    end = V.encode_columns_into(memoryview(buf), 3, *args, settings=R.BatchSettings(codec), **kw)
    assert bytes(buf[3:end]) == want


@SETTINGS
@given(columns(), st.integers(200, 3000), st.one_of(st.none(), st.integers(1, 50)))
def test_split_batches_respects_budget_and_matches_per_record(
    c: dict[str, Any], batch_size: int, max_records: int | None
) -> None:
    args, kw, _, recs = vector_args(c)
    base_kw = kw.get("base_timestamp_ms")
    with fast_path_only():
        bounds = V.split_batches(*args, batch_size=batch_size, max_records=max_records, **kw)
        batches = list(
            V.iter_encoded_batches(*args, batch_size=batch_size, max_records=max_records, **kw)
        )
    assert bounds[0] == 0 and bounds[-1] == len(recs) and len(batches) == len(bounds) - 1
    for b, (s, e) in zip(batches, itertools.pairwise(bounds.tolist()), strict=True):
        rows = recs[s:e]
        first = rows[0].timestamp_ms
        base = base_kw if base_kw is not None else (first if first is not None else c["base"])
        want = R.encode_batch(rows, base_timestamp_ms=base)
        assert b.to_bytes() == want
        assert max_records is None or e - s <= max_records
        assert len(want) <= batch_size or e - s == 1  # a lone oversized record is allowed


@pytest.mark.parametrize("batch_size", [1024, 4096, 16384, 100_000])
@pytest.mark.parametrize("row", [1, 9, 40])
def test_split_batches_with_wide_offset_deltas(batch_size: int, row: int) -> None:
    """Batches of more than 64 (and 8192) rows, where offsetDelta needs 2 (3) bytes."""
    n = 30_000
    vals = [b"v" * row] * n
    keys = [b"k%07d" % i for i in range(n)]
    bounds = V.split_batches(vals, keys, 7, batch_size=batch_size)
    for batch in V.iter_encoded_batches(vals, keys, 7, bounds=bounds):
        assert R.HEADER_SIZE + len(batch.records) <= batch_size
    # The last batch, where the estimate reaches the last row, for every column length
    # around the point where the whole column just fits.
    for m in range(100, 400, 7):
        for batch in V.iter_encoded_batches(vals[:m], keys[:m], 7, batch_size=batch_size):
            assert R.HEADER_SIZE + len(batch.records) <= batch_size, m
    # tight: one more row would not have fit
    sizes = V.record_sizes(vals, keys, 7)
    assert int(bounds[1]) < n
    assert R.HEADER_SIZE + int(sizes[: int(bounds[1]) + 1].sum()) > batch_size - 3


def test_iter_encoded_batches_spans_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small batches over several encoding chunks, explicit bounds."""
    monkeypatch.setattr(V, "CHUNK_BYTES", 4096)
    vals = pa.array([b"x" * (i % 50) for i in range(5000)], pa.binary())
    bounds = np.array([0, 1, 64, 65, 1000, 4999, 5000])
    got = list(V.iter_encoded_batches(vals, None, 42, bounds=bounds))
    assert [b.record_count for b in got] == np.diff(bounds).tolist()
    for b, s, e in zip(got, bounds[:-1], bounds[1:], strict=True):
        recs = [R.NewRecord(None, bytes(v), (), None) for v in vals[s:e].to_pylist()]
        assert b.to_bytes(R.BatchSettings(C.ZSTD)) == R.encode_batch(
            recs, base_timestamp_ms=42, settings=R.BatchSettings(C.ZSTD)
        )
    many = list(V.iter_encoded_batches(vals, None, 42, batch_size=300))
    assert sum(b.record_count for b in many) == 5000 and all(b.max_size() <= 300 for b in many)


def test_vectorized_falls_back_for_huge_timestamp_deltas() -> None:
    ts = np.array([0, 2**60, -(2**61)], dtype=np.int64)
    recs = [R.NewRecord(None, b"a", (), int(t)) for t in ts]
    assert V.encode_columns([b"a"] * 3, None, ts) == R.encode_batch(recs, base_timestamp_ms=0)
    with pytest.raises(EncodeError):  # a delta beyond int64
        V.encode_columns([b"a", b"b"], None, np.array([-(2**63), 2**63 - 1], dtype=np.int64))


@pytest.mark.parametrize(
    "bad",
    [
        lambda: V.encode_columns([], base_timestamp_ms=0),
        lambda: V.encode_columns([b"a"]),  # no timestamp at all
        lambda: V.encode_columns([b"a", b"b"], [b"k"], base_timestamp_ms=0),
        lambda: V.encode_columns([b"a", b"b"], None, np.array([1], dtype=np.int64)),
        lambda: V.encode_columns([b"a"], None, np.array([1.5])),
        lambda: V.encode_columns([1, 2], base_timestamp_ms=0),
        lambda: V.encode_columns(pa.array([1, 2]), base_timestamp_ms=0),
        lambda: V.encode_columns([b"a"], headers=[[("k", b"v")], []], base_timestamp_ms=0),
        lambda: V.encode_columns_into(bytearray(10), 0, [b"abc"], base_timestamp_ms=0),
        lambda: V.split_batches([b"a"], batch_size=61, base_timestamp_ms=0),
    ],
)
def test_vectorized_errors_are_encode_errors(bad: Any) -> None:
    with pytest.raises(EncodeError):
        bad()


def test_to_binary_array_kinds_are_zero_copy_where_possible() -> None:
    arr = pa.array([b"a", None, b"bc"], pa.binary())
    assert V.to_binary_array(arr) is arr
    strings = pa.array(["a", None, "bc"])
    assert V.to_binary_array(strings).buffers()[2].address == strings.buffers()[2].address
    assert V.to_binary_array(pa.nulls(3)).null_count == 3
    assert V.to_binary_array(pa.array([b"ab"], pa.binary(2))).to_pylist() == [b"ab"]


def test_the_cached_varints_are_the_encodings_of_their_index() -> None:
    """The encoder's table of small values, built by byte arithmetic, against the
    reference encoder for every entry."""
    from shmprod.protocol.primitives import encode_uvarint

    assert len(R._UVARINTS) == R._UVARINT_CACHE_SIZE
    for u, encoded in enumerate(R._UVARINTS):
        assert encoded == encode_uvarint(u)
