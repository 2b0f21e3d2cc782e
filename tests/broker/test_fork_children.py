"""A worker's forked children do not keep its control connection alive.

A process that attached and then forked (a pool inside a worker, a subprocess helper)
dies: the sender must see that death at once, reclaim its buffers and count it, even
though the child it forked is still running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil
import pytest

from shmprod import Producer, attach
from shmprod.broker import EmbeddedBroker
from shmprod.handle import Handle

pytestmark = pytest.mark.broker


def _attach_fork_and_die(handle: Handle, topic: str, child_pid: mp.Queue[int]) -> None:
    w = attach(handle)
    sent = w.send(topic, b"from the worker", partition=0)
    w.flush(30)
    sent.result(timeout=0)
    w.send(topic, b"left staged", partition=1)  # and it holds its lease of granted buffers
    pid = os.fork()
    if pid == 0:  # the child: lives on, never touches the producer
        time.sleep(60)
        os._exit(0)
    child_pid.put(pid)
    time.sleep(60)  # killed by the test


def test_the_sender_sees_a_worker_die_while_its_forked_child_lives(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 2)
    ctx = mp.get_context("spawn")
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=60_000) as p:
        q: mp.Queue[int] = ctx.Queue()
        proc = ctx.Process(target=_attach_fork_and_die, args=(p.handle, topic_name, q))
        proc.start()
        child = q.get(timeout=60)
        try:
            assert psutil.pid_exists(child)
            os.kill(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            # not join(): it waits on a pipe the forked child holds open too
            while proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert proc.exitcode == -signal.SIGKILL
            while time.monotonic() < deadline and p.stats()["sender"]["workers_died"] < 1:
                time.sleep(0.05)
            stats = p.stats()["sender"]
            assert stats["workers_died"] == 1, stats
            assert stats["buffers_reclaimed"] >= 1, stats
            assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE  # still alive
        finally:
            os.kill(child, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while psutil.pid_exists(child) and time.monotonic() < deadline:
                time.sleep(0.05)  # reparented: reaped by init, not by us
