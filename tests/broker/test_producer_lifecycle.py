"""Start, close, death of the owner, back-pressure, bad input and stats of the producer."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from shmprod import Producer, attach
from shmprod.broker import EmbeddedBroker
from shmprod.config import ProducerConfig
from shmprod.errors import (
    BufferExhaustedError,
    ConfigError,
    InvalidRecordError,
    InvalidTopicError,
    OwnerDiedError,
    ProducerClosedError,
    ProducerHostError,
    RecordTooLargeError,
    SenderDiedError,
    ShmprodError,
    UnknownPartitionError,
)
from shmprod.handle import Handle
from tests.support.procs import reap
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def _live_senders() -> list[psutil.Process]:
    return [
        c
        for c in psutil.Process().children(recursive=True)
        if "shmprod.sender" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE
    ]


def _our_files() -> set[str]:
    import tempfile

    from shmprod import shm

    return {
        os.path.join(d, n)
        for d in (shm.SHM_DIR, tempfile.gettempdir())
        for n in os.listdir(d)
        if n.startswith(shm.NAME_PREFIX)
    }


def test_close_leaves_nothing_behind(broker: EmbeddedBroker) -> None:
    broker.create_topic("life-close", 2)
    p = Producer(bootstrap_servers=broker.bootstrap)
    segment, sender, sock = p.handle.segment, p.sender_pid, p.handle.socket_path
    assert os.path.exists(f"/dev/shm/{segment}")
    assert oct(os.stat(f"/dev/shm/{segment}").st_mode & 0o777) == "0o600"
    p.send("life-close", b"x").result(timeout=30)
    p.close()
    p.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{segment}")
    assert not os.path.exists(os.path.dirname(sock))
    assert _wait_until(lambda: _gone(sender), 10)
    assert not _live_senders()
    with pytest.raises(ProducerClosedError):
        p.send("life-close", b"late")


def test_the_sender_removes_the_files_as_it_exits_after_shutdown(broker: EmbeddedBroker) -> None:
    """Between the sender's exit and the owner's own unlink, an owner killed (a host
    producer's daemon killed while it closed) must leave nothing behind: the sender
    removes the segment, the socket and its directory itself before it exits. Here the
    owner's close is cut after the sender exited; the files are already gone."""
    broker.create_topic("life-cut", 1)
    p = Producer(bootstrap_servers=broker.bootstrap)
    segment, sock = p.handle.segment, p.handle.socket_path
    p.send("life-cut", b"x").result(timeout=30)
    p._workers[os.getpid()].shutdown_producer(10_000)  # what close() does, up to here
    assert p._proc.wait(30) == 0
    assert not os.path.exists(f"/dev/shm/{segment}")
    assert not os.path.exists(os.path.dirname(sock))
    p.close()  # the owner's removal finds them gone
    with pytest.raises(ProducerClosedError):
        p.send("life-cut", b"late")


OWNER_SCRIPT = textwrap.dedent(
    """
    import pickle, sys, time
    from shmprod import Producer
    p = Producer(bootstrap_servers=sys.argv[1])
    p.send("life-owner", b"before death").result(timeout=30)
    handle = pickle.dumps(p.handle).hex()
    print(p.handle.segment, p.sender_pid, p.handle.socket_path, handle, flush=True)
    time.sleep(120)
    """
)


def test_owner_killed_sender_cleans_up(broker: EmbeddedBroker) -> None:
    broker.create_topic("life-owner", 1)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, broker.bootstrap],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        segment, sender_s, sock, handle_hex = owner.stdout.readline().split()
        sender = int(sender_s)
        assert os.path.exists(f"/dev/shm/{segment}")
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert _wait_until(lambda: _gone(sender), 15), "the sender outlived its owner"
        assert not os.path.exists(f"/dev/shm/{segment}")
        assert not os.path.exists(sock)
        # attaching afterwards names what happened: the owner died (not "closed")
        with pytest.raises(OwnerDiedError, match="is gone"):
            attach(pickle.loads(bytes.fromhex(handle_hex)))
    finally:
        reap(owner)


