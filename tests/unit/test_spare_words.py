"""Spare buffers: the atomic words in C, and the pool that keeps spares, over a plain
bytearray "segment" (claims made as a worker makes them, through the same C call)."""

from __future__ import annotations

import logging
import mmap
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import ipc, speedups
from shmprod import layout as L
from shmprod.sender.pool import SPARE_MIN_POOL, BufferPool, spare_target
from shmprod.sender.shmstate import SharedState
from shmprod.worker.append import claim_spares
from tests.support.segments import shared, stat

pytestmark = pytest.mark.skipif(
    speedups.claim_words is None, reason="spare buffers need the C extension"
)

WORD = 8


def _c() -> tuple[object, object, object]:
    assert speedups.claim_words and speedups.swap_word
    return speedups.claim_words, speedups.swap_word, speedups.write_word


def _words(buf: bytearray | mmap.mmap, n: int, stride: int = WORD) -> list[int]:
    return [int(L.U64.unpack_from(buf, i * stride)[0]) for i in range(n)]


# -- the C primitives -------------------------------------------------------------------


@given(
    st.lists(st.sampled_from([L.SPARE_WORD, L.FREE_WORD, 7, 2**64 - 1]), max_size=40),
    st.integers(0, 50),
    st.integers(0, 39),
)
def test_claim_words_swaps_only_expected_words_from_start_wrapping(
    words: list[int], count: int, start: int
) -> None:
    claim, _, _ = _c()
    n = len(words)
    stride = 16
    buf = bytearray(n * stride + 8)
    for i, w in enumerate(words):
        L.U64.pack_into(buf, i * stride, w)
    start = start % n if n else 0
    got = claim(memoryview(buf), 0, stride, n, L.SPARE_WORD, 99, count, start)  # type: ignore[operator]
    order = [(start + k) % n for k in range(n)]
    expected = [i for i in order if words[i] == L.SPARE_WORD][:count]
    assert got == expected
    after = _words(buf, n, stride)
    for i, w in enumerate(words):
        assert after[i] == (99 if i in expected else w)


def test_swap_and_store_word() -> None:
    _, swap, store = _c()
    buf = bytearray(32)
    view = memoryview(buf)
    store(view, 8, L.SPARE_WORD)  # type: ignore[operator]
    assert swap(view, 8, L.FREE_WORD, 5) == L.SPARE_WORD  # type: ignore[operator]
    assert _words(buf, 4)[1] == L.SPARE_WORD  # not expected: unchanged
    assert swap(view, 8, L.SPARE_WORD, 5) == L.SPARE_WORD  # type: ignore[operator]
    assert _words(buf, 4)[1] == 5


@pytest.mark.parametrize("off", [-8, 25, 28, 3])
def test_words_outside_or_unaligned_are_refused(off: int) -> None:
    claim, swap, store = _c()
    view = memoryview(bytearray(32))
    with pytest.raises(ValueError):
        swap(view, off, 0, 1)  # type: ignore[operator]
    with pytest.raises(ValueError):
        store(view, off, 1)  # type: ignore[operator]
    with pytest.raises(ValueError):
        claim(view, off, 8, 1, 0, 1, 1, 0)  # type: ignore[operator]
    with pytest.raises(ValueError):
        claim(view, 0, 8, 5, 0, 1, 1, 0)  # type: ignore[operator]  # 5 words in 32 bytes
    with pytest.raises(TypeError):
        store(b"read-only bytes.", 0, 1)  # type: ignore[operator]


def test_processes_claiming_at_once_each_get_distinct_words() -> None:
    """Four processes claim from the same shared words until none are left: every spare
    goes to exactly one of them."""
    claim, _, _ = _c()
    n = 4096
    shared = mmap.mmap(-1, n * WORD)
    for i in range(n):
        L.U64.pack_into(shared, i * WORD, L.SPARE_WORD)
    children = []
    for slot in range(4):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            mine: list[int] = []
            word = L.descriptor_word(L.BUF_GRANTED, slot)
            while got := claim(shared, 0, WORD, n, L.SPARE_WORD, word, 3, 0):  # type: ignore[operator]
                mine += got
            os.write(w, " ".join(map(str, mine)).encode())
            os._exit(0)
        os.close(w)
        children.append((pid, r, slot))
    claimed: dict[int, list[int]] = {}
    for pid, r, slot in children:
        with os.fdopen(r, "rb") as f:
            claimed[slot] = [int(x) for x in f.read().split()]
        assert os.waitpid(pid, 0)[1] == 0
    every = sorted(i for got in claimed.values() for i in got)
    assert every == list(range(n))  # each word claimed once, by one process
    words = _words(shared, n)
    for slot, got in claimed.items():
        assert all(words[i] == L.descriptor_word(L.BUF_GRANTED, slot) for i in got)
    shared.close()


