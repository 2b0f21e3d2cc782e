"""Rows written straight into a buffer by the C extension (shmprod._speedups:
plan_batches, encode_records, staged_lengths; shmprod.worker.direct), as a flush of
``send()``'s staged rows and ``send_batch`` use it: from lists of bytes or from Arrow
buffers, batches byte-identical to the per-record encoder's, cut within the byte budget
and never across a partition, and a typed error, never a crash or a read or write past
a buffer, for bad arguments."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import speedups
from shmprod.errors import EncodeError
from shmprod.protocol.compression import LZ4
from shmprod.protocol.records import (
    HEADER_SIZE,
    BatchSettings,
    NewRecord,
    decode_batches,
    encode_batch,
    encode_headers,
)
from shmprod.worker.direct import Source, arrow_source, plan, staged_source
from shmprod.worker.staging import Stage

pytestmark = pytest.mark.skipif(not speedups.ACCELERATED, reason="the C extension is not in use")

BIG_TS = (1 << 63) - 1

blobs = st.one_of(st.none(), st.binary(max_size=300))
stamps = st.one_of(
    st.integers(0, 2_000_000_000_000),
    st.sampled_from([0, 1, BIG_TS, BIG_TS - 1, 1 << 55, (1 << 55) + 1]),
)


@st.composite
def rows(draw: Any) -> tuple[list[Any], list[Any], list[int], np.ndarray | None, list[int]]:
    n = draw(st.integers(1, 40))
    values = draw(st.lists(blobs, min_size=n, max_size=n))
    keys = draw(st.lists(blobs, min_size=n, max_size=n))
    ts = draw(st.lists(stamps, min_size=n, max_size=n))
    if draw(st.booleans()):  # as the stager stamps them: one int object per millisecond
        pool = [int(str(t)) for t in draw(st.lists(stamps, min_size=1, max_size=3))]
        ts = [
            pool[i % len(pool)] for i in draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        ]
    order = None
    if draw(st.booleans()):
        order = np.array(draw(st.permutations(range(n))), np.int64)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=5))) if n > 1 else []
    return values, keys, ts, order, [*cuts, n]


headers_st = st.one_of(
    st.none(),
    st.lists(
        st.tuples(st.text(max_size=5), st.one_of(st.none(), st.binary(max_size=8))),
        min_size=1,
        max_size=3,
    ),
)


def _arrow(items: list[Any], large: bool, pad: int) -> pa.Array:
    """``items`` as an Arrow array, sliced out of a longer one when ``pad``."""
    arr = pa.array(
        [b"pad"] * pad + items + [b"tail"] * pad, pa.large_binary() if large else pa.binary()
    )
    return arr.slice(pad, len(items))


def _sizes(values: list[Any], keys: list[Any]) -> np.ndarray:
    """Each row's key and value length as staged_lengths writes them (-1: None)."""
    assert speedups.staged_lengths is not None
    sizes = np.full(2 * len(values), -7, np.int32)
    speedups.staged_lengths(values, keys, np.empty(len(values), np.int64), sizes)
    return sizes


@st.composite
def sources(draw: Any) -> tuple[Source, list[Any], list[Any], list[int], list[Any]]:
    """A source in one of its forms, and the rows it holds (values, keys, timestamps,
    and each row's headers)."""
    values, keys, ts, order, ends = draw(rows())
    headers = draw(headers_st)
    form = draw(
        st.sampled_from(["list", "list-rows", "arrow", "arrow-large", "chunks", "chunks-large"])
    )
    # a stage's rows with their lengths read once at the flush (Stage.row_lengths), or not
    sizes = _sizes(values, keys) if draw(st.booleans()) else None
    if form == "list-rows":  # a stage of send(): each row's own section
        row_headers = [draw(headers_st) or [] for _ in values]
        sections = [encode_headers(h) for h in row_headers]
        source = Source(values, keys, ts, sections, sizes)
        return source, values, keys, ts, [order, ends, row_headers]
    every = [headers or []] * len(values)
    if form == "list":
        source = Source(values, keys, ts, encode_headers(headers) if headers else b"\x00", sizes)
        return source, values, keys, ts, [order, ends, every]
    pad = draw(st.integers(0, 3))
    one_ts = draw(st.booleans())
    if one_ts:
        ts = [ts[0]] * len(values)
    no_keys = all(k is None for k in keys)
    large = form.endswith("-large")
    vals: pa.Array | pa.ChunkedArray = _arrow(values, large, pad)
    if form.startswith("chunks"):  # held send_batch calls: the values of each call
        cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=4)))
        bounds = [0, *cuts, len(values)]
        vals = pa.chunked_array(
            [
                _arrow(values[a:b], large, draw(st.integers(0, 2)))
                for a, b in itertools.pairwise(bounds)
            ]
        )
    got = arrow_source(
        vals,
        None if no_keys else _arrow(keys, large, pad),
        ts[0] if one_ts else np.array(ts, np.int64),
        headers,
    )
    assert got is not None
    return got, values, keys, ts, [order, ends, every]


