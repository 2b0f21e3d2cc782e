"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]


def _run(example: str) -> str:
    """Runs ``examples/<example>`` as a user would; its standard output."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_quickstart_runs() -> None:
    stdout = _run("quickstart.py")
    assert "80,000 records from 4 worker processes through one producer" in stdout


def test_the_readme_use_example_runs() -> None:
    stdout = _run("use.py")
    assert "send_batch: [0, 1, 2]" in stdout
    assert "4,000 records from 4 pool processes through one producer" in stdout


def test_export_dataframe_example() -> None:
    pytest.importorskip("pandas")
    assert "exported 10,000 rows" in _run("export_dataframe.py")


def test_export_parquet_dir_example() -> None:
    assert "exported 60,000 rows" in _run("export_parquet_dir.py")


def test_pool_example() -> None:
    assert "8,000 records from 4 pool processes through one producer" in _run("pool.py")


@pytest.mark.celery
def test_celery_example() -> None:
    pytest.importorskip("celery")
    assert "10 tasks, offsets [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in _run("celery_task.py")


@pytest.mark.spark
def test_pyspark_example() -> None:
    pytest.importorskip("pyspark")
    assert "wrote 50,000 rows through format('shmprod')" in _run("pyspark_write.py")