def test_descriptor_word_round_trips_state_and_owner() -> None:
    for state, owner in [(L.BUF_SPARE, -1), (L.BUF_GRANTED, 0), (L.BUF_GRANTED, 255)]:
        word = L.descriptor_word(state, owner)
        assert word & 0xFFFFFFFF == state
        assert L.word_owner(word) == owner
    buf = bytearray(L.DESCRIPTOR_SIZE)
    L.U64.pack_into(buf, L.D_WORD, L.descriptor_word(L.BUF_GRANTED, 7))
    assert L.U32.unpack_from(buf, L.D_STATE)[0] == L.BUF_GRANTED
    assert L.I32.unpack_from(buf, L.D_OWNER)[0] == 7


def test_claimed_message_round_trips() -> None:
    for buffers in [(), (0,), (3, 4, 511)]:
        msg = ipc.Claimed(buffers)
        assert ipc.MessageReader().feed(ipc.encode(msg)) == [msg]


# -- the pool ---------------------------------------------------------------------------


def worker_claims(s: SharedState, slot: int, count: int) -> list[int]:
    """What a worker's flush does: the same call, the same words."""
    return claim_spares(s.view, s.geo, slot, count)


def spares_in_memory(s: SharedState) -> list[int]:
    return [b for b in range(s.geo.n_buffers) if s.word(b) == L.SPARE_WORD]


def test_spare_target_is_an_eighth_and_none_in_a_small_pool() -> None:
    assert spare_target(512) == 64
    assert spare_target(SPARE_MIN_POOL - 1) == 0
    assert spare_target(SPARE_MIN_POOL) == SPARE_MIN_POOL // 8


def test_pool_keeps_spares_and_a_worker_claims_them_without_asking() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    assert pool.n_spare == 8 and spares_in_memory(s) == sorted(spares_in_memory(s))
    assert len(spares_in_memory(s)) == 8
    assert pool.n_free == 64 and stat(s, L.S_BUFFERS_FREE) == 64
    assert stat(s, L.S_BUFFERS_SPARE) == 8
    got = worker_claims(s, 2, 3)
    assert len(got) == 3
    assert pool.claim(owner=10, slot=2, buffers=tuple(got)) == []
    assert sorted(pool.granted(10)) == got
    assert pool.n_spare == 8  # topped up again
    assert pool.n_free == 61
    for b in got:  # granted like any Grant: sealed, then freed
        assert pool.seal(10, b, 1)
        pool.free(b, 1)
    assert pool.n_free == 64


def test_pool_refuses_claims_of_buffers_that_were_not_spares_taken_by_that_slot() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    got = worker_claims(s, 1, 1)
    not_spare = next(b for b in range(64) if b not in got and s.word(b) != L.SPARE_WORD)
    seen: dict[int, str] = {}
    assert pool.claim(owner=10, slot=2, buffers=(got[0],), seen=seen) == [got[0]]  # another's
    # the warning gets the descriptor as the refusal saw it (slot 1's word)
    assert seen == {
        got[0]: f"word {L.descriptor_word(L.BUF_GRANTED, 1):#x}, run 1, partition slot -1, "
        "batch 0, length 0, 0 records"
    }
    seen.clear()
    assert pool.claim(owner=10, slot=2, buffers=(not_spare, 999), seen=seen) == [not_spare, 999]
    assert seen == {}  # neither was a spare
    assert pool.explain(999) == "999: outside the pool" and pool.holder(-1) == "outside the pool"
    assert pool.explain(got[0]) == f"{got[0]}: spare, word {s.word(got[0]):#x}"
    assert pool.granted(10) == {}
    assert pool.claim(owner=11, slot=1, buffers=(got[0],)) == []


