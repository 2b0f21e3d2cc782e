"""The key/value input rule, for ``send`` and ``send_batch`` alike, in every input form.

The rule (README "Keys and values"): bytes-like as is, str as UTF-8, None (and, in a
pandas column, NaN and pd.NA) as null; numpy fixed-width strings as numpy gives each
element; Arrow binary/string (large, view, fixed size, dictionary, chunked) as stored;
anything else -- numbers above all -- is refused with InvalidRecordError naming the type
and the fix, nothing written. Memory is never reinterpreted.

The expected bytes are computed here from Python's and numpy's own view of each element
(``bytes(x)``, ``str(x).encode()``), never by the code under test; what landed on the
broker is read back with confluent-kafka.
"""

from __future__ import annotations

import array
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from shmprod.errors import EncodeError, InvalidRecordError
from shmprod.partitioner import partition_for_key
from shmprod.protocol.columns import to_binary_array
from shmprod.protocol.values import as_bytes
from tests.support.readback import consume_all

# ---------------------------------------------------------------------------------------
# The reported cases, one by one
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "expected"),
    [
        (
            [b"a", "h\u00e9", None, bytearray(b"c"), memoryview(b"d")],
            [b"a", b"h\xc3\xa9", None, b"c", b"d"],
        ),
        (("x", b"y"), [b"x", b"y"]),
        (np.array([b"a\x00b", b"\x00\x01"]), [b"a\x00b", b"\x00\x01"]),
        (np.array(["h\u00e9llo", "abc", "a\x00b"]), [b"h\xc3\xa9llo", b"abc", b"a\x00b"]),
        (np.array([b"x", "y", None], dtype=object), [b"x", b"y", None]),
        (np.array([b"", b"\x00"]), [b"", b""]),  # numpy's own value: trailing NULs cut
        (pd.Series([b"a", "b", None, np.nan, pd.NA]), [b"a", b"b", None, None, None]),
        (pd.Series(["a", None], dtype="string"), [b"a", None]),
        (pd.Series(["q", "r", "q"], dtype="category"), [b"q", b"r", b"q"]),
        (pd.Index(["i", "j"]), [b"i", b"j"]),
        (pa.array(["s", None], pa.large_string()), [b"s", None]),
        (pa.array([b"b"], pa.binary_view()), [b"b"]),
        (pa.array([b"ab", b"cd"], pa.binary(2)), [b"ab", b"cd"]),
        (pa.array(["d", "e", "d"]).dictionary_encode(), [b"d", b"e", b"d"]),
        (pa.chunked_array([["m"], ["n", None]]), [b"m", b"n", None]),
        (pa.chunked_array([], pa.string()), []),
        (pa.nulls(2), [None, None]),
        # elements that send() takes are taken in a list too: one rule for both calls
        (
            [np.frombuffer(b"u8", np.uint8), array.array("B", b"ab"), None],
            [b"u8", b"ab", None],
        ),
    ],
    ids=lambda v: type(v).__name__,
)
def test_accepted_columns(column: Any, expected: list[bytes | None]) -> None:
    assert to_binary_array(column).to_pylist() == expected


@pytest.mark.parametrize(
    ("column", "named"),
    [
        (np.array([42, 300, 7, 1_000_000]), "int64"),
        (np.array([1.5]), "float64"),
        (np.array([True]), "bool"),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64"),
        (pd.Series([1, 256, 3.5]), "float64"),
        (pd.Series([1, None], dtype="Int64"), "Int64"),
        (pd.Series([True, None], dtype="boolean"), "boolean"),
        (pd.Series([1, 2], dtype="category"), "category"),
        (pa.array([1, 2]), "int64"),
        (pa.chunked_array([[1.0], [2.0]]), "double"),
        ([1, 2], "int"),
        ([b"a", 1.5], "float"),
        ([b"ok", memoryview(array.array("i", [1]))], "'i'"),
        ([b"ok", np.array([-1, 2], np.int8)], "'b'"),  # numbers, though one byte each
        (np.array([b"x", math.nan], dtype=object), "float"),  # NaN is null in pandas only
        ("abc", "str"),  # a single str is not a column of three
        (b"abc", "bytes"),
        (np.zeros((2, 2)), "one-dimensional"),
        ({b"a": 1}, "dict"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_refused_columns(column: Any, named: str) -> None:
    with pytest.raises(EncodeError, match=named) as info:
        to_binary_array(column, "keys")
    assert "keys" in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"x", b"x"),
        ("h\u00e9", b"h\xc3\xa9"),
        (np.str_("s"), b"s"),
        (np.bytes_(b"b\x00"), b"b\x00"),  # a bytes object: its bytes, all of them
        (bytearray(b"y"), b"y"),
        (np.frombuffer(b"raw", np.uint8), b"raw"),
        (None, None),
    ],
)
def test_accepted_scalars(value: Any, expected: bytes | None) -> None:
    got = as_bytes(value, "value")
    assert (None if got is None else bytes(got)) == expected


