"""The sender process end to end: a real tansu broker, a real sender subprocess, and a
small fake worker (and owner) in the test speaking shmprod.ipc over the socket and
writing batches into granted buffers with protocol.records.encode_batch_into."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from shmprod import ipc
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.config import ProducerConfig
from shmprod.connection import BrokerConnection
from shmprod.errors import (
    CorruptBatchError,
    MetadataTimeoutError,
    OwnerDiedError,
    ProducerClosedError,
    RecordTooLargeError,
)
from shmprod.handle import SenderSpec
from shmprod.protocol.records import decode_batches
from shmprod.sender import lifecycle
from shmprod.shm import Segment
from tests.support.kafka_proxy import KafkaProxy
from tests.support.readback import consume_all
from tests.support.sender_peers import WAIT, Endpoint, FakeWorker, Owner, running, shutdown, values

pytestmark = pytest.mark.broker


def test_delivers_batches_with_base_offsets(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        base, n = w.topic(topic_name)
        assert n == 1
        first = w.done(w.produce(base, values("a", 10)))
        assert (first.error, first.base_offset) == (0, 0), first
        second = w.done(w.produce(base, values("b", 5)))
        assert (second.error, second.base_offset) == (0, 10), second
        assert owner.stat(L.S_BATCHES_SENT) == 2
        assert owner.stat(L.S_RECORDS_SENT) == 15
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 15, timeout_s=20)
    assert [r.value for r in got[0]] == values("a", 10) + values("b", 5)
    assert [r.offset for r in got[0]] == list(range(15))


@pytest.mark.parametrize("lanes", [1, 2])
def test_several_partitions_share_one_request_per_connection(
    broker: EmbeddedBroker, topic_name: str, lanes: int
) -> None:
    """One request a connection carries every ready partition of it: with one connection
    per broker one request, with two one per connection (partition slot p on p % 2)."""
    broker.create_topic(topic_name, 4)
    with running(broker, connections_per_broker=lanes) as (owner, w):
        base, n = w.topic(topic_name)
        assert n == 4
        grant = w.alloc(count=4)
        assert grant.error == 0 and len(grant.buffers) == 4
        msgs = []
        ids = []
        for p, buf in enumerate(grant.buffers):
            length = w.write(buf, values(f"p{p}", 3 + p))
            bid, msg = w.sealed(buf, base + p, length, 3 + p)
            ids.append(bid)
            msgs.append(msg)
        before = owner.stat(L.S_REQUESTS_SENT)
        w.send(*msgs)  # one write: the sender reads all four before it drains
        dones = [w.done(bid) for bid in ids]
        assert all(d.error == 0 and d.base_offset == 0 for d in dones), dones
        assert owner.stat(L.S_REQUESTS_SENT) - before == lanes
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 4, 3 + 4 + 5 + 6, timeout_s=20)
    for p in range(4):
        assert [r.value for r in got[p]] == values(f"p{p}", 3 + p)


def test_idempotent_sequences_in_order(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        base, _ = w.topic(topic_name)
        grant = w.alloc(count=6)
        msgs = []
        for i, buf in enumerate(grant.buffers):
            length = w.write(buf, values(f"s{i}", 4))
            msgs.append(w.sealed(buf, base, length, 4))
        w.send(*(m for _, m in msgs))
        dones = [w.done(bid) for bid, _ in msgs]
        assert [d.base_offset for d in dones] == [0, 4, 8, 12, 16, 20], dones
        shutdown(owner, w)
    with BrokerConnection("127.0.0.1", broker.port) as conn:
        resp = conn.fetch({(topic_name, 0): 0})
    data = resp.responses[0].partitions[0].records
    assert data is not None
    batches = decode_batches(data, allow_truncated_tail=True)
    assert [b.base_sequence for b in batches] == [0, 4, 8, 12, 16, 20]
    assert len({(b.producer_id, b.producer_epoch) for b in batches}) == 1
    assert batches[0].producer_id >= 0
    assert [r.value for b in batches for r in b.records] == [
        v for i in range(6) for v in values(f"s{i}", 4)
    ]


def test_corrupt_batch_fails_alone(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        base, _ = w.topic(topic_name)
        grant = w.alloc(count=2)
        bad, good = grant.buffers
        bad_len = w.write(bad, values("bad", 3))
        w.view[w.geo.buffer(bad) + bad_len - 1] ^= 0xFF  # breaks the CRC
        good_len = w.write(good, values("good", 3))
        bad_id, bad_msg = w.sealed(bad, base, bad_len, 3)
        good_id, good_msg = w.sealed(good, base, good_len, 3)
        # a buffer this worker was never granted, and a count that disagrees
        stray_id, stray = w.sealed(owner.geo.n_buffers - 1, base, good_len, 3)
        w.send(bad_msg, good_msg, stray)
        assert w.done(bad_id).error == CorruptBatchError.code
        assert w.done(stray_id).error == CorruptBatchError.code
        d = w.done(good_id)
        assert (d.error, d.base_offset) == (0, 0)
        assert owner.stat(L.S_BATCHES_FAILED) == 2
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers
        g = w.alloc()
        n_id, n_msg = w.sealed(g.buffers[0], base, w.write(g.buffers[0], values("n", 2)), 3)
        w.send(n_msg)
        assert w.done(n_id).error == CorruptBatchError.code
        shutdown(owner, w)


def test_grants_wait_in_fifo_and_large_runs(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        n = owner.geo.n_buffers
        assert w.alloc(run=n + 1).error == RecordTooLargeError.code
        everything = w.alloc(run=1, count=n)
        assert everything.error == 0 and sorted(everything.buffers) == list(range(n))
        w.send(ipc.Alloc(900, 3, 1), ipc.Alloc(901, 1, 1))  # both must wait
        w.nothing(ipc.Grant, within=0.3)
        assert owner.stat(L.S_ALLOC_WAITERS) == 2
        w.send(ipc.Release(1, (0, 1)))  # two free buffers: not a run of 3, and FIFO
        w.nothing(ipc.Grant, within=0.3)
        w.send(ipc.Release(1, (2,)))
        run3 = w.expect(ipc.Grant, lambda m: m.request_id == 900)
        assert run3.buffers == (0,) and run3.run == 3
        w.send(ipc.Release(1, (5,)))
        single = w.expect(ipc.Grant, lambda m: m.request_id == 901)
        assert single.buffers == (5,)
        # a batch larger than one buffer goes out of the run
        big = b"x" * (2 * owner.geo.buffer_size + 100)
        length = w.write(0, [big])
        assert length > 2 * owner.geo.buffer_size
        base, _ = w.topic(topic_name)
        bid, msg = w.sealed(0, base, length, 1, run=3)
        w.send(msg)
        assert w.done(bid).error == 0
        assert owner.stat(L.S_BUFFERS_FREE) == 3  # the run came back (0, 1, 2)
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 1, timeout_s=20)
    assert got[0][0].value == big


def test_dead_worker_buffers_are_reclaimed(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        base, _ = w.topic(topic_name)
        other = FakeWorker(owner)
        slot = other.slot
        g = other.alloc(count=3)
        assert g.error == 0
        # it seals one batch (delivered even though it dies), the rest is dropped
        b0 = g.buffers[0]
        _, msg = other.sealed(b0, base, other.write(b0, values("x", 2)), 2)
        other.send(msg)
        other.write(g.buffers[1], values("partial", 2))
        other.sock.shutdown(socket.SHUT_RDWR)  # dies: no Bye
        other.close()
        deadline = time.monotonic() + WAIT
        while owner.stat(L.S_WORKERS_DIED) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert owner.stat(L.S_WORKERS_DIED) == 1
        assert owner.stat(L.S_BUFFERS_RECLAIMED) == 2
        state = L.U32.unpack_from(owner.view, owner.geo.worker(slot) + L.W_STATE)[0]
        assert state == L.WORKER_DEAD
        while owner.stat(L.S_BUFFERS_FREE) < owner.geo.n_buffers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers
        # the slot is reused
        again = FakeWorker(owner)
        assert again.slot == slot
        again.send(ipc.Bye())
        again.close()
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 2, timeout_s=20)
    assert [r.value for r in got[0]] == values("x", 2)


def test_owner_death_removes_the_segment(broker: EmbeddedBroker, topic_name: str) -> None:
    owner = Owner(broker.bootstrap)
    try:
        boss = FakeWorker(owner, as_owner=True)
        assert boss.expect(ipc.Ready).error == 0
        other = FakeWorker(owner)
        stranger = FakeWorker(owner, secret=b"\0" * ipc.SECRET_SIZE)
        assert not stranger._pump(time.monotonic() + WAIT) and stranger.eof  # closed at once
        stranger.close()
        boss.close()  # the owner's connection ends without Shutdown
        fatal = other.expect(ipc.Fatal)
        assert fatal.error == OwnerDiedError.code
        assert owner.wait_exit() == lifecycle.EXIT_OWNER_DIED
        assert not os.path.exists(f"/dev/shm/{owner.segment.name}")
        assert not os.path.exists(owner.dir)
        other.close()
    finally:
        owner.close()


def test_shutdown_flushes_queued_batches(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 2)
    with running(broker) as (owner, w):
        base, _ = w.topic(topic_name)
        grant = w.alloc(count=10)
        msgs = []
        for i, buf in enumerate(grant.buffers):
            length = w.write(buf, values(f"f{i}", 2))
            msgs.append(w.sealed(buf, base + i % 2, length, 2))
        w.send(*(m for _, m in msgs), ipc.Shutdown(10_000), ipc.Alloc(77, 1, 1))
        assert all(w.done(bid).error == 0 for bid, _ in msgs)
        refused = w.expect(ipc.Grant, lambda m: m.request_id == 77)
        assert refused.error == ProducerClosedError.code
        assert w.expect(ipc.Fatal).error == ProducerClosedError.code
        assert owner.wait_exit() == lifecycle.EXIT_OK
        state = L.U32.unpack_from(owner.view, L.H_STATE)[0]
        assert state == L.STATE_CLOSED
    got = consume_all(broker.bootstrap, topic_name, 2, 20, timeout_s=20)
    assert sum(len(v) for v in got.values()) == 20


def test_acks_zero_completes_when_written(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker, acks=0, enable_idempotence=False) as (owner, w):
        base, _ = w.topic(topic_name)
        d = w.done(w.produce(base, values("z", 4)))
        assert (d.error, d.base_offset) == (0, -1)
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 4, timeout_s=20)
    assert [r.value for r in got[0]] == values("z", 4)


def test_unknown_topic_is_created_and_bad_names_refused(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    with running(broker) as (owner, w):
        base, n = w.topic(topic_name)  # auto-created by the Metadata request
        assert n >= 1
        d = w.done(w.produce(base + n - 1, values("auto", 1)))
        assert d.error == 0
        w.send(ipc.TopicRequest(555, "bad topic!"))
        info = w.expect(ipc.TopicInfo, lambda m: m.request_id == 555)
        assert info.error == 17 and info.topic_slot == -1  # INVALID_TOPIC_EXCEPTION
        shutdown(owner, w)


def test_bootstrap_failure_reports_ready_error() -> None:
    from shmprod.broker import free_port

    owner = Owner(f"127.0.0.1:{free_port()}", max_block_ms=1000)
    try:
        boss = FakeWorker(owner, as_owner=True)
        ready = boss.expect(ipc.Ready)
        assert ready.error == MetadataTimeoutError.code and "max_block_ms" in ready.message
        assert owner.wait_exit() == lifecycle.EXIT_BOOTSTRAP_FAILED
        boss.close()
    finally:
        owner.close()


def test_unexpected_error_sends_fatal_and_exits_nonzero(
    broker: EmbeddedBroker, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process sender: a bug in the loop must fail every worker, never hang them."""
    import threading

    from shmprod.sender.loop import Sender

    broker.create_topic(topic_name, 1)
    geo = L.Geometry.for_pool(64 * 1024, 1024)
    cfg = ProducerConfig(
        bootstrap_servers=broker.bootstrap, buffer_memory=64 * 1024, batch_size=1024
    )
    segment = Segment.create(geo.segment_size)
    tmp = tempfile.mkdtemp(prefix="shmprod-test-")
    try:
        L.write_header(segment.view, geo, os.getpid(), 0)
        path = os.path.join(tmp, "ctl.sock")
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listen.bind(path)
        listen.listen(8)
        secret = secrets.token_bytes(ipc.SECRET_SIZE)
        spec = SenderSpec(
            segment.name, path, secret.hex(), os.getpid(), 0, listen.fileno(), cfg.to_wire()
        )
        sender = Sender(spec, segment.view, listen, owner_alive=lambda: True)

        def boom(now: int) -> None:
            if len(sender.acc):
                raise RuntimeError("boom")

        monkeypatch.setattr(sender, "_drain", boom)
        status: list[int] = []
        thread = threading.Thread(target=lambda: status.append(sender.run()), daemon=True)
        thread.start()
        endpoint = Endpoint(geo, segment.view, path, secret)
        w = FakeWorker(endpoint, as_owner=True)
        other = FakeWorker(endpoint)
        assert w.expect(ipc.Ready).error == 0
        base, _ = w.topic(topic_name)
        w.produce(base, values("x", 1))
        for worker in (w, other):
            fatal = worker.expect(ipc.Fatal)
            assert fatal.error == -1000 and "RuntimeError: boom" in fatal.message
        thread.join(WAIT)
        assert status == [lifecycle.EXIT_CRASHED]
        assert L.U32.unpack_from(segment.view, L.H_STATE)[0] == L.STATE_FAILED
        w.close()
        other.close()
    finally:
        segment.close()
        segment.unlink()
        shutil.rmtree(tmp, ignore_errors=True)


