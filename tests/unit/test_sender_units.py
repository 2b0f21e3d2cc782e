"""Sender logic without sockets or processes: pool, queues, drain, retry policy,
sequences and the metadata table, over a plain bytearray "segment" and a fake clock."""

from __future__ import annotations

import random

import pytest

from shmprod import ipc
from shmprod import layout as L
from shmprod.config import ProducerConfig
from shmprod.errors import (
    BufferExhaustedError,
    DeliveryTimeoutError,
    MetadataTimeoutError,
    ProducerClosedError,
    RecordTooLargeError,
)
from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import (
    InitProducerIdResponse,
    MetadataResponse,
    MetadataResponseBroker,
    MetadataResponsePartition,
    MetadataResponseTopic,
)
from shmprod.sender.accumulator import Accumulator
from shmprod.sender.batch import NO_SEQUENCE, Batch
from shmprod.sender.completions import Completions
from shmprod.sender.drain import Drainer
from shmprod.sender.idempotence import ProducerIdentity, next_sequence
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.lifecycle import EXIT_CRASHED, EXIT_OK, Lifecycle, Phase
from shmprod.sender.metadata import Metadata
from shmprod.sender.policy import Action, backoff_ns, decide
from shmprod.sender.pool import BufferPool
from shmprod.sender.produce import BatchAnswer
from shmprod.sender.producer_id import PidStep, ProducerIdDriver
from shmprod.sender.shmstate import SharedState
from tests.support.segments import shared, stat

MS = 1_000_000


def desc(s: SharedState, buffer: int, field: int) -> int:
    return int(L.U32.unpack_from(s.view, s.geo.descriptor(buffer) + field)[0])


_arrivals = iter(range(1, 1 << 30))


def batch(slot: int = 0, length: int = 100, count: int = 1, **kw: int) -> Batch:
    fields = {
        "buffer": 0,
        "run": 1,
        "partition_slot": slot,
        "batch_id": 1,
        "length": length,
        "record_count": count,
        "origin": 1,
        "sealed_ns": 0,
        "deadline_ns": 10**12,
        "arrival": next(_arrivals),
    }
    fields.update(kw)
    return Batch(**fields)  # type: ignore[arg-type]


# -- pool ------------------------------------------------------------------------------


def test_pool_grants_first_fit_and_describes_buffers() -> None:
    s = shared()
    pool = BufferPool(s)
    g = pool.alloc(owner=1, owner_slot=0, request_id=7, run=1, count=3, now_ns=0)
    assert g is not None and g.error == 0 and g.buffers == (0, 1, 2)
    assert stat(s, L.S_BUFFERS_FREE) == 5
    assert desc(s, 0, L.D_STATE) == L.BUF_GRANTED
    run = pool.alloc(1, 0, 8, run=3, count=1, now_ns=0)
    assert run is not None and run.buffers == (3,)
    assert [desc(s, b, L.D_STATE) for b in (3, 4, 5)] == [L.BUF_GRANTED, L.BUF_CONT, L.BUF_CONT]
    assert pool.granted(1) == {0: 1, 1: 1, 2: 1, 3: 3}


def test_pool_refuses_impossible_requests() -> None:
    pool = BufferPool(shared())
    big = pool.alloc(1, 0, 1, run=9, count=1, now_ns=0)
    assert big is not None and big.error == RecordTooLargeError.code
    many = pool.alloc(1, 0, 2, run=2, count=5, now_ns=0)
    assert many is not None and many.error == BufferExhaustedError.code
    assert pool.n_free == 8 and pool.n_waiting == 0


def test_pool_waiters_are_served_in_strict_fifo_and_runs_are_not_starved() -> None:
    s = shared()
    pool = BufferPool(s)
    all8 = pool.alloc(1, 0, 1, run=1, count=8, now_ns=0)
    assert all8 is not None and all8.error == 0
    assert pool.alloc(2, 1, 10, run=3, count=1, now_ns=1) is None  # waits
    assert pool.alloc(3, 2, 11, run=1, count=1, now_ns=2) is None  # waits behind the run
    assert stat(s, L.S_ALLOC_WAITERS) == 2
    # two singles come back: enough for the single, not for the run: nobody is served
    assert pool.seal(1, 0, 1) and pool.free(0, 1) == []
    assert pool.seal(1, 1, 1) and pool.free(1, 1) == []
    # the third adjacent buffer makes the run: the run goes first, then the single
    assert pool.seal(1, 2, 1)
    assert pool.free(2, 1)[0].request_id == 10
    assert pool.n_waiting == 1
    served = pool.release(1, 6, 1)
    assert served is not None and [(r.owner, r.buffers) for r in served] == [(3, (6,))]
    assert stat(s, L.S_ALLOC_WAITERS) == 0


