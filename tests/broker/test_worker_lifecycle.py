"""Worker life cycle against the fake sender: attach errors, flush, close, sender death,
Fatal, fork/spawn/multiprocess children, a dying worker, stats, and the owner's calls."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import threading
import time

import multiprocess
import pytest

from shmprod.errors import (
    FlushTimeoutError,
    OwnerDiedError,
    ProducerClosedError,
    ProducerError,
    SenderDiedError,
    ShmprodError,
)
from shmprod.futures import RecordFuture
from shmprod.handle import Handle
from shmprod.worker import Worker, attach
from tests.support.fake_sender import FakeSender

# Python 3.12+ warns when forking a process that runs threads (the fake sender, the I/O
# thread); these tests fork on purpose, with children that only use what they attach.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"
)

HOLD = {"hold_done": True, "request_timeout_ms": 1000, "delivery_timeout_ms": 8000}


def test_attach_errors(fake: FakeSender) -> None:
    with pytest.raises(SenderDiedError, match="secret"):
        attach(dataclasses.replace(fake.handle, secret=b"\0" * 16))
    with pytest.raises(ProducerClosedError):
        attach(dataclasses.replace(fake.handle, socket_path=fake.path + ".gone"))
    with pytest.raises(ProducerClosedError, match="its shared memory was removed"):
        attach(dataclasses.replace(fake.handle, segment="shmprod-does-not-exist"))


def test_flush_waits_and_times_out() -> None:
    with FakeSender(linger_ms=5000, **HOLD) as fake, attach(fake.handle) as w:
        futs = [w.send("events", b"v%d" % i, partition=i % 4) for i in range(20)]
        t0 = time.monotonic()
        with pytest.raises(FlushTimeoutError):
            w.flush(0.2)
        assert 0.15 < time.monotonic() - t0 < 3
        assert fake.wait_for(lambda: len(fake.landed) == 4)  # flush handed every batch over
        fake.release_held()
        w.flush(5)
        assert all(f.done() and f.exception(0) is None for f in futs)


def test_close_says_bye_and_refuses_later_calls(fake: FakeSender) -> None:
    w = attach(fake.handle)
    fut = w.send("events", b"v")
    w.close()
    assert fut.result(0).offset == 0  # close flushed
    assert fake.wait_for(lambda: fake.byes == 1)
    with pytest.raises(ProducerClosedError):
        w.send("events", b"v")
    with pytest.raises(ProducerClosedError):
        w.send_batch("events", [b"v"])
    with pytest.raises(ProducerClosedError):
        w.stats()
    w.close()  # idempotent
    w.flush()  # nothing to do
    assert fake.deaths == 0


def test_sender_death_fails_pending_futures_at_once() -> None:
    with FakeSender(linger_ms=5000, **HOLD) as fake:
        w = attach(fake.handle)
        sealed = [w.send("events", b"x" * 300, partition=0) for _ in range(40)]  # some sealed
        open_ = w.send("events", b"open", partition=1)
        t0 = time.monotonic()
        fake.die()
        for f in [*sealed, open_]:
            assert isinstance(f.exception(2), SenderDiedError)
        assert time.monotonic() - t0 < 2
        with pytest.raises(SenderDiedError):
            w.send("events", b"later")
        w.flush(1)  # returns at once: nothing can complete any more
        assert w.stats()["worker"]["records_failed"] == 41
        w.close()


def test_fatal_fails_everything_with_its_code() -> None:
    with FakeSender(linger_ms=5000, **HOLD) as fake, attach(fake.handle) as w:
        futs = [w.send("events", b"v", partition=p) for p in range(4)]
        fake.fatal(OwnerDiedError.code, "owner gone")
        for f in futs:
            assert isinstance(f.exception(2), OwnerDiedError)
        with pytest.raises(OwnerDiedError):
            w.send("events", b"v")


def test_callbacks_may_send_but_not_flush() -> None:
    """A callback runs in the I/O thread: a send there that must wait for a buffer run or
    a new topic's metadata reads the control socket itself instead of deadlocking."""
    with FakeSender(topics={"events": 4, "other": 1}) as fake, attach(fake.handle) as w:
        results: list[object] = []
        done = threading.Event()

        def cb(f: RecordFuture) -> None:
            try:
                # a run of 9 buffers: more than the stock ever holds (a fair share is
                # 8 of 16), so it is asked for
                results.append(w.send("events", b"z" * 34_000, partition=1))
                results.append(w.send("other", b"new topic"))  # needs a TopicRequest
                w.flush(1)
            except ShmprodError as exc:
                results.append(exc)
            done.set()

        w.send("events", b"v", partition=0).add_done_callback(cb)
        w.flush(5)
        assert done.wait(5)
        big, other, refused = results
        assert isinstance(refused, ShmprodError) and "callback" in str(refused)
        assert isinstance(big, RecordFuture) and isinstance(other, RecordFuture)
        w.flush(5)
        assert big.result(0).offset == 0 and other.result(0).topic == "other"
        assert any(a.run == 9 for a in fake.allocs)


def test_worker_is_not_picklable(fake: FakeSender) -> None:
    with attach(fake.handle) as w, pytest.raises(TypeError, match="attach"):
        pickle.dumps(w)
    assert pickle.loads(pickle.dumps(fake.handle)) == fake.handle


