"""send_batch against the fake sender: offsets and partitions in input order, every
column type, null-key spreading, per-row and shared headers, compression, large rows,
ordering with send(), typed errors with nothing written, and partial failures."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shmprod import speedups
from shmprod.errors import (
    BufferExhaustedError,
    InvalidRecordError,
    InvalidTopicError,
    RecordTooLargeError,
    UnknownPartitionError,
)
from shmprod.futures import BatchMetadata
from shmprod.partitioner import partitions_for_keys
from shmprod.protocol import compression as C
from shmprod.protocol.records import HEADER_SIZE, Record, record_size
from shmprod.worker import Worker, attach
from tests.support.fake_sender import FakeSender


def landed_rows(fake: FakeSender, md: BatchMetadata) -> list[Record]:
    """The record the fake holds at each row's (partition, offset)."""
    recs = fake.records(md.topic)
    return [recs[int(p)][int(o)] for p, o in zip(md.partitions, md.offsets, strict=True)]


def test_offsets_and_partitions_in_input_order(fake: FakeSender, w: Worker) -> None:
    n = 2000
    keys = [os.urandom(8) for _ in range(n)]
    values = [b"value-%d" % i for i in range(n)]
    md = w.send_batch("events", values, keys=keys).result(5)
    assert md.partitions.tolist() == partitions_for_keys(keys, 4).tolist()
    rows = landed_rows(fake, md)
    assert [r.value for r in rows] == values
    assert [r.key for r in rows] == keys
    assert len(set(zip(md.partitions.tolist(), md.offsets.tolist(), strict=True))) == n
    assert not fake.corrupt
    assert all(b.length <= fake.geo.run_bytes(b.run) for b in fake.landed)
    st = w.stats()["worker"]
    assert st["records_appended"] == n == st["records_acked"]


def test_bulk_batches_respect_batch_size(fake: FakeSender, w: Worker) -> None:
    w.send_batch("events", [b"v" * 9] * 164, keys=[b"k" * 8] * 164, partitions=0).result(5)
    assert all(b.length <= fake.config.batch_size for b in fake.landed)


@pytest.mark.parametrize("kind", ["list", "numpy", "arrow_binary", "arrow_string", "chunked"])
def test_column_types(fake: FakeSender, w: Worker, kind: str) -> None:
    raw = [b"a", None, b"ccc", b"", b"x" * 40]
    keys_raw = [b"k1", b"k2", None, b"k4", b"k5"]
    values: object
    keys: object
    if kind == "list":
        values, keys = raw, keys_raw
    elif kind == "numpy":
        values, keys = np.array(raw, dtype=object), np.array(keys_raw, dtype=object)
    elif kind == "arrow_binary":
        values, keys = pa.array(raw, pa.binary()), pa.array(keys_raw, pa.binary())
    elif kind == "arrow_string":
        values = pa.array([None if v is None else v.decode() for v in raw], pa.string())
        keys = pa.array([None if k is None else k.decode() for k in keys_raw], pa.large_string())
    else:
        values = pa.chunked_array([pa.array(raw[:2], pa.binary()), pa.array(raw[2:], pa.binary())])
        keys = pa.array(keys_raw, pa.binary())
    md = w.send_batch("events", values, keys=keys).result(5)
    rows = landed_rows(fake, md)
    assert [r.value for r in rows] == raw
    assert [r.key for r in rows] == keys_raw


def test_null_keys_spread_in_whole_batches(fake: FakeSender, w: Worker) -> None:
    values = [os.urandom(100) for _ in range(1000)]  # ~28 batches of 4 KiB
    md = w.send_batch("events", values).result(5)
    assert [r.value for r in landed_rows(fake, md)] == values
    assert set(md.partitions.tolist()) == {0, 1, 2, 3}
    changes = int(np.count_nonzero(np.diff(md.partitions)))
    assert changes <= len(fake.landed)  # partitions change only between batches
    small = w.send_batch("events", [b"s"] * 5).result(5)
    assert len(set(small.partitions.tolist())) == 1  # a small call stays on one partition