def test_pool_seal_and_release_check_ownership() -> None:
    pool = BufferPool(shared())
    pool.alloc(1, 0, 1, run=2, count=1, now_ns=0)
    assert not pool.seal(2, 0, 2)  # not its grant
    assert not pool.seal(1, 1, 1)  # inside the run, not its head
    assert not pool.seal(1, 0, 3)  # longer than the run
    assert pool.release(2, 0, 2) is None
    assert pool.seal(1, 0, 2)
    assert not pool.seal(1, 0, 2)  # already sealed
    pool.free(0, 2)
    with pytest.raises(ValueError, match="double free"):
        pool.free(0, 2)


def test_a_batch_in_the_head_of_a_longer_run_leaves_the_rest_granted_one_by_one() -> None:
    s = shared()
    pool = BufferPool(s)
    got = pool.alloc(1, 0, 1, run=4, count=1, now_ns=0)
    assert got is not None and got.buffers == (0,)
    assert pool.seal(1, 0, 3)  # a batch of three buffers in the run of four
    assert [pool.holder(b) for b in range(4)] == ["the sender"] * 3 + ["granted"]
    assert pool.granted(1) == {3: 1}
    assert not pool.seal(2, 3, 1)  # still this worker's, not another's
    served = pool.release(1, 3, 1)  # given back with the Sealed
    assert served == [] and pool.is_free(3) and pool.granted(1) == {}
    assert pool.free(0, 3) == [] and all(pool.is_free(b) for b in range(4))
    # a worker that dies holding the rest of a run: every buffer comes back
    pool.alloc(1, 0, 2, run=4, count=1, now_ns=0)
    assert pool.seal(1, 0, 1)
    assert pool.granted(1) == {1: 1, 2: 1, 3: 1}
    assert pool.reclaim(1)[0] == 3
    assert pool.free(0, 1) == [] and all(pool.is_free(b) for b in range(4))


def test_pool_gives_singles_as_a_block_and_takes_them_back_as_one_run() -> None:
    s = shared()
    pool = BufferPool(s)
    one = pool.alloc(1, 0, 1, run=1, count=1, now_ns=0)
    gap = pool.alloc(2, 1, 2, run=1, count=1, now_ns=0)
    assert one is not None and gap is not None and (one.buffers, gap.buffers) == ((0,), (1,))
    assert pool.seal(1, 0, 1) and pool.free(0, 1) == []  # buffer 0 free, 1 still granted
    block = pool.alloc(1, 0, 3, run=1, count=3, now_ns=0)
    assert block is not None and block.buffers == (2, 3, 4)  # adjacent, not 0, 2, 3
    assert not pool.seal(2, 2, 3)  # not its buffers
    assert not pool.seal(1, 1, 2)  # buffer 1 is another worker's
    assert not pool.seal(1, 3, 3)  # buffer 5 is not granted
    assert pool.seal(1, 2, 3)  # three adjacent singles sealed as one run
    assert pool.granted(1) == {}
    assert pool.free(2, 3) == [] and pool.n_free == 7
    again = pool.alloc(1, 0, 4, run=1, count=2, now_ns=0)
    assert again is not None
    served = pool.release(1, again.buffers[0], 2)  # released as one run too
    assert served == [] and pool.n_free == 7 and pool.granted(1) == {}


def test_pool_reclaims_a_dead_workers_grants_and_waiters() -> None:
    s = shared()
    pool = BufferPool(s)
    pool.alloc(1, 0, 1, run=1, count=6, now_ns=0)
    pool.alloc(2, 1, 2, run=1, count=2, now_ns=0)
    assert pool.alloc(2, 1, 3, run=1, count=1, now_ns=0) is None  # worker 2 waits
    assert pool.alloc(3, 2, 4, run=2, count=1, now_ns=0) is None  # worker 3 waits
    assert pool.seal(1, 0, 1)  # worker 1 sealed one batch: that one is not reclaimed
    n, served = pool.reclaim(1)
    assert n == 5
    assert [(r.owner, r.request_id) for r in served] == [(2, 3), (3, 4)]  # FIFO
    assert pool.granted(1) == {}
    assert not pool.is_free(0)  # the sealed batch's buffer stays with the sender


def test_pool_close_refuses_waiters_and_new_requests() -> None:
    pool = BufferPool(shared())
    pool.alloc(1, 0, 1, run=1, count=8, now_ns=0)
    pool.alloc(2, 1, 5, run=1, count=1, now_ns=0)
    refused = pool.close()
    assert [(r.request_id, r.error) for r in refused] == [(5, ProducerClosedError.code)]
    again = pool.alloc(2, 1, 6, run=1, count=1, now_ns=0)
    assert again is not None and again.error == ProducerClosedError.code


