"""Arrow columns turned into send_batch's inputs (shmprod.tables): a headers column of
list<struct<key, value>> read as each row's (key, value) pairs."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.errors import InvalidRecordError
from shmprod.tables import header_rows

_header = st.fixed_dictionaries(
    {"key": st.text(max_size=4), "value": st.one_of(st.none(), st.binary(max_size=6))}
)
_rows = st.lists(st.one_of(st.none(), st.lists(_header, max_size=3)), max_size=12)


def _expected(rows: list[Any], text: bool) -> list[list[tuple[str, bytes | None]]]:
    out = []
    for row in rows:
        pairs = []
        for h in row or ():
            v = h["value"]
            pairs.append((h["key"], v.encode() if text and v is not None else v))
        out.append(pairs)
    return out


@settings(max_examples=100, deadline=None)
@given(rows=_rows, large=st.booleans(), text=st.booleans(), cut=st.integers(0, 3))
def test_each_row_gets_its_pairs(rows: list[Any], large: bool, text: bool, cut: int) -> None:
    """Any list and key/value types, sliced or chunked, null lists as no headers."""
    if text:  # text values: the same bytes, as UTF-8 strings
        rows = [
            None
            if r is None
            else [{**h, "value": None if h["value"] is None else h["value"].hex()} for h in r]
            for r in rows
        ]
    vtype = (pa.large_string() if large else pa.string()) if text else pa.binary()
    ktype = pa.large_string() if large else pa.string()
    list_of = pa.large_list if large else pa.list_
    arr = pa.array(rows, list_of(pa.struct([("key", ktype), ("value", vtype)])))
    want = _expected(rows, text)
    assert header_rows(arr) == want
    assert header_rows(arr.slice(cut)) == want[cut:]
    assert header_rows(pa.chunked_array([arr.slice(0, cut), arr.slice(cut)], arr.type)) == want


@pytest.mark.parametrize(
    "rows",
    [
        [[{"key": None, "value": b"v"}]],
        [[{"key": "k", "value": b"v"}], [None]],
    ],
)
def test_a_null_key_or_header_is_refused(rows: list[Any]) -> None:
    t = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    with pytest.raises(InvalidRecordError, match="null key"):
        header_rows(pa.array(rows, t))
