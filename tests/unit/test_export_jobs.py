"""How ``shmprod.export`` cuts its work into jobs and batches: a Parquet file into runs
of consecutive row groups (shmprod.exporter._row_group_runs), each job read one row
group at a time; and batches of wide rows, read or handed over, at BATCH_BYTES."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod import exporter
from shmprod.exporter import JOB_ROWS, Columns, Job, _batches, _row_group_runs, prepare

_sizes = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 5_000)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(sizes=_sizes, rows=st.integers(0, 500), nbytes=st.integers(0, 20_000))
def test_runs_cover_every_row_group_once_in_order(
    sizes: list[tuple[int, int]], rows: int, nbytes: int
) -> None:
    """Every row group once, in order; every run but the last reaches ``rows`` rows or
    ``nbytes`` bytes, and would reach neither without its last group (no run is longer
    than it needs)."""
    runs = _row_group_runs(sizes, rows, nbytes)
    assert [g for run in runs for g in run] == list(range(len(sizes)))
    for i, run in enumerate(runs):
        assert run, "an empty run"
        held_rows = sum(sizes[g][0] for g in run)
        held_bytes = sum(sizes[g][1] for g in run)
        if i < len(runs) - 1:
            assert held_rows >= rows or held_bytes >= nbytes
        last_rows, last_bytes = sizes[run[-1]]
        assert len(run) == 1 or (held_rows - last_rows < rows and held_bytes - last_bytes < nbytes)


def _file(path: Path, rows: int, group: int, width: int = 0) -> Path:
    pq.write_table(
        pa.table({"v": pa.array([b"%d" % i + b"x" * width for i in range(rows)], pa.binary())}),
        path,
        row_group_size=group,
        compression="none",
    )
    return path


def test_small_row_groups_make_jobs_of_several(tmp_path: Path) -> None:
    """Row groups of 1,000 rows: a job takes enough of them to hold JOB_ROWS, or fewer
    where the file would otherwise give a process under two jobs."""
    big = _file(tmp_path / "big.parquet", 200_000, 1_000)
    jobs = list(prepare(big, "t", value="v", workers=1).jobs)
    assert [len(j.row_groups or ()) for j in jobs] == [JOB_ROWS // 1_000 + 1] * 3 + [
        200 - 3 * (JOB_ROWS // 1_000 + 1)
    ]
    jobs = list(prepare(big, "t", value="v", workers=4).jobs)  # 25,000 rows a job
    assert [len(j.row_groups or ()) for j in jobs] == [25] * 8
    assert [g for j in jobs for g in j.row_groups or ()] == list(range(200))


def test_wide_rows_make_jobs_of_fewer_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run also ends at JOB_BYTES (here 50,000) of the groups' uncompressed bytes, as
    the file's metadata gives them: rows of 1 KB in row groups of 10 hold 10-13 KB a
    group, so a run ends at its fifth group or earlier, long before 100 rows (the rows
    a job may hold here, 200 rows over two jobs a process)."""
    monkeypatch.setattr(exporter, "JOB_BYTES", 50_000)
    path = _file(tmp_path / "wide.parquet", 200, 10, width=1_000)
    md = pq.ParquetFile(path).metadata
    nbytes = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
    assert all(10_000 < b < 13_000 for b in nbytes)
    jobs = list(prepare(path, "t", value="v", workers=1).jobs)
    assert [g for j in jobs for g in j.row_groups or ()] == list(range(20))
    for j in jobs[:-1]:
        held = [nbytes[g] for g in j.row_groups or ()]
        assert sum(held) >= 50_000 > sum(held[:-1])
        assert len(held) <= 5


def test_large_row_groups_stay_a_job_each(tmp_path: Path) -> None:
    path = _file(tmp_path / "a.parquet", 3 * JOB_ROWS, JOB_ROWS)
    jobs = list(prepare(path, "t", value="v", workers=2).jobs)
    assert [j.row_groups for j in jobs] == [(0,), (1,), (2,)]