# -- accumulator -----------------------------------------------------------------------


def test_accumulator_fifo_depth_and_retry_order() -> None:
    s = shared()
    acc = Accumulator(s)
    a, b, c = batch(3), batch(3), batch(3)
    for x in (a, b, c):
        acc.append(x)
    assert L.U32.unpack_from(s.view, s.geo.partition(3) + L.P_QUEUE_DEPTH)[0] == 3
    assert acc.pop_head(3) is a and acc.pop_head(3) is b
    # a and b were sent with sequences 0 and 1 and both failed: b's answer came first
    a.sequence, b.sequence = 0, 1
    a.attempts = b.attempts = 1
    acc.requeue(b)
    acc.requeue(a)
    assert [acc.pop_head(3) for _ in range(3)] == [a, b, c]
    assert len(acc) == 0 and list(acc.ready_slots()) == []


def test_retries_across_a_reset_keep_the_order_they_arrived_in() -> None:
    """Sequences of two identities do not compare: a retried batch renumbered from 0
    under a new producer id must not go before an older one still holding its old
    sequence; between identities the order is the order of arrival."""
    acc = Accumulator(shared())
    old, new = batch(3), batch(3)
    old.sequence, old.producer_id, old.producer_epoch = 100, 7, 0
    new.sequence, new.producer_id, new.producer_epoch = 0, 8, 0  # renumbered already
    old.attempts = new.attempts = 1
    acc.requeue(new)
    acc.requeue(old)
    assert [acc.pop_head(3), acc.pop_head(3)] == [old, new]


def test_accumulator_expires_batches_past_their_deadline() -> None:
    acc = Accumulator()
    early, late = batch(1, deadline_ns=100), batch(1, deadline_ns=300)
    acc.append(early)
    acc.append(late)
    acc.append(batch(2, deadline_ns=100))
    assert acc.expire(99) == []
    gone = acc.expire(100)
    assert early in gone and len(gone) == 2
    assert len(acc) == 1 and acc.head(1) is late


# -- drain -----------------------------------------------------------------------------


def test_drain_one_batch_per_partition_bounded_by_request_size() -> None:
    acc = Accumulator()
    for slot in range(4):
        for _ in range(2):
            acc.append(batch(slot, length=400))
    d = Drainer(max_request_size=1000, partition_in_flight_limit=5)
    first = d.drain(7, [0, 1, 2, 3], acc, {}, now_ns=0)
    assert [b.partition_slot for b in first] == [0, 1]  # 400 + 400; a third would pass 1000
    second = d.drain(7, [0, 1, 2, 3], acc, {}, now_ns=0)
    assert [b.partition_slot for b in second] == [2, 3]  # rotation starts where it stopped
    third = d.drain(7, [0, 1, 2, 3], acc, {}, now_ns=0)
    assert [b.partition_slot for b in third] == [0, 1]


def test_drain_sends_an_oversized_batch_alone() -> None:
    acc = Accumulator()
    acc.append(batch(0, length=5000))
    acc.append(batch(1, length=10))
    d = Drainer(max_request_size=1000, partition_in_flight_limit=5)
    assert [b.length for b in d.drain(1, [0, 1], acc, {}, 0)] == [5000]
    assert [b.length for b in d.drain(1, [0, 1], acc, {}, 0)] == [10]


def test_drain_respects_backoff_in_flight_and_retry_gating() -> None:
    acc = Accumulator()
    retry = batch(0, attempts=1, retry_at_ns=100 * MS)
    acc.append(retry)
    acc.append(batch(1))
    acc.append(batch(2))
    d = Drainer(max_request_size=1 << 20, partition_in_flight_limit=2)
    in_flight = {1: 2}  # partition 1 at its limit
    by_node, no_leader = d.ready_by_leader(acc, lambda s: -1 if s == 2 else 5, in_flight, 0)
    assert by_node == {} and no_leader == [2]  # 0 waits for backoff, 1 is at its limit
    assert d.drain(5, [0, 1], acc, in_flight, now_ns=0) == []
    # backoff over, but a retry is resent only when nothing of its partition is in flight
    assert d.drain(5, [0], acc, {0: 1}, now_ns=200 * MS) == []
    assert d.drain(5, [0], acc, {}, now_ns=200 * MS) == [retry]


# -- policy and sequences --------------------------------------------------------------


