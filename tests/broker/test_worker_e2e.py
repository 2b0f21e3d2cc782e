"""End to end: workers -> the real sender process (``python -m shmprod.sender``) -> the
embedded tansu broker, read back with confluent-kafka (a client shmprod did not write).

The test plays the owner itself with the contracts only (segment + header, listening
socket, SenderSpec, ``attach(owner=True)``, ``wait_ready``, ``shutdown_producer``), so it
does not depend on :mod:`shmprod.producer`.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.config import ProducerConfig
from shmprod.connection import BrokerConnection
from shmprod.handle import Handle, SenderSpec
from shmprod.ipc import process_start_us
from shmprod.layout import Geometry, write_header
from shmprod.producer import spawn_sender
from shmprod.shm import Segment
from shmprod.worker import Worker, attach
from tests.support.readback import consume_all

pytestmark = [
    pytest.mark.broker,
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

PARTITIONS = 3


@dataclass
class Owner:
    handle: Handle
    worker: Worker
    proc: subprocess.Popen[bytes]


@pytest.fixture
def owner(broker: EmbeddedBroker) -> Iterator[Owner]:
    cfg = ProducerConfig(
        bootstrap_servers=broker.bootstrap,
        batch_size=16384,
        buffer_memory=1 << 20,
        linger_ms=5,
        compression_type="lz4",
        max_block_ms=20_000,
    )
    geo = Geometry.for_pool(cfg.buffer_memory, cfg.batch_size)
    seg = Segment.create(geo.segment_size)
    tmpdir = tempfile.mkdtemp(prefix="shmprod-e2e-")
    proc: subprocess.Popen[bytes] | None = None
    worker: Worker | None = None
    try:
        start_us = process_start_us()
        write_header(seg.view, geo, os.getpid(), start_us)
        path = os.path.join(tmpdir, "ctl.sock")
        secret = os.urandom(16)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(64)
            spec = SenderSpec(
                seg.name,
                path,
                secret.hex(),
                os.getpid(),
                start_us,
                listener.fileno(),
                cfg.to_wire(),
            )
            proc = spawn_sender(spec, start_new_session=True)
        handle = Handle(seg.name, path, secret, os.getpid(), cfg.to_wire())
        worker = attach(handle, owner=True)
        worker.wait_ready(30)
        yield Owner(handle, worker, proc)
        assert worker.shutdown_producer(5000)
        assert proc.wait(10) == 0
    finally:
        if worker is not None:
            worker.close(0)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)
        seg.close()
        seg.unlink()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _child(handle: Handle, topic: str) -> None:
    with attach(handle) as w:
        md = w.send_batch(topic, [b"child %d" % i for i in range(100)], partitions=0)
        md.result(20)


def test_records_reach_the_broker_where_the_futures_say(
    owner: Owner, broker: EmbeddedBroker, topic_name: str
) -> None:
    with BrokerConnection(broker.host, broker.port) as conn:
        assert conn.create_topics({topic_name: PARTITIONS}) == {topic_name: 0}
    w = owner.worker
    futs = [
        w.send(topic_name, b"single %d" % i, key=b"key %d" % (i % 50), headers=[("i", b"%d" % i)])
        for i in range(500)
    ]
    values = [b"bulk %d" % i for i in range(3000)]
    keys = [b"key %d" % (i % 97) for i in range(3000)]
    bulk = w.send_batch(topic_name, values, keys=keys)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_child, args=(owner.handle, topic_name))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    w.flush(30)

    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, 3600)
    at = {(r.partition, r.offset): r for recs in landed.values() for r in recs}
    assert len(at) == 3600
    for i, f in enumerate(futs):
        md = f.result(0)
        r = at[(md.partition, md.offset)]
        assert (r.key, r.value, r.headers) == (
            b"key %d" % (i % 50),
            b"single %d" % i,
            (("i", b"%d" % i),),
        )
        assert r.timestamp_ms == md.timestamp_ms
    bmd = bulk.result(0)
    for p, o, k, v in zip(bmd.partitions, bmd.offsets, keys, values, strict=True):
        r = at[(int(p), int(o))]
        assert (r.key, r.value) == (k, v)
    children = sorted(r.value for r in landed[0] if r.value and r.value.startswith(b"child"))
    assert len(children) == 100
    stats = w.stats()
    assert stats["worker"]["records_acked"] == 3500
    assert stats["sender"]["workers_died"] == 0


def _headers_of(i: int) -> tuple[object, tuple[tuple[str, bytes | None], ...]]:
    """Record i's headers as sent (every form send() takes) and as they must land."""
    forms: list[tuple[object, tuple[tuple[str, bytes | None], ...]]] = [
        (None, ()),
        ([], ()),
        ([("i", b"%d" % i)], (("i", b"%d" % i),)),
        ((["trace", f"t-{i}"], ["none", None]), (("trace", b"t-%d" % i), ("none", None))),
        ({"ключ": "значение", "e": b""}, (("ключ", "значение".encode()), ("e", b""))),
        ([("buf", bytearray(b"mutable"))], (("buf", b"mutable"),)),  # the Python path's
        ({}, ()),
    ]
    return forms[i % len(forms)]


def test_headers_of_every_form_land_as_sent(
    owner: Owner, broker: EmbeddedBroker, topic_name: str
) -> None:
    """Rows with and without headers share a stage (the C path encodes the common forms,
    the Python path the rest); each record lands with exactly its own headers."""
    with BrokerConnection(broker.host, broker.port) as conn:
        assert conn.create_topics({topic_name: PARTITIONS}) == {topic_name: 0}
    w = owner.worker
    n = 700
    futs = [
        w.send(
            topic_name,
            b"v%d" % i,
            key=b"k%d" % (i % 13) if i % 4 else None,
            headers=_headers_of(i)[0],
            partition=i % PARTITIONS if i % 11 == 0 else None,
        )
        for i in range(n)
    ]
    w.flush(30)
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, n)
    at = {(r.partition, r.offset): r for recs in landed.values() for r in recs}
    assert len(at) == n
    for i, f in enumerate(futs):
        md = f.result(0)
        r = at[(md.partition, md.offset)]
        assert (r.value, r.headers) == (b"v%d" % i, _headers_of(i)[1]), i
        assert r.timestamp_ms == md.timestamp_ms
