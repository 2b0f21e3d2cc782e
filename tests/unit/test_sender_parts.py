"""The sender's selector, endings and metadata/producer-id driver on their own: the
poller's write interest, and each ending on the scripted broker with the in-process
sender (tests/support/scripted_broker.py): the owner's shutdown after the queue drained, the
acks=0 fence, the owner lost, and a crash that still tells every worker."""

from __future__ import annotations

import selectors
import socket
from collections.abc import Iterator

import pytest

from shmprod import ipc
from shmprod import layout as L
from shmprod.errors import OwnerDiedError, ProducerClosedError, ProducerError
from shmprod.protocol.messages import MetadataRequest
from shmprod.sender import lifecycle
from shmprod.sender.poller import Poller
from tests.support.scripted_broker import SILENCE, DrivenWorker, ScriptedBroker, SenderRig
from tests.support.sender_peers import values


def test_poller_asks_for_writes_only_while_bytes_wait() -> None:
    a, b = socket.socketpair()
    poller = Poller()
    try:
        poller.watch(a, "peer", write=False)
        assert poller.selector.get_key(a).events == selectors.EVENT_READ
        poller.sync([(a, "peer", True)])
        key = poller.selector.get_key(a)
        assert key.events == selectors.EVENT_READ | selectors.EVENT_WRITE
        assert key.data == "peer"
        assert [k.data for k, _ in poller.select(0)] == ["peer"]  # writable at once
        poller.watch(a, "peer", write=False)
        assert poller.select(0) == []
        b.send(b"x")
        assert [(k.data, m) for k, m in poller.select(1)] == [("peer", selectors.EVENT_READ)]
        poller.forget(a)
        with pytest.raises(KeyError):
            poller.selector.get_key(a)
        poller.forget(a)  # twice: nothing to do
        poller.forget(None)
    finally:
        poller.close()
        a.close()
        b.close()


@pytest.fixture
def broker() -> Iterator[ScriptedBroker]:
    b = ScriptedBroker(nodes=2, topics={"t": 2})
    try:
        yield b
    finally:
        b.close()


def _ready(broker: ScriptedBroker, **options: object) -> SenderRig:
    r = SenderRig(broker, **options)
    ready = r.worker.expect(ipc.Ready)
    assert ready.error == 0, ready
    assert r.sender.driver.ready
    return r


def _unanswered(r: SenderRig) -> tuple[DrivenWorker, int]:
    """The rig's worker and a batch the broker took but never answers."""
    w = r.worker
    base, _ = w.topic("t")
    r.broker.script("t", 0, SILENCE)
    bid = w.produce(base, values("u", 1))
    w.nothing(ipc.Done, within_ms=50)
    return w, bid


def test_shutdown_sends_what_is_queued_then_closes(broker: ScriptedBroker) -> None:
    """Shutdown while a batch waits for its answer: no more grants, the batch is still
    delivered, then STATE_CLOSED, Fatal(ProducerClosedError) and exit status 0."""
    r = _ready(broker)
    try:
        w = r.worker
        base, _ = w.topic("t")
        bid = w.produce(base, values("q", 2))
        w.send(ipc.Shutdown(5_000))
        refused = w.alloc()  # read with the Shutdown, before the answer
        assert refused.error == ProducerClosedError.code, refused
        assert w.done(bid).error == 0
        fatal = w.expect(ipc.Fatal)
        assert fatal.error == ProducerClosedError.code
        r.turn()
        assert r.status == lifecycle.EXIT_OK
        assert L.U32.unpack_from(r.view, L.H_STATE)[0] == L.STATE_CLOSED
        assert broker.values("t", 0) == values("q", 2)
    finally:
        r.close()


def test_shutdown_deadline_fails_what_was_never_answered(broker: ScriptedBroker) -> None:
    r = _ready(broker, request_timeout_ms=60_000, delivery_timeout_ms=120_000)
    try:
        w = r.worker
        base, _ = w.topic("t")
        broker.script("t", 0, SILENCE)
        bid = w.produce(base, values("s", 1))
        w.nothing(ipc.Done, within_ms=100)
        w.send(ipc.Shutdown(1_000))
        done = w.done(bid)
        assert done.error == ProducerClosedError.code, done
        assert "closed before this batch was delivered" in done.message
        r.turn()
        assert r.status == lifecycle.EXIT_OK
    finally:
        r.close()


def test_acks_0_shutdown_fences_every_connection_first(broker: ScriptedBroker) -> None:
    """acks=0: before closing, one Metadata request per connection, so the broker read
    every produce request written before it."""
    r = _ready(broker, acks=0, enable_idempotence=False)
    try:
        w = r.worker
        base, _ = w.topic("t")
        assert w.done(w.produce(base, values("z", 1))).error == 0  # done once written
        fences_before = len(broker.seen(MetadataRequest))
        w.send(ipc.Shutdown(5_000))
        w.expect(ipc.Fatal)
        r.turn()
        assert r.status == lifecycle.EXIT_OK
        assert len(broker.seen(MetadataRequest)) > fences_before
        assert broker.values("t", 0) == values("z", 1)
    finally:
        r.close()


def test_the_owner_lost_fails_everything_and_exits_with_its_status(
    broker: ScriptedBroker,
) -> None:
    r = _ready(broker)
    try:
        w, bid = _unanswered(r)
        r.sender.endings.owner_lost(r.now)
        done = w.done(bid)
        assert done.error == OwnerDiedError.code, done
        assert w.expect(ipc.Fatal).error == OwnerDiedError.code
        r.turn()
        assert r.status == lifecycle.EXIT_OWNER_DIED
        assert L.U32.unpack_from(r.view, L.H_STATE)[0] == L.STATE_FAILED
    finally:
        r.close()


def test_a_crash_still_tells_every_worker(broker: ScriptedBroker) -> None:
    """An unexpected error in the loop: the batch fails, every worker gets Fatal, H_STATE
    says FAILED and the exit status is 1."""
    r = _ready(broker)
    try:
        w, bid = _unanswered(r)
        r.sender.endings.crash(RuntimeError("boom"))
        done = w.done(bid)
        assert done.error == ProducerError.code and "boom" in done.message, done
        fatal = w.expect(ipc.Fatal)
        assert fatal.error == ProducerError.code and "RuntimeError: boom" in fatal.message
        assert r.sender.life.exit_status == lifecycle.EXIT_CRASHED
        assert L.U32.unpack_from(r.view, L.H_STATE)[0] == L.STATE_FAILED
    finally:
        r.close()


def test_the_driver_schedules_the_next_metadata_refresh(broker: ScriptedBroker) -> None:
    r = _ready(broker, metadata_max_age_ms=1_000)
    try:
        refreshes = r.stat(L.S_METADATA_REFRESHES)
        due = r.sender.driver.next_due_ns(r.now)
        assert due is not None and due > r.now
        r.worker.nothing(ipc.Fatal, within_ms=1_500)
        assert r.stat(L.S_METADATA_REFRESHES) > refreshes
    finally:
        r.close()
