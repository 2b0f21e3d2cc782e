"""format("shmprod") on a Spark cluster of one host: separate executor JVMs
(local-cluster) sharing one host producer, and a task killed mid-write.

Counted from the outside: sender processes from the process table, connections to the
broker from the sockets, segments from /dev/shm; confluent-kafka reads back the rows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.config import DEFAULT_CONNECTIONS_PER_BROKER
from tests.support.procs import broker_connections, segments, senders

pytest.importorskip("pyspark", reason="the spark extra is not installed")

import shmprod.spark
from shmprod.spark import local_session
from shmprod.spark.sink import LINEAGE_HEADERS
from tests.support.spark_cluster import (
    IDLE_MS,
    check_all,
    children,
    host_daemons,
    private_runtime,
    rows,
    stop_and_reap,
    times_landed,
    wait_for_executors,
    wait_gone,
)

pytestmark = [pytest.mark.broker, pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    before = children()
    with private_runtime(tmp_path_factory.mktemp("xdg")) as runtime:
        spark = local_session(
            "local-cluster[2,1,1024]",
            "shmprod-local-cluster",
            **{"spark.driver.host": "127.0.0.1", "spark.executor.memory": "512m"},
        )
        spark.sparkContext.setLogLevel("ERROR")
        shmprod.spark.register(spark)
        try:
            wait_for_executors(spark, 2)
            yield spark, runtime
        finally:
            stop_and_reap(spark, before)
            assert wait_gone(runtime, 30), host_daemons(runtime)


class Sampler:
    """Samples the process table and sockets in a thread while a Spark action runs in
    this one (pyspark's JVM side keeps the active session per thread)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.senders: set[int] = set()
        self.max_connections: Counter[int] = Counter()
        self.segments: set[str] = set()
        self._before = senders()
        self._before_segments = segments()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        self.senders |= senders() - self._before
        for pid, n in broker_connections(self.port).items():
            self.max_connections[pid] = max(self.max_connections[pid], n)
        self.segments |= segments() - self._before_segments


def test_executors_on_one_host_share_one_producer_and_its_connections(
    local_cluster: tuple[Any, Path], fresh_broker: EmbeddedBroker, topic_name: str
) -> None:
    spark, runtime = local_cluster
    n = 400_000
    fresh_broker.create_topic(topic_name, 4)
    port = int(fresh_broker.bootstrap.rsplit(":", 1)[1])
    writer = (
        rows(spark, n, 8)
        .write.format("shmprod")
        .option("kafka.bootstrap.servers", fresh_broker.bootstrap)
        .option("topic", topic_name)
        .option("idleTimeoutMs", str(IDLE_MS))
        .mode("append")
    )
    with Sampler(port) as sampler:
        writer.save()
    landed = check_all(fresh_broker.bootstrap, topic_name, 4, n)
    assert set(times_landed(landed).values()) == {1}  # exactly once: nothing failed
    # one sender process and its connections to the broker (the default
    # connections_per_broker), for two executor JVMs: no executor opened one of its own
    assert len(sampler.senders) == 1, sampler.senders
    (sender,) = sampler.senders
    assert dict(sampler.max_connections) == {sender: DEFAULT_CONNECTIONS_PER_BROKER}, (
        sampler.max_connections
    )
    # after idleTimeoutMs (and the Python workers' short hold) it has closed; nothing left
    assert wait_gone(runtime, 30)
    assert not psutil.pid_exists(sender) or psutil.Process(sender).status() == "zombie"
    assert sampler.segments and not segments() & sampler.segments


def _attached_python_workers(exclude: set[int]) -> list[int]:
    """pyspark's Python workers (not in ``exclude``) that map a shmprod segment."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if p.pid in exclude or "pyspark" not in cmd:  # never another test's processes
            continue
        with contextlib.suppress(psutil.Error):
            if any("/dev/shm/shmprod-" in m.path for m in p.memory_maps()):
                found.append(p.pid)
    return found


def test_a_writer_killed_mid_write_is_retried_and_every_row_lands(
    local_cluster: tuple[Any, Path], fresh_broker: EmbeddedBroker, topic_name: str
) -> None:
    spark, runtime = local_cluster
    n, parts = 200_000, 4
    fresh_broker.create_topic(topic_name, 3)

    def slow(batches: Any) -> Any:  # upstream of the writer: 4 s of rows per task
        for b in batches:
            for i in range(0, b.num_rows, 2_000):
                time.sleep(0.08)
                yield b.slice(i, 2_000)

    df = rows(spark, n, parts).mapInArrow(slow, "value string, key string")
    writer = (
        df.write.format("shmprod")
        .option("kafka.bootstrap.servers", fresh_broker.bootstrap)
        .option("topic", topic_name)
        .option("includeLineage", "true")
        .option("idleTimeoutMs", str(IDLE_MS))
        .mode("append")
    )
    killed: list[int] = []
    tracker = spark.sparkContext.statusTracker()

    def failed_tasks() -> int:
        infos = (tracker.getStageInfo(s) for s in tracker.getActiveStageIds())
        return sum(i.numFailedTasks for i in infos if i is not None)

    def kill_a_writer() -> None:
        """SIGKILLs writers until Spark counts a failed task: a writer between two
        tasks (its attachment kept for the next) fails none."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and failed_tasks() == 0 and len(killed) < 5:
            time.sleep(0.2)
            exclude = {os.getpid(), *host_daemons(runtime), *senders(), *killed}
            victims = _attached_python_workers(exclude)
            if victims:
                os.kill(victims[0], signal.SIGKILL)  # a writer task's Python worker
                killed.append(victims[0])
                time.sleep(1.0)  # Spark notices the lost worker

    killer = threading.Thread(target=kill_a_writer, daemon=True)
    killer.start()
    writer.save()
    killer.join(60)
    assert killed, "no writer was seen attached"
    landed = check_all(fresh_broker.bootstrap, topic_name, 3, n)
    # at least once: the killed task ran again (a later attempt's lineage: 1, or 2 when
    # the killer also caught the retry before Spark counted the first failure), and a
    # row landed at most once per attempt
    attempts = Counter(dict(r.headers)[LINEAGE_HEADERS[3]] for r in landed)
    assert sum(n for a, n in attempts.items() if a != b"0") > 0, attempts
    per_attempt = Counter((r.value, dict(r.headers)[LINEAGE_HEADERS[3]]) for r in landed)
    assert max(per_attempt.values()) == 1, per_attempt.most_common(3)
    assert max(times_landed(landed).values()) <= len(attempts)