def test_policy_decisions() -> None:
    ident = ProducerIdentity(True)
    ident.set_identity(9, 0)
    b = batch(0, count=2, deadline_ns=1000)
    assert decide(0, b, ident, retries=5, now_ns=0).action is Action.SUCCEED
    # DUPLICATE_SEQUENCE_NUMBER is success only for a batch that an unanswered request
    # carried before with its sequence (an answered error means it was not written)
    b.maybe_written = True
    assert decide(ec.DUPLICATE_SEQUENCE_NUMBER, b, ident, 5, 0).action is Action.SUCCEED
    b.maybe_written = False
    first = decide(ec.DUPLICATE_SEQUENCE_NUMBER, b, ident, 5, 0)
    assert (first.action, first.code, first.reset_producer) == (
        Action.FAIL,
        ec.DUPLICATE_SEQUENCE_NUMBER,
        True,
    )
    nl = decide(ec.NOT_LEADER_OR_FOLLOWER, b, ident, 5, 0)
    assert nl.action is Action.RETRY and nl.refresh_metadata
    rt = decide(ec.REQUEST_TIMED_OUT, b, ident, 5, 0)
    assert rt.action is Action.RETRY and not rt.refresh_metadata
    too_big = decide(ec.MESSAGE_TOO_LARGE, b, ident, 5, 0)
    assert too_big.action is Action.SPLIT  # two records: split in two
    lone = batch(0, count=1, deadline_ns=1000)
    one = decide(ec.MESSAGE_TOO_LARGE, lone, ident, 5, 0)
    assert (one.action, one.code, one.retriable) == (Action.FAIL, ec.MESSAGE_TOO_LARGE, False)
    too_late = decide(ec.MESSAGE_TOO_LARGE, b, ident, 5, now_ns=1000)
    assert (too_late.action, too_late.code) == (Action.FAIL, DeliveryTimeoutError.code)
    late = decide(ec.REQUEST_TIMED_OUT, b, ident, 5, now_ns=1000)
    assert (late.action, late.code) == (Action.FAIL, DeliveryTimeoutError.code)
    b.attempts = 5
    spent = decide(ec.REQUEST_TIMED_OUT, b, ident, 5, 0)
    assert (spent.action, spent.code, spent.retriable) == (Action.FAIL, ec.REQUEST_TIMED_OUT, True)
    b.attempts = 0
    # OUT_OF_ORDER for the first unacknowledged batch: reset; for a later one: just retry
    ident.assign(b)
    assert decide(ec.OUT_OF_ORDER_SEQUENCE_NUMBER, b, ident, 5, 0).reset_producer
    later = batch(0)
    ident.assign(later)
    oo = decide(ec.OUT_OF_ORDER_SEQUENCE_NUMBER, later, ident, 5, 0)
    assert oo.action is Action.RETRY and not oo.reset_producer
    assert decide(ec.UNKNOWN_PRODUCER_ID, later, ident, 5, 0).reset_producer
    plain = ProducerIdentity(False)
    assert decide(ec.DUPLICATE_SEQUENCE_NUMBER, b, plain, 5, 0).action is Action.FAIL


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    rng = random.Random(1)
    values = [backoff_ns(a, 100, 1000, rng) / MS for a in range(1, 8)]
    assert 80 <= values[0] <= 120 and 160 <= values[1] <= 240
    assert all(v <= 1000 for v in values) and values[-1] >= 800
    assert backoff_ns(0, 100, 1000) == 0


def test_sequences_are_assigned_once_per_identity_and_wrap() -> None:
    ident = ProducerIdentity(True)
    ident.set_identity(4, 0)
    a, b = batch(0, count=3), batch(0, count=2)
    assert ident.assign(a) and ident.assign(b)
    assert (a.sequence, b.sequence) == (0, 3)
    assert not ident.assign(a)  # a retry keeps its sequence
    assert ident.is_next_expected(a) and not ident.is_next_expected(b)
    ident.acknowledge(a)
    assert ident.is_next_expected(b)
    ident.request_reset()
    assert ident.reset_pending and ident.can_drain  # only fates still unknown go now
    assert not ident.resolving(b)  # never sent: nothing to learn
    b.unresolved = True  # sent, then the connection dropped
    assert ident.resolving(b)
    ident.set_identity(5, 0)
    assert not ident.resolving(b)  # not under the new identity
    assert ident.assign(b) and b.sequence == 0 and b.producer_id == 5
    assert next_sequence(2**31 - 2, 3) == 1 and next_sequence(2**31 - 1, 1) == 0
    assert next_sequence(10, 5) == 15