@pytest.mark.parametrize(
    "value",
    [
        42,
        1.5,
        True,
        np.int64(42),
        np.float32(1),
        memoryview(array.array("i", [1])),
        np.array([-1, 2], np.int8),  # one byte per item, but numbers: never their bytes
        np.uint8(5),  # a single number, though its buffer is one unsigned byte
        np.datetime64("2020-01-01T00:00:00.000"),  # exports 8 machine bytes of format B
        np.timedelta64(5, "ms"),
        np.array(7, np.uint8),  # a 0-d array
        object(),
    ],
    ids=lambda v: f"{type(v).__name__}-{getattr(v, 'dtype', '')}",
)
def test_refused_scalars(value: Any) -> None:
    with pytest.raises(EncodeError, match="bytes, str or None"):
        as_bytes(value, "value")


# ---------------------------------------------------------------------------------------
# Input forms x dtypes, with Hypothesis
# ---------------------------------------------------------------------------------------

_blob = st.binary(max_size=12)
_text = st.text(st.characters(codec="utf-8"), max_size=8)


@dataclass
class Case:
    """A column in one input form, and what the rule says each row becomes (or that
    the column is refused: ``expected`` None)."""

    form: str
    column: Any
    expected: list[bytes | None] | None
    scalars: list[Any] | None  # the same rows as send() arguments, where that form exists


def _stripped(b: bytes) -> bytes:
    return b.rstrip(b"\x00")


_NUMPY_NUMBERS = ["int8", "uint8", "int32", "int64", "uint64", "float32", "float64", "bool"]
_NUMPY_NUMBERS += ["datetime64[ms]"]
_PANDAS_NUMBERS = ["int64", "float64", "bool", "Int64", "UInt8", "boolean", "Float64"]
_PANDAS_NUMBERS += ["category", "datetime64[ns]"]
_ARROW_NUMBERS = [pa.int8(), pa.uint8(), pa.int64(), pa.float32(), pa.bool_(), pa.timestamp("ms")]


@st.composite
def cases(draw: Callable[..., Any], n: int) -> Case:
    """One column of ``n`` rows in one of the accepted or refused forms."""
    form = draw(
        st.sampled_from(
            [
                "list-mixed",
                "numpy-object",
                "numpy-S",
                "numpy-U",
                "pandas-object",
                "pandas-string",
                "pandas-category",
                "arrow-binary",
                "arrow-large_string",
                "arrow-string_view",
                "arrow-dictionary",
                "arrow-chunked",
                "arrow-large_binary",
                "numpy-number",
                "pandas-number",
                "arrow-number",
                "list-int",
            ]
        )
    )
    if form == "list-mixed":
        rows = draw(st.lists(st.one_of(_blob, _text, st.none()), min_size=n, max_size=n))
        exp = [r.encode() if isinstance(r, str) else r for r in rows]
        return Case(form, rows, exp, rows)
    if form == "numpy-object":
        rows = draw(st.lists(st.one_of(_blob, _text, st.none()), min_size=n, max_size=n))
        exp = [r.encode() if isinstance(r, str) else r for r in rows]
        arr = np.empty(n, dtype=object)
        arr[:] = rows
        return Case(form, arr, exp, rows)
    if form == "numpy-S":
        rows = draw(st.lists(_blob, min_size=n, max_size=n))
        arr = np.array(rows, dtype=f"S{max([1, *map(len, rows)])}")
        return Case(form, arr, [bytes(x) for x in arr], list(arr))
    if form == "numpy-U":
        rows = draw(st.lists(_text, min_size=n, max_size=n))
        arr = np.array(rows, dtype=f"U{max([1, *map(len, rows)])}")
        return Case(form, arr, [str(x).encode() for x in arr], list(arr))
    if form == "pandas-object":
        rows = draw(
            st.lists(st.one_of(_blob, _text, st.none(), st.just(math.nan)), min_size=n, max_size=n)
        )
        exp = [
            None if r is None or isinstance(r, float) else (r.encode() if isinstance(r, str) else r)
            for r in rows
        ]
        return Case(form, pd.Series(rows, dtype=object), exp, None)
    if form == "pandas-string":
        rows = draw(st.lists(st.one_of(_text, st.none()), min_size=n, max_size=n))
        return Case(
            form,
            pd.Series(rows, dtype="string"),
            [None if r is None else r.encode() for r in rows],
            None,
        )
    if form == "pandas-category":
        rows = draw(st.lists(st.sampled_from(["a", "bb", "\u00e7"]), min_size=n, max_size=n))
        return Case(form, pd.Series(rows, dtype="category"), [r.encode() for r in rows], None)
    if form.startswith("arrow-") and form != "arrow-number":
        rows = draw(st.lists(st.one_of(_text, st.none()), min_size=n, max_size=n))
        exp = [None if r is None else r.encode() for r in rows]
        if form == "arrow-binary":
            col: Any = pa.array(exp, pa.binary())
        elif form == "arrow-large_binary":
            col = pa.array(exp, pa.large_binary())
        elif form == "arrow-large_string":
            col = pa.array(rows, pa.large_string())
        elif form == "arrow-string_view":
            col = pa.array(rows, pa.string_view())
        elif form == "arrow-dictionary":
            col = pa.array(rows, pa.string()).dictionary_encode()
        else:
            cut = n // 2
            col = pa.chunked_array(
                [pa.array(rows[:cut], pa.string()), pa.array(rows[cut:], pa.string())]
            )
        return Case(form, col, exp, None)
    ints = draw(st.lists(st.integers(0, 127), min_size=n, max_size=n))
    if form == "numpy-number":  # uint8 and int8 too: one byte per item, still numbers
        dtype = draw(st.sampled_from(_NUMPY_NUMBERS))
        arr = np.array(ints).astype(dtype)
        return Case(form, arr, None, list(arr))  # numpy scalars: refused by send() too
    if form == "pandas-number":
        dtype = draw(st.sampled_from(_PANDAS_NUMBERS))
        series = pd.Series(ints)
        if dtype == "boolean":
            series = series > 50
        # an empty category column has no numbers in it (its categories are objects)
        empty_ok = not ints and dtype == "category"
        return Case(form, series.astype(dtype), [] if empty_ok else None, None)
    if form == "arrow-number":
        typ = draw(st.sampled_from(_ARROW_NUMBERS))
        return Case(form, pa.array(ints, pa.int64()).cast(typ), None, None)
    return Case(form, ints, None if ints else [], ints)  # an empty list holds no int


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI is never red by luck
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.integers(0, 6).flatmap(cases))
def test_every_form_follows_the_rule(case: Case) -> None:
    if case.expected is None:
        with pytest.raises(EncodeError, match="keys"):
            to_binary_array(case.column, "keys")
        for item in case.scalars or []:
            with pytest.raises(EncodeError):
                as_bytes(item, "key")
        return
    assert to_binary_array(case.column, "keys").to_pylist() == case.expected
    if case.scalars is None:
        return
    for item, exp in zip(case.scalars, case.expected, strict=True):
        got = as_bytes(item, "key")
        assert (None if got is None else bytes(got)) == exp


