"""A flush's rows grouped by partition and placed in their batches, in C
(``speedups.partition_order``, ``speedups.row_places``; ``shmprod.worker.bulk._order`` and
``_row_places``) and in numpy, and its timestamps kept as runs (``speedups.stamp_runs``,
``shmprod.worker.staging.stamp_runs``): the same answer for any partitions, cuts and
timestamps, and a typed error, never a write outside a buffer, for bad arguments."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import speedups
from shmprod.errors import ProducerError
from shmprod.worker.bulk import _order, _order_numpy, _row_places, _row_places_numpy
from shmprod.worker.staging import Stage, StampRuns, stamp_runs, stamp_runs_numpy

pytestmark = pytest.mark.skipif(not speedups.ACCELERATED, reason="the C extension is not in use")


@st.composite
def partitions(draw: Any) -> np.ndarray:
    """Rows' partitions: random (keyed), in runs (null keys, sticky), or one run each."""
    form = draw(st.sampled_from(["random", "runs", "grouped"]))
    top = draw(st.integers(0, 40))
    if form == "random":
        rows = draw(st.lists(st.integers(0, top), min_size=1, max_size=300))
    else:
        parts = draw(st.lists(st.integers(0, top), min_size=1, max_size=12))
        if form == "grouped":
            parts = list(dict.fromkeys(parts))
        rows = [p for p in parts for _ in range(draw(st.integers(1, 30)))]
    return np.array(rows, np.int32)


@settings(max_examples=300, deadline=None)
@given(partitions(), st.data())
def test_c_and_numpy_group_and_place_rows_alike(parts: np.ndarray, data: Any) -> None:
    order, ranges = _order(parts)
    want_order, want_ranges = _order_numpy(parts)
    assert ranges == want_ranges
    assert (order is None) == (want_order is None)
    if order is not None and want_order is not None:
        assert order.tolist() == want_order.tolist()
    n = len(parts)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=8))) if n > 1 else []
    counts = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, n], strict=True)]
    got = _row_places(order, counts, n)
    want = _row_places_numpy(order, counts, n)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_many_runs_of_few_partitions_are_sorted() -> None:
    parts = np.tile(np.array([3, 1], np.int32), 5000)  # 10,000 runs: above the grouped limit
    order, ranges = _order(parts)
    assert order is not None and ranges == [(1, 0, 5000), (3, 5000, 10000)]
    assert order[:3].tolist() == [1, 3, 5] and order[5000:5003].tolist() == [0, 2, 4]


@pytest.mark.parametrize(
    ("parts", "order", "error"),
    [
        (np.array([0, -1], np.int32), np.empty(2, np.int64), ValueError),  # below 0
        (np.array([0, 1], np.int64), np.empty(2, np.int64), TypeError),  # not int32
        (np.array([0, 1], np.int32), np.empty(2, np.int32), TypeError),  # order not int64
        (np.array([0, 1], np.int32), np.empty(3, np.int64), ValueError),  # lengths differ
        (np.array([0, 1], np.int32), b"\x00" * 16, BufferError),  # read-only order
        ([0, 1], np.empty(2, np.int64), TypeError),  # not a buffer
    ],
)
def test_partition_order_refuses_bad_arguments(
    parts: Any, order: Any, error: type[Exception]
) -> None:
    fn = speedups.partition_order
    assert fn is not None
    with pytest.raises(error):
        fn(parts, order)


def test_partition_order_of_no_rows() -> None:
    fn = speedups.partition_order
    assert fn is not None
    assert fn(np.zeros(0, np.int32), np.zeros(0, np.int64)) == (False, [])


@pytest.mark.parametrize(
    ("order", "counts", "n", "error"),
    [
        (None, [1, 1], 3, ValueError),  # the counts sum to less than the rows
        (None, [2, 2], 3, ValueError),  # ... to more
        (None, [-1, 4], 3, ValueError),
        (None, [1, "x"], 2, TypeError),
        (np.array([0, 5], np.int64), [2], 2, IndexError),  # a row out of range
        (np.array([0, -1], np.int64), [2], 2, IndexError),
        (np.array([0, 1], np.int32), [2], 2, ValueError),  # order not int64
        (np.array([0, 1, 2], np.int64), [2], 2, ValueError),  # order of other rows
    ],
)
def test_row_places_refuses_bad_arguments(
    order: Any, counts: list[Any], n: int, error: type[Exception]
) -> None:
    fn = speedups.row_places
    assert fn is not None
    batch, index = np.full(n, -7, np.int32), np.full(n, -7, np.int32)
    with pytest.raises(error):
        fn(order, counts, batch, index)
    with pytest.raises(TypeError):  # outputs that are not writable int32 buffers
        fn(None, [n], np.zeros(n, np.int64), index)
    with pytest.raises(BufferError):  # read-only
        fn(None, [n], b"\x00" * (4 * n), index)
    with pytest.raises(ValueError):
        fn(None, [n], batch, np.zeros(n + 1, np.int32))


