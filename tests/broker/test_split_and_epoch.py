"""MESSAGE_TOO_LARGE answered by splitting, and the producer epoch bump (KIP-360).

Through the fault-injecting proxy in front of tansu, with idempotence on; what landed
is read back with confluent-kafka and checked at the offset each future reported.
"""

from __future__ import annotations

import os

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from shmprod.errors import KafkaError
from shmprod.protocol import error_codes as ec
from tests.support.kafka_proxy import PRODUCE, KafkaProxy
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

PARTITIONS = 3


def _producer(proxy: KafkaProxy, **extra: object) -> Producer:
    return Producer(
        bootstrap_servers=proxy.bootstrap,
        linger_ms=5,
        retry_backoff_ms=10,
        retry_backoff_max_ms=100,
        request_timeout_ms=5_000,
        delivery_timeout_ms=60_000,
        **extra,
    )


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_batches_refused_as_too_large_are_split_until_they_fit(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str, codec: str
) -> None:
    broker.create_topic(topic_name, PARTITIONS)
    proxy.set_max_message_bytes(3_000)  # batch_size is 16 KiB: up to three halvings
    rounds, rows = 6, 300
    values = [[os.urandom(40) + b"%d-%04d" % (r, i) for i in range(rows)] for r in range(rounds)]
    with _producer(proxy, compression_type=codec) as p:
        futures = [
            p.send_batch(topic_name, vals, keys=[b"k%d" % (i % 7) for i in range(rows)])
            for vals in values
        ]
        big = p.send(topic_name, os.urandom(3_500), partition=0)  # alone and too large
        small = p.send(topic_name, b"after the big one", partition=0)
        results = [f.result(timeout=60) for f in futures]
        with pytest.raises(KafkaError) as info:
            big.result(timeout=60)
        assert info.value.code == ec.MESSAGE_TOO_LARGE and not info.value.retriable
        after = small.result(timeout=60)
        split = p.stats()["sender"]["batches_split"]
    assert split > 0
    expected = rounds * rows + 1
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, expected, 60)
    where = {r.value: (r.partition, r.offset) for recs in landed.values() for r in recs}
    assert sum(len(v) for v in landed.values()) == expected == len(where), "lost or twice"
    for vals, md in zip(values, results, strict=True):
        for i, v in enumerate(vals):
            assert where[v] == (md.partitions[i], md.offsets[i])
    assert where[b"after the big one"] == (0, after.offset)
    for recs in landed.values():  # send order kept per partition
        order = [(r.value or b"")[40:] for r in recs if r.value != b"after the big one"]
        assert order == sorted(order, key=lambda v: tuple(int(x) for x in v.split(b"-")))


def test_unknown_producer_id_bumps_the_epoch_then_takes_a_new_id(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    """The sender bumps the epoch itself, as Java's idempotent producer does; tansu fences
    the bumped epoch (PRODUCER_FENCED), so the sender falls back to a new producer id.
    Every record lands once, in order."""
    broker.create_topic(topic_name, PARTITIONS)
    with _producer(proxy) as p:
        first = [p.send(topic_name, b"a-%03d" % i, partition=i % PARTITIONS) for i in range(60)]
        for f in first:
            f.result(timeout=30)
        proxy.fail_next(PRODUCE, ec.UNKNOWN_PRODUCER_ID, count=1)
        second = [p.send(topic_name, b"b-%03d" % i, partition=i % PARTITIONS) for i in range(60)]
        for f in second:
            f.result(timeout=30)
        stats = p.stats()["sender"]
    assert stats["epoch_bumps"] == 1
    assert stats["producer_id_resets"] == 1
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, 120, 60)
    values = [r.value for recs in landed.values() for r in recs]
    assert sorted(values) == sorted(
        [b"a-%03d" % i for i in range(60)] + [b"b-%03d" % i for i in range(60)]
    )
    for recs in landed.values():
        order = [r.value for r in recs]
        assert order == sorted(order)
