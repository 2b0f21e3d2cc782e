"""Reads a topic back with confluent-kafka's Consumer: a client shmprod did not write."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition


@dataclass(frozen=True)
class Landed:
    """One record as confluent-kafka read it."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int


def consume_all(
    bootstrap: str,
    topic: str,
    partitions: int,
    expected: int,
    timeout_s: float = 60.0,
    config: Mapping[str, Any] | None = None,
    extra_wait_s: float = 0.0,
) -> dict[int, list[Landed]]:
    """Every record of ``topic`` by partition, in offset order; stops at ``expected`` records.

    Bounded by ``timeout_s``: returns what it has then (the caller's counts will show it).
    ``config`` adds librdkafka options (``security.protocol``, ``ssl.ca.location``,
    ``sasl.mechanism``, ...) to the consumer's. ``extra_wait_s``: after ``expected``
    records, keep reading that long, so a caller can see records beyond those it expected.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"readback-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 50,
            "log_level": 3,
            **(config or {}),
        }
    )
    out: dict[int, list[Landed]] = {p: [] for p in range(partitions)}
    got = 0
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        settle: float | None = None
        while time.monotonic() < deadline:
            if got >= expected:
                settle = time.monotonic() + extra_wait_s if settle is None else settle
                if time.monotonic() >= settle:
                    break
            for msg in consumer.consume(num_messages=10_000, timeout=0.2):
                err = msg.error()
                if err is not None:
                    raise KafkaException(err)
                _, ts = msg.timestamp()
                headers = tuple((k, v) for k, v in (msg.headers() or ()))
                out[msg.partition()].append(
                    Landed(msg.partition(), msg.offset(), msg.key(), msg.value(), headers, ts)
                )
                got += 1
    finally:
        consumer.close()
    return out
