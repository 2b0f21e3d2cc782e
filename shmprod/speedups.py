"""The per-record ``send()`` path: the C extension ``shmprod._speedups``, or its twin here.

``send()`` costs about 1.1 us of the caller's CPU per record in Python; in C the same
steps cost about a quarter of that (ARCHITECTURE.md "The per-record path"). The
extension is built when shmprod is installed (``pip install``) and is optional: without
a C compiler, or with ``SHMPROD_PURE_PYTHON=1`` in the environment, the classes below
do the same in Python. The tests run both and compare them.

* :class:`StageCore`: the fields of a stage that ``send()`` touches (rows, sizes, limit);
  :class:`shmprod.worker.staging.Stage` subclasses it.
* :class:`FutureCore`: a record future's stage and row;
  :class:`shmprod.futures.RecordFuture` subclasses it.
* :class:`Stager`: the common case of ``Worker.send`` (bytes, bytearray (copied), str or
  None key and value; headers none, or a dict or list of (str, bytes | str | None)
  pairs, encoded here into the row's section; no partition, or one the stage knows
  whose batch has room; the topic's one stage has room): stages the row and returns
  its future; None when nothing was staged and the Python path must handle the record.
  A stage's first row with headers, and its first with an explicit partition, take the
  Python path, which makes the stage's list of sections or of partitions.
* :data:`SendMethod`: ``Worker.send`` as a method descriptor in C: when the Worker's
  ``_fast`` is its :class:`Stager` (open, no serializers) and the stager stages the row,
  no Python frame runs for the call; otherwise the Python method it wraps runs with the
  same arguments. C only (None without the extension: ``send`` is the Python method).
* :func:`plan_batches`, :func:`encode_records`, :func:`staged_lengths`: rows (a stage's
  lists, or ``send_batch``'s Arrow arrays, or the chunks of the ``send_batch`` calls
  held together; one headers section for every row, or one per row) cut into batches
  and each record written straight into its pool buffer, one copy of each key and value
  (:mod:`shmprod.worker.direct`). They exist in C only (None without the extension):
  without them the vectorised Arrow path (:mod:`shmprod.protocol.vectorized`) encodes
  the same bytes.

* :func:`claim_words`, :func:`swap_word`: atomic 8-byte words in shared memory, for
  spare pool buffers (:mod:`shmprod.sender.pool`). C only: Python has no
  compare-and-swap; without them the sender keeps no spares and workers ask.
  :func:`write_word` and :func:`read_word` change and read such a word whole, with or
  without the extension.

Runs in: worker. ``Stager`` takes the Worker's state lock when another thread holds it
(see ``_speedups.c``).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shmprod.native import load_speedups
from shmprod.protocol.records import encode_headers

__all__ = [
    "ACCELERATED",
    "FutureCore",
    "SendMethod",
    "StageCore",
    "Stager",
    "append_row",
    "encode_records",
    "header_sections",
    "partition_order",
    "plan_batches",
    "row_places",
    "staged_lengths",
    "stamp_runs",
]

_time_ns = time.time_ns
_INT64_MAX = (1 << 63) - 1


class _PyStageCore:
    """Python twin of ``shmprod._speedups.StageCore``."""

    __slots__ = (
        "batch_size",
        "header_max",
        "headers",
        "keys",
        "limit",
        "n",
        "nbytes",
        "part_bytes",
        "partitions",
        "timestamps",
        "values",
    )

    values: list[bytes | None]
    keys: list[bytes | None]
    timestamps: list[int]
    n: int
    nbytes: int
    limit: int
    headers: list[bytes] | None
    header_max: int
    partitions: list[int] | None
    part_bytes: bytearray | None
    batch_size: int

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        self.n = 0
        self.nbytes = 0
        self.limit = 1 << 62
        self.headers = None
        self.header_max = 1
        self.partitions = None
        self.part_bytes = None
        self.batch_size = 0
        return self


class _PyFutureCore:
    """Python twin of ``shmprod._speedups.FutureCore``."""

    __slots__ = ("_row", "_stage")

    _stage: Any
    _row: int

    def __init__(self, stage: Any, row: int) -> None:
        self._stage = stage
        self._row = row


class _PyStager:
    """Python twin of ``shmprod._speedups.Stager`` (see the module docstring)."""

    __slots__ = (
        "_future_type",
        "_header_size",
        "_int_type",
        "_lock",
        "_max_request_size",
        "_overhead_max",
        "_records_room",
        "_staged_overhead",
        "_stages",
    )

    def __init__(
        self,
        stages: dict[str, list[Any]],
        lock: threading.Lock,
        future_type: type[Any],
        records_room: int,
        max_request_size: int,
        header_size: int,
        overhead_max: int,
        staged_overhead: int,
        int_type: type | None = None,
    ) -> None:
        self._stages = stages
        self._int_type = int_type
        self._lock = lock
        self._future_type = future_type
        self._records_room = records_room
        self._max_request_size = max_request_size
        self._header_size = header_size
        self._overhead_max = overhead_max
        self._staged_overhead = staged_overhead

    def __call__(
        self,
        topic: object,
        value: object,
        key: object,
        headers: object,
        partition: object,
        timestamp_ms: object,
    ) -> Any:
        if type(topic) is not str:
            return None
        if _other_int(self._int_type, partition):  # as the Python path converts them
            partition = int(partition)  # type: ignore[call-overload]
        if _other_int(self._int_type, timestamp_ms):
            timestamp_ms = int(timestamp_ms)  # type: ignore[call-overload]
        part = -1
        if partition is not None:
            if type(partition) is not int or not 0 <= partition <= _INT64_MAX:
                return None
            part = partition
        if type(key) is str or type(value) is str:  # staged as UTF-8 bytes
            try:
                key = key.encode("utf-8") if type(key) is str else key
                value = value.encode("utf-8") if type(value) is str else value
            except UnicodeEncodeError:  # a lone surrogate: the Python path raises
                return None
        if type(key) is bytearray:  # a copy: the caller may reuse it
            key = bytes(key)
        if type(value) is bytearray:
            value = bytes(value)
        if key is not None and type(key) is not bytes:
            return None
        if value is not None and type(value) is not bytes:
            return None
        section = None
        hlen = 1
        if headers is not None:
            section = header_section(headers)
            if section is None:
                return None
            hlen = len(section)
            if hlen <= 1:
                section, hlen = None, 1
        klen = 0 if key is None else len(key)
        vlen = 0 if value is None else len(value)
        bound = klen + vlen + hlen + self._overhead_max
        if bound > self._records_room or bound + self._header_size > self._max_request_size:
            return None
        size = klen + vlen + hlen + self._staged_overhead
        if timestamp_ms is None:
            ts = _time_ns() // 1_000_000
        elif type(timestamp_ms) is int and 0 <= timestamp_ms <= _INT64_MAX:
            ts = timestamp_ms
        else:
            return None
        lock = self._lock
        lock.acquire()
        try:
            stages = self._stages.get(topic)
            if stages is None or len(stages) != 1:
                return None
            stage = stages[0]
            if not isinstance(stage, _PyStageCore):  # held send_batch calls
                return None
            if stage.nbytes + size > stage.limit:
                return None
            sections = stage.headers
            if section is not None and sections is None:
                return None  # the stage's first row with headers: the Python path
            parts = stage.partitions
            pb = stage.part_bytes
            used = 0
            if part >= 0:
                # the stage's first explicit partition, one past what it knows, or one
                # whose batch is full: the Python path
                if parts is None or pb is None or part >= len(pb) // 8:
                    return None
                used = _I64.unpack_from(pb, 8 * part)[0]
                if used and stage.batch_size - used < size:
                    return None
            if sections is not None:
                sections.append(_NO_HEADERS if section is None else section)
                stage.header_max = max(stage.header_max, hlen)
            if parts is not None:
                parts.append(part)
            if part >= 0 and pb is not None:
                _I64.pack_into(pb, 8 * part, used + size)
            return self._future_type(stage, append_row(stage, key, value, ts, size))
        finally:
            lock.release()


def _other_int(int_type: type | None, o: object) -> bool:
    """An explicit partition or timestamp that is an integer but not an exact int (an
    int subclass, or a numpy integer; a bool is neither)."""
    if o is None or type(o) is int or isinstance(o, bool):
        return False
    return isinstance(o, int) or (int_type is not None and isinstance(o, int_type))


_NO_HEADERS = b"\x00"
_I64 = struct.Struct("=q")  # one partition's staged bytes in StageCore.part_bytes


def header_section(headers: object) -> bytes | None:
    """The encoded headers section of a record sent with headers in the common form: a
    dict, or a list or tuple of (key, value) pairs (2-tuples or 2-lists), key str, value
    bytes, str or None. None for any other form, or what cannot be encoded: the Python
    path of ``send()`` converts it or raises its typed error. The C stager decides
    alike. Runs in: worker, no lock."""
    if type(headers) is dict:
        pairs: Any = list(headers.items())
    elif type(headers) is list or type(headers) is tuple:
        pairs = headers
    else:
        return None
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            return None
        k, v = pair
        if not isinstance(k, str) or not (v is None or isinstance(v, bytes | str)):
            return None
    try:
        return encode_headers(pairs)
    except Exception:  # a lone surrogate (not UTF-8): the Python path says so
        return None


def append_row(stage: Any, key: Any, value: Any, timestamp_ms: int, size: int) -> int:
    """Stages one checked row on a StageCore: its key, value and timestamp, the row
    count and the staged bytes; returns its row. Runs in: worker, state lock held."""
    row: int = stage.n
    stage.values.append(value)
    stage.keys.append(key)
    stage.timestamps.append(timestamp_ms)
    stage.n = row + 1
    stage.nbytes += size
    return row


_C = load_speedups()
ACCELERATED: bool = _C is not None
"""True when the C extension is in use."""

# The type checker sees the Python twins; at run time the C types replace them.
if TYPE_CHECKING or _C is None:
    StageCore = _PyStageCore
    FutureCore = _PyFutureCore
    Stager = _PyStager
else:
    StageCore = _C.StageCore
    FutureCore = _C.FutureCore
    Stager = _C.Stager

# The staged-rows encoder (C only; see the module docstring).
#: plan_batches(values, keys, timestamps, order, ends, budget[, headers[, sizes]]) -> [(lo,
#: hi, bytes, base, max)]; sizes: each row's key and value length, from staged_lengths
plan_batches: Callable[..., list[tuple[int, int, int, int, int]]] | None = (
    None if _C is None else _C.plan_batches
)
#: encode_records(values, keys, timestamps, order, lo, hi, base_ts, out, offset) -> end
encode_records: Callable[..., int] | None = None if _C is None else _C.encode_records
#: SendMethod(slow): Worker.send without a Python frame in the common case (C only)
SendMethod: Callable[[Callable[..., Any]], Any] | None = None if _C is None else _C.SendMethod
#: staged_lengths(values, keys, out[, sizes]): key + value bytes of each row into an int64
#: buffer; each key's and value's length (-1: None) into sizes, two int32 a row
staged_lengths: Callable[..., None] | None = None if _C is None else _C.staged_lengths
#: partition_order(parts, order) -> (sorted, [(partition, lo, hi)]): a flush's rows grouped
#: by partition (int32 parts, int64 order written when sorted); shmprod.worker.bulk._order
partition_order: Callable[..., tuple[bool, list[tuple[int, int, int]]]] | None = (
    None if _C is None else _C.partition_order
)
#: row_places(order, counts, row_batch, row_index): each row's batch and its index there
row_places: Callable[..., None] | None = None if _C is None else _C.row_places
#: stamp_runs(timestamps, starts, values) -> runs: a flushed stage's list of timestamps as
#: runs of rows with one each (int32 starts, int64 values); shmprod.worker.staging
stamp_runs: Callable[..., int] | None = None if _C is None else _C.stamp_runs
#: murmur2_partitions(keys, num_partitions, out): Java's partition of each key (-1: null
#: key) into an int32 buffer; keys: a list of bytes | None or Arrow binary buffers
murmur2_partitions: Callable[..., None] | None = None if _C is None else _C.murmur2_partitions
#: header_sections(rows): each row's encoded headers section, None where a row is not in
#: a common form (the Python path encodes it or raises); rows: a list, None for none
header_sections: Callable[[list[Any]], list[bytes | None]] | None = (
    None if _C is None else _C.header_sections
)
# Atomic words in shared memory, for spare buffers (C only: Python has no compare-and-swap
# on shared memory; without the extension the sender keeps no spares and workers ask).
#: claim_words(buf, base, stride, n, expected, desired, count, start) -> [index]
claim_words: Callable[..., list[int]] | None = None if _C is None else _C.claim_words
#: swap_word(buf, off, expected, desired) -> the word seen (swapped if it was expected)
swap_word: Callable[..., int] | None = None if _C is None else _C.swap_word


def _write_word(buf: Any, off: int, value: int) -> None:
    memoryview(buf)[off : off + 8].cast("Q")[0] = value


#: write_word(buf, off, value): the 8-byte word at ``off`` (aligned) changed by one store,
#: so a reader in another process sees the old value or the new one. struct.pack_into
#: cannot do that: it zeroes its target before it writes (CPython's s_pack_internal), so
#: a field written with it reads 0 for a moment. The extension's atomic store_word, else
#: one 8-byte copy through a memoryview cast (native byte order, as the extension's words).
write_word: Callable[[Any, int, int], None] = _write_word if _C is None else _C.store_word


def read_word(buf: Any, off: int) -> int:
    """The 8-byte word at ``off`` (aligned) read by one load: the old value or the new
    one of a concurrent :data:`write_word`, never a mix (struct.unpack_from reads byte by
    byte)."""
    return int(memoryview(buf)[off : off + 8].cast("Q")[0])