def _reference(
    values: list[Any], keys: list[Any], ts: list[int], rows: list[int], base: int, headers: Any
) -> bytes:
    """The batch of ``rows`` by the per-record encoder (``headers``: each row's)."""
    return encode_batch(
        [NewRecord(keys[r], values[r], headers[r], ts[r]) for r in rows], base_timestamp_ms=base
    )


def _stage(values: list[Any], keys: list[Any], ts: list[int]) -> Stage:
    stage = Stage("t", 0, threading.Lock())
    stage.values, stage.keys, stage.timestamps = values, keys, ts
    stage.n = len(values)
    return stage


@settings(max_examples=300, deadline=None)
@given(sources(), st.integers(1, 2000))
def test_batches_match_the_per_record_encoder(case: Any, budget: int) -> None:
    source, values, keys, ts, (order, ends, headers) = case
    n = len(values)
    sorted_rows = list(range(n)) if order is None else order.tolist()
    parts = {}
    lo = 0
    for p, hi in enumerate(ends):
        parts[p] = (lo, hi)
        lo = hi
    todo = plan(source, order, [(p, lo, hi) for p, (lo, hi) in parts.items()], budget)
    assert todo[0][1].lo == 0
    assert sum(b.record_count for _, b in todo) == n
    for (_, a), (_, b) in itertools.pairwise(todo):
        assert a.lo + a.record_count == b.lo  # contiguous
    for p, batch in todo:
        lo, hi = batch.lo, batch.lo + batch.record_count
        assert parts[p][0] <= lo < hi <= parts[p][1]  # never across a partition's end
        assert batch.section_size <= budget or hi - lo == 1  # a record too big: alone
        batch_rows = sorted_rows[lo:hi]
        base = batch.base_timestamp_ms
        assert base == ts[batch_rows[0]]
        assert batch.max_timestamp_ms == max(ts[r] for r in batch_rows)
        want = _reference(values, keys, ts, batch_rows, base, headers)
        assert len(want) == HEADER_SIZE + batch.section_size
        out = bytearray(len(want) + 7)
        end = batch.write_into(memoryview(out), 3)
        assert end == 3 + len(want)
        assert bytes(out[3:end]) == want
        if hi < parts[p][1]:  # the batch is full: the next record does not fit
            longer = _reference(values, keys, ts, sorted_rows[lo : hi + 1], base, headers)
            assert len(longer) - HEADER_SIZE > budget


@settings(max_examples=100, deadline=None)
@given(sources())
def test_compressed_batches_decode_to_the_rows(case: Any) -> None:
    source, values, keys, ts, (order, _ends, headers) = case
    sorted_rows = list(range(len(values))) if order is None else order.tolist()
    ranges = [(0, 0, len(values))]
    for _, batch in plan(source, order, ranges, 1 << 20):
        buf = bytearray(HEADER_SIZE + batch.section_size + 1024)
        end = batch.write_into(memoryview(buf), 0, settings=BatchSettings(LZ4))
        (decoded,) = decode_batches(bytes(buf[:end]))
        got = [(r.key, r.value, r.timestamp_ms, r.headers) for r in decoded.records]
        rows_ = sorted_rows[batch.lo : batch.lo + batch.record_count]
        assert got == [(keys[r], values[r], ts[r], list(headers[r])) for r in rows_]