def test_stats(fake: FakeSender) -> None:
    with attach(fake.handle) as w:
        for _ in range(10):
            w.send("events", b"v", partition=2)
        w.flush(5)
        st = w.stats()
        assert st["worker"]["records_appended"] == 10 and st["worker"]["records_acked"] == 10
        assert st["worker"]["batches_sealed"] == 1 and st["worker"]["slot"] == w.worker_slot
        assert st["pool"]["buffers_total"] == fake.geo.n_buffers
        assert st["topics"]["events"]["queue_depth"] == [0, 0, 0, 0]
        assert {"batches_sent", "buffers_free", "state"} <= set(st["sender"])


def test_owner_ready_and_shutdown(fake: FakeSender) -> None:
    owner = attach(fake.handle, owner=True)
    owner.wait_ready(5)
    fut = owner.send("events", b"last words")
    assert owner.shutdown_producer(1000)
    assert fut.result(2).offset == 0  # sealed and answered before the sender closed
    with pytest.raises(ProducerClosedError):
        owner.send("events", b"v")
    owner.close()
    with attach(fake.handle) as w, pytest.raises(ProducerError):
        w.shutdown_producer(10)  # only the owner may


# --- other processes -------------------------------------------------------------------

_INHERITED: Worker | None = None


def _fork_child(handle: Handle, out: multiprocessing.queues.Queue[object]) -> None:
    assert _INHERITED is not None
    try:
        _INHERITED.send("events", b"from the child")
        out.put("no error")
    except ShmprodError as exc:
        out.put(str(exc))
    w = attach(handle)
    fut = w.send("events", b"child %d" % os.getpid(), partition=3)
    w.flush(5)
    out.put(fut.result(0).offset)
    w.close()


def _spawn_child(handle: Handle, n: int) -> None:
    with attach(handle) as w:
        md = w.send_batch("events", [b"spawned %d" % i for i in range(n)], partitions=2)
        md.result(10)


def test_fork_child_must_attach_again(fake: FakeSender) -> None:
    global _INHERITED
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.queues.Queue[object] = ctx.Queue()
    with attach(fake.handle) as w:
        _INHERITED = w
        try:
            w.send("events", b"parent", partition=3).result(5)
            p = ctx.Process(target=_fork_child, args=(fake.handle, q))
            p.start()
            p.join(20)
            assert p.exitcode == 0
            msg = q.get(timeout=5)
            assert isinstance(msg, str) and "attach(handle)" in msg
            assert q.get(timeout=5) == 1
            # the parent's Worker is unaffected by the child
            assert w.send("events", b"parent again", partition=3).result(5).offset == 2
        finally:
            _INHERITED = None
    assert fake.wait_for(lambda: fake.byes == 2)


def test_spawn_child_attaches_by_handle(fake: FakeSender) -> None:
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_spawn_child, args=(fake.handle, 50))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert [r.value for r in fake.records("events")[2]] == [b"spawned %d" % i for i in range(50)]


def _pool_task(args: tuple[Handle, int]) -> int:
    handle, i = args
    with attach(handle) as w:
        return int(w.send("events", b"task %d" % i, key=b"%d" % i).result(10).offset >= 0)


def test_multiprocess_pool(fake: FakeSender) -> None:
    with multiprocess.get_context("fork").Pool(2) as pool:
        assert sum(pool.map(_pool_task, [(fake.handle, i) for i in range(6)], chunksize=1)) == 6
    assert sum(len(v) for v in fake.records("events").values()) == 6


def _return_without_close(handle: Handle) -> None:
    w = attach(handle)
    w.send("events", b"left in an open batch", partition=0)


def test_normal_exit_flushes_open_batches() -> None:
    with FakeSender(linger_ms=5000, delivery_timeout_ms=200_000) as fake:
        for method in ("fork", "spawn"):
            p = multiprocessing.get_context(method).Process(
                target=_return_without_close, args=(fake.handle,)
            )
            p.start()
            p.join(60)
            assert p.exitcode == 0
        assert [r.value for r in fake.records("events")[0]] == [b"left in an open batch"] * 2
        assert fake.wait_for(lambda: fake.byes == 2) and fake.deaths == 0


def _die_with_open_batch(handle: Handle) -> None:
    w = attach(handle)
    w.send("events", b"never sealed", partition=0)  # staged; its lease is granted
    w.stats()  # a round trip to shared memory only; the lease was asked for at attach
    os._exit(0)  # no close, no Bye


def test_dying_worker_leaves_buffers_to_reclaim() -> None:
    with FakeSender(linger_ms=60_000, delivery_timeout_ms=200_000) as fake:
        p = multiprocessing.get_context("fork").Process(
            target=_die_with_open_batch, args=(fake.handle,)
        )
        p.start()
        p.join(20)
        assert p.exitcode == 0
        assert fake.wait_for(lambda: fake.deaths == 1 and fake.reclaimed >= 1)
        assert not fake.landed


def test_a_dropped_worker_is_freed_when_it_is_garbage() -> None:
    """A Worker dropped without close() must not keep its thread, sockets, mapping and
    worker slot for good: 300 attach-and-drop rounds (more than max_workers) all work,
    and the sender sees each leave. One that still has records to deliver lives until
    they are delivered (its I/O thread holds it while it is busy), then goes too."""
    import gc

    with FakeSender(linger_ms=200) as fake:
        threads_before = threading.active_count()
        pending = None
        for i in range(300):
            w = attach(fake.handle)
            if i == 0:
                pending = w.send("events", b"staged, then dropped", partition=0)
            del w
            gc.collect()
        assert pending is not None and pending.result(5).offset == 0
        gc.collect()
        assert fake.wait_for(lambda: fake.byes == 300 and not fake.conns, 10), (fake.byes,)
        deadline = time.monotonic() + 5
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() <= threads_before
