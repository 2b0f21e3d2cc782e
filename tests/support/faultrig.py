"""The fault-matrix rig: known records through several worker processes, one fault, a count.

One row of the matrix (:class:`Row`) starts a shared producer (behind the fault proxy
:class:`tests.support.kafka_proxy.KafkaProxy`, or straight on the broker), spawns worker
processes that attach by handle and send a known set of records, injects its fault,
then reads the topic back with confluent-kafka and counts (:class:`Tally`):

- **sent**: records handed over (the ``send`` / ``send_batch`` call returned a future);
- **acked**, **failed** by error, **refused** at the call, **no outcome** (futures that
  died with a killed worker);
- **duplicated** (a record found more than once), **lost** (acknowledged, not found),
  **misplaced** (found at another partition or offset than its future said),
  **foreign** (bytes in the log that no worker sent), **failed but written** (fate
  unknown, not a loss);
- **order kept**: within each worker and partition, sequence numbers ascend in offset
  order.

A record is ``w<worker>-<seq>-`` plus padding, keyed ``k<n>`` so that murmur2 spreads
records over every partition. Workers alternate ``send`` (one record at a time) and
``send_batch`` chunks, keep a few chunks in flight, and may pause at a barrier where the
row injects its fault. Every wait is bounded.

``python -m tests.support.faultrig --table FILE`` runs every row against an embedded
broker and writes the markdown table printed in README.md's "Fault matrix" section.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from shmprod import Producer
from shmprod import layout as L
from shmprod.broker import EmbeddedBroker
from shmprod.errors import KafkaError, ShmprodError
from shmprod.futures import BatchFuture, RecordFuture
from shmprod.handle import Handle
from shmprod.protocol.records import HEADER_SIZE
from shmprod.shm import Segment
from shmprod.worker import append as A
from shmprod.worker import attach
from tests.support.kafka_proxy import PRODUCE, KafkaProxy

PARTITIONS = 6
CTX = mp.get_context("spawn")

# per-record status, as a worker reports it
UNSENT, PENDING, ACKED, FAILED, REFUSED = 0, 1, 2, 3, 4
_FATAL_AT_CALL = ("SenderDiedError", "OwnerDiedError", "ProducerClosedError", "ProducerError")

WAIT_S = 60.0  # the longest any single wait of the rig may take


def value_of(worker: int, seq: int, size: int) -> bytes:
    head = b"w%02d-%06d-" % (worker, seq)
    return head + b"x" * max(0, size - len(head))


def key_of(worker: int, seq: int) -> bytes:
    return b"k%d" % ((seq * 7 + worker * 13) % 101)


def parse_value(value: bytes | None) -> tuple[int, int] | None:
    """(worker, seq) of a value the rig wrote, or None for anything else."""
    if value is None or len(value) < 11 or value[:1] != b"w" or value[3:4] != b"-":
        return None
    try:
        worker, seq = int(value[1:3]), int(value[4:10])
    except ValueError:
        return None
    return (worker, seq) if value[10:11] == b"-" else None


def error_name(exc: BaseException) -> str:
    if isinstance(exc, KafkaError):
        return exc.name
    return type(exc).__name__


# =========================================================================================
# The worker process
# =========================================================================================


@dataclass(frozen=True)
class HookSpec:
    """What the victim's :data:`shmprod.worker.append.fault_hook` does, and when: at the
    ``nth`` call at ``point``, ``"kill"`` (SIGKILL itself, inside the critical section)
    or ``"scribble"`` (overwrite bytes of the batch's records section)."""

    point: str
    nth: int
    action: str


class _Hook:
    """Runs in the victim worker, under its state lock (see :mod:`shmprod.worker.append`)."""

    def __init__(self, spec: HookSpec) -> None:
        self.spec = spec
        self.calls = 0

    def __call__(self, point: str, view: memoryview, end: int) -> None:
        if point != self.spec.point:
            return
        self.calls += 1
        if self.calls != self.spec.nth:
            return
        if self.spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # not reached
        elif self.spec.action == "scribble":
            for i in range(HEADER_SIZE + 3, min(end, HEADER_SIZE + 35)):
                view[i] ^= 0x5A


@dataclass(frozen=True)
class WorkerPlan:
    worker: int
    topic: str
    records: int
    chunk: int = 100
    window: int = 4  # chunks in flight before waiting for the oldest
    value_size: int = 48
    pause_at: int = -1  # wait at the barrier before sending this seq (-1: never)
    hook: HookSpec | None = None
    result_timeout: float = 30.0


@dataclass
class WorkerReport:
    worker: int
    status: npt.NDArray[np.int8]
    partition: npt.NDArray[np.int32]
    offset: npt.NDArray[np.int64]
    error: npt.NDArray[np.int16]  # index into errors, -1 none
    errors: list[str]
    sent_at: npt.NDArray[np.float64]  # time.monotonic() of the send call (system-wide clock)
    resolved_at: float  # when the last outcome was known


class _Outcomes:
    def __init__(self, plan: WorkerPlan) -> None:
        n = plan.records
        self.plan = plan
        self.status = np.zeros(n, np.int8)
        self.partition = np.full(n, -1, np.int32)
        self.offset = np.full(n, -1, np.int64)
        self.error = np.full(n, -1, np.int16)
        self.errors: list[str] = []
        self.sent_at = np.zeros(n, np.float64)

    def fail(self, seqs: Any, name: str, status: int = FAILED) -> None:
        if name not in self.errors:
            self.errors.append(name)
        self.status[seqs] = status
        self.error[seqs] = self.errors.index(name)

    def report(self) -> WorkerReport:
        return WorkerReport(
            self.plan.worker,
            self.status,
            self.partition,
            self.offset,
            self.error,
            self.errors,
            self.sent_at,
            time.monotonic(),
        )


def _resolve_records(out: _Outcomes, futs: list[tuple[int, RecordFuture]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for seq, f in futs:
        try:
            md = f.result(timeout=max(0.0, deadline - time.monotonic()))
        except ShmprodError as exc:
            out.fail(seq, error_name(exc))
            continue
        except TimeoutError:
            out.fail(seq, "no outcome in time", PENDING)
            continue
        out.status[seq] = ACKED
        out.partition[seq] = md.partition
        out.offset[seq] = md.offset


def _resolve_batch(out: _Outcomes, lo: int, fut: BatchFuture, timeout: float) -> None:
    """Per-row outcome of one ``send_batch`` call, through its public API: every row's
    partition and offset, and the rows of each failed batch with its error."""
    try:
        md = fut.partial_result(timeout=timeout)
    except TimeoutError:
        out.fail(np.arange(lo, lo + len(fut._partitions)), "no outcome in time", PENDING)
        return
    n = len(md)
    out.partition[lo : lo + n] = md.partitions
    out.status[lo : lo + n] = ACKED
    out.offset[lo : lo + n] = md.offsets
    for failure in fut.failures(0):
        # not handed over: rows the call could not write (a full pool, a dead sender)
        kind = FAILED if failure.handed_over else REFUSED
        out.fail(lo + failure.rows, error_name(failure.error), kind)


def worker_main(
    handle: Handle,
    plan: WorkerPlan,
    reports: Any,
    go: Any,
    progress: Any,
) -> None:
    """A worker process: attach, send the plan's records, report every outcome."""
    if plan.hook is not None:
        A.fault_hook = _Hook(plan.hook)
    out = _Outcomes(plan)
    w = attach(handle)
    pending: list[tuple[int, Any]] = []
    stop = False
    try:
        for ci, lo in enumerate(range(0, plan.records, plan.chunk)):
            hi = min(lo + plan.chunk, plan.records)
            if lo <= plan.pause_at < hi:
                reports.put(("arrived", plan.worker))
                go.wait(WAIT_S)
            out.sent_at[lo:hi] = time.monotonic()
            if ci % 2:
                values = [value_of(plan.worker, s, plan.value_size) for s in range(lo, hi)]
                keys = [key_of(plan.worker, s) for s in range(lo, hi)]
                try:
                    fut = w.send_batch(plan.topic, values, keys=keys)
                except ShmprodError as exc:
                    out.fail(np.arange(lo, hi), error_name(exc), REFUSED)
                    stop = error_name(exc) in _FATAL_AT_CALL
                else:
                    out.status[lo:hi] = PENDING
                    pending.append((lo, fut))
            else:
                futs: list[tuple[int, RecordFuture]] = []
                for s in range(lo, hi):
                    try:
                        f = w.send(
                            plan.topic,
                            value_of(plan.worker, s, plan.value_size),
                            key=key_of(plan.worker, s),
                        )
                    except ShmprodError as exc:
                        out.fail(s, error_name(exc), REFUSED)
                        if error_name(exc) in _FATAL_AT_CALL:
                            stop = True
                            break
                    else:
                        out.status[s] = PENDING
                        futs.append((s, f))
                pending.append((lo, futs))
            progress[plan.worker] = hi
            while len(pending) > plan.window:
                _resolve(out, pending.pop(0), plan.result_timeout)
            if stop:
                break
        while pending:
            _resolve(out, pending.pop(0), plan.result_timeout)
        reports.put(("report", plan.worker, out.report()))
    finally:
        w.close(timeout=10)


def _resolve(out: _Outcomes, item: tuple[int, Any], timeout: float) -> None:
    lo, what = item
    if isinstance(what, BatchFuture):
        _resolve_batch(out, lo, what, timeout)
    else:
        _resolve_records(out, what, timeout)


def owner_main(options: dict[str, Any], conn: Any) -> None:
    """An owner process of its own (the owner-death row): creates the producer, hands
    its handle over, then waits to be killed (bounded)."""
    p = Producer(**options)
    conn.send((p.handle, p.sender_pid))
    conn.recv() if conn.poll(WAIT_S) else None
    p.close(timeout=10)


def scribbler_main(segment: str, limit: int, conn: Any) -> None:
    """A buggy process writing over batches the sender holds, queued and not yet sent
    (DESCRIPTOR state SEALED): flips bytes inside each record value's padding so the
    records still parse. Reports the (worker, seq) of every record it changed."""
    from shmprod.protocol.records import decode_batches

    seg = Segment.attach(segment)
    hit: list[tuple[int, int]] = []
    try:
        view = seg.view
        geo = L.read_geometry(view)
        deadline = time.monotonic() + 5
        done: set[int] = set()
        while len(done) < limit and time.monotonic() < deadline:
            for b in range(geo.n_buffers):
                d = geo.descriptor(b)
                if b in done or L.U32.unpack_from(view, d + L.D_STATE)[0] != L.BUF_SEALED:
                    continue
                length = L.U32.unpack_from(view, d + L.D_LENGTH)[0]
                start = geo.buffer(b)
                try:
                    batch = decode_batches(bytes(view[start : start + length]))[0]
                except Exception:
                    continue
                data = bytes(view[start : start + length])
                for rec in batch.records:
                    who = parse_value(rec.value)
                    if who is None or rec.value is None:
                        continue
                    at = data.find(rec.value)
                    if at > 0:
                        view[start + at + 11] = ord("!")  # the first padding byte
                        hit.append(who)
                done.add(b)
                if len(done) >= limit:
                    break
            time.sleep(0.005)
        del view
    finally:
        conn.send(hit)
        seg.close()


# =========================================================================================
# Reading the log back
# =========================================================================================


@dataclass(frozen=True)
class Landed:
    partition: int
    offset: int
    value: bytes | None


def read_topic(
    bootstrap: str, topic: str, partitions: int, timeout_s: float = 30.0
) -> list[Landed]:
    """Every record of ``topic`` (confluent-kafka), up to each partition's end.

    The end is taken from the high watermark: tansu reports the base offset of the last
    batch + 1 there (tansu-quirks), so reading stops once every partition returned an
    offset at or past ``watermark - 1`` and one more short poll brought nothing new.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"faultrig-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 20,
            "log_level": 3,
        }
    )
    out: list[Landed] = []
    try:
        tps = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)]
        ends = {}
        for p in range(partitions):
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            ends[p] = high - 1
        seen = dict.fromkeys(range(partitions), -1)
        consumer.assign(tps)
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            msgs = consumer.consume(num_messages=10_000, timeout=0.1)
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    raise KafkaException(err)
                p, off = msg.partition() or 0, msg.offset() or 0
                seen[p] = max(seen[p], off)
                out.append(Landed(p, off, msg.value()))
            if all(seen[p] >= ends[p] for p in seen):
                quiet = quiet + 1 if not msgs else 0
                if quiet >= 2:
                    break
    finally:
        consumer.close()
    return out


# =========================================================================================
# Counting
# =========================================================================================


@dataclass
class Tally:
    """What one row sent, what came back, and what the log holds."""

    fault: str
    sent: int = 0
    acked: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    no_outcome: int = 0  # futures of killed workers, or still pending at the end
    duplicated: int = 0
    lost: int = 0
    misplaced: int = 0
    foreign: int = 0
    failed_but_written: int = 0
    written_without_outcome: int = 0
    order_breaks: int = 0
    storage_lost: int = 0  # acknowledged by a broker that then restarted (memory storage)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def order_kept(self) -> bool:
        return self.order_breaks == 0

    def failed_text(self) -> str:
        parts = [f"{n} {name}" for name, n in sorted(self.failed.items())]
        parts += [f"{n} refused at the call ({name})" for name, n in sorted(self.refused.items())]
        if self.no_outcome:
            parts.append(
                f"{self.no_outcome} no outcome (killed worker; "
                f"{self.written_without_outcome} of them written)"
            )
        if self.failed_but_written:
            parts.append(f"{self.failed_but_written} of them written")
        return "; ".join(parts) if parts else "0"


def tally(
    fault: str,
    reports: dict[int, WorkerReport],
    dead: dict[int, int],
    landed: list[Landed],
    value_size: int,
    after: float = 0.0,
) -> Tally:
    """Counts one row. ``dead``: worker -> records it had handed over when it was killed
    (its futures died with it). ``after``: a monotonic time; records sent before it that
    were acknowledged and are missing count as ``storage_lost`` (a broker restart), not
    ``lost``."""
    t = Tally(fault)
    where: dict[tuple[int, int], list[Landed]] = {}
    for rec in landed:
        who = parse_value(rec.value)
        if who is None or rec.value != value_of(who[0], who[1], value_size):
            t.foreign += 1
            continue
        where.setdefault(who, []).append(rec)
    t.duplicated = sum(len(v) - 1 for v in where.values() if len(v) > 1)
    for w, rep in reports.items():
        st = rep.status
        t.sent += int(np.count_nonzero((st == ACKED) | (st == FAILED) | (st == PENDING)))
        t.acked += int(np.count_nonzero(st == ACKED))
        t.no_outcome += int(np.count_nonzero(st == PENDING))
        for idx, name in enumerate(rep.errors):
            failed = int(np.count_nonzero((rep.error == idx) & (st == FAILED)))
            refused = int(np.count_nonzero((rep.error == idx) & (st == REFUSED)))
            if failed:
                t.failed[name] += failed
            if refused:
                t.refused[name] += refused
        for seq in np.flatnonzero(st == ACKED).tolist():
            found = where.get((w, seq))
            if not found:
                if rep.sent_at[seq] < after:
                    t.storage_lost += 1
                else:
                    t.lost += 1
                continue
            part, off = int(rep.partition[seq]), int(rep.offset[seq])
            if rep.sent_at[seq] >= after and (
                found[0].partition != part or (off >= 0 and found[0].offset != off)
            ):
                t.misplaced += 1
        for seq in np.flatnonzero((st == FAILED) | (st == REFUSED)).tolist():
            if (w, seq) in where:
                t.failed_but_written += 1
    for w, handed in dead.items():
        t.sent += handed
        t.no_outcome += handed
        t.written_without_outcome += sum(1 for (ww, _s) in where if ww == w)
    # order: per worker and partition, seqs ascend in offset order
    by_wp: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (w, seq), recs in where.items():
        for r in recs:
            by_wp.setdefault((w, r.partition), []).append((r.offset, seq))
    for items in by_wp.values():
        items.sort()
        seqs = [s for _, s in items]
        t.order_breaks += sum(1 for a, b in itertools.pairwise(seqs) if b < a)
    return t


# =========================================================================================
# Rows
# =========================================================================================


@dataclass
class RowContext:
    """What a fault function may use. ``threads`` are joined (bounded) after the row."""

    broker: EmbeddedBroker
    topic: str
    proxy: KafkaProxy | None
    producer: Producer | None
    handle: Handle
    sender_pid: int
    owner: SpawnProcess | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def px(self) -> KafkaProxy:
        assert self.proxy is not None
        return self.proxy

    def later(self, fn: Callable[[], None]) -> None:
        th = threading.Thread(target=fn, daemon=True)
        th.start()
        self.threads.append(th)


Fault = Callable[[RowContext], None]

BASE_OPTIONS: dict[str, Any] = {
    "linger_ms": 2,
    "batch_size": 16 * 1024,
    "buffer_memory": 4 * 1024 * 1024,
    "retry_backoff_ms": 10,
    "retry_backoff_max_ms": 100,
    "request_timeout_ms": 3_000,
    "delivery_timeout_ms": 30_000,
    "max_block_ms": 10_000,
}


@dataclass
class Row:
    fault: str
    inject: Fault | None = None
    workers: int = 2
    records: int = 2_000
    pause_at: int = 600  # the fault comes when each worker reached this record
    window: int = 4  # chunks a worker keeps in flight
    result_timeout: float = 30.0  # a worker's wait for one chunk's outcome
    proxy: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    hooks: dict[int, HookSpec] = field(default_factory=dict)  # worker -> hook
    late_workers: int = 0  # attach after the fault (a dead worker left no lock behind)
    restart: bool = False  # the broker behind the proxy is the row's own (restarted)
    setup: Callable[[KafkaProxy, str], None] | None = None  # before the producer starts
    owner_process: bool = False  # the owner is a process of its own (killed)
    note: str = ""


def _proxy_faults() -> list[Row]:
    def not_leader(c: RowContext) -> None:
        c.px.fail_next(PRODUCE, 6, count=4)

    def timed_out(c: RowContext) -> None:
        c.px.fail_next(PRODUCE, 7, count=3)

    def not_enough_replicas(c: RowContext) -> None:
        c.px.fail_next(PRODUCE, 19, count=3, partitions=[1, 2])

    def drops(c: RowContext) -> None:
        def run() -> None:
            for _ in range(5):
                c.px.drop_connections()
                time.sleep(0.05)

        c.later(run)

    def stall(c: RowContext) -> None:
        for node in range(c.px.nodes):
            c.px.stall(node, 1.5)

    def slow(c: RowContext) -> None:
        def run() -> None:
            for node in range(c.px.nodes):
                c.px.delay_responses(node, 0.3)
            time.sleep(1.0)
            for node in range(c.px.nodes):
                c.px.delay_responses(node, 0)

        c.later(run)

    def moves(c: RowContext) -> None:
        for part in range(PARTITIONS):
            c.px.set_leader(c.topic, part, (part + 1) % c.px.nodes)
        c.px.fail_next(PRODUCE, 6, count=2)

    def too_large(c: RowContext) -> None:
        def run() -> None:  # like a broker's max.message.bytes, for 1 s
            c.px.set_max_message_bytes(3_000)
            time.sleep(1.0)
            c.px.set_max_message_bytes(None)

        c.later(run)

    def node_down(c: RowContext) -> None:
        c.px.take_down(1)

        def up() -> None:
            time.sleep(1.0)
            c.px.bring_up(1)

        c.later(up)

    return [
        Row("none (baseline)"),
        Row("NOT_LEADER_OR_FOLLOWER x4", not_leader),
        Row("REQUEST_TIMED_OUT x3", timed_out),
        Row("NOT_ENOUGH_REPLICAS x3 (2 of 6 partitions)", not_enough_replicas),
        Row("connections dropped x5", drops),
        Row(
            "every node stalled 1.5 s (request timeout 1 s)",
            stall,
            options={"request_timeout_ms": 1_000},
        ),
        Row("slow broker: answers delayed 300 ms for 1 s", slow),
        Row("leaders moved (+ NOT_LEADER x2)", moves),
        Row("node 1 down 1 s, then back", node_down),
        Row("MESSAGE_TOO_LARGE over 3000 B for 1 s (batches split)", too_large),
    ]


def _partitions_seen(c: RowContext, count: int) -> bool:
    """Waits (bounded) until the producer's topic table shows ``count`` partitions."""
    assert c.producer is not None
    producer = c.producer

    def seen() -> bool:
        depths = producer.stats()["topics"].get(c.topic, {}).get("queue_depth", [])
        return len(depths) == count

    return wait_until(seen, 10)


def _hide_growth(px: KafkaProxy, topic: str) -> None:
    px.show_partitions(topic, 2)


def _grow(c: RowContext) -> None:
    """The topic grows from 2 to 6 partitions while the workers send (every node
    stalled 0.3 s, so batches sealed before and after a worker saw the growth queue up
    together): the partitions it had keep one queue and one sequence space each."""

    def run() -> None:
        time.sleep(0.02)
        for node in range(c.px.nodes):
            c.px.stall(node, 0.3)
        c.px.show_partitions(c.topic, None)
        c.facts["growth_seen"] = _partitions_seen(c, PARTITIONS)

    c.later(run)


def _shrink(c: RowContext) -> None:
    """The topic loses partitions 3-5 (as if created again smaller) while batches for
    them are queued and in flight (every node stalled 0.5 s first)."""
    for node in range(c.px.nodes):
        c.px.stall(node, 0.5)
    c.px.show_partitions(c.topic, 3)

    def seen() -> None:
        c.facts["shrink_seen"] = _partitions_seen(c, 3)

    c.later(seen)


def _restart(c: RowContext) -> None:
    """tansu keeps topics in memory too: with clients shut out by the proxy, the broker
    restarts on its port and the topic is created again before anyone can ask Metadata
    (which would auto-create it with tansu's default of 4 partitions)."""
    c.marks["restart"] = time.monotonic()
    for node in range(c.px.nodes):
        c.px.take_down(node)
    c.broker.stop()
    c.broker.start()
    c.broker.create_topic(c.topic, PARTITIONS)
    for node in range(c.px.nodes):
        c.px.bring_up(node)


def _full_pool(c: RowContext) -> None:
    for node in range(c.px.nodes):
        c.px.stall(node, 1.5)


def _kill_sender(c: RowContext) -> None:
    c.marks["killed"] = time.monotonic()
    os.kill(c.sender_pid, signal.SIGKILL)


def _kill_owner(c: RowContext) -> None:
    assert c.owner is not None and c.owner.pid is not None
    c.marks["killed"] = time.monotonic()
    os.kill(c.owner.pid, signal.SIGKILL)


def _scribble_queued(c: RowContext) -> None:
    """Once the workers go on: shuts clients out (every node down) so sealed batches
    queue in the sender, lets a buggy process scribble over two of them, then brings the
    nodes back."""
    c.later(lambda: _scribble_queued_now(c))


def _scribble_queued_now(c: RowContext) -> None:
    for node in range(c.px.nodes):
        c.px.take_down(node)
    try:
        seg = Segment.attach(c.handle.segment)
        try:
            geo = L.read_geometry(seg.view)

            def queued() -> bool:
                n = 0
                for b in range(geo.n_buffers):
                    d = geo.descriptor(b)
                    n += L.U32.unpack_from(seg.view, d + L.D_STATE)[0] == L.BUF_SEALED
                return n >= 4

            wait_until(queued, 10)
        finally:
            seg.close()
        recv, send = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=scribbler_main, args=(c.handle.segment, 2, send))
        proc.start()
        try:
            c.facts["scribbled"] = recv.recv() if recv.poll(WAIT_S) else []
        finally:
            proc.join(WAIT_S)
            recv.close()
            send.close()
    finally:
        for node in range(c.px.nodes):
            c.px.bring_up(node)


def rows() -> list[Row]:
    """Every row of the matrix, in table order."""
    return [
        *_proxy_faults(),
        Row(
            "topic grows from 2 to 6 partitions",
            _grow,
            setup=_hide_growth,
            records=4_000,
            options={"metadata_max_age_ms": 200},
            note="growth",
        ),
        Row(
            "topic shrinks from 6 to 3 partitions (created again smaller)",
            _shrink,
            records=3_000,
            window=12,
            options={"metadata_max_age_ms": 200},
            note="shrink",
        ),
        Row(
            "broker restarted (memory storage: what it stored is gone)",
            _restart,
            restart=True,
            window=20,
            options={"request_timeout_ms": 2_000, "delivery_timeout_ms": 8_000},
            note="restart",
        ),
        Row(
            "full pool: 8 buffers, max_block_ms 300, broker stalled 1.5 s",
            _full_pool,
            options={
                "buffer_memory": 8 * 16 * 1024,
                "max_block_ms": 300,
                "request_timeout_ms": 5_000,
            },
        ),
        Row(
            "workers SIGKILLed mid-append (one sealing, one in send_batch)",
            None,
            workers=3,
            pause_at=-1,
            hooks={0: HookSpec("seal", 4, "kill"), 1: HookSpec("bulk", 3, "kill")},
            late_workers=1,
            note="kill",
        ),
        Row("sender SIGKILLed", _kill_sender, result_timeout=10, note="sender"),
        Row(
            "owner SIGKILLed",
            _kill_owner,
            proxy=False,
            owner_process=True,
            result_timeout=10,
            note="owner",
        ),
        Row(
            "scribble: a worker overwrites its batch after the CRC, before handing it over",
            None,
            pause_at=-1,
            hooks={0: HookSpec("sealed", 3, "scribble")},
        ),
        Row(
            "scribble: a process overwrites batches queued in the sender",
            _scribble_queued,
            note="scribble-queued",
        ),
    ]


# =========================================================================================
# Running a row
# =========================================================================================


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@contextlib.contextmanager
def _own_broker(shared: EmbeddedBroker, own: bool) -> Iterator[EmbeddedBroker]:
    if not own:
        yield shared
        return
    with EmbeddedBroker() as b:
        yield b


def run_row(row: Row, broker: EmbeddedBroker, topic: str) -> Tally:
    """Runs one row end to end and counts it. Leaves no process, segment or port behind."""
    t0 = time.monotonic()
    with _own_broker(broker, row.restart) as b:
        b.create_topic(topic, PARTITIONS)
        proxy = KafkaProxy(b.host, b.port, nodes=3) if row.proxy else None
        try:
            result = _run(row, b, topic, proxy)
        finally:
            if proxy is not None:
                proxy.close()
        landed = read_topic(b.bootstrap, topic, PARTITIONS)
    reports, dead, ctx, checks = result
    value_size = WorkerPlan(0, topic, 0).value_size
    after = ctx.marks.get("restart", 0.0)
    t = tally(row.fault, reports, dead, landed, value_size, after)
    t.checks.update(checks)
    t.seconds = time.monotonic() - t0
    for fact in ("growth_seen", "shrink_seen"):
        if fact in ctx.facts:
            t.checks[fact] = bool(ctx.facts[fact])
    scribbled = ctx.facts.get("scribbled")
    if scribbled is not None:
        t.checks["scribbled_some"] = bool(scribbled)
        t.notes.append(f"{len(scribbled)} records scribbled over in the sender's queue")
    return t


def _run(
    row: Row, b: EmbeddedBroker, topic: str, proxy: KafkaProxy | None
) -> tuple[dict[int, WorkerReport], dict[int, int], RowContext, dict[str, bool]]:
    options = {**BASE_OPTIONS, **row.options}
    options["bootstrap_servers"] = proxy.bootstrap if proxy is not None else b.bootstrap
    checks: dict[str, bool] = {}
    producer: Producer | None = None
    owner: SpawnProcess | None = None
    owner_conn: Any = None
    procs: dict[int, SpawnProcess] = {}
    try:
        if row.owner_process:
            owner_conn, child_conn = CTX.Pipe()
            owner = CTX.Process(target=owner_main, args=(options, child_conn))
            owner.start()
            child_conn.close()
            if not owner_conn.poll(WAIT_S):
                raise RuntimeError("the owner process did not start its producer")
            handle, sender_pid = owner_conn.recv()
        else:
            if row.setup is not None:
                assert proxy is not None
                row.setup(proxy, topic)
            producer = Producer(**options)
            handle, sender_pid = producer.handle, producer.sender_pid
        ctx = RowContext(b, topic, proxy, producer, handle, sender_pid, owner)
        reports_q = CTX.Queue()
        go = CTX.Event()
        n_all = row.workers + row.late_workers
        progress = CTX.RawArray("q", n_all)

        def spawn(w: int, pause_at: int) -> None:
            plan = WorkerPlan(
                w,
                topic,
                row.records,
                window=row.window,
                pause_at=pause_at,
                hook=row.hooks.get(w),
                result_timeout=row.result_timeout,
            )
            p = CTX.Process(target=worker_main, args=(handle, plan, reports_q, go, progress))
            p.start()
            procs[w] = p

        for w in range(row.workers):
            spawn(w, row.pause_at if row.inject is not None else -1)
        reports: dict[int, WorkerReport] = {}
        victims = set(row.hooks) if any(h.action == "kill" for h in row.hooks.values()) else set()
        if row.inject is not None:
            arrived: set[int] = set()
            deadline = time.monotonic() + WAIT_S
            while len(arrived) < row.workers and time.monotonic() < deadline:
                try:
                    msg = reports_q.get(timeout=0.2)
                except queue.Empty:
                    if any(p.exitcode is not None for p in procs.values()):
                        break  # a worker died before the barrier (its report will be missing)
                    continue
                if msg[0] == "arrived":
                    arrived.add(msg[1])
                else:
                    reports[msg[1]] = msg[2]
            row.inject(ctx)
        go.set()
        if victims:
            for w in victims:
                procs[w].join(WAIT_S)
            checks["victims_killed"] = all(procs[w].exitcode == -signal.SIGKILL for w in victims)
            for w in range(row.workers, n_all):
                spawn(w, -1)
        expected = set(range(n_all)) - victims
        deadline = time.monotonic() + WAIT_S
        while not expected <= set(reports) and time.monotonic() < deadline:
            try:
                msg = reports_q.get(timeout=0.5)
            except queue.Empty:
                if all(procs[w].exitcode is not None for w in expected - set(reports)):
                    break  # exited without a report (its traceback is on stderr)
                continue
            if msg[0] == "report":
                reports[msg[1]] = msg[2]
        checks["every_worker_reported"] = expected <= set(reports)
        for p in procs.values():
            p.join(WAIT_S)
        checks["workers_exited"] = all(p.exitcode is not None for p in procs.values())
        dead = {w: int(progress[w]) for w in victims}
        _after(row, ctx, producer, reports, checks)
        for th in ctx.threads:
            th.join(WAIT_S)
        reports_q.close()
        reports_q.join_thread()
        return reports, dead, ctx, checks
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(10)
        if producer is not None:
            producer.close(timeout=20)
        if owner is not None:
            if owner.is_alive():
                owner.kill()
            owner.join(10)
            owner_conn.close()


def _after(
    row: Row,
    ctx: RowContext,
    producer: Producer | None,
    reports: dict[int, WorkerReport],
    checks: dict[str, bool],
) -> None:
    """Row-specific checks once every worker is done."""
    if row.note == "kill" and producer is not None:
        producer.flush(timeout=30)
        stats: dict[str, Any] = {}

        def settled() -> bool:
            stats.update(producer.stats())
            pool = stats["pool"]
            # a spare is free too: any worker may claim it
            return bool(pool["buffers_free"] + pool["buffers_spare"] == pool["buffers_total"])

        checks["pool_all_free"] = wait_until(settled, 10)
        checks["workers_died_counted"] = stats["sender"]["workers_died"] == len(row.hooks)
        checks["buffers_reclaimed"] = stats["sender"]["buffers_reclaimed"] >= len(row.hooks)
        ctx.facts["stats"] = stats
    if row.note in ("sender", "owner"):
        killed = ctx.marks["killed"]
        last = max((r.resolved_at for r in reports.values()), default=killed)
        ctx.facts["resolved_after_s"] = last - killed
        checks["futures_failed_within_5s"] = last - killed < 5.0
        checks["sender_gone"] = wait_until(lambda: not _alive(ctx.sender_pid), 15)
    if row.note == "owner":
        checks["segment_removed"] = wait_until(
            lambda: not os.path.exists(f"/dev/shm/{ctx.handle.segment}"), 15
        )
        checks["socket_removed"] = not os.path.exists(ctx.handle.socket_path)


# =========================================================================================
# The table
# =========================================================================================


def table(tallies: Sequence[Tally]) -> str:
    lines = [
        "| fault | sent | acked | failed (error) | duplicated | lost | order kept |",
        "|---|---:|---:|---|---:|---:|:---:|",
    ]
    for t in tallies:
        lost = str(t.lost)
        if t.storage_lost:
            lost += f" (+{t.storage_lost} acked before the restart, gone with its storage)"
        if t.foreign:
            lost += f"; {t.foreign} records in the log nobody sent"
        lines.append(
            f"| {t.fault} | {t.sent} | {t.acked} | {t.failed_text()} | {t.duplicated} "
            f"| {lost} | {'yes' if t.order_kept else f'no ({t.order_breaks})'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the fault matrix and print its table")
    parser.add_argument("--table", metavar="FILE", help="also write the markdown table here")
    parser.add_argument("--only", help="run only rows whose name contains this")
    args = parser.parse_args(argv)
    tallies = []
    with EmbeddedBroker() as broker:
        for i, row in enumerate(rows()):
            if args.only and args.only not in row.fault:
                continue
            t = run_row(row, broker, f"matrix-{os.getpid()}-{i}")
            bad = [k for k, v in t.checks.items() if not v]
            print(
                f"{t.seconds:5.1f} s  {row.fault}  {t.failed_text()}  checks failed: {bad}",
                file=sys.stderr,
            )
            tallies.append(t)
    text = table(tallies)
    print(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
