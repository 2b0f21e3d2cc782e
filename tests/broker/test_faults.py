"""The shared producer under broker faults, through the fault-injecting proxy.

Each test sends a known set of records, injects a fault, then reads the topic back with
confluent-kafka: with idempotence on, nothing acknowledged is lost, nothing is written
twice, and per-partition order holds. (The beginning of the fault matrix.)
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from tests.support.kafka_proxy import PRODUCE, KafkaProxy
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

PARTITIONS = 6


def _send_and_check(
    broker: EmbeddedBroker,
    proxy: KafkaProxy,
    topic: str,
    fault: object,
    *,
    resends: bool = False,
) -> None:
    """``resends``: a request may be written twice; the broker answers the second one
    DUPLICATE_SEQUENCE_NUMBER (success) and tansu gives no offset then, so those rows
    report offset -1 ("delivered, offset unknown")."""
    broker.create_topic(topic, PARTITIONS)
    n_batches, per_batch = 20, 500
    with Producer(
        bootstrap_servers=proxy.bootstrap,
        linger_ms=2,
        retry_backoff_ms=10,
        retry_backoff_max_ms=100,
        request_timeout_ms=5_000,
        delivery_timeout_ms=60_000,
    ) as p:
        p.send(topic, b"warm-up", partition=0).result(timeout=30)
        futures = []
        for b in range(n_batches):
            if b == n_batches // 3:
                fault()  # type: ignore[operator]
            values = [b"%03d-%05d" % (b, i) for i in range(per_batch)]
            keys = [b"k%d" % (i % 97) for i in range(per_batch)]
            futures.append(p.send_batch(topic, values, keys=keys))
        p.flush(timeout=60)
        results = [f.result(timeout=30) for f in futures]
    expected = n_batches * per_batch + 1
    landed = consume_all(broker.bootstrap, topic, PARTITIONS, expected, 60)
    values = [r.value for recs in landed.values() for r in recs]
    assert len(values) == expected, "lost or duplicated records"
    assert len(set(values)) == expected, "duplicated records"
    where = {r.value: (r.partition, r.offset) for recs in landed.values() for r in recs}
    for b, md in enumerate(results):
        for i in range(per_batch):
            partition, offset = where[b"%03d-%05d" % (b, i)]
            assert partition == md.partitions[i]
            assert offset == md.offsets[i] or (resends and md.offsets[i] == -1)
    for recs in landed.values():  # send order kept per partition
        sent_order = [r.value for r in recs if r.value != b"warm-up"]
        assert sent_order == sorted(sent_order)
    if not resends:
        assert np.all(np.concatenate([md.offsets for md in results]) >= 0)


def test_not_leader_answers_are_retried(broker: EmbeddedBroker, proxy: KafkaProxy) -> None:
    _send_and_check(broker, proxy, "fault-not-leader", lambda: proxy.fail_next(PRODUCE, 6, count=4))


def test_timeouts_and_not_enough_replicas_are_retried(
    broker: EmbeddedBroker, proxy: KafkaProxy
) -> None:
    def fault() -> None:
        proxy.fail_next(PRODUCE, 7, count=2)  # REQUEST_TIMED_OUT
        proxy.fail_next(PRODUCE, 19, count=2, partitions=[1, 2])  # NOT_ENOUGH_REPLICAS

    _send_and_check(broker, proxy, "fault-timeouts", fault)


def test_dropped_connections_lose_and_duplicate_nothing(
    broker: EmbeddedBroker, proxy: KafkaProxy
) -> None:
    def fault() -> None:
        def drop() -> None:
            for _ in range(5):
                proxy.drop_connections()
                time.sleep(0.03)

        threading.Thread(target=drop, daemon=True).start()

    _send_and_check(broker, proxy, "fault-drops", fault, resends=True)


def test_leader_moves(broker: EmbeddedBroker, proxy: KafkaProxy) -> None:
    def fault() -> None:
        for part in range(PARTITIONS):
            proxy.set_leader("fault-moves", part, (part + 1) % 3)
        proxy.fail_next(PRODUCE, 6, count=2)  # the old leaders say so once

    _send_and_check(broker, proxy, "fault-moves", fault)