def test_epoch_bump_then_new_ids_once_the_broker_fences_a_bump() -> None:
    ident = ProducerIdentity(True)
    assert not ident.bump_epoch()  # no id yet
    ident.set_identity(4, 7)
    a = batch(0, count=3)
    ident.assign(a)
    ident.request_reset()
    assert ident.bump_epoch() and ident.bumped
    assert (ident.producer_id, ident.producer_epoch, ident.can_drain) == (4, 8, True)
    b = batch(0, count=2)
    assert ident.assign(b) and (b.sequence, b.producer_epoch) == (0, 8)  # from 0 again
    assert ident.assign(a) and a.sequence == 2  # an old-epoch batch gets a new sequence
    fenced = decide(ec.PRODUCER_FENCED, b, ident, 5, 0)
    assert fenced.action is Action.RETRY and fenced.refuse_bump and fenced.reset_producer
    ident.refuse_bump()
    assert ident.reset_pending and not ident.bump_epoch()  # a new id, never a bump again
    ident.set_identity(5, 0)
    assert not ident.bumped and not ident.bump_epoch()
    # PRODUCER_FENCED without a bump of ours: fatal for the batch
    assert decide(ec.PRODUCER_FENCED, b, ident, 5, 0).action is Action.FAIL
    top = ProducerIdentity(True)
    top.set_identity(1, 2**15 - 1)
    assert not top.bump_epoch()  # the epoch is at its maximum: take a new id


# -- metadata --------------------------------------------------------------------------


def meta_response(**topics: tuple[int, int]) -> MetadataResponse:
    """``name=(error, partitions)``; every partition led by node 1."""
    return MetadataResponse(
        brokers=[MetadataResponseBroker(node_id=1, host="h", port=9092)],
        topics=[
            MetadataResponseTopic(
                error_code=err,
                name=name.replace("_", "-"),
                is_internal=False,
                partitions=[
                    MetadataResponsePartition(
                        error_code=0,
                        partition_index=i,
                        leader_id=1,
                        replica_nodes=[1],
                        isr_nodes=[1],
                    )
                    for i in range(n)
                ],
            )
            for name, (err, n) in topics.items()
        ],
    )


def new_metadata(s: SharedState) -> Metadata:
    return Metadata(
        s, max_age_ms=60_000, retry_backoff_ms=100, retry_backoff_max_ms=1000, max_block_ms=5000
    )


def test_metadata_publishes_topics_and_answers_waiters() -> None:
    s = shared()
    md = new_metadata(s)
    assert md.due(0)  # bootstrap: wanted at once
    assert md.topic_request(1, 11, "a-topic", now_ns=0) is None
    req = md.build_request()
    assert [t.name for t in req.topics or []] == ["a-topic"] and req.allow_auto_topic_creation
    answers = md.on_response(meta_response(a_topic=(0, 3), other=(0, 2)), now_ns=MS)
    assert [(a.owner, a.info.request_id, a.info.partitions, a.info.error) for a in answers] == [
        (1, 11, 3, 0)
    ]
    slot = answers[0].info.topic_slot
    off = s.geo.topic(slot)
    assert L.U32.unpack_from(s.view, off + L.T_STATE)[0] == L.TOPIC_READY
    assert L.U32.unpack_from(s.view, off + L.T_N_PARTITIONS)[0] == 3
    base = L.U32.unpack_from(s.view, off + L.T_PARTITION_BASE)[0]
    name_len = L.U16.unpack_from(s.view, off + L.T_NAME_LEN)[0]
    assert bytes(s.view[off + L.T_NAME : off + L.T_NAME + name_len]) == b"a-topic"
    assert (
        L.U64.unpack_from(s.view, L.H_METADATA_EPOCH)[0] == 2
    )  # even: no table write in progress (seqlock)
    assert md.locate(base + 2) == ("a-topic", 2) and md.leader(base + 2) == 1
    assert L.I32.unpack_from(s.view, s.geo.partition(base + 1) + L.P_LEADER)[0] == 1
    # a known topic is answered at once
    again = md.topic_request(2, 12, "a-topic", now_ns=2 * MS)
    assert again is not None and again.topic_slot == slot
    assert md.address(1) == ("h", 9092)


def test_metadata_growth_gets_a_new_range_and_a_push() -> None:
    s = shared()
    md = new_metadata(s)
    md.topic_request(1, 1, "t", 0)
    md.build_request()
    first = md.on_response(meta_response(t=(0, 2)), MS)[0].info
    old_base = md.locate(0)
    assert old_base == ("t", 0)
    md.build_request()
    answers = md.on_response(meta_response(t=(0, 5)), 2 * MS)
    assert [(a.owner, a.info.request_id, a.info.partitions) for a in answers] == [(None, 0, 5)]
    off = s.geo.topic(first.topic_slot)
    assert L.U32.unpack_from(s.view, off + L.T_PARTITION_BASE)[0] == 2
    assert md.locate(2 + 4) == ("t", 4)
    assert md.locate(1) == ("t", 1)  # the old range stays mapped
    assert L.U64.unpack_from(s.view, L.H_METADATA_EPOCH)[0] == 4
    # one home per topic-partition: the new range's first two slots are aliases
    assert [md.home(slot) for slot in range(2 + 5)] == [0, 1, 0, 1, 4, 5, 6]
    homes = [L.U32.unpack_from(s.view, s.geo.partition(2 + i) + L.P_HOME)[0] for i in range(5)]
    assert homes == [0, 1, 4, 5, 6]
    assert not any(md.gone(slot) for slot in range(7))


