"""The shared-memory layout: the only module that knows where anything lives.

One segment per producer, created (mode 0600, unguessable name) by the owner and
unlinked by the sender as it exits after the owner's Shutdown or death (the owner
unlinks it too, in case the sender could not). Every region starts on a 64-byte cache
line (the buffer data on a page); every field is a named offset within its region.

::

    offset 0          ┌──────────────────────────────────────────────┐
                      │ HEADER   (HEADER_SIZE)                       │ geometry, owner and
                      │  magic, version, geometry, pids, state       │ sender identity, state
    STATS             ├──────────────────────────────────────────────┤
                      │ STATS    (STATS_SIZE) counters, sender-only  │ written by the sender
    WORKERS           ├──────────────────────────────────────────────┤
                      │ WORKER slot x max_workers (WORKER_SLOT_SIZE) │ each written by its
                      │  state, pid, start time, append counters     │ worker only
    TOPICS            ├──────────────────────────────────────────────┤
                      │ TOPIC slot x max_topics (TOPIC_SLOT_SIZE)    │ metadata table:
                      │  state, partitions, first partition slot,    │ written by the sender
                      │  error, name                                 │ only, read by workers
    PARTITIONS        ├──────────────────────────────────────────────┤
                      │ PARTITION slot x max_partitions              │ leader, queue depth,
                      │  (PARTITION_SLOT_SIZE)                       │ counters: sender-only
    DESCRIPTORS       ├──────────────────────────────────────────────┤
                      │ DESCRIPTOR x n_buffers (DESCRIPTOR_SIZE)     │ written by the buffer's
                      │  state, owner, partition, batch id, length   │ current owner
    DATA (page)       ├──────────────────────────────────────────────┤
                      │ buffer 0 | buffer 1 | ... (buffer_size each) │ RecordBatch bytes; a
                      │                                              │ run of adjacent buffers
                      │                                              │ holds a large batch
                      └──────────────────────────────────────────────┘

Ownership instead of locks: the sender owns the free list (in its own memory) and
grants buffers to a worker over the control socket; the worker alone writes a granted
buffer until it hands the sealed batch back (``SEALED``); then the sender alone reads
it until the batch completes and the buffer is free again. A socket message (a system
call, so a full memory barrier) separates every change of owner but one: a SPARE
buffer (free, offered to every worker) goes to the worker that swaps its DESCRIPTOR's
state and owner (``D_WORD``, one aligned 8-byte word) from SPARE to GRANTED by its slot,
a compare-and-swap in the C extension, which the sender uses too to take a spare back.
Every other change of ``D_WORD`` is one 8-byte store too (``speedups.write_word``):
``struct.pack_into`` zeroes a field before it writes it, and a sender reading a claimed
spare's word at that moment saw owner 0 or state FREE. The 8-byte counters in STATS,
WORKERS and PARTITIONS, and H_METADATA_EPOCH, have one writer each and change by one
store the same way; readers (``stats()``) may see a value one update old, never a torn
one. The 4-byte fields (gauges, leaders, states, the topic table) are written with
``pack_into`` and may read 0 for that moment: nothing decides on one read of them (the
topic table is read under its seqlock, a header state only after a break).

A topic's partitions are a contiguous range of PARTITION slots (``base + partition``).
When a topic gains partitions it gets a new, larger range; each slot's ``P_HOME`` names
the slot that holds that partition for good (its first slot: the queue, the sequences
and the counters of a topic-partition live in one slot only). Readers follow ``P_HOME``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Final

MAGIC: Final = b"SHMPROD\x01"
LAYOUT_VERSION: Final = 3
CACHE_LINE: Final = 64
PAGE: Final = 4096

MAX_TOPIC_NAME: Final = 249  # Kafka's limit

# ---------------------------------------------------------------------------
# HEADER region (offset 0)
# ---------------------------------------------------------------------------
H_MAGIC: Final = 0  # 8s
H_VERSION: Final = 8  # u32
H_SEGMENT_SIZE: Final = 16  # u64
H_N_BUFFERS: Final = 24  # u32
H_BUFFER_SIZE: Final = 28  # u32
H_MAX_WORKERS: Final = 32  # u32
H_MAX_TOPICS: Final = 36  # u32
H_MAX_PARTITIONS: Final = 40  # u32
H_OWNER_PID: Final = 48  # u64
H_OWNER_START_US: Final = 56  # u64: process start time, microseconds since the epoch
H_SENDER_PID: Final = 64  # u64
H_SENDER_START_US: Final = 72  # u64
H_STATE: Final = 80  # u32, one of STATE_*
H_FATAL_CODE: Final = 84  # i32: Kafka or shmprod error code once STATE_FAILED
H_METADATA_EPOCH: Final = 88  # u64: bumped by the sender on every topic table change
HEADER_SIZE: Final = 4 * CACHE_LINE

STATE_STARTING: Final = 0
STATE_RUNNING: Final = 1
STATE_CLOSING: Final = 2
STATE_CLOSED: Final = 3
STATE_FAILED: Final = 4

# ---------------------------------------------------------------------------
# STATS region: u64 counters, written by the sender only
# ---------------------------------------------------------------------------
S_BATCHES_RECEIVED: Final = 0  # sealed batches handed to the sender
S_BATCHES_SENT: Final = 8  # batches acknowledged (or sent, acks=0)
S_BATCHES_FAILED: Final = 16
S_RECORDS_SENT: Final = 24
S_BYTES_SENT: Final = 32  # batch bytes on the wire
S_REQUESTS_SENT: Final = 40
S_REQUESTS_IN_FLIGHT: Final = 48
S_BATCHES_IN_FLIGHT: Final = 56
S_BUFFERS_FREE: Final = 64
S_ALLOC_WAITERS: Final = 72  # allocation requests waiting for free buffers
S_RETRIES: Final = 80
S_ERRORS: Final = 88  # error answers from brokers, all kinds
S_METADATA_REFRESHES: Final = 96
S_WORKERS_ATTACHED: Final = 104
S_WORKERS_DIED: Final = 112
S_BUFFERS_RECLAIMED: Final = 120  # buffers taken back from dead workers
S_BATCHES_SPLIT: Final = 128  # batches split after MESSAGE_TOO_LARGE
S_EPOCH_BUMPS: Final = 136  # producer epoch bumped by the sender itself (KIP-360)
S_PRODUCER_ID_RESETS: Final = 144  # new producer ids taken after the first
S_BATCHES_REQUESTED: Final = 152  # batches written into produce requests (retries too)
S_BUFFERS_SPARE: Final = 160  # free buffers any worker may claim without asking (BUF_SPARE)
STATS_FIELDS: Final = (
    ("batches_received", S_BATCHES_RECEIVED),
    ("batches_sent", S_BATCHES_SENT),
    ("batches_failed", S_BATCHES_FAILED),
    ("records_sent", S_RECORDS_SENT),
    ("bytes_sent", S_BYTES_SENT),
    ("requests_sent", S_REQUESTS_SENT),
    ("requests_in_flight", S_REQUESTS_IN_FLIGHT),
    ("batches_in_flight", S_BATCHES_IN_FLIGHT),
    ("buffers_free", S_BUFFERS_FREE),
    ("alloc_waiters", S_ALLOC_WAITERS),
    ("retries", S_RETRIES),
    ("errors", S_ERRORS),
    ("metadata_refreshes", S_METADATA_REFRESHES),
    ("workers_attached", S_WORKERS_ATTACHED),
    ("workers_died", S_WORKERS_DIED),
    ("buffers_reclaimed", S_BUFFERS_RECLAIMED),
    ("batches_split", S_BATCHES_SPLIT),
    ("epoch_bumps", S_EPOCH_BUMPS),
    ("producer_id_resets", S_PRODUCER_ID_RESETS),
    ("batches_requested", S_BATCHES_REQUESTED),
    ("buffers_spare", S_BUFFERS_SPARE),
)
STATS_SIZE: Final = 4 * CACHE_LINE

# ---------------------------------------------------------------------------
# WORKER slot: written by the worker that holds the slot (state by the sender)
# ---------------------------------------------------------------------------
W_STATE: Final = 0  # u32: WORKER_FREE / WORKER_ACTIVE / WORKER_DEAD (sender writes)
W_PID: Final = 8  # u64
W_START_US: Final = 16  # u64
W_RECORDS_APPENDED: Final = 24  # u64 (worker writes from here on)
W_BYTES_APPENDED: Final = 32  # u64: encoded record bytes before compression
W_BATCHES_SEALED: Final = 40  # u64
W_SEND_ERRORS: Final = 48  # u64: sends refused at the call (bad input, timeouts)
W_RECORDS_ACKED: Final = 56  # u64
W_RECORDS_FAILED: Final = 64  # u64
W_BUFFER_WAITS: Final = 72  # u64: times the worker waited for the sender to grant buffers
W_BUFFER_WAIT_NS: Final = 80  # u64: time spent in those waits
W_BUFFER_WAITS_POOL_FREE: Final = 88  # u64: those waits while half the pool or more was free
W_SPARES_CLAIMED: Final = 96  # u64: spare buffers this worker claimed without asking
WORKER_SLOT_SIZE: Final = 2 * CACHE_LINE

WORKER_FREE: Final = 0
WORKER_ACTIVE: Final = 1
WORKER_DEAD: Final = 2

# ---------------------------------------------------------------------------
# TOPIC slot (the metadata table): written by the sender only
# ---------------------------------------------------------------------------
T_STATE: Final = 0  # u32: TOPIC_EMPTY / TOPIC_READY / TOPIC_ERROR
T_N_PARTITIONS: Final = 4  # u32
T_PARTITION_BASE: Final = 8  # u32: first PARTITION slot of this topic
T_ERROR: Final = 12  # i32: Kafka error code when TOPIC_ERROR
T_NAME_LEN: Final = 16  # u16
T_NAME: Final = 18  # MAX_TOPIC_NAME bytes of UTF-8
TOPIC_SLOT_SIZE: Final = 5 * CACHE_LINE

TOPIC_EMPTY: Final = 0
TOPIC_READY: Final = 1
TOPIC_ERROR: Final = 2

# ---------------------------------------------------------------------------
# PARTITION slot: written by the sender only
# ---------------------------------------------------------------------------
P_LEADER: Final = 0  # i32: node id, -1 unknown
P_QUEUE_DEPTH: Final = 4  # u32: sealed batches waiting in the sender
P_IN_FLIGHT: Final = 8  # u32: batches in requests not yet answered
P_LAST_ERROR: Final = 12  # i32
P_BATCHES_SENT: Final = 16  # u64
P_RECORDS_SENT: Final = 24  # u64
P_BYTES_SENT: Final = 32  # u64
P_HOME: Final = 40  # u32: the slot holding this partition's queue, sequences and counters
PARTITION_SLOT_SIZE: Final = CACHE_LINE

# ---------------------------------------------------------------------------
# DESCRIPTOR of a pool buffer: written by the buffer's current owner
# ---------------------------------------------------------------------------
D_STATE: Final = 0  # u32: BUF_*
D_OWNER: Final = 4  # i32: worker slot, or -1 for the sender
D_PARTITION: Final = 8  # i32: partition slot of the batch, -1 none
D_RUN: Final = 12  # u32: buffers in this run (1, or more for a large batch)
D_BATCH_ID: Final = 16  # u64
D_LENGTH: Final = 24  # u32: batch bytes written
D_RECORD_COUNT: Final = 28  # u32
D_CREATED_NS: Final = 32  # u64: monotonic clock of the creating process, for linger
DESCRIPTOR_SIZE: Final = CACHE_LINE

BUF_FREE: Final = 0  # in the sender's free list
BUF_GRANTED: Final = 1  # owned by a worker, no batch yet
BUF_OPEN: Final = 2  # a worker is appending records
BUF_SEALED: Final = 3  # handed to the sender, waiting to be sent
BUF_IN_FLIGHT: Final = 4  # in a request not yet answered
BUF_CONT: Final = 5  # continuation of a run; its first buffer describes the batch
BUF_SPARE: Final = 6  # free, and claimable by any worker without asking (sender/pool.py)

D_WORD: Final = D_STATE  # u64: D_STATE and D_OWNER read and changed as one atomic word
assert D_OWNER == D_STATE + 4 and D_WORD % 8 == 0 and DESCRIPTOR_SIZE % 8 == 0


def pair_word(low: int, high: int) -> int:
    """Two adjacent 32-bit fields (signed or not) as the one little-endian 8-byte word
    that holds them, ``low`` at the lower address."""
    return (low & 0xFFFFFFFF) | ((high & 0xFFFFFFFF) << 32)


def descriptor_word(state: int, owner: int) -> int:
    """D_STATE and D_OWNER as the one little-endian word at D_WORD (owner -1: nobody)."""
    return pair_word(state, owner)


def word_owner(word: int) -> int:
    """The D_OWNER half of a D_WORD value, signed."""
    owner = (word >> 32) & 0xFFFFFFFF
    return owner - (1 << 32) if owner >= 1 << 31 else owner


D_PLACE: Final = D_PARTITION  # u64: D_PARTITION and D_RUN written as one word
assert D_RUN == D_PARTITION + 4 and D_PLACE % 8 == 0


def place_word(partition: int, run: int) -> int:
    """D_PARTITION and D_RUN as the one little-endian word at D_PLACE."""
    return pair_word(partition, run)


SPARE_WORD: Final = descriptor_word(BUF_SPARE, -1)
FREE_WORD: Final = descriptor_word(BUF_FREE, -1)

# ---------------------------------------------------------------------------
# Packing helpers (struct objects shared by every reader and writer)
# ---------------------------------------------------------------------------
U16: Final = struct.Struct("<H")
U32: Final = struct.Struct("<I")
I32: Final = struct.Struct("<i")
U64: Final = struct.Struct("<Q")
I64: Final = struct.Struct("<q")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


BUFFER_UNIT_MAX: Final = 128 * 1024
"""The largest pool buffer. Batches larger than this (``batch_size``) take runs of
adjacent buffers; the unit stays small because most batches are closed by linger, far
below ``batch_size``, and each pins whole buffers until acknowledged."""


@dataclass(frozen=True)
class Geometry:
    """Sizes of every region, and the absolute offset of every slot, for one segment."""

    n_buffers: int
    buffer_size: int
    max_workers: int = 256
    max_topics: int = 256
    max_partitions: int = 16384

    @classmethod
    def for_pool(cls, buffer_memory: int, batch_size: int) -> Geometry:
        """The geometry that splits ``buffer_memory`` into buffers of ``batch_size``, or
        of :data:`BUFFER_UNIT_MAX` when batches are larger: a larger batch takes a run of
        adjacent buffers sized to what it holds, so a batch that linger closed small
        does not pin a whole ``batch_size`` of the pool."""
        size = _align(min(batch_size, BUFFER_UNIT_MAX), CACHE_LINE)
        return cls(n_buffers=max(2, buffer_memory // size), buffer_size=size)

    @cached_property
    def stats(self) -> int:
        return HEADER_SIZE

    @cached_property
    def workers(self) -> int:
        return self.stats + STATS_SIZE

    @cached_property
    def topics(self) -> int:
        return self.workers + self.max_workers * WORKER_SLOT_SIZE

    @cached_property
    def partitions(self) -> int:
        return self.topics + self.max_topics * TOPIC_SLOT_SIZE

    @cached_property
    def descriptors(self) -> int:
        return self.partitions + self.max_partitions * PARTITION_SLOT_SIZE

    @cached_property
    def data(self) -> int:
        return _align(self.descriptors + self.n_buffers * DESCRIPTOR_SIZE, PAGE)

    @cached_property
    def segment_size(self) -> int:
        return _align(self.data + self.n_buffers * self.buffer_size, PAGE)

    def worker(self, slot: int) -> int:
        """Offset of WORKER slot ``slot``."""
        if not 0 <= slot < self.max_workers:
            raise IndexError(f"worker slot {slot} outside [0, {self.max_workers})")
        return self.workers + slot * WORKER_SLOT_SIZE

    def topic(self, slot: int) -> int:
        """Offset of TOPIC slot ``slot``."""
        if not 0 <= slot < self.max_topics:
            raise IndexError(f"topic slot {slot} outside [0, {self.max_topics})")
        return self.topics + slot * TOPIC_SLOT_SIZE

    def partition(self, slot: int) -> int:
        """Offset of PARTITION slot ``slot``."""
        if not 0 <= slot < self.max_partitions:
            raise IndexError(f"partition slot {slot} outside [0, {self.max_partitions})")
        return self.partitions + slot * PARTITION_SLOT_SIZE

    def descriptor(self, buffer: int) -> int:
        """Offset of the DESCRIPTOR of buffer ``buffer``."""
        if not 0 <= buffer < self.n_buffers:
            raise IndexError(f"buffer {buffer} outside [0, {self.n_buffers})")
        return self.descriptors + buffer * DESCRIPTOR_SIZE

    def buffer(self, buffer: int) -> int:
        """Offset of buffer ``buffer``'s data."""
        if not 0 <= buffer < self.n_buffers:
            raise IndexError(f"buffer {buffer} outside [0, {self.n_buffers})")
        return self.data + buffer * self.buffer_size

    def run_bytes(self, run: int) -> int:
        """Capacity of a run of ``run`` adjacent buffers."""
        return run * self.buffer_size

    def buffers_for(self, nbytes: int) -> int:
        """How many adjacent buffers a batch of ``nbytes`` needs."""
        return max(1, -(-nbytes // self.buffer_size))

    def check_run(self, first: int, run: int) -> None:
        """Raises IndexError unless buffers ``first .. first+run-1`` all exist."""
        if run < 1 or first < 0 or first + run > self.n_buffers:
            raise IndexError(f"buffer run {first}+{run} outside [0, {self.n_buffers})")


def write_header(buf: memoryview, geo: Geometry, owner_pid: int, owner_start_us: int) -> None:
    """Initialises HEADER. Runs in: owner, at creation, before anyone attaches. The
    magic goes last: a segment whose magic another process reads (a sweep looking for
    dead producers' files) already names its owner."""
    U32.pack_into(buf, H_VERSION, LAYOUT_VERSION)
    U64.pack_into(buf, H_SEGMENT_SIZE, geo.segment_size)
    U32.pack_into(buf, H_N_BUFFERS, geo.n_buffers)
    U32.pack_into(buf, H_BUFFER_SIZE, geo.buffer_size)
    U32.pack_into(buf, H_MAX_WORKERS, geo.max_workers)
    U32.pack_into(buf, H_MAX_TOPICS, geo.max_topics)
    U32.pack_into(buf, H_MAX_PARTITIONS, geo.max_partitions)
    U64.pack_into(buf, H_OWNER_PID, owner_pid)
    U64.pack_into(buf, H_OWNER_START_US, owner_start_us)
    U32.pack_into(buf, H_STATE, STATE_STARTING)
    buf[H_MAGIC : H_MAGIC + 8] = MAGIC


class LayoutError(ValueError):
    """A segment whose header does not describe a shmprod layout this version reads."""


def read_geometry(buf: memoryview) -> Geometry:
    """The geometry recorded in HEADER, checked against the segment's real size.

    Runs in: any process that attaches. Never trusts a field without bounds.
    """
    if len(buf) < HEADER_SIZE or bytes(buf[H_MAGIC : H_MAGIC + 8]) != MAGIC:
        raise LayoutError("not a shmprod segment (bad magic)")
    version = U32.unpack_from(buf, H_VERSION)[0]
    if version != LAYOUT_VERSION:
        raise LayoutError(f"segment layout version {version}, this shmprod reads {LAYOUT_VERSION}")
    geo = Geometry(
        n_buffers=U32.unpack_from(buf, H_N_BUFFERS)[0],
        buffer_size=U32.unpack_from(buf, H_BUFFER_SIZE)[0],
        max_workers=U32.unpack_from(buf, H_MAX_WORKERS)[0],
        max_topics=U32.unpack_from(buf, H_MAX_TOPICS)[0],
        max_partitions=U32.unpack_from(buf, H_MAX_PARTITIONS)[0],
    )
    if geo.n_buffers < 1 or geo.buffer_size < CACHE_LINE or geo.segment_size > len(buf):
        raise LayoutError(f"segment geometry {geo} does not fit its {len(buf)} bytes")
    if U64.unpack_from(buf, H_SEGMENT_SIZE)[0] != geo.segment_size:
        raise LayoutError("segment size field disagrees with its geometry")
    return geo