def test_lz4_rows_after_an_incompressible_batch_are_framed_where_they_are_written() -> None:
    """After a batch whose lz4 frame stored every block, the next batch's rows are
    encoded where its frame goes: incompressible, they stay as one stored block (the
    frame's maximum block size the smallest that holds them); compressible, they are
    compressed as any section is, and the batch after goes through the scratch section
    again. Every batch decodes to its rows, whichever way it went."""
    rng = np.random.default_rng(4)
    noise = [rng.bytes(1000) for _ in range(300)]
    text = [b"repeat after me " * 60 for _ in range(300)]
    lz4 = BatchSettings(LZ4)

    def one(values: list[bytes]) -> bytes:
        keys = [str(i).encode() for i in range(len(values))]
        ts = list(range(1_700_000_000_000, 1_700_000_000_000 + len(values)))
        source = Source(values, keys, ts, b"\x00")
        ((_, batch),) = plan(source, None, [(0, 0, len(values))], 1 << 22)
        buf = bytearray(HEADER_SIZE + batch.section_size + 1024)
        end = batch.write_into(memoryview(buf), 0, settings=lz4)
        (decoded,) = decode_batches(bytes(buf[:end]))  # the CRC is checked
        assert [(r.key, r.value, r.timestamp_ms) for r in decoded.records] == list(
            zip(keys, values, ts, strict=True)
        )
        return bytes(buf[HEADER_SIZE:end])

    def blocks(frame: bytes) -> int:
        pos, count = 7, 0
        while (word := int.from_bytes(frame[pos : pos + 4], "little")) != 0:
            pos, count = pos + 4 + (word & 0x7FFFFFFF), count + 1
        return count

    one(text[:1])  # whatever this thread wrote before: a compressed frame
    first = one(noise)  # through the scratch section: 64 KiB blocks, all stored
    assert first[5] == 0x40 and blocks(first) == 5
    second = one(noise)  # in place: one stored block of 300 KB, so 1 MiB at most
    assert second[5] == 0x60 and blocks(second) == 1
    assert len(second) == len(first) - 4 * 4
    small = one(noise[:50])  # in place again, 50 KB: the 64 KiB frame compress() makes
    assert small[5] == 0x40 and blocks(small) == 1
    squeezed = one(text)  # in place, but it compresses
    assert len(squeezed) < len(text) * len(text[0]) // 10
    assert one(text) == squeezed  # through the scratch section: the same frame
    assert blocks(one(noise)) == 5  # stored, through the scratch section once more


@settings(max_examples=100, deadline=None)
@given(rows())
def test_staged_lengths(case: Any) -> None:
    values, keys, *_ = case
    assert speedups.staged_lengths is not None
    out = np.full(len(values), -7, np.int64)
    speedups.staged_lengths(values, keys, out)
    assert out.tolist() == [
        len(v or b"") + len(k or b"") for v, k in zip(values, keys, strict=True)
    ]
    sizes = _sizes(values, keys)
    assert sizes.tolist() == [
        n for k, v in zip(keys, values, strict=True) for n in (_len(k), _len(v))
    ]


def _len(b: bytes | None) -> int:
    return -1 if b is None else len(b)


def test_stage_lengths_are_kept_for_the_plan_until_the_rows_are_released() -> None:
    stage = _stage([b"abc", None, b""], [None, b"k", b"kk"], [5, 5, 6])
    assert stage.sizes is None
    source = staged_source(stage)
    assert source is not None and source.sizes is None  # the plan reads the objects
    assert stage.row_lengths().tolist() == [3, 1, 2]
    assert stage.sizes is not None and stage.sizes.tolist() == [-1, 3, 1, -1, 2, 0]
    source = staged_source(stage)
    assert source is not None and source.sizes is stage.sizes
    stage.release_rows()
    assert stage.sizes is None


@pytest.mark.parametrize(
    ("sizes", "error"),
    [
        (np.array([-1, 1, -1], np.int32), ValueError),  # not two a row
        (np.array([-1, 1, -1, 1, 0, 0], np.int32), ValueError),
        (np.array([-2, 1, -1, 1], np.int32), ValueError),  # below -1
        (np.array([-1, -9, -1, 1], np.int32), ValueError),
        ("ab", TypeError),  # not a buffer
        (7, TypeError),
    ],
)
def test_sizes_that_do_not_fit_the_rows_are_refused(sizes: Any, error: type[Exception]) -> None:
    plan_ = speedups.plan_batches
    assert plan_ is not None
    with pytest.raises(error):
        plan_([b"a", b"b"], [None, None], [1, 1], None, [2], 100, b"\x00", sizes)