def test_buffer_full_blocks_then_raises(fresh_broker: EmbeddedBroker) -> None:
    fresh_broker.create_topic("life-full", 1)
    with Producer(
        bootstrap_servers=fresh_broker.bootstrap,
        batch_size=16 * 1024,
        buffer_memory=64 * 1024,
        max_block_ms=300,
        linger_ms=0,
        request_timeout_ms=20_000,
        delivery_timeout_ms=60_000,
    ) as p:
        p.send("life-full", b"warm").result(timeout=30)
        assert fresh_broker.pid is not None
        os.kill(fresh_broker.pid, signal.SIGSTOP)
        accepted = []
        try:
            with pytest.raises(BufferExhaustedError):
                for i in range(10_000):
                    accepted.append(p.send("life-full", b"%05d" % i + b"x" * 1000))
            t0 = time.monotonic()
            with pytest.raises(BufferExhaustedError):
                p.send("life-full", b"y" * 1000)
            assert 0.2 < time.monotonic() - t0 < 5
        finally:
            os.kill(fresh_broker.pid, signal.SIGCONT)
        p.flush(timeout=60)
        assert all(f.result(timeout=10).offset >= 0 for f in accepted)
    landed = consume_all(fresh_broker.bootstrap, "life-full", 1, len(accepted) + 1, 30)
    assert len(landed[0]) == len(accepted) + 1


def test_bad_input_is_refused_with_nothing_written(broker: EmbeddedBroker) -> None:
    broker.create_topic("life-bad", 2)
    with Producer(bootstrap_servers=broker.bootstrap, max_request_size=64 * 1024) as p:
        with pytest.raises(InvalidRecordError):
            p.send("life-bad", 1.5)  # a number: never its machine bytes
        with pytest.raises(InvalidRecordError):
            p.send("life-bad", b"v", key=12)
        with pytest.raises(InvalidRecordError):
            p.send("life-bad", b"v", headers=[("h", 7)])
        with pytest.raises(InvalidRecordError):
            p.send("life-bad", b"v", headers=[(b"bytes key", b"v")])
        with pytest.raises(UnknownPartitionError):
            p.send("life-bad", b"v", partition=2)
        with pytest.raises(RecordTooLargeError):
            p.send("life-bad", b"x" * (65 * 1024))
        for name in ("", "a" * 250, "bad topic", "..", "ünïcode"):
            with pytest.raises(InvalidTopicError):
                p.send(name, b"v")
        with pytest.raises(InvalidRecordError):
            p.send_batch("life-bad", [b"ok", 5])
        with pytest.raises(UnknownPartitionError):
            p.send_batch("life-bad", [b"a", b"b"], partitions=[0, 7])
        p.send("life-bad", b"the only record", partition=1).result(timeout=30)
    landed = consume_all(broker.bootstrap, "life-bad", 2, 1, 20)
    assert [r.value for recs in landed.values() for r in recs] == [b"the only record"]


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ConfigError, match="linger_mss"):
        ProducerConfig.from_mapping({"bootstrap.servers": "127.0.0.1:1", "linger_mss": 5})
    with pytest.raises(ConfigError, match="batch_size"):
        Producer(bootstrap_servers="127.0.0.1:1", batch_size="big")
    with pytest.raises(ConfigError, match="acks"):
        Producer(bootstrap_servers="127.0.0.1:1", acks=2)
    with pytest.raises(ConfigError, match="compression_type"):
        Producer(bootstrap_servers="127.0.0.1:1", compression_type="brotli")
    cfg = ProducerConfig.from_mapping(
        {"bootstrap.servers": "h:1", "linger.ms": 10, "acks": "all", "compression.type": "lz4"}
    )
    assert (cfg.linger_ms, cfg.acks, cfg.compression_type) == (10, -1, "lz4")


