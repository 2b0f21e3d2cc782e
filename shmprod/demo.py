"""``shmprod demo``: export a generated data set through the shared producer and verify it.

The job: a pool of worker processes (started by spawn: fresh interpreters) attaches to
ONE producer by its handle. Each worker generates its slice of a clickstream-like table
(user keys, JSON values, event timestamps) and hands it to ``send_batch`` as Arrow
columns: partitioned with Java's murmur2, encoded and compressed straight into shared
memory, sent by the one sender process. The parent shows progress from the producer's
shared counters, then reads every partition back with Fetch and checks key, value,
timestamp, partition and offset of every record against what the futures reported.
Progress goes to stderr; the report to stdout and to a JSON file.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from shmprod.broker import EmbeddedBroker
from shmprod.config import parse_bootstrap
from shmprod.connection import BrokerConnection
from shmprod.errors import KafkaError, ShmprodError
from shmprod.handle import Handle
from shmprod.producer import Producer
from shmprod.protocol.records import iter_batches
from shmprod.worker import Worker, attach

_ACTIONS = np.array(["view", "click", "add_to_cart", "purchase", "search"], dtype=object)


def make_sample_dataset(
    rows: int, value_size: int = 100, seed: int = 7, start: int = 0
) -> pa.Table:
    """A clickstream-like table: ``key`` (user id), ``value`` (JSON), ``timestamp_ms``.

    Rows ``start .. start+rows-1`` of a data set that is the same whichever way it is
    sliced into parts (each part is seeded by its ``start``). Built with Arrow compute,
    column at a time: no per-row Python.
    """
    if rows < 1:
        raise ShmprodError(f"the demo needs at least one record, got {rows}")
    rng = np.random.default_rng([seed, start])
    users = pc.cast(pa.array(rng.integers(0, 10_000, rows)), pa.string())
    actions = pa.array(_ACTIONS[rng.integers(0, len(_ACTIONS), rows)], pa.string())
    amounts = pc.cast(pa.array(rng.integers(0, 100_000, rows)), pa.string())
    event_ids = pc.cast(pa.array(np.arange(start, start + rows)), pa.string())
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
    ts = base_ts + start + np.arange(rows, dtype=np.int64)
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
    workers: int = 0
    batches: int = 0
    requests: int = 0
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


_worker: Worker | None = None


def _attach_in_pool(handle: Handle) -> None:
    """Pool initializer: this worker process attaches to the shared producer once."""
    global _worker
    _worker = attach(handle)


def _export_slice(job: tuple[str, int, int, int]) -> tuple[int, npt.NDArray[Any], npt.NDArray[Any]]:
    """Runs in a pool worker: generates rows ``start..start+rows-1`` and sends them.

    Returns where they landed: (start, partitions, offsets), in row order.
    """
    topic, start, rows, value_size = job
    assert _worker is not None, "the pool initializer did not attach"
    table = make_sample_dataset(rows, value_size, start=start)
    fut = _worker.send_batch(
        topic,
        table["value"],
        keys=table["key"],
        timestamps_ms=table["timestamp_ms"].to_numpy(),
    )
    md = fut.result(timeout=300)
    return start, md.partitions, md.offsets


def _close_in_pool(_: int) -> int:
    """Runs in a pool worker: detaches (flushes first)."""
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None
    return 0


def _read_back(
    conn: BrokerConnection,
    topic: str,
    expected: dict[int, int],
    progress: _Progress,
    timeout_s: float,
) -> dict[int, list[tuple[int, bytes | None, bytes | None, int]]]:
    """Every record (offset, key, value, timestamp) of every partition, in offset order, until ``expected`` counts are met."""
    got: dict[int, list[tuple[int, bytes | None, bytes | None, int]]] = {p: [] for p in expected}
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
                        got[part.partition_index].append(
                            (rec.offset, rec.key, rec.value, rec.timestamp_ms)
                        )
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
    workers: int = 4,
    slice_rows: int = 25_000,
) -> int:
    """Runs the demo; returns 0 when every record came back exactly as sent."""
    broker = None if bootstrap else EmbeddedBroker().start()
    try:
        servers = bootstrap or (broker.bootstrap if broker else "")
        host, port = parse_bootstrap(servers)[0]
        topic = f"shmprod-demo-{int(time.time() * 1000)}"

        def log(line: str) -> None:
            if progress:
                print(line, file=sys.stderr, flush=True)

        log(
            f"shmprod demo: {records:,} records, {workers} worker processes, one producer; "
            f"broker {servers}, topic {topic} ({partitions} partitions), {compression}"
        )
        with BrokerConnection(host, port, client_id="shmprod-demo") as conn:
            errors = conn.create_topics({topic: partitions})
            if errors.get(topic, 0) not in (0, 36):
                raise KafkaError(errors[topic], f"creating topic {topic}")

        jobs = [
            (topic, start, min(slice_rows, records - start), value_size)
            for start in range(0, records, slice_rows)
        ]
        parts = np.full(records, -1, np.int32)
        offsets = np.full(records, -1, np.int64)
        t0 = time.monotonic()
        with Producer(
            bootstrap_servers=servers, compression_type=compression, linger_ms=5
        ) as producer:
            bar = _Progress(progress, records, "acknowledged")
            ctx = mp.get_context("spawn")
            with ctx.Pool(
                workers, initializer=_attach_in_pool, initargs=(producer.handle,)
            ) as pool:
                pending = pool.imap_unordered(_export_slice, jobs)
                done = 0
                for start, p_arr, o_arr in pending:
                    parts[start : start + len(p_arr)] = p_arr
                    offsets[start : start + len(o_arr)] = o_arr
                    done += len(o_arr)
                    bar.update(done)
                bar.finish(done)
                pool.map(_close_in_pool, range(workers))
            produce_s = time.monotonic() - t0
            sender = producer.stats()["sender"]

        expected = {p: int(n) for p, n in enumerate(np.bincount(parts, minlength=partitions))}
        t0 = time.monotonic()
        with BrokerConnection(host, port, client_id="shmprod-demo") as conn:
            got = _read_back(conn, topic, expected, _Progress(progress, records, "read back"), 60.0)
        table = pa.concat_tables(
            [make_sample_dataset(rows, value_size, start=start) for _, start, rows, _ in jobs]
        )
        mismatches = _compare(table, parts, offsets, got)
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
            workers=workers,
            batches=int(sender.get("batches_sent", 0)),
            requests=int(sender.get("requests_sent", 0)),
            produce_s=round(produce_s, 4),
            verify_s=round(verify_s, 4),
            records_per_s=round(records / max(produce_s, 1e-9)),
            mb_per_s=round(value_bytes / 1e6 / max(produce_s, 1e-9), 1),
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
    offsets: npt.NDArray[np.int64],
    got: dict[int, list[tuple[int, bytes | None, bytes | None, int]]],
) -> int:
    """Rows whose record is missing or differs at the (partition, offset) its future gave."""
    keys = table["key"].to_pylist()
    values = table["value"].to_pylist()
    ts = table["timestamp_ms"].to_pylist()
    landed = {(p, rec[0]): rec[1:] for p, recs in got.items() for rec in recs}
    if len(landed) != sum(len(recs) for recs in got.values()):
        return len(keys)  # an offset read twice: the log is not what was sent
    bad = abs(len(landed) - len(keys))
    for r in range(len(keys)):
        if landed.get((int(parts[r]), int(offsets[r]))) != (keys[r], values[r], ts[r]):
            bad += 1
    return bad


def _print_report(r: DemoReport) -> None:
    status = "OK: every record read back byte for byte" if r.ok else "FAILED"
    rows: list[tuple[str, Any]] = [
        ("records", f"{r.records:,} ({r.value_bytes / 1e6:.1f} MB of values)"),
        ("topic", f"{r.topic} ({r.partitions} partitions)"),
        ("compression", r.compression),
        ("worker processes", f"{r.workers} (spawned), one shared producer"),
        ("batches / requests", f"{r.batches:,} / {r.requests:,}"),
        ("export", f"{r.produce_s:.3f}s (start-up of the pool included)"),
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
