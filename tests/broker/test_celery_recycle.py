"""shmprod.celery.setup under churn: a prefork worker with 4 children recycled every
50 tasks runs 1,000 tasks through one sender and its broker connections (the default
``connections_per_broker``); every record lands once; nothing is left after shutdown."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.config import DEFAULT_CONNECTIONS_PER_BROKER
from tests.support.procs import broker_connections, segments, senders
from tests.support.readback import consume_all

pytest.importorskip("celery", reason="the celery extra is not installed")

from celery import Celery

from tests.support.celery_worker import RESULT_TIMEOUT_S, start_worker, stop_and_check
from workers import celery_app

pytestmark = [pytest.mark.broker, pytest.mark.celery, pytest.mark.slow]


def test_recycled_children_share_one_sender_and_leave_nothing(
    fresh_broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    tasks, per_task, partitions = 1_000, 5, 4
    fresh_broker.create_topic(topic_name, partitions)
    port = int(fresh_broker.bootstrap.rsplit(":", 1)[1])
    before_senders, before_segments = senders(), segments()
    w = start_worker(fresh_broker.bootstrap, tmp_path, 4, "--max-tasks-per-child", "50")
    client = Celery("shmprod-recycle-client")  # a client of its own: its own transport dir
    client.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    celery_app.configure(client, tmp_path)
    seen_senders: set[int] = set()
    most: Counter[int] = Counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            seen_senders.update(senders() - before_senders)
            for pid, n in broker_connections(port).items():
                most[pid] = max(most[pid], n)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncs = [
            client.send_task(
                "shmprod.export_rows",
                (topic_name, [{"key": f"k{t}", "value": f"t{t}-{i}"} for i in range(per_task)]),
            )
            for t in range(tasks)
        ]
        done = [a.get(timeout=RESULT_TIMEOUT_S, interval=0.05) for a in asyncs]
        stats = client.send_task("shmprod.producer_stats").get(
            timeout=RESULT_TIMEOUT_S, interval=0.05
        )
        w.segment = stats["segment"]
    finally:
        stop.set()
        sampler.join(10)
        client.close()
        stop_and_check(w)
    assert sum(r["records"] for r in done) == tasks * per_task
    assert len({r["pid"] for r in done}) > 4  # children were recycled
    assert len(seen_senders) == 1, seen_senders
    (sender,) = seen_senders
    # no child opened a connection of its own; the sender's reached every partition
    assert dict(most) == {sender: DEFAULT_CONNECTIONS_PER_BROKER}, most
    assert not segments() - before_segments  # nothing left in /dev/shm
    landed = consume_all(
        fresh_broker.bootstrap, topic_name, partitions, tasks * per_task, 60, extra_wait_s=1
    )
    values = Counter(r.value for recs in landed.values() for r in recs)
    assert len(values) == tasks * per_task and set(values.values()) == {1}


def test_setup_checks_options_and_producer_says_what_is_missing() -> None:
    import shmprod.celery
    from shmprod.errors import ConfigError, ProducerClosedError

    with pytest.raises(ConfigError, match="did you mean 'linger_ms'"):
        shmprod.celery.setup(Celery("x"), bootstrap_servers="127.0.0.1:9092", lingr_ms=5)
    with pytest.raises(ProducerClosedError, match=r"shmprod\.celery\.setup"):
        shmprod.celery.producer()
