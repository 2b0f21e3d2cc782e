"""``shmprod demo``: export a generated sample data set through a real broker and verify it.

The job: generate a clickstream-like table (user keys, JSON values, event timestamps),
partition it with Java's murmur2, encode one compressed RecordBatch v2 per partition
chunk with the vectorized column encoder, send the batches in ProduceRequests (one batch
per partition per request, several requests in flight), then read every partition back
with Fetch and compare key, value and timestamp of every record. Progress goes to
stderr; the report to stdout and to a JSON file.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from shmprod.broker import EmbeddedBroker
from shmprod.connection import BrokerConnection, parse_bootstrap
from shmprod.errors import KafkaError, ShmprodError
from shmprod.partitioner import partitions_for_keys
from shmprod.protocol import compression as codecs
from shmprod.protocol.messages import ProduceResponse
from shmprod.protocol.records import iter_batches
from shmprod.protocol.vectorized import iter_encoded_batches

_ACTIONS = np.array(["view", "click", "add_to_cart", "purchase", "search"], dtype=object)


def make_sample_dataset(rows: int, value_size: int = 100, seed: int = 7) -> pa.Table:
    """A clickstream-like table: ``key`` (user id), ``value`` (JSON), ``timestamp_ms``.

    Built with Arrow compute, column at a time: no per-row Python.
    """
    if rows < 1:
        raise ShmprodError(f"the demo needs at least one record, got {rows}")
    rng = np.random.default_rng(seed)
    users = pc.cast(pa.array(rng.integers(0, max(1, rows // 20), rows)), pa.string())
    actions = pa.array(_ACTIONS[rng.integers(0, len(_ACTIONS), rows)], pa.string())
    amounts = pc.cast(pa.array(rng.integers(0, 100_000, rows)), pa.string())
    event_ids = pc.cast(pa.array(np.arange(rows)), pa.string())
    key = pc.binary_join_element_wise("user-", users, "")
    body = pc.binary_join_element_wise(
        '{"event_id":',
        event_ids,
        ',"user":"user-',
        users,
        '","action":"',
        actions,
        '","amount_cents":',
        amounts,
        ',"pad":"',
        "",
    )
    # Pad each value to about ``value_size`` bytes (never below the JSON itself).
    pad_len = np.maximum(0, value_size - 2 - pc.binary_length(body).to_numpy())
    pad_offsets = np.concatenate([[0], np.cumsum(pad_len)]).astype(np.int32)
    pad_data = np.full(int(pad_offsets[-1]), ord("x"), dtype=np.uint8)
    pad = pa.Array.from_buffers(
        pa.string(), rows, [None, pa.py_buffer(pad_offsets), pa.py_buffer(pad_data)]
    )
    value = pc.binary_join_element_wise(body, pad, '"}', "")
    base_ts = 1_700_000_000_000
    ts = base_ts + np.sort(rng.integers(0, 3_600_000, rows)).astype(np.int64)
    return pa.table(
        {
            "key": pc.cast(key, pa.binary()),
            "value": pc.cast(value, pa.binary()),
            "timestamp_ms": pa.array(ts),
        }
    )


@dataclass
class DemoReport:
    """What the demo did and found; written as JSON."""

    bootstrap: str
    topic: str
    partitions: int
    compression: str
    records: int
    value_bytes: int
    batches: int = 0
    requests: int = 0
    encode_s: float = 0.0
    produce_s: float = 0.0
    verify_s: float = 0.0
    records_per_s: float = 0.0
    mb_per_s: float = 0.0
    records_read_back: int = 0
    mismatches: int = 0
    per_partition: dict[int, int] = field(default_factory=dict)
    ok: bool = False


class _Progress:
    """One self-rewriting line on stderr, at most ten updates a second."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.enabled = enabled and total > 0
        self.total = total
        self.what = what
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, done: int, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        rate = done / max(now - self.start, 1e-9)
        pct = 100.0 * done / self.total
        sys.stderr.write(
            f"\r  {self.what}: {done:>10,}/{self.total:,} ({pct:5.1f}%) {rate:>12,.0f}/s"
        )
        sys.stderr.flush()

    def finish(self, done: int) -> None:
        self.update(done, force=True)
        if self.enabled:
            sys.stderr.write("\n")


