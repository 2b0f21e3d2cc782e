"""Every write the sender makes to shared memory, in one place.

The sender is the single writer of HEADER state fields, STATS, TOPIC and PARTITION
slots, a WORKER slot's identity fields, and the DESCRIPTOR of every buffer it owns (free,
sealed, in flight). Offsets come from :mod:`shmprod.layout` (Geometry methods + field
constants); nothing here computes a layout offset of its own.

Readers in other processes (``stats()``, workers) may see a value one update old, never
a torn one: every field is an aligned 4- or 8-byte store.
"""

from __future__ import annotations

from shmprod import layout as L
from shmprod import speedups


class SharedState:
    """The sender's view of the segment. Runs in: sender (the only writer of what it
    writes, so no lock is needed)."""

    __slots__ = ("_stats", "_stats_base", "geo", "view")

    def __init__(self, view: memoryview, geo: L.Geometry) -> None:
        self.view = view
        self.geo = geo
        self._stats_base = geo.stats
        # Local mirror of STATS: the sender is the only writer, so it never re-reads.
        self._stats: dict[int, int] = {off: 0 for _, off in L.STATS_FIELDS}
        for _, off in L.STATS_FIELDS:
            L.U64.pack_into(view, self._stats_base + off, 0)

    # -- HEADER ------------------------------------------------------------------------

    def set_sender_identity(self, pid: int, start_us: int) -> None:
        """Writes H_SENDER_PID / H_SENDER_START_US. Runs in: sender."""
        L.U64.pack_into(self.view, L.H_SENDER_PID, pid)
        L.U64.pack_into(self.view, L.H_SENDER_START_US, start_us)

    def set_state(self, state: int, fatal_code: int = 0) -> None:
        """Writes H_STATE (and H_FATAL_CODE first when failing). Runs in: sender."""
        if fatal_code:
            L.I32.pack_into(self.view, L.H_FATAL_CODE, fatal_code)
        L.U32.pack_into(self.view, L.H_STATE, state)

    def state(self) -> int:
        return int(L.U32.unpack_from(self.view, L.H_STATE)[0])

    def begin_table_write(self) -> None:
        """Makes H_METADATA_EPOCH odd: the topic table is being written (a seqlock).

        Readers that see an odd epoch, or a different epoch after reading, read again.
        Runs in: sender.
        """
        epoch = int(L.U64.unpack_from(self.view, L.H_METADATA_EPOCH)[0])
        if epoch % 2 == 0:
            speedups.write_word(self.view, L.H_METADATA_EPOCH, epoch + 1)

    def bump_metadata_epoch(self) -> int:
        """Ends a topic table change: H_METADATA_EPOCH to the next even value.

        Runs in: sender.
        """
        epoch = int(L.U64.unpack_from(self.view, L.H_METADATA_EPOCH)[0])
        epoch += 1 if epoch % 2 else 2
        speedups.write_word(self.view, L.H_METADATA_EPOCH, epoch)
        return epoch

    # -- STATS ---------------------------------------------------------------------------

    def add(self, field: int, n: int = 1) -> None:
        """Adds ``n`` to the STATS counter at ``field`` (an ``S_*`` constant)."""
        v = self._stats[field] + n
        self._stats[field] = v
        speedups.write_word(self.view, self._stats_base + field, v if v > 0 else 0)

    def set(self, field: int, value: int) -> None:
        """Sets a STATS gauge (buffers_free, requests_in_flight, ...); an unchanged one is
        not written again."""
        if self._stats[field] == value:
            return
        self._stats[field] = value
        speedups.write_word(self.view, self._stats_base + field, value if value > 0 else 0)

    def get(self, field: int) -> int:
        return self._stats[field]

    # -- WORKER slots --------------------------------------------------------------------

    def claim_worker_slot(self, slot: int, pid: int, start_us: int) -> None:
        """Zeroes a WORKER slot and records its new holder, before Welcome hands it over.

        Runs in: sender; the slot is nobody's until the worker reads Welcome.
        """
        off = self.geo.worker(slot)
        self.view[off : off + L.WORKER_SLOT_SIZE] = bytes(L.WORKER_SLOT_SIZE)
        L.U64.pack_into(self.view, off + L.W_PID, pid)
        L.U64.pack_into(self.view, off + L.W_START_US, start_us)
        L.U32.pack_into(self.view, off + L.W_STATE, L.WORKER_ACTIVE)

    def set_worker_state(self, slot: int, state: int) -> None:
        """Writes W_STATE (FREE after Bye, DEAD after a death). Runs in: sender."""
        L.U32.pack_into(self.view, self.geo.worker(slot) + L.W_STATE, state)

    # -- TOPIC slots ---------------------------------------------------------------------

    def write_topic(
        self, slot: int, *, name: str, state: int, n_partitions: int, base: int, error: int
    ) -> None:
        """Publishes a TOPIC slot. Order matters for a concurrent reader: name, then the
        partition base, then the count, then error and state (see metadata.py).

        Runs in: sender (the only writer of the topic table).
        """
        self.begin_table_write()
        off = self.geo.topic(slot)
        raw = name.encode("utf-8")[: L.MAX_TOPIC_NAME]
        self.view[off + L.T_NAME : off + L.T_NAME + len(raw)] = raw
        L.U16.pack_into(self.view, off + L.T_NAME_LEN, len(raw))
        L.U32.pack_into(self.view, off + L.T_PARTITION_BASE, base)
        L.U32.pack_into(self.view, off + L.T_N_PARTITIONS, n_partitions)
        L.I32.pack_into(self.view, off + L.T_ERROR, error)
        L.U32.pack_into(self.view, off + L.T_STATE, state)

    # -- PARTITION slots -----------------------------------------------------------------

    def init_partition(self, slot: int, leader: int, home: int) -> None:
        """Zeroes a PARTITION slot, sets its leader and its home slot (itself, or the
        first slot of its topic-partition: see layout.P_HOME). Runs in: sender."""
        off = self.geo.partition(slot)
        self.view[off : off + L.PARTITION_SLOT_SIZE] = bytes(L.PARTITION_SLOT_SIZE)
        L.I32.pack_into(self.view, off + L.P_LEADER, leader)
        L.U32.pack_into(self.view, off + L.P_HOME, home)

    def set_leader(self, slot: int, leader: int) -> None:
        L.I32.pack_into(self.view, self.geo.partition(slot) + L.P_LEADER, leader)

    def set_queue_depth(self, slot: int, depth: int) -> None:
        L.U32.pack_into(self.view, self.geo.partition(slot) + L.P_QUEUE_DEPTH, depth)

    def set_partition_in_flight(self, slot: int, n: int) -> None:
        L.U32.pack_into(self.view, self.geo.partition(slot) + L.P_IN_FLIGHT, n)

    def set_partition_error(self, slot: int, code: int) -> None:
        L.I32.pack_into(self.view, self.geo.partition(slot) + L.P_LAST_ERROR, code)

    def add_partition_sent(self, slot: int, records: int, nbytes: int) -> None:
        """Counts one acknowledged batch in its PARTITION slot. Runs in: sender."""
        off = self.geo.partition(slot)
        view = self.view
        for field, n in (
            (L.P_BATCHES_SENT, 1),
            (L.P_RECORDS_SENT, records),
            (L.P_BYTES_SENT, nbytes),
        ):
            total = int(L.U64.unpack_from(view, off + field)[0]) + n
            speedups.write_word(view, off + field, total)

    # -- DESCRIPTORS ---------------------------------------------------------------------

    def describe_run(self, first: int, run: int, state: int, owner: int) -> None:
        """Writes D_STATE/D_OWNER/D_RUN of a run: ``state`` on its first buffer, CONT (or
        FREE when freeing) on the others; D_PARTITION -1 when freeing or granting. Runs
        in: sender, for buffers it owns or is handing over (the grant message that
        follows is the barrier)."""
        view = self.view
        geo = self.geo
        write = speedups.write_word
        freeing = state == L.BUF_FREE
        word = L.descriptor_word(state, owner)
        rest = L.descriptor_word(L.BUF_FREE if freeing else L.BUF_CONT, owner)
        clear = freeing or state == L.BUF_GRANTED
        place = L.place_word(-1, 1 if freeing else run)
        start = geo.descriptor(first)
        stop = geo.descriptor(first + run - 1) + L.DESCRIPTOR_SIZE  # checks the run's end
        for off in range(start, stop, L.DESCRIPTOR_SIZE):
            if clear:
                write(view, off + L.D_PLACE, place)
            else:
                L.U32.pack_into(view, off + L.D_RUN, run)
            write(view, off + L.D_WORD, word)
            word = rest

    def describe_batch(
        self, buffer: int, state: int, partition: int, batch_id: int, length: int, count: int
    ) -> None:
        """Records a sealed batch in its first buffer's DESCRIPTOR. Runs in: sender, once
        Sealed made the buffer the sender's."""
        off = self.geo.descriptor(buffer)
        view = self.view
        speedups.write_word(view, off + L.D_WORD, L.descriptor_word(state, -1))
        L.I32.pack_into(view, off + L.D_PARTITION, partition)
        L.U64.pack_into(view, off + L.D_BATCH_ID, batch_id)
        L.U32.pack_into(view, off + L.D_LENGTH, length)
        L.U32.pack_into(view, off + L.D_RECORD_COUNT, count)

    def created_ns(self, buffer: int) -> int:
        """When the worker opened the batch in ``buffer`` (its DESCRIPTOR's monotonic
        clock reading; CLOCK_MONOTONIC is one clock for every process of the host).
        Written by the worker, so untrusted: callers clamp it. Runs in: sender, once
        Sealed made the buffer the sender's."""
        return int(L.U64.unpack_from(self.view, self.geo.descriptor(buffer) + L.D_CREATED_NS)[0])

    def set_descriptor_state(self, buffer: int, state: int) -> None:
        """A sealed batch's state (SEALED, IN_FLIGHT), owner -1 (the sender's) as
        :meth:`describe_batch` left it. Runs in: sender, for a buffer it holds."""
        speedups.write_word(
            self.view, self.geo.descriptor(buffer) + L.D_WORD, L.descriptor_word(state, -1)
        )

    # -- spare buffers: a DESCRIPTOR's word changed atomically (C only) -------------------

    def make_spare(self, buffer: int) -> None:
        """Describes a free buffer as SPARE (any worker may claim it): run 1, no
        partition, then state and owner in one atomic store with release ordering, so a
        worker whose swap sees SPARE sees the rest too. Runs in: sender, for a free
        buffer it owns."""
        off = self.geo.descriptor(buffer)
        speedups.write_word(self.view, off + L.D_PLACE, L.place_word(-1, 1))
        speedups.write_word(self.view, off + L.D_WORD, L.SPARE_WORD)

    def take_back_spare(self, buffer: int) -> int:
        """Swaps a SPARE buffer's word to FREE (the sender's again), atomically. Returns
        the word seen: SPARE_WORD when taken back; any other word (a worker's claim, or
        a scribble) is left as it is. Runs in: sender."""
        assert speedups.swap_word is not None
        return speedups.swap_word(
            self.view, self.geo.descriptor(buffer) + L.D_WORD, L.SPARE_WORD, L.FREE_WORD
        )

    def descriptor_text(self, buffer: int) -> str:
        """A buffer's DESCRIPTOR fields after its word, for a warning. Runs in: sender."""
        off = self.geo.descriptor(buffer)
        view = self.view
        return (
            f"run {L.U32.unpack_from(view, off + L.D_RUN)[0]}, "
            f"partition slot {L.I32.unpack_from(view, off + L.D_PARTITION)[0]}, "
            f"batch {L.U64.unpack_from(view, off + L.D_BATCH_ID)[0]}, "
            f"length {L.U32.unpack_from(view, off + L.D_LENGTH)[0]}, "
            f"{L.U32.unpack_from(view, off + L.D_RECORD_COUNT)[0]} records"
        )

    def word(self, buffer: int) -> int:
        """A buffer's D_WORD (state and owner) as it is now. Runs in: sender."""
        return speedups.read_word(self.view, self.geo.descriptor(buffer) + L.D_WORD)