@pytest.mark.parametrize("lie", [1, -1])
def test_sizes_that_lie_make_a_batch_that_is_refused_not_written(lie: int) -> None:
    """Lengths other than the rows' own cut batches of the wrong size: writing one is an
    EncodeError, whatever the codec, never a batch whose framing disagrees with its
    records."""
    values, keys = [b"abc", b"de"], [None, b"k"]
    sizes = _sizes(values, keys)
    sizes[1] += lie
    source = Source(values, keys, [1, 1], b"\x00", sizes)
    ((_, batch),) = plan(source, None, [(0, 0, 2)], 1 << 20)
    for codec in (BatchSettings(), BatchSettings(LZ4)):
        with pytest.raises(EncodeError):
            batch.write_into(memoryview(bytearray(HEADER_SIZE + 64)), 0, settings=codec)


def test_plan_maps_partitions_and_stages_with_headers_carry_their_sections() -> None:
    values = [b"v%d" % i for i in range(6)]
    keys: list[bytes | None] = [None] * 6
    stage = _stage(values, keys, [5] * 6)
    source = staged_source(stage)
    assert source is not None and source.headers == b"\x00"
    order = np.array([1, 3, 5, 0, 2, 4], np.intp)
    todo = plan(source, order, [(7, 0, 3), (2, 3, 6)], 1 << 20)
    assert [(p, b.lo, b.record_count) for p, b in todo] == [(7, 0, 3), (2, 3, 3)]
    stage.headers = [encode_headers([("h", b"%d" % i)]) if i % 2 else b"\x00" for i in range(6)]
    source = staged_source(stage)
    assert source is not None and source.headers is stage.headers
    (_, batch), _ = plan(source, order, [(7, 0, 3), (2, 3, 6)], 1 << 20)
    out = bytearray(HEADER_SIZE + batch.section_size)
    batch.write_into(memoryview(out), 0)
    (decoded,) = decode_batches(bytes(out))
    assert [(r.value, r.headers) for r in decoded.records] == [
        (b"v%d" % i, [("h", b"%d" % i)]) for i in (1, 3, 5)
    ]


def test_other_arrow_types_stay_out() -> None:
    ts = np.zeros(1, np.int64)
    assert arrow_source(pa.array(["a"]), None, ts, None) is None  # string: not binary
    assert arrow_source(pa.array([b"a"]), pa.array(["k"]), ts, None) is None
    assert arrow_source(pa.array([b"a"], pa.binary_view()), None, ts, None) is None


def test_arrow_buffers_that_lie_are_refused() -> None:
    """Offsets past the data buffer, a short offsets or validity buffer: a typed error,
    never a read outside the buffers."""
    encode = speedups.encode_records
    assert encode is not None
    data = b"abcdef"
    good = np.array([0, 3, 6], np.int32).tobytes()
    out = bytearray(256)
    assert encode((2, 0, 4, None, good, data), None, 1, None, 0, 2, 1, out, 0) > 0
    cases = [
        ((2, 0, 4, None, np.array([0, 3, 7], np.int32).tobytes(), data), ValueError),
        ((2, 0, 4, None, np.array([0, 4, 3], np.int32).tobytes(), data), ValueError),
        ((2, 0, 4, None, np.array([-1, 3, 6], np.int32).tobytes(), data), ValueError),
        ((2, 0, 4, None, good[:8], data), ValueError),  # offsets too short
        ((2, 1, 4, None, good, data), ValueError),  # the array's offset runs past them
        ((2, 0, 8, None, good, data), ValueError),  # int64 offsets: too short
        ((2, 0, 4, b"", good, data), ValueError),  # validity too short
        ((2, 0, 3, None, good, data), ValueError),  # width
        ((-1, 0, 4, None, good, data), ValueError),
        ((2, 0, 4, None, good, None), ValueError),  # offsets into no data
        ((2, 0, 4, None, 5, data), TypeError),
        ((2, 0, 4, None, good), TypeError),
    ]
    for col, error in cases:
        with pytest.raises(error):
            encode(col, None, 1, None, 0, 2, 1, out, 0)


def test_rows_asked_for_ahead_encode_as_the_reference() -> None:
    """encode_records asks for the bytes of rows ahead of the one it copies (the first
    1 KiB of each): values longer than that, shorter, empty and null, in a shuffled
    order, come out as the per-record encoder writes them."""
    rng = np.random.default_rng(7)
    n = 64
    sizes = rng.choice([0, 1, 63, 64, 65, 1023, 1024, 1025, 3000], n)
    values: list[bytes | None] = [rng.bytes(int(z)) for z in sizes]
    values[5] = values[40] = None
    keys: list[bytes | None] = [rng.bytes(16) if i % 3 else None for i in range(n)]
    order = rng.permutation(n).astype(np.int64)
    source = arrow_source(pa.array(values, pa.binary()), pa.array(keys, pa.binary()), 7, None)
    assert source is not None
    ((_, batch),) = plan(source, order, [(0, 0, n)], 1 << 20)
    want = _reference(values, keys, [7] * n, order.tolist(), 7, [[]] * n)
    out = bytearray(len(want))
    assert batch.write_into(memoryview(out), 0) == len(want)
    assert bytes(out) == want


