"""Futures: one outcome per Kafka batch, record futures as (outcome, index), and batch
futures that fill offsets in input order with numpy."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np
import pytest

from shmprod.errors import KafkaError, SenderDiedError
from shmprod.futures import (
    BatchFuture,
    BatchOutcome,
    OutcomePiece,
    RecordFuture,
    RecordMetadata,
    Stamps,
)
from shmprod.worker.staging import Stage, stamp_runs


@pytest.fixture
def lock() -> threading.Lock:
    return threading.Lock()


def record(outcome: BatchOutcome, index: int, timestamp_ms: int) -> RecordFuture:
    """The future of a record staged alone, flushed as record ``index`` of the batch
    that ``outcome`` completes (what ``send`` returns once its stage is flushed)."""
    stage = Stage(outcome.topic, 0, threading.Lock())
    stage.timestamps.append(timestamp_ms)
    stage.n = 1
    one = np.ones(1, np.int32)
    stage.resolve([outcome], one * 0, one * index, stamp_runs(stage.timestamps))
    return RecordFuture(stage, 0)


def test_a_staged_record_waits_for_its_flush(lock: threading.Lock) -> None:
    stage = Stage("t", 0, lock)
    stage.timestamps.append(7)
    stage.n = 1
    f = RecordFuture(stage, 0)
    assert not f.done()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(0.01)
    seen: list[object] = []
    f.add_done_callback(seen.append)
    o = BatchOutcome(lock, "t", 2)
    one = np.ones(1, np.int32)
    threading.Timer(
        0.05, stage.resolve, args=([o], one * 0, one * 4, stamp_runs(stage.timestamps))
    ).start()
    threading.Timer(0.1, o.succeed, args=(100,)).start()
    assert f.result(5) == RecordMetadata("t", 2, 104, 7)
    assert seen == [f]
    failed = Stage("t", 0, lock)
    failed.n = 1
    g = RecordFuture(failed, 0)
    failed.fail(SenderDiedError("gone"))
    assert isinstance(g.exception(0), SenderDiedError)


def test_record_future_offset_is_base_plus_index(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 3)
    futs = [record(o, i, 1000 + i) for i in range(3)]
    assert not any(f.done() for f in futs) and futs[0].running()
    o.succeed(500)
    assert [f.result(0) for f in futs] == [
        RecordMetadata("t", 3, 500 + i, 1000 + i) for i in range(3)
    ]
    assert futs[1].exception(0) is None
    assert not futs[0].cancel() and not futs[0].cancelled()


def test_log_append_time_and_acks0(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 0)
    o.succeed(-1, 777)
    md = record(o, 4, 1).result(0)
    assert md.offset == -1 and md.timestamp_ms == 777


def test_failure_raises_and_first_outcome_sticks(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 0)
    f = record(o, 0, 0)
    o.fail(KafkaError(87))
    o.succeed(1)  # ignored
    with pytest.raises(KafkaError) as ei:
        f.result(0)
    assert ei.value.code == 87
    assert isinstance(f.exception(0), KafkaError)


def test_result_times_out(lock: threading.Lock) -> None:
    f = record(BatchOutcome(lock, "t", 0), 0, 0)
    t0 = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(0.05)
    with pytest.raises(TimeoutError):
        f.exception(0.01)
    assert time.monotonic() - t0 < 2


def test_waiter_wakes_when_resolved_from_another_thread(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 0)
    f = record(o, 2, 0)
    threading.Timer(0.05, o.succeed, args=(10,)).start()
    assert f.result(5).offset == 12


def test_callbacks_run_once_and_at_once_when_done(
    lock: threading.Lock, caplog: pytest.LogCaptureFixture
) -> None:
    o = BatchOutcome(lock, "t", 0)
    f = record(o, 0, 0)
    seen: list[object] = []

    def boom(_f: RecordFuture) -> None:
        raise RuntimeError("callback bug")

    f.add_done_callback(seen.append)
    f.add_done_callback(boom)
    f.add_done_callback(lambda fut: seen.append(fut.result(0).offset))
    with caplog.at_level(logging.ERROR, logger="shmprod.futures"):
        o.succeed(9)
    assert seen == [f, 9]
    assert "callback" in caplog.text
    f.add_done_callback(seen.append)  # already done: runs now
    assert seen[-1] is f


def test_to_concurrent(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 1)
    cf = record(o, 1, 5).to_concurrent()
    assert isinstance(cf, concurrent.futures.Future) and not cf.done()
    o.succeed(10)
    assert cf.result(1) == RecordMetadata("t", 1, 11, 5)
    o2 = BatchOutcome(lock, "t", 1)
    cf2 = record(o2, 0, 0).to_concurrent()
    o2.fail(SenderDiedError("gone"))
    assert isinstance(cf2.exception(1), SenderDiedError)


def test_record_future_is_not_picklable(lock: threading.Lock) -> None:
    import pickle

    with pytest.raises(TypeError):
        pickle.dumps(record(BatchOutcome(lock, "t", 0), 0, 0))


def _batch_future(lock: threading.Lock) -> tuple[BatchFuture, list[BatchOutcome]]:
    # 6 input rows; partitions [1, 0, 1, 0, 0, 1]; stable sort -> rows 1,3,4 | 0,2,5
    parts = np.array([1, 0, 1, 0, 0, 1], np.int32)
    order = np.argsort(parts, kind="stable")
    outcomes = [BatchOutcome(lock, "t", 0), BatchOutcome(lock, "t", 1), BatchOutcome(lock, "t", 1)]
    ts = np.arange(100, 106, dtype=np.int64)
    fut = BatchFuture(lock, "t", parts, ts, order, outcomes, [3, 2, 1])
    return fut, outcomes


def test_batch_future_offsets_in_input_order(lock: threading.Lock) -> None:
    fut, outcomes = _batch_future(lock)
    seen: list[BatchFuture] = []
    fut.add_done_callback(seen.append)
    outcomes[0].succeed(40)
    outcomes[2].succeed(90)
    assert not fut.done() and not seen
    outcomes[1].succeed(70, 5555)
    md = fut.result(1)
    assert seen == [fut]
    assert md.partitions.tolist() == [1, 0, 1, 0, 0, 1]
    # partition 0 rows 1,3,4 -> 40,41,42; partition 1 rows 0,2 -> 70,71 and row 5 -> 90
    assert md.offsets.tolist() == [70, 40, 71, 41, 42, 90]
    assert md.timestamps_ms.tolist() == [5555, 101, 5555, 103, 104, 105]
    assert len(md) == 6 and md.topic == "t"


def test_batch_future_failure_and_partial_result(lock: threading.Lock) -> None:
    fut, outcomes = _batch_future(lock)
    outcomes[1].fail(KafkaError(10))
    outcomes[0].succeed(0)
    outcomes[2].fail(KafkaError(2))
    with pytest.raises(KafkaError) as ei:
        fut.result(1)
    assert ei.value.code == 10  # the first error sticks
    md = fut.partial_result(0)
    assert md.offsets.tolist() == [-1, 0, -1, 1, 2, -1]
    assert fut.exception(0) is ei.value


def test_stamps_keep_runs_and_give_every_row(lock: threading.Lock) -> None:
    """A held whole's timestamps: one run per call, an int for a call's one timestamp,
    an array for per-row ones; rows() gives them in input order, in a new array."""
    per_row = np.array([7, 8], np.int64)
    stamps = Stamps([(3, 100), (2, per_row), (0, 5), (1, 200)])
    assert stamps.n == 6
    got = stamps.rows()
    assert got.dtype == np.int64 and got.tolist() == [100, 100, 100, 7, 8, 200]
    got[3] = 0
    assert per_row.tolist() == [7, 8]  # a copy, never the caller's array
    assert Stamps([(2, 9), (1, 10)]).rows().tolist() == [9, 9, 10]
    assert Stamps.of(0, 1).rows().tolist() == []
    with pytest.raises(ValueError):
        Stamps.of(3, np.zeros(2, np.int64))
    # a future given one timestamp for every row reports it for each
    parts = np.array([0, 1, 0], np.int32)
    outcome = BatchOutcome(lock, "t", 0)
    fut = BatchFuture(lock, "t", parts, Stamps.of(3, 1234), None, [outcome], [3])
    outcome.succeed(10)
    md = fut.result(1)
    assert md.timestamps_ms.tolist() == [1234] * 3 and md.offsets.tolist() == [10, 11, 12]
    with pytest.raises(ValueError):
        BatchFuture(lock, "t", parts, Stamps.of(2, 1), None, [outcome], [2])


def test_batch_future_empty_and_timeout(lock: threading.Lock) -> None:
    empty = BatchFuture(lock, "t", np.zeros(0, np.int32), np.zeros(0, np.int64), None, [], [])
    assert empty.done() and len(empty.result(0)) == 0
    fut, _ = _batch_future(lock)
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(0.01)
    with pytest.raises(ValueError):
        BatchFuture(lock, "t", np.zeros(2, np.int32), np.zeros(2, np.int64), None, [], [1])


def test_batch_future_to_concurrent(lock: threading.Lock) -> None:
    fut, outcomes = _batch_future(lock)
    cf = fut.to_concurrent()
    for o in outcomes:
        o.succeed(0)
    assert len(cf.result(1)) == 6


def test_split_batch_pieces_resolve_records_one_by_one(lock: threading.Lock) -> None:
    o = BatchOutcome(lock, "t", 2)
    futs = [record(o, i, 1000 + i) for i in range(5)]
    o.resolve_pieces(
        (
            OutcomePiece(0, 2, 70, -1, None),
            OutcomePiece(2, 1, -1, -1, KafkaError(10)),
            OutcomePiece(3, 2, 90, 5555, None),
        )
    )
    assert [f.result(0).offset for f in (futs[0], futs[1])] == [70, 71]
    with pytest.raises(KafkaError):
        futs[2].result(0)
    assert isinstance(futs[2].exception(0), KafkaError) and futs[3].exception(0) is None
    assert futs[4].result(0) == RecordMetadata("t", 2, 91, 5555)
    assert not o.succeeded and isinstance(o.error, KafkaError)
    o.succeed(1)  # the first outcome sticks
    assert futs[0].result(0).offset == 70


def test_batch_future_with_a_split_batch(lock: threading.Lock) -> None:
    fut, outcomes = _batch_future(lock)
    outcomes[0].resolve_pieces((OutcomePiece(0, 1, 40, -1, None), OutcomePiece(1, 2, 60, -1, None)))
    outcomes[1].succeed(70)
    outcomes[2].succeed(90)
    # partition 0 rows 1 | 3,4 -> 40 | 60,61
    assert fut.result(1).offsets.tolist() == [70, 40, 71, 60, 61, 90]
    fut2, outcomes2 = _batch_future(lock)
    outcomes2[0].resolve_pieces(
        (OutcomePiece(0, 1, -1, -1, KafkaError(10)), OutcomePiece(1, 2, 60, -1, None))
    )
    outcomes2[1].succeed(70)
    outcomes2[2].succeed(90)
    with pytest.raises(KafkaError):
        fut2.result(1)
    assert fut2.partial_result(0).offsets.tolist() == [70, -1, 71, 60, 61, 90]