def test_the_pool_frees_only_what_the_sender_holds() -> None:
    """A free of a buffer the sender does not hold -- spare, claimed, granted, or freed
    already -- raises and changes nothing: freeing it would give a buffer a worker
    writes into to another (a second free of a batch's buffer after it became a spare
    would overwrite a worker's claim word with FREE)."""
    s = shared(64)
    pool = BufferPool(s, spares=8)
    claimed = worker_claims(s, 1, 1)[0]
    grant = pool.alloc(7, 3, 1, run=1, count=1, now_ns=0)
    assert grant is not None
    granted = grant.buffers[0]
    pool.alloc(8, 0, 2, run=1, count=56, now_ns=0)  # takes the spares back: one claimed
    spare = spares_in_memory(s)[0]  # made again once nothing waits
    assert pool.holder(claimed) == "claimed" and pool.holder(granted) == "granted"
    assert pool.holder(spare) == "spare"
    for b, held in ((claimed, "claimed"), (granted, "granted"), (spare, "spare")):
        words = [s.word(i) for i in range(64)]
        with pytest.raises(ValueError, match=f"the sender's expected, found {held}"):
            pool.free(b, 1)
        assert pool.holder(b) == held and [s.word(i) for i in range(64)] == words
    assert pool.claim(owner=2, slot=1, buffers=(claimed,)) == []
    assert pool.seal(2, claimed, 1) and pool.holder(claimed) == "the sender"
    pool.free(claimed, 1)
    with pytest.raises(ValueError, match="double free"):
        pool.free(claimed, 1)
    assert pool.is_free(claimed)


def test_a_request_takes_the_spares_back_and_none_are_kept_while_one_waits() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    first = pool.alloc(1, 0, 1, run=1, count=56, now_ns=0)  # all the free list has
    assert first is not None and len(first.buffers) == 56 and pool.n_spare == 8
    assert pool.alloc(1, 0, 2, run=1, count=10, now_ns=0) is None  # spares back, waits
    assert pool.n_waiting == 1 and pool.n_free == 8
    assert pool.n_spare == 0 and spares_in_memory(s) == []
    assert worker_claims(s, 3, 1) == []  # nothing to claim while a request waits
    assert pool.seal(1, first.buffers[0], 1) and pool.seal(1, first.buffers[1], 1)
    assert pool.free(first.buffers[0], 1) == [] and pool.n_spare == 0  # 9 of 10
    served = pool.free(first.buffers[1], 1)
    assert [len(r.buffers) for r in served] == [10]
    assert pool.n_waiting == 0


def test_a_spare_claimed_before_the_sender_takes_it_back_goes_to_its_claimer() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    got = worker_claims(s, 3, 2)  # Claimed not read yet
    pool.alloc(1, 0, 1, run=1, count=62, now_ns=0)  # takes the spares back
    assert pool.n_spare == 0
    assert pool.claim(owner=7, slot=3, buffers=tuple(got)) == []
    assert sorted(pool.granted(7)) == got


def test_a_worker_that_goes_frees_its_spares_announced_or_not() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    announced = worker_claims(s, 1, 2)
    assert pool.claim(owner=5, slot=1, buffers=tuple(announced)) == []
    assert len(worker_claims(s, 1, 1)) == 1  # then the spares are taken back
    assert pool.alloc(2, 0, 1, run=1, count=56, now_ns=0) is not None
    assert pool.n_spare == 1  # a quarter of the 5 left
    assert len(worker_claims(s, 1, 1)) == 1  # still in the spare set when it goes
    reclaimed, _ = pool.reclaim(5, slot=1)
    assert reclaimed == 4 and pool.granted(5) == {}
    assert pool.n_free == 64 - 56
    assert not [b for b in range(64) if s.word(b) == L.descriptor_word(L.BUF_GRANTED, 1)]


def test_a_scribbled_spare_word_is_freed_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    b = spares_in_memory(s)[0]
    L.U64.pack_into(s.view, s.geo.descriptor(b) + L.D_WORD, 12345)
    with caplog.at_level(logging.WARNING, "shmprod.sender"):
        pool.close()
    assert "holds no claim" in caplog.text
    assert pool.n_spare == 0 and pool.n_free == 64 and spares_in_memory(s) == []
    assert s.word(b) == L.FREE_WORD


def test_close_takes_the_spares_back() -> None:
    s = shared(64)
    pool = BufferPool(s, spares=8)
    pool.close()
    assert pool.n_spare == 0 and spares_in_memory(s) == []
    assert stat(s, L.S_BUFFERS_SPARE) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("acfrgkxh"), st.integers(0, 3), st.integers(1, 9))))