def test_a_lying_offset_ahead_is_refused_when_its_row_is_reached() -> None:
    """The row asked for ahead has an offset past the data, or before it: nothing is
    read from there, and the row is refused with a typed error when it is copied."""
    encode = speedups.encode_records
    assert encode is not None
    n = 40
    for bad in (10**9, -(10**6)):
        offsets = np.arange(0, 4 * (n + 1), 4, dtype=np.int32)
        offsets[20] = bad
        column = (n, 0, 4, None, offsets.tobytes(), b"v" * (4 * n))
        out = bytearray(64 * n)
        with pytest.raises(ValueError, match="outside its data buffer"):
            encode(column, None, 1, None, 0, n, 1, out, 0)


def test_chunks_that_lie_are_refused() -> None:
    """The chunked form (held calls' values): every chunk checked as an Arrow column,
    the rows counted across chunks; a typed error for a bad one."""
    encode = speedups.encode_records
    assert encode is not None
    good = (2, 0, 4, None, np.array([0, 3, 6], np.int32).tobytes(), b"abcdef")
    out = bytearray(256)
    assert encode(([good, good],), None, 1, None, 0, 4, 1, out, 0) > 0
    cases = [
        (([],), TypeError),  # no chunks
        ((good,), TypeError),  # not a list
        (([good, 5],), TypeError),
        (([good, ([good],)],), TypeError),  # chunks inside a chunk
        (([good, (2, 0, 4, None, good[4], b"abc")],), ValueError),  # offsets past data
        (([good, (2, 0, 4, b"", good[4], b"abcdef")],), ValueError),  # validity too short
    ]
    for col, error in cases:
        with pytest.raises(error):
            encode(col, None, 1, None, 0, 4, 1, out, 0)
    with pytest.raises(ValueError):  # 4 rows in the chunks, 3 keys
        encode(([good, good],), [None] * 3, 1, None, 0, 2, 1, out, 0)
    with pytest.raises(ValueError):  # a row past the chunks
        encode(([good],), None, 1, None, 0, 3, 1, out, 0)


def test_a_buffer_too_small_is_an_error_not_an_overrun() -> None:
    source = Source([b"x" * 100], [b"k"], [1], b"\x00")
    ((_, batch),) = plan(source, None, [(0, 0, 1)], 1000)
    buf = bytearray(HEADER_SIZE + batch.section_size + 16)
    with pytest.raises(EncodeError):
        batch.write_into(memoryview(buf)[: HEADER_SIZE + batch.section_size - 1], 0)
    encode = speedups.encode_records
    assert encode is not None
    guard = bytearray(b"\xee" * 64)
    with pytest.raises(ValueError, match="do not fit"):
        encode([b"x" * 100], [b"k"], [1], None, 0, 1, 1, memoryview(guard)[:32], 0)
    assert guard[32:] == b"\xee" * 32


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (([b"a"], [None], [1], None, [1], 10), None),
        (([b"a"], [None, None], [1], None, [1], 10), ValueError),  # lengths differ
        ((b"a", [None], [1], None, [1], 10), TypeError),  # not a list
        (([bytearray(b"a")], [None], [1], None, [1], 10), TypeError),  # not bytes
        (([b"a"], ["k"], [1], None, [1], 10), TypeError),
        (([b"a"], [None], [1.5], None, [1], 10), TypeError),
        (([b"a"], [None], 1.5, None, [1], 10), TypeError),
        (([b"a"], [None], -3, None, [1], 10), ValueError),
        (([b"a"], [None], np.array([1], np.int32), None, [1], 10), TypeError),
        (([b"a"], [None], np.array([1, 2], np.int64), None, [1], 10), ValueError),
        (([b"a"], [None], np.array([-1], np.int64), None, [1], 10), ValueError),
        (([b"a"], [None], [-1], None, [1], 10), ValueError),
        (([b"a"], [None], [1 << 64], None, [1], 10), OverflowError),
        (([b"a"], [None], [1], np.array([1], np.int64), [1], 10), IndexError),
        (([b"a"], [None], [1], np.array([-1], np.int64), [1], 10), IndexError),
        (([b"a"], [None], [1], np.array([0], np.int32), [1], 10), TypeError),
        (([b"a"], [None], [1], np.array([0, 0], np.int64), [1], 10), ValueError),
        (([b"a"], [None], [1], None, [2], 10), ValueError),  # ends past the rows
        (([b"a", b"b"], [None, None], [1, 1], None, [1], 10), ValueError),  # short
        (([b"a", b"b"], [None, None], [1, 1], None, [2, 1], 10), ValueError),
        (([b"a"], [None], [1], None, (1,), 10), TypeError),
        # per-row headers: one non-empty bytes section per row
        (([b"a"], [None], [1], None, [1], 10, [b"\x00", b"\x00"]), ValueError),
        (([b"a"], [None], [1], None, [1], 10, [b""]), TypeError),
        (([b"a"], [None], [1], None, [1], 10, [[("h", b"v")]]), TypeError),
        (([b"a"], [None], [1], None, [1], 10, [None]), TypeError),
        (([b"a"], [None], [1], None, [1], 10, b""), TypeError),
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], error: type[Exception] | None) -> None:
    plan = speedups.plan_batches
    encode = speedups.encode_records
    assert plan is not None and encode is not None
    values, keys, ts, order, _ends, _budget, *headers = args
    if error is None:
        plan(*args)
        return
    with pytest.raises(error):
        plan(*args)
    one_row = isinstance(values, list) and isinstance(keys, list) and len(values) == len(keys) == 1
    if one_row and _ends == [1]:  # encode_records takes the same rows: the same error
        with pytest.raises(error):
            encode(values, keys, ts, order, 0, 1, 0, bytearray(64), 0, *headers)