def test_metadata_shrink_marks_partitions_gone_and_growth_brings_them_back() -> None:
    """A topic created again with fewer partitions: the partitions past the new count
    are gone (their batches fail); it growing again, within its range or past it, brings
    them back under their old homes."""
    s = shared()
    md = new_metadata(s)
    md.topic_request(1, 1, "t", 0)
    md.build_request()
    slot = md.on_response(meta_response(t=(0, 4)), MS)[0].info.topic_slot
    off = s.geo.topic(slot)
    md.build_request()
    answers = md.on_response(meta_response(t=(0, 2)), 2 * MS)
    assert [(a.owner, a.info.request_id, a.info.partitions) for a in answers] == [(None, 0, 2)]
    assert L.U32.unpack_from(s.view, off + L.T_N_PARTITIONS)[0] == 2
    assert L.U32.unpack_from(s.view, off + L.T_PARTITION_BASE)[0] == 0  # same range
    assert [md.gone(i) for i in range(4)] == [False, False, True, True]
    assert L.U64.unpack_from(s.view, L.H_METADATA_EPOCH)[0] % 2 == 0
    md.build_request()
    md.on_response(meta_response(t=(0, 3)), 3 * MS)  # back within the range
    assert [md.gone(i) for i in range(4)] == [False, False, False, True]
    md.build_request()
    md.on_response(meta_response(t=(0, 6)), 4 * MS)  # past it: a new range, old homes kept
    assert L.U32.unpack_from(s.view, off + L.T_PARTITION_BASE)[0] == 4
    assert [md.home(4 + i) for i in range(6)] == [0, 1, 2, 3, 8, 9]
    assert not any(md.gone(i) for i in range(10))


def test_metadata_unknown_topics_retry_then_time_out() -> None:
    s = shared()
    md = new_metadata(s)
    md.topic_request(1, 5, "ghost", 0)
    md.build_request()
    assert md.on_response(meta_response(ghost=(ec.UNKNOWN_TOPIC_OR_PARTITION, 0)), MS) == []
    due = md.next_due_ns()
    assert due is not None and MS + 80 * MS <= due <= MS + 120 * MS  # backoff
    md.build_request()
    assert md.on_response(meta_response(ghost=(ec.LEADER_NOT_AVAILABLE, 0)), 200 * MS) == []
    assert md.expire_waiters(4999 * MS) == []
    late = md.expire_waiters(5000 * MS)
    assert [(a.info.request_id, a.info.error) for a in late] == [(5, MetadataTimeoutError.code)]
    assert not md.has_waiters


def test_metadata_non_retriable_errors_answer_at_once() -> None:
    md = new_metadata(shared())
    md.topic_request(1, 5, "bad!", 0)
    md.build_request()
    answers = md.on_response(meta_response(**{"bad!": (ec.INVALID_TOPIC_EXCEPTION, 0)}), MS)
    assert [(a.info.error, a.info.topic_slot) for a in answers] == [
        (ec.INVALID_TOPIC_EXCEPTION, -1)
    ]


def test_metadata_refresh_is_rate_limited_and_failures_back_off() -> None:
    md = new_metadata(shared())
    md.build_request()
    md.on_response(meta_response(), 10 * MS)
    assert not md.due(11 * MS)
    md.request_refresh(11 * MS)
    assert not md.due(109 * MS) and md.due(110 * MS)
    md.build_request()
    assert md.next_due_ns() is None  # in flight
    md.on_failure(120 * MS)
    due = md.next_due_ns()
    assert due is not None and 200 * MS <= due <= 240 * MS
    assert md.due(10 * MS + 60_000 * MS)  # max age


def test_metadata_table_full_answers_an_error() -> None:
    s = shared()
    md = new_metadata(s)
    md.topic_request(1, 1, "huge", 0)
    md.build_request()
    answers = md.on_response(meta_response(huge=(0, 17)), MS)  # 16 partition slots
    assert answers[0].info.error == -1000 and answers[0].info.topic_slot == -1
    assert NO_SEQUENCE == -1


# ---------------------------------------------------------------------------------------
# Lifecycle: every transition writes H_STATE
# ---------------------------------------------------------------------------------------


