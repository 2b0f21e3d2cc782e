"""The sender's logic against a scripted broker, deterministic and fast: an in-process
Sender with a fake clock (tests/support/scripted_broker.py), no tansu, no subprocess. Each
scenario that the real-broker tests reach only by timing (splitting, epoch bumps,
unknown fates, in-flight deadlines, leader moves, dropped connections) is driven here
turn by turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ConfigError, ProducerConfig, text_options
from shmprod.errors import DeliveryTimeoutError, MetadataTimeoutError
from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import InitProducerIdRequest, ProduceRequest
from shmprod.sender import lifecycle
from tests.support.scripted_broker import SILENCE, WRITE_THEN_DROP, ScriptedBroker, SenderRig
from tests.support.sender_peers import values


def _ready_rig(broker: ScriptedBroker, **options: Any) -> Iterator[SenderRig]:
    """A rig whose sender said Ready over ``broker``; closes both after."""
    r = SenderRig(broker, **options)
    try:
        ready = r.worker.expect(ipc.Ready)
        assert ready.error == 0, ready
        yield r
    finally:
        r.close()
        broker.close()


@pytest.fixture
def rig() -> Iterator[SenderRig]:
    yield from _ready_rig(ScriptedBroker(nodes=2, topics={"t": 2}))


def test_a_batch_is_delivered_with_its_offset(rig: SenderRig) -> None:
    w = rig.worker
    base, n = w.topic("t")
    assert n == 2
    first = w.done(w.produce(base, values("a", 3)))
    second = w.done(w.produce(base, values("b", 2)))
    assert (first.error, first.base_offset, second.base_offset) == (0, 0, 3)
    assert rig.broker.values("t", 0) == values("a", 3) + values("b", 2)
    assert rig.stat(L.S_BUFFERS_FREE) == rig.geo.n_buffers


def _batches_at(rig: SenderRig, partition: int) -> list[tuple[int, int, int, int]]:
    """(node, epoch, base sequence, records) of every Produce of ``partition``."""
    return [
        (x.node, x.batch.producer_epoch, x.batch.base_sequence, x.batch.record_count)
        for x in rig.broker.landed
        if x.partition == partition
    ]


def test_too_large_is_split_and_both_halves_land_in_order(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 0, ec.MESSAGE_TOO_LARGE)
    bid = w.produce(base, values("s", 4))
    split = w.expect(ipc.DoneSplit, lambda m: m.batch_id == bid)
    assert [(p.error, p.base_offset) for p in split.pieces] == [(0, 0), (0, 2)], split
    assert rig.broker.values("t", 0) == values("s", 4)
    counts = [n for *_, n in _batches_at(rig, 0)]
    assert counts == [4, 2, 2]
    assert rig.stat(L.S_BUFFERS_FREE) == rig.geo.n_buffers


def test_unknown_fate_is_resent_with_its_sequence_and_written_once(rig: SenderRig) -> None:
    """Written, then the connection dropped before the answer: resent under the same
    producer id, epoch and sequence, the broker recognises it; one copy in the log."""
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 0, WRITE_THEN_DROP)
    done = w.done(w.produce(base, values("u", 3)))
    assert (done.error, done.base_offset) == (0, 0), done
    assert rig.broker.values("t", 0) == values("u", 3)  # once
    sent = _batches_at(rig, 0)
    assert len(sent) == 2 and sent[0][1:] == sent[1][1:] == (0, 0, 3)
    nxt = w.done(w.produce(base, values("v", 1)))
    assert nxt.base_offset == 3


def test_out_of_order_bumps_the_epoch_and_resends_from_sequence_zero(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    assert w.done(w.produce(base, values("a", 2))).base_offset == 0
    rig.broker.script("t", 0, ec.OUT_OF_ORDER_SEQUENCE_NUMBER)
    done = w.done(w.produce(base, values("b", 2)))
    assert (done.error, done.base_offset) == (0, 2), done
    assert rig.stat(L.S_EPOCH_BUMPS) == 1
    assert [(e, s) for _, e, s, _ in _batches_at(rig, 0)] == [(0, 0), (0, 2), (1, 0)]
    assert len(rig.broker.seen(InitProducerIdRequest)) == 1  # bumped, no new id
    assert rig.broker.values("t", 0) == values("a", 2) + values("b", 2)


def test_a_refused_bump_takes_a_new_producer_id(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 0, ec.OUT_OF_ORDER_SEQUENCE_NUMBER, ec.PRODUCER_FENCED)
    done = w.done(w.produce(base, values("f", 2)))
    assert (done.error, done.base_offset) == (0, 0), done
    assert len(rig.broker.seen(InitProducerIdRequest)) == 2
    pids = [x.batch.producer_id for x in rig.broker.landed]
    assert pids[0] == pids[1] != pids[2]
    assert rig.stat(L.S_PRODUCER_ID_RESETS) == 1


def test_a_leader_move_sends_the_batch_to_the_new_leader(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    assert w.done(w.produce(base, values("a", 1))).error == 0
    rig.broker.leaders[("t", 0)] = 1
    done = w.done(w.produce(base, values("b", 1)))
    assert (done.error, done.base_offset) == (0, 1), done
    nodes = [n for n, *_ in _batches_at(rig, 0)]
    # the retry may reach the old leader again before the new metadata (a backoff of
    # 10 ms against a metadata refresh no more often than that): refused there each time
    assert nodes[:2] == [0, 0] and nodes[-1] == 1 and set(nodes[2:-1]) <= {0}, nodes
    assert all(x.answer == ec.NOT_LEADER_OR_FOLLOWER for x in rig.broker.landed[1:-1])


def test_a_dropped_connection_loses_nothing(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 1, SILENCE)
    bid = w.produce(base + 1, values("d", 2))  # partition 1: node 1
    rig.turn()
    assert rig.broker.drop_connections(1) == 1
    done = w.done(bid)
    assert (done.error, done.base_offset) == (0, 0), done
    assert rig.broker.values("t", 1) == values("d", 2)
    assert [n for n, *_ in _batches_at(rig, 1)] == [1, 1]


def test_a_request_never_answered_times_out_and_is_retried(rig: SenderRig) -> None:
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 0, SILENCE)
    start = rig.now
    done = w.done(w.produce(base, values("r", 1)))
    assert (done.error, done.base_offset) == (0, 0), done
    assert rig.now - start >= rig.cfg.request_timeout_ms * 1_000_000  # only after it
    assert len(rig.broker.seen(ProduceRequest)) == 2


def test_in_flight_at_the_deadline_the_outcome_goes_out_then(rig: SenderRig) -> None:
    """KIP-91: a batch still in flight at its delivery deadline is reported then, as
    failed and retriable (it may still be written), not when its request ends."""
    w = rig.worker
    base, _ = w.topic("t")
    rig.broker.script("t", 0, *[SILENCE] * 20)
    start = rig.now
    bid = w.produce(base, values("x", 1))
    w.nothing(ipc.Done, within_ms=rig.cfg.delivery_timeout_ms - 100)
    done = w.done(bid)
    assert done.error == DeliveryTimeoutError.code and done.retriable, done
    waited = (rig.now - start) / 1_000_000
    assert rig.cfg.delivery_timeout_ms - 100 <= waited <= rig.cfg.delivery_timeout_ms + 1_000


def test_producer_id_failures_back_off_then_ready() -> None:
    broker = ScriptedBroker()
    broker.fail_producer_id(ec.COORDINATOR_NOT_AVAILABLE, ec.COORDINATOR_NOT_AVAILABLE)
    r = SenderRig(broker)
    try:
        start = r.now
        ready = r.worker.expect(ipc.Ready)
        assert ready.error == 0, ready
        assert len(broker.seen(InitProducerIdRequest)) == 3
        backoffs = (10 + 20) * 0.8  # two failures in a row: 10 ms, then 20 ms, -20% jitter
        assert (r.now - start) / 1_000_000 >= backoffs
    finally:
        r.close()
        broker.close()


def test_retries_exhausted_fail_the_batch_with_the_brokers_error() -> None:
    broker = ScriptedBroker()
    r = SenderRig(broker, retries=1)
    try:
        assert r.worker.expect(ipc.Ready).error == 0
        w = r.worker
        base, _ = w.topic("t")
        broker.script("t", 0, ec.NOT_ENOUGH_REPLICAS, ec.NOT_ENOUGH_REPLICAS)
        done = w.done(w.produce(base, values("n", 1)))
        assert done.error == ec.NOT_ENOUGH_REPLICAS and done.retriable, done
        assert broker.values("t", 0) == []
        assert r.stat(L.S_BUFFERS_FREE) == r.geo.n_buffers
        assert w.done(w.produce(base, values("m", 1))).base_offset == 0  # sequences go on
    finally:
        r.close()
        broker.close()


def test_no_broker_at_start_fails_ready_and_exits_with_the_bootstrap_status() -> None:
    broker = ScriptedBroker()
    broker.close()  # nothing listens: every connection is refused
    r = SenderRig(broker, max_block_ms=2_000)
    try:
        ready = r.worker.expect(ipc.Ready, within_ms=5_000)
        assert ready.error == MetadataTimeoutError.code, ready
        assert "max_block_ms=2000" in ready.message
        r.turn()
        assert r.status == lifecycle.EXIT_BOOTSTRAP_FAILED
        assert L.U32.unpack_from(r.view, L.H_STATE)[0] == L.STATE_FAILED
    finally:
        r.close()


# -- several connections per broker (connections_per_broker) ----------------------------


@pytest.fixture
def lanes() -> Iterator[SenderRig]:
    yield from _ready_rig(ScriptedBroker(nodes=1, topics={"t": 4}), connections_per_broker=2)


def _conns_of(rig: SenderRig, partitions: int) -> dict[int, set[int]]:
    """The connections (serials) each partition's Produces came over."""
    return {p: {x.conn for x in rig.broker.landed if x.partition == p} for p in range(partitions)}


