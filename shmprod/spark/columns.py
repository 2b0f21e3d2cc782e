"""Arrow columns as ``send_batch`` wants them: keys and values as binary or text,
timestamps as epoch milliseconds; rows (pyspark ``Row``) as Arrow tables. Pure
functions; no pyspark import.
Runs in: Spark's Python workers (and anywhere else)."""

from __future__ import annotations

import calendar
import datetime
import time
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shmprod.errors import InvalidRecordError

__all__ = ["binary_column", "datetime_ms", "epoch_ms_column", "rows_table"]


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


def rows_table(names: list[str], chunk: list[tuple[Any, ...]]) -> pa.Table:
    """A chunk of rows (tuples of the ``names`` columns) as an Arrow table. pyspark
    gives TimestampType as naive local datetimes: they become epoch milliseconds
    (``datetime.timestamp`` reads a naive one as local time, which is how pyspark made
    it); an array of structs (Kafka headers: ``Row(key, value)``) becomes a list of
    structs."""
    arrays: list[pa.Array] = []
    for i in range(len(names)):
        col = [r[i] for r in chunk]
        first = next((v for v in col if v is not None), None)
        if isinstance(first, datetime.datetime):
            col = [None if v is None else datetime_ms(v) for v in col]
        elif isinstance(first, list):
            col = [None if v is None else [_struct(h) for h in v] for v in col]
        arrays.append(pa.array(col))
    return pa.table(arrays, names=names)


def _struct(item: Any) -> Any:
    as_dict = getattr(item, "asDict", None)
    return as_dict() if as_dict is not None else item


def datetime_ms(dt: datetime.datetime) -> int:
    """Exact epoch milliseconds of a datetime (naive ones are local time)."""
    seconds = (
        time.mktime(dt.timetuple()) if dt.tzinfo is None else calendar.timegm(dt.utctimetuple())
    )
    return int(seconds) * 1000 + dt.microsecond // 1000
