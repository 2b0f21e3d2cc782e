"""``shmprod.export`` of an Arrow table against confluent-kafka, one producer per process.

    python bench/export.py            # 1,000,000 rows, 3 interleaved runs (run it alone)
    python bench/export.py --quick    # the same rows, one run each (what CI runs)

The same table -- distinct random (incompressible) 100-byte values and 16-byte keys --
goes to a 12-partition topic on a fresh embedded broker per measurement, lz4, acks=all,
linger 5 ms, idempotence on, by:

* ``shmprod export``: ``shmprod.export(table, ...)`` with ``workers`` spawned processes
  sharing one producer (the pool's start-up is in the time, as a user sees it);
* ``confluent-kafka``: the same number of spawned processes, each given its slice of
  the table (pickled to it) and producing every row with ``produce`` into a producer of
  its own, then ``flush``.

* ``shmprod export (Parquet)``: ``shmprod.export(path, ...)`` of a Parquet file of the
  same table, in row groups of ``--row-group-rows`` (10,000; uncompressed, written
  once before the runs), as ``shmprod export FILE`` reads it.

The clock runs from the call to the last acknowledgement; every run reads the topic
back and fails unless it holds exactly the rows. CPU: every process the run started
and saw end (the pool's, and shmprod's sender; the broker apart), per GB of keys and
values. Each run also logs the machine's speed just before it (``_probe``: a fixed CPU
task and a fixed copy into fresh memory), the broker's CPU (in cores, and its kernel
time and page faults per GB and MB, as ``bench/suite.py`` does), the CPU of everything
else the machine ran meanwhile (other processes, interrupts not charged to a process),
the CPU the host took from this machine's cores (steal) and the free memory it took
back, where the system counts them, so that a run slower than its neighbours says
whether the broker, something else or the machine was. ``--warm-mb`` (1024; 0: off)
holds that much memory through each run's set-up and lets it go just before the clock,
as ``bench/suite.py`` does: the broker's CPU is mostly page faults, and a fault on
memory this machine handed back to its host costs several times one on memory freed a
moment ago (``bench/first_touch.py``). Medians of the runs with min and max; JSON and
markdown in ``bench/results/`` (``export-quick.*`` for quick runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

# Only the standard library at the top: every process a run spawns, confluent-kafka's
# and shmprod's pools alike, imports this module again as its main module, and should
# load nothing it does not need itself (pyarrow, the suite and shmprod took 250-480 ms
# of each confluent-kafka process's start). The rest is imported where it is used.
if TYPE_CHECKING:
    import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOPIC = "export-bench"
PARTITIONS = 12
VALUE_SIZE = 100
LINGER_MS = 5


def _confluent_slice(bootstrap: str, values: list[bytes], keys: list[bytes]) -> int:
    """Runs in a spawned process: one confluent-kafka producer for its slice."""
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": LINGER_MS,
            "compression.type": "lz4",
            "log_level": 3,
        }
    )
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    produce = p.produce
    for v, k in zip(values, keys, strict=True):
        while True:
            try:
                produce(TOPIC, v, k, on_delivery=on_delivery)
                break
            except BufferError:
                p.poll(0.005)
    if p.flush(600) != 0 or errors:
        raise RuntimeError(f"confluent-kafka: {errors[:3]}")
    return len(values)


def _confluent(bootstrap: str, table: pa.Table, workers: int) -> None:
    n = table.num_rows
    step = -(-n // workers)
    slices = [table.slice(i, step) for i in range(0, n, step)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        jobs = [
            (bootstrap, s.column("value").to_pylist(), s.column("key").to_pylist()) for s in slices
        ]
        sent = sum(pool.starmap(_confluent_slice, jobs))
    if sent != n:
        raise RuntimeError(f"confluent-kafka sent {sent} of {n}")


def _shmprod(bootstrap: str, table: pa.Table, workers: int, source: Any = None) -> None:
    """``shmprod.export`` of ``source`` (a path), or of the table itself."""
    import shmprod

    r = shmprod.export(
        table if source is None else source,
        TOPIC,
        bootstrap_servers=bootstrap,
        key="key",
        value="value",
        workers=workers,
        progress=False,
        compression_type="lz4",
        linger_ms=LINGER_MS,
    )
    if r.records != table.num_rows:
        raise RuntimeError(f"shmprod export acknowledged {r.records} of {table.num_rows}")


def _cpu(who: int) -> float:
    """CPU seconds so far of this process (``resource.RUSAGE_SELF``) or of the children
    it saw end (``resource.RUSAGE_CHILDREN``)."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@dataclass(frozen=True)
