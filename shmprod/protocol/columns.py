"""Key and value columns: what ``send_batch`` accepts, and their bytes as one Arrow array.

One rule for ``send`` and ``send_batch`` alike (:mod:`shmprod.protocol.values` has it
for one key or value): bytes-like as is, str as UTF-8, None as null; anything else is
refused, never reinterpreted. Columns (:func:`to_binary_array`) follow it per element,
in C or numpy, never a Python loop per row:

=====================================  ==============================================
column                                 elements
=====================================  ==============================================
list, tuple                            bytes-like, str or None
numpy ``object``                       bytes-like, str or None
numpy ``S`` (fixed bytes)              numpy's own element value: trailing NULs cut
numpy ``U`` (fixed text), ``T``        UTF-8 (``U``: trailing NULs cut, as numpy does)
pandas ``object``                      bytes-like, str; None, NaN and ``pd.NA`` are null
pandas ``string``, ``category`` of     UTF-8 / bytes; missing values are null
text or bytes, ``ArrowDtype`` binary
Arrow binary, string (large, view),    as they are (text is UTF-8 already); a
fixed_size_binary, dictionary of them  dictionary is decoded; chunked arrays too
=====================================  ==============================================

Numbers, booleans, dates and every other type are refused, with the fix in the message
(e.g. ``keys.astype("string")`` for decimal text from pandas). A single ``str`` or
``bytes`` is not a column.

Runs in: worker (pure functions, no shared state).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from shmprod.errors import EncodeError
from shmprod.protocol.values import as_bytes, describe, frozen

if TYPE_CHECKING:
    import pyarrow as pa
else:
    from shmprod.arrow import pa


__all__ = ["to_binary_array"]

_LARGE: Final = 1 << 31  # past this many bytes a column needs 64-bit offsets
_FIX_COLUMN: Final = (
    "convert the column first: for numbers as decimal text e.g. col.astype(str) (numpy), "
    'col.astype("string") (pandas: nulls stay null) or pyarrow.compute.cast(col, '
    "pyarrow.string()); numbers are never taken as their machine bytes"
)


# ---------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------


def index_array(rows: npt.NDArray[np.integer[Any]]) -> pa.Array:
    """Row numbers as an Arrow int64 array for ``take``. Not ``pa.array``: that imports
    pandas when it is installed (0.2-0.3 s and tens of MB in every worker process)."""
    ix = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(ix), [None, pa.py_buffer(ix)])


def binary_array(items: list[bytes]) -> pa.Array:
    """A list of bytes as an Arrow large_binary array (without ``pa.array``: see
    :func:`index_array`)."""
    lengths = np.fromiter(map(len, items), np.int64, len(items))
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = pa.py_buffer(b"".join(items))
    return pa.Array.from_buffers(pa.large_binary(), len(items), [None, pa.py_buffer(offsets), data])


def binary_lengths(arr: pa.Array) -> npt.NDArray[np.int64]:
    """Byte length of each row of a binary or large_binary array (null: 0), a new
    writable array, from the offsets (no pandas: see :func:`index_array`)."""
    n = len(arr)
    if n == 0:
        return np.zeros(0, np.int64)
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        arr = arr.cast(pa.large_binary())
    off_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=off_type)[arr.offset : arr.offset + n + 1]
    lengths: npt.NDArray[np.int64] = np.subtract(offsets[1:], offsets[:-1], dtype=np.int64)
    if arr.null_count:
        lengths[~valid_mask(arr)] = 0
    return lengths


def arrow_buffers(arr: pa.Array) -> tuple[int, int, int, Any, Any, Any] | None:
    """A (large_)binary array as the C extension reads it: (length, offset,
    offset width 4 or 8, validity buffer or None, offsets buffer, data buffer); None for
    another type."""
    kind = arr.type
    if pa.types.is_binary(kind):
        width = 4
    elif pa.types.is_large_binary(kind):
        width = 8
    else:
        return None
    validity, offsets, data = arr.buffers()
    return len(arr), arr.offset, width, validity if arr.null_count else None, offsets, data


def join_binary(arrays: list[pa.Array]) -> pa.Array:
    """One binary column of ``arrays`` (binary or large_binary), one copy of the bytes:
    large_binary when the types differ or the bytes need 64-bit offsets."""
    large = len({a.type for a in arrays}) > 1 or sum(a.nbytes for a in arrays) >= _LARGE
    if large:
        arrays = [
            a if pa.types.is_large_binary(a.type) else a.cast(pa.large_binary()) for a in arrays
        ]
    return pa.concat_arrays(arrays)


def valid_mask(arr: pa.Array) -> npt.NDArray[np.bool_]:
    """True where ``arr`` holds a value, read from its validity bitmap. Not
    ``is_valid().to_numpy(zero_copy_only=False)``: that imports pandas (see
    :func:`index_array`)."""
    n = len(arr)
    bitmap = arr.buffers()[0] if arr.null_count else None
    if bitmap is None:
        return np.ones(n, dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + n].astype(bool)


def to_binary_array(column: Any, what: str = "values") -> pa.Array:
    """A column as one Arrow binary (or large_binary) array, by the rule above.

    Convert once and slice the result (zero-copy) when encoding many batches from one
    column. Raises :class:`EncodeError` naming the column, the type and the fix.
    """
    try:
        arr = _to_arrow(column, what)
        return _binary(arr, what, _describe(column))
    except EncodeError:
        raise
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"{what} cannot be converted to binary: {exc}") from None


def _describe(column: Any) -> str:
    if isinstance(column, pa.Array | pa.ChunkedArray):
        return f"an Arrow array of type {column.type}"
    dtype = getattr(column, "dtype", None)
    if dtype is not None:
        return f"a {type(column).__name__} of dtype {dtype}"
    return f"a {type(column).__name__}"


def _to_arrow(column: Any, what: str) -> pa.Array:
    """Any accepted column form as one Arrow array (any type; checked by the caller)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return column.chunk(0)
        if column.num_chunks == 0:
            return pa.array([], column.type)
        return _combine(column, what)
    if isinstance(column, pa.Array):
        return column
    if isinstance(column, str | bytes | bytearray | memoryview):
        raise EncodeError(
            f"{what} must be a column (a list, numpy array, pandas Series or Arrow array), "
            f"got a single {type(column).__name__}: wrap it in a list"
        )
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(column, pandas.Series | pandas.Index):
        return _from_pandas(column, what)
    if isinstance(column, np.ndarray):
        return _from_numpy(column, what)
    if isinstance(column, list | tuple):
        return _from_objects(column, what, pandas_nulls=False)
    raise EncodeError(
        f"{what} must be a list, tuple, numpy array, pandas Series or Arrow array, "
        f"got {type(column).__name__}"
    )


