"""``shmprod stats``: a running producer's counters, read-only, from any process of its
user: a live view, JSON for scripts, or Prometheus/OpenMetrics text to scrape.

A snapshot maps the segment read-only (``mmap`` with ``PROT_READ``): it never attaches
as a worker, takes no slot and changes nothing the producer counts (a host producer's
idle timer included). Every field is one writer's aligned counter, so a value may be one
update old but is never torn (see :mod:`shmprod.worker.shmstats`); the header's
geometry is checked against the segment's size before anything else is read.

Runs in: any process of the producer's user (``shmprod stats``, a metrics endpoint).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Final, TextIO

from shmprod import layout as L
from shmprod import shm
from shmprod.errors import ShmprodError
from shmprod.worker import shmstats
from shmprod.worker.cause import alive

__all__ = ["live_producers", "serve_metrics", "snapshot", "watch"]


class StatsError(ShmprodError):
    """No producer to read: not found, not this user's, or not a shmprod segment."""


def _path(name: str) -> str:
    base = os.path.basename(name)
    if not base.startswith(shm.NAME_PREFIX):
        raise StatsError(f"{name!r} is not a shmprod segment name ({shm.NAME_PREFIX}...)")
    return os.path.join(shm.SHM_DIR, base)


def live_producers() -> list[str]:
    """The segments of this user's producers whose owner or sender runs."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(shm.SHM_DIR))
    except OSError:
        return out
    for name in names:
        if not name.startswith(shm.NAME_PREFIX):
            continue
        try:
            snap = snapshot(name, topics=False)
        except StatsError:
            continue
        if snap["alive"]:
            out.append(name)
    return out


def snapshot(segment: str, *, topics: bool = True) -> dict[str, Any]:
    """Every counter of the producer in ``segment`` (a name, or its /dev/shm path):
    the sender's, the pool's, each attached process's, and (``topics``) each
    partition's queue. Raises :class:`StatsError` when it cannot be read."""
    path = _path(segment)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StatsError(f"no producer {os.path.basename(path)!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StatsError(f"{os.path.basename(path)!r} belongs to another user")
        if st.st_size < L.HEADER_SIZE:
            raise StatsError(f"{os.path.basename(path)!r} is not a shmprod segment")
        with mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            try:
                return _read(view, os.path.basename(path), topics)
            finally:
                view.release()
    except (OSError, ValueError) as exc:
        raise StatsError(f"cannot read {os.path.basename(path)!r}: {exc}") from None
    finally:
        os.close(fd)


def _read(view: memoryview, name: str, topics: bool) -> dict[str, Any]:
    try:
        geo = L.read_geometry(view)
    except L.LayoutError as exc:
        raise StatsError(f"{name!r}: {exc}") from None
    owner = int(L.U64.unpack_from(view, L.H_OWNER_PID)[0])
    owner_start = int(L.U64.unpack_from(view, L.H_OWNER_START_US)[0])
    sender = shmstats.read_sender_stats(view, geo)
    sender_start = int(L.U64.unpack_from(view, L.H_SENDER_START_US)[0])
    workers = []
    for slot in range(geo.max_workers):
        base = geo.worker(slot)
        if L.U32.unpack_from(view, base + L.W_STATE)[0] != L.WORKER_ACTIVE:
            continue
        counters = shmstats.read_worker(view, geo, slot)
        workers.append(
            {"slot": slot, "pid": int(L.U64.unpack_from(view, base + L.W_PID)[0]), **counters}
        )
    out: dict[str, Any] = {
        "segment": name,
        "owner_pid": owner,
        "alive": alive(owner, owner_start)
        or bool(sender["sender_pid"] and alive(int(sender["sender_pid"]), sender_start)),
        "sender": sender,
        "pool": shmstats.read_pool(view, geo),
        "workers": workers,
    }
    if topics:
        out["topics"] = shmstats.read_topics(view, geo)
    return out


# ----------------------------------------------------------------------------------
# the live view
# ----------------------------------------------------------------------------------


def _rates(prev: dict[str, Any] | None, cur: dict[str, Any], dt: float) -> tuple[float, float]:
    if prev is None or dt <= 0:
        return 0.0, 0.0
    records = cur["sender"]["records_sent"] - prev["sender"]["records_sent"]
    nbytes = cur["sender"]["bytes_sent"] - prev["sender"]["bytes_sent"]
    return records / dt, nbytes / dt


def render(snap: dict[str, Any], records_s: float, bytes_s: float) -> str:
    """One screen of the live view."""
    s, p = snap["sender"], snap["pool"]
    used = p["buffers_total"] - p["buffers_free"]
    lines = [
        f"producer {snap['segment']}  owner pid {snap['owner_pid']}  sender pid "
        f"{s['sender_pid']} ({s['state']})",
        f"sent {s['records_sent']:,} records, {s['bytes_sent'] / 1e6:,.1f} MB  |  "
        f"{records_s:,.0f} records/s, {bytes_s / 1e6:,.2f} MB/s",
        f"requests in flight {s['requests_in_flight']}  batches in flight "
        f"{s['batches_in_flight']}  retries {s['retries']}  errors {s['errors']}  "
        f"failed batches {s['batches_failed']}",
        f"pool {used}/{p['buffers_total']} buffers in use ({used / max(p['buffers_total'], 1):.0%})"
        f" of {p['buffer_size'] // 1024} KiB; waiting allocations {s['alloc_waiters']}",
        f"attached processes {len(snap['workers'])}: "
        + ", ".join(str(w["pid"]) for w in snap["workers"]),
    ]
    for topic, parts in sorted(snap.get("topics", {}).items()):
        depth = parts.get("queue_depth", [])
        lines.append(f"  {topic}: queue depth per partition {depth}")
    return "\n".join(lines)


def watch(
    segment: str,
    *,
    interval_s: float = 1.0,
    count: int | None = None,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """Prints snapshots every ``interval_s`` (``count`` of them, or until Ctrl-C or the
    producer is gone): the live view on a terminal (redrawn in place), else one block
    (or, ``as_json``, one JSON object) per line. Returns an exit status."""
    prev: dict[str, Any] | None = None
    t_prev = time.monotonic()
    shown = 0
    tty = out.isatty() and not as_json
    try:
        while count is None or shown < count:
            try:
                snap = snapshot(segment)
            except StatsError as exc:
                if shown:
                    out.write(f"\nthe producer is gone ({exc})\n")
                    return 0
                raise
            now = time.monotonic()
            records_s, bytes_s = _rates(prev, snap, now - t_prev)
            prev, t_prev = snap, now
            if as_json:
                snap["records_per_s"], snap["bytes_per_s"] = records_s, bytes_s
                out.write(json.dumps(snap, sort_keys=True) + "\n")
            else:
                text = render(snap, records_s, bytes_s)
                out.write(("\x1b[H\x1b[2J" if tty else "") + text + "\n" + ("" if tty else "\n"))
            out.flush()
            shown += 1
            if count is not None and shown >= count:
                break
            time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    return 0


# ----------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------

_PREFIX: Final = "shmprod"
_COUNTERS: Final = (
    "records_sent",
    "bytes_sent",
    "batches_sent",
    "batches_failed",
    "requests_sent",
    "retries",
    "errors",
    "workers_died",
    "buffers_reclaimed",
    "metadata_refreshes",
)
_GAUGES: Final = ("requests_in_flight", "batches_in_flight", "alloc_waiters", "workers_attached")


class _Collector:
    """A prometheus_client collector that reads a snapshot at each scrape."""

    def __init__(self, segment: str) -> None:
        self.segment = segment

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            snap = snapshot(self.segment)
        except StatsError:
            return
        labels = ["segment"]
        seg = [snap["segment"]]
        s = snap["sender"]
        for name in _COUNTERS:
            c = CounterMetricFamily(f"{_PREFIX}_{name}", f"sender {name}", labels=labels)
            c.add_metric(seg, float(s[name]))
            yield c
        for name in _GAUGES:
            g = GaugeMetricFamily(f"{_PREFIX}_{name}", f"sender {name}", labels=labels)
            g.add_metric(seg, float(s[name]))
            yield g
        pool = GaugeMetricFamily(
            f"{_PREFIX}_pool_buffers", "pool buffers by state", labels=["segment", "state"]
        )
        for key, value in snap["pool"].items():
            if key.startswith("buffers_") and key != "buffers_total":
                pool.add_metric([*seg, key.removeprefix("buffers_")], float(value))
        yield pool
        queued = GaugeMetricFamily(
            f"{_PREFIX}_partition_queued_batches",
            "batches waiting in the sender's queue per partition",
            labels=["segment", "topic", "partition"],
        )
        for topic, parts in snap.get("topics", {}).items():
            for p, depth in enumerate(parts.get("queue_depth", [])):
                queued.add_metric([*seg, topic, str(p)], float(depth))
        yield queued


def serve_metrics(segment: str, port: int, addr: str = "127.0.0.1") -> Any:
    """Serves the producer's counters as Prometheus/OpenMetrics text on
    ``http://addr:port/metrics`` (a daemon thread; the ``metrics`` extra). Returns the
    server (``shutdown()`` stops it)."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry
    except ImportError as exc:
        raise StatsError(
            f"metrics need prometheus_client ({exc}): pip install 'shmprod[metrics]'"
        ) from None
    snapshot(segment, topics=False)  # a wrong segment fails here, not at the first scrape
    registry = CollectorRegistry()
    registry.register(_Collector(segment))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
