"""The shared metadata table: the sender writes TOPIC slots under a seqlock, workers read."""

from __future__ import annotations

import threading
import time

from shmprod import layout as L
from shmprod.partitioner import default_random_source
from shmprod.sender.shmstate import SharedState
from shmprod.worker.topics import TopicTable


def test_reader_never_sees_a_slot_while_it_is_written() -> None:
    geo = L.Geometry(n_buffers=2, buffer_size=4096, max_workers=2, max_topics=4, max_partitions=64)
    view = memoryview(bytearray(geo.segment_size))
    L.write_header(view, geo, 1, 1)
    shared = SharedState(view, geo)
    table = TopicTable(view, geo, 4096, default_random_source(1))

    for i in range(3):
        shared.init_partition(5 + i, leader=0, home=5 + i)
    shared.write_topic(0, name="t", state=L.TOPIC_READY, n_partitions=3, base=5, error=0)
    # Written but not published: the epoch is odd, so the reader waits and then gives up.
    t0 = time.monotonic()
    assert table.read_slot(0, "t") is None
    assert time.monotonic() - t0 < 5

    threading.Timer(0.05, shared.bump_metadata_epoch).start()
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = table.read_slot(0, "t")
    assert got == (3, [5, 6, 7])
    assert table.read_epoch() % 2 == 0
    assert table.read_slot(0, "other") is None  # a slot answers only for its own name


def test_scribbled_table_reads_as_missing_never_out_of_bounds() -> None:
    """The topic table is read from shared memory any process could scribble on: random
    bytes in TOPIC and PARTITION slots give None (ask the sender again) or a topic whose
    every home slot is inside the table, and stats() readers never raise."""
    import random

    from shmprod.worker.shmstats import read_topics

    geo = L.Geometry(n_buffers=2, buffer_size=4096, max_workers=2, max_topics=4, max_partitions=64)
    view = memoryview(bytearray(geo.segment_size))
    L.write_header(view, geo, 1, 1)
    shared = SharedState(view, geo)
    table = TopicTable(view, geo, 4096, default_random_source(1))
    rng = random.Random(7)
    for i in range(4):
        shared.init_partition(i, leader=0, home=i)
    for _ in range(400):
        shared.write_topic(0, name="t", state=L.TOPIC_READY, n_partitions=4, base=0, error=0)
        shared.bump_metadata_epoch()
        region = rng.choice([geo.topic(0), geo.partition(rng.randrange(8))])
        at = region + rng.randrange(64)
        view[at : at + 4] = rng.randbytes(4)
        got = table.read_slot(0, "t")
        if got is not None:
            n, homes = got
            assert n >= 1 and len(homes) == n
            assert all(0 <= h < geo.max_partitions for h in homes)
        read_topics(view, geo)
        for i in range(8):  # repair for the next round
            shared.init_partition(i, leader=0, home=i)