def _state(sh: SharedState) -> tuple[int, int]:
    return sh.state(), L.I32.unpack_from(sh.view, L.H_FATAL_CODE)[0]


def test_lifecycle_writes_every_transition() -> None:
    sh = shared()
    life = Lifecycle(sh)
    assert life.phase is Phase.BOOTSTRAP and not life.ended and life.exit_status is None
    life.to_running()
    assert life.phase is Phase.RUNNING and _state(sh) == (L.STATE_RUNNING, 0)
    life.to_closing()
    assert life.phase is Phase.CLOSING and _state(sh) == (L.STATE_CLOSING, 0)
    life.to_ended(L.STATE_CLOSED, ProducerClosedError.code, EXIT_OK)
    assert life.ended and life.exit_status == EXIT_OK
    assert _state(sh) == (L.STATE_CLOSED, 0)  # a clean close records no fatal code


def test_lifecycle_failure_records_its_code_and_refuses_going_back() -> None:
    sh = shared()
    life = Lifecycle(sh)
    life.to_ended(L.STATE_FAILED, MetadataTimeoutError.code, EXIT_CRASHED)
    assert _state(sh) == (L.STATE_FAILED, MetadataTimeoutError.code)
    with pytest.raises(AssertionError):
        life.to_running()
    with pytest.raises(AssertionError):
        life.to_ended(L.STATE_RUNNING, 0, EXIT_OK)


# ---------------------------------------------------------------------------------------
# ProducerIdDriver: when to ask InitProducerId, bump, or wait (a fake clock)
# ---------------------------------------------------------------------------------------


def _driver() -> ProducerIdDriver:
    return ProducerIdDriver(ProducerIdentity(True), retry_backoff_ms=100, retry_backoff_max_ms=800)


def _granted(pid: int = 7, epoch: int = 0) -> InitProducerIdResponse:
    return InitProducerIdResponse(producer_id=pid, producer_epoch=epoch)


def test_pid_driver_asks_once_metadata_is_known_and_backs_off_on_failures() -> None:
    d = _driver()
    never = lambda: pytest.fail("quiet() asked without a pending reset")  # noqa: E731
    assert d.step(0, never, bootstrapped=False) is PidStep.WAIT
    assert d.step(0, never, bootstrapped=True) is PidStep.REQUEST
    d.sent()
    assert d.step(0, never, bootstrapped=True) is PidStep.WAIT  # one request at a time
    d.on_lost(10 * MS)
    first = d.retry_at
    assert 10 * MS + 80 * MS <= first <= 10 * MS + 120 * MS
    assert d.next_due_ns(10 * MS) == first
    assert d.step(first - 1, never, bootstrapped=True) is PidStep.WAIT
    assert d.step(first, never, bootstrapped=True) is PidStep.REQUEST
    d.sent()
    assert not d.on_response(InitProducerIdResponse(error_code=ec.COORDINATOR_NOT_AVAILABLE), first)
    assert "COORDINATOR_NOT_AVAILABLE" in d.error and d.failures == 2
    assert d.retry_at - first >= 160 * MS  # grows
    d.refused("InitProducerId: no version in common", d.retry_at)
    assert d.failures == 3 and d.error.startswith("InitProducerId:")
    d.sent()
    assert d.on_response(_granted(), d.retry_at)
    assert d.failures == 0 and d.identity.has_id and d.resets_in_a_row == 0


def test_pid_driver_resets_only_when_quiet_bumping_first_then_a_new_id() -> None:
    d = _driver()
    d.sent()
    assert d.on_response(_granted(7, 0), 0)
    ident = d.identity
    assert d.step(0, lambda: True, bootstrapped=True) is PidStep.WAIT  # no reset pending
    ident.request_reset()
    assert d.step(0, lambda: False, bootstrapped=True) is PidStep.WAIT  # not quiet yet
    assert d.step(0, lambda: True, bootstrapped=True) is PidStep.BUMPED
    assert (ident.producer_id, ident.producer_epoch) == (7, 1) and d.resets_in_a_row == 1
    ident.refuse_bump()  # the broker fenced the bumped epoch: a new id from now on
    assert d.step(0, lambda: True, bootstrapped=True) is PidStep.WAIT  # a reset's backoff
    later = d.retry_at
    assert d.step(later, lambda: True, bootstrapped=True) is PidStep.REQUEST
    d.sent()
    assert d.on_response(_granted(9, 0), later)
    assert (ident.producer_id, ident.producer_epoch) == (9, 0) and d.resets_in_a_row == 2
    assert d.retry_at - later >= 160 * MS  # resets in a row back off more
    d.batch_acknowledged()
    assert d.resets_in_a_row == 0


