"""The benchmark suite's worker side: one function per producer kind, run in a worker
process forked from a clean server (``forkserver``), plus the data every kind sends.

Every kind does the same thing: make its records (before the clock), build its producer
and connect (before the clock), wait at the barrier, send until it has sent its share or
its time is up, wait until every record is acknowledged, and report what it sent, when
it started and ended (``perf_counter``: one clock for every process on the host) and the
CPU its process used meanwhile (every thread: the client's own I/O threads count). The
clock stops when every record is acknowledged: each kind closes its producer after
every worker has reported (:data:`AFTER_CLOCK`), as confluent-kafka's, which has no
``close``, is destroyed only when its process exits.

Imported by ``bench/suite.py``; not a benchmark of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

CHUNK = 10_000  # records per send_batch / produce_batch call
CHECK_EVERY = 2048  # per-record loops look at the clock this often
KEY_SIZE = 16
# row groups the exporter kind reads before its clock: about what one process holds at
# once (up to a stage's worth of 100 B rows in held send_batch calls), so its allocator
# has the pages a run reuses
WARM_ROW_GROUPS = 6
# what each kind closes once every worker has reported, or once its worker's failure is
# reported: a producer's close is not part of delivering its records, and a worker that
# closed inside the clock took the cores the others' clocks still ran on (eight shmprod
# workers' close took 3-37 ms each)
AFTER_CLOCK: list[Callable[[], object]] = []


# ---------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------


def make_columns(
    seed: int, n: int, value_size: int, keyed: bool
) -> tuple[pa.Array, pa.Array | None]:
    """``n`` distinct random values of ``value_size`` bytes (incompressible: lz4 gains
    nothing) and, when ``keyed``, distinct random 16-byte keys; no Python loop."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, n * value_size, dtype=np.uint8)
    voff = np.arange(0, (n + 1) * value_size, value_size, dtype=np.int32)
    v = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(voff), pa.py_buffer(values)])
    if not keyed:
        return v, None
    keys = rng.integers(0, 256, n * KEY_SIZE, dtype=np.uint8)
    koff = np.arange(0, (n + 1) * KEY_SIZE, KEY_SIZE, dtype=np.int32)
    k = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(koff), pa.py_buffer(keys)])
    return v, k


HEADER_KINDS = ("shmprod send", "confluent-kafka produce", "kafka-python send")
"""The kinds that take ``--headers`` (per-record calls, where each record carries its own)."""


def header_lists(count: int, n: int) -> list[list[tuple[str, bytes]] | None]:
    """The headers of each of ``n`` records: ``count`` of them, key ``h<j>`` and an
    8-byte value that differs per record (a sequence number or trace id); None for
    every record when ``count`` is 0."""
    if not count:
        return [None] * n
    return [[(f"h{j}", (i + j).to_bytes(8, "big")) for j in range(count)] for i in range(n)]


def _lists(values: pa.Array, keys: pa.Array | None) -> tuple[list[bytes], list[bytes | None]]:
    vlist = values.to_pylist()
    klist = keys.to_pylist() if keys is not None else [None] * len(vlist)
    return vlist, klist


def pss_bytes(pid: int | None = None) -> int:
    """Proportional set size of a process: shared pages (the shared pool, libraries)
    counted once over all the processes that map them."""
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.Error, AttributeError):
        return 0


def mapping_pss_bytes(pid: int, path_part: str) -> int:
    """The PSS of a process's mappings whose path contains ``path_part``: its share of
    a shared-memory segment it maps (the producer's pool, in the process that made it)."""
    try:
        maps = psutil.Process(pid).memory_maps(grouped=True)
    except (psutil.Error, AttributeError):
        return 0
    return sum(int(m.pss) for m in maps if path_part in m.path)


# ---------------------------------------------------------------------------------
# the kinds
# ---------------------------------------------------------------------------------


class Stop(Exception):
    pass


# when a shmprod worker's last record was given to the producer (its stage or held
# calls still to flush): the suite's phases compare it with the run's end
SENT_AT: list[float | None] = [None]