_INTERMEDIATE = """
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
spec["owner_pid"] = os.getpid()
proc = subprocess.Popen([sys.executable, "-m", "shmprod.sender"],
                        pass_fds=[spec["listen_fd"]], stdin=subprocess.PIPE)
proc.stdin.write(json.dumps(spec).encode())
proc.stdin.close()
print(os.getpid(), proc.pid, flush=True)
sys.stdin.readline()
"""


def test_owner_death_is_noticed_with_its_connection_still_open(broker: EmbeddedBroker) -> None:
    """The owner's socket may outlive it (a forked child inherited it): the sender
    watches its parent too."""
    import json

    geo = L.Geometry.for_pool(64 * 1024, 1024)
    cfg = ProducerConfig(
        bootstrap_servers=broker.bootstrap, buffer_memory=64 * 1024, batch_size=1024
    )
    segment = Segment.create(geo.segment_size)
    tmp = tempfile.mkdtemp(prefix="shmprod-test-")
    mid: subprocess.Popen[str] | None = None
    try:
        L.write_header(segment.view, geo, os.getpid(), 0)
        path = os.path.join(tmp, "ctl.sock")
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listen.bind(path)
        listen.listen(8)
        secret = secrets.token_bytes(ipc.SECRET_SIZE)
        spec = SenderSpec(segment.name, path, secret.hex(), 0, 0, listen.fileno(), cfg.to_wire())
        mid = subprocess.Popen(
            [sys.executable, "-c", _INTERMEDIATE, json.dumps(spec.__dict__)],
            pass_fds=[listen.fileno()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        listen.close()
        assert mid.stdout is not None and mid.stdin is not None
        owner_pid, sender_pid = map(int, mid.stdout.readline().split())
        w = FakeWorker(Endpoint(geo, segment.view, path, secret), as_owner=True, pid=owner_pid)
        assert w.expect(ipc.Ready).error == 0
        mid.stdin.close()  # the owner exits; our connection stays open
        assert mid.wait(WAIT) == 0
        assert w.expect(ipc.Fatal).error == OwnerDiedError.code
        deadline = time.monotonic() + WAIT
        while os.path.exists(f"/dev/shm/{segment.name}") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(f"/dev/shm/{segment.name}")
        assert not os.path.exists(path)
        while _alive(sender_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(sender_pid)
        w.close()
    finally:
        if mid is not None:
            if mid.poll() is None:
                mid.kill()
                mid.wait(10)
            for pipe in (mid.stdin, mid.stdout):
                if pipe is not None:
                    pipe.close()
        segment.close()
        segment.unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def test_a_misbehaving_worker_is_contained(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with running(broker) as (owner, w):
        base, _ = w.topic(topic_name)
        bad = FakeWorker(owner)
        assert bad.alloc(run=0).error == RecordTooLargeError.code
        g = bad.alloc()
        length = bad.write(g.buffers[0], values("v", 1))
        bid, msg = bad.sealed(g.buffers[0], 10_000, length, 1)  # a slot of no topic
        # claims of a buffer outside the pool and of one it never took: refused, logged
        bad.send(msg, ipc.Release(1, (10**6,)), ipc.Claimed((10**6, 0)), ipc.TopicRequest(9, ""))
        assert bad.done(bid).error == CorruptBatchError.code
        assert bad.expect(ipc.TopicInfo, lambda m: m.request_id == 9).error == -1009
        bad.send(ipc.Shutdown(0))  # only the owner may: ignored
        bad.sock.sendall(b"\xff\xff\xff\xff garbage")  # not a control message: dropped
        assert not bad._pump(time.monotonic() + WAIT) and bad.eof
        bad.close()
        d = w.done(w.produce(base, values("still", 2)))  # everyone else carries on
        assert d.error == 0
        assert owner.stat(L.S_BUFFERS_FREE) == owner.geo.n_buffers
        shutdown(owner, w)


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "plain"])
def test_growth_keeps_one_queue_per_partition(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str, idempotent: bool
) -> None:
    """A topic grows: its partitions get slots in a new range, but each topic-partition
    keeps one queue, one sequence space and one place in a request, whichever slot a
    batch was sealed under. Batches of partition 0 handed over together under the old and
    the new slot are sent in order, each written once at its own offset."""
    broker.create_topic(topic_name, 4)
    proxy.show_partitions(topic_name, 2)
    with running(proxy, metadata_max_age_ms=100, enable_idempotence=idempotent) as (owner, w):
        old, n = w.topic(topic_name)
        assert n == 2
        assert w.done(w.produce(old, values("a", 3))).base_offset == 0
        proxy.show_partitions(topic_name, None)
        push = w.expect(ipc.TopicInfo, lambda m: m.request_id == 0 and m.partitions == 4)
        new = L.U32.unpack_from(owner.view, owner.geo.topic(push.topic_slot) + L.T_PARTITION_BASE)
        assert new[0] != old
        grant = w.alloc(count=3)
        ids, msgs = [], []
        for buf, slot, prefix in zip(grant.buffers, (new[0], old, new[0]), "bcd", strict=True):
            bid, msg = w.sealed(buf, slot, w.write(buf, values(prefix, 2)), 2)
            ids.append(bid)
            msgs.append(msg)
        w.send(*msgs)  # one write: the sender has all three before it drains
        dones = [w.done(bid) for bid in ids]
        assert [(d.error, d.base_offset) for d in dones] == [(0, 3), (0, 5), (0, 7)], dones
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 4, 9, timeout_s=20)
    expected = values("a", 3) + values("b", 2) + values("c", 2) + values("d", 2)
    assert [r.value for r in got[0]] == expected
    assert [r.offset for r in got[0]] == list(range(9))


def test_duplicate_sequence_for_a_first_send_fails_loudly(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    """DUPLICATE_SEQUENCE_NUMBER means "written before" only for a batch that WAS sent
    before with its sequence. For a first send the broker holds another batch under that
    sequence: calling it success would lose this one without a trace."""
    from shmprod.protocol import error_codes as ec
    from tests.support.kafka_proxy import PRODUCE

    broker.create_topic(topic_name, 1)
    with running(proxy) as (owner, w):
        base, _ = w.topic(topic_name)
        proxy.fail_next(PRODUCE, ec.DUPLICATE_SEQUENCE_NUMBER)
        d = w.done(w.produce(base, values("lost?", 3)))
        assert d.error == ec.DUPLICATE_SEQUENCE_NUMBER and "never sent" in d.message, d
        after = w.done(w.produce(base, values("next", 2)))  # the producer goes on
        assert (after.error, after.base_offset) == (0, 0), after
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 2, timeout_s=20)
    assert [r.value for r in got[0]] == values("next", 2)


def test_acks_0_close_waits_until_the_broker_read_everything(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    """With acks=0 a batch is complete once written, but a connection closed before the
    broker read its requests loses them. At close the sender waits for the answer to
    one Metadata request per connection (answers come in order), bounded by the close
    timeout. Here every node holds its bytes for 0.5 s when the owner closes."""
    broker.create_topic(topic_name, 1)
    with running(proxy, acks=0, enable_idempotence=False) as (owner, w):
        base, _ = w.topic(topic_name)
        for node in range(proxy.nodes):
            proxy.stall(node, 0.5)
        ids = [w.produce(base, values(f"z{i}", 5)) for i in range(4)]
        assert all(w.done(bid).error == 0 for bid in ids)  # written, not yet read
        shutdown(owner, w)
    got = consume_all(broker.bootstrap, topic_name, 1, 20, timeout_s=20)
    assert sorted(r.value for r in got[0]) == sorted(
        v for i in range(4) for v in values(f"z{i}", 5)
    )
