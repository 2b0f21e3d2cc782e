"""How ``shmprod.export`` cuts a Parquet file into jobs: runs of consecutive row groups
(shmprod.exporter._row_group_runs), each job read one row group at a time."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.exporter import JOB_ROWS, Columns, Job, _batches, _row_group_runs, prepare


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 200), max_size=40), target=st.integers(0, 500))
def test_runs_cover_every_row_group_once_in_order(rows: list[int], target: int) -> None:
    """Every row group once, in order; every run but the last holds at least ``target``
    rows, and would not without its last group (no run is longer than it needs)."""
    runs = _row_group_runs(rows, target)
    assert [g for run in runs for g in run] == list(range(len(rows)))
    for i, run in enumerate(runs):
        assert run, "an empty run"
        held = sum(rows[g] for g in run)
        if i < len(runs) - 1:
            assert held >= target
        assert held - rows[run[-1]] < target or len(run) == 1


def _file(path: Path, rows: int, group: int) -> Path:
    pq.write_table(
        pa.table({"v": pa.array([b"%d" % i for i in range(rows)], pa.binary())}),
        path,
        row_group_size=group,
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
