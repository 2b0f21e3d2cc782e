"""End to end: many processes, one shared producer, one real broker, an independent reader.

Eight processes (half started by fork, half by spawn) attach by handle and each send
100,000 records to a 12-partition topic, mixing ``send`` and ``send_batch``, keyed and
null-keyed records, and headers. confluent-kafka reads the topic back: every record
exactly once, every future's (partition, offset) where confluent found it, and per
process and partition the records in send order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pytest

from shmprod import Producer, attach
from shmprod.broker import EmbeddedBroker
from shmprod.handle import Handle
from tests.support.readback import consume_all

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROCESSES = 8
PER_PROCESS = 100_000
SINGLE = 20_000  # of each process's records, this many go through send(); the rest in batches
CHUNK = 10_000
PARTITIONS = 12


def _value(proc: int, i: int) -> bytes:
    return b"p%d-%07d-" % (proc, i) + b"v" * (i % 50)


def _key(proc: int, i: int) -> bytes | None:
    return None if i % 10 == 0 else b"key-%d" % (i % 5000)


def _send_all(handle: Handle, proc: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Runs in a child: sends PER_PROCESS records; returns partitions and offsets by index."""
    worker = attach(handle)
    parts = np.full(PER_PROCESS, -1, np.int64)
    offsets = np.full(PER_PROCESS, -1, np.int64)
    try:
        futures = []
        for i in range(SINGLE):
            headers = [("proc", b"%d" % proc), ("i", b"%d" % i)] if i % 3 == 0 else None
            futures.append(worker.send("e2e", _value(proc, i), key=_key(proc, i), headers=headers))
        batch_futures = []
        for start in range(SINGLE, PER_PROCESS, CHUNK):
            idx = range(start, min(start + CHUNK, PER_PROCESS))
            values = pa.array([_value(proc, i) for i in idx], pa.binary())
            keys = pa.array([_key(proc, i) for i in idx], pa.binary())
            batch_futures.append(
                (
                    start,
                    worker.send_batch("e2e", values, keys=keys, headers=[("proc", b"%d" % proc)]),
                )
            )
        worker.flush(timeout=120)
        for i, fut in enumerate(futures):
            md = fut.result(timeout=60)
            parts[i] = md.partition
            offsets[i] = md.offset
        for start, bfut in batch_futures:
            bmd = bfut.result(timeout=60)
            n = len(bmd.offsets)
            parts[start : start + n] = bmd.partitions
            offsets[start : start + n] = bmd.offsets
    finally:
        worker.close()
    return proc, parts, offsets


def _child(handle: Handle, proc: int, out: Any) -> None:
    out.put(_send_all(handle, proc))


def test_eight_processes_one_producer(broker: EmbeddedBroker) -> None:
    topic = "e2e"
    broker.create_topic(topic, PARTITIONS)
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5, compression_type="lz4") as p:
        procs = []
        queues = []
        for proc in range(PROCESSES):
            ctx = mp.get_context("fork" if proc % 2 == 0 else "spawn")
            q = ctx.Queue()
            child = ctx.Process(target=_child, args=(p.handle, proc, q))
            child.start()
            procs.append(child)
            queues.append(q)
        for q in queues:
            proc, parts, offsets = q.get(timeout=300)
            results[proc] = (parts, offsets)
        for child in procs:
            child.join(60)
            assert child.exitcode == 0
        stats = p.stats()
        segment = p.handle.segment
        sender = p.sender_pid
    assert stats["sender"]["records_sent"] >= PROCESSES * PER_PROCESS

    landed = consume_all(broker.bootstrap, topic, PARTITIONS, PROCESSES * PER_PROCESS, 180)
    where: dict[bytes, tuple[int, int]] = {}
    for records in landed.values():
        for rec in records:
            assert rec.value is not None
            assert rec.value not in where, f"duplicate {rec.value!r}"
            where[rec.value] = (rec.partition, rec.offset)
    assert len(where) == PROCESSES * PER_PROCESS
    for proc, (parts, offsets) in results.items():
        for i in range(PER_PROCESS):
            assert where[_value(proc, i)] == (parts[i], offsets[i]), (proc, i)
        for part in range(PARTITIONS):
            mine = offsets[parts == part]
            assert (np.diff(mine) > 0).all(), f"order broken for process {proc} partition {part}"
    assert not os.path.exists(f"/dev/shm/{segment}"), "close() left the segment behind"
    assert not psutil.pid_exists(sender) or psutil.Process(sender).status() == "zombie"


def test_send_batch_partitions_with_nulls_use_the_partitioner_for_those_rows(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """An Arrow partitions column may hold nulls (Spark's Kafka sink allows a null
    partition): those rows go where the key's murmur2 sends them, the others where
    they say; an explicit bad partition is still refused."""
    from shmprod.errors import UnknownPartitionError
    from shmprod.partitioner import murmur2

    broker.create_topic(topic_name, 4)
    n = 2_000
    keys = [b"k%d" % (i % 50) for i in range(n)]
    parts = pa.array([i % 4 if i % 3 == 0 else None for i in range(n)], pa.int32())
    values = [b"v%d" % i for i in range(n)]
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        md = p.send_batch(topic_name, values, keys=keys, partitions=parts).result(30)
        with pytest.raises(UnknownPartitionError, match="partition 7 at row 1"):
            p.send_batch(topic_name, [b"a", b"b"], partitions=pa.array([None, 7]))
        all_null = p.send_batch(topic_name, [b"x"], keys=[b"k0"], partitions=pa.array([None]))
        assert int(all_null.result(30).partitions[0]) == (murmur2(b"k0") & 0x7FFFFFFF) % 4
    landed = consume_all(broker.bootstrap, topic_name, 4, n + 1, 30)
    where = {r.value: r.partition for recs in landed.values() for r in recs}
    for i in range(n):
        want = i % 4 if i % 3 == 0 else (murmur2(keys[i]) & 0x7FFFFFFF) % 4
        assert where[values[i]] == want == int(md.partitions[i])
