"""send()'s common case in C (shmprod._speedups) against its Python twin
(shmprod.speedups): the same answer for every input, rows that stay aligned under
threads, a lock that is always released, and no leaked references."""

from __future__ import annotations

import gc
import itertools
import os
import sys
import threading
import time
import tracemalloc
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import speedups
from shmprod.protocol.records import encode_headers
from shmprod.speedups import _PyFutureCore, _PyStageCore, _PyStager

if speedups.ACCELERATED:
    from shmprod import _speedups as C
else:  # pragma: no cover - only without the extension
    C = None

ROOM = 1000  # records_room
MAX_REQUEST = 1100
HEADER = 61
OVERHEAD = 31
STAGED = 12
BATCH = 300  # an explicit partition's batch


def test_the_extension_is_in_use() -> None:
    """The install builds it (a C compiler is part of set-up); without it send() is
    about twice as slow, so a failed build must not pass unnoticed."""
    if os.environ.get("SHMPROD_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("SHMPROD_PURE_PYTHON is set")
    assert speedups.ACCELERATED
    assert speedups.Stager is C.Stager


class _PyStage(_PyStageCore):
    __slots__ = ("tag",)


class _PyFuture(_PyFutureCore):
    __slots__ = ()


def _kinds() -> list[tuple[Any, Any, Any]]:
    kinds: list[tuple[Any, Any, Any]] = [(_PyStage, _PyFuture, _PyStager)]
    if C is not None:

        class CStage(C.StageCore):  # type: ignore[misc,name-defined]
            __slots__ = ("tag",)

        class CFuture(C.FutureCore):  # type: ignore[misc,name-defined]
            __slots__ = ()

        kinds.append((CStage, CFuture, C.Stager))
    return kinds


KINDS = _kinds()
IDS = ["python", "c"][: len(KINDS)]


def _make(kind: Any, layout: list[tuple[Any, ...]]) -> tuple[Any, dict[str, Any]]:
    """A stager over topic "t" with stages per ``layout`` (partitions known (0: no
    list of partitions yet), limit, nbytes[, has a list of headers sections])."""
    stage_t, fut_t, stager_t = kind
    stages: dict[str, list[Any]] = {}
    if layout:
        lst = []
        for parts, limit, nbytes, *sections in layout:
            s = stage_t()
            s.values, s.keys, s.timestamps = [], [], []
            s.limit, s.nbytes = limit, nbytes
            if parts:
                s.partitions, s.part_bytes, s.batch_size = [], bytearray(8 * parts), BATCH
            if sections and sections[0]:
                s.headers = []
            lst.append(s)
        stages["t"] = lst
    lock = threading.Lock()
    stager = stager_t(stages, lock, fut_t, ROOM, MAX_REQUEST, HEADER, OVERHEAD, STAGED, np.integer)
    return stager, {"stages": stages, "lock": lock}


def _snapshot(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (list(s.values), list(s.keys), list(s.timestamps), s.n, s.nbytes)
        for s in state["stages"].get("t", [])
    ]


def _sections(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each stage's headers sections and explicit partitions (with the bytes staged
    per partition)."""
    return [
        (
            None if s.headers is None else list(s.headers),
            s.header_max,
            None if s.partitions is None else list(s.partitions),
            None if s.part_bytes is None else bytes(s.part_bytes),
        )
        for s in state["stages"].get("t", [])
    ]


_blob = st.one_of(
    st.none(),
    st.binary(max_size=1200),
    st.binary(max_size=8).map(bytearray),
    st.text(max_size=4),
    st.just("\ud800x"),
    st.integers(),
)
_header_value = st.one_of(
    st.none(), st.binary(max_size=6), st.text(max_size=3), st.just(bytearray(b"b")), st.just(7)
)
_header_key = st.one_of(st.text(max_size=4), st.just("\ud800"), st.just(b"k"), st.just(3))
_pair = st.one_of(
    st.tuples(_header_key, _header_value),
    st.tuples(_header_key, _header_value).map(list),
    st.just(("a", b"b", b"c")),
    st.just("ab"),
)
_headers = st.one_of(
    st.none(),
    st.lists(_pair, max_size=3),
    st.lists(_pair, max_size=3).map(tuple),
    st.dictionaries(st.text(max_size=3), _header_value, max_size=3),
    st.just({"a": b"1"}.items()),
)
_call = st.tuples(
    st.sampled_from(["t", "u", b"t", None]),
    _blob,
    _blob,
    _headers,
    st.sampled_from(
        [None, 0, 3, -1, 5, 2**64, True, np.int64(2), np.uint8(1), np.int32(-1), np.bool_(True)]
    ),
    st.one_of(
        st.none(),
        st.integers(min_value=-5, max_value=2**64),
        st.integers(min_value=-5, max_value=2**63 - 1).map(np.int64),
        st.just(np.uint64(2**64 - 1)),
        st.just(True),
        st.just(1.5),
        st.just(np.float64(3.0)),
    ),
)
_layout = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 3000), st.integers(0, 2000), st.booleans()),
    max_size=2,
)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(_call, max_size=12), layout=_layout)
def test_c_and_python_agree(calls: list[tuple[Any, ...]], layout: list[Any]) -> None:
    """Every implementation stages the same rows and answers the same for every call
    (timestamps of "now" compared as present, their value checked below)."""
    results = []
    for kind in KINDS:
        stager, state = _make(kind, layout)
        answers = []
        for topic, value, key, headers, partition, ts in calls:
            fut = stager(topic, value, key, headers, partition, ts)
            answers.append(
                None if fut is None else (fut._row, fut._stage is state["stages"]["t"][0])
            )
            assert not state["lock"].locked()
        snap = _snapshot(state)
        for values, keys, stamps, n, _ in snap:
            assert len(values) == len(keys) == len(stamps) == n
        for _, _, stamps, _, _ in snap:
            assert all(type(t) is int and 0 <= t < 2**63 for t in stamps)
        sections = _sections(state)
        for (sec, _, parts, _), (_, _, _, n, _) in zip(sections, snap, strict=True):
            assert sec is None or len(sec) == n
            assert parts is None or len(parts) == n
        results.append((answers, [(v, k, n, b) for v, k, _, n, b in snap], sections))
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_common_case_stages_one_row(kind: Any) -> None:
    stager, state = _make(kind, [(0, 10_000, 0)])
    before = time.time_ns() // 1_000_000
    fut = stager("t", b"v" * 10, b"k", None, None, None)
    after = time.time_ns() // 1_000_000
    stage = state["stages"]["t"][0]
    assert (fut._stage, fut._row) == (stage, 0)
    assert type(fut) is kind[1]
    assert stage.values == [b"v" * 10] and stage.keys == [b"k"]
    assert before <= stage.timestamps[0] <= after
    assert (stage.n, stage.nbytes) == (1, 10 + 1 + 1 + STAGED)
    fut2 = stager("t", None, None, None, None, 2**63 - 1)
    assert fut2._row == 1 and stage.timestamps[1] == 2**63 - 1


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_str_keys_and_values_are_staged_as_utf8_and_bytearrays_as_copies(kind: Any) -> None:
    stager, state = _make(kind, [(0, 10_000, 0)])
    assert stager("t", "välue", "kéy", None, None, None) is not None
    assert stager("t", "", None, None, None, None) is not None
    stage = state["stages"]["t"][0]
    buf = bytearray(b"reused")
    assert stager("t", buf, buf, None, None, None) is not None
    buf[:] = b"change"  # the caller reuses its buffer: what was staged is a copy
    assert stage.values == ["välue".encode(), b"", b"reused"]
    assert stage.keys == ["kéy".encode(), None, b"reused"]
    assert all(type(v) is bytes for v in [*stage.values, stage.keys[2]])
    assert stage.nbytes == (6 + 4 + 1 + STAGED) + (0 + 1 + STAGED) + (6 + 6 + 1 + STAGED)


class _MyInt(int):
    pass


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_numpy_and_int_subclass_partitions_and_timestamps_are_staged_as_ints(kind: Any) -> None:
    stager, state = _make(kind, [(4, 10_000, 0)])
    assert stager("t", b"v", None, None, np.int64(2), np.int64(1_700_000_000_000)) is not None
    assert stager("t", b"v", None, None, _MyInt(3), _MyInt(5)) is not None
    assert stager("t", b"v", None, None, np.uint8(1), np.uint64(7)) is not None
    for partition, ts in [(np.bool_(True), None), (None, np.float64(1.0)), (np.int8(-1), None)]:
        assert stager("t", b"v", None, None, partition, ts) is None  # the Python path's
    stage = state["stages"]["t"][0]
    assert stage.partitions == [2, 3, 1] and stage.timestamps == [1_700_000_000_000, 5, 7]
    assert all(type(x) is int for x in [*stage.partitions, *stage.timestamps])


def test_records_of_one_millisecond_share_their_timestamp() -> None:
    """The C stager stamps every record of one millisecond with the same int (no
    allocation each), and the encoder reads it once."""
    if C is None:
        pytest.skip("the C extension is not in use")
    stager, state = _make(KINDS[-1], [(0, 1 << 30, 0)])
    for _ in range(2_000):
        stager("t", b"v", None, None, None, None)
    ts = state["stages"]["t"][0].timestamps
    for a, b in itertools.pairwise(ts):
        assert (a is b) == (a == b)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize(
    "args",
    [
        ("t", b"v", b"k", [("h", b"")], None, None),  # the stage's first row with headers
        ("t", b"v", b"k", None, 0, None),  # explicit partition
        ("u", b"v", b"k", None, None, None),  # no stage yet
        ("t", "\ud800", None, None, None, None),  # str that is not UTF-8: a typed error
        ("t", b"v", "\udfff", None, None, None),
        ("t", b"v", None, None, None, -1),  # bad timestamp: a typed error
        ("t", b"v", None, None, None, 2**63),
        ("t", b"v", None, None, None, True),
        ("t", b"x" * ROOM, None, None, None, None),  # too large for a batch
    ],
)
def test_other_cases_stage_nothing(kind: Any, args: tuple[Any, ...]) -> None:
    stager, state = _make(kind, [(0, 10_000, 0)])
    assert stager(*args) is None
    assert _snapshot(state) == [([], [], [], 0, 0)]
    assert not state["lock"].locked()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_headers_are_staged_as_their_encoded_section(kind: Any) -> None:
    """Once a stage keeps sections (the Python path made the list at its first row with
    headers), rows with headers in the common forms are staged with the section
    ``encode_headers`` writes, and rows without headers with an empty one."""
    stager, state = _make(kind, [(0, 10_000, 0, True)])
    stage = state["stages"]["t"][0]
    pairs = [("trace", b"\x01\x02"), ("schema", "v2"), ("none", None), ("", b"")]
    calls: list[Any] = [
        pairs,
        tuple(pairs),
        [list(p) for p in pairs],
        dict(pairs),
        None,
        [],
        {},
    ]
    for headers in calls:
        assert stager("t", b"v", None, headers, None, None) is not None
    want = encode_headers([("trace", b"\x01\x02"), ("schema", b"v2"), ("none", None), ("", b"")])
    assert stage.headers == [want] * 4 + [b"\x00"] * 3
    assert stage.header_max == len(want)
    assert stage.nbytes == 4 * (1 + len(want) + STAGED) + 3 * (1 + 1 + STAGED)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
@pytest.mark.parametrize(
    "headers",
    [
        [("k", bytearray(b"v"))],  # another bytes-like: converted by the Python path
        [("k", memoryview(b"v"))],
        [(b"k", b"v")],  # bad key: a typed error there
        [("k", 1)],
        [("\ud800", b"v")],  # not UTF-8
        [("k", "\ud800")],
        [("k", b"v", b"x")],
        ["kv"],
        {"k": b"v"}.items(),
        [("k", b"v" * ROOM)],  # too large for a batch
    ],
)
def test_other_headers_stage_nothing(kind: Any, headers: Any) -> None:
    stager, state = _make(kind, [(0, 10_000, 0, True)])
    assert stager("t", b"v", None, headers, None, None) is None
    assert _snapshot(state) == [([], [], [], 0, 0)]
    assert _sections(state) == [([], 1, None, None)]
    assert not state["lock"].locked()


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_explicit_partitions_are_staged_with_their_bytes(kind: Any) -> None:
    """Once a stage keeps explicit partitions (the Python path made the list at its
    first), a row to a partition it knows is staged and counted against that
    partition's batch; a full batch, or a partition past what it knows, goes to Python
    (which flushes, or checks the partition against the topic)."""
    stager, state = _make(kind, [(4, 10_000, 0)])
    stage = state["stages"]["t"][0]
    row = 100 + 1 + STAGED  # a 100-byte value, no key, no headers: its staged bytes
    assert stager("t", b"v" * 100, None, None, 1, None) is not None
    assert stager("t", b"v" * 100, None, None, None, None) is not None  # no partition
    assert stager("t", b"v" * 100, None, None, 1, None) is not None
    assert stager("t", b"v" * 100, None, None, 1, None) is None  # 3 rows > BATCH: full
    assert stager("t", b"v" * 100, None, None, 3, None) is not None  # another batch
    assert stager("t", b"v", None, None, 4, None) is None  # past the 4 it knows
    assert stager("t", b"v" * (ROOM - 40), None, None, 0, None) is not None  # alone
    assert stage.partitions == [1, -1, 1, 3, 0]
    used = [int.from_bytes(stage.part_bytes[8 * p : 8 * p + 8], sys.byteorder) for p in range(4)]
    assert used == [ROOM - 40 + 1 + STAGED, 2 * row, 0, row]
    assert stage.n == 5
    bare, state = _make(kind, [(0, 10_000, 0)])  # no list of partitions yet
    assert bare("t", b"v", None, None, 0, None) is None
    assert _snapshot(state) == [([], [], [], 0, 0)]


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_full_or_queued_stages_stage_nothing(kind: Any) -> None:
    for layout in ([(0, 20, 0)], [(0, 10_000, 0)] * 2):
        stager, state = _make(kind, layout)
        assert stager("t", b"v" * 10, None, None, None, None) is None
        assert all(s[3] == 0 for s in _snapshot(state))


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_a_lock_that_fails_stages_nothing(kind: Any) -> None:
    class Broken:
        def acquire(self) -> bool:
            raise KeyboardInterrupt

        def release(self) -> None:
            raise AssertionError("not taken, so not released")

        def locked(self) -> bool:
            return True  # held elsewhere: the C stager must acquire it

    stage_t, fut_t, stager_t = kind
    s = stage_t()
    s.values, s.keys, s.timestamps = [], [], []
    stager = stager_t({"t": [s]}, Broken(), fut_t, ROOM, MAX_REQUEST, HEADER, OVERHEAD, STAGED)
    with pytest.raises(KeyboardInterrupt):
        stager("t", b"v", None, None, None, None)
    assert s.n == 0 and s.values == []


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_c_takes_the_lock_only_when_someone_holds_it() -> None:
    """A free lock: the row is staged without acquiring it (the GIL keeps the flushing
    thread out). A held lock: the stager waits for it like any thread."""

    class Counting:
        def __init__(self) -> None:
            self.inner = threading.Lock()
            self.acquired = 0

        def acquire(self) -> bool:
            self.acquired += 1
            return self.inner.acquire()

        def release(self) -> None:
            self.inner.release()

        def locked(self) -> bool:
            return self.inner.locked()

    stage_t, fut_t, stager_t = KINDS[-1]
    s = stage_t()
    s.values, s.keys, s.timestamps = [], [], []
    s.limit = 1 << 30
    lock = Counting()
    stager = stager_t({"t": [s]}, lock, fut_t, ROOM, MAX_REQUEST, HEADER, OVERHEAD, STAGED)
    assert stager("t", b"a", None, None, None, 1)._row == 0
    assert lock.acquired == 0
    lock.inner.acquire()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(stager("t", b"b", None, None, None, 2)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and s.n == 1  # waits for the holder
    lock.inner.release()
    t.join(10)
    assert got[0]._row == 1 and lock.acquired == 1
    assert s.values == [b"a", b"b"] and s.timestamps == [1, 2] and not lock.locked()


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_c_checks_its_arguments() -> None:
    stager, _ = _make(KINDS[1], [(0, 10_000, 0)])
    with pytest.raises(TypeError):
        stager("t", b"v")
    with pytest.raises(TypeError):
        stager("t", b"v", None, None, None, timestamp_ms=None)
    with pytest.raises(TypeError, match="FutureCore"):
        C.Stager({}, threading.Lock(), object, ROOM, MAX_REQUEST, HEADER, OVERHEAD, STAGED)
    with pytest.raises(TypeError):
        C.Stager([], threading.Lock(), KINDS[1][1], 1, 1, 1, 1, 1)


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_rows_stay_aligned_under_threads(kind: Any) -> None:
    """Two threads stage while a third takes the stage away under the lock, as a flush
    does: every row is in exactly one taken stage, with its key, timestamp, headers
    section and partition."""
    stage_t, fut_t, stager_t = kind
    lock = threading.Lock()
    stages: dict[str, list[Any]] = {}
    taken: list[Any] = []

    def fresh() -> None:
        s = stage_t()
        s.values, s.keys, s.timestamps, s.headers = [], [], [], []
        s.partitions, s.part_bytes, s.batch_size = [], bytearray(8 * 4), 1 << 40
        s.limit = 1 << 40
        stages["t"] = [s]

    fresh()
    stager = stager_t(stages, lock, fut_t, ROOM, MAX_REQUEST, HEADER, OVERHEAD, STAGED)
    per_thread = 20_000
    staged: list[list[Any]] = [[], []]

    def send(i: int) -> None:
        for j in range(per_thread):
            v = b"%d:%d" % (i, j)
            part = j % 4 if j % 3 == 0 else None
            fut = stager("t", v, v, [("h", v)] if j % 2 else None, part, j)
            assert fut is not None
            staged[i].append((fut._stage, fut._row, v))

    stop = threading.Event()

    def flush() -> None:
        while not stop.is_set():
            with lock:
                taken.append(stages.pop("t"))
                fresh()
            time.sleep(0.0005)

    ts = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    f = threading.Thread(target=flush)
    f.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    stop.set()
    f.join(60)
    taken.append(stages["t"])
    total = 0
    for (s,) in taken:
        assert len(s.values) == len(s.keys) == len(s.timestamps) == len(s.headers) == s.n
        assert len(s.partitions) == s.n
        assert s.values == s.keys
        total += s.n
    assert total == 2 * per_thread
    for rows in staged:
        for stage, row, v in rows:
            assert stage.values[row] == v
            j = int(v.split(b":")[1])
            assert stage.timestamps[row] == j
            assert stage.headers[row] == (encode_headers([("h", v)]) if j % 2 else b"\x00")
            assert stage.partitions[row] == (j % 4 if j % 3 == 0 else -1)


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_no_reference_is_leaked() -> None:
    stager, state = _make(KINDS[1], [(0, 1 << 40, 0)])
    value, key = os.urandom(100), os.urandom(16)
    before = sys.getrefcount(value), sys.getrefcount(key)
    stamp = 1_700_000_000_000
    stamp_refs = sys.getrefcount(stamp)
    futs = [stager("t", value, key, None, None, stamp) for _ in range(1000)]
    assert sys.getrefcount(value) == before[0] + 1000
    del futs
    for refused in ("u", None):
        assert stager(refused, value, key, None, None, stamp) is None
    stage = state["stages"]["t"][0]
    stage.values, stage.keys, stage.timestamps = [], [], []
    assert (sys.getrefcount(value), sys.getrefcount(key)) == before
    assert sys.getrefcount(stamp) == stamp_refs


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_no_headers_section_or_reference_is_leaked() -> None:
    """Headers are copied into the row's section; a section, or the UTF-8 copy of a str
    value, made for a row that is then refused (too large, the stage's first row with
    headers, not UTF-8) is freed."""
    hval, hkey = os.urandom(50), "k" + os.urandom(4).hex()
    headers = [(hkey, hval), ("s", "text")]
    before = [sys.getrefcount(x) for x in (headers, hval, hkey)]
    stager, state = _make(KINDS[1], [(0, 1 << 40, 0, True)])
    futs = [stager("t", b"v", None, headers, None, None) for _ in range(1000)]
    assert all(f is not None for f in futs)
    assert [sys.getrefcount(x) for x in (headers, hval, hkey)] == before
    sections = state["stages"]["t"][0].headers
    assert [sys.getrefcount(sections[i]) for i in range(3)] == [2, 2, 2]  # list, call
    del futs, sections
    bare, _ = _make(KINDS[1], [(0, 1 << 40, 0)])  # no list of sections yet
    big = [("k", b"x" * ROOM)]
    text = "é" * ROOM
    for _ in range(100):  # warm up
        assert stager("t", b"v", None, big, None, None) is None
        assert bare("t", b"v", None, headers, None, None) is None
        assert stager("t", text, None, None, None, None) is None
        assert stager("t", "ok", "\ud800", None, None, None) is None
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            stager("t", b"v", None, big, None, None)
            bare("t", b"v", None, headers, None, None)
            stager("t", text, None, None, None, None)
            stager("t", "ok", "\ud800", None, None, None)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown  # 5,000 sections of 1 KB each would be 5 MB


@pytest.mark.parametrize("kind", KINDS, ids=IDS)
def test_cycles_through_stages_and_futures_are_collected(kind: Any) -> None:
    """A stage whose rows hold its own futures (as callbacks do) is garbage like any
    Python cycle."""
    stager, state = _make(kind, [(0, 1 << 40, 0)])
    stage = state["stages"]["t"][0]

    class Marker:
        pass

    fut = stager("t", b"v", None, None, None, None)
    stage.values.append([fut, Marker()])  # stage -> list -> future -> stage
    ref = weakref.ref(stage.values[-1][1])
    del stage, fut
    state["stages"].clear()
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_send_method_stages_the_common_case_and_hands_the_rest_to_python() -> None:
    """``Worker.send`` in C: with ``_fast`` a stager, positional and keyword calls stage
    without the Python method; anything else (``_fast`` None, a stage without room,
    other spellings, bad arguments) calls the Python method with the same arguments."""
    calls: list[tuple[Any, ...]] = []

    def slow(
        self: Any,
        topic: str,
        value: Any = None,
        key: Any = None,
        headers: Any = None,
        partition: Any = None,
        timestamp_ms: Any = None,
    ) -> str:
        """The Python method."""
        calls.append((topic, value, key, headers, partition, timestamp_ms))
        return "slow"

    stager, state = _make(KINDS[-1], [(0, 10_000, 0)])

    class W:
        send = C.SendMethod(slow)

        def __init__(self) -> None:
            self._fast = stager

    w = W()
    stage = state["stages"]["t"][0]
    assert w.send("t", b"v1", key=b"k1")._row == 0
    assert w.send("t", b"v2", b"k2", None, None, 7)._row == 1
    assert w.send("t", value=b"v3", timestamp_ms=8)._row == 2
    send = w.send  # a bound method
    assert send("t", b"v4")._row == 3
    assert W.send(w, "t", b"v5")._row == 4
    assert calls == []
    assert stage.values == [b"v1", b"v2", b"v3", b"v4", b"v5"]
    assert stage.keys == [b"k1", b"k2", None, None, None]
    assert stage.timestamps[1:3] == [7, 8]
    # not the common case, or not open: the Python method, same arguments
    assert w.send("t", b"x", partition=0) == "slow"
    assert w.send("u", b"x") == "slow"  # no stage
    assert w.send(topic="t", value=b"x") == "slow"
    name = "".join(["ke", "y"])  # built at run time: not the interned "key"
    assert w.send("t", b"x", **{name: b"k"}) == "slow"
    w._fast = None  # type: ignore[assignment]
    assert w.send("t", b"y") == "slow"
    assert calls == [
        ("t", b"x", None, None, 0, None),
        ("u", b"x", None, None, None, None),
        ("t", b"x", None, None, None, None),
        ("t", b"x", b"k", None, None, None),
        ("t", b"y", None, None, None, None),
    ]
    assert stage.n == 5
    with pytest.raises(TypeError):
        w.send()  # Python's own message
    with pytest.raises(TypeError):
        w.send("t", b"v", value=b"twice")
    with pytest.raises(TypeError):
        w.send("t", b"v", colour=b"red")
    assert W.send.__doc__ == "The Python method." and W.send.__wrapped__ is slow
    assert W.send.__name__ == "slow"
    with pytest.raises(TypeError):
        C.SendMethod(42)


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.one_of(st.none(), _headers), max_size=8))
def test_header_sections_are_the_stagers_sections(rows: list[Any]) -> None:
    """send_batch's per-row sections: the bytes encode_headers writes for a common form,
    None for any other (the Python path then encodes or refuses that row), as the
    stager decides for one record."""
    got = C.header_sections(rows)
    assert len(got) == len(rows)
    for row, section in zip(rows, got, strict=True):
        want = b"\x00" if row is None else speedups.header_section(row)
        assert section == want


@pytest.mark.skipif(C is None, reason="the C extension is not in use")
def test_header_sections_takes_a_list() -> None:
    with pytest.raises(TypeError):
        C.header_sections((None,))