def test_explicit_partitions_and_timestamps(fake: FakeSender, w: Worker) -> None:
    parts = np.array([3, 0, 3, 1, 2, 0], np.int64)
    ts = np.array([10, 20, 5, 40, 50, 60], np.int64)
    md = w.send_batch(
        "events", [b"%d" % i for i in range(6)], partitions=parts, timestamps_ms=ts
    ).result(5)
    assert md.partitions.tolist() == parts.tolist()
    assert md.timestamps_ms.tolist() == ts.tolist()
    rows = landed_rows(fake, md)
    assert [r.timestamp_ms for r in rows] == ts.tolist()
    assert [r.value for r in rows] == [b"%d" % i for i in range(6)]
    md2 = w.send_batch("events", [b"a", b"b"], partitions=2, timestamps_ms=1234).result(5)
    assert md2.partitions.tolist() == [2, 2] and md2.timestamps_ms.tolist() == [1234, 1234]
    assert [r.timestamp_ms for r in landed_rows(fake, md2)] == [1234, 1234]


def test_headers_shared_and_per_row(fake: FakeSender, w: Worker) -> None:
    shared = [("trace", b"t1"), ("n", None)]
    md = w.send_batch("events", [b"a", b"b"], headers=shared).result(5)
    assert all(r.headers == shared for r in landed_rows(fake, md))
    per_row = [[("i", b"0")], [], [("x", b"1"), ("y", None)]]
    md = w.send_batch("events", [b"a", b"b", b"c"], keys=[b"1", b"2", b"3"], headers=per_row)
    rows = landed_rows(fake, md.result(5))
    assert [r.headers for r in rows] == per_row
    md = w.send_batch("events", [b"a"], headers={"d": b"v"}).result(5)
    assert landed_rows(fake, md)[0].headers == [("d", b"v")]


def test_per_row_headers_of_every_form_land_with_their_rows(fake: FakeSender, w: Worker) -> None:
    """Each row's section is encoded in C for the common forms and in Python for the
    rest; rows sorted by partition keep their own headers."""
    forms: list[tuple[Any, list[tuple[str, bytes | None]]]] = [
        (None, []),
        ([], []),
        ({"d": "é", "n": None}, [("d", "é".encode()), ("n", None)]),
        ((("t", b"x"),), [("t", b"x")]),
        ([["l", b"y"]], [("l", b"y")]),
        ([("b", bytearray(b"ba"))], [("b", b"ba")]),  # the Python path's
        ([("m", memoryview(b"mv"))], [("m", b"mv")]),
    ]
    n = 300
    headers = [forms[i % len(forms)][0] for i in range(n)]
    headers[1] = [("row", b"1")]  # not every row alike: per-row headers
    want = [forms[i % len(forms)][1] for i in range(n)]
    want[1] = [("row", b"1")]
    keys = [b"k%d" % (i % 17) for i in range(n)]
    md = w.send_batch("events", [b"v%d" % i for i in range(n)], keys=keys, headers=headers)
    rows = landed_rows(fake, md.result(5))
    assert [(r.value, r.headers) for r in rows] == [(b"v%d" % i, want[i]) for i in range(n)]


@pytest.mark.parametrize("codec", ["gzip", "lz4", "zstd", "snappy"])
def test_bulk_compression(codec: str) -> None:
    with FakeSender(compression_type=codec) as fake, attach(fake.handle) as w:
        values = [(b"compressible %d " % (i % 10)) * 8 for i in range(500)]
        md = w.send_batch("events", values, partitions=1).result(5)
        assert [r.value for r in landed_rows(fake, md)] == values
        assert {b.header.compression for b in fake.landed} == {C.codec_id(codec)}


@pytest.mark.parametrize(
    ("codec", "batch_size"), [("lz4", 16384), ("gzip", 16384), ("zstd", 65536)]
)
def test_batches_that_fill_their_runs_are_written_compressed(codec: str, batch_size: int) -> None:
    # incompressible rows, cut to fill a batch to its budget: their compressed form
    # (stored blocks) is a little longer, so each batch's run keeps room for it. Before,
    # a batch that came within that growth of its run's end was encoded, compressed to
    # new bytes, encoded again and written uncompressed
    with (
        FakeSender(
            compression_type=codec, batch_size=batch_size, buffer_memory=16 * batch_size
        ) as fake,
        attach(fake.handle) as w,
    ):
        for size in range(100, 300, 3):
            n = batch_size // size + 10  # a full batch and the rest
            blob = os.urandom(n * size * 2)
            values = [blob[i * size : (i + 1) * size] for i in range(n)]
            keys = [blob[(n + i) * size : (n + i + 1) * size] for i in range(n)]
            md = w.send_batch("events", values, keys=keys, partitions=0).result(5)
            assert [r.value for r in landed_rows(fake, md)] == values
        assert {b.header.compression for b in fake.landed} == {C.codec_id(codec)}
        assert all(b.length <= fake.geo.run_bytes(b.run) for b in fake.landed)