# ---------------------------------------------------------------------------------------
# ... and what a client we did not write reads back from the broker
# ---------------------------------------------------------------------------------------

PARTITIONS = 3


@pytest.fixture(scope="module")
def producer(broker: EmbeddedBroker) -> Any:
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=1) as p:
        yield p


@pytest.mark.broker
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(st.integers(1, 5).flatmap(cases), st.integers(1, 5).flatmap(cases)),
        min_size=12,
        max_size=12,
    )
)
def test_what_lands_is_what_the_rule_promises(
    broker: EmbeddedBroker, producer: Any, pairs: list[tuple[Case, Case]]
) -> None:
    """Each pair is a values column and a keys column (forms and dtypes drawn apart);
    send_batch, and send() row by row where the form has scalars, either refuse at the
    call with nothing written or land exactly the promised keys and values, keyed rows
    in Java's murmur2 partition of the promised key bytes."""
    topic = f"inputs-{os.getpid()}-{os.urandom(4).hex()}"
    broker.create_topic(topic, PARTITIONS)
    expected: dict[bytes, tuple[bytes | None, bytes | None]] = {}
    for c, (vals, keys) in enumerate(pairs):
        n = min(_rows(vals), _rows(keys))
        vcol, kcol = _head(vals.column, n), _head(keys.column, n)
        tags = [[("row", b"b%d-%d" % (c, i))] for i in range(n)]
        if vals.expected is None or keys.expected is None:
            with pytest.raises(InvalidRecordError):
                producer.send_batch(topic, vcol, keys=kcol, headers=tags)
        else:
            producer.send_batch(topic, vcol, keys=kcol, headers=tags).result(timeout=30)
            for i in range(n):
                expected[b"b%d-%d" % (c, i)] = (keys.expected[i], vals.expected[i])
        if vals.scalars is None or keys.scalars is None:
            continue
        for i in range(n):
            tag = b"s%d-%d" % (c, i)
            v, k = vals.scalars[i], keys.scalars[i]
            if vals.expected is None or keys.expected is None:
                with pytest.raises(InvalidRecordError):
                    producer.send(topic, v, key=k, headers=[("row", tag)])
                continue
            producer.send(topic, v, key=k, headers=[("row", tag)])
            expected[tag] = (keys.expected[i], vals.expected[i])
    producer.flush(30)
    landed = consume_all(broker.bootstrap, topic, PARTITIONS, len(expected), timeout_s=30)
    seen: dict[bytes, tuple[bytes | None, bytes | None]] = {}
    for part, records in landed.items():
        for r in records:
            tag = dict(r.headers)["row"]
            assert tag is not None and tag not in seen
            seen[tag] = (r.key, r.value)
            if r.key is not None:
                assert part == partition_for_key(r.key, PARTITIONS)
    assert seen == expected


def _rows(case: Case) -> int:
    return len(case.column)


def _head(column: Any, n: int) -> Any:
    if isinstance(column, pa.Array | pa.ChunkedArray):
        return column.slice(0, n)
    if isinstance(column, pd.Series):
        return column.iloc[:n]
    return column[:n]