def test_pid_driver_is_idle_without_idempotence() -> None:
    d = ProducerIdDriver(ProducerIdentity(False), 100, 800)
    assert d.step(0, lambda: True, bootstrapped=True) is PidStep.WAIT
    d.on_lost(0)
    assert d.next_due_ns(0) is None


# ---------------------------------------------------------------------------------------
# InFlightLedger: the one count of what is out, mirrored in shared memory
# ---------------------------------------------------------------------------------------


def test_in_flight_ledger_counts_requests_batches_and_partitions() -> None:
    sh = shared()
    ledger = InFlightLedger(sh)
    a, b, c = batch(slot=1), batch(slot=1), batch(slot=2)
    ledger.sent([a, b])
    ledger.sent([c])
    assert (ledger.requests, len(ledger)) == (2, 3)
    assert dict(ledger.per_partition) == {1: 2, 2: 1}
    assert set(ledger) == {a, b, c} and a in ledger
    assert (sh.get(L.S_REQUESTS_IN_FLIGHT), sh.get(L.S_BATCHES_IN_FLIGHT)) == (2, 3)
    assert (sh.get(L.S_REQUESTS_SENT), sh.get(L.S_BATCHES_REQUESTED)) == (2, 3)
    with pytest.raises(AssertionError):
        ledger.sent([a])  # a batch is in one request at a time
    ledger.done([a, b])
    assert dict(ledger.per_partition) == {2: 1} and a not in ledger
    ledger.done([c])
    assert (ledger.requests, len(ledger), dict(ledger.per_partition)) == (0, 0, {})
    assert (sh.get(L.S_REQUESTS_IN_FLIGHT), sh.get(L.S_BATCHES_IN_FLIGHT)) == (0, 0)
    assert (sh.get(L.S_REQUESTS_SENT), sh.get(L.S_BATCHES_REQUESTED)) == (2, 3)  # totals


# ---------------------------------------------------------------------------------------
# Completions alone: answers, retries, one report per batch
# ---------------------------------------------------------------------------------------


def _completions(retries: int = 3) -> tuple[Completions, list[ipc.Message], SharedState]:
    sh = shared()
    ident = ProducerIdentity(False)
    posted: list[ipc.Message] = []
    cfg = ProducerConfig(
        bootstrap_servers="127.0.0.1:9",
        retries=retries,
        retry_backoff_ms=10,
        enable_idempotence=False,
    )
    c = Completions(
        cfg,
        sh.view,
        sh.geo,
        sh,
        BufferPool(sh),
        Accumulator(sh),
        new_metadata(sh),
        ident,
        ProducerIdDriver(ident, 10, 100),
        InFlightLedger(sh),
        post_to=lambda origin, msg: posted.append(msg),
        send_grants=lambda results: None,
        connection_trouble=lambda: "refused; 2 connection failure(s) so far",
    )
    return c, posted, sh


def _piece(**kw: int) -> Batch:
    b = batch(**kw)
    b.data = bytearray(b.length)  # the sender's own memory: no pool buffer to free
    return b


def test_completions_retry_with_backoff_then_succeed_once() -> None:
    c, posted, sh = _completions()
    b = _piece(batch_id=7, count=3)
    c.on_answer(BatchAnswer(b, ec.NOT_ENOUGH_REPLICAS), 5 * MS)
    assert posted == [] and len(c.acc) == 1 and b.attempts == 1
    assert 5 * MS + 8 * MS <= b.retry_at_ns <= 5 * MS + 12 * MS
    assert stat(sh, L.S_RETRIES) == 1 and stat(sh, L.S_ERRORS) == 1
    c.on_answer(BatchAnswer(b, 0, base_offset=40), 20 * MS)
    assert posted == [ipc.Done(7, 0, 40, -1, False, "")]
    assert (stat(sh, L.S_BATCHES_SENT), stat(sh, L.S_RECORDS_SENT)) == (1, 3)
    c.report(b, DeliveryTimeoutError.code)  # already reported: nothing more
    assert len(posted) == 1


def test_completions_fail_when_retries_run_out_and_name_the_last_error() -> None:
    c, posted, _ = _completions(retries=0)
    b = _piece(batch_id=8)
    c.on_answer(BatchAnswer(b, ec.NOT_ENOUGH_REPLICAS, message="isr 1 < 2"), 0)
    (done,) = posted
    assert isinstance(done, ipc.Done) and done.error == ec.NOT_ENOUGH_REPLICAS
    assert done.retriable and "isr 1 < 2" in done.message
    never = _piece(batch_id=9)
    assert c.last_error(never) == " (last error: refused; 2 connection failure(s) so far)"
