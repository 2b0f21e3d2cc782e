"""Rows written as records straight into a pool buffer, by the C extension.

A flush of ``send()``'s staged rows, and ``send_batch``, cut their rows (sorted by
partition) into batches with :func:`shmprod.speedups.plan_batches` and write each batch
with :func:`shmprod.speedups.encode_records`: the varints and the bytes of every record
go from where they are -- the stage's ``bytes`` objects, an Arrow array's data buffer,
or the data buffers of the chunks of held ``send_batch`` calls -- into the granted
buffer. One copy of each key and value, where joining lists
into columns, reordering them by partition (Arrow ``take``) and encoding a records
section copied them four times (ARCHITECTURE.md, "Rows written straight into the
pool"). With a codec the records go to a scratch section that the codec compresses;
with lz4, after a batch that stored every block as is (incompressible rows), the next
batch's records are written where its frame goes, and stay there as one stored block
when they are incompressible too (:func:`shmprod.protocol.compression.lz4_frame_in_place`:
no copy out of the scratch section).

Rows with their own headers carry their encoded sections (one per row: made at
``send()``, or by ``send_batch`` for its per-row headers); otherwise every row of a call
shares one section. What cannot go this way (Arrow types other than binary and
large_binary; no C extension) takes :mod:`shmprod.protocol.vectorized`, which encodes
the same bytes.

Runs in: worker. The sources are the caller's: a stage taken for a flush is immutable,
and ``send_batch`` holds its columns for the call.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from shmprod import speedups
from shmprod.errors import EncodeError
from shmprod.protocol.columns import arrow_buffers
from shmprod.protocol.compression import (
    LZ4,
    LZ4_SECTION_OFFSET,
    NONE,
    compress_bound,
    lz4_frame_in_place,
    lz4_stored_whole,
)
from shmprod.protocol.records import (
    HEADER_SIZE,
    PLAIN,
    RECORDS,
    BatchSettings,
    Header,
    encode_headers,
    write_batch,
    write_batch_header,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from shmprod.worker.staging import Stage
else:
    from shmprod.arrow import pa

__all__ = ["DirectBatch", "Source", "arrow_source", "plan", "staged_source"]

NO_HEADERS = b"\x00"
# what the extension raises for rows it cannot encode (a typed EncodeError here)
_C_ERRORS = (ValueError, TypeError, OverflowError, IndexError)
# sections up to this size are encoded, before compression, in one bytearray per thread
_SCRATCH_MAX: Final = 1 << 20
_scratch = threading.local()
# per thread: whether its last lz4 batch stored every block as is (then the next one is
# encoded in place). One flag per thread, not per topic: a thread that alternates
# incompressible and compressible rows copies a section out (and tries its first block
# twice) at each change to compressible ones.
_lz4_incompressible = threading.local()


def _section(n: int) -> memoryview:
    """``n`` writable bytes for a section about to be compressed: this thread's scratch,
    reused (measured: a new bytearray per batch of 1 KB lz4 records cost a page fault
    per 4 KiB and a zero fill, 27,670 faults for 100 MB), or new bytes above
    ``_SCRATCH_MAX``. Valid until this thread's next call."""
    if n > _SCRATCH_MAX:
        return memoryview(bytearray(n))
    buf: bytearray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch.buf = bytearray(max(n, 64 * 1024))
    return memoryview(buf)[:n]


class Source(NamedTuple):
    """What :func:`shmprod.speedups.encode_records` reads: values and keys (a list of
    ``bytes | None``, or an Arrow array's buffers; keys None: every key null),
    timestamps (a list, an int64 array, or one int) and the encoded headers section
    every record carries, or a list of one section per row."""

    values: Any
    keys: Any
    timestamps: Any
    headers: bytes | list[bytes]
    sizes: npt.NDArray[np.int32] | None = None  # a stage's rows' lengths (Stage.sizes)


def staged_source(stage: Stage) -> Source | None:
    """A stage's rows, or None when they cannot go directly (no extension)."""
    if speedups.plan_batches is None:
        return None
    sections = stage.headers
    return Source(
        stage.values,
        stage.keys,
        stage.timestamps,
        NO_HEADERS if sections is None else sections,
        stage.sizes,
    )


def arrow_source(
    values: pa.Array | pa.ChunkedArray,
    keys: pa.Array | None,
    timestamps: npt.NDArray[np.int64] | int,
    headers: list[Header] | None,
    sections: list[bytes] | None = None,
) -> Source | None:
    """``send_batch``'s checked columns (one headers list shared by every row, or None;
    or ``sections``, each row's encoded headers section), or None when they cannot go
    directly (another Arrow type; no extension). Values in chunks (held calls) are read
    where they are: the extension takes a 1-tuple of the chunks' buffers."""
    if speedups.plan_batches is None:
        return None
    vals: Any
    if isinstance(values, pa.ChunkedArray):
        chunks = [arrow_buffers(c) for c in values.chunks]
        vals = None if not chunks or None in chunks else (chunks,)
    else:
        vals = arrow_buffers(values)
    ks = None if keys is None else arrow_buffers(keys)
    if vals is None or (keys is not None and ks is None):
        return None
    ts: Any = timestamps
    if not isinstance(ts, int):
        ts = np.ascontiguousarray(ts, np.int64)
    if sections is not None:
        return Source(vals, ks, ts, sections)
    section = encode_headers(headers) if headers else NO_HEADERS
    return Source(vals, ks, ts, section)