def _encode_partitions(
    table: pa.Table, parts: npt.NDArray[np.int32], partitions: int, batch_bytes: int, codec: int
) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Each partition's rows, in input order, as compressed batches of ``batch_bytes``.

    Returns ``(partition, batch)`` pairs and each batch's record count. Column at a time:
    one stable argsort groups the rows, the vectorized encoder does the rest.
    """
    order = np.argsort(parts, kind="stable")
    bounds = np.searchsorted(parts[order], np.arange(partitions + 1))
    ts = table["timestamp_ms"].to_numpy()
    encoded: list[tuple[int, bytes]] = []
    counts: list[int] = []
    for p in range(partitions):
        rows = order[bounds[p] : bounds[p + 1]]
        if not len(rows):
            continue
        idx = pa.array(rows)
        for batch in iter_encoded_batches(
            pc.take(table["value"], idx),
            pc.take(table["key"], idx),
            ts[rows],
            batch_size=batch_bytes,
        ):
            encoded.append((p, batch.to_bytes(compression=codec)))
            counts.append(batch.record_count)
    return encoded, counts


def _produce_all(
    conn: BrokerConnection,
    topic: str,
    encoded: list[tuple[int, bytes]],
    progress: _Progress,
    counts: list[int],
    *,
    max_request_bytes: int = 1 << 20,
    in_flight: int = 5,
) -> int:
    """Sends every batch, one per partition per request, up to ``in_flight`` requests."""
    queues: dict[int, deque[tuple[int, bytes]]] = {}
    for i, (p, batch) in enumerate(encoded):
        queues.setdefault(p, deque()).append((i, batch))
    pending: deque[tuple[int, list[int]]] = deque()
    requests = done = 0

    def reap() -> None:
        nonlocal done
        corr, ids = pending.popleft()
        resp = conn.receive(corr, ProduceResponse)
        for t in resp.responses:
            for pr in t.partition_responses:
                if pr.error_code:
                    raise KafkaError(pr.error_code, f"producing to {t.name}[{pr.index}]")
        done += sum(counts[i] for i in ids)
        progress.update(done)

    while queues:
        batches: dict[tuple[str, int], bytes] = {}
        ids: list[int] = []
        size = 0
        for p in list(queues):
            i, batch = queues[p][0]
            if batches and size + len(batch) > max_request_bytes:
                continue
            queues[p].popleft()
            if not queues[p]:
                del queues[p]
            batches[(topic, p)] = batch
            ids.append(i)
            size += len(batch)
        if len(pending) >= in_flight:
            reap()
        pending.append((conn.send(conn.produce_request(batches)), ids))
        requests += 1
    while pending:
        reap()
    progress.finish(done)
    return requests


def _read_back(
    conn: BrokerConnection,
    topic: str,
    expected: dict[int, int],
    progress: _Progress,
    timeout_s: float,
) -> dict[int, list[tuple[bytes | None, bytes | None, int]]]:
    """Every record of every partition, in offset order, until ``expected`` counts are met."""
    got: dict[int, list[tuple[bytes | None, bytes | None, int]]] = {p: [] for p in expected}
    offsets = {(topic, p): 0 for p in expected if expected[p]}
    deadline = time.monotonic() + timeout_s
    total = 0
    while offsets and time.monotonic() < deadline:
        resp = conn.fetch(offsets)
        for t in resp.responses:
            for part in t.partitions:
                if part.error_code:
                    raise KafkaError(part.error_code, f"fetching {t.topic}[{part.partition_index}]")
                key = (t.topic, part.partition_index)
                if key not in offsets or not part.records:
                    continue
                for batch in iter_batches(part.records, allow_truncated_tail=True):
                    for rec in batch.records:
                        if rec.offset < offsets[key]:
                            continue
                        got[part.partition_index].append((rec.key, rec.value, rec.timestamp_ms))
                        offsets[key] = rec.offset + 1
                        total += 1
                if len(got[part.partition_index]) >= expected[part.partition_index]:
                    del offsets[key]
        progress.update(total)
    progress.finish(total)
    return got


def run_demo(
    *,
    records: int = 200_000,
    value_size: int = 100,
    partitions: int = 8,
    compression: str = "lz4",
    bootstrap: str | None = None,
    report_path: str | None = None,
    progress: bool = True,
    batch_bytes: int = 256 << 10,
) -> int:
    """Runs the demo; returns 0 when every record came back exactly as sent."""
    broker = None if bootstrap else EmbeddedBroker().start()
    try:
        servers = bootstrap or (broker.bootstrap if broker else "")
        host, port = parse_bootstrap(servers)[0]
        codec = codecs.codec_id(compression)
        topic = f"shmprod-demo-{int(time.time() * 1000)}"

        def log(line: str) -> None:
            if progress:
                print(line, file=sys.stderr, flush=True)

        log(
            f"shmprod demo: broker {servers}, topic {topic} ({partitions} partitions), {compression}"
        )
        t0 = time.monotonic()
        table = make_sample_dataset(records, value_size)
        log(
            f"  generated {records:,} records ({table.nbytes / 1e6:.1f} MB) in {time.monotonic() - t0:.2f}s"
        )

        with BrokerConnection(host, port, client_id="shmprod-demo") as conn:
            errors = conn.create_topics({topic: partitions})
            if errors.get(topic, 0) not in (0, 36):
                raise KafkaError(errors[topic], f"creating topic {topic}")

            t0 = time.monotonic()
            parts = partitions_for_keys(table["key"], partitions)
            encoded, counts = _encode_partitions(table, parts, partitions, batch_bytes, codec)
            encode_s = time.monotonic() - t0

            t0 = time.monotonic()
            n_requests = _produce_all(
                conn, topic, encoded, _Progress(progress, records, "produced"), counts
            )
            produce_s = time.monotonic() - t0

            expected = {p: int(n) for p, n in enumerate(np.bincount(parts, minlength=partitions))}
            t0 = time.monotonic()
            got = _read_back(conn, topic, expected, _Progress(progress, records, "read back"), 60.0)
            mismatches = _compare(table, parts, got)
            verify_s = time.monotonic() - t0

        value_bytes = int(pc.sum(pc.binary_length(table["value"])).as_py())
        read = sum(len(v) for v in got.values())
        report = DemoReport(
            bootstrap=servers,
            topic=topic,
            partitions=partitions,
            compression=compression,
            records=records,
            value_bytes=value_bytes,
            batches=len(encoded),
            requests=n_requests,
            encode_s=round(encode_s, 4),
            produce_s=round(produce_s, 4),
            verify_s=round(verify_s, 4),
            records_per_s=round(records / max(encode_s + produce_s, 1e-9)),
            mb_per_s=round(value_bytes / 1e6 / max(encode_s + produce_s, 1e-9), 1),
            records_read_back=read,
            mismatches=mismatches,
            per_partition={p: len(v) for p, v in got.items()},
            ok=mismatches == 0 and read == records,
        )
        _print_report(report)
        if report_path:
            with open(report_path, "w", encoding="utf-8") as fh:
                json.dump(asdict(report), fh, indent=2)
            print(f"report written to {report_path}")
        return 0 if report.ok else 1
    finally:
        if broker is not None:
            broker.stop()


def _compare(
    table: pa.Table,
    parts: npt.NDArray[np.int32],
    got: dict[int, list[tuple[bytes | None, bytes | None, int]]],
) -> int:
    """Records that differ from what was sent (per partition, in send order), plus missing."""
    keys = table["key"].to_pylist()
    values = table["value"].to_pylist()
    ts = table["timestamp_ms"].to_pylist()
    bad = 0
    for p, received in got.items():
        rows = np.flatnonzero(parts == p)
        bad += abs(len(rows) - len(received))
        for r, (k, v, t) in zip(rows.tolist(), received, strict=False):
            if (k, v, t) != (keys[r], values[r], ts[r]):
                bad += 1
    return bad


def _print_report(r: DemoReport) -> None:
    status = "OK: every record read back byte for byte" if r.ok else "FAILED"
    rows: list[tuple[str, Any]] = [
        ("records", f"{r.records:,} ({r.value_bytes / 1e6:.1f} MB of values)"),
        ("topic", f"{r.topic} ({r.partitions} partitions)"),
        ("compression", r.compression),
        ("batches / requests", f"{r.batches:,} / {r.requests:,}"),
        ("encode", f"{r.encode_s:.3f}s"),
        ("produce", f"{r.produce_s:.3f}s"),
        ("throughput", f"{r.records_per_s:,.0f} records/s, {r.mb_per_s:.1f} MB/s"),
        ("read back", f"{r.records_read_back:,} records in {r.verify_s:.2f}s"),
        ("per partition", ", ".join(f"{p}:{n:,}" for p, n in r.per_partition.items())),
        ("mismatches", r.mismatches),
        ("result", status),
    ]
    width = max(len(k) for k, _ in rows)
    print("shmprod demo report")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
