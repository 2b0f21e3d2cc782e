"""Interop: batches encoded by shmprod, sent on its own connection, read by confluent-kafka.

For every codec, 10,000 random records (null and empty keys and values, 0-3 headers with
null values, explicit timestamps) go to a 4-partition topic on the embedded broker, half
through the per-record encoder and half through the vectorized column encoder. What
confluent-kafka reads back must match byte for byte: key, value, headers, timestamp,
partition, and offset order (each offset = the batch's base offset + record index).
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from shmprod import speedups
from shmprod.broker import EmbeddedBroker
from shmprod.connection import BrokerConnection
from shmprod.partitioner import partition_for_key
from shmprod.protocol import compression as codecs
from shmprod.protocol.records import HEADER_SIZE, BatchSettings, NewRecord, encode_batch
from shmprod.protocol.vectorized import encode_columns
from shmprod.worker.direct import Source, plan
from tests.support.readback import consume_all

pytestmark = pytest.mark.broker

RECORDS = 10_000
PARTITIONS = 4
BATCH_RECORDS = 250


def _random_bytes(rng: random.Random, max_len: int) -> bytes | None:
    roll = rng.random()
    if roll < 0.08:
        return None
    if roll < 0.15:
        return b""
    return rng.randbytes(rng.randint(1, max_len))


def _random_records(rng: random.Random, n: int) -> list[NewRecord]:
    base = 1_700_000_000_000
    out = []
    for _ in range(n):
        headers = [
            (
                rng.choice(["h", "trace-id", "ключ", "x" * rng.randint(1, 20)]),
                _random_bytes(rng, 30),
            )
            for _ in range(rng.randint(0, 3))
        ]
        out.append(
            NewRecord(
                key=_random_bytes(rng, 40),
                value=_random_bytes(rng, 400),
                headers=headers,
                timestamp_ms=base + rng.randint(-10_000_000, 10_000_000),
            )
        )
    return out


def _vectorized(chunk: list[NewRecord], codec: int) -> bytes:
    """The same records through the column encoder (per-row headers take its slow path)."""
    return encode_columns(
        pa.array([r.value for r in chunk], pa.binary()),
        keys=pa.array([r.key for r in chunk], pa.binary()),
        timestamps_ms=[r.timestamp_ms for r in chunk],
        headers=[list(r.headers) for r in chunk],
        settings=BatchSettings(codec),
    )


@pytest.mark.parametrize("codec_name", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_confluent_reads_what_shmprod_wrote(
    broker: EmbeddedBroker, topic_name: str, codec_name: str
) -> None:
    codec = codecs.codec_id(codec_name)
    rng = random.Random(f"interop-{codec_name}")
    records = _random_records(rng, RECORDS)
    by_partition: dict[int, list[NewRecord]] = {p: [] for p in range(PARTITIONS)}
    for i, rec in enumerate(records):
        p = i % PARTITIONS if rec.key is None else partition_for_key(rec.key, PARTITIONS)
        by_partition[p].append(rec)

    expected: dict[int, list[tuple[int, NewRecord]]] = {p: [] for p in range(PARTITIONS)}
    with BrokerConnection(broker.host, broker.port) as conn:
        assert conn.create_topics({topic_name: PARTITIONS}) == {topic_name: 0}
        for start in range(0, max(len(v) for v in by_partition.values()), BATCH_RECORDS):
            batches: dict[tuple[str, int], bytes] = {}
            chunks: dict[int, list[NewRecord]] = {}
            for p, recs in by_partition.items():
                chunk = recs[start : start + BATCH_RECORDS]
                if not chunk:
                    continue
                chunks[p] = chunk
                vectorized = (start // BATCH_RECORDS) % 2 == 1
                batches[(topic_name, p)] = (
                    _vectorized(chunk, codec)
                    if vectorized
                    else encode_batch(
                        chunk,
                        base_timestamp_ms=chunk[0].timestamp_ms or 0,
                        settings=BatchSettings(codec),
                    )
                )
            resp = conn.produce(batches)
            assert resp is not None
            for t in resp.responses:
                for pr in t.partition_responses:
                    assert pr.error_code == 0, pr
                    for i, rec in enumerate(chunks[pr.index]):
                        expected[pr.index].append((pr.base_offset + i, rec))

    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, RECORDS)
    assert sum(len(v) for v in landed.values()) == RECORDS
    for p in range(PARTITIONS):
        got = landed[p]
        want = expected[p]
        assert len(got) == len(want), f"partition {p}"
        for g, (offset, rec) in zip(got, want, strict=True):
            assert g.partition == p
            assert g.offset == offset
            assert g.key == rec.key
            assert g.value == rec.value
            assert list(g.headers) == [(k, v) for k, v in rec.headers]
            assert g.timestamp_ms == rec.timestamp_ms


@pytest.mark.skipif(not speedups.ACCELERATED, reason="the C extension is not in use")
def test_confluent_reads_lz4_frames_of_one_stored_block_of_every_size(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """Incompressible rows a worker writes straight into the pool after another such
    batch stay where they are as one stored lz4 block; the frame header names the
    smallest maximum block size that holds them (64 KiB, 256 KiB, 1 MiB, 4 MiB). A
    reader we did not write must take each of the four."""
    rng = random.Random("one-block")
    counts = {0: 40, 1: 200, 2: 900, 3: 3000}  # 1 KB rows: ~41 KB, 206 KB, 925 KB, 3 MB
    lz4 = BatchSettings(codecs.LZ4)
    batches: dict[tuple[str, int], bytes] = {}
    sent: dict[int, list[tuple[bytes, bytes, int]]] = {}
    for p, n in counts.items():
        rows = [(rng.randbytes(16), rng.randbytes(1000), 1_700_000_000_000 + i) for i in range(n)]
        keys, values, stamps = (list(c) for c in zip(*rows, strict=True))
        ((_, batch),) = plan(Source(values, keys, stamps, b"\x00"), None, [(p, 0, n)], 1 << 23)
        buf = bytearray(HEADER_SIZE + codecs.compress_bound(codecs.LZ4, batch.section_size))
        batch.write_into(memoryview(buf), 0, settings=lz4)  # stored: the next goes in place
        end = batch.write_into(memoryview(buf), 0, settings=lz4)
        frame = bytes(buf[HEADER_SIZE:end])
        assert frame[5] == (0x40, 0x50, 0x60, 0x70)[p]
        assert len(frame) == batch.section_size + 15  # one stored block
        batches[(topic_name, p)] = bytes(buf[:end])
        sent[p] = rows
    with BrokerConnection(broker.host, broker.port) as conn:
        assert conn.create_topics({topic_name: len(counts)}) == {topic_name: 0}
        resp = conn.produce(batches)
        assert resp is not None
        for t in resp.responses:
            for pr in t.partition_responses:
                assert (pr.error_code, pr.base_offset) == (0, 0), pr
    landed = consume_all(broker.bootstrap, topic_name, len(counts), sum(counts.values()))
    for p, rows in sent.items():
        got = [(g.key, g.value, g.timestamp_ms, g.offset) for g in landed[p]]
        assert got == [(k, v, ts, i) for i, (k, v, ts) in enumerate(rows)], f"partition {p}"