def _stats_in_child(handle: Handle, out: Any) -> None:
    w = attach(handle)
    try:
        w.send("life-stats", b"from child").result(timeout=30)
        out.put(w.stats())
    finally:
        w.close()


def test_stats_from_owner_and_attached_process(broker: EmbeddedBroker) -> None:
    broker.create_topic("life-stats", 3)
    with Producer.from_config({"bootstrap.servers": broker.bootstrap, "linger.ms": 1}) as p:
        p.send_batch("life-stats", [b"v%d" % i for i in range(1000)]).result(timeout=30)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=_stats_in_child, args=(p.handle, q))
        child.start()
        child_stats = q.get(timeout=60)
        child.join(30)
        owner_stats = p.stats()
    for stats in (owner_stats, child_stats):
        assert stats["sender"]["records_sent"] >= 1000
        assert stats["pool"]["buffers_total"] > 0
        assert "life-stats" in stats["topics"]
    assert owner_stats["worker"]["records_appended"] == 1000
    assert child_stats["worker"]["records_appended"] == 1


def _last_partition(key: bytes | None, num_partitions: int) -> int:
    return num_partitions - 1


def _send_in_child(handle: Handle, out: Any) -> None:
    w = attach(handle)
    try:
        out.put(w.send("life-custom", "v", key=b"k").result(timeout=30).partition)
    finally:
        w.close()


def test_custom_partitioner_and_serializers_reach_attached_processes(
    broker: EmbeddedBroker,
) -> None:
    broker.create_topic("life-custom", 4)
    with Producer(
        bootstrap_servers=broker.bootstrap,
        partitioner=_last_partition,
        value_serializer=str.encode,
    ) as p:
        assert p.send("life-custom", "text value", key=b"k").result(timeout=30).partition == 3
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=_send_in_child, args=(p.handle, q))
        child.start()
        assert q.get(timeout=60) == 3
        child.join(30)


def test_shared_memory_space_is_checked_up_front() -> None:
    from shmprod.shm import SharedMemoryError, check_space

    with pytest.raises(SharedMemoryError, match="shm-size"):
        check_space(1 << 60)


@pytest.mark.parametrize(
    "start", ["fork", "spawn", "forkserver", "multiprocess-spawn", "multiprocess-fork"]
)
def test_attach_from_every_start_method(broker: EmbeddedBroker, start: str) -> None:
    broker.create_topic(f"life-start-{start}", 1)
    if start.startswith("multiprocess-"):
        import multiprocess

        ctx: Any = multiprocess.get_context(start.split("-")[1])
    else:
        ctx = mp.get_context(start)
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        q = ctx.Queue()
        child = ctx.Process(target=_send_one_to, args=(p.handle, f"life-start-{start}", q))
        child.start()
        assert q.get(timeout=60) >= 0
        child.join(30)
        assert child.exitcode == 0


def _send_one_to(handle: Handle, topic: str, out: Any) -> None:
    w = attach(handle)
    try:
        out.put(w.send(topic, b"hello", key=b"k").result(timeout=30).offset)
    finally:
        w.close()


def test_attach_elsewhere_names_the_host(broker: EmbeddedBroker) -> None:
    """A handle carried to another host (a pickled closure, a task message) cannot map
    the segment there: the error says why, and the handle records the producer's host."""
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        assert p.handle.host == socket.gethostname()
        gone = dataclasses.replace(p.handle, segment="shmprod-not-on-this-host")
        with pytest.raises(ProducerClosedError, match="its shared memory was removed"):
            attach(gone)  # same host, owner alive: the producer was closed
        elsewhere = dataclasses.replace(gone, host="another-host")
        with pytest.raises(ProducerHostError, match=r"'another-host'.*host-local"):
            attach(elsewhere)


