"""Arrow columns as ``send_batch`` wants them: keys and values as binary or text (other
types as their text, or whole rows as JSON objects), timestamps as epoch milliseconds.
Pure functions of Arrow arrays. Runs in: any process that sends (export jobs, Spark's
Python workers).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa

from shmprod.errors import InvalidRecordError

if TYPE_CHECKING:
    import pyarrow.compute as pc
else:  # loaded at its first use (34 ms of each export process's start, unused by
    # binary columns with no nulls: the common case)
    from shmprod.arrow import pc

__all__ = ["binary_column", "epoch_ms_column", "header_rows", "json_column"]


def binary_column(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A key or value column for ``send_batch``: binary and strings as they are, any
    other type as its text (numbers as decimal)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t):
        return arr
    if pa.types.is_large_string(t) or pa.types.is_null(t):
        return arr
    return pc.cast(arr, pa.string())


_MS_PER: Final = {"s": (1000, 1), "ms": (1, 1), "us": (1, 1000), "ns": (1, 1_000_000)}


def epoch_ms_column(arr: pa.Array | pa.ChunkedArray, now_ms: int) -> np.ndarray[Any, Any]:
    """A timestamp column as int64 epoch milliseconds: Arrow timestamps of any unit
    (Spark's TimestampType arrives as microseconds since the epoch), dates, or integers
    taken as milliseconds. Nulls become ``now_ms``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_timestamp(t):
        mul, div = _MS_PER[t.unit]
        ints = arr.cast(pa.int64())
    elif pa.types.is_date(t):
        mul, div = 86_400_000, 1
        ints = pc.cast(pc.cast(arr, pa.date32()), pa.int32()).cast(pa.int64())
    elif pa.types.is_integer(t):
        mul, div = 1, 1
        ints = arr.cast(pa.int64())
    else:
        raise InvalidRecordError(
            f"timestamp column of type {t}: need a timestamp, a date or integer epoch ms"
        )
    raw = np.asarray(pc.fill_null(ints, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    ms = raw * mul // div
    if ints.null_count:
        ms[np.asarray(ints.is_null().to_numpy(zero_copy_only=False), dtype=bool)] = now_ms
    return ms


def _json_default(obj: Any) -> Any:
    if isinstance(obj, datetime.datetime | datetime.date | datetime.time):
        return obj.isoformat()
    if isinstance(obj, bytes | bytearray):
        return base64.b64encode(obj).decode()
    if isinstance(obj, decimal.Decimal):
        return str(obj)
    if isinstance(obj, datetime.timedelta):
        return obj.total_seconds()
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def json_column(batch: pa.RecordBatch | pa.Table) -> pa.Array:
    """Each row of ``batch`` as a JSON object (string column): timestamps and dates in
    ISO 8601, binary as base64, decimals as strings. One Python step per row."""
    dumps = json.JSONEncoder(default=_json_default, separators=(",", ":"), ensure_ascii=False)
    return pa.array([dumps.encode(row) for row in batch.to_pylist()], pa.string())


def header_rows(arr: pa.Array | pa.ChunkedArray) -> list[list[tuple[str, bytes | None]]]:
    """A list<struct<key, value>> column as one list of (key, value) pairs per row
    (string values as UTF-8; a null list: no headers), for ``send_batch``'s per-row
    headers.

    The headers of every row are read as two flat columns (keys, values) and sliced
    per row: 1.1-1.9 us a row of two headers, where reading each row's list of dicts
    (``to_pylist`` of the column) took 5.3 us (100,000 rows)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    flat = arr.flatten()  # every header of the non-null rows, in order
    keys = flat.field("key")
    values = flat.field("value")
    if flat.null_count or keys.null_count:
        raise InvalidRecordError("a header in the headers column has a null key")
    if pa.types.is_string(values.type):
        values = values.cast(pa.binary())
    elif pa.types.is_large_string(values.type):
        values = values.cast(pa.large_binary())
    pairs = list(zip(keys.to_pylist(), values.to_pylist(), strict=True))
    counts = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    ends = np.cumsum(counts)
    starts = (ends - counts).tolist()
    return [pairs[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]