def test_runs_never_cross_files(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _file(tmp_path / f"{name}.parquet", 3_000, 1_000)
    jobs = list(prepare(tmp_path, "t", value="v", workers=1).jobs)
    assert [(Path(j.path or "").name, j.row_groups) for j in jobs] == [
        ("a.parquet", (0, 1, 2)),
        ("b.parquet", (0, 1, 2)),
    ]


def test_a_job_reads_its_row_groups_in_order_one_at_a_time(tmp_path: Path) -> None:
    """Every row of the job's groups, in order, in batches that never span two groups
    (so a job of many groups holds no more decoded rows than one group's)."""
    path = _file(tmp_path / "a.parquet", 10_000, 1_000)
    job = Job("t", Columns("v"), str(path), "parquet", (2, 3, 4), threads=False)
    batches = list(_batches(job))
    assert [b.num_rows for b in batches] == [1_000] * 3
    got = [v for b in batches for v in b.column("v").to_pylist()]
    assert got == [b"%d" % i for i in range(2_000, 5_000)]


def test_wide_rows_are_read_in_batches_of_fewer_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holds BATCH_ROWS rows, or fewer where they would hold more than
    BATCH_BYTES (here 100,000): row groups of 500 rows of about 5 KB (2.5 MB) are read
    19 rows at a time, every row once and in order."""
    monkeypatch.setattr(exporter, "BATCH_BYTES", 100_000)
    path = _file(tmp_path / "wide.parquet", 1_000, 500, width=5_000)
    job = Job("t", Columns("v"), str(path), "parquet", (0, 1), threads=False)
    batches = list(_batches(job))
    assert [b.num_rows for b in batches] == ([19] * 26 + [6]) * 2
    assert all(b.nbytes <= 100_000 for b in batches)
    got = [v for b in batches for v in b.column("v").to_pylist()]
    assert got == [b"%d" % i + b"x" * 5_000 for i in range(1_000)]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 10_000_000),
    nbytes=st.integers(0, 10**12),
)
def test_rows_per_batch_keeps_a_batch_under_the_bytes(rows: int, nbytes: int) -> None:
    n = exporter._rows_per_batch(rows, nbytes)
    assert 1 <= n <= exporter.BATCH_ROWS
    if rows and nbytes:
        assert n == 1 or n * nbytes / rows <= exporter.BATCH_BYTES


_widths = st.lists(st.integers(0, 3_000), min_size=0, max_size=300)


@settings(max_examples=300, deadline=None)
@given(widths=_widths, limit=st.integers(1, 20_000), start=st.integers(0, 5))
def test_a_batch_is_cut_into_slices_under_the_bytes_in_order(
    widths: list[int], limit: int, start: int
) -> None:
    """Slices cover every row once and in order; each holds at most ``limit`` bytes of
    values (8 for each int64) unless it is one row; and none could have taken its next
    row as well. ``start``: the batch is itself a slice of a larger one."""
    values = [b"x" * w for w in [7] * start + widths]
    whole = pa.record_batch(
        {"v": pa.array(values, pa.binary()), "n": pa.array(range(len(values)), pa.int64())}
    )
    batch = whole.slice(start)
    parts = exporter._byte_slices(batch, limit)
    assert pa.Table.from_batches(parts, batch.schema).equals(pa.Table.from_batches([batch]))
    if batch.nbytes <= limit:
        assert parts == [batch]
        return
    at = 0
    for p in parts:
        size = sum(widths[at : at + p.num_rows]) + 8 * p.num_rows
        assert p.num_rows >= 1 and (p.num_rows == 1 or size <= limit)
        if at + p.num_rows < len(widths):
            assert size + widths[at + p.num_rows] + 8 > limit
        at += p.num_rows


def test_a_tables_batches_are_cut_at_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of wide rows: each job's batch holds about BATCH_BYTES, not BATCH_ROWS
    rows of them (a million rows of 1 MB would otherwise be 64 GB a batch)."""
    monkeypatch.setattr(exporter, "BATCH_BYTES", 50_000)
    t = pa.table({"v": pa.array([b"%05d" % i + b"y" * 995 for i in range(1_000)], pa.binary())})
    with prepare(t, "t", value="v", workers=1) as plan:
        jobs = list(plan.jobs)
        batches = [b for j in jobs for b in _batches(j)]
        assert [b.num_rows for b in batches] == [50] * 20  # rows of 1,000 bytes of values
        got = [v for b in batches for v in b.column("v").to_pylist()]
    assert got == t.column("v").to_pylist()
