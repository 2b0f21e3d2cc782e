"""The buffer pool's free list, grants and waiting allocations: sender memory only.

The sender owns every FREE buffer. A worker asks ``Alloc(request_id, run, count)``: count
runs of ``run`` adjacent buffers each. The answer is all or nothing: one ``Grant`` with
``count`` first-buffers, or a refusal (``error`` set), never a partial grant.

Allocation policy (documented contract):

- First fit: the lowest-numbered free run that fits. The free map is a ``bytearray``
  (1 = free) so ``find`` scans it in C; single buffers come from the low end, which keeps
  the high end contiguous for large runs, and several of them as one adjacent block
  where the pool has one (a worker may seal adjacent single buffers as one run).
- Waiting requests form ONE strict FIFO. A request is served only when every request
  before it has been served. A large run at the head therefore holds back single-buffer
  requests behind it until enough adjacent buffers free up: runs are never starved by a
  stream of small requests (Java's BufferPool does the same with its waiter deque). The
  price is head-of-line blocking while a large run waits; the workers bound every wait
  with ``max_block_ms``.
- A request that can never be satisfied is refused at once: a run longer than the pool
  (RecordTooLargeError code) or more buffers in total than the pool holds
  (BufferExhaustedError code: ask in smaller chunks).

- Spare buffers: while no request waits, up to ``spares`` free buffers (made while
  they are a quarter of what is free at most) are described SPARE in shared memory. A
  worker short of buffers claims one by swapping its DESCRIPTOR word from SPARE to
  GRANTED by its slot (an atomic compare-and-swap: one claimer wins) and tells the
  sender with ``Claimed`` before it seals the buffer; a flush never waits for a Grant
  while spares last, however late the sender runs (a flush of runs of several buffers
  takes adjacent ones while it finds them). The sender takes its spares back the same
  way (SPARE to FREE) before a request would wait, so the FIFO above holds: no spare
  exists while anyone waits. A spare whose swap back fails was claimed; it is the
  claimer's once its ``Claimed`` is read, or freed when that worker goes without
  sending it.

Grants are tracked per worker connection (``owner``) so a dead worker's unsealed
buffers come back (:meth:`BufferPool.reclaim`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from shmprod import layout as L
from shmprod import speedups
from shmprod.errors import BufferExhaustedError, ProducerClosedError, RecordTooLargeError
from shmprod.sender.shmstate import SharedState

# The holder map: one byte per buffer, who holds it as far as the sender knows. Every
# change of hands checks the byte it expects, so a buffer is never freed, granted or
# made spare while another holds it.
FREE = 1  # on the free list (``find`` scans it for runs of FREE)
SENDER = 0  # the sender's: just taken from the free list, or a sealed batch's
GRANTED = 2  # a worker's: granted to it, or claimed by it and its Claimed read
SPARE = 3  # described SPARE in shared memory (a worker may have claimed it since)
CLAIMED = 4  # found claimed when the sender took its spares back; its Claimed not read
_HOLDERS = {
    FREE: "free",
    SENDER: "the sender",
    GRANTED: "granted",
    SPARE: "spare",
    CLAIMED: "claimed",
}
SPARE_MIN_POOL = 16  # a smaller pool keeps no spares: every buffer goes through the FIFO

log = logging.getLogger("shmprod.sender")

# what a spare's state can be once a worker claimed it
_CLAIMED_STATES = frozenset((L.BUF_GRANTED, L.BUF_OPEN, L.BUF_SEALED, L.BUF_CONT))


def spare_target(n_buffers: int) -> int:
    """The spares a pool of ``n_buffers`` keeps ready: an eighth of it; none in a pool of
    fewer than SPARE_MIN_POOL buffers, or without the C extension (no atomic swap)."""
    if speedups.claim_words is None or speedups.swap_word is None or n_buffers < SPARE_MIN_POOL:
        return 0
    return n_buffers // 8


@dataclass(slots=True)
class AllocResult:
    """A Grant to send: to connection ``owner``, for its request ``request_id``."""

    owner: int
    request_id: int
    run: int
    error: int
    buffers: tuple[int, ...] = ()


@dataclass(slots=True)
class _Waiter:
    owner: int
    owner_slot: int
    request_id: int
    run: int
    count: int
    since_ns: int


class BufferPool:
    """Free list + grants + FIFO of waiters. Runs in: sender (its own memory; DESCRIPTOR
    and STATS writes go through :class:`SharedState`, no lock needed)."""

    def __init__(self, shared: SharedState, spares: int = 0) -> None:
        self._shared = shared
        self.n_buffers = shared.geo.n_buffers
        self._held = bytearray([FREE]) * self.n_buffers  # the holder map (above)
        self._n_free = self.n_buffers
        self._waiters: deque[_Waiter] = deque()
        # owner -> {first buffer: run} of runs granted and not yet sealed or released
        self._grants: dict[int, dict[int, int]] = {}
        self._spare_target = spares
        self._spare: set[int] = set()  # described SPARE: free, claimable without asking
        # buffer -> worker slot: spares a worker claimed before the sender took them
        # back, whose Claimed is not read yet
        self._claimed: dict[int, int] = {}
        self.closed = False
        for b in range(self.n_buffers):
            shared.describe_run(b, 1, L.BUF_FREE, -1)
        self._publish()

    # -- queries -------------------------------------------------------------------------

    @property
    def n_free(self) -> int:
        """Buffers nobody holds: the free list and the spares."""
        return self._n_free + len(self._spare)

    @property
    def n_spare(self) -> int:
        return len(self._spare)

    @property
    def n_waiting(self) -> int:
        return len(self._waiters)

    def granted(self, owner: int) -> dict[int, int]:
        """The runs (first -> run) currently granted to ``owner``."""
        return dict(self._grants.get(owner, {}))

    def is_free(self, buffer: int) -> bool:
        return self._held[buffer] == FREE

    def holder(self, buffer: int) -> str:
        """Who holds ``buffer`` as far as the sender knows (for messages and tests)."""
        if not 0 <= buffer < self.n_buffers:
            return "outside the pool"
        return _HOLDERS[self._held[buffer]]

    def explain(self, buffer: int) -> str:
        """``buffer``'s holder and its DESCRIPTOR word, for a warning about it."""
        if not 0 <= buffer < self.n_buffers:
            return f"{buffer}: outside the pool"
        return f"{buffer}: {self.holder(buffer)}, word {self._shared.word(buffer):#x}"

    # -- allocation ----------------------------------------------------------------------

    def alloc(
        self, owner: int, owner_slot: int, request_id: int, run: int, count: int, now_ns: int
    ) -> AllocResult | None:
        """Grants now, refuses now, or queues the request (returns None: answered later
        from :meth:`free`)."""
        if self.closed:
            return AllocResult(owner, request_id, run, ProducerClosedError.code)
        if run < 1 or count < 1 or run > self.n_buffers:
            return AllocResult(owner, request_id, run, RecordTooLargeError.code)
        if run * count > self.n_buffers:
            return AllocResult(owner, request_id, run, BufferExhaustedError.code)
        if not self._waiters:
            firsts = self._take_any(run, count)
            if firsts is not None:
                return self._grant(owner, owner_slot, request_id, run, firsts)
        self._waiters.append(_Waiter(owner, owner_slot, request_id, run, count, now_ns))
        self._publish()
        return None

    def _take(self, run: int, count: int) -> list[int] | None:
        """First-fit ``count`` runs of ``run``; the sender's now, or takes nothing. Several
        single buffers come as one adjacent block when the pool has one, so a worker can
        put a large batch in adjacent buffers of its stock (see :meth:`seal`)."""
        if self._n_free < run * count:
            return None
        free = self._held
        if run == 1 and count > 1:
            block = free.find(bytes([FREE]) * count)
            if block >= 0:
                free[block : block + count] = bytes(count)
                self._n_free -= count
                return list(range(block, block + count))
        pattern = bytes([FREE]) * run
        firsts: list[int] = []
        pos = 0
        while len(firsts) < count:
            first = free.find(pattern, pos)
            if first < 0:
                for f in firsts:  # undo: all or nothing
                    free[f : f + run] = pattern
                return None
            free[first : first + run] = bytes(run)
            firsts.append(first)
            pos = first + run
        self._n_free -= run * count
        return firsts

    def _take_any(self, run: int, count: int) -> list[int] | None:
        """:meth:`_take`, taking the spares back first when the free list is short: a
        request never waits while spares are kept."""
        firsts = self._take(run, count)
        if firsts is None and self._spare:
            self._unspare_all()
            firsts = self._take(run, count)
        return firsts

    def _grant(
        self, owner: int, owner_slot: int, request_id: int, run: int, firsts: list[int]
    ) -> AllocResult:
        grants = self._grants.setdefault(owner, {})
        for first in firsts:
            grants[first] = run
            self._hand(first, run, SENDER, GRANTED)
            self._shared.describe_run(first, run, L.BUF_GRANTED, owner_slot)
        self._publish()
        return AllocResult(owner, request_id, run, 0, tuple(firsts))

    def _serve(self) -> list[AllocResult]:
        """Serves waiters from the head while they fit (strict FIFO)."""
        out: list[AllocResult] = []
        while self._waiters:
            w = self._waiters[0]
            firsts = self._take_any(w.run, w.count)
            if firsts is None:
                break
            self._waiters.popleft()
            out.append(self._grant(w.owner, w.owner_slot, w.request_id, w.run, firsts))
        if not out:
            self._publish()
        return out

    # -- ownership changes ---------------------------------------------------------------

    def seal(self, owner: int, first: int, run: int) -> bool:
        """A worker hands ``first`` (a run of ``run`` it was granted) to the sender.

        The run was granted as one; or is the head of a longer run granted as one (a
        worker put a shorter batch in it: the rest stays granted to ``owner`` as single
        buffers, which its ``Release`` in the same write gives back); or is ``run``
        adjacent single buffers granted to ``owner`` (a worker joins buffers of its stock
        for a large batch). Returns False, changing nothing, if it is none of these.
        """
        grants = self._grants.get(owner)
        if grants is None:
            return False
        granted = grants.get(first, 0)
        if granted == run:
            del grants[first]
        elif granted > run >= 1:
            del grants[first]
            for b in range(first + run, first + granted):
                grants[b] = 1
        elif run < 2 or any(grants.get(b) != 1 for b in range(first, first + run)):
            return False
        else:
            for b in range(first, first + run):
                del grants[b]
        self._hand(first, run, GRANTED, SENDER)
        return True

    def release(self, owner: int, first: int, run: int) -> list[AllocResult] | None:
        """A worker gives a granted run back unused; None if it was not granted to it."""
        if not self.seal(owner, first, run):
            return None
        return self.free(first, run)

    def free(self, first: int, run: int) -> list[AllocResult]:
        """Returns a run the sender holds to the free list; answers the waiters it
        unblocks. A run the sender does not hold (freed twice, or granted, spare or
        claimed) raises ValueError, changing nothing: freeing it would hand a buffer a
        worker writes into to another."""
        self._hand(first, run, SENDER, FREE)
        self._n_free += run
        self._shared.describe_run(first, run, L.BUF_FREE, -1)
        return self._serve()

    def reclaim(self, owner: int, slot: int | None = None) -> tuple[int, list[AllocResult]]:
        """Takes back every run granted to ``owner`` and drops its waiting requests; with
        its worker ``slot``, the spares it claimed too, announced or not.

        Returns (buffers reclaimed, grants now possible for others). Runs in: sender,
        after ``owner``'s control connection ended (a dead worker, or Bye).
        """
        self.drop_waiters(owner)
        grants = self._grants.pop(owner, {})
        if slot is not None:
            for b in [b for b in self._spare if self._claimer(b) == slot]:
                self._spare.discard(b)
                self._hand(b, 1, SPARE, GRANTED)
                grants[b] = 1
            for b in [b for b, s in self._claimed.items() if s == slot]:
                del self._claimed[b]
                self._hand(b, 1, CLAIMED, GRANTED)
                grants[b] = 1
        n = 0
        served: list[AllocResult] = []
        for first, run in sorted(grants.items()):
            self._hand(first, run, GRANTED, SENDER)
            n += run
            served.extend(self.free(first, run))
        served.extend(self._serve())
        return n, served

    # -- spare buffers -------------------------------------------------------------------

    def claim(
        self, owner: int, slot: int, buffers: tuple[int, ...], seen: dict[int, str] | None = None
    ) -> list[int]:
        """``owner`` (worker ``slot``) says it claimed ``buffers`` (``Claimed``): each one
        that was a spare and whose word names the slot is now granted to it. Returns
        the others (nothing changed for them); ``seen`` gets, for each spare among
        them, its DESCRIPTOR as it was when refused (a worker may change it right
        after), for the warning."""
        grants = self._grants.setdefault(owner, {})
        refused: list[int] = []
        for b in buffers:
            word = self._shared.word(b) if b in self._spare else None
            if word is not None and self._claimer(b, word) == slot:
                self._spare.discard(b)
                self._hand(b, 1, SPARE, GRANTED)
            elif self._claimed.get(b) == slot:
                del self._claimed[b]
                self._hand(b, 1, CLAIMED, GRANTED)
            else:
                refused.append(b)
                if word is not None and seen is not None:
                    seen[b] = f"word {word:#x}, {self._shared.descriptor_text(b)}"
                continue
            grants[b] = 1
        self._publish()
        return refused

    def _unspare_all(self) -> None:
        """Every spare back to the free list (swapped SPARE to FREE). One a worker claimed
        meanwhile waits for its Claimed (or its worker's end); a word that is neither
        spare nor a worker's claim was scribbled over, and the buffer is simply free."""
        for b in sorted(self._spare):
            seen = self._shared.take_back_spare(b)
            if seen != L.SPARE_WORD:
                claimer = self._claimer(b, seen)
                if claimer is not None:
                    self._claimed[b] = claimer
                    self._hand(b, 1, SPARE, CLAIMED)
                    continue
                log.warning("spare buffer %d holds no claim (word %#x): freed", b, seen)
                self._shared.describe_run(b, 1, L.BUF_FREE, -1)
            self._hand(b, 1, SPARE, FREE)
            self._n_free += 1
        self._spare.clear()

    def _hand(self, first: int, run: int, holder: int, to: int) -> None:
        """Hands ``run`` buffers from ``first`` on from ``holder`` to ``to`` in the holder
        map; ValueError, changing nothing, when any of them is not ``holder``'s."""
        held = self._held
        if held[first : first + run] != bytes([holder]) * run:
            states = sorted({_HOLDERS[h] for h in held[first : first + run]})
            what = "double free" if to == FREE and states == ["free"] else "a change of hands"
            raise ValueError(
                f"{what} of buffer run {first}+{run}: {_HOLDERS[holder]}'s expected, "
                f"found {', '.join(states)}"
            )
        held[first : first + run] = bytes([to]) * run

    def _claimer(self, buffer: int, word: int | None = None) -> int | None:
        """The worker slot that claimed spare ``buffer``, from its word (read now when
        not given): its owner, with a state only a worker writes after a claim
        (GRANTED, then OPEN, SEALED or CONT as it writes the batch); None otherwise."""
        if word is None:
            word = self._shared.word(buffer)
        owner = L.word_owner(word)
        if word & 0xFFFFFFFF in _CLAIMED_STATES and 0 <= owner < self._shared.geo.max_workers:
            return owner
        return None

    def _refill(self) -> None:
        """Tops the spares up while no request waits: up to the target, new ones only
        while they stay a quarter of the buffers nobody holds at most. (Spares left when
        the free list empties stay: a request takes them back first.)"""
        if not self._spare_target or self._waiters or self.closed:
            return
        want = min(self._spare_target, self.n_free // 4) - len(self._spare)
        if want <= 0:
            return
        firsts = self._take(1, want)
        if firsts is None:
            return
        for b in firsts:
            self._hand(b, 1, SENDER, SPARE)
            self._shared.make_spare(b)
            self._spare.add(b)

    def drop_waiters(self, owner: int) -> None:
        if any(w.owner == owner for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if w.owner != owner)
            self._publish()

    def close(self) -> list[AllocResult]:
        """Stops granting: every waiter is refused with ProducerClosedError's code, and
        the spares are taken back."""
        self.closed = True
        self._unspare_all()
        out = [
            AllocResult(w.owner, w.request_id, w.run, ProducerClosedError.code)
            for w in self._waiters
        ]
        self._waiters.clear()
        self._publish()
        return out

    def _publish(self) -> None:
        self._refill()
        self._shared.set(L.S_BUFFERS_FREE, self.n_free)
        self._shared.set(L.S_BUFFERS_SPARE, len(self._spare))
        self._shared.set(L.S_ALLOC_WAITERS, len(self._waiters))