def _delivered(w: Any, futures: list[Any], n: int) -> int:
    """The end of every shmprod kind's run: notes when its last record was given to the
    producer (``SENT_AT``), flushes, waits for ``futures`` (any failure raises) and
    returns ``n``, the records sent."""
    SENT_AT[0] = time.perf_counter()
    w.flush(timeout=600)
    for f in futures:
        f.result(timeout=600)
    return n


def _shmprod_send(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from shmprod import attach

    vlist, klist = _lists(values, keys)
    hlist = header_lists(spec["headers"], len(vlist))
    w = attach(spec["handle"])
    topic = spec["topic"]
    w.send(topic, b"warm-up").result(60)  # every kind: one record acknowledged first

    def run(deadline: float) -> int:
        send = w.send
        n = 0
        last = []  # the last record's future of each stretch: any failure shows there too
        for start in range(0, len(vlist), CHECK_EVERY):
            end = min(start + CHECK_EVERY, len(vlist))
            for i in range(start, end - 1):
                send(topic, vlist[i], key=klist[i], headers=hlist[i])
            last.append(send(topic, vlist[end - 1], key=klist[end - 1], headers=hlist[end - 1]))
            n = end
            if time.perf_counter() > deadline:
                break
        return _delivered(w, last, n)

    AFTER_CLOCK.append(w.close)
    return run


def _shmprod_send_batch(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from shmprod import attach

    w = attach(spec["handle"])
    topic = spec["topic"]
    w.send(topic, b"warm-up").result(60)

    def run(deadline: float) -> int:
        n = 0
        futures = []
        for start in range(0, len(values), CHUNK):
            end = min(start + CHUNK, len(values))
            futures.append(
                w.send_batch(
                    topic, values[start:end], keys=None if keys is None else keys[start:end]
                )
            )
            n = end
            if time.perf_counter() > deadline:
                break
        return _delivered(w, futures, n)

    AFTER_CLOCK.append(w.close)
    return run


def _shmprod_exporter(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    """The exporter's path: Parquet row groups read with pyarrow, sent whole, and read
    as ``shmprod.export`` reads them: with pyarrow's thread pool in one process, on one
    thread each when several processes export, into the memory pool its processes use
    (``shmprod.exporter.reader_memory_pool``).

    The reader is warmed up like the producers are, before the clock starts: the first
    ``WARM_ROW_GROUPS`` row groups are read and held together, then dropped. The first
    read in a fresh process costs 30-50 ms of CPU (pyarrow's first allocations and
    threads), against 1-16 ms for the next ones. And the first few row groups a
    process holds at once are read into memory its allocator has never had: every
    page is a page fault, the kernel zeroing each one (perf of eight exporter
    processes at 1 KB: 64% of their CPU in the clock was ``clear_page``). A long export
    pays that once per process; with eight processes each reads only 4 (1 KB) to 25
    (100 B) row groups in a run, so with one row group of warm-up the row measured those
    faults more than the export (reading alone, eight processes, 1 KB: 0.87-1.69 CPU
    s/GB with one row group of warm-up, 0.35-0.43 with four).
    """
    import pyarrow.parquet as pq

    from shmprod import attach
    from shmprod.exporter import reader_memory_pool

    reader_memory_pool()  # shmprod.export's processes' allocator (see suite.main)
    path = os.path.join(spec["tmpdir"], f"part-{spec['worker']}.parquet")
    cols = {"value": values} if keys is None else {"value": values, "key": keys}
    pq.write_table(pa.table(cols), path, row_group_size=CHUNK, compression="none")
    w = attach(spec["handle"])
    topic = spec["topic"]
    w.send(topic, b"warm-up").result(60)
    f = pq.ParquetFile(path)
    threads = spec["procs"] == 1
    warm = [  # the reader's warm-up (see above)
        f.read_row_group(g, use_threads=threads)
        for g in range(min(WARM_ROW_GROUPS, f.num_row_groups))
    ]
    del warm

    def run(deadline: float) -> int:
        n = 0
        futures = []
        for g in range(f.num_row_groups):
            t = f.read_row_group(g, use_threads=threads)
            futures.append(
                w.send_batch(topic, t["value"], keys=t["key"] if keys is not None else None)
            )
            n += t.num_rows
            if time.perf_counter() > deadline:
                break
        return _delivered(w, futures, n)

    AFTER_CLOCK.append(w.close)
    return run


def _confluent_config(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "bootstrap.servers": spec["bootstrap"],
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": spec["linger_ms"],
        "compression.type": spec["compression"],
        "log_level": 3,
    }


def _confluent_produce(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from confluent_kafka import Producer

    vlist, klist = _lists(values, keys)
    hlist = header_lists(spec["headers"], len(vlist))
    p = Producer(_confluent_config(spec))
    p.produce(spec["topic"], b"warm-up")  # connected, metadata and producer id known
    if p.flush(60):
        raise RuntimeError("confluent-kafka: the warm-up record was not acknowledged")
    topic = spec["topic"]
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    def run(deadline: float) -> int:
        produce = p.produce
        n = 0
        for start in range(0, len(vlist), CHECK_EVERY):
            end = min(start + CHECK_EVERY, len(vlist))
            for i in range(start, end):
                while True:
                    try:
                        produce(
                            topic, vlist[i], klist[i], on_delivery=on_delivery, headers=hlist[i]
                        )
                        break
                    except BufferError:
                        p.poll(0.005)
            p.poll(0)
            n = end
            if time.perf_counter() > deadline:
                break
        if p.flush(600) != 0 or errors:
            raise RuntimeError(f"confluent-kafka: {errors[:3]}")
        return n

    return run


def _confluent_produce_batch(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from confluent_kafka import Producer

    vlist, klist = _lists(values, keys)
    p = Producer(_confluent_config(spec))
    p.produce(spec["topic"], b"warm-up")  # connected, metadata and producer id known
    if p.flush(60):
        raise RuntimeError("confluent-kafka: the warm-up record was not acknowledged")
    topic = spec["topic"]
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    def run(deadline: float) -> int:
        n = 0
        for start in range(0, len(vlist), CHUNK):
            end = min(start + CHUNK, len(vlist))
            msgs: list[dict[str, Any]] = [
                {"value": vlist[i], "key": klist[i]} for i in range(start, end)
            ]
            while msgs:
                p.produce_batch(topic, msgs, on_delivery=on_delivery)
                msgs = [m for m in msgs if "_error" in m]  # the queue was full for these
                for m in msgs:
                    del m["_error"]
                p.poll(0.005 if msgs else 0)
            n = end
            if time.perf_counter() > deadline:
                break
        if p.flush(600) != 0 or errors:
            raise RuntimeError(f"confluent-kafka produce_batch: {errors[:3]}")
        return n

    return run


def _kafka_python(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from kafka import KafkaProducer

    vlist, klist = _lists(values, keys)
    hlist = header_lists(spec["headers"], len(vlist))
    p = KafkaProducer(
        bootstrap_servers=spec["bootstrap"],
        acks="all",
        enable_idempotence=True,
        linger_ms=spec["linger_ms"],
        compression_type=None if spec["compression"] == "none" else spec["compression"],
    )
    topic = spec["topic"]
    p.send(topic, b"warm-up").get(60)  # connected, metadata and producer id known

    def run(deadline: float) -> int:
        send = p.send
        n = 0
        last = None
        for start in range(0, len(vlist), CHECK_EVERY):
            end = min(start + CHECK_EVERY, len(vlist))
            for i in range(start, end):
                last = send(topic, value=vlist[i], key=klist[i], headers=hlist[i])
            n = end
            if time.perf_counter() > deadline:
                break
        p.flush(600)
        if last is not None:
            last.get(timeout=600)
        return n

    AFTER_CLOCK.append(lambda: p.close(30))
    return run


def _aiokafka_send_batch(
    spec: dict[str, Any], values: pa.Array, keys: pa.Array | None
) -> Callable[[float], int]:
    from aiokafka import AIOKafkaProducer
    from aiokafka.partitioner import DefaultPartitioner

    vlist, klist = _lists(values, keys)
    topic = spec["topic"]
    loop = asyncio.new_event_loop()

    async def start() -> tuple[Any, list[int]]:
        p = AIOKafkaProducer(
            bootstrap_servers=spec["bootstrap"],
            acks="all",
            enable_idempotence=False,  # it asks InitProducerId v0, which the broker refuses
            linger_ms=spec["linger_ms"],
            compression_type=None if spec["compression"] == "none" else spec["compression"],
        )
        await p.start()
        await p.send_and_wait(topic, b"warm-up")
        return p, sorted(await p.partitions_for(topic))

    p, parts = loop.run_until_complete(start())
    partitioner = DefaultPartitioner()

    async def go(deadline: float) -> int:
        batches: dict[int, Any] = {}
        futures = []
        n = 0
        rr = 0
        for start in range(0, len(vlist), CHECK_EVERY):
            end = min(start + CHECK_EVERY, len(vlist))
            for i in range(start, end):
                k = klist[i]
                part = parts[rr] if k is None else partitioner(k, parts, parts)
                b = batches.get(part)
                if b is None:
                    b = batches[part] = p.create_batch()
                if b.append(key=k, value=vlist[i], timestamp=None) is None:
                    b.close()
                    futures.append(await p.send_batch(b, topic, partition=part))
                    del batches[part]  # sent: the final sweep must not send it again
                    if k is None:  # null keys: the next partition (sticky per batch)
                        rr = (rr + 1) % len(parts)
                        part = parts[rr]
                    b = batches[part] = p.create_batch()
                    b.append(key=k, value=vlist[i], timestamp=None)
            n = end
            if time.perf_counter() > deadline:
                break
        for part, b in batches.items():
            if b.record_count():
                b.close()
                futures.append(await p.send_batch(b, topic, partition=part))
        await asyncio.gather(*futures)
        return n

    def close() -> None:
        try:
            loop.run_until_complete(p.stop())
        finally:
            loop.close()

    def run(deadline: float) -> int:
        return loop.run_until_complete(go(deadline))

    AFTER_CLOCK.append(close)
    return run


KINDS: dict[str, Callable[[dict[str, Any], pa.Array, pa.Array | None], Callable[[float], int]]] = {
    "shmprod send": _shmprod_send,
    "shmprod send_batch": _shmprod_send_batch,
    "shmprod exporter": _shmprod_exporter,
    "confluent-kafka produce": _confluent_produce,
    "confluent-kafka produce_batch": _confluent_produce_batch,
    "aiokafka send_batch": _aiokafka_send_batch,
    "kafka-python send": _kafka_python,
}


def worker_main(kind: str, spec: dict[str, Any], barrier: Any, out: Any) -> None:
    """One worker process of one measurement (see the module docstring)."""
    try:
        values, keys = make_columns(
            spec["seed"], spec["records"], spec["value_size"], spec["keyed"]
        )
        run = KINDS[kind](spec, values, keys)
        # The set-up's objects (the record lists among them) are young: a kind that makes
        # tracked objects as it sends (shmprod's stages and outcomes) would have its first
        # collection walk them all inside the clock (one process's send at 100 B: a
        # generation-1 collection over its 2 M-item lists, user CPU 0.68 s against 0.56 s
        # with this), so every kind collects here, before the barrier
        gc.collect()
        # the footprint once the producer is built, without this process's share of the
        # shmprod pool: the peak counts the whole pool, so "producer MB" does too
        base = pss_bytes()
        if "handle" in spec:
            base -= mapping_pss_bytes(os.getpid(), spec["handle"].segment)
        barrier.wait(180)
        c0 = time.process_time()
        t0 = time.perf_counter()
        sent = run(t0 + spec["max_s"])
        t1 = time.perf_counter()
        c1 = time.process_time()
        out.put(
            {
                "ok": True,
                "t0": t0,
                "t1": t1,
                "cpu": c1 - c0,
                "sent": sent,
                "base_pss": base,
                "pid": os.getpid(),
                "sent_at": SENT_AT[0],
            }
        )
        # Waits for every other worker's report before it returns: a worker done early
        # would otherwise free its data and exit while the others' clocks run, on the
        # cores they share (eight processes' runs end up to about 170 ms apart).
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(900)
    except BaseException as exc:  # reported, and the measurement fails loudly
        out.put({"ok": False, "error": f"{kind}: {exc!r}", "pid": os.getpid()})
        barrier.abort()  # nobody waits for this worker
        raise
    finally:  # after every report, or once this worker's failure is reported
        for close in AFTER_CLOCK:
            close()


# ---------------------------------------------------------------------------------
# send-to-acknowledgement latency at a fixed moderate rate
# ---------------------------------------------------------------------------------


def latency_main(kind: str, spec: dict[str, Any], out: Any) -> None:
    """Sends ``rate`` records/s for ``seconds`` from one process; reports every
    record's send-to-acknowledgement time (ms)."""
    try:
        n = int(spec["rate"] * spec["seconds"])
        values, keys = make_columns(spec["seed"], n, spec["value_size"], spec["keyed"])
        vlist, klist = _lists(values, keys)
        sent_at = np.zeros(n)
        acked_at = np.full(n, np.nan)
        period = 1.0 / spec["rate"]
        topic = spec["topic"]
        pc = time.perf_counter

        def paced(send_one: Callable[[int], None], idle: Callable[[float], None]) -> None:
            t_start = pc()
            for i in range(n):
                due = t_start + i * period
                while True:
                    left = due - pc()
                    if left <= 0:
                        break
                    idle(left)
                sent_at[i] = pc()
                send_one(i)

        if kind == "shmprod send":
            from shmprod import attach

            w = attach(spec["handle"])
            w.send(topic, b"warm-up").result(30)  # every kind: one record acknowledged first

            def send_one(i: int) -> None:
                def done(_f: Any, i: int = i) -> None:
                    acked_at[i] = pc()

                w.send(topic, vlist[i], key=klist[i]).add_done_callback(done)

            paced(send_one, time.sleep)
            w.flush(60)
            w.close()
        elif kind == "confluent-kafka produce":
            from confluent_kafka import Producer

            p = Producer(_confluent_config(spec))
            p.produce(topic, b"warm-up")
            p.flush(30)

            def send_one(i: int) -> None:
                def done(err: Any, _m: Any, i: int = i) -> None:
                    if err is None:
                        acked_at[i] = pc()

                p.produce(topic, vlist[i], klist[i], on_delivery=done)
                p.poll(0)

            paced(send_one, lambda s: p.poll(min(s, 0.001)))
            p.flush(60)
        elif kind == "kafka-python send":
            from kafka import KafkaProducer

            kp = KafkaProducer(
                bootstrap_servers=spec["bootstrap"],
                acks="all",
                enable_idempotence=True,
                linger_ms=spec["linger_ms"],
            )
            kp.send(topic, b"warm-up").get(30)

            def send_one(i: int) -> None:
                def done(_md: Any, i: int = i) -> None:
                    acked_at[i] = pc()

                kp.send(topic, value=vlist[i], key=klist[i]).add_callback(done)

            paced(send_one, time.sleep)
            kp.flush(60)
            kp.close(30)
        elif kind == "aiokafka send":
            from aiokafka import AIOKafkaProducer

            async def go() -> None:
                ap = AIOKafkaProducer(
                    bootstrap_servers=spec["bootstrap"],
                    acks="all",
                    enable_idempotence=False,  # InitProducerId v0: refused by the broker
                    linger_ms=spec["linger_ms"],
                )
                await ap.start()
                await ap.send_and_wait(topic, b"warm-up")
                futs = []
                t_start = pc()
                for i in range(n):
                    left = t_start + i * period - pc()
                    if left > 0:
                        await asyncio.sleep(left)
                    sent_at[i] = pc()
                    fut = await ap.send(topic, vlist[i], key=klist[i])
                    fut.add_done_callback(lambda _f, i=i: acked_at.__setitem__(i, pc()))
                    futs.append(fut)
                await asyncio.gather(*futs)
                await ap.stop()

            asyncio.run(go())
        else:
            raise ValueError(kind)
        lat = (acked_at - sent_at) * 1000.0
        if os.environ.get("BENCH_DEBUG"):
            worst = np.argsort(lat)[-8:]
            print(
                f"  {kind}: slowest rows {worst.tolist()} ms {lat[worst].round(1).tolist()}",
                flush=True,
            )
        if np.isnan(lat).any():
            raise RuntimeError(f"{int(np.isnan(lat).sum())} records never acknowledged")
        out.put(
            {
                "ok": True,
                "p50": float(np.percentile(lat, 50)),
                "p99": float(np.percentile(lat, 99)),
                "n": n,
            }
        )
    except BaseException as exc:
        out.put({"ok": False, "error": f"{kind}: {exc!r}"})
        raise