@pytest.mark.parametrize("bounds", [(-1, 1, 0), (0, 2, 0), (1, 0, 0), (0, 1, -1), (0, 1, 65)])
def test_encode_checks_rows_and_offset(bounds: tuple[int, int, int]) -> None:
    encode = speedups.encode_records
    assert encode is not None
    lo, hi, offset = bounds
    with pytest.raises(ValueError):
        encode([b"a"], [None], [1], None, lo, hi, 1, bytearray(64), offset)


def test_read_only_output_is_refused() -> None:
    encode = speedups.encode_records
    assert encode is not None
    with pytest.raises(TypeError):
        encode([b"a"], [None], [1], None, 0, 1, 1, b"\x00" * 64, 0)


# ---------------------------------------------------------------------------------------
# murmur2_partitions: Java's key partitioning in one pass (shmprod.partitioner uses it)
# ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(blobs, min_size=0, max_size=60),
    st.integers(1, 2**31 - 1) | st.sampled_from([1, 2, 12, 1000]),
    st.integers(0, 5),
)
def test_murmur2_partitions_is_javas_partition_of_each_key(
    keys: list[bytes | None], nparts: int, cut: int
) -> None:
    from shmprod.partitioner import partition_for_key

    c = speedups.murmur2_partitions
    assert c is not None
    want = [-1 if k is None else partition_for_key(k, nparts) for k in keys]
    out = np.full(len(keys), 99, np.int32)
    c(keys, nparts, out)
    assert out.tolist() == want
    for typ in (pa.binary(), pa.large_binary()):  # Arrow buffers, sliced
        arr = pa.array(keys, typ).slice(min(cut, len(keys)))
        validity, offsets, data = arr.buffers()
        width = 8 if typ == pa.large_binary() else 4
        src = (len(arr), arr.offset, width, validity if arr.null_count else None, offsets, data)
        part = np.full(len(arr), 99, np.int32)
        c(src, nparts, part)
        assert part.tolist() == want[min(cut, len(keys)) :]


def test_murmur2_partitions_bad_arguments() -> None:
    c = speedups.murmur2_partitions
    assert c is not None
    with pytest.raises(ValueError):
        c([b"a"], 0, np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        c([b"a", b"b"], 3, np.zeros(1, np.int32))  # out too short
    with pytest.raises(TypeError):
        c(["text"], 3, np.zeros(1, np.int32))  # staged keys are bytes
    with pytest.raises(TypeError):
        c([b"a"], 3, b"\x00" * 4)  # read-only out
    offsets = np.array([0, 4, 100], np.int32)  # the second key runs past the data
    with pytest.raises(ValueError):
        c((2, 0, 4, None, offsets, b"abcd"), 3, np.zeros(2, np.int32))
