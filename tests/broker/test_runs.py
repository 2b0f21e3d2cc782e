"""Batches of several run lengths through the real sender: a partition's remainder put in
the head of a longer run lands like any batch, and the buffers it did not need go back
to the pool with its Sealed."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from tests.support.faultrig import wait_until
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

PARTITIONS = 12
ROWS = 840  # per partition: a full batch of ~519 1 KB records (4 buffers), then 3 buffers


def test_remainders_in_the_heads_of_longer_runs_land_and_nothing_of_the_pool_is_lost(
    broker: EmbeddedBroker,
) -> None:
    topic = "runs-heads"
    broker.create_topic(topic, PARTITIONS)
    values = pa.array([os.urandom(1000) for _ in range(PARTITIONS * ROWS)], pa.binary())
    parts = np.repeat(np.arange(PARTITIONS, dtype=np.int32), ROWS)
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
        assert p.stats()["pool"]["buffer_size"] == 128 * 1024
        assert p.config.batch_size == 512 * 1024
        md = p.send_batch(topic, values, partitions=parts).result(60)
        assert list(md.partitions) == parts.tolist()

        def settled() -> bool:
            pool = p.stats()["pool"]
            return (pool["buffers_sealed"], pool["buffers_in_flight"], pool["buffers_cont"]) == (
                0,
                0,
                0,
            )

        assert wait_until(settled, 10)
        pool = p.stats()["pool"]
        sender = p.stats()["sender"]
        assert sender["batches_sent"] >= 2 * PARTITIONS and sender["batches_failed"] == 0
        assert sender["errors"] == 0
        # every buffer is free, spare, or in this process's stock (granted): none lost
        held = pool["buffers_free"] + pool["buffers_spare"] + pool["buffers_granted"]
        assert held == pool["buffers_total"], pool
        assert pool["buffers_granted"] == p.stats()["worker"]["stock_buffers"]
    got = consume_all(broker.bootstrap, topic, PARTITIONS, PARTITIONS * ROWS)
    assert [len(got[q]) for q in range(PARTITIONS)] == [ROWS] * PARTITIONS
    assert [r.value for q in range(PARTITIONS) for r in got[q]] == values.to_pylist()
    offsets = {q: [r.offset for r in got[q]] for q in range(PARTITIONS)}
    for q in range(PARTITIONS):
        assert md.offsets[q * ROWS : (q + 1) * ROWS].tolist() == offsets[q]


def test_lz4_batches_that_fill_their_runs_land_compressed_and_read_back(
    broker: EmbeddedBroker,
) -> None:
    # the suite's 1 KB keyed shape: incompressible 16 B keys and 1,000 B values, cut into
    # batches whose lz4 frames (stored blocks, a little longer than the records) fill
    # runs of 4 buffers; another client reads every record back (the fake sender's test
    # checks that each batch went compressed)
    topic = "runs-lz4"
    broker.create_topic(topic, PARTITIONS)
    n = PARTITIONS * ROWS
    values = pa.array([os.urandom(1000) for _ in range(n)], pa.binary())
    keys = pa.array([os.urandom(16) for _ in range(n)], pa.binary())
    parts = np.repeat(np.arange(PARTITIONS, dtype=np.int32), ROWS)
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5, compression_type="lz4") as p:
        md = p.send_batch(topic, values, keys=keys, partitions=parts).result(60)
        sender = p.stats()["sender"]
        assert sender["batches_failed"] == 0 and sender["errors"] == 0
    got = consume_all(broker.bootstrap, topic, PARTITIONS, n)
    assert [len(got[q]) for q in range(PARTITIONS)] == [ROWS] * PARTITIONS
    flat = [r for q in range(PARTITIONS) for r in got[q]]
    assert [r.value for r in flat] == values.to_pylist()
    assert [r.key for r in flat] == keys.to_pylist()
    for q in range(PARTITIONS):
        assert md.offsets[q * ROWS : (q + 1) * ROWS].tolist() == [r.offset for r in got[q]]
