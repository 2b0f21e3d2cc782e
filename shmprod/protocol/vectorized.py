"""RecordBatch v2 built from whole columns, with no per-row Python in the hot path.

The output is byte-identical to :mod:`shmprod.protocol.records` for the same input.

How it works, per chunk of whole batches (about ``CHUNK_BYTES`` of output; a bounded
number of whole-array numpy passes over rows, never over bytes):

1. A record is ``length attributes timestampDelta offsetDelta keyLength | key |
   valueLength | value | headers``. numpy computes every varint's zig-zag value for all
   rows, then its width and little-endian bytes with the continuation bits ("spread"
   words; a 64 Ki-entry lookup table for small values), and packs consecutive varints
   into groups of at most 12 bytes.
2. Arrow's BinaryView layout stores a string of at most 12 bytes *inline* in its 16-byte
   view, and a longer one as a (buffer, offset) reference. So each packed varint group
   already is a view; keys and values become views by one C++ cast that references
   their data buffers; the shared headers section (usually ``\x00``) rides inline in
   the next record's first view.
3. numpy interleaves the views record by record, and one C++ cast of that BinaryView
   array to plain binary concatenates all pieces: its data buffer IS the records
   section of every batch in the chunk, back to back. This beat
   ``pyarrow.compute.binary_join_element_wise(prefix, value, suffix)`` by about 2.5x
   on 100-byte values (``python bench/codec.py``, "assembly" table).

Per-row headers (one list per row) are encoded in a Python loop first (the slow path,
about a microsecond per row); shared headers are encoded once. Inputs that need a
varint wider than 8 bytes (a timestampDelta beyond +-2**55 ms) fall back to the
per-record encoder. Splitting rows into batches is cumsum + searchsorted over per-row
sizes, one Python step per batch (not per row).

Runs in: worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from shmprod.errors import EncodeError
from shmprod.protocol import compression as _codecs
from shmprod.protocol import records as _records
from shmprod.protocol.columns import binary_array, to_binary_array, valid_mask
from shmprod.protocol.compression import NONE
from shmprod.protocol.primitives import INT32_MAX
from shmprod.protocol.records import HEADER_SIZE, PLAIN, BatchSettings, Header, NewRecord

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.compute as pc
else:
    from shmprod.arrow import pa, pc


__all__ = [
    "EncodedBatch",
    "encode_columns",
    "encode_columns_into",
    "encoded_size",
    "iter_encoded_batches",
    "record_sizes",
    "split_batches",
    "to_binary_array",
]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
BinaryColumn = Any  # pa.Array | pa.ChunkedArray | np.ndarray | Sequence[bytes | None]
HeadersArg = Sequence[Header] | Sequence[Sequence[Header]] | Sequence[bytes] | None
TimestampsArg = npt.ArrayLike | None
WritableBuffer = bytearray | memoryview

# Rows are encoded in chunks of about this many output bytes (whole batches each), which
# keeps numpy temporaries and Arrow output cache-resident and memory bounded.
CHUNK_BYTES: Final = 4 << 20
_INLINE: Final = 12  # BinaryView inlines strings up to this many bytes
_MAX_WORD_BYTES: Final = 8  # a spread varint must fit one uint64 lane
_TABLE_BITS: Final = 16  # varints of values below 2**16 come from a lookup table
_U32: Final = np.uint64(32)
_U56: Final = np.uint64(56)
_U64: Final = np.uint64(64)
_LOW56: Final = np.uint64((1 << 56) - 1)
_LOW32: Final = np.uint64(0xFFFFFFFF)
_CONT: Final = np.array(
    [sum(0x80 << (8 * j) for j in range(max(w - 1, 0))) for w in range(9)], dtype=np.uint64
)


# ---------------------------------------------------------------------------------------
# Input normalisation
# ---------------------------------------------------------------------------------------


def _lengths(arr: pa.Array) -> tuple[pa.Array, I64, bool]:
    """(array with nulls replaced by empty, lengths with -1 for null, any null?)."""
    n = len(arr)
    if n == 0:
        return arr, np.zeros(0, np.int64), False
    off_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=off_type)[arr.offset : arr.offset + n + 1]
    lengths = np.subtract(offsets[1:], offsets[:-1], dtype=np.int64)
    has_null = arr.null_count > 0
    if has_null:
        valid = valid_mask(arr)
        lengths[~valid] = -1
        # nulls become empty values: if_else against an all-empty array of the same
        # type (pc.fill_null needs a pa.scalar, and pa.scalar imports pandas)
        empty = pa.Array.from_buffers(
            arr.type, n, [None, pa.py_buffer(np.zeros(n + 1, off_type)), pa.py_buffer(b"")]
        )
        arr = pc.if_else(arr.is_valid(), arr, empty)
    return arr, lengths, has_null


def _is_header_pair(item: object) -> bool:
    return isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)


@dataclass(slots=True)
class _Columns:
    """Normalised inputs: Arrow arrays, lengths, timestamps and encoded headers."""

    n: int
    values: pa.Array  # nulls replaced by empty values
    vlen: I64  # -1 for null
    v_null: bool  # vlen may hold -1
    keys: pa.Array | None  # None: every key is null
    klen: I64 | None
    k_null: bool
    timestamps: I64 | None  # None: every record has base_ts
    base_ts: int | None
    shared_headers: bytes  # the headers section every record carries
    row_headers: pa.Array | None  # per-row headers sections, or None
    row_hlen: I64 | None

    def slice(self, lo: int, hi: int) -> _Columns:
        """Rows [lo, hi) as a new _Columns (zero-copy)."""
        return _Columns(
            hi - lo,
            self.values.slice(lo, hi - lo),
            self.vlen[lo:hi],
            self.v_null,
            None if self.keys is None else self.keys.slice(lo, hi - lo),
            None if self.klen is None else self.klen[lo:hi],
            self.k_null,
            None if self.timestamps is None else self.timestamps[lo:hi],
            self.base_ts,
            self.shared_headers,
            None if self.row_headers is None else self.row_headers.slice(lo, hi - lo),
            None if self.row_hlen is None else self.row_hlen[lo:hi],
        )


def _prepare(
    values: BinaryColumn,
    keys: BinaryColumn | None,
    timestamps_ms: TimestampsArg,
    headers: HeadersArg,
    base_timestamp_ms: int | None,
) -> _Columns:
    """Validates and converts every input column once."""
    vals, vlen, v_null = _lengths(to_binary_array(values, "values"))
    n = len(vals)
    karr: pa.Array | None = None
    klen: I64 | None = None
    k_null = False
    if keys is not None:
        karr, klen, k_null = _lengths(to_binary_array(keys, "keys"))
        if len(karr) != n:
            raise EncodeError(f"{len(karr)} keys for {n} values")
        if int(klen.max(initial=-1)) < 0:  # every key null: same as no keys
            karr, klen = None, None
    ts: I64 | None = None
    base = base_timestamp_ms
    if timestamps_ms is not None and np.ndim(timestamps_ms) == 0:
        base = int(timestamps_ms) if base is None else base  # type: ignore[arg-type]
        if base != int(timestamps_ms):  # type: ignore[arg-type]
            ts = np.full(n, int(timestamps_ms), np.int64)  # type: ignore[arg-type]
    elif timestamps_ms is not None:
        ts = _timestamps(timestamps_ms, n)
    if ts is None and base is None:
        raise EncodeError("need timestamps_ms or base_timestamp_ms")
    if base is not None and not -(2**63) <= base < 2**63:
        raise EncodeError(f"base timestamp out of int64 range: {base}")
    shared, row_hdrs, row_hlen = _headers(headers, n)
    return _Columns(n, vals, vlen, v_null, karr, klen, k_null, ts, base, shared, row_hdrs, row_hlen)


def _timestamps(timestamps_ms: npt.ArrayLike, n: int) -> I64:
    """Per-row timestamps as int64 milliseconds (datetime64 is converted)."""
    arr = np.asarray(timestamps_ms)
    if np.issubdtype(arr.dtype, np.datetime64):
        arr = arr.astype("datetime64[ms]").view(np.int64)
    if arr.ndim != 1 or len(arr) != n:
        raise EncodeError(f"timestamps_ms must have one entry per row ({n}), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise EncodeError(f"timestamps_ms must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and n and int(arr.max()) >= 2**63:
        raise EncodeError("timestamp out of int64 range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _headers(headers: HeadersArg, n: int) -> tuple[bytes, pa.Array | None, I64 | None]:
    """(shared headers section, per-row sections or None, their lengths or None).

    ``headers`` is either one list of (key, value) pairs for every record, or one such
    list per row (detected by its items not being (str, ...) pairs) -- the slow path --
    or one encoded section (``bytes``) per row, as a stage of ``send()`` keeps them.
    """
    if not headers:
        return _records.encode_headers(()), None, None
    if all(_is_header_pair(h) for h in headers):
        return _records.encode_headers(headers), None, None  # type: ignore[arg-type]
    if len(headers) != n:
        raise EncodeError(f"per-row headers: {len(headers)} lists for {n} rows")
    sections = [
        h if isinstance(h, bytes) else _records.encode_headers(h)  # type: ignore[arg-type]
        for h in headers
    ]
    return b"", binary_array(sections), np.fromiter(map(len, sections), np.int64, n)


# ---------------------------------------------------------------------------------------
# Varints, vectorised
# ---------------------------------------------------------------------------------------

_table_cache: list[U64] = []


def _varint_table() -> U64:
    """entry[u] = spread varint of u | width << 56, for u < 2**16 (built once)."""
    if not _table_cache:
        u = np.arange(1 << _TABLE_BITS, dtype=np.uint64)
        word, width = _spread_arith(u, 3)
        _table_cache.append(word | (width.view(np.uint64) << _U56))
    return _table_cache[0]


def _spread_arith(u: U64, nbytes: int) -> tuple[U64, I64]:
    """(byte lanes with continuation bits, width) of unsigned varints below 2**(7*nbytes)."""
    word = u & np.uint64(0x7F)
    width = np.ones(len(u), np.int64)
    for j in range(1, nbytes):
        word |= (u << np.uint64(j)) & np.uint64(0x7F << (8 * j))
        width += u >= np.uint64(1 << (7 * j))
    word |= _CONT[width]
    return word, width


def _uvarint_size(u: int) -> int:
    return 1 if u < 0x80 else (u.bit_length() + 6) // 7


def _varints(u: U64) -> tuple[U64, I64 | int]:
    """Spread words and widths of unsigned varints; a scalar width when all agree
    (which keeps later fields of a view at the same position in every row)."""
    if len(u) == 0:
        return u, 1
    top = int(u.max())
    if top < 0x80:
        return u, 1
    nbytes = _uvarint_size(top)
    if nbytes > _MAX_WORD_BYTES:
        raise _TooWide
    same = _uvarint_size(int(u.min())) == nbytes
    if top < 1 << _TABLE_BITS:
        entry: U64 = np.take(_varint_table(), u)
        if same:
            entry &= _LOW56
            return entry, nbytes
        width = (entry >> _U56).view(np.int64)
        entry &= _LOW56
        return entry, width
    word, width = _spread_arith(u, nbytes)
    return word, (nbytes if same else width)


def _zigzag(v: I64) -> U64:
    """Zig-zag of int64 values as uint64."""
    return ((v << 1) ^ (v >> 63)).view(np.uint64)


class _TooWide(Exception):
    """A varint needs more than 8 bytes: use the per-record encoder instead."""


# ---------------------------------------------------------------------------------------
# Record sizes and batch splitting
# ---------------------------------------------------------------------------------------


def _varint_width(u: U64) -> I64 | int:
    """Width of unsigned varints (scalar when all agree)."""
    if len(u) == 0:
        return 1
    top = int(u.max())
    if top < 0x80:
        return 1
    width = np.ones(len(u), np.int64)
    for j in range(1, (top.bit_length() + 6) // 7):
        width += u >= np.uint64(1 << (7 * j))
    return width


def _scalar_width(v: int) -> int:
    u = ((v << 1) ^ (v >> 63)) & 0xFFFFFFFFFFFFFFFF
    return 1 if u < 0x80 else (u.bit_length() + 6) // 7


def _fixed_body(cols: _Columns) -> I64:
    """Per-row body bytes except timestampDelta and offsetDelta varints."""
    vlen = cols.vlen
    v_null = cols.v_null
    body: I64 = np.maximum(vlen, 0) if v_null else vlen.copy()
    body += 1  # attributes
    body += _varint_width(_zigzag_len(vlen, v_null))
    if cols.klen is None:
        body += 1  # keyLength -1
    else:
        body += np.maximum(cols.klen, 0)
        body += _varint_width(_zigzag_len(cols.klen, cols.k_null))
    if cols.row_hlen is None:
        body += len(cols.shared_headers)
    else:
        body += cols.row_hlen
    return body


def _sizes_one_batch(cols: _Columns) -> I64:
    """Exact encoded size of each row when all rows form one batch."""
    body = _fixed_body(cols)
    if cols.timestamps is not None:
        base = cols.base_ts if cols.base_ts is not None else int(cols.timestamps[0])
        body += _varint_width(_zigzag(_ts_deltas(cols.timestamps, base)))
    else:
        body += 1
    body += _varint_width(_zigzag(np.arange(cols.n, dtype=np.int64)))
    return body + _varint_width(_zigzag(body))


def _ts_deltas(ts: I64, base: int | I64) -> I64:
    """ts - base, raising _TooWide where int64 subtraction would overflow."""
    with np.errstate(over="ignore"):
        delta = ts - base
    b = np.asarray(base, dtype=np.int64)
    if ((ts ^ b) & (ts ^ delta)).min(initial=0) < 0:
        raise _TooWide
    return delta


def record_sizes(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    base_timestamp_ms: int | None = None,
) -> I64:
    """Exact encoded size of each row, as if all rows formed one batch (offsetDelta = row).

    ``sizes.sum() + HEADER_SIZE`` is the uncompressed batch size; a caller can split by
    budget from these without encoding (:func:`split_batches` does it exactly per batch).
    """
    cols = _prepare(values, keys, timestamps_ms, headers, base_timestamp_ms)
    try:
        return _sizes_one_batch(cols)
    except _TooWide:
        return np.array(
            [_records.record_size(*args) for args in _row_args(cols, 0, cols.n, [0])], np.int64
        )


def split_batches(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    batch_size: int,
    max_records: int | None = None,
    base_timestamp_ms: int | None = None,
) -> I64:
    """Row boundaries ``[0, b1, ..., n]`` of consecutive batches within a byte budget.

    Each batch's uncompressed encoded size (header included) is at most ``batch_size``
    and it has at most ``max_records`` rows; a row too large for an empty batch goes
    alone, as in Java. Uses cumsum + searchsorted over per-row upper bounds (exact
    except that, with per-row timestamps and no ``base_timestamp_ms``, timestampDelta
    widths are bounded by the whole column's timestamp range).
    """
    cols = _prepare(values, keys, timestamps_ms, headers, base_timestamp_ms)
    return _split(cols, batch_size, max_records)


def _split(
    cols: _Columns, batch_size: int, max_records: int | None, groups: I64 | None = None
) -> I64:
    if batch_size <= HEADER_SIZE:
        raise EncodeError(f"batch_size {batch_size} leaves no room after the header")
    if max_records is not None and max_records < 1:
        raise EncodeError(f"max_records must be >= 1, got {max_records}")
    n = cols.n
    if n == 0:
        return np.zeros(1, np.int64)
    budget = batch_size - HEADER_SIZE
    max_rows = n if max_records is None else min(n, max_records)
    body = _fixed_body(cols)
    if cols.timestamps is None:
        body += 1
    elif cols.base_ts is not None:
        body += _varint_width(_zigzag(_safe_deltas(cols.timestamps, cols.base_ts)))
    else:
        body += _ts_width_bound(cols.timestamps, body + 3, budget, max_rows)
    od_max_width = _scalar_width(max_rows - 1)
    bound = body + _varint_width(((body + od_max_width) << 1).view(np.uint64))
    # bound[i]: row i's bytes except its offsetDelta varint. The offsetDelta of the m-th
    # row of a batch takes w bytes for m in (T[w-1], T[w]], so m rows' deltas take
    # F(m) = w*m - sum(T[1:w]) bytes. With G_w = cumsum(bound) + w*index, a batch from
    # s to e costs G_w[e] - G_w[s] - sum(T[1:w]) in region w: one searchsorted per region.
    cum = np.zeros(n + 1, np.int64)
    np.cumsum(bound, out=cum[1:])
    index = np.arange(n + 1, dtype=np.int64)
    regions = [0]
    while regions[-1] < max_rows:
        regions.append(1 << (7 * len(regions) - 1))  # 64, 8192, 2**20, ...
    grids = [cum + w * index for w in range(1, len(regions))]
    out = [0]
    start = 0
    ends = groups if groups is not None else np.array([n], np.int64)  # batches end there
    while start < n:
        group_end = int(ends[np.searchsorted(ends, start, side="right")])
        limit = min(group_end, start + max_rows)
        end = start
        offset = 0  # sum(T[1:w])
        for w, grid in enumerate(grids, start=1):
            target = int(grid[start]) + budget + offset
            end = int(np.searchsorted(grid, target, side="right")) - 1
            if end - start <= regions[w]:
                break  # every row of the batch has an offsetDelta of w bytes or fewer
            offset += regions[w]
        end = max(min(end, limit), start + 1)  # a row too big for an empty batch: alone
        out.append(end)
        start = end
    return np.array(out, np.int64)


def _ts_width_bound(ts: I64, row_min: I64, budget: int, max_rows: int) -> I64 | int:
    """Upper bound of each row's timestampDelta width when its batch's first row (the
    base) is unknown: that first row is no earlier than the first from which the rows
    up to this one could still fit ``budget`` (``row_min`` is a lower bound per row)."""
    n = len(ts)
    cum = np.zeros(n + 1, np.int64)
    np.cumsum(row_min, out=cum[1:])
    first = np.searchsorted(cum, cum[1:] - budget, side="left")
    rows = np.arange(n)
    first = np.minimum(np.maximum(first, rows - (max_rows - 1)), rows)
    if n < 2 or (ts[1:] >= ts[:-1]).all():  # ascending: the earliest base is the smallest
        hi = ts - ts[first]
    else:  # blocks as wide as the widest window: a base is in the row's block or the last
        window = int((np.arange(n) - first).max()) + 1
        starts = np.arange(0, n, window)
        bmax = np.maximum.reduceat(ts, starts)
        bmin = np.minimum.reduceat(ts, starts)
        bmax[1:] = np.maximum(bmax[1:], bmax[:-1])
        bmin[1:] = np.minimum(bmin[1:], bmin[:-1])
        block = np.arange(n) // window
        hi = np.maximum(ts - bmin[block], bmax[block] - ts)  # >= |ts_i - ts_base|
    if int(hi.max()) >= 2**62 or int(hi.min()) < 0:
        return 10
    return _varint_width((hi << 1).view(np.uint64))


def _safe_deltas(ts: I64, base: int) -> I64:
    try:
        return _ts_deltas(ts, base)
    except _TooWide:
        return np.full(len(ts), 2**62, np.int64)


# ---------------------------------------------------------------------------------------
# Encoding core: a chunk of whole batches -> one records buffer
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Field:
    """One varint (or constant bytes) of every row: spread word, width, widest row."""

    word: U64 | int
    width: I64 | int
    max_width: int


def _field(u: U64) -> _Field:
    word, width = _varints(u)
    return _Field(word, width, width if isinstance(width, int) else int(width.max()))


def _const(byte_values: bytes) -> _Field:
    return _Field(int.from_bytes(byte_values, "little"), len(byte_values), len(byte_values))


def _acc(acc: U64 | None, x: U64) -> U64:
    """acc | x, in place when acc exists (x is always a fresh temporary)."""
    if acc is None:
        return x
    np.bitwise_or(acc, x, out=acc)
    return acc


def _fuse(fields: list[_Field]) -> list[_Field]:
    """Merges each field into the one before it when that one has the same width in every
    row, so every later field is placed at a per-row position once, not one by one."""
    out: list[_Field] = []
    for f in fields:
        prev = out[-1] if out else None
        if (
            prev is None
            or not isinstance(prev.width, int)
            or prev.max_width + f.max_width > _MAX_WORD_BYTES
        ):
            out.append(f)
            continue
        sh = 8 * prev.width
        word: U64 | int
        if isinstance(f.word, int):
            word = (
                prev.word | (f.word << sh)
                if isinstance(prev.word, int)
                else (prev.word | np.uint64(f.word << sh) if f.word else prev.word)
            )
        else:
            word = f.word << np.uint64(sh)
            if not isinstance(prev.word, int):
                word |= prev.word
            elif prev.word:
                word |= np.uint64(prev.word)
        width = prev.width + f.width if isinstance(f.width, int) else f.width + prev.width
        out[-1] = _Field(word, width, prev.max_width + f.max_width)
    return out


def _pack_into(fields: list[_Field], out: U64) -> None:
    """Packs consecutive fields (at most 12 bytes) into inline BinaryViews ``out[:, 0:2]``.

    A view is ``length:uint32 | data[0:12]`` little-endian; the 12 data bytes are split
    into ``lo`` (bytes 0-7) and ``hi`` (8-11). Constants at fixed positions are folded
    into Python ints; only per-row words and positions cost array passes.
    """
    clo = 0  # constant bytes of the group as one Python int
    lo: U64 | None = None
    hi: U64 | None = None
    pos: U64 | int = 0
    pos_min = pos_max = 0  # range of the per-row position
    for f in _fuse(fields):
        w = f.word
        if isinstance(pos, int):
            if isinstance(w, int):
                clo |= w << (8 * pos)
            elif pos + f.max_width <= _MAX_WORD_BYTES:
                lo = _acc(lo, w << np.uint64(8 * pos)) if pos else _acc(lo, w.copy())
            elif pos >= _MAX_WORD_BYTES:
                hi = _acc(hi, w << np.uint64(8 * pos - 64))
            else:
                lo = _acc(lo, w << np.uint64(8 * pos))
                hi = _acc(hi, w >> np.uint64(64 - 8 * pos))
        elif not (isinstance(w, int) and w == 0):
            wv: U64 = np.full(1, w, np.uint64) if isinstance(w, int) else w
            sh = pos << np.uint64(3)
            if pos_min < _MAX_WORD_BYTES:
                lo = _acc(lo, np.left_shift(wv, sh))  # numpy: a shift by >= 64 gives 0
            if pos_max + f.max_width > _MAX_WORD_BYTES:  # bytes past the 8th go to hi
                spill: U64 = np.right_shift(wv, _U64 - sh)  # right for pos <= 8
                if pos_max > _MAX_WORD_BYTES:
                    np.bitwise_or(spill, np.left_shift(wv, sh - _U64), out=spill)
                hi = _acc(hi, spill)
        pos = _advance(pos, f.width)
        pos_min += f.width if isinstance(f.width, int) else int(f.width.min())
        pos_max += f.max_width
    c0 = np.uint64(((clo & 0xFFFFFFFF) << 32) | (pos if isinstance(pos, int) else 0))
    c1 = np.uint64(clo >> 32)
    w0 = c0 if lo is None else (lo << _U32) | c0
    if not isinstance(pos, int):
        w0 = w0 | pos
    out[:, 0] = w0
    if lo is None:
        out[:, 1] = c1 if hi is None else (hi << _U32) | c1
        return
    w1: U64 = np.right_shift(lo, _U32, out=lo)
    if c1:
        w1 |= c1
    if hi is not None:
        w1 |= hi << _U32
    out[:, 1] = w1


def _advance(pos: U64 | int, width: I64 | int) -> U64 | int:
    """Byte position after a field: a Python int while every row agrees."""
    if isinstance(width, int):
        return pos + width
    moved: U64 = np.add(width.view(np.uint64), pos, dtype=np.uint64)
    return moved


def _groups(fields: list[_Field]) -> list[list[_Field]]:
    """Consecutive fields in groups of at most 12 bytes (by their widest row)."""
    groups: list[list[_Field]] = [[]]
    used = 0
    for f in fields:
        if used + f.max_width > _INLINE and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append(f)
        used += f.max_width
    return groups


def _view_words(arr: pa.Array, buffer_base: int, max_len: int) -> tuple[U64, list[pa.Buffer]]:
    """The (n, 2) uint64 BinaryView words of a binary array and the data buffers they use.

    Views of strings longer than 12 bytes name a data buffer by index; ``buffer_base``
    shifts those indices past the buffers of columns placed before this one.
    """
    view = arr.cast(pa.binary_view())
    bufs = view.buffers()
    words = np.frombuffer(bufs[1], np.uint64).reshape(-1, 2)[view.offset : view.offset + len(view)]
    if max_len <= _INLINE:
        return words, []  # all inline: no buffer referenced
    data = [b for b in bufs[2:] if b is not None]
    if buffer_base and data:
        long = (words[:, 0] & _LOW32) > np.uint64(_INLINE)
        words = words.copy()
        words[long, 1] += np.uint64(buffer_base)
    return words, data


def _inline_view(section: bytes) -> tuple[int, int]:
    """The two words of an inline BinaryView holding ``section`` (at most 12 bytes)."""
    data = int.from_bytes(section, "little")
    return len(section) | ((data & 0xFFFFFFFF) << 32), data >> 32


def _drop_front(view: U64, nbytes: int) -> None:
    """Removes the first ``nbytes`` bytes of one inline view (2 words), in place."""
    w0, w1 = int(view[0]), int(view[1])
    data = ((w0 >> 32) | (w1 << 32)) >> (8 * nbytes)
    view[0] = ((w0 & 0xFFFFFFFF) - nbytes) | ((data & 0xFFFFFFFF) << 32)
    view[1] = data >> 32


@dataclass(slots=True)
class _Chunk:
    """Encoded records of whole batches: one buffer and per-batch metadata."""

    data: memoryview  # records of all batches, back to back
    batch_ends: I64  # byte offset in data where each batch's records end
    counts: I64
    base_ts: I64
    max_ts: I64


def _zigzag_len(lengths: I64, has_null: bool) -> U64:
    """Zig-zag of lengths (-1 only where null): a shift when none is null."""
    return _zigzag(lengths) if has_null else (lengths << 1).view(np.uint64)


def _encode_chunk(cols: _Columns, starts: I64) -> _Chunk:
    """Encodes every row of ``cols``; offsetDelta restarts at each row in ``starts``.

    Builds one BinaryView per piece of each record -- inline packed varints, key, value,
    headers -- in record order, then lets one C++ cast concatenate them.
    """
    n = cols.n
    counts = np.diff(np.append(starts, n))
    od = np.arange(n, dtype=np.int64)
    if len(starts) > 1:
        od -= np.repeat(starts, counts)
    if cols.timestamps is None:
        assert cols.base_ts is not None
        base_ts = np.full(len(starts), cols.base_ts, np.int64)
        max_ts = base_ts
        ts_field = _const(b"\x00")
    else:
        ts = cols.timestamps
        base_ts = (
            np.full(len(starts), cols.base_ts, np.int64) if cols.base_ts is not None else ts[starts]
        )
        max_ts = np.maximum.reduceat(ts, starts)
        base_rows: int | I64 = int(base_ts[0]) if len(starts) == 1 else np.repeat(base_ts, counts)
        ts_field = _field(_zigzag(_ts_deltas(ts, base_rows)))
    od_field = _field((od << 1).view(np.uint64))
    v_field = _field(_zigzag_len(cols.vlen, cols.v_null))
    if cols.klen is None or cols.keys is None:
        k_field = _const(b"\x01")
        key_max = -1
    else:
        k_field = _field(_zigzag_len(cols.klen, cols.k_null))
        key_max = int(cols.klen.max())
    body: I64 = np.maximum(cols.vlen, 0) if cols.v_null else cols.vlen.copy()
    body += 1 + ts_field.width + od_field.width + v_field.width + k_field.width
    if key_max >= 0 and cols.klen is not None:
        body += np.maximum(cols.klen, 0)
    body += len(cols.shared_headers) if cols.row_hlen is None else cols.row_hlen
    if int(body.max()) > INT32_MAX:
        raise EncodeError("record too large")
    len_field = _field((body << 1).view(np.uint64))
    rec_ends = np.cumsum(body + len_field.width)

    # The shared headers section of record i rides in the first view of record i+1.
    shared = cols.shared_headers if cols.row_headers is None else None
    carry = shared is not None and len(shared) <= _INLINE
    head = [len_field, _const(b"\x00"), ts_field, od_field, k_field]
    if key_max < 0:
        head.append(v_field)
    if carry:
        assert shared is not None
        head.insert(0, _const(shared))
    head_groups = _groups(head)
    mid_groups = _groups([v_field]) if key_max >= 0 else []
    k = len(head_groups) + len(mid_groups) + 1 + (key_max >= 0) + (not carry)
    flat_views = np.empty((n * k + carry, 2), np.uint64)
    views = flat_views[: n * k].reshape(n, k, 2)
    as16 = views.view("V16").reshape(n, k)
    data_bufs: list[pa.Buffer] = []
    j = 0
    for group in head_groups:
        _pack_into(group, views[:, j])
        j += 1
    vwords, bufs = _view_words(cols.values, 0, int(cols.vlen.max()))
    data_bufs += bufs
    if key_max >= 0:
        assert cols.keys is not None
        kwords, bufs = _view_words(cols.keys, len(data_bufs), key_max)
        data_bufs += bufs
        as16[:, j] = kwords.view("V16").reshape(n)
        j += 1
        for group in mid_groups:
            _pack_into(group, views[:, j])
            j += 1
    as16[:, j] = vwords.view("V16").reshape(n)
    j += 1
    if carry:
        assert shared is not None
        _drop_front(flat_views[0], len(shared))
        flat_views[-1] = _inline_view(shared)
    elif cols.row_headers is None:
        assert shared is not None
        prefix = int.from_bytes(shared[:4], "little")
        views[:, j, 0] = len(shared) | (prefix << 32)
        views[:, j, 1] = len(data_bufs)  # buffer index, offset 0
        data_bufs.append(pa.py_buffer(shared))
    else:
        assert cols.row_hlen is not None
        hwords, bufs = _view_words(cols.row_headers, len(data_bufs), int(cols.row_hlen.max()))
        data_bufs += bufs
        as16[:, j] = hwords.view("V16").reshape(n)
    total = int(rec_ends[-1])
    target = pa.large_binary() if total >= 2**31 - 1 else pa.binary()
    arr = pa.Array.from_buffers(
        pa.binary_view(), len(flat_views), [None, pa.py_buffer(flat_views), *data_bufs]
    )
    flat = arr.cast(target)
    out = memoryview(flat.buffers()[2]).cast("B")[:total]
    batch_ends = rec_ends[np.append(starts[1:], n) - 1]
    return _Chunk(out, batch_ends, counts, base_ts, max_ts)


# ---------------------------------------------------------------------------------------
# Public encoders
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """One batch's (uncompressed) records section and what its header needs."""

    records: memoryview
    record_count: int
    base_timestamp_ms: int
    max_timestamp_ms: int

    @property
    def section_size(self) -> int:
        """The records section's bytes, uncompressed."""
        return len(self.records)

    def max_size(self, compression: int = NONE) -> int:
        """Bytes to reserve for :meth:`write_into` (exact when uncompressed)."""
        return HEADER_SIZE + _codecs.compress_bound(compression, len(self.records))

    def write_into(
        self,
        buf: WritableBuffer,
        offset: int,
        *,
        settings: BatchSettings = PLAIN,
    ) -> int:
        """Writes the whole batch at ``buf[offset:]``, CRC last; returns its end offset."""
        return _records.write_batch(
            buf,
            offset,
            self.records,
            record_count=self.record_count,
            base_timestamp_ms=self.base_timestamp_ms,
            max_timestamp_ms=self.max_timestamp_ms,
            settings=settings,
        )

    def to_bytes(self, settings: BatchSettings = PLAIN) -> bytes:
        """The whole batch as new bytes (see :meth:`write_into`)."""
        out = bytearray(self.max_size(settings.compression))
        end = self.write_into(out, 0, settings=settings)
        del out[end:]
        return bytes(out)


def _row_args(
    cols: _Columns, lo: int, hi: int, starts: Sequence[int]
) -> Iterator[tuple[int, int, bytes | None, bytes | None, bytes]]:
    """Per-record encoder arguments for rows [lo, hi) (the fallback path)."""
    vals = cols.values.to_pylist()
    keys = cols.keys.to_pylist() if cols.keys is not None else None
    hdrs = cols.row_headers.to_pylist() if cols.row_headers is not None else None
    bounds = [*starts, hi]
    for b in range(len(starts)):
        s, e = bounds[b], bounds[b + 1]
        if cols.timestamps is not None:
            base = cols.base_ts if cols.base_ts is not None else int(cols.timestamps[s])
        else:
            base = cols.base_ts if cols.base_ts is not None else 0
        for i in range(s, e):
            ts = int(cols.timestamps[i]) if cols.timestamps is not None else base
            key = None if keys is None or cols.klen is None or cols.klen[i] < 0 else keys[i]
            value = None if cols.vlen[i] < 0 else vals[i]
            yield (
                i - s,
                ts - base,
                key,
                value,
                (hdrs[i] if hdrs is not None else cols.shared_headers),
            )


def _encode_chunk_slow(cols: _Columns, starts: I64) -> _Chunk:
    """The per-record encoder over a chunk, for inputs the vectorised path cannot take."""
    out = bytearray()
    ends = []
    start_list = [int(s) for s in starts]
    bounds = [*start_list, cols.n]
    base_ts, max_ts = [], []
    for b in range(len(start_list)):
        s, e = bounds[b], bounds[b + 1]
        for od, td, key, value, hdr in _row_args(cols, s, e, [s]):
            _records._append_record(out, od, td, key, value, hdr)
        ends.append(len(out))
        if cols.timestamps is not None:
            base = cols.base_ts if cols.base_ts is not None else int(cols.timestamps[s])
            base_ts.append(base)
            max_ts.append(int(cols.timestamps[s:e].max()))
        else:
            assert cols.base_ts is not None
            base_ts.append(cols.base_ts)
            max_ts.append(cols.base_ts)
    return _Chunk(
        memoryview(out),
        np.array(ends, np.int64),
        np.array(bounds[1:], np.int64) - np.array(bounds[:-1], np.int64),
        np.array(base_ts, np.int64),
        np.array(max_ts, np.int64),
    )


def _encode(cols: _Columns, starts: I64) -> _Chunk:
    try:
        return _encode_chunk(cols, starts)
    except _TooWide:
        return _encode_chunk_slow(cols, starts)


def _chunks(bounds: I64, row_bytes: I64 | None) -> Iterator[tuple[int, int]]:
    """Ranges of whole batches [first, last) of about CHUNK_BYTES each."""
    nb = len(bounds) - 1
    if row_bytes is None or nb <= 1:
        yield 0, nb
        return
    cum = np.concatenate(([0], np.cumsum(row_bytes)))
    batch_cum = cum[bounds]
    first = 0
    while first < nb:
        last = int(np.searchsorted(batch_cum, batch_cum[first] + CHUNK_BYTES, side="right")) - 1
        last = max(last, first + 1)
        yield first, min(last, nb)
        first = min(last, nb)


def iter_encoded_batches(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    batch_size: int | None = None,
    max_records: int | None = None,
    bounds: npt.ArrayLike | None = None,
    groups: npt.ArrayLike | None = None,
    base_timestamp_ms: int | None = None,
) -> Iterator[EncodedBatch]:
    """Encodes many rows as consecutive batches, vectorised across batches.

    Batches come from ``bounds`` (row boundaries ``[0, ..., n]``) or from
    :func:`split_batches` with ``batch_size``/``max_records``, where no batch crosses a
    boundary in ``groups`` (rising row indexes ending with ``n``: rows grouped by
    partition are then encoded in one call); without either, all rows form one batch. Each batch's base timestamp is ``base_timestamp_ms`` or else its first
    row's timestamp. Rows are encoded in chunks of whole batches (about CHUNK_BYTES), so
    memory stays bounded however many rows come in. Write each batch with
    :meth:`EncodedBatch.write_into`.
    """
    cols = _prepare(values, keys, timestamps_ms, headers, base_timestamp_ms)
    if cols.n == 0:
        return
    if bounds is not None:
        b = np.asarray(bounds, dtype=np.int64)
        if b.ndim != 1 or len(b) < 2 or b[0] != 0 or b[-1] != cols.n or (np.diff(b) <= 0).any():
            raise EncodeError("bounds must rise strictly from 0 to the row count")
    elif batch_size is not None:
        g = None
        if groups is not None:
            g = np.asarray(groups, dtype=np.int64)
            if g.ndim != 1 or not len(g) or g[-1] != cols.n or (np.diff(g) <= 0).any():
                raise EncodeError("groups must rise strictly and end at the row count")
        b = _split(cols, batch_size, max_records, g)
    else:
        b = np.array([0, cols.n], np.int64)
    approx = None
    if len(b) > 2:
        approx = np.maximum(cols.vlen, 0) + 16
        if cols.klen is not None:
            approx += np.maximum(cols.klen, 0)
    for first, last in _chunks(b, approx):
        lo, hi = int(b[first]), int(b[last])
        chunk = _encode(cols.slice(lo, hi), b[first:last] - lo)
        ends = chunk.batch_ends.tolist()
        begin = 0
        for j in range(last - first):
            yield EncodedBatch(
                chunk.data[begin : ends[j]],
                int(chunk.counts[j]),
                int(chunk.base_ts[j]),
                int(chunk.max_ts[j]),
            )
            begin = ends[j]


def _single(
    values: BinaryColumn,
    keys: BinaryColumn | None,
    timestamps_ms: TimestampsArg,
    headers: HeadersArg,
    base_timestamp_ms: int | None,
) -> EncodedBatch:
    cols = _prepare(values, keys, timestamps_ms, headers, base_timestamp_ms)
    if cols.n == 0:
        raise EncodeError("a record batch needs at least one record")
    chunk = _encode(cols, np.zeros(1, np.int64))
    return EncodedBatch(chunk.data, cols.n, int(chunk.base_ts[0]), int(chunk.max_ts[0]))


def encoded_size(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    base_timestamp_ms: int | None = None,
    compression: int = NONE,
) -> int:
    """Bytes to reserve for :func:`encode_columns_into` with the same arguments.

    Exact without compression; with a codec, an upper bound of the compressed batch.
    """
    sizes = record_sizes(values, keys, timestamps_ms, headers, base_timestamp_ms=base_timestamp_ms)
    if len(sizes) == 0:
        raise EncodeError("a record batch needs at least one record")
    return HEADER_SIZE + _codecs.compress_bound(compression, int(sizes.sum()))


def encode_columns_into(
    buf: WritableBuffer,
    offset: int,
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    base_timestamp_ms: int | None = None,
    settings: BatchSettings = PLAIN,
) -> int:
    """Encodes all rows as ONE batch at ``buf[offset:]``; returns the end offset.

    ``values``/``keys``: see :func:`to_binary_array` (``keys=None``: null keys).
    ``timestamps_ms``: per-row int64 (or datetime64) array, or one int for all rows.
    ``base_timestamp_ms``: the batch's base timestamp; defaults to the first row's.
    ``headers``: one list of (str, bytes | None) for every record, or one list per row
    (slower: encoded row by row). Reserve :func:`encoded_size` bytes first.
    """
    batch = _single(values, keys, timestamps_ms, headers, base_timestamp_ms)
    return batch.write_into(
        buf,
        offset,
        settings=settings,
    )


def encode_columns(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
    *,
    base_timestamp_ms: int | None = None,
    settings: BatchSettings = PLAIN,
) -> bytes:
    """All rows as ONE batch in new bytes (see :func:`encode_columns_into`)."""
    batch = _single(values, keys, timestamps_ms, headers, base_timestamp_ms)
    return batch.to_bytes(
        settings=settings,
    )


def as_new_records(
    values: BinaryColumn,
    keys: BinaryColumn | None = None,
    timestamps_ms: TimestampsArg = None,
    headers: HeadersArg = None,
) -> list[NewRecord]:
    """The same rows as per-record encoder input (for tests and the slow path)."""
    vals = to_binary_array(values).to_pylist()
    n = len(vals)
    ks = to_binary_array(keys, "keys").to_pylist() if keys is not None else [None] * n
    if timestamps_ms is None:
        ts: list[int | None] = [None] * n
    elif np.ndim(timestamps_ms) == 0:
        ts = [int(timestamps_ms)] * n  # type: ignore[arg-type]
    else:
        ts = [int(t) for t in _timestamps(timestamps_ms, n)]
    if not headers:
        hs: list[Sequence[Header]] = [()] * n
    elif all(_is_header_pair(h) for h in headers):
        hs = [headers] * n  # type: ignore[list-item]
    else:
        hs = list(headers)  # type: ignore[arg-type]
    return [NewRecord(k, v, h, t) for k, v, h, t in zip(ks, vals, hs, ts, strict=True)]
