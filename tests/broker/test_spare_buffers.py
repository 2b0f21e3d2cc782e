"""Spare buffers through a real producer: a flush claims them from shared memory instead
of waiting for the sender, and a process that dies holding claims it never announced
loses nothing of the pool.

The sender is stopped (SIGSTOP) in the first test, so no Grant can come: every flush
past the lease either claims spares or waits, and the counters say which.
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


def test_flushes_claim_spares_while_the_sender_cannot_run(fresh_broker: EmbeddedBroker) -> None:
    topic = f"spares-{os.getpid()}"
    fresh_broker.create_topic(topic, PARTITIONS)
    with Producer(bootstrap_servers=fresh_broker.bootstrap, linger_ms=5) as p:
        p.send(topic, b"warm", partition=0).result(30)
        time.sleep(0.1)  # the lease asked after that flush has come
        before = p.stats()["batching"]
        futs = []
        os.kill(p.sender_pid, signal.SIGSTOP)
        try:
            for r in range(ROUNDS):
                futs += [
                    p.send(topic, b"r%d-p%d" % (r, q), key=b"k", partition=q)
                    for q in range(PARTITIONS)
                ]
                time.sleep(0.05)  # linger expires: the I/O thread hands the batches over
            stopped = p.stats()["batching"]
        finally:
            os.kill(p.sender_pid, signal.SIGCONT)
        p.flush(30)
        assert all(f.exception(0) is None for f in futs)
        after = p.stats()
    assert stopped["buffer_waits"] == before["buffer_waits"], (before, stopped)
    claimed = stopped["spares_claimed"] - before["spares_claimed"]
    assert ROUNDS * PARTITIONS - 32 <= claimed <= ROUNDS * PARTITIONS, (before, stopped)
    assert after["sender"]["batches_failed"] == 0
    landed = consume_all(fresh_broker.bootstrap, topic, PARTITIONS, 1 + ROUNDS * PARTITIONS)
    values = sorted(rec.value for recs in landed.values() for rec in recs)
    expected = sorted([b"warm"] + [b"r%d-p%d" % (r, q) for r in range(ROUNDS) for q in range(12)])
    assert values == expected


RUN_PARTITIONS = 4
RUN_ROUNDS = 6  # 24 batches of two buffers: 48, past the 32 of the first lease
RUN_RECORDS = 200  # 1 KB each: 200 KB a batch, more than one 128 KiB buffer


def test_flushes_of_batches_longer_than_a_buffer_claim_spares_as_runs(
    fresh_broker: EmbeddedBroker,
) -> None:
    topic = f"spare-runs-{os.getpid()}"
    fresh_broker.create_topic(topic, RUN_PARTITIONS)
    value = b"v" * 1000
    assert (
        2 * L.BUFFER_UNIT_MAX > RUN_RECORDS * len(value) > L.BUFFER_UNIT_MAX
    )  # the default buffer
    with Producer(bootstrap_servers=fresh_broker.bootstrap, linger_ms=5) as p:
        p.send(topic, b"warm", partition=0).result(30)
        time.sleep(0.1)  # the lease asked after that flush has come
        before = p.stats()["batching"]
        futs = []
        os.kill(p.sender_pid, signal.SIGSTOP)
        try:
            for r in range(RUN_ROUNDS):
                futs += [
                    p.send(topic, value, key=b"r%d-%d" % (r, i), partition=q)
                    for q in range(RUN_PARTITIONS)
                    for i in range(RUN_RECORDS)
                ]
                time.sleep(0.05)  # linger expires: the I/O thread hands the batches over
            stopped = p.stats()["batching"]
        finally:
            os.kill(p.sender_pid, signal.SIGCONT)
        p.flush(30)
        assert all(f.exception(0) is None for f in futs)
        after = p.stats()
    assert stopped["buffer_waits"] == before["buffer_waits"], (before, stopped)
    claimed = stopped["spares_claimed"] - before["spares_claimed"]
    wanted = 2 * RUN_ROUNDS * RUN_PARTITIONS
    assert wanted - 32 <= claimed <= 64, (before, stopped)
    assert after["sender"]["batches_failed"] == 0
    assert after["sender"]["records_sent"] == 1 + len(futs)


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