class Run:
    """One measurement, and what the host did meanwhile (None where not counted)."""

    rows_per_s: float
    cpu_s_per_gb: float
    steal_s: float | None  # CPU the host took from this machine's cores in the run
    host_reported_mb: float | None  # free memory this machine handed back to its host
    broker_cores: float | None = None  # the broker's CPU s per s of the run
    broker_sys_s_per_gb: float | None = None  # of that, in the kernel, per GB
    broker_faults_per_mb: float | None = None  # its minor page faults per MB
    others_cores: float | None = None  # all else the machine ran, CPU s per s of the run
    probe_cpu_ms: float | None = None  # a fixed CPU task just before the run (_probe)
    probe_memory_ms: float | None = None  # a fixed copy into fresh memory, the same


def measure(
    kind: str,
    send: Callable[[str, pa.Table, int], None],
    table: pa.Table,
    workers: int,
    warm_mb: int = 0,
) -> Run:
    """One run of ``send`` on a fresh broker, after checking the topic holds every row.
    ``warm_mb`` MB are held from before the broker starts until just before the clock
    (the suite's ``--warm-mb``: ``suite.WarmMemory``). The broker's CPU, that of all
    else the machine ran, the host's steal time and the memory it took back
    (``bench/first_touch.py``) come with it, so that a run slower than its neighbours
    says where the time went."""

    from first_touch import reported_mb
    from suite import (
        WarmMemory,
        _broker_kernel,
        _delta,
        _kernel,
        _stat_cpu_s,
        _steal_s,
        count_back,
    )

    from shmprod.broker import EmbeddedBroker

    nbytes = table.num_rows * (VALUE_SIZE + 16)
    gb = nbytes / 1e9
    warm = WarmMemory(warm_mb)
    warm.take()  # before the broker starts: it and the run draw on what is let go
    with EmbeddedBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        warm.let_go()
        probe = _probe()  # after: its fresh memory is what the run draws on
        stat = f"/proc/{broker.pid}/stat"
        cpu0, steal0, reported0 = _cpu(resource.RUSAGE_CHILDREN), _steal_s(), reported_mb()
        b0, k0, busy0 = _stat_cpu_s(stat), _kernel(broker.pid), _busy_s()
        own0 = _cpu(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        send(broker.bootstrap, table, workers)
        seconds = time.perf_counter() - t0
        b1, k1, busy1 = _stat_cpu_s(stat), _kernel(broker.pid), _busy_s()
        own1 = _cpu(resource.RUSAGE_SELF)
        cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu0
        steal, reported = _delta(steal0, _steal_s()), _delta(reported0, reported_mb())
        got = count_back(broker.bootstrap, table.num_rows, topic=TOPIC, partitions=PARTITIONS)
    if got != table.num_rows:
        raise RuntimeError(f"{kind}: the topic holds {got} records, {table.num_rows} were sent")
    kernel = _broker_kernel(k0, k1, nbytes)
    others = None
    if busy0 is not None and busy1 is not None:  # the machine's CPU less this run's own
        others = max(0.0, (busy1 - busy0) - cpu - (b1 - b0) - (own1 - own0)) / seconds
    return Run(
        table.num_rows / seconds,
        cpu / gb,
        steal,
        reported,
        round((b1 - b0) / seconds, 2),
        kernel["broker_sys_s_per_gb"],
        kernel["broker_faults_per_mb"],
        None if others is None else round(others, 2),
        *probe,
    )


_PROBE_DATA = b""


def _probe() -> tuple[float, float]:
    """The machine's speed just before a run, in CPU ms of this process (so that being
    preempted does not count): SHA-256 of 32 MiB, and a copy of 64 MiB into memory
    never touched (its page faults, the kernel zeroing each page). Both take the same
    work every time, so a run slower than its neighbours whose probe was slower too
    ran on a slower machine (its host busier, or handing it memory the host had taken
    back), not on slower code."""
    import hashlib

    global _PROBE_DATA
    if not _PROBE_DATA:
        _PROBE_DATA = os.urandom(64 << 20)
    t0 = time.process_time()
    hashlib.sha256(memoryview(_PROBE_DATA)[: 32 << 20]).digest()
    t1 = time.process_time()
    copy = bytearray(_PROBE_DATA)
    t2 = time.process_time()
    del copy
    return round((t1 - t0) * 1e3, 1), round((t2 - t1) * 1e3, 1)


def _busy_s() -> float | None:
    """CPU seconds the machine's cores have run anything (user, nice, system and
    interrupts: all but idle, iowait and steal), summed over the cores; read as the
    suite reads steal time (``psutil.cpu_times``), None where the system does not count
    interrupts."""
    import psutil

    t = psutil.cpu_times()
    irq, softirq = getattr(t, "irq", None), getattr(t, "softirq", None)
    if irq is None or softirq is None:
        return None
    return float(t.user + t.nice + t.system + irq + softirq)


def _host(r: Run) -> str:
    """What the host did in a run, for the log and the table ("" where not counted)."""
    parts = []
    if r.probe_cpu_ms is not None:
        parts.append(f"probe {r.probe_cpu_ms:.0f}/{r.probe_memory_ms:.0f} ms")
    if r.broker_cores is not None:
        parts.append(f"broker {r.broker_cores:.2f} cores")
    if r.broker_sys_s_per_gb is not None:
        parts.append(
            f"broker kernel {r.broker_sys_s_per_gb:.2f} s/GB, "
            f"{r.broker_faults_per_mb:,.0f} faults/MB"
        )
    if r.others_cores is not None:
        parts.append(f"all else {r.others_cores:.2f} cores")
    if r.steal_s is not None:
        parts.append(f"steal {r.steal_s:.1f} s")
    if r.host_reported_mb is not None:
        parts.append(f"host took back {r.host_reported_mb:,.0f} MB")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run each")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--warm-mb",
        type=int,
        default=1024,
        help="MB held through each run's set-up and let go just before its clock "
        "(1024; 0: off), as bench/suite.py does",
    )
    parser.add_argument(
        "--row-group-rows",
        type=int,
        default=10_000,
        help="the Parquet file's rows per row group (10,000)",
    )
    args = parser.parse_args(argv)
    # quick runs as many rows: at 200,000 the fixed costs (pools, producers, the
    # idempotent producers' ids) are most of the time and tell another story
    rows = args.rows or 1_000_000
    runs = args.runs or (1 if args.quick else 3)
    import pyarrow as pa
    from _peers import make_columns
    from suite import RESULTS, _cpu_model, installed_version

    values, keys = make_columns(11, rows, VALUE_SIZE, True)
    table = pa.table({"value": values, "key": keys})
    with tempfile.TemporaryDirectory(prefix="shmprod-export-bench-") as tmp:
        import pyarrow.parquet as pq

        path = os.path.join(tmp, "table.parquet")
        pq.write_table(table, path, row_group_size=args.row_group_rows, compression="none")
        sends: dict[str, Callable[[str, pa.Table, int], None]] = {
            "shmprod export": _shmprod,
            "shmprod export (Parquet)": functools.partial(_shmprod, source=path),
            "confluent-kafka": _confluent,
        }
        results: dict[str, list[Run]] = {k: [] for k in sends}
        log: list[str] = []  # every run in the order it ran
        t0 = time.monotonic()
        for run in range(runs):  # interleaved: each run measures every kind once
            for kind in sends if run % 2 == 0 else reversed(sends):
                r = measure(kind, sends[kind], table, args.workers, args.warm_mb)
                results[kind].append(r)
                host = _host(r)
                log.append(
                    f"run {run + 1}/{runs} {kind}: {r.rows_per_s:,.0f} rows/s, "
                    f"{r.cpu_s_per_gb:.2f} CPU s/GB" + (f"; {host}" if host else "")
                )
                print(log[-1], flush=True)
    rows_out = {
        k: {
            "median": statistics.median(r.rows_per_s for r in v),
            "min": min(r.rows_per_s for r in v),
            "max": max(r.rows_per_s for r in v),
            "runs": [r.rows_per_s for r in v],
            "cpu_s_per_gb": statistics.median(r.cpu_s_per_gb for r in v),
            "cpu_min": min(r.cpu_s_per_gb for r in v),
            "cpu_max": max(r.cpu_s_per_gb for r in v),
            "run_details": [asdict(r) for r in v],
        }
        for k, v in results.items()
    }
    ratio = rows_out["shmprod export"]["median"] / rows_out["confluent-kafka"]["median"]
    ratio_parquet = (
        rows_out["shmprod export (Parquet)"]["median"] / rows_out["confluent-kafka"]["median"]
    )
    meta = {
        "quick": args.quick,
        "rows": rows,
        "runs": runs,
        "workers": args.workers,
        "parquet_row_group_rows": args.row_group_rows,
        "warm_mb": args.warm_mb,
        "value_size": VALUE_SIZE,
        "key_size": 16,
        "compression": "lz4",
        "partitions": PARTITIONS,
        "linger_ms": LINGER_MS,
        "python": sys.version.split()[0],
        "cpu": f"{os.cpu_count()} cores, {_cpu_model()}",
        "versions": {n: installed_version(n) for n in ("shmprod", "confluent-kafka", "pyarrow")},
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    os.makedirs(RESULTS, exist_ok=True)
    prefix = os.path.join(RESULTS, "export-quick" if args.quick else "export")
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(
            {"meta": meta, "results": rows_out, "ratio": ratio, "ratio_parquet": ratio_parquet},
            f,
            indent=2,
        )
    lines = [
        f"# export: {rows:,} rows of {VALUE_SIZE} B values, 16 B keys, lz4, "
        f"{args.workers} processes, {runs} run(s); the Parquet file in row groups of "
        f"{args.row_group_rows:,} rows; {args.warm_mb:,} MB held through each run's "
        "set-up and let go just before its clock",
        "",
        f"{meta['cpu']}; Python {meta['python']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        "| producer | rows/s (median) | min | max | CPU s/GB (min - max) |",
        "|---|---|---|---|---|",
    ]
    for k, r in rows_out.items():
        lines.append(
            f"| {k} | {r['median']:,.0f} | {r['min']:,.0f} | {r['max']:,.0f} "
            f"| {r['cpu_s_per_gb']:.2f} ({r['cpu_min']:.2f} - {r['cpu_max']:.2f}) |"
        )
    lines += [
        "",
        f"shmprod export / confluent-kafka: **{ratio:.2f}x** (the table), "
        f"**{ratio_parquet:.2f}x** (the Parquet file)",
        "",
        "The runs in order, with the machine's speed just before each (a fixed CPU task "
        "and a fixed copy into fresh memory, CPU ms), the broker's CPU (cores; kernel "
        "s/GB and page faults/MB), "
        "the CPU of all else the machine ran (other processes, interrupts not charged to "
        "a process), the CPU the host took from this machine's cores (steal) and the free "
        "memory it took back, where the system counts them:",
        "",
        *(f"- {line}" for line in log),
        "",
    ]
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
