"""The fault-injecting proxy in front of the real test broker: tansu seen as 3 nodes."""

from __future__ import annotations

import contextlib
import socket
import struct
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from shmprod.broker import EmbeddedBroker
from shmprod.connection import BrokerConnection
from shmprod.errors import KafkaConnectionError
from shmprod.protocol.messages import ProduceResponse
from shmprod.protocol.records import NewRecord, encode_batch
from tests.support.kafka_proxy import METADATA, PRODUCE, KafkaProxy
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

HOST = "127.0.0.1"
NOT_LEADER_OR_FOLLOWER = 6


def _batch(prefix: str, n: int) -> bytes:
    records = [NewRecord(None, f"{prefix}-{i}".encode()) for i in range(n)]
    return encode_batch(records, base_timestamp_ms=int(time.time() * 1000))


def _errors(resp: ProduceResponse | None) -> dict[int, tuple[int, int]]:
    assert resp is not None
    return {
        p.index: (p.error_code, p.base_offset)
        for t in resp.responses
        for p in t.partition_responses
    }


def _producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 5,
            "reconnect.backoff.ms": 20,
            "reconnect.backoff.max.ms": 200,
            "message.timeout.ms": 15_000,
            "log_level": 3,
        }
    )


def _deliver(producer: Producer, topic: str, values: list[bytes], partitions: int) -> None:
    failures: list[object] = []

    def on_delivery(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(err)

    for i, v in enumerate(values):
        producer.produce(topic, v, partition=i % partitions, on_delivery=on_delivery)
    assert producer.flush(15) == 0
    assert not failures, failures


def test_metadata_shows_the_nodes_and_the_leader_spread(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 6)
    with BrokerConnection(HOST, proxy.port(1)) as conn:
        md = conn.metadata([topic_name])
    assert sorted((b.node_id, b.host, b.port) for b in md.brokers) == [
        (n, HOST, proxy.port(n)) for n in range(3)
    ]
    assert md.controller_id == 0
    (topic,) = md.topics
    assert {p.partition_index: p.leader_id for p in topic.partitions} == {
        p: p % 3 for p in range(6)
    }
    assert all(p.replica_nodes[0] == p.leader_id for p in topic.partitions)

    admin = AdminClient({"bootstrap.servers": proxy.address(2), "log_level": 3})
    cluster = admin.list_topics(topic_name, timeout=10)
    assert {b.id: b.port for b in cluster.brokers.values()} == {n: proxy.port(n) for n in range(3)}
    assert cluster.controller_id == 0
    parts = cluster.topics[topic_name].partitions
    assert {p: parts[p].leader for p in parts} == {p: p % 3 for p in range(6)}
    assert proxy.requests_seen(METADATA) >= 2


def test_confluent_produce_through_proxy_lands(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 3)
    values = [f"v{i}".encode() for i in range(30)]
    producer = _producer(proxy.address(0))
    _deliver(producer, topic_name, values, 3)
    assert proxy.requests_seen(PRODUCE) >= 1
    # each partition's leader is another node: the producer talked to all three
    assert all(proxy.connections(n) >= 1 for n in range(3))
    got = consume_all(proxy.bootstrap, topic_name, 3, len(values), timeout_s=15)
    assert sorted(r.value for rs in got.values() for r in rs) == sorted(values)
    assert all(len(got[p]) == 10 for p in range(3))


def test_fail_next_answers_not_leader_without_forwarding(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 1)
    proxy.fail_next(PRODUCE, NOT_LEADER_OR_FOLLOWER)
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        first = conn.produce({(topic_name, 0): _batch("lost", 2)})
        assert _errors(first) == {0: (NOT_LEADER_OR_FOLLOWER, -1)}
        second = conn.produce({(topic_name, 0): _batch("kept", 3)})
        # nothing landed for the failed request: the next batch starts the log
        assert _errors(second) == {0: (0, 0)}
    assert proxy.requests_seen(PRODUCE) == 2
    assert proxy.pending_failures() == 0
    got = consume_all(proxy.bootstrap, topic_name, 1, 3, timeout_s=10)
    assert [r.value for r in got[0]] == [f"kept-{i}".encode() for i in range(3)]


def test_fail_next_for_some_partitions_forwards_the_rest(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 2)
    proxy.fail_next(PRODUCE, NOT_LEADER_OR_FOLLOWER, partitions=[1])
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        resp = conn.produce({(topic_name, 0): _batch("a", 2), (topic_name, 1): _batch("b", 2)})
        assert _errors(resp) == {0: (0, 0), 1: (NOT_LEADER_OR_FOLLOWER, -1)}
        # one request only: the rule is used up
        resp = conn.produce({(topic_name, 1): _batch("c", 1)})
        assert _errors(resp) == {1: (0, 0)}
    got = consume_all(proxy.bootstrap, topic_name, 2, 3, timeout_s=10)
    assert [r.value for r in got[0]] == [b"a-0", b"a-1"]
    assert [r.value for r in got[1]] == [b"c-0"]


def test_drop_connections_makes_clients_reconnect(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 3)
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        conn.metadata([topic_name])
        assert proxy.drop_connections(node=0) == 1
        with pytest.raises(KafkaConnectionError):
            conn.metadata([topic_name])
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        assert conn.metadata([topic_name]).topics[0].name == topic_name

    producer = _producer(proxy.address(0))
    _deliver(producer, topic_name, [b"before"] * 3, 3)
    assert proxy.drop_connections() >= 1
    _deliver(producer, topic_name, [b"after"] * 3, 3)
    assert proxy.connections() >= 1  # librdkafka came back by itself
    got = consume_all(proxy.bootstrap, topic_name, 3, 6, timeout_s=15)
    assert sorted(r.value for rs in got.values() for r in rs) == [b"after"] * 3 + [b"before"] * 3


def test_take_down_refuses_then_bring_up_listens_again(
    broker: EmbeddedBroker, proxy: KafkaProxy
) -> None:
    with BrokerConnection(HOST, proxy.port(1)) as kept:
        kept.metadata([])
        proxy.take_down(1)
        assert not proxy.is_up(1)
        with pytest.raises(KafkaConnectionError):  # its connection was dropped
            kept.metadata([])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, proxy.port(1)), timeout=2).close()
    with BrokerConnection(HOST, proxy.port(0)) as other:  # the others still answer
        assert len(other.metadata([]).brokers) == 3
    proxy.bring_up(1)
    assert proxy.is_up(1)
    with BrokerConnection(HOST, proxy.port(1)) as back:
        assert len(back.metadata([]).brokers) == 3


