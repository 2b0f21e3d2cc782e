"""Rows (pyspark ``Row``) as Arrow tables (the columns ``send_batch`` wants are made by
:mod:`shmprod.tables`). Pure functions; no pyspark import.
Runs in: Spark's Python workers (and anywhere else)."""

from __future__ import annotations

import calendar
import datetime
import time
from typing import Any

import pyarrow as pa

__all__ = ["datetime_ms", "rows_table"]


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