def _combine(column: pa.ChunkedArray, what: str) -> pa.Array:
    t = column.type
    narrow = pa.types.is_string(t) or pa.types.is_binary(t)
    if narrow and sum(c.nbytes for c in column.chunks) >= _LARGE:  # 32-bit offsets overflow
        column = column.cast(pa.large_binary() if pa.types.is_binary(t) else pa.large_string())
    return column.combine_chunks()


def _binary(arr: pa.Array, what: str, described: str) -> pa.Array:
    """An Arrow array of an accepted type as binary/large_binary; refuses the others."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return arr
    if pa.types.is_string(t):
        return arr.view(pa.binary())
    if pa.types.is_large_string(t):
        return arr.view(pa.large_binary())
    if pa.types.is_null(t):
        return pa.nulls(len(arr), pa.binary())
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t) or pa.types.is_fixed_size_binary(t):
        return arr.cast(pa.large_binary() if arr.nbytes >= _LARGE else pa.binary())
    raise EncodeError(
        f"{what} must hold bytes or text, got {described} (Arrow type {t}): " + _FIX_COLUMN
    )


def _from_objects(items: Sequence[Any], what: str, *, pandas_nulls: bool) -> pa.Array:
    """A sequence of Python objects: bytes-like, str or None each (pandas: NaN and pd.NA
    are null too). One C conversion; a type scan first, since pyarrow would take any
    memoryview's raw bytes."""
    if not set(map(type, items)) <= _PLAIN:  # buffers (memoryview, numpy uint8, ...)
        items = [_plain(item, f"{what}[{i}]", pandas_nulls) for i, item in enumerate(items)]
    try:
        return pa.array(items, type=pa.binary(), from_pandas=pandas_nulls)
    except (pa.ArrowTypeError, pa.ArrowInvalid, TypeError, ValueError):
        pass
    for i, item in enumerate(items):
        if item is None or isinstance(item, bytes | bytearray | str | memoryview):
            continue
        if pandas_nulls and _is_pandas_null(item):
            continue
        raise EncodeError(
            f"{what}[{i}] must be bytes, str or None, got {describe(item)}: " + _FIX_COLUMN
        )
    try:  # every element passed: too large for 32-bit offsets, or bad UTF-8
        return pa.array(items, type=pa.large_binary(), from_pandas=pandas_nulls)
    except (pa.ArrowException, UnicodeEncodeError) as exc:
        raise EncodeError(f"{what} cannot be converted to binary: {exc}") from None


