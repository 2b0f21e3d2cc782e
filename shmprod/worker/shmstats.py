"""Reading the producer's counters out of shared memory, from any attached process.

Every counter has one writer (STATS and PARTITION slots: the sender; a WORKER slot: its
worker; a DESCRIPTOR: the buffer's current owner). Readers take aligned 8- or 4-byte
values, so a value may be one update old but never torn. Region copies are taken with
``bytes(...)`` so no numpy view of the segment outlives the call.

Runs in: any attached process; no lock needed (read-only, single-writer fields).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmprod import layout as L

__all__ = [
    "WORKER_FIELDS",
    "batching",
    "read_pool",
    "read_sender_stats",
    "read_topics",
    "read_worker",
]

WORKER_FIELDS = (
    ("records_appended", L.W_RECORDS_APPENDED),
    ("bytes_appended", L.W_BYTES_APPENDED),
    ("batches_sealed", L.W_BATCHES_SEALED),
    ("send_errors", L.W_SEND_ERRORS),
    ("records_acked", L.W_RECORDS_ACKED),
    ("records_failed", L.W_RECORDS_FAILED),
    ("buffer_waits", L.W_BUFFER_WAITS),
    ("buffer_wait_ns", L.W_BUFFER_WAIT_NS),
    ("buffer_waits_pool_half_free", L.W_BUFFER_WAITS_POOL_FREE),
    ("spares_claimed", L.W_SPARES_CLAIMED),
)

_BUF_STATES = ("free", "granted", "open", "sealed", "in_flight", "cont", "spare")
_STATES = ("starting", "running", "closing", "closed", "failed")


def read_sender_stats(seg: memoryview, geo: L.Geometry) -> dict[str, Any]:
    """The sender's STATS counters and the producer's HEADER state."""
    base = geo.stats
    out: dict[str, Any] = {
        name: L.U64.unpack_from(seg, base + off)[0] for name, off in L.STATS_FIELDS
    }
    state = L.U32.unpack_from(seg, L.H_STATE)[0]
    out["state"] = _STATES[state] if state < len(_STATES) else str(state)
    out["sender_pid"] = L.U64.unpack_from(seg, L.H_SENDER_PID)[0]
    out["metadata_epoch"] = L.U64.unpack_from(seg, L.H_METADATA_EPOCH)[0]
    return out


def read_worker(seg: memoryview, geo: L.Geometry, slot: int) -> dict[str, int]:
    """The counters of WORKER slot ``slot``."""
    base = geo.worker(slot)
    out = {name: int(L.U64.unpack_from(seg, base + off)[0]) for name, off in WORKER_FIELDS}
    out["slot"] = slot
    return out


def read_pool(seg: memoryview, geo: L.Geometry) -> dict[str, int]:
    """How many pool buffers are in each DESCRIPTOR state, plus the pool's geometry."""
    n = geo.n_buffers
    raw = bytes(seg[geo.descriptors : geo.descriptors + n * L.DESCRIPTOR_SIZE])
    states = np.frombuffer(raw, dtype="<u4").reshape(n, L.DESCRIPTOR_SIZE // 4)[:, L.D_STATE // 4]
    counts = np.bincount(np.minimum(states, len(_BUF_STATES)), minlength=len(_BUF_STATES) + 1)
    out = {f"buffers_{name}": int(counts[i]) for i, name in enumerate(_BUF_STATES)}
    out["buffers_total"] = n
    out["buffer_size"] = geo.buffer_size
    return out


def read_topics(seg: memoryview, geo: L.Geometry) -> dict[str, dict[str, list[int]]]:
    """Per READY topic of the metadata table: each partition's sender queue depth,
    batches in flight, batches and records sent, and last error."""
    out: dict[str, dict[str, list[int]]] = {}
    for slot in range(geo.max_topics):
        off = geo.topic(slot)
        if L.U32.unpack_from(seg, off + L.T_STATE)[0] != L.TOPIC_READY:
            continue
        n = L.U32.unpack_from(seg, off + L.T_N_PARTITIONS)[0]
        base = L.U32.unpack_from(seg, off + L.T_PARTITION_BASE)[0]
        name_len = min(L.U16.unpack_from(seg, off + L.T_NAME_LEN)[0], L.MAX_TOPIC_NAME)
        name = bytes(seg[off + L.T_NAME : off + L.T_NAME + name_len]).decode("utf-8", "replace")
        if n == 0 or base + n > geo.max_partitions:
            continue
        homes = [L.U32.unpack_from(seg, geo.partition(base + i) + L.P_HOME)[0] for i in range(n)]
        if any(h >= geo.max_partitions for h in homes):
            continue
        # a partition's counters live in its home slot (an older range after growth)
        slots = b"".join(
            bytes(seg[geo.partition(h) : geo.partition(h) + L.PARTITION_SLOT_SIZE]) for h in homes
        )
        words = np.frombuffer(slots, dtype="<u4").reshape(n, L.PARTITION_SLOT_SIZE // 4)
        longs = np.frombuffer(slots, dtype="<u8").reshape(n, L.PARTITION_SLOT_SIZE // 8)
        out[name] = {
            "queue_depth": words[:, L.P_QUEUE_DEPTH // 4].tolist(),
            "in_flight": words[:, L.P_IN_FLIGHT // 4].tolist(),
            "last_error": words[:, L.P_LAST_ERROR // 4].view("<i4").tolist(),
            "batches_sent": longs[:, L.P_BATCHES_SENT // 8].tolist(),
            "records_sent": longs[:, L.P_RECORDS_SENT // 8].tolist(),
        }
    return out


def batching(worker: dict[str, Any], sender: dict[str, Any]) -> dict[str, float]:
    """How well records are batched, to spot a degenerate pattern at a glance: records
    per batch (this process, and the whole producer), batches per produce request, and
    how often and how long this process waited for the sender to grant buffers (it
    should not while the pool has room: ``buffer_waits_pool_half_free``), and how many
    spare buffers it claimed instead of waiting."""

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else 0.0

    return {
        "records_per_batch": ratio(worker["records_appended"], worker["batches_sealed"]),
        "producer_records_per_batch": ratio(sender["records_sent"], sender["batches_sent"]),
        "batches_per_request": ratio(sender["batches_requested"], sender["requests_sent"]),
        "buffer_waits": worker["buffer_waits"],
        "buffer_wait_ms": round(worker["buffer_wait_ns"] / 1e6, 3),
        "buffer_waits_pool_half_free": worker["buffer_waits_pool_half_free"],
        "spares_claimed": worker["spares_claimed"],
    }