def test_a_bad_grouping_is_a_producer_error_not_a_crash() -> None:
    with pytest.raises(ProducerError):
        _order(np.array([0, -3], np.int32))
    with pytest.raises(ProducerError):
        _row_places(None, [5], 2)


def _every_row(runs: StampRuns, n: int) -> list[int]:
    starts, values = runs
    if starts is None:
        return [int(v) for v in values]
    return np.repeat(values, np.diff([*starts.tolist(), n])).tolist()


@st.composite
def staged_timestamps(draw: Any) -> list[int]:
    """Timestamps as send() stages them: runs of one int object (a millisecond's rows),
    equal ints that are other objects, or any int64 per row."""
    out: list[int] = []
    for _ in range(draw(st.integers(0, 12))):
        ts = draw(st.integers(0, 2**63 - 1))
        same_object = draw(st.booleans())
        for _ in range(draw(st.integers(1, 40))):
            out.append(ts if same_object else int(str(ts)))  # equal, not the same object
    return out


@settings(max_examples=300, deadline=None)
@given(staged_timestamps())
def test_c_and_numpy_keep_timestamps_alike(timestamps: list[int]) -> None:
    got = stamp_runs(timestamps)
    want = stamp_runs_numpy(timestamps)
    assert _every_row(got, len(timestamps)) == _every_row(want, len(timestamps)) == timestamps
    assert (got[0] is None) == (want[0] is None)
    stage = Stage("t", 0, threading.Lock())
    stage.stamp_starts, stage.stamp_values = got
    assert [stage.timestamp_of(r) for r in range(len(timestamps))] == timestamps


def test_timestamps_are_kept_as_runs_only_when_smaller() -> None:
    one_ms = [1_700_000_000_000] * 1000 + [1_700_000_000_001] * 1000
    starts, values = stamp_runs(one_ms)
    assert starts is not None and starts.tolist() == [0, 1000] and values.tolist() == one_ms[::1000]
    assert (starts.typecode, starts.itemsize, values.typecode) == ("i", 4, "q")
    every = list(range(100))  # a run per row: 12 bytes a row, against 8 as one array
    starts, values = stamp_runs(every)
    assert starts is None and values.tolist() == every
    starts, values = stamp_runs([])
    assert starts is not None and len(starts) == len(values) == 0


@pytest.mark.parametrize(
    ("timestamps", "error"),
    [
        ([1, "x"], TypeError),  # not an int
        ([1, 2.0], TypeError),
        ([2**63], OverflowError),
        ([-(2**63) - 1], OverflowError),
        ((1, 2), TypeError),  # not a list
    ],
)
def test_stamp_runs_refuses_bad_arguments(timestamps: Any, error: type[Exception]) -> None:
    fn = speedups.stamp_runs
    assert fn is not None
    with pytest.raises(error):
        fn(timestamps, np.zeros(4, np.int32), np.zeros(4, np.int64))
    if isinstance(timestamps, list):
        with pytest.raises(ProducerError):  # what a flush sees: nothing handed over yet
            stamp_runs(timestamps)


def test_stamp_runs_refuses_outputs_it_cannot_fill() -> None:
    fn = speedups.stamp_runs
    assert fn is not None
    ts = [5, 5, 6]
    with pytest.raises(ValueError):  # shorter than the rows
        fn(ts, np.zeros(2, np.int32), np.zeros(3, np.int64))
    with pytest.raises(ValueError):
        fn(ts, np.zeros(3, np.int32), np.zeros(2, np.int64))
    with pytest.raises(TypeError):  # not int32 and int64
        fn(ts, np.zeros(3, np.int64), np.zeros(3, np.int64))
    with pytest.raises(TypeError):
        fn(ts, np.zeros(3, np.int32), np.zeros(3, np.int32))
    with pytest.raises(BufferError):  # read-only
        fn(ts, b"\x00" * 12, np.zeros(3, np.int64))
    starts, values = np.full(3, -1, np.int32), np.full(3, -1, np.int64)
    assert fn(ts, starts, values) == 2
    assert starts[:2].tolist() == [0, 2] and values[:2].tolist() == [5, 6]