class DirectBatch:
    """Rows ``order[lo:hi]`` of a source as one batch, written straight into a buffer:
    the interface of :class:`shmprod.protocol.vectorized.EncodedBatch` that the writer
    uses, without its records section in between."""

    __slots__ = (
        "base_timestamp_ms",
        "lo",
        "max_timestamp_ms",
        "order",
        "record_count",
        "section_size",
        "source",
    )

    def __init__(
        self,
        source: Source,
        order: npt.NDArray[np.int64] | None,
        lo: int,
        hi: int,
        section_size: int,
        base_timestamp_ms: int,
        max_timestamp_ms: int,
    ) -> None:
        self.source = source
        self.order = order
        self.lo = lo
        self.record_count = hi - lo
        self.section_size = section_size  # the records section's bytes, uncompressed
        self.base_timestamp_ms = base_timestamp_ms
        self.max_timestamp_ms = max_timestamp_ms

    def _encode(self, out: bytearray | memoryview, offset: int) -> int:
        """The records written at ``out[offset:]``; returns the offset just past them
        (EncodeError when that is not ``section_size`` bytes on: a source that changed)."""
        encode = speedups.encode_records
        assert encode is not None
        src = self.source
        try:
            end: int = encode(
                src.values,
                src.keys,
                src.timestamps,
                self.order,
                self.lo,
                self.lo + self.record_count,
                self.base_timestamp_ms,
                out,
                offset,
                src.headers,
            )
        except _C_ERRORS as exc:
            raise EncodeError(f"encoding records: {exc}") from None
        if end != offset + self.section_size:  # a changed source: never
            raise EncodeError("rows changed while they were encoded")
        return end

    def write_into(
        self,
        buf: memoryview,
        offset: int,
        *,
        settings: BatchSettings = PLAIN,
    ) -> int:
        """Writes the whole batch at ``buf[offset:]``, CRC last; returns its end offset
        (EncodeError when it does not fit)."""
        n = self.section_size
        lz4 = settings.compression == LZ4
        if lz4 and getattr(_lz4_incompressible, "last", False):
            room = compress_bound(LZ4, n)
            frame = buf[offset + RECORDS : offset + RECORDS + room]
            if len(frame) == room:
                return self._write_lz4_in_place(buf, offset, frame, settings)
        if settings.compression != NONE:
            section = _section(n)
            self._encode(section, 0)
            end = write_batch(
                buf,
                offset,
                section,
                record_count=self.record_count,
                base_timestamp_ms=self.base_timestamp_ms,
                max_timestamp_ms=self.max_timestamp_ms,
                settings=settings,
            )
            if lz4:
                _lz4_incompressible.last = lz4_stored_whole(n, end - offset - RECORDS)
            return end
        if len(buf) - offset < HEADER_SIZE + self.section_size:
            raise EncodeError(
                f"batch of {HEADER_SIZE + self.section_size} bytes does not fit in "
                f"{len(buf) - offset}"
            )
        end = self._encode(buf, offset + HEADER_SIZE)
        return self._seal(buf, offset, end, settings)

    def _write_lz4_in_place(
        self, buf: memoryview, offset: int, frame: memoryview, settings: BatchSettings
    ) -> int:
        """The records encoded where an lz4 frame of them goes (``frame``: the room
        after the header, ``compress_bound`` bytes), then made that frame in place."""
        n = self.section_size
        self._encode(buf, offset + RECORDS + LZ4_SECTION_OFFSET)
        length = lz4_frame_in_place(frame, n, settings.level)
        _lz4_incompressible.last = lz4_stored_whole(n, length)
        return self._seal(buf, offset, offset + RECORDS + length, settings)

    def _seal(self, buf: memoryview, offset: int, end: int, settings: BatchSettings) -> int:
        """The batch header for records ending at ``end``, CRC last; returns ``end``."""
        write_batch_header(
            buf,
            offset,
            end,
            record_count=self.record_count,
            base_timestamp_ms=self.base_timestamp_ms,
            max_timestamp_ms=self.max_timestamp_ms,
            settings=settings,
        )
        return end


def plan(
    source: Source,
    order: npt.NDArray[np.intp] | None,
    ranges: list[tuple[int, int, int]],
    budget: int,
) -> list[tuple[int, DirectBatch]]:
    """The source's rows cut into (partition, batch) with at most ``budget`` bytes of
    records each. ``order``: the rows sorted by partition (None: as they are);
    ``ranges``: (partition, lo, hi) over the sorted rows."""
    cut = speedups.plan_batches
    assert cut is not None
    order64 = None if order is None else order.astype(np.int64, copy=False)
    ends = [hi for *_, hi in ranges]
    try:
        cuts = cut(
            source.values,
            source.keys,
            source.timestamps,
            order64,
            ends,
            budget,
            source.headers,
            source.sizes,
        )
    except _C_ERRORS as exc:
        raise EncodeError(f"cutting records into batches: {exc}") from None
    out: list[tuple[int, DirectBatch]] = []
    k = 0
    for lo, hi, size, base, top in cuts:
        while lo >= ranges[k][2]:
            k += 1
        out.append((ranges[k][0], DirectBatch(source, order64, lo, hi, size, base, top)))
    return out
