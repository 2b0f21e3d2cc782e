"""A real ``celery worker --pool prefork`` for tests (workers/celery_app.py), started on
kombu's ``filesystem://`` transport in a temporary directory, and stopped with every
process, segment and log line checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 60.0
BASE_MS = 1_700_000_000_000


class CeleryWorker:
    """A ``celery worker`` process, its log, and the processes it started."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log
        self.segment: str | None = None  # the producer's, once a test asked for it

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"celery worker exited with {self.proc.returncode}:\n{self.log_text()}")
            if " ready." in self.log_text():
                return
            time.sleep(0.2)
        pytest.fail(f"celery worker not ready within {START_TIMEOUT_S} s:\n{self.log_text()}")

    def stop(self) -> list[psutil.Process]:
        """Warm shutdown (SIGTERM: the pool stops, then the producer closes), bounded;
        then SIGKILL for whatever is left. Returns the processes that had to be killed."""
        try:
            family = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        _, alive = psutil.wait_procs(family, timeout=20)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)
        return alive


def start_worker(bootstrap: str, data: Path, concurrency: int, *extra: str) -> CeleryWorker:
    """A ``celery -A workers.celery_app worker --pool prefork`` on the server-less
    transport in ``data``, ready."""
    log = data / "worker.log"
    env = {
        **os.environ,
        "SHMPROD_CELERY_DIR": str(data),
        "SHMPROD_BOOTSTRAP": bootstrap,
        "SHMPROD_PRODUCER_OPTIONS": '{"compression_type": "lz4", "linger_ms": 5}',
        "PYTHONPATH": str(ROOT),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                str(concurrency),
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--hostname",
                f"shmprod-test-{os.getpid()}-{concurrency}@%h",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    w = CeleryWorker(proc, log)
    w.wait_ready()
    return w


def stop_and_check(w: CeleryWorker) -> None:
    """Warm shutdown; nothing left: no process, no segment, no error in the log."""
    killed = w.stop()
    assert not killed, f"processes still alive after the worker stopped: {killed}"
    if w.segment is not None:
        assert not os.path.exists(f"/dev/shm/{w.segment}"), "the producer was not closed"
    assert w.proc.returncode == 0, w.log_text()
    text = w.log_text()
    # the only tracebacks are the task failures a test asked for
    assert text.count("Traceback") == text.count("raised unexpected: UnknownPartitionError")
    assert "ERROR/MainProcess" not in text and "CRITICAL" not in text, text