_PLAIN: Final = frozenset({bytes, bytearray, str, type(None)})


def _plain(item: object, what: str, pandas_nulls: bool) -> object:
    """One element by the rule of :func:`shmprod.protocol.values.as_bytes` (what ``send``
    takes), as bytes, str or None; pandas nulls stay for pyarrow to see."""
    if type(item) in _PLAIN or (pandas_nulls and _is_pandas_null(item)):
        return item
    try:
        b = as_bytes(item, what)
    except EncodeError as exc:
        raise EncodeError(f"{exc}; {_FIX_COLUMN}") from None
    return frozen(b)


def _is_pandas_null(item: object) -> bool:
    if isinstance(item, float) and item != item:  # NaN
        return True
    pandas = sys.modules.get("pandas")
    return pandas is not None and item is pandas.NA


def _from_numpy(arr: npt.NDArray[Any], what: str) -> pa.Array:
    if arr.ndim != 1:
        raise EncodeError(f"{what} must be one-dimensional, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "O":
        return _from_objects(arr.tolist(), what, pandas_nulls=False)
    if kind == "S":
        return _fixed_bytes(arr)
    if kind == "U":
        return _fixed_text(arr, what)
    if kind == "T":  # numpy 2 StringDType: variable width, converted by pyarrow
        return pa.array(arr)
    raise EncodeError(
        f"{what} must hold bytes or text, got a numpy array of dtype {arr.dtype}: " + _FIX_COLUMN
    )


def _from_pandas(column: Any, what: str) -> pa.Array:
    dtype = column.dtype
    if isinstance(dtype, np.dtype) and dtype.kind == "O":  # not category or string
        return _from_objects(column.to_numpy(dtype=object).tolist(), what, pandas_nulls=True)
    arr = pa.array(column, from_pandas=True)
    if isinstance(arr, pa.ChunkedArray):
        arr = _combine(arr, what)
    return _binary(arr, what, f"a pandas {type(column).__name__} of dtype {dtype}")


def _offsets_array(
    n: int, lengths: npt.NDArray[np.int64], data: bytes | npt.NDArray[Any]
) -> pa.Array:
    """A binary (or large_binary) Arrow array from row lengths and concatenated bytes."""
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1]) if n else 0
    buf = pa.py_buffer(data)
    if total >= _LARGE:
        return pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), buf])
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), buf]
    )


def _trimmed(units: npt.NDArray[Any]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Per row of a (rows, width) table of code units: the length without trailing zero
    units (numpy's element semantics), and the mask of the units kept."""
    width = units.shape[1]
    nonzero = units != 0
    last = width - np.argmax(nonzero[:, ::-1], axis=1)
    lengths = np.where(nonzero.any(axis=1), last, 0).astype(np.int64)
    keep = np.arange(width) < lengths[:, None]
    return lengths, keep


def _fixed_bytes(arr: npt.NDArray[Any]) -> pa.Array:
    """numpy ``S<k>``: each element as numpy gives it (trailing NULs cut, inner kept)."""
    n, width = len(arr), arr.dtype.itemsize
    if width == 0 or n == 0:
        return _offsets_array(n, np.zeros(n, np.int64), b"")
    units = np.ascontiguousarray(arr).view(np.uint8).reshape(n, width)
    lengths, keep = _trimmed(units)
    return _offsets_array(n, lengths, np.ascontiguousarray(units[keep]))


def _fixed_text(arr: npt.NDArray[Any], what: str) -> pa.Array:
    """numpy ``U<k>`` (UTF-32): each element as numpy gives it, encoded as UTF-8."""
    n, width = len(arr), arr.dtype.itemsize // 4
    if width == 0 or n == 0:
        return _offsets_array(n, np.zeros(n, np.int64), b"")
    units = np.ascontiguousarray(arr).view(np.uint32).reshape(n, width)
    _, keep = _trimmed(units)
    points = units.astype(np.int64)
    utf8_len = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    lengths = np.where(keep, utf8_len, 0).sum(axis=1).astype(np.int64)
    try:
        data = units[keep].astype("<u4").tobytes().decode("utf-32-le").encode("utf-8")
    except UnicodeError as exc:
        raise EncodeError(f"{what} holds text that is not valid Unicode: {exc}") from None
    return _offsets_array(n, lengths, data)
