"""End-to-end throughput: shmprod (one shared producer) vs confluent-kafka (one per process).

For 1, 2 and 4 worker processes sharing one run's records (1.2 M of them, 100-byte
values, 16-byte keys) to a 12-partition topic on a fresh embedded broker, measures
records/s from a common start (every producer already connected) until every record is
acknowledged:

- ``shmprod send``: one ``send()`` per record, through a handle attached in each worker;
- ``shmprod send_batch``: the same records as Arrow columns, ``send_batch`` per chunk;
- ``confluent-kafka``: one ``confluent_kafka.Producer`` per worker, ``produce()`` per record.

Same guarantees for all: acks=all, idempotence on, no compression, linger 5 ms.
Every configuration runs ``--repeat`` times (3; the kinds interleaved, so drift of the
machine hits them alike) and the median is reported with the lowest and highest run:
single runs on two shared cores vary by tens of percent.
Results: ``bench/results/e2e.json`` and ``.md`` (``--quick``: ``e2e-quick.*``).
Run alone: the machine has two cores and every worker competes with the broker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa

from shmprod import Producer, attach
from shmprod.broker import EmbeddedBroker
from shmprod.handle import Handle

TOPIC = "bench"
PARTITIONS = 12
VALUE_SIZE = 100
CHUNK = 50_000


def _columns(worker: int, n: int) -> tuple[pa.Array, pa.Array]:
    """n 100-byte values and 16-byte keys, different per worker, built without Python loops."""
    rng = np.random.default_rng(worker)
    values = rng.integers(0, 256, n * VALUE_SIZE, dtype=np.uint8)
    keys = rng.integers(0, 256, n * 16, dtype=np.uint8)
    voff = np.arange(0, (n + 1) * VALUE_SIZE, VALUE_SIZE, dtype=np.int32)
    koff = np.arange(0, (n + 1) * 16, 16, dtype=np.int32)
    return (
        pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(voff), pa.py_buffer(values)]),
        pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(koff), pa.py_buffer(keys)]),
    )


def _run_shmprod(handle: Handle, worker: int, n: int, mode: str, barrier: Any, out: Any) -> None:
    values, keys = _columns(worker, n)
    w = attach(handle)
    try:
        if mode == "send":
            vlist = values.to_pylist()
            klist = keys.to_pylist()
        barrier.wait(120)
        t0 = time.perf_counter()
        if mode == "send":
            send = w.send
            for v, k in zip(vlist, klist, strict=True):
                send(TOPIC, v, key=k)
        else:
            for start in range(0, n, CHUNK):
                w.send_batch(TOPIC, values[start : start + CHUNK], keys=keys[start : start + CHUNK])
        w.flush(timeout=600)
        out.put((t0, time.perf_counter()))
    finally:
        w.close()


def _run_confluent(bootstrap: str, worker: int, n: int, barrier: Any, out: Any) -> None:
    from confluent_kafka import Producer as CKProducer

    values, keys = _columns(worker, n)
    vlist = values.to_pylist()
    klist = keys.to_pylist()
    p = CKProducer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "none",
            "log_level": 3,
        }
    )
    p.list_topics(TOPIC, timeout=30)  # connected and metadata known before the clock starts
    barrier.wait(120)
    t0 = time.perf_counter()
    produce = p.produce
    for v, k in zip(vlist, klist, strict=True):
        while True:
            try:
                produce(TOPIC, v, k)
                break
            except BufferError:
                p.poll(0.01)
    remaining = p.flush(600)
    out.put((t0, time.perf_counter()) if remaining == 0 else (t0, float("nan")))


def measure(kind: str, workers: int, per_worker: int) -> float:
    """Records/s for one configuration, on a fresh broker."""
    ctx = mp.get_context("fork")
    with EmbeddedBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        barrier = ctx.Barrier(workers)
        out = ctx.Queue()
        producer = None
        if kind.startswith("shmprod"):
            producer = Producer(bootstrap_servers=broker.bootstrap, linger_ms=5, acks="all")
            mode = kind.split()[-1]
            # Warm the topic's metadata so every run starts with it known.
            producer.send(TOPIC, b"warm-up").result(timeout=30)
            target = _run_shmprod
            args: tuple[Any, ...] = (producer.handle,)
        else:
            target = _run_confluent
            args = (broker.bootstrap,)
            mode = ""
        try:
            procs = []
            for w in range(workers):
                extra = (
                    (w, per_worker, mode, barrier, out)
                    if producer
                    else (w, per_worker, barrier, out)
                )
                proc = ctx.Process(target=target, args=args + extra)
                proc.start()
                procs.append(proc)
            spans = [out.get(timeout=900) for _ in procs]
            for proc in procs:
                proc.join(60)
        finally:
            if producer is not None:
                producer.close()
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    return workers * per_worker / (end - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="400k records per run, one run per row (fewer records let fixed start and "
        "flush costs decide: 80k put one producer kind 3.6x off its full-run figure)",
    )
    parser.add_argument(
        "--total",
        type=int,
        default=None,
        help="records per run, split over the workers (1.2M: long enough for a steady "
        "rate, small enough for tansu's in-memory store)",
    )
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=None, help="runs per row (3; quick: 1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    total = args.total or (400_000 if args.quick else 1_200_000)
    counts = [int(x) for x in args.workers.split(",")]
    kinds = ["confluent-kafka", "shmprod send", "shmprod send_batch"]
    rows: list[dict[str, Any]] = []
    for workers in counts:
        per_worker = total // workers
        runs: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeat):
            for kind in kinds:
                rate = measure(kind, workers, per_worker)
                runs[kind].append(rate)
                print(f"{workers} worker(s) {kind:<20} {rate:>12,.0f} records/s", flush=True)
        rates = {kind: float(np.median(r)) for kind, r in runs.items()}
        for kind in kinds:
            rows.append(
                {
                    "workers": workers,
                    "kind": kind,
                    "records_per_s": round(rates[kind]),
                    "low": round(min(runs[kind])),
                    "high": round(max(runs[kind])),
                    "vs_confluent": round(rates[kind] / rates["confluent-kafka"], 2),
                }
            )
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", "e2e-quick.json" if args.quick else "e2e.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {
        "records_per_run": total,
        "value_size": VALUE_SIZE,
        "partitions": PARTITIONS,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "repeat": repeat,
    }
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    md = out.rsplit(".", 1)[0] + ".md"
    with open(md, "w", encoding="utf-8") as fh:
        fh.write(
            f"# End-to-end throughput\n\n`python bench/e2e.py{' --quick' if args.quick else ''}`: "
            f"{total:,} records of {VALUE_SIZE} B (16 B keys) per run, split over the "
            f"workers, {PARTITIONS} "
            f"partitions, acks=all, idempotence on, no compression, a fresh tansu broker per "
            f"run; {meta['cpus']} cores shared by workers, sender and broker. Median of "
            f"{repeat} run(s) per row, the kinds interleaved; low-high is the spread.\n\n"
            "| workers | producer | records/s (median) | low - high | vs confluent-kafka |\n"
            "|---:|---|---:|---:|---:|\n"
        )
        for r in rows:
            fh.write(
                f"| {r['workers']} | {r['kind']} | {r['records_per_s']:,} | "
                f"{r['low']:,} - {r['high']:,} | {r['vs_confluent']} |\n"
            )
    print(f"results: {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