def test_a_row_as_large_as_the_pool_lands_where_the_slack_does_not_fit() -> None:
    # the run of a row that fills the whole pool cannot keep lz4's slack free: it is
    # written in the pool's every buffer (uncompressed, as its frame does not fit)
    with FakeSender(compression_type="lz4") as fake, attach(fake.handle) as w:
        pool = fake.geo.n_buffers * fake.geo.buffer_size
        size = pool - HEADER_SIZE - 8
        while record_size(0, 0, None, b"x" * size) + HEADER_SIZE > pool:
            size -= 1
        assert record_size(0, 0, None, b"x" * size) + HEADER_SIZE > pool - 15
        value = os.urandom(size)
        md = w.send_batch("events", [value], partitions=0).result(5)
        assert [r.value for r in landed_rows(fake, md)] == [value]
        assert [b.run for b in fake.landed] == [fake.geo.n_buffers]


def test_large_row_goes_alone_in_a_run(fake: FakeSender, w: Worker) -> None:
    values = [b"small", os.urandom(9000), b"small again"]
    md = w.send_batch("events", values, partitions=0).result(5)
    assert [r.value for r in landed_rows(fake, md)] == values
    assert any(b.run == 3 for b in fake.landed)


def test_send_then_send_batch_keeps_order(fake: FakeSender, w: Worker) -> None:
    f = w.send("events", b"first", partition=0)
    md = w.send_batch("events", [b"second", b"third"], partitions=0).result(5)
    assert f.result(5).offset == 0
    assert md.offsets.tolist() == [1, 2]


BAD = [
    ({"values": [1, 2]}, InvalidRecordError),
    ({"values": np.zeros((2, 2))}, InvalidRecordError),
    ({"keys": [b"a"]}, InvalidRecordError),
    ({"partitions": 7}, UnknownPartitionError),
    ({"partitions": [0, 9]}, UnknownPartitionError),
    ({"partitions": [0.5, 1.0]}, InvalidRecordError),
    ({"partitions": [0]}, InvalidRecordError),
    ({"timestamps_ms": [1]}, InvalidRecordError),
    ({"timestamps_ms": [1, -2]}, InvalidRecordError),
    ({"timestamps_ms": -1}, InvalidRecordError),
    ({"headers": [[("a", b"1")]]}, InvalidRecordError),
    ({"headers": [("a", 1.5)]}, InvalidRecordError),
    ({"headers": [[("a", b"1")], [(1, b"x")]]}, InvalidRecordError),  # per row: a bad key
    ({"headers": [[("a", b"1")], [("\ud800", b"x")]]}, InvalidRecordError),  # not UTF-8
    ({"headers": [[("a", b"1")], [("b", 2)]]}, InvalidRecordError),
    ({"headers": [[("a", b"1")], 5]}, InvalidRecordError),
    ({"values": np.array([1, 2])}, InvalidRecordError),
    ({"values": "ab"}, InvalidRecordError),  # a str is not a column
    ({"keys": np.array([42, 300])}, InvalidRecordError),
    ({"headers": 5}, InvalidRecordError),
    ({"topic": "no spaces"}, InvalidTopicError),
]


def test_bad_input_raises_with_nothing_written(fake: FakeSender, w: Worker) -> None:
    for kwargs, exc in BAD:
        args = {"topic": "events", "values": [b"a", b"b"], **kwargs}
        with pytest.raises(exc):
            w.send_batch(**args)  # type: ignore[arg-type]
    lease = list(fake.allocs)  # the buffers a worker asks for ahead, at attach
    assert not fake.landed
    with pytest.raises(RecordTooLargeError):
        w.send_batch("events", [b"ok", b"x" * 70_000])
    assert fake.allocs == lease and not fake.landed
    empty = w.send_batch("events", [])
    assert empty.done() and len(empty.result(0)) == 0


def test_pool_exhausted_midway_fails_only_the_rest() -> None:
    with (
        FakeSender(
            hold_done=True, max_block_ms=200, request_timeout_ms=1000, delivery_timeout_ms=2000
        ) as fake,
        attach(fake.handle) as w,
    ):
        values = [b"x" * 200 for _ in range(2000)]  # ~100 batches, the pool has 16
        fut = w.send_batch("events", values, partitions=0)
        fake.release_held()
        assert isinstance(fut.exception(5), BufferExhaustedError)
        md = fut.partial_result(0)
        sent = md.offsets >= 0
        assert 0 < int(sent.sum()) < 2000
        assert md.offsets[sent].tolist() == list(range(int(sent.sum())))
        # nothing was handed over at all: the error is raised at the call
        fake.hold_done = True
        fill = [w.send("events", b"y" * 3000, partition=1) for _ in range(fake.geo.n_buffers)]
        with pytest.raises(BufferExhaustedError):
            w.send_batch("events", values[:10], partitions=2)
        fake.hold_done = False
        fake.release_held()
        w.flush(5)
        assert all(f.done() for f in fill)