_MANY_FDS = """
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # push new fds past 1024
from shmprod import Producer
with Producer(bootstrap_servers=sys.argv[1]) as p:
    md = p.send(sys.argv[2], b"from a process with many files", partition=0).result(30)
    assert p._worker()._sock.fileno() > 1024
print("offset", md.offset)
"""


def test_a_process_with_descriptors_past_1024_can_send(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """Servers and Spark executors often hold more than 1024 files: nothing may use
    select() (FD_SETSIZE), or every send fails with 'filedescriptor out of range'."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("the hard limit of open files is below 2048 here")
    broker.create_topic(topic_name, 1)
    out = subprocess.run(
        [sys.executable, "-c", _MANY_FDS, broker.bootstrap, topic_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "offset 0" in out.stdout


def test_a_misspelled_option_is_a_config_error_with_the_closest_name() -> None:
    with pytest.raises(ConfigError, match=r"compresion_type.*compression_type"):
        Producer(bootstrap_servers="127.0.0.1:1", compresion_type="lz4")
    with pytest.raises(ConfigError, match=r"linger\.mss.*linger\.ms"):
        Producer.from_config({"bootstrap.servers": "127.0.0.1:1", "linger.mss": 5})
    with pytest.raises(ConfigError, match=r"unknown producer option 'zzz'$"):
        Producer(bootstrap_servers="127.0.0.1:1", zzz=1)


def test_pickling_a_producer_or_a_lambda_serializer_says_what_to_do(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    monkeypatch.delitem(sys.modules, "dill", raising=False)  # as in a process without it

    with Producer(bootstrap_servers=broker.bootstrap) as p:
        with pytest.raises(TypeError, match=r"pass producer\.handle.*shmprod\.attach"):
            pickle.dumps(p)
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool, pytest.raises(TypeError, match="handle"):
            pool.apply(os.getpid, (p,))  # what users try first
        assert pickle.loads(pickle.dumps(p.handle)) == p.handle
    with (
        Producer(bootstrap_servers=broker.bootstrap, value_serializer=lambda v: b"x") as p,
        pytest.raises(TypeError, match=r"value_serializer=.*top level of an importable"),
    ):
        pickle.dumps(p.handle)


def _send_until_closed(handle: Handle, topic: str, out: Any) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(45, exit=False)  # a hang shows every thread's stack
    w = attach(handle)
    futs = []
    end = time.monotonic() + 60  # bounded in time, not count: the owner closes after 1 s
    try:
        i = 0
        while time.monotonic() < end:
            futs.append(w.send(topic, b"%d" % i))
            i += 1
            if i % 1000 == 0:
                time.sleep(0.005)
        out.put(("call", "no error within 60 s", ""))
    except ShmprodError as exc:
        out.put(("call", type(exc).__name__, str(exc)))
    # the owner's close lets the sender drain for up to 30 s (a slow broker): one
    # deadline for all futures, past which a future without an outcome is a bug
    deadline = time.monotonic() + 50
    try:
        failed = {
            type(e).__name__
            for f in futs
            if (e := f.exception(max(0.0, deadline - time.monotonic()))) is not None
        }
    except BaseException as exc:
        failed = {f"no outcome 50 s after the close: {exc!r}"}
    out.put(("futures", sorted(failed), ""))


def test_errors_name_what_happened(broker: EmbeddedBroker, topic_name: str) -> None:
    """Closed by its owner -> ProducerClosedError, for later sends and pending futures of
    every process; a killed sender -> SenderDiedError naming it, also at attach; a
    producer whose owner is gone -> OwnerDiedError; attach of a closed one ->
    ProducerClosedError, never SharedMemoryError."""
    broker.create_topic(topic_name, 1)
    ctx = mp.get_context("spawn")
    p = Producer(bootstrap_servers=broker.bootstrap, linger_ms=50)
    out = ctx.Queue()
    proc = ctx.Process(target=_send_until_closed, args=(p.handle, topic_name, out))
    proc.start()
    time.sleep(1.0)
    handle = p.handle
    p.close()
    call = out.get(timeout=60)
    futures = out.get(timeout=90)
    proc.join(30)
    assert call[1] == "ProducerClosedError" and "closed by its owner" in call[2], call
    assert set(futures[1]) <= {"ProducerClosedError"}, futures
    with pytest.raises(ProducerClosedError, match="closed"):
        attach(handle)

    with Producer(bootstrap_servers=broker.bootstrap) as q:
        w = attach(q.handle)
        os.kill(q.sender_pid, signal.SIGKILL)
        with pytest.raises(SenderDiedError, match=rf"sender process \(pid {q.sender_pid}\)"):
            attach(q.handle)
        with pytest.raises(SenderDiedError):
            w.send(topic_name, b"x").result(10)
        w.close(1)


def _attach_in_a_loop(handle: Handle, out: Any) -> None:
    bad: list[str] = []
    for _ in range(400):  # bounded; the owner closes meanwhile
        try:
            attach(handle).close(1)
        except ShmprodError:
            pass
        except Exception as exc:  # anything else is a bug
            bad.append(repr(exc))
    out.put(bad)


def test_attach_racing_a_close_raises_only_typed_errors(broker: EmbeddedBroker) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    for _ in range(3):
        p = Producer(bootstrap_servers=broker.bootstrap)
        procs = [ctx.Process(target=_attach_in_a_loop, args=(p.handle, out)) for _ in range(2)]
        for proc in procs:
            proc.start()
        time.sleep(0.3)
        p.close()
        results = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
        assert results == [[], []], results


def test_a_dead_broker_is_logged_and_named_in_the_timeout(
    fresh_broker: EmbeddedBroker, topic_name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A broker gone after start: the sender logs the failed connections at WARNING
    (not silence until the timeout), and the DeliveryTimeoutError says why."""
    from shmprod.broker import free_port
    from shmprod.errors import DeliveryTimeoutError, MetadataTimeoutError

    fresh_broker.create_topic(topic_name, 1)
    with Producer(
        bootstrap_servers=fresh_broker.bootstrap,
        request_timeout_ms=1000,
        delivery_timeout_ms=3000,
        retry_backoff_max_ms=200,
    ) as p:
        p.send(topic_name, b"before").result(30)
        fresh_broker.stop()
        with pytest.raises(DeliveryTimeoutError, match=r"last error: .*connection failure"):
            p.send(topic_name, b"after").result(30)
    err = capfd.readouterr().err
    assert "WARNING broker connection failed" in err, err[-2000:]

    t0 = time.monotonic()
    with pytest.raises(MetadataTimeoutError, match="connection failure"):
        Producer(bootstrap_servers=f"127.0.0.1:{free_port()}", max_block_ms=1500)
    assert time.monotonic() - t0 < 30
    assert "retrying until max_block_ms=1500" in capfd.readouterr().err


_OWNER = """
import sys, time
from shmprod import Producer
p = Producer(bootstrap_servers=sys.argv[1])
print(p.handle.segment, p.sender_pid, flush=True)
time.sleep(120)
"""


def _orphan(broker: EmbeddedBroker) -> tuple[str, str]:
    """A producer whose sender, then owner, were SIGKILLed: (segment, socket dir)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, broker.bootstrap], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        segment, sender = owner.stdout.readline().split()
        os.kill(int(sender), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # dead: gone, or a zombie of its parent
            try:
                if psutil.Process(int(sender)).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
    finally:
        owner.kill()
        owner.wait(10)
        if owner.stdout is not None:
            owner.stdout.close()
    from shmprod.sweep import socket_dir

    assert os.path.exists(f"/dev/shm/{segment}") and os.path.isdir(socket_dir(segment))
    return segment, socket_dir(segment)


def test_files_of_dead_producers_are_swept(broker: EmbeddedBroker) -> None:
    """SIGKILL of the sender and then of the owner leaves the segment and the socket
    directory; ``shmprod cleanup`` (after ``--dry-run`` listed them) and the next
    Producer() start remove them, and nothing of a live producer."""
    with Producer(bootstrap_servers=broker.bootstrap) as live:
        segment, directory = _orphan(broker)
        dry = subprocess.run(
            [sys.executable, "-m", "shmprod", "cleanup", "--dry-run"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert dry.returncode == 0 and f"would remove {segment}" in dry.stdout
        assert live.handle.segment not in dry.stdout
        assert os.path.exists(f"/dev/shm/{segment}")
        done = subprocess.run(
            [sys.executable, "-m", "shmprod", "cleanup"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and f"removed {segment}" in done.stdout
        assert not os.path.exists(f"/dev/shm/{segment}") and not os.path.exists(directory)
        assert os.path.exists(f"/dev/shm/{live.handle.segment}")
    segment, directory = _orphan(broker)
    with Producer(bootstrap_servers=broker.bootstrap):
        assert not os.path.exists(f"/dev/shm/{segment}") and not os.path.exists(directory)


def test_a_small_dev_shm_sizes_the_pool_to_fit_and_says_so(
    broker: EmbeddedBroker,
    topic_name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A container's 64 MiB /dev/shm cannot hold the default 64 MiB pool and its
    tables: the pool shrinks to fit, with a warning at start, and works."""
    from shmprod import shm
    from shmprod.shm import SharedMemoryError

    broker.create_topic(topic_name, 1)
    monkeypatch.setattr(shm, "free_bytes", lambda path=shm.SHM_DIR: 64 * 2**20)
    with (
        caplog.at_level("WARNING", "shmprod.producer"),
        Producer(bootstrap_servers=broker.bootstrap) as p,
    ):
        assert p.config.buffer_memory <= int(64 * 2**20 * 0.8)
        assert p.config.buffer_memory % p.config.batch_size == 0
        assert p.send(topic_name, b"fits", partition=0).result(30).offset == 0
    assert "/dev/shm has 64.0 MiB free" in caplog.text and "--shm-size" in caplog.text
    # too little for a useful pool: the clear error at start, never a SIGBUS later
    monkeypatch.setattr(shm, "free_bytes", lambda path=shm.SHM_DIR: 256 * 1024)
    with pytest.raises(SharedMemoryError, match="MiB free but the producer's pool needs"):
        Producer(bootstrap_servers=broker.bootstrap)


def test_a_start_that_fails_after_the_sender_started_leaves_nothing(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's interpreter starts before the pool is made; a failure in making the
    pool or the control socket kills it and removes what was made, with the error."""
    from shmprod import producer, shm
    from shmprod.shm import SharedMemoryError

    before = _our_files()
    monkeypatch.setattr(shm, "free_bytes", lambda path=shm.SHM_DIR: 256 * 1024)
    with pytest.raises(SharedMemoryError):  # no room for the pool
        Producer(bootstrap_servers=broker.bootstrap)
    monkeypatch.undo()
    monkeypatch.setattr(producer, "socket_dir", lambda name: os.path.join("/nonexistent", name))
    with pytest.raises(FileNotFoundError):  # the segment was made, the socket's directory not
        Producer(bootstrap_servers=broker.bootstrap)
    assert not _live_senders()
    assert _our_files() <= before


def test_a_sender_that_dies_as_it_starts_is_named_with_its_status(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender whose interpreter fails before it serves the producer (say, it cannot
    import shmprod) is a SenderDiedError naming its exit status, not a complaint about
    the handle; nothing is left behind."""
    from shmprod import producer

    def broken(listen_fd: int, **kwargs: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.exit(3)"],
            pass_fds=[listen_fd],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )

    before = _our_files()
    monkeypatch.setattr(producer, "start_sender", broken)
    with pytest.raises(SenderDiedError, match="exited with status 3 as it started"):
        Producer(bootstrap_servers=broker.bootstrap)
    assert not _live_senders()
    assert _our_files() <= before
