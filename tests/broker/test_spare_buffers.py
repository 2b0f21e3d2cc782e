"""Spare buffers through a real producer: a flush claims them from shared memory instead
of waiting for the sender, single buffers and runs of adjacent ones alike, and a process
that dies holding claims it never announced loses nothing of the pool.

The sender is stopped (SIGSTOP) in the first two tests, so no Grant can come: every
flush past the lease either claims spares or waits, and the counters say which.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest

from shmprod import Producer, attach, speedups
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.handle import Handle
from shmprod.worker.append import claim_spares
from tests.support.readback import consume_all

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(speedups.claim_words is None, reason="spares need the C extension"),
]

PARTITIONS = 12
ROUNDS = 6  # 72 batches: past the 32 of the first lease, within the 64 spares
RUN_PARTITIONS = 4
RUN_ROUNDS = 6  # 24 batches of two buffers: 48, past the 32 of the first lease
RUN_RECORDS = 200  # 1 KB each: 200 KB a batch, more than one buffer (128 KiB)
FIRST_LEASE = 32
SPARES = 64


def _send_while_the_sender_is_stopped(
    broker: EmbeddedBroker, topic: str, rounds: list[list[tuple[bytes, bytes, int]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sends each round of (value, key, partition) with the sender stopped (SIGSTOP),
    linger expiring between rounds; returns the batching stats before the rounds and
    while the sender was still stopped. Every record must then be delivered."""
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
        p.send(topic, b"warm", partition=0).result(30)
        time.sleep(0.1)  # the lease asked after that flush has come
        before = p.stats()["batching"]
        futs = []
        os.kill(p.sender_pid, signal.SIGSTOP)
        try:
            for records in rounds:
                futs += [p.send(topic, v, key=k, partition=q) for v, k, q in records]
                time.sleep(0.05)  # linger expires: the I/O thread hands the batches over
            stopped = p.stats()["batching"]
        finally:
            os.kill(p.sender_pid, signal.SIGCONT)
        p.flush(30)
        assert all(f.exception(0) is None for f in futs)
        assert p.stats()["sender"]["batches_failed"] == 0
    assert stopped["buffer_waits"] == before["buffer_waits"], (before, stopped)
    return before, stopped


def _landed_values(broker: EmbeddedBroker, topic: str, partitions: int, n: int) -> list[bytes]:
    landed = consume_all(broker.bootstrap, topic, partitions, n)
    return sorted(rec.value for recs in landed.values() for rec in recs)


def test_flushes_claim_spares_while_the_sender_cannot_run(fresh_broker: EmbeddedBroker) -> None:
    topic = f"spares-{os.getpid()}"
    fresh_broker.create_topic(topic, PARTITIONS)
    rounds = [[(b"r%d-p%d" % (r, q), b"k", q) for q in range(PARTITIONS)] for r in range(ROUNDS)]
    before, stopped = _send_while_the_sender_is_stopped(fresh_broker, topic, rounds)
    claimed = stopped["spares_claimed"] - before["spares_claimed"]
    batches = ROUNDS * PARTITIONS
    assert batches - FIRST_LEASE <= claimed <= batches, (before, stopped)
    expected = sorted([b"warm"] + [v for records in rounds for v, _, _ in records])
    assert _landed_values(fresh_broker, topic, PARTITIONS, len(expected)) == expected


def test_flushes_of_batches_longer_than_a_buffer_claim_spares_as_runs(
    fresh_broker: EmbeddedBroker,
) -> None:
    """A batch of two buffers takes two adjacent spares: claimed into the stock, the
    run is taken there, with no Grant asked for."""
    assert 2 * L.BUFFER_UNIT_MAX > RUN_RECORDS * 1000 > L.BUFFER_UNIT_MAX
    topic = f"spare-runs-{os.getpid()}"
    fresh_broker.create_topic(topic, RUN_PARTITIONS)
    rounds = [
        [
            (b"%d-%d-%04d-" % (r, q, i) + b"v" * 991, b"r%d" % r, q)
            for q in range(RUN_PARTITIONS)
            for i in range(RUN_RECORDS)
        ]
        for r in range(RUN_ROUNDS)
    ]
    before, stopped = _send_while_the_sender_is_stopped(fresh_broker, topic, rounds)
    claimed = stopped["spares_claimed"] - before["spares_claimed"]
    buffers = 2 * RUN_ROUNDS * RUN_PARTITIONS
    assert buffers - FIRST_LEASE <= claimed <= SPARES, (before, stopped)
    expected = sorted([b"warm"] + [v for records in rounds for v, _, _ in records])
    assert _landed_values(fresh_broker, topic, RUN_PARTITIONS, len(expected)) == expected


def _claim_and_die(handle: Handle, out: Any) -> None:
    w = attach(handle)
    # the claim a flush makes, without the Claimed that follows it
    got = claim_spares(w._view, w.geometry, w.worker_slot, 5)
    out.put((w.worker_slot, got))
    time.sleep(60)  # killed here


def test_a_process_killed_holding_unannounced_claims_gives_them_back(
    fresh_broker: EmbeddedBroker,
) -> None:
    with Producer(bootstrap_servers=fresh_broker.bootstrap, linger_ms=5) as p:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_claim_and_die, args=(p.handle, out))
        child.start()
        slot, got = out.get(timeout=60)
        assert len(got) == 5
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        word = L.descriptor_word(L.BUF_GRANTED, slot)
        view = p._worker()._view
        geo = p._worker().geometry
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            held = [
                b
                for b in range(geo.n_buffers)
                if L.U64.unpack_from(view, geo.descriptor(b) + L.D_WORD)[0] == word
            ]
            if not held and p.stats()["sender"]["workers_died"] == 1:
                break
            time.sleep(0.02)
        stats = p.stats()["sender"]
        assert held == [], held
        assert stats["workers_died"] == 1
        assert stats["buffers_reclaimed"] >= 5
        topic = f"after-{os.getpid()}"
        fresh_broker.create_topic(topic, 1)
        p.send(topic, b"x").result(30)