@pytest.mark.parametrize("large", [pa.large_binary(), pa.large_string()])
def test_large_arrow_types_with_keys(fake: FakeSender, w: Worker, large: pa.DataType) -> None:
    """64-bit-offset Arrow columns come zero-copy and read-only: nothing may add into
    them in place (that raised "output array is read-only")."""
    vals = pa.array(["v1", "v2", None], large)
    keys = pa.array(["k1", None, "k3"], large)
    md = w.send_batch("events", vals, keys=keys).result(5)
    assert len(md) == 3
    got = {(r.key, r.value) for part in fake.records("events").values() for r in part}
    assert got == {(b"k1", b"v1"), (None, b"v2"), (b"k3", None)}


@pytest.mark.skipif(
    speedups.plan_batches is None,
    reason="batches encoded as they go (no C extension): runs of several come one at a time",
)
def test_shorter_batches_go_in_the_heads_of_longer_runs_when_the_pool_is_busy() -> None:
    """Each partition's full batch (a run of 4 buffers) then its remainder (3): with the
    pool more than half used, each change of length used to give the runs in hand back
    and wait for a Grant of the other length (one round trip per batch). The windows now
    ask for runs of 4 for both, each remainder goes in the head of one, and the buffer
    it did not need goes back with its Sealed."""
    with (
        FakeSender(
            batch_size=512 * 1024, buffer_memory=16 * 1024 * 1024, topics={"events": 12}
        ) as fake,
        attach(fake.handle) as w,
    ):
        assert fake.geo.n_buffers == 128

        def busy() -> None:  # another process's batches: 70 buffers in use
            for b in sorted(fake.free)[-70:]:
                fake.free.discard(b)
            fake._publish()

        fake.call(busy)
        rows = 840  # per partition: one full batch of ~519 records, a remainder of 3 buffers
        values = pa.array([os.urandom(1000) for _ in range(12 * rows)], pa.binary())
        parts = np.repeat(np.arange(12, dtype=np.int32), rows)
        w.send_batch("events", values, partitions=parts).result(10)
        landed = sorted(fake.landed, key=lambda b: b.batch_id)
        assert [b.run for b in landed] == [4, 3] * 12
        asked = [(a.run, a.count) for a in fake.allocs if a.run > 1]
        assert {run for run, _ in asked} == {4} and sum(n for _, n in asked) <= 24, asked
        assert len(asked) <= 6, asked  # windows of 4 runs (an eighth of the pool)
        assert not any(r.run > 1 for r in fake.releases), fake.releases
        released = {b for r in fake.releases for b in r.buffers}
        assert {b.buffer + 3 for b in landed if b.run == 3} <= released
        got = fake.records("events")
        assert [len(got[p]) for p in range(12)] == [rows] * 12
        assert [r.value for p in range(12) for r in got[p]] == values.to_pylist()


def test_runs_are_asked_for_as_needed_and_none_is_held_back() -> None:
    """Batches of several run lengths (full 512 KiB batches in runs of 4 buffers, each
    partition's remainder in a shorter run): each Alloc asks for no more runs of a
    length than batches still need it, so no unused run is held while the process waits
    for another length (8 processes holding such runs once starved the pool until
    max_block_ms) and none has to be given back."""
    with (
        FakeSender(batch_size=512 * 1024, buffer_memory=16 * 1024 * 1024) as fake,
        attach(fake.handle) as w,
    ):
        assert fake.geo.buffer_size == 128 * 1024
        rows = 2300  # per partition: 4 full batches and a remainder
        values = pa.array([os.urandom(1000) for _ in range(4 * rows)], pa.binary())
        parts = np.repeat(np.arange(4, dtype=np.int32), rows)
        w.send_batch("events", values, partitions=parts).result(10)
        runs = [b.run for b in fake.landed]
        assert len(runs) == 20 and runs.count(4) == 16, runs
        for length in set(runs) - {1}:
            asked = sum(a.count for a in fake.allocs if a.run == length)
            assert asked <= runs.count(length), (length, asked, runs)
        assert not any(r.run > 1 for r in fake.releases), fake.releases
        got = fake.records("events")
        assert [len(got[p]) for p in range(4)] == [rows] * 4
