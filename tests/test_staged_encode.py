"""The staged-rows encoder in C (shmprod._speedups: plan_batches, encode_records,
staged_lengths) that a flush of ``send()``'s records uses: batches byte-identical to
the per-record encoder's, cut within the byte budget and never across a partition,
and a typed error, never a crash or a write past the buffer, for bad arguments."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import speedups
from shmprod.errors import EncodeError
from shmprod.protocol.compression import LZ4
from shmprod.protocol.records import HEADER_SIZE, NewRecord, decode_batches, encode_batch
from shmprod.worker.staging import Stage, StagedBatch, direct_batches

pytestmark = pytest.mark.skipif(not speedups.ACCELERATED, reason="the C extension is not in use")

BIG_TS = (1 << 63) - 1

blobs = st.one_of(st.none(), st.binary(max_size=300))
stamps = st.one_of(
    st.integers(0, 2_000_000_000_000),
    st.sampled_from([0, 1, BIG_TS, BIG_TS - 1, 1 << 55, (1 << 55) + 1]),
)


@st.composite
def staged(draw: Any) -> tuple[list[Any], list[Any], list[int], np.ndarray | None, list[int]]:
    n = draw(st.integers(1, 40))
    values = draw(st.lists(blobs, min_size=n, max_size=n))
    keys = draw(st.lists(blobs, min_size=n, max_size=n))
    ts = draw(st.lists(stamps, min_size=n, max_size=n))
    order = None
    if draw(st.booleans()):
        order = np.array(draw(st.permutations(range(n))), np.int64)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=5))) if n > 1 else []
    return values, keys, ts, order, [*cuts, n]


def _reference(
    values: list[Any], keys: list[Any], ts: list[int], rows: list[int], base: int
) -> bytes:
    return encode_batch(
        [NewRecord(keys[r], values[r], (), ts[r]) for r in rows], base_timestamp_ms=base
    )


def _stage(values: list[Any], keys: list[Any], ts: list[int]) -> Stage:
    stage = Stage("t", 0, threading.Lock())
    stage.values, stage.keys, stage.timestamps = values, keys, ts
    stage.n = len(values)
    return stage


@settings(max_examples=300, deadline=None)
@given(staged(), st.integers(1, 2000))
def test_batches_match_the_per_record_encoder(case: Any, budget: int) -> None:
    values, keys, ts, order, ends = case
    plan = speedups.plan_batches
    assert plan is not None
    cuts = plan(values, keys, ts, order, ends, budget)
    n = len(values)
    rows = list(range(n)) if order is None else order.tolist()
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    for (_, hi, *_), (lo, *_) in itertools.pairwise(cuts):
        assert hi == lo  # contiguous
    stage = _stage(values, keys, ts)
    for lo, hi, size, base, top in cuts:
        assert hi > lo
        assert not any(lo < e < hi for e in ends)  # never across a partition's end
        assert size <= budget or hi - lo == 1  # a record too big goes alone
        batch_rows = rows[lo:hi]
        assert base == ts[batch_rows[0]] and top == max(ts[r] for r in batch_rows)
        want = _reference(values, keys, ts, batch_rows, base)
        assert len(want) == HEADER_SIZE + size
        out = bytearray(len(want) + 7)
        sb = StagedBatch(stage, order, lo, hi, size, base, top)
        end = sb.write_into(memoryview(out), 3)
        assert end == 3 + len(want)
        assert bytes(out[3:end]) == want
        if hi < n and hi not in ends:  # the batch is full: the next record does not fit
            longer = _reference(values, keys, ts, rows[lo : hi + 1], base)
            assert len(longer) - HEADER_SIZE > budget


@settings(max_examples=100, deadline=None)
@given(staged())
def test_lengths_and_compressed_batches(case: Any) -> None:
    values, keys, ts, order, ends = case
    assert speedups.staged_lengths is not None and speedups.plan_batches is not None
    out = np.full(len(values), -7, np.int64)
    speedups.staged_lengths(values, keys, out)
    assert out.tolist() == [
        len(v or b"") + len(k or b"") for v, k in zip(values, keys, strict=True)
    ]
    stage = _stage(values, keys, ts)
    rows = list(range(len(values))) if order is None else order.tolist()
    for lo, hi, size, base, top in speedups.plan_batches(values, keys, ts, order, ends, 1 << 20):
        buf = bytearray(HEADER_SIZE + size + 1024)
        end = StagedBatch(stage, order, lo, hi, size, base, top).write_into(
            memoryview(buf), 0, compression=LZ4
        )
        (batch,) = decode_batches(bytes(buf[:end]))
        got = [(r.key, r.value, r.timestamp_ms, r.headers) for r in batch.records]
        assert got == [(keys[r], values[r], ts[r], []) for r in rows[lo:hi]]


def test_direct_batches_map_partitions_and_skip_stages_with_headers() -> None:
    values = [b"v%d" % i for i in range(6)]
    keys: list[bytes | None] = [None] * 6
    stage = _stage(values, keys, [5] * 6)
    order = np.array([1, 3, 5, 0, 2, 4], np.intp)
    todo = direct_batches(stage, order, [(7, 0, 3), (2, 3, 6)], 1 << 20)
    assert todo is not None
    assert [(p, b.lo, b.record_count) for p, b in todo] == [(7, 0, 3), (2, 3, 3)]
    stage.headers = [[] for _ in range(6)]
    assert direct_batches(stage, order, [(7, 0, 3), (2, 3, 6)], 1 << 20) is None


def test_a_buffer_too_small_is_an_error_not_an_overrun() -> None:
    stage = _stage([b"x" * 100], [b"k"], [1])
    (cut,) = speedups.plan_batches([b"x" * 100], [b"k"], [1], None, [1], 1000)  # type: ignore[misc]
    sb = StagedBatch(stage, None, *cut[:2], *cut[2:])
    buf = bytearray(HEADER_SIZE + cut[2] + 16)
    with pytest.raises(EncodeError):
        sb.write_into(memoryview(buf)[: HEADER_SIZE + cut[2] - 1], 0)
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
    ],
)
def test_bad_arguments_raise(args: tuple[Any, ...], error: type[Exception] | None) -> None:
    plan = speedups.plan_batches
    encode = speedups.encode_records
    assert plan is not None and encode is not None
    values, keys, ts, order, _ends, _budget = args
    if error is None:
        plan(*args)
        return
    with pytest.raises(error):
        plan(*args)
    one_row = isinstance(values, list) and isinstance(keys, list) and len(values) == len(keys) == 1
    if one_row and _ends == [1]:  # encode_records takes the same rows: the same error
        with pytest.raises(error):
            encode(values, keys, ts, order, 0, 1, 0, bytearray(64), 0)


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
