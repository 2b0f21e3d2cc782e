"""The ``shmprod`` command line: ``shmprod broker`` for local development."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from shmprod.config import parse_bootstrap
from shmprod.connection import BrokerConnection
from tests.support.procs import reap

pytestmark = pytest.mark.broker


def test_broker_command_serves_until_terminated() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmprod", "broker", "--topic", "dev:3", "--topic", "other"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("broker ready: bootstrap_servers=")
        host, port = parse_bootstrap(line.split("=", 1)[1].split()[0])[0]
        with BrokerConnection(host, port) as conn:
            md = conn.metadata(["dev", "other"])
        assert {t.name: len(t.partitions) for t in md.topics} == {"dev": 3, "other": 1}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "broker stopped" in proc.stdout.read()
    finally:
        reap(proc)


def test_version_and_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shmprod", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.startswith("shmprod ")
    bad = subprocess.run(
        [sys.executable, "-m", "shmprod", "demo", "--compression", "brotli"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "brotli" in bad.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--records", "0"], "--records: 0 is out of range"),
        (["demo", "--records", "-5"], "--records: -5 is out of range"),
        (["demo", "--workers", "0"], "--workers: 0 is out of range"),
        (["demo", "--partitions", "0"], "--partitions: 0 is out of range"),
        (["demo", "--value-size", "x"], "'x' is not an integer"),
        (["demo", "--value-size", str(1 << 20)], "--value-size: 1048576 is out of range"),
        (["demo", "--report", "/nonexistent-dir/r.json"], "cannot write a report"),
        (["demo", "--bootstrap", "nope"], "not host:port"),
        (["broker", "--port", "70000"], "--port: 70000 is out of range"),
        (["broker", "--topic", "t:0"], "--topic: 0 is out of range"),
        (["broker", "--topic", "bad name"], "not legal"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_starts(args: list[str], says: str) -> None:
    """Every option is checked up front: exit status 2 and a message, never a traceback
    or a wait (``--partitions 0`` used to hang 62 s and then blame metadata)."""
    out = subprocess.run(
        [sys.executable, "-m", "shmprod", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr


def test_run_without_a_command_prints_its_usage() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["bash", str(root / "run")], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert out.returncode == 2
    assert "usage: ./run COMMAND" in out.stderr and "set -euo" not in out.stderr
