"""The main job: ``shmprod demo`` exports through the shared producer and verifies it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shmprod.demo import make_sample_dataset, run_demo

pytestmark = pytest.mark.broker


def test_sample_dataset_is_the_same_however_sliced() -> None:
    whole = make_sample_dataset(1000, 80, start=0)
    again = make_sample_dataset(1000, 80, start=0)
    assert whole.equals(again)
    assert whole.num_rows == 1000
    assert min(len(v) for v in whole["value"].to_pylist()) >= 78


def test_run_demo_verifies_every_record(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    rc = run_demo(
        records=30_000,
        partitions=5,
        compression="zstd",
        workers=2,
        slice_rows=7_000,
        report_path=str(report),
        progress=False,
    )
    assert rc == 0
    data = json.loads(report.read_text())
    assert data["ok"] is True
    assert data["records_read_back"] == 30_000
    assert data["mismatches"] == 0
    assert sum(data["per_partition"].values()) == 30_000


def test_cli_demo_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmprod",
            "demo",
            "--records",
            "5000",
            "--workers",
            "2",
            "--report",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "OK: every record read back" in out.stdout
    assert "acknowledged" in out.stderr
