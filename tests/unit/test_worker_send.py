"""The single-record path against the fake sender: what lands in shared memory decodes
back exactly, batches seal when full or when linger expires, large records take runs,
compression per codec, partitioning, serializers, and typed errors with nothing written."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import threading
import time
from typing import Any

import numpy as np
import pytest

from shmprod.errors import (
    BufferExhaustedError,
    InvalidRecordError,
    InvalidTopicError,
    KafkaError,
    MetadataTimeoutError,
    RecordTooLargeError,
    UnknownPartitionError,
)
from shmprod.partitioner import partition_for_key
from shmprod.protocol import compression as C
from shmprod.worker import Worker, attach
from tests.support.fake_sender import FakeSender

SLOW_LINGER = {"linger_ms": 60_000, "delivery_timeout_ms": 200_000}


def test_records_decode_back_exactly(fake: FakeSender, w: Worker) -> None:
    now = int(time.time() * 1000)
    sent = []
    futs = []
    for i in range(300):
        key = None if i % 5 == 0 else f"k{i}".encode()
        value = None if i % 7 == 0 else (b"" if i % 11 == 0 else os.urandom(i % 50))
        value_arg: object = bytearray(value) if (value and i % 3 == 0) else value
        if value and i % 13 == 0:
            value_arg = memoryview(value)
        headers = [("a", b"1"), ("b", None)] if i % 4 == 0 else ([] if i % 4 == 1 else None)
        if i % 9 == 0:
            headers = {"d": b"x" * (i % 5)}
        ts = now - 5000 + i * 3 if i % 2 else None
        futs.append(
            w.send("events", value_arg, key=key, headers=headers, partition=2, timestamp_ms=ts)
        )
        hdrs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        sent.append((key, value, hdrs, ts))
    w.flush(5)
    got = fake.records("events")[2]
    assert len(got) == 300
    assert not fake.corrupt
    for (key, value, hdrs, ts), rec, fut in zip(sent, got, futs, strict=True):
        assert rec.key == key and rec.value == value and rec.headers == hdrs
        md = fut.result(1)
        assert md.partition == 2 and md.topic == "events"
        assert rec.timestamp_ms == md.timestamp_ms
        if ts is not None:
            assert rec.timestamp_ms == ts
        else:
            assert abs(rec.timestamp_ms - now) < 60_000
    # offsets: the fake assigns base offsets per partition in arrival order
    assert [f.result(0).offset for f in futs] == list(range(300))
    for b in fake.landed:
        assert b.header.base_timestamp == b.records[0].timestamp_ms
        assert b.header.max_timestamp == max(r.timestamp_ms for r in b.records)
        assert b.header.producer_id == -1 and b.header.base_sequence == -1
        assert b.length <= fake.config.batch_size


def test_a_buffer_reused_after_send_does_not_change_the_record(fake: FakeSender, w: Worker) -> None:
    """send() keeps staged records until the flush: a bytearray or memoryview the caller
    fills again right after the call must not change what was sent."""
    buf = bytearray(b"first-value")
    key = bytearray(b"k1")
    arr = np.frombuffer(bytearray(b"view-value"), dtype=np.uint8)
    f1 = w.send("events", buf, key=key, partition=0)
    f2 = w.send("events", memoryview(arr), partition=0)
    buf[:] = b"XXXXXXXXXXX"
    key[:] = b"YY"
    arr[:] = 0
    w.flush(5)
    got = fake.records("events")[0]
    assert [(r.key, r.value) for r in got] == [(b"k1", b"first-value"), (None, b"view-value")]
    assert f1.result(1).offset + 1 == f2.result(1).offset


def test_linger_seals_a_partial_batch() -> None:
    with FakeSender(linger_ms=50) as fake, attach(fake.handle) as w:
        t0 = time.monotonic()
        fut = w.send("events", b"alone", partition=1)
        assert fake.wait_for(lambda: len(fake.landed) == 1, 5)
        elapsed = time.monotonic() - t0
        assert fut.result(5).offset == 0
        assert 0.04 <= elapsed < 3
        assert fake.landed[0].records[0].value == b"alone"


def test_zero_linger_seals_promptly() -> None:
    with FakeSender(linger_ms=0) as fake, attach(fake.handle) as w:
        assert w.send("events", b"now").result(5).offset == 0


def test_full_batches_seal_without_waiting_for_linger() -> None:
    with FakeSender(**SLOW_LINGER) as fake, attach(fake.handle) as w:
        futs = [w.send("events", b"x" * 200, partition=0) for _ in range(60)]  # ~3 batches
        assert fake.wait_for(lambda: len(fake.landed) >= 2, 5)
        assert all(b.length <= fake.config.batch_size for b in fake.landed)
        assert not futs[-1].done()  # the last batch waits for linger (or flush)
        w.flush(5)
        assert [f.result(0).offset for f in futs] == list(range(60))


def test_large_record_takes_a_run_and_keeps_order(fake: FakeSender, w: Worker) -> None:
    big = os.urandom(10_000)  # batch_size is 4096: a run of 3 buffers
    f1 = w.send("events", b"before", partition=0)
    f2 = w.send("events", big, key=b"k", partition=0)
    f3 = w.send("events", b"after", partition=0)
    w.flush(5)
    assert [r.value for r in fake.records("events")[0]] == [b"before", big, b"after"]
    assert [f.result(0).offset for f in (f1, f2, f3)] == [0, 1, 2]
    runs = [b.run for b in fake.landed]
    assert 3 in runs  # adjacent buffers of the stock joined, or a run asked for


def test_too_large_records_fail_at_the_call_with_nothing_written() -> None:
    with FakeSender(max_request_size=8192) as fake, attach(fake.handle) as w:
        w.send("events", b"ok", partition=0)
        with pytest.raises(RecordTooLargeError):
            w.send("events", b"x" * 9000, partition=0)
        w.flush(5)
        assert [r.value for r in fake.records("events")[0]] == [b"ok"]
        assert not any(a.run > 1 for a in fake.allocs)
    with (
        FakeSender() as fake,
        attach(fake.handle) as w,
        pytest.raises(RecordTooLargeError, match="pool"),  # larger than the 64 KiB pool
    ):
        w.send("events", b"x" * 70_000)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compression_per_codec(codec: str) -> None:
    with FakeSender(compression_type=codec) as fake, attach(fake.handle) as w:
        values = [(b"row %d of a very compressible value " % i) * 4 for i in range(200)]
        futs = [w.send("events", v, key=b"k", partition=3) for v in values]
        random_value = os.urandom(3000)  # incompressible: may stay uncompressed
        fr = w.send("events", random_value, partition=1)
        w.flush(5)
        assert not fake.corrupt
        assert [r.value for r in fake.records("events")[3]] == values
        assert fake.records("events")[1][0].value == random_value
        cid = C.codec_id(codec)
        assert {b.header.compression for b in fake.landed if b.partition == 3} == {cid}
        assert futs[-1].result(0).offset == 199 and fr.result(0).offset == 0
        raw = sum(len(v) for v in values)
        assert sum(b.length for b in fake.landed if b.partition == 3) < raw / 2


def test_partitioning(fake: FakeSender, w: Worker) -> None:
    keys = [f"user-{i}".encode() for i in range(100)]
    futs = [w.send("events", b"v", key=k) for k in keys]
    nulls = [w.send("events", b"n" * 10) for _ in range(20)]
    explicit = w.send("events", b"e", key=b"user-1", partition=3)
    w.flush(5)
    for k, f in zip(keys, futs, strict=True):
        assert f.result(0).partition == partition_for_key(k, 4)
    assert len({f.result(0).partition for f in nulls}) == 1  # sticky while the batch fills
    assert explicit.result(0).partition == 3


def test_round_robin_partitioner() -> None:
    with FakeSender(partitioner="round_robin") as fake, attach(fake.handle) as w:
        futs = [w.send("events", b"v", key=b"same") for _ in range(8)]
        w.flush(5)
        assert [f.result(0).partition for f in futs] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_serializers() -> None:
    with FakeSender() as fake:
        handle = dataclasses.replace(
            fake.handle,
            key_serializer=lambda k: None if k is None else str(k).encode(),
            value_serializer=lambda v: json.dumps(v).encode(),
        )
        with attach(handle) as w:
            fut = w.send("events", {"a": 1}, key=42, partition=0)
            w.flush(5)
            (rec,) = fake.records("events")[0]
            assert (rec.key, rec.value) == (b"42", b'{"a": 1}')
            assert fut.result(0).offset == 0
            with pytest.raises(InvalidRecordError, match="value_serializer"):
                w.send("events", {1, 2})  # json cannot
        bad = dataclasses.replace(fake.handle, value_serializer=lambda v: v * 2)
        with attach(bad) as w2, pytest.raises(InvalidRecordError, match="int"):
            w2.send("events", 1)


def test_serializers_run_once_per_send_whichever_path_stages_it() -> None:
    """The serializers run in Python, once; what they make is staged by the C path when
    it can and by the Python path otherwise (a topic's first record, a first explicit
    partition or headers), never serialized again; a bad result is refused with its
    name."""
    calls: list[object] = []

    def ser(v: object) -> object:
        calls.append(v)
        return v if not isinstance(v, int) else str(v)  # ints as text: staged as UTF-8

    with FakeSender() as fake:
        handle = dataclasses.replace(fake.handle, key_serializer=ser, value_serializer=ser)
        with attach(handle) as w:
            futs = [
                w.send("events", b"v0", key=b"k0"),  # the topic's first: Python
                w.send("events", 1, key=2),  # str from the serializer: C
                w.send("events", bytearray(b"v2"), partition=1),  # first partition: Python
                w.send("events", b"v3", partition=1, headers=[("h", b"x")]),
                w.send("events", b"v4", headers={"h": "y"}),  # C
            ]
            w.flush(5)
            assert len(calls) == 10
            landed = {r.value: r for p in fake.records("events").values() for r in p}
            assert set(landed) == {b"v0", b"1", b"v2", b"v3", b"v4"}
            assert landed[b"1"].key == b"2" and landed[b"v4"].headers == [("h", b"y")]
            assert all(f.result(0).offset >= 0 for f in futs)
            bad = dataclasses.replace(fake.handle, value_serializer=lambda v: 1.5)
        with attach(bad) as w2:
            with pytest.raises(InvalidRecordError, match=r"value \(from value_serializer\)"):
                w2.send("events", b"x")
            assert w2.stats()["worker"]["send_errors"] == 1


BAD_CALLS = [
    ({"value": 12}, InvalidRecordError),
    ({"value": np.int64(12)}, InvalidRecordError),  # a buffer, but of int64, not bytes
    ({"key": np.array([1, 2], np.int32)}, InvalidRecordError),
    ({"key": 1.5}, InvalidRecordError),
    ({"headers": "h"}, InvalidRecordError),
    ({"headers": [("k", 5)]}, InvalidRecordError),
    ({"headers": [(1, b"v")]}, InvalidRecordError),
    ({"headers": [("k",)]}, InvalidRecordError),
    ({"timestamp_ms": "now"}, InvalidRecordError),
    ({"timestamp_ms": -5}, InvalidRecordError),
    ({"timestamp_ms": 2.5}, InvalidRecordError),
    ({"partition": 4}, UnknownPartitionError),
    ({"partition": -1}, UnknownPartitionError),
    ({"partition": "1"}, InvalidRecordError),
    ({"partition": True}, InvalidRecordError),
    ({"topic": "bad topic!"}, InvalidTopicError),
    ({"topic": ""}, InvalidTopicError),
    ({"topic": ".."}, InvalidTopicError),
    ({"topic": "a" * 250}, InvalidTopicError),
    ({"topic": 5}, InvalidTopicError),
]


def test_bad_input_raises_typed_errors_with_nothing_written(fake: FakeSender, w: Worker) -> None:
    w.send("events", b"good", partition=0)
    for kwargs, exc in BAD_CALLS:
        args = {"topic": "events", "value": b"v", **kwargs}
        with pytest.raises(exc):
            w.send(**args)  # type: ignore[arg-type]
    w.send("events", b"good too", partition=0)
    w.flush(5)
    assert [r.value for r in fake.records()[0]] == [b"good", b"good too"]
    assert len(fake.landed) == 1
    assert w.stats()["worker"]["send_errors"] == len(BAD_CALLS)
    assert "bad topic!" not in fake.topic_requests


def test_unknown_topic_times_out_and_topic_errors_are_typed() -> None:
    with (
        FakeSender(max_block_ms=200, topic_errors={"denied": 29}) as fake,
        attach(fake.handle) as w,
    ):
        t0 = time.monotonic()
        with pytest.raises(MetadataTimeoutError):
            w.send("nope", b"v")
        assert 0.15 < time.monotonic() - t0 < 3
        with pytest.raises(KafkaError) as ei:
            w.send("denied", b"v")
        assert ei.value.code == 29
        assert w.send("events", b"v").result(5).offset == 0


def test_buffer_exhaustion_blocks_then_raises_then_recovers() -> None:
    with (
        FakeSender(
            hold_done=True, max_block_ms=200, request_timeout_ms=1000, delivery_timeout_ms=2000
        ) as fake,
        attach(fake.handle) as w,
    ):
        futs = []
        with pytest.raises(BufferExhaustedError):
            for _ in range(fake.geo.n_buffers * 40):  # bounded: far more than the pool holds
                futs.append(w.send("events", b"x" * 300, partition=0))
        assert futs and not futs[0].done()
        fake.release_held()
        assert futs[0].result(5).offset == 0
        w.send("events", b"again", partition=0)
        fake.hold_done = False
        fake.release_held()
        w.flush(5)
        assert all(f.done() for f in futs)


def test_a_flush_short_of_buffers_keeps_no_stock() -> None:
    """A process that cannot get every buffer a flush needs within max_block_ms holds
    none back: with a stock kept, two processes short of a few buffers each waited for
    the other's until their records' delivery timeout. (A guard: the race itself is
    the fault matrix's full-pool row, which failed about one run in eight.)"""
    with (
        FakeSender(
            hold_done=True, max_block_ms=200, request_timeout_ms=1000, delivery_timeout_ms=5000
        ) as fake,
        attach(fake.handle) as w,
    ):
        with pytest.raises(BufferExhaustedError):
            for i in range(fake.geo.n_buffers * 40):  # bounded: far more than the pool holds
                w.send("events", b"x" * 300, partition=i % 3)
        assert w.stats()["worker"]["stock_buffers"] == 0
        fake.hold_done = False
        fake.release_held()
        w.flush(5)


def _lease_fake(partitions: int, max_block_ms: int = 10_000) -> FakeSender:
    """A fake sender of 256 buffers of 4 KiB (a first lease of 32) and one topic of
    ``partitions`` partitions; linger never expires, so only flushes seal."""
    return FakeSender(
        topics={"events": partitions},
        buffer_memory=256 * 4096,
        batch_size=4096,
        max_block_ms=max_block_ms,
        **SLOW_LINGER,
    )


def _flush_rounds(w: Worker, partitions: int, rounds: int) -> list[Any]:
    """``rounds`` flushes of one batch per partition (one buffer each); their futures."""
    futs = []
    for _ in range(rounds):
        futs += [w.send("events", b"x" * 300, partition=p) for p in range(partitions)]
        w.flush(5)
    return futs


def test_a_late_refill_does_not_stall_the_next_flush() -> None:
    """Two flushes of 14 buffers back to back while the sender answers no Alloc (a busy
    sender): the second takes its buffers from the lease, without waiting."""
    partitions = 14
    with (
        _lease_fake(partitions) as fake,
        attach(fake.handle) as w,
    ):
        assert w.stats()["worker"]["stock_buffers"] == 32  # the first lease, in at attach
        fake.hold_grants = True
        futs = _flush_rounds(w, partitions, 2)
        assert w.stats()["batching"]["buffer_waits"] == 0
        assert w.stats()["worker"]["stock_buffers"] == 32 - 2 * partitions
        fake.release_grants()
        assert all(f.result(1).partition == i % partitions for i, f in enumerate(futs))
        assert not fake.corrupt


def test_every_flush_tops_the_lease_up_while_a_refill_is_late() -> None:
    """While the sender answers no Alloc, each flush asks for what the stock and the asks
    in flight lack, instead of waiting for the one ask before: with one ask at a time, a
    flush made before the last refill came asked for nothing, and a third flush within
    one slow round trip found the stock short (tests/broker/test_batching.py, a loaded
    machine)."""
    partitions = 10
    with (
        _lease_fake(partitions) as fake,
        attach(fake.handle) as w,
    ):
        assert w.stats()["worker"]["stock_buffers"] == 32
        fake.hold_grants = True
        asks_before = len(fake.allocs)
        futs = _flush_rounds(w, partitions, 3)
        assert w.stats()["batching"]["buffer_waits"] == 0
        assert w.stats()["worker"]["stock_buffers"] == 32 - 3 * partitions
        # the lease is 4 flushes of 10: each flush asked for its share of that
        assert fake.wait_for(lambda: len(fake.allocs) == asks_before + 3)
        asked = [a.count for a in fake.allocs[asks_before:]]
        assert sum(asked) == 4 * partitions - (32 - 3 * partitions), asked
        fake.release_grants()
        assert fake.wait_for(lambda: w.stats()["worker"]["stock_buffers"] == 4 * partitions)
        assert all(f.result(1).partition == i % partitions for i, f in enumerate(futs))
        assert not fake.corrupt


def test_a_flush_takes_a_refill_the_io_thread_has_not_read() -> None:
    """A thread sending in a loop holds the GIL while a Grant waits in the control socket
    for the I/O thread: a flush that finds its stock short takes that Grant itself
    instead of asking again and waiting. (Here the I/O thread is kept from reading.)"""
    partitions = 20
    with (
        _lease_fake(partitions, max_block_ms=2_000) as fake,
        attach(fake.handle) as w,
    ):
        assert w.stats()["worker"]["stock_buffers"] == 32
        futs = [w.send("events", b"x" * 300, partition=p) for p in range(partitions)]
        fake.hold_grants = True
        w.flush(5)  # 12 buffers left; the refill is asked for, and held
        assert w.stats()["worker"]["stock_buffers"] == 32 - partitions
        core: Any = w
        core._receive = lambda: None  # the I/O thread reads nothing from here on
        try:
            fake.release_grants()
            assert fake.wait_for(lambda: not fake.waiting)
            # the Grant is in the socket, unread (nothing else is sent to it now)
            assert select.select([core._sock], [], [], 5)[0]
            assert w.stats()["worker"]["stock_buffers"] == 32 - partitions
            futs += [w.send("events", b"x" * 300, partition=p) for p in range(partitions)]
            core._flush_stages()  # writes and hands over; needs 20, the stock holds 12
        finally:
            del core._receive
        assert w.stats()["batching"]["buffer_waits"] == 0  # no Alloc waited on
        w.flush(5)
        assert all(f.result(1).partition == i % partitions for i, f in enumerate(futs))
        assert not fake.corrupt


def test_a_flush_short_of_stock_writes_into_what_the_stock_holds_first() -> None:
    """A flush of more batches than its stock holds (30 batches, 25 buffers in stock,
    written a window at a time) writes and hands over 25 batches before it waits for the
    sender, and only for the rest; the refill may come meanwhile."""
    partitions = 30
    with (
        FakeSender(
            topics={"events": partitions},
            buffer_memory=100 * 4096,  # the first lease: a quarter of what is free, 25
            batch_size=4096,
            max_block_ms=10_000,
            **SLOW_LINGER,
        ) as fake,
        attach(fake.handle) as w,
    ):
        assert w.stats()["worker"]["stock_buffers"] == 25
        fake.hold_grants = True
        futs = [w.send("events", b"y" * 300, partition=p) for p in range(partitions)]
        flush = threading.Thread(target=w.flush, args=(5,))
        flush.start()
        assert fake.wait_for(lambda: len(fake.landed) >= 25)
        time.sleep(0.05)  # nothing more lands while the sender answers no Alloc
        assert len(fake.landed) == 25
        fake.release_grants()
        flush.join(5)
        assert not flush.is_alive()
        assert all(f.result(1).partition == i for i, f in enumerate(futs))
        assert w.stats()["batching"]["buffer_waits"] == 1
        assert not fake.corrupt


def test_the_first_lease_is_a_fair_share() -> None:
    """A process attaching beside three others asks at once for a whole fair share of the
    pool (half of it over four processes: 25 of 200 buffers), not half of one. (Measured
    in tests/broker/test_batching.py on a loaded machine: with half a fair share, 25
    buffers for five processes in a 512-buffer pool, a first flush of 12-14 buffers left
    too few for the second, and the refill came just after the second had asked.)"""
    with FakeSender(buffer_memory=200 * 4096, batch_size=4096) as fake:
        others = [attach(fake.handle) for _ in range(3)]
        try:
            with attach(fake.handle) as w:
                assert w.stats()["worker"]["stock_buffers"] == 200 // (2 * 4)
        finally:
            for o in others:
                o.close(5)


def test_done_error_fails_the_records() -> None:
    with FakeSender(done_error=87) as fake, attach(fake.handle) as w:
        futs = [w.send("events", b"v", partition=0) for _ in range(3)]
        w.flush(5)
        for f in futs:
            err = f.exception(0)
            assert isinstance(err, KafkaError) and err.code == 87
        stats = w.stats()["worker"]
        assert stats["records_failed"] == 3 and stats["records_acked"] == 0


def test_log_append_time_is_reported() -> None:
    with FakeSender(log_append_time=123_456) as fake, attach(fake.handle) as w:
        assert w.send("events", b"v", timestamp_ms=5).result(5).timestamp_ms == 123_456


def test_partition_count_change_is_picked_up() -> None:
    with FakeSender(topics={"events": 2}) as fake, attach(fake.handle) as w:
        assert w.send("events", b"v", partition=1).result(5).partition == 1
        with pytest.raises(UnknownPartitionError):
            w.send("events", b"v", partition=3)
        fake.set_partitions("events", 4)
        deadline = time.monotonic() + 5
        while True:  # bounded: the push arrives within milliseconds
            try:
                fut = w.send("events", b"v", partition=3)
                break
            except UnknownPartitionError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert fut.result(5).partition == 3
        assert fake.landed[-1].partition == 3


def test_growth_keeps_appending_to_the_partitions_open_batch() -> None:
    """After a topic grows, a partition it had keeps its home slot: this process goes on
    appending to the batch it had open (one batch, in order), never a second one under
    the new range's slot (the sender would see two queues for one partition)."""
    with FakeSender(topics={"events": 2}, linger_ms=60_000) as fake, attach(fake.handle) as w:
        first = w.send("events", b"before", partition=1)
        fake.set_partitions("events", 4)
        deadline = time.monotonic() + 5
        while True:  # bounded: the push arrives within milliseconds
            try:
                w.send("events", b"new", partition=3)
                break
            except UnknownPartitionError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        second = w.send("events", b"after", partition=1)
        w.flush(5)
        assert first.result(5).partition == second.result(5).partition == 1
        ones = [b for b in fake.landed if b.partition == 1]
        assert len(ones) == 1
        assert [r.value for r in ones[0].records] == [b"before", b"after"]


def test_callbacks_run_in_the_io_thread() -> None:
    """A callback added while the record is pending runs in the worker's I/O thread (a
    long linger: the record cannot be done before the callback is added)."""
    with FakeSender(**SLOW_LINGER) as fake, attach(fake.handle) as w:
        names: list[str] = []
        done = threading.Event()
        fut = w.send("events", b"v")
        fut.add_done_callback(lambda f: (names.append(threading.current_thread().name), done.set()))
        w.flush(5)
        assert done.wait(5)
        assert names[0].startswith("shmprod-worker-io")


def test_threads_keep_their_own_order(fake: FakeSender, w: Worker) -> None:
    def run(t: int) -> None:
        for i in range(300):
            w.send("events", f"{t}:{i}".encode(), partition=0)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    w.flush(5)
    got = [r.value.decode() for r in fake.records("events")[0] if r.value]
    assert len(got) == 1200
    for t in range(4):
        mine = [int(v.split(":")[1]) for v in got if v.startswith(f"{t}:")]
        assert mine == list(range(300))
