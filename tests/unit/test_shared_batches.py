"""A table's batches handed to the export's pool processes in memory files
(shmprod.shared_batches): read back whole, closed when done, never mistaken for another
file, and a damaged stream is a typed error. No process is started: this process reads
its own descriptors through /proc, as a pool process reads its caller's."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmprod import exporter, shared_batches
from shmprod.exporter import BATCH_ROWS, Columns, Job, _batches, prepare
from shmprod.shared_batches import SharedBatch, SharedBatches

pytestmark = pytest.mark.skipif(not shared_batches.SUPPORTED, reason="no memfd_create or /proc")


def _shared_files() -> list[int]:
    """This process's descriptors of shared batches' files."""
    out = []
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{n}").startswith(f"/memfd:{shared_batches.NAME}"):
                out.append(int(n))
    return out


def _table(rows: int) -> pa.Table:
    return pa.table(
        {
            "v": pa.array([b"value-%d" % i for i in range(rows)], pa.binary()),
            "k": pa.array([f"key-{i}" for i in range(rows)]),
            "unused": pa.array(range(rows), pa.int64()),
        }
    )


def _read_back(jobs: list[Job]) -> pa.Table:
    """The jobs' rows as a pool process reads them (a copy: no mapping outlives it)."""
    got = pa.Table.from_batches([b for j in jobs for b in _batches(j)])
    return pa.Table.from_pylist(got.to_pylist(), got.schema)


def test_a_tables_jobs_read_back_every_row_in_order_and_close_their_files() -> None:
    t = _table(2 * BATCH_ROWS + 7)
    assert _shared_files() == []
    with prepare(t, "t", key="k", value="v", workers=2) as plan:
        jobs = list(plan.jobs)
        refs = [j.batch for j in jobs]
        assert all(isinstance(r, SharedBatch) for r in refs)
        assert sorted(_shared_files()) == sorted(r.fd for r in refs if isinstance(r, SharedBatch))
        got = _read_back(jobs)
        # only the columns the export reads are handed over
        assert got.column_names == ["v", "k"]
        assert got.equals(t.select(["v", "k"]))
        plan.release(jobs[0])
        assert len(plan.shared) == 2 and len(_shared_files()) == 2
    assert _shared_files() == []


def test_a_released_file_is_never_read_as_another() -> None:
    """A pool process checks the descriptor still names the batch's file: after the
    caller closed it and the number went to another file, reading fails, typed."""
    shared = SharedBatches()
    ref = shared.share(_table(10).to_batches()[0])
    shared.release(ref)
    fd = os.open("/dev/null", os.O_RDONLY)  # the lowest free number: most likely ref.fd
    try:
        with pytest.raises(OSError):
            shared_batches.read(ref)
    finally:
        os.close(fd)
    shared.release(ref)  # twice: nothing more to close
    shared.close()


def test_without_memory_files_a_batch_is_pickled_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shared_batches, "available", lambda: False)
    t = _table(100)
    with prepare(t, "t", value="v", workers=1) as plan:
        jobs = list(plan.jobs)
        assert [type(j.batch) for j in jobs] == [bytes] and len(plan.shared) == 0
        assert pa.Table.from_batches(list(_batches(jobs[0]))).equals(t.select(["v"]))


def test_a_caller_that_is_not_dumpable_pickles_its_batches() -> None:
    """Another process may not open a non-dumpable process's descriptors, so such a
    caller hands its batches over pickled. (This process is made non-dumpable for the
    test, and dumpable again after.)"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_dumpable = 4
    assert shared_batches.available()
    assert libc.prctl(pr_set_dumpable, 0, 0, 0, 0) == 0
    try:
        assert not shared_batches.available()
        with prepare(_table(10), "t", value="v", workers=1) as plan:
            assert [type(j.batch) for j in plan.jobs] == [bytes]
    finally:
        assert libc.prctl(pr_set_dumpable, 1, 0, 0, 0) == 0
    assert shared_batches.available()


def _stream(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        for b in t.to_batches(40):
            w.write_batch(b)
    return bytes(sink.getvalue())


_GOOD = _stream(_table(120).select(["v", "k"]))


def _share_bytes(data: bytes, shared: SharedBatches) -> SharedBatch:
    """``data`` as a shared batch's file, whatever it holds (the caller always writes a
    whole stream: this is what a damaged file would read like)."""
    fd = os.memfd_create("test", os.MFD_CLOEXEC)
    os.write(fd, data)
    st_ = os.fstat(fd)
    ref = SharedBatch(os.getpid(), fd, st_.st_ino, st_.st_size)
    shared._open[fd] = ref
    return ref


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(1, len(_GOOD)),
    flips=st.lists(st.tuples(st.integers(0, len(_GOOD) - 1), st.integers(0, 255)), max_size=8),
)
def test_a_damaged_stream_is_a_typed_error_or_valid_batches(
    cut: int, flips: list[tuple[int, int]]
) -> None:
    """Fuzz: a stream cut short or with bytes changed, read as a pool process reads it,
    gives valid batches or raises ``OSError`` / ``ArrowException`` (what a job reports
    as its error), never anything else and never a crash."""
    data = bytearray(_GOOD[:cut])
    for at, byte in flips:
        if at < len(data):
            data[at] = byte
    shared = SharedBatches()
    try:
        ref = _share_bytes(bytes(data), shared)
        job = Job("t", Columns("v", "k"), batch=ref)
        try:
            for b in _batches(job):
                assert b.num_rows <= 40
        except (OSError, pa.ArrowException):
            pass
    finally:
        shared.close()


def test_an_export_that_stops_closes_what_it_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool breaks while the first jobs are handed over (before the producer
    starts): every file shared so far is closed. The pool is a stand-in that starts no
    process and never runs a job."""

    class BrokenPool:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.submitted = 0
            self._processes: dict[int, object] = {}

        def submit(self, *args: object) -> Future[None]:
            self.submitted += 1
            if self.submitted == 3:
                raise BrokenProcessPool("a pool process died")
            return Future()

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    monkeypatch.setattr(exporter, "ProcessPoolExecutor", BrokenPool)
    assert _shared_files() == []
    with pytest.raises(BrokenProcessPool):
        exporter.export(
            _table(5 * BATCH_ROWS), "t", bootstrap_servers="127.0.0.1:1", value="v", workers=2
        )
    assert _shared_files() == []
