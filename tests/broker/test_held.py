"""send_batch calls held so that batches fill across calls: which calls are held, when
they are written (next call overflowing, linger, flush, send() to the topic), the order
of a process's records, every row's offset and error, and failures after the call."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import Producer, speedups
from shmprod.broker import EmbeddedBroker
from shmprod.errors import ProducerError
from shmprod.futures import BatchFuture, BatchOutcome, OutcomePiece
from shmprod.worker import Worker, attach
from shmprod.worker.held import concat
from shmprod.worker.staging import Columns, HeldCalls
from tests.support.fake_sender import FakeSender
from tests.support.readback import consume_all


def _rows(
    fake: FakeSender, topic: str = "events"
) -> dict[tuple[int, int], tuple[bytes | None, bytes | None]]:
    return {
        (p, i): (r.key, r.value)
        for p, recs in fake.records(topic).items()
        for i, r in enumerate(recs)
    }


def _held(w: Worker, topic: str = "events") -> list[HeldCalls]:
    with w._lock:
        return [st for st in w._stages.get(topic, ()) if isinstance(st, HeldCalls)]


def test_small_calls_fill_batches_across_calls() -> None:
    """Calls of 20 keyed rows each: held, written together at flush() as full batches,
    and each call's future gives its own rows' partitions and offsets."""
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        calls = []
        for c in range(10):
            keys = [os.urandom(8) for _ in range(20)]
            values = [b"c%d-r%d" % (c, i) for i in range(20)]
            calls.append((keys, values, w.send_batch("events", values, keys=keys)))
        assert not fake.landed and not any(f.done() for _, _, f in calls)
        assert len(_held(w)) == 1 and _held(w)[0].n == 200
        assert w.stats()["worker"]["staged_records"] == 200
        w.flush(5)
        assert len(fake.landed) <= 4  # one batch per partition, not one per call and partition
        rows = _rows(fake)
        for keys, values, fut in calls:
            md = fut.result(5)
            got = [rows[(int(p), int(o))] for p, o in zip(md.partitions, md.offsets, strict=True)]
            assert got == list(zip(keys, values, strict=True))


@pytest.mark.parametrize("kw", [{"partitions": 1}, {"headers": [("h", b"1")]}])
def test_explicit_partitions_and_headers_are_written_at_the_call(kw: dict[str, object]) -> None:
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        fut = w.send_batch("events", [b"a", b"b"], **kw)  # type: ignore[arg-type]
        assert not _held(w)
        assert fut.result(5).offsets.tolist() == [0, 1]


def test_linger_zero_and_large_calls_are_not_held() -> None:
    with FakeSender(linger_ms=0) as fake, attach(fake.handle) as w:
        w.send_batch("events", [b"a", b"b"]).result(5)
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        values = [os.urandom(100) for _ in range(200)]  # over 7/8 of a batch per partition
        fut = w.send_batch("events", values)
        assert not _held(w)
        assert len(fut.result(5)) == 200


def test_linger_writes_held_calls_without_a_flush() -> None:
    with FakeSender(linger_ms=30) as fake, attach(fake.handle) as w:
        fut = w.send_batch("events", [b"a", b"b"], keys=[b"k", b"k"])
        md = fut.result(5)
        assert md.offsets.tolist() == [0, 1] and len(set(md.partitions.tolist())) == 1


def test_overflowing_call_writes_the_held_ones_first() -> None:
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        room = w._batch_size * 4 * 7 // 8
        values = [os.urandom(50) for _ in range(room // 2 // 62 - 1)]  # just under half
        first = [w.send_batch("events", values, partitions=None) for _ in range(2)]
        assert not fake.landed
        third = w.send_batch("events", values)
        assert fake.wait_for(lambda: len(fake.landed) > 0)
        assert all(len(f.result(5)) == len(values) for f in first)
        assert not third.done() and _held(w)[0].n == len(values)
        w.flush(5)
        assert len(third.result(5)) == len(values)


def test_a_process_records_keep_their_order() -> None:
    """send_batch (held), send(), send_batch: one key, so one partition, in that order."""
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        a = w.send_batch("events", [b"a1", b"a2"], keys=[b"k", b"k"])
        r = w.send("events", b"r", key=b"k")
        b = w.send_batch("events", [b"b1"], keys=[b"k"])
        c = w.send_batch("events", [b"c1"], keys=[b"k"], partitions=None)
        w.flush(5)
        got = [a.result(5).offsets.tolist(), [r.result(5).offset], b.result(5).offsets.tolist()]
        assert got == [[0, 1], [2], [3]] and c.result(5).offsets.tolist() == [4]
        part = int(a.result(5).partitions[0])
        assert [rec.value for rec in fake.records("events")[part]] == [
            b"a1",
            b"a2",
            b"r",
            b"b1",
            b"c1",
        ]


def test_mixed_column_types_are_joined() -> None:
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        f1 = w.send_batch("events", pa.array([b"v1", b"v2"], pa.binary()), keys=[b"k1", None])
        f2 = w.send_batch("events", pa.array(["v3"], pa.large_string()))
        f3 = w.send_batch(
            "events", np.array([b"v4", b"v5"]), keys=pa.array(["k4", "k5"], pa.large_string())
        )
        assert _held(w)[0].n == 5
        w.flush(5)
        rows = _rows(fake)
        got = []
        for fut in (f1, f2, f3):
            md = fut.result(5)
            got += [rows[(int(p), int(o))] for p, o in zip(md.partitions, md.offsets, strict=True)]
        assert got == [(b"k1", b"v1"), (None, b"v2"), (None, b"v3"), (b"k4", b"v4"), (b"k5", b"v5")]


def test_per_row_timestamps_are_copied_when_held() -> None:
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        ts = np.array([1_000, 2_000], np.int64)
        fut = w.send_batch("events", [b"a", b"b"], timestamps_ms=ts)
        ts[:] = 9  # the caller reuses its array
        w.flush(5)
        assert fut.result(5).timestamps_ms.tolist() == [1_000, 2_000]
        got = sorted(r.timestamp_ms for recs in fake.records("events").values() for r in recs)
        assert got == [1_000, 2_000]


def test_held_calls_fail_when_the_sender_dies() -> None:
    with FakeSender(linger_ms=60_000) as fake:
        w = attach(fake.handle)
        try:
            fut = w.send_batch("events", [b"a", b"b"])
            fake.die()
            assert isinstance(fut.exception(10), ProducerError)
            md = fut.partial_result(0)
            assert md.offsets.tolist() == [-1, -1] and md.partitions.tolist() == [-1, -1]
            [failure] = fut.failures(0)
            assert failure.rows.tolist() == [0, 1] and not failure.handed_over
        finally:
            w.close(timeout=5)


def test_callbacks_of_held_calls_run_once_written() -> None:
    with FakeSender(linger_ms=60_000) as fake, attach(fake.handle) as w:
        seen = threading.Event()
        fut = w.send_batch("events", [b"a"])
        fut.add_done_callback(lambda f: seen.set())
        assert not seen.is_set()
        w.flush(5)
        assert seen.wait(5) and fut.exception(0) is None


# -- a held call's rows in the one future of the calls written together ---------------


def _outcome(lock: threading.Lock, base: int | None, error: str | None = None) -> BatchOutcome:
    o = BatchOutcome(lock, "t", 0)
    if error is not None:
        o.fail(ProducerError(error))
    else:
        assert base is not None
        o.succeed(base, -1)
    return o


def test_a_held_call_gets_only_its_own_batches_errors() -> None:
    lock = threading.Lock()
    # three batches of 2 rows in sorted order (order maps sorted position -> row):
    # rows 0-1 in batch 0, rows 4-5 in batch 1 (failed), rows 2-3 in batch 2
    order = np.array([0, 1, 4, 5, 2, 3], np.intp)
    outcomes = [_outcome(lock, 10), _outcome(lock, None, "b1"), _outcome(lock, 20)]
    parts = np.zeros(6, np.int32)
    ts = np.arange(6, dtype=np.int64)
    whole = BatchFuture(lock, "t", parts, ts, order, outcomes, [2, 2, 2])
    calls = [BatchFuture.held(lock, "t", ts[lo:hi]) for lo, hi in ((0, 2), (2, 4), (4, 6))]
    for fut, (lo, hi) in zip(calls, ((0, 2), (2, 4), (4, 6)), strict=True):
        fut._bind(whole, lo, hi)
    assert calls[0].result(0).offsets.tolist() == [10, 11] and not calls[0].failures(0)
    assert calls[1].result(0).offsets.tolist() == [20, 21]
    assert str(calls[2].exception(0)) == "b1"
    assert calls[2].partial_result(0).offsets.tolist() == [-1, -1]
    [failure] = calls[2].failures(0)
    assert failure.rows.tolist() == [0, 1] and failure.handed_over
    assert [f.rows.tolist() for f in whole.failures(0)] == [[4, 5]]


def test_a_held_call_in_a_split_batch() -> None:
    lock = threading.Lock()
    o = BatchOutcome(lock, "t", 0)
    o.resolve_pieces(
        (OutcomePiece(0, 2, 100, -1, None), OutcomePiece(2, 2, -1, -1, ProducerError("p1")))
    )
    ts = np.zeros(4, np.int64)
    whole = BatchFuture(lock, "t", np.zeros(4, np.int32), ts, None, [o], [4])
    first, second = BatchFuture.held(lock, "t", ts[:2]), BatchFuture.held(lock, "t", ts[2:])
    first._bind(whole, 0, 2)
    second._bind(whole, 2, 4)
    assert first.result(0).offsets.tolist() == [100, 101]
    assert str(second.exception(0)) == "p1"
    assert [f.rows.tolist() for f in second.failures(0)] == [[0, 1]]


_chunk = st.lists(st.one_of(st.none(), st.binary(max_size=8)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(_chunk, st.booleans(), st.sampled_from([pa.binary(), pa.large_binary()])),
        min_size=1,
        max_size=5,
    )
)
def test_concat_keeps_every_row(chunks: list[tuple[list[bytes | None], bool, pa.DataType]]) -> None:
    cols = []
    want = []
    for i, (values, keyed, kind) in enumerate(chunks):
        keys = [b"k%d" % j for j in range(len(values))] if keyed else None
        n = len(values)
        cols.append(
            Columns(
                n,
                pa.array(values, kind),
                None if keys is None else pa.array(keys, kind),
                np.full(n, i, np.int64),
                None,
                False,
                1,
                np.zeros(n, np.int64),
            )
        )
        want += [(None if keys is None else keys[j], values[j], i) for j in range(n)]
    out = concat(cols)
    keys_out = [None] * out.n if out.keys is None else out.keys.to_pylist()
    assert isinstance(out.timestamps, np.ndarray)
    got = list(zip(keys_out, out.values.to_pylist(), out.timestamps.tolist(), strict=True))
    assert got == want and out.n == len(want)


def test_held_calls_land_as_sent(broker: EmbeddedBroker, topic_name: str) -> None:
    """A real broker, read back with confluent-kafka: 40 small calls (keyed, null keys,
    per-row timestamps) land with every key, value, timestamp, partition and offset
    their futures give, in far fewer batches than calls."""
    broker.create_topic(topic_name, 4)
    sent: list[tuple[BatchFuture, list[bytes | None], list[bytes], list[int]]] = []
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=50) as p:
        for c in range(40):
            keys: list[bytes | None] = (
                [None] * 25 if c % 4 == 3 else [b"k%d" % ((c * 25 + i) % 13) for i in range(25)]
            )
            values = [b"c%d-r%d" % (c, i) for i in range(25)]
            ts = [1_700_000_000_000 + c * 100 + i for i in range(25)]
            fut = p.send_batch(topic_name, values, keys=keys, timestamps_ms=np.array(ts))
            sent.append((fut, keys, values, ts))
        for fut, *_ in sent:
            fut.result(30)
        assert p.stats()["worker"]["batches_sealed"] <= 12
    landed = consume_all(broker.bootstrap, topic_name, 4, 1000, 60)
    at = {(r.partition, r.offset): r for recs in landed.values() for r in recs}
    assert len(at) == 1000
    for fut, keys, values, ts in sent:
        md = fut.result(0)
        for i, (part, off) in enumerate(
            zip(md.partitions.tolist(), md.offsets.tolist(), strict=True)
        ):
            r = at[(part, off)]
            assert (r.key, r.value, r.timestamp_ms) == (keys[i], values[i], ts[i])
            assert int(md.timestamps_ms[i]) == ts[i]


def test_held_values_are_not_copied_when_the_extension_writes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the extension the values stay in each call's array (only keys are joined);
    without it they are joined into one array for the vectorised encoder."""
    arrays = [pa.array([b"a" * 50, b"b"]), pa.array([b"c"], pa.large_binary())]
    cols = [
        Columns(
            len(a),
            a,
            pa.array([b"k"] * len(a)),
            np.zeros(len(a), np.int64),
            None,
            False,
            1,
            np.zeros(len(a), np.int64),
        )
        for a in arrays
    ]
    if speedups.plan_batches is not None:
        out = concat(cols)
        assert isinstance(out.values, pa.ChunkedArray)
        assert out.values.chunks[0].buffers()[2].address == arrays[0].buffers()[2].address
        assert out.values.to_pylist() == [b"a" * 50, b"b", b"c"]
    monkeypatch.setattr(speedups, "plan_batches", None)
    joined = concat(cols)
    assert isinstance(joined.values, pa.Array)
    assert joined.values.to_pylist() == [b"a" * 50, b"b", b"c"]