def test_two_connections_per_broker_keep_each_partition_on_one(lanes: SenderRig) -> None:
    w = lanes.worker
    base, n = w.topic("t")
    for rnd in range(3):
        bids = [w.produce(base + p, values(f"{p}.{rnd}", 2)) for p in range(n)]
        for bid in bids:
            assert w.done(bid).error == 0
    for p in range(n):
        assert lanes.broker.values("t", p) == [
            v for rnd in range(3) for v in values(f"{p}.{rnd}", 2)
        ]
    conns = _conns_of(lanes, n)
    assert all(len(c) == 1 for c in conns.values()), conns
    assert len(set().union(*conns.values())) == 2, conns  # both connections carry some
    assert lanes.broker.connections(0) == 2


def test_a_dropped_lane_loses_nothing_and_keeps_each_partition_on_one(
    lanes: SenderRig,
) -> None:
    w = lanes.worker
    base, n = w.topic("t")
    for p in range(n):
        assert w.done(w.produce(base + p, values(f"a{p}", 1))).error == 0
    before = len(lanes.broker.landed)
    lanes.broker.script("t", 1, SILENCE)  # written nowhere, never answered
    bid = w.produce(base + 1, values("d", 2))
    lanes.turn()
    assert lanes.broker.drop_connections(0) == 2
    done = w.done(bid)
    assert (done.error, done.base_offset) == (0, 1), done
    for p in range(n):
        assert w.done(w.produce(base + p, values(f"b{p}", 1))).error == 0
    assert lanes.broker.values("t", 1) == values("a1", 1) + values("d", 2) + values("b1", 1)
    after = [x for x in lanes.broker.landed[before:] if x.answer != SILENCE]
    conns = {p: {x.conn for x in after if x.partition == p} for p in range(n)}
    assert all(len(c) == 1 for c in conns.values()), conns  # the new connections
    assert lanes.broker.connections(0) == 2


@pytest.mark.parametrize("bad", [0, 17, -1, 1.5, True, "2"])
def test_connections_per_broker_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="connections_per_broker"):
        ProducerConfig(bootstrap_servers="127.0.0.1:9092", connections_per_broker=bad)


def test_connections_per_broker_is_read_from_text() -> None:
    options = text_options({"bootstrap.servers": "127.0.0.1:9092", "connections.per.broker": "3"})
    assert ProducerConfig(**options).connections_per_broker == 3
