"""shmprod.pool_initializer and shmprod.current with the pools users have:
multiprocessing.Pool under fork, spawn and forkserver, multiprocess.Pool and
concurrent.futures.ProcessPoolExecutor; every record read back by confluent-kafka."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

import shmprod
from shmprod.broker import EmbeddedBroker
from shmprod.errors import ProducerError
from tests.support.faultrig import wait_until
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker


def send_chunk(job: tuple[str, int, int]) -> tuple[int, int]:
    """A pool task: sends its rows through this process's attachment."""
    topic, start, n = job
    w = shmprod.current()
    futures = [w.send(topic, b"row-%d" % i, key=b"k%d" % (i % 13)) for i in range(start, start + n)]
    w.flush(60)
    assert all(f.exception(0) is None for f in futures)
    return os.getpid(), w.worker_slot


JOBS = 8
ROWS = 500


def _jobs(topic: str) -> list[tuple[str, int, int]]:
    return [(topic, j * ROWS, ROWS) for j in range(JOBS)]


def _check(bootstrap: str, topic: str, results: list[tuple[int, int]]) -> None:
    assert os.getpid() not in {pid for pid, _ in results}
    landed = consume_all(bootstrap, topic, 3, JOBS * ROWS, 60, extra_wait_s=0.5)
    values = sorted(r.value for recs in landed.values() for r in recs if r.value)
    assert values == sorted(b"row-%d" % i for i in range(JOBS * ROWS))


def _mp_pool(method: str) -> Callable[[Any], Any]:
    def run(p: shmprod.Producer) -> list[tuple[int, int]]:
        ctx = mp.get_context(method)
        with ctx.Pool(2, initializer=shmprod.pool_initializer, initargs=(p.handle,)) as pool:
            out = pool.map(send_chunk, _jobs(p._test_topic))  # type: ignore[attr-defined]
            pool.close()
            pool.join()
        return out

    return run


def _multiprocess_pool(p: shmprod.Producer) -> list[tuple[int, int]]:
    multiprocess = pytest.importorskip("multiprocess")
    with multiprocess.get_context("spawn").Pool(
        2, initializer=shmprod.pool_initializer, initargs=(p.handle,)
    ) as pool:
        out: list[tuple[int, int]] = pool.map(send_chunk, _jobs(p._test_topic))  # type: ignore[attr-defined]
        pool.close()
        pool.join()
    return out


def _executor(method: str) -> Callable[[Any], Any]:
    def run(p: shmprod.Producer) -> list[tuple[int, int]]:
        with ProcessPoolExecutor(
            2,
            mp_context=mp.get_context(method),
            initializer=shmprod.pool_initializer,
            initargs=(p.handle,),
        ) as ex:
            return list(ex.map(send_chunk, _jobs(p._test_topic)))  # type: ignore[attr-defined]

    return run


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param(_mp_pool("fork"), id="multiprocessing-fork"),
        pytest.param(_mp_pool("spawn"), id="multiprocessing-spawn"),
        pytest.param(_mp_pool("forkserver"), id="multiprocessing-forkserver"),
        pytest.param(_multiprocess_pool, id="multiprocess-spawn"),
        pytest.param(_executor("spawn"), id="executor-spawn"),
        pytest.param(_executor("forkserver"), id="executor-forkserver"),
    ],
)
def test_pool_processes_share_the_producer(
    broker: EmbeddedBroker, topic_name: str, pool: Callable[[Any], list[tuple[int, int]]]
) -> None:
    broker.create_topic(topic_name, 3)
    with shmprod.Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
        p._test_topic = topic_name  # type: ignore[attr-defined]
        results = pool(p)
        # every pool process detached when it exited: only the owner is left
        deadline_ok = wait_until(lambda: p.stats()["sender"]["workers_attached"] == 1, 20)
        assert deadline_ok, p.stats()["sender"]["workers_attached"]
    _check(broker.bootstrap, topic_name, results)


def test_current_outside_a_pool_says_what_to_do() -> None:
    with pytest.raises(ProducerError, match=r"initializer=shmprod\.pool_initializer"):
        shmprod.current()
