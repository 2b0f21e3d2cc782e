"""A DESCRIPTOR's state and owner, and the 8-byte counters, change by whole words: a
process reading them while another writes sees the old word or the new one, never a mix.

struct.pack_into zeroes a field before it writes it, so a worker sealing a spare it
claimed (GRANTED by its slot) showed the sender, reading the Claimed at that moment,
owner 0 (``0x1``: GRANTED by slot 0) or state FREE: the claim was refused and the batch
failed with CorruptBatchError, or a spare taken back at that moment was freed while the
worker wrote it. These tests read the words from another process while they are written.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from shmprod import layout as L
from shmprod import speedups
from shmprod.sender.shmstate import SharedState
from shmprod.worker.append import describe_batch

SLOT = 3
GEO = L.Geometry(n_buffers=4, buffer_size=1024, max_workers=8, max_topics=4, max_partitions=16)
WATCH_S = 1.0


class _NotZero:
    def __contains__(self, word: int) -> bool:
        return word != 0


def _watch(raw: Any, offsets: list[int], allowed: Any, ready: Any, stop: Any, out: Any) -> None:
    """Reads the words at ``offsets`` until ``stop`` is set; puts the ones not allowed.
    Runs in: a spawned process."""
    mem = memoryview(raw).cast("B")
    seen: set[int] = set()
    reads = 0
    ready.set()
    while not stop.is_set() and len(seen) < 16:
        for off in offsets:
            w = speedups.read_word(mem, off)
            if w not in allowed:
                seen.add(w)
        reads += 1
    out.put((sorted(seen), reads))


def _run(write: Any, offsets: list[int], allowed: Any) -> tuple[list[int], int, int]:
    """Calls ``write(view)`` in a loop for WATCH_S while another process reads."""
    ctx = mp.get_context("spawn")
    raw = ctx.RawArray("B", GEO.segment_size)
    view = memoryview(raw).cast("B")
    write(view)
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_watch, args=(raw, offsets, allowed, ready, stop, out))
    reader.start()
    writes = 0
    try:
        assert ready.wait(60), "the reader did not start"
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            for _ in range(200):
                write(view)
            writes += 200
    finally:
        stop.set()
        seen, reads = out.get(timeout=30)
        reader.join(10)
        view.release()
    return seen, reads, writes


def test_a_worker_sealing_a_claimed_spare_never_shows_another_owner() -> None:
    head, cont = GEO.descriptor(1) + L.D_WORD, GEO.descriptor(2) + L.D_WORD
    granted = L.descriptor_word(L.BUF_GRANTED, SLOT)

    def seal(view: memoryview) -> None:
        speedups.write_word(view, head, granted)  # claimed again, as a spare is
        speedups.write_word(view, cont, granted)
        describe_batch(view, GEO, SLOT, 1, 2, 5, 7, 100, 3, time.monotonic_ns())

    allowed = {granted, L.descriptor_word(L.BUF_SEALED, SLOT), L.descriptor_word(L.BUF_CONT, SLOT)}
    seen, reads, writes = _run(seal, [head, cont], allowed)
    assert reads > 1000 and writes > 1000
    assert not seen, [hex(w) for w in seen]


@pytest.mark.parametrize("state", [L.BUF_GRANTED, L.BUF_FREE])
def test_the_sender_describing_a_run_never_shows_a_word_between(state: int) -> None:
    """The sender's grants and frees: each buffer's word goes from the one it had to the
    one described, nothing between (a worker claims a buffer whose word it reads)."""
    offsets = [GEO.descriptor(b) + L.D_WORD for b in range(GEO.n_buffers)]
    owner = SLOT if state == L.BUF_GRANTED else -1
    shared: list[SharedState] = []

    def describe(view: memoryview) -> None:
        if not shared:
            shared.append(SharedState(view, GEO))
        s = shared[0]
        s.describe_run(0, GEO.n_buffers, L.BUF_SEALED, -1)
        s.describe_run(0, GEO.n_buffers, state, owner)

    allowed = {
        0,
        L.descriptor_word(L.BUF_SEALED, -1),
        L.descriptor_word(L.BUF_CONT, -1),
        L.descriptor_word(state, owner),
        L.descriptor_word(L.BUF_FREE if state == L.BUF_FREE else L.BUF_CONT, owner),
    }
    seen, reads, writes = _run(describe, offsets, allowed)
    assert reads > 1000 and writes > 1000
    assert not seen, [hex(w) for w in seen]


def test_counters_never_read_zero_between_two_values() -> None:
    """The sender's STATS gauges and the topic table's epoch: a reader sees the old value
    or the new one, not the 0 ``struct.pack_into`` would write first."""
    offsets = [GEO.stats + L.S_BUFFERS_FREE, L.H_METADATA_EPOCH]
    shared: list[SharedState] = []

    def update(view: memoryview) -> None:
        if not shared:
            shared.append(SharedState(view, GEO))
        s = shared[0]
        s.set(L.S_BUFFERS_FREE, 3)
        s.set(L.S_BUFFERS_FREE, 5)
        s.begin_table_write()
        s.bump_metadata_epoch()

    seen, reads, writes = _run(update, offsets, _NotZero())
    assert reads > 1000 and writes > 1000
    assert not seen, [hex(w) for w in seen]