def test_set_leader_changes_the_next_metadata(
    broker: EmbeddedBroker, proxy: KafkaProxy, topic_name: str
) -> None:
    broker.create_topic(topic_name, 2)
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        before = conn.metadata([topic_name]).topics[0].partitions
        assert [p.leader_id for p in before] == [0, 1]
        proxy.set_leader(topic_name, 0, 2)
        after = conn.metadata([topic_name]).topics[0].partitions
        assert [p.leader_id for p in after] == [2, 1]
        assert after[0].replica_nodes[0] == 2 and after[0].isr_nodes[0] == 2
        if before[0].leader_epoch >= 0:
            assert after[0].leader_epoch == before[0].leader_epoch + 1
    assert proxy.leader_of(topic_name, 0) == 2
    # a client following the move still delivers
    producer = _producer(proxy.address(1))
    _deliver(producer, topic_name, [b"moved"], 1)
    got = consume_all(proxy.bootstrap, topic_name, 2, 1, timeout_s=10)
    assert [r.value for r in got[0]] == [b"moved"]


def test_delay_and_stall_hold_a_node(proxy: KafkaProxy) -> None:
    with BrokerConnection(HOST, proxy.port(2)) as conn:
        conn.metadata([])
        proxy.delay_responses(2, 0.3)
        started = time.monotonic()
        conn.metadata([])
        assert time.monotonic() - started >= 0.3
        proxy.delay_responses(2, 0)
        proxy.stall(2, 0.3)
        started = time.monotonic()
        conn.metadata([])
        assert time.monotonic() - started >= 0.25
        started = time.monotonic()
        conn.metadata([])
        assert time.monotonic() - started < 0.25


def _frame(api_key: int, version: int, corr: int, body: bytes) -> bytes:
    client = b"raw"
    payload = struct.pack(">hhih", api_key, version, corr, len(client)) + client + body
    return struct.pack(">i", len(payload)) + payload


def _read_frame(sock: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
        chunk = sock.recv(65536)
        assert chunk, "closed"
        buf += chunk
    return buf[4:]


def test_unknown_requests_and_garbage_are_forwarded(proxy: KafkaProxy) -> None:
    # FindCoordinator (10) v0: an API the codec does not know, forwarded as it is
    group = b"g"
    with socket.create_connection((HOST, proxy.port(0)), timeout=5) as sock:
        sock.sendall(_frame(10, 0, 77, struct.pack(">h", len(group)) + group))
        answer = _read_frame(sock)
    assert struct.unpack_from(">i", answer)[0] == 77
    assert proxy.requests_seen(10) == 1
    # a stream that cannot be framed: forwarded, and the proxy carries on
    with socket.create_connection((HOST, proxy.port(0)), timeout=5) as sock:
        sock.sendall(struct.pack(">i", -5) + b"junk")
        sock.settimeout(2)
        with contextlib.suppress(OSError):  # timed out or reset: either is fine
            sock.recv(100)
    with BrokerConnection(HOST, proxy.port(0)) as conn:
        assert len(conn.metadata([]).brokers) == 3
