"""The producer under each acks, linger, value size and compression setting.

Each case sends through ``send`` and ``send_batch`` and has confluent-kafka read the
topic back: keys, values, headers and timestamps must match at the offsets the futures
reported (acks=0 reports no offsets: then the records are matched by value).
"""

from __future__ import annotations

import itertools

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

_topics = itertools.count()


def _roundtrip(broker: EmbeddedBroker, records: int, value_size: int, **options: object) -> None:
    topic = f"matrix-{next(_topics)}"
    partitions = 3
    broker.create_topic(topic, partitions)
    sent: dict[bytes, tuple[bytes | None, list[tuple[str, bytes]], int]] = {}
    with Producer(bootstrap_servers=broker.bootstrap, **options) as p:  # type: ignore[arg-type]
        futures = []
        for i in range(records):
            value = b"%06d" % i + b"\xab" * max(0, value_size - 6) if value_size else b""
            key = None if i % 4 == 0 else b"k%d" % i
            headers = [("n", b"%d" % i)]
            ts = 1_700_000_000_000 + i
            futures.append(p.send(topic, value, key=key, headers=headers, timestamp_ms=ts))
            sent[b"%d" % i] = (key, headers, ts)
        batch_values = [b"b%06d" % i + b"\xcd" * max(0, value_size - 7) for i in range(records)]
        bfut = p.send_batch(topic, batch_values, keys=[b"bk%d" % i for i in range(records)])
        p.flush(timeout=60)
        mds = [f.result(timeout=30) for f in futures]
        bmd = bfut.result(timeout=30)
    landed = consume_all(broker.bootstrap, topic, partitions, 2 * records, 60)
    got = [rec for recs in landed.values() for rec in recs]
    assert len(got) == 2 * records
    singles = [r for r in got if r.headers]
    assert len(singles) == records
    for rec in singles:
        n = dict(rec.headers)["n"]
        assert n is not None
        key, headers, ts = sent[n]
        assert (rec.key, list(rec.headers), rec.timestamp_ms) == (key, headers, ts)
        if value_size:
            assert rec.value is not None and rec.value.startswith(b"%06d" % int(n))
            assert len(rec.value) == value_size
        else:
            assert rec.value == b""
        md = mds[int(n)]
        assert md.partition == rec.partition
        if options.get("acks") != 0:
            assert md.offset == rec.offset
    by_value = {r.value: r for r in got if not r.headers}
    for i, value in enumerate(batch_values):
        rec = by_value[value]
        assert rec.key == b"bk%d" % i
        assert bmd.partitions[i] == rec.partition
        if options.get("acks") != 0:
            assert bmd.offsets[i] == rec.offset


@pytest.mark.parametrize("acks", [0, 1, "all"])
def test_acks(broker: EmbeddedBroker, acks: object) -> None:
    _roundtrip(broker, 300, 50, acks=acks, enable_idempotence=acks == "all", linger_ms=5)


@pytest.mark.parametrize("linger_ms", [0, 100])
def test_linger(broker: EmbeddedBroker, linger_ms: int) -> None:
    _roundtrip(broker, 300, 50, linger_ms=linger_ms)


@pytest.mark.parametrize("value_size", [0, 900 * 1024])
def test_value_sizes(broker: EmbeddedBroker, value_size: int) -> None:
    _roundtrip(broker, 4 if value_size else 200, value_size, linger_ms=5)


@pytest.mark.parametrize("compression", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_compression(broker: EmbeddedBroker, compression: str) -> None:
    _roundtrip(broker, 300, 120, compression_type=compression, linger_ms=5)