def test_every_buffer_has_exactly_one_holder_whatever_the_order(
    ops: list[tuple[str, int, int]],
) -> None:
    """Allocs (single buffers, and runs of 3 whose head a shorter batch takes), claims
    (announced at once or later), frees, releases and workers gone, in any order: each
    buffer is free, spare, granted to one worker, claimed but not yet announced, or the
    sender's (sealed) -- never two of these, never none."""
    s = shared(32)
    pool = BufferPool(s, spares=4)
    sealed: list[tuple[int, int]] = []  # (first buffer, run)
    unannounced: dict[int, list[int]] = {slot: [] for slot in range(4)}
    for op, slot, n in ops:
        owner = 100 + slot
        if op == "a":
            pool.alloc(owner, slot, 1, 1, n, 0)
        elif op == "c":
            got = worker_claims(s, slot, n)
            assert pool.claim(owner, slot, tuple(got)) == []
        elif op == "k":
            unannounced[slot] += worker_claims(s, slot, n)
        elif op == "r" and unannounced[slot]:
            assert pool.claim(owner, slot, tuple(unannounced[slot])) == []
            unannounced[slot] = []
        elif op == "h":  # a run of 3; a batch of 1 or 2 buffers takes its head
            got = pool.alloc(owner, slot, 1, 3, 1, 0)
            if got is not None and got.buffers:
                head = 1 + n % 2
                assert pool.seal(owner, got.buffers[0], head)
                sealed.append((got.buffers[0], head))
        elif op == "f":  # the first buffer of each grant (the head of a run, or a single)
            held = sorted(pool.granted(owner))[:n]
            for b in held:
                assert pool.seal(owner, b, 1)
                sealed.append((b, 1))
            while sealed and len(sealed) > n:
                pool.free(*sealed.pop(0))
        elif op == "g":
            pool.reclaim(owner, slot)
            unannounced[slot] = []
        granted = [
            b for o in range(100, 104) for f, r in pool.granted(o).items() for b in range(f, f + r)
        ]
        claimed = [b for bs in unannounced.values() for b in bs]
        free = [b for b in range(32) if pool.is_free(b)]
        spare = spares_in_memory(s)
        sender = [b for f, r in sealed for b in range(f, f + r)]
        holders = granted + claimed + free + spare + sender
        assert sorted(holders) == list(range(32)), (op, slot, n)
        # the sender's holder map says the same (a claim not yet announced: spare, or
        # claimed once the sender tried to take it back)
        assert all(pool.holder(b) == "granted" for b in granted)
        assert all(pool.holder(b) in ("spare", "claimed") for b in claimed)
        assert all(pool.holder(b) == "spare" for b in spare)
        assert all(pool.holder(b) == "the sender" for b in sender)
        if op == "x":  # a free of any buffer the sender does not hold changes nothing
            b = n * 3 + slot
            if b not in sender:
                with pytest.raises(ValueError):
                    pool.free(b, 1)
        # the sender counts a claimed spare as spare until the Claimed is read
        assert pool.n_free == len(free) + pool.n_spare and len(spare) <= pool.n_spare
    for slot in range(4):
        pool.reclaim(100 + slot, slot)
    for f, r in sealed:
        pool.free(f, r)
    assert pool.n_free == 32


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=8, max_size=8))
def test_any_word_scribbled_over_the_spares_is_read_safely(words: list[int]) -> None:
    """Words read back from shared memory are untrusted: whatever the spares hold when
    the sender takes them back, each buffer ends up free or kept for a worker slot that
    exists, and the pool's counts still add up."""
    s = shared(64)
    pool = BufferPool(s, spares=8)
    spares = spares_in_memory(s)
    for b, w in zip(spares, words, strict=True):
        L.U64.pack_into(s.view, s.geo.descriptor(b) + L.D_WORD, w)
    logging.getLogger("shmprod.sender").disabled = True
    try:
        pool.close()
    finally:
        logging.getLogger("shmprod.sender").disabled = False
    kept = [b for b in spares if not pool.is_free(b)]
    for b in kept:
        claimer = L.word_owner(s.word(b))
        assert 0 <= claimer < s.geo.max_workers
        assert s.word(b) & 0xFFFFFFFF in (L.BUF_GRANTED, L.BUF_OPEN, L.BUF_SEALED, L.BUF_CONT)
    assert pool.n_free == 64 - len(kept) and pool.n_spare == 0
    for slot in range(s.geo.max_workers):
        pool.reclaim(1000 + slot, slot)
    assert pool.n_free == 64
