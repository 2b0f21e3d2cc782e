"""shmprod.host_producer: one producer per host, user and configuration, found or started.

Real processes (spawn), the real broker; confluent-kafka reads back what was sent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from shmprod import host_producer
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.host import runtime_dir
from shmprod.shm import Segment
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker


@pytest.fixture(autouse=True)
def private_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's host producers live in a directory of its own (children inherit it)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "shmprod"


def _send(bootstrap: str, topic: str, worker: int, n: int, out: Any, barrier: Any) -> None:
    barrier.wait(60)
    with host_producer(bootstrap, linger_ms=7, idle_timeout_ms=500) as w:
        futs = [w.send(topic, b"w%d-%d" % (worker, i), partition=0) for i in range(n)]
        w.flush(30)
        out.put((w._seg.name, sum(f.exception(0) is None for f in futs)))


def _daemon_pid(segment: str) -> int:
    seg = Segment.attach(segment)
    try:
        return int(L.U64.unpack_from(seg.view, L.H_OWNER_PID)[0])
    finally:
        seg.close()


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def test_racing_processes_share_one_producer_which_closes_when_idle(
    broker: EmbeddedBroker, topic_name: str, private_runtime_dir: Path
) -> None:
    broker.create_topic(topic_name, 1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_send, args=(broker.bootstrap, topic_name, w, 500, out, barrier))
        for w in range(4)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    segments = {seg for seg, _ in results}
    assert len(segments) == 1, results  # four racing callers, one producer
    assert all(ok == 500 for _, ok in results)
    landed = consume_all(broker.bootstrap, topic_name, 1, 2000, timeout_s=30)
    assert len(landed[0]) == 2000
    (segment,) = segments
    # private files: the directory 0700, the files 0600
    assert stat.S_IMODE(os.stat(private_runtime_dir).st_mode) == 0o700
    for f in private_runtime_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    # idle for idle_timeout_ms after the last detached: it closes, nothing is left
    assert _wait(lambda: not os.path.exists(f"/dev/shm/{segment}"), 20)
    assert not any(p.suffix == ".handle" for p in private_runtime_dir.iterdir())


def test_another_configuration_gets_its_own_and_a_killed_one_is_replaced(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 1)
    with host_producer(broker.bootstrap, linger_ms=5, idle_timeout_ms=200) as a:
        with host_producer(broker.bootstrap, linger_ms=5, idle_timeout_ms=200) as same:
            assert same._seg.name == a._seg.name
        with host_producer(broker.bootstrap, linger_ms=6, idle_timeout_ms=200) as other:
            assert other._seg.name != a._seg.name
        first = a._seg.name
        a.send(topic_name, b"one", partition=0).result(30)
        # a crashed host producer, killed while a process is attached (once none is, it
        # may be closing itself for idleness: a kill then races its close)
        os.kill(_daemon_pid(first), signal.SIGKILL)
        assert _wait(lambda: not os.path.exists(f"/dev/shm/{first}"), 20)  # its sender cleans up
    with host_producer(broker.bootstrap, linger_ms=5, idle_timeout_ms=200) as b:
        assert b._seg.name != first
        assert b.send(topic_name, b"two", partition=0).result(30).offset == 1


def test_runtime_dir_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmprod.errors import ProducerError

    shared = tmp_path / "open"
    shared.mkdir()
    (shared / "shmprod").mkdir(mode=0o777)
    os.chmod(shared / "shmprod", 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    with pytest.raises(ProducerError, match="0700"):
        runtime_dir()


def test_the_daemon_starts_numpy_without_blas_threads(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It never calls BLAS: OpenBLAS's threads would only spin at its start. A value
    of the caller's does not reach it (its environment is an allow-list)."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    with host_producer(broker.bootstrap, linger_ms=5, idle_timeout_ms=200) as w:
        environ = Path(f"/proc/{_daemon_pid(w._seg.name)}/environ").read_bytes().split(b"\0")
    assert b"OPENBLAS_NUM_THREADS=1" in environ
