"""Shared fixtures: a real tansu broker per test session, topics per test."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import psutil
import pytest

from shmprod import layout as L
from shmprod import speedups
from shmprod.broker import EmbeddedBroker
from shmprod.worker import Worker, attach
from shmprod.worker import core as worker_core
from tests.support.fake_sender import FakeSender
from tests.support.kafka_proxy import KafkaProxy

_topic_ids = itertools.count()


def _segments() -> set[str]:
    shm = "/dev/shm"
    return {f for f in os.listdir(shm) if f.startswith("shmprod-")} if os.path.isdir(shm) else set()


def _someone_elses(name: str) -> bool:
    """A segment whose owner is alive and outside this test process's tree: a producer of
    another program (or another test session) on this host, not ours to judge."""
    try:
        with open(f"/dev/shm/{name}", "rb") as f:
            f.seek(L.H_OWNER_PID)
            pid = int.from_bytes(f.read(8), "little")
        owner = psutil.Process(pid)
        if owner.status() == psutil.STATUS_ZOMBIE:
            return False
        me = os.getpid()
        return pid != me and all(p.pid != me for p in owner.parents())
    except (OSError, ValueError, psutil.Error):
        return False  # gone, unreadable or dead owner: judged as ours


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Fails the run if any test left a shared-memory segment behind (and removes it).

    Segments of live producers outside this process tree are left alone, so test runs
    side by side on one host neither blame nor delete each other's segments."""
    before = _segments()
    yield
    leaked = {name for name in _segments() - before if not _someone_elses(name)}
    for name in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
    assert not leaked, f"tests left shared-memory segments behind: {sorted(leaked)}"


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """One embedded broker for the whole session; always stopped."""
    b = EmbeddedBroker()
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def fresh_broker() -> Iterator[EmbeddedBroker]:
    """A broker of the test's own, for tests that must not share state."""
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def proxy(broker: EmbeddedBroker) -> Iterator[KafkaProxy]:
    """The fault-injecting proxy in front of the session broker: three nodes."""
    with KafkaProxy(broker.host, broker.port, nodes=3) as p:
        yield p
    assert not p.running  # the loop thread was joined


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name unique within the session."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"t-{os.getpid()}-{next(_topic_ids)}-{base}"


@pytest.fixture
def fake() -> Iterator[FakeSender]:
    """A fake sender speaking the control protocol over a real segment (worker tests)."""
    with FakeSender() as f:
        yield f


@pytest.fixture(params=["c", "python"])
def w(
    fake: FakeSender, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Worker]:
    """A worker attached to the fake sender; closed after the test. Once with send()'s
    common case and the staged-rows encoder in C (the extension), once as without it:
    the Python twin of send() (shmprod.speedups) and flushes through the vectorised
    Arrow encoder."""
    if request.param == "c":
        if not speedups.ACCELERATED:
            pytest.skip("the C extension is not in use")
    else:
        monkeypatch.setattr(worker_core, "Stager", speedups._PyStager)
        monkeypatch.setattr(speedups, "plan_batches", None)
        monkeypatch.setattr(speedups, "encode_records", None)
        monkeypatch.setattr(speedups, "staged_lengths", None)
        monkeypatch.setattr(speedups, "murmur2_partitions", None)
        monkeypatch.setattr(speedups, "partition_order", None)
        monkeypatch.setattr(speedups, "row_places", None)
    worker = attach(fake.handle)
    try:
        yield worker
    finally:
        worker.close(timeout=5)
