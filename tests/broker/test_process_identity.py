"""A process's identity (pid and start time) and whether it still runs, read from
``/proc/<pid>/stat`` as psutil reads it, without importing psutil: what a worker's
Hello, the sender's check of its owner and a worker's reading of why a producer is
gone compare."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shmprod import ipc
from shmprod.worker.cause import alive

pytestmark = pytest.mark.broker  # starts processes


def _psutil_view(pid: int) -> tuple[bool, int]:
    import psutil

    proc = psutil.Process(pid)
    return proc.status() == psutil.STATUS_ZOMBIE, int(proc.create_time() * 1_000_000)


def _zombie_child() -> subprocess.Popen[bytes]:
    """A child that has exited and is not waited for yet."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = ipc.process_state(child.pid)
        if found is not None and found[0] == "Z":
            return child
        time.sleep(0.02)
    child.kill()
    child.wait()
    raise AssertionError("the child did not exit within 30 s")


def test_process_state_reads_what_psutil_reads() -> None:
    """A process's identity is read from /proc without importing psutil; it must be the
    value psutil gives, since a peer compares the start times."""
    child = _zombie_child()
    try:
        for pid in (os.getpid(), os.getppid(), child.pid):
            found = ipc.process_state(pid)
            assert found is not None
            zombie, start_us = _psutil_view(pid)
            assert (found[0] == "Z", found[1]) == (zombie, start_us)
        assert ipc.process_start_us(child.pid) == _psutil_view(child.pid)[1]
    finally:
        child.wait(timeout=30)
    assert ipc.process_state(child.pid) is None
    assert ipc.process_start_us(child.pid) == 0
    assert ipc.process_start_us() == _psutil_view(os.getpid())[1]


def test_alive_tells_a_running_a_reused_a_zombie_and_a_gone_pid() -> None:
    me = ipc.process_start_us()
    assert alive(os.getpid(), me) and alive(os.getpid())
    assert not alive(os.getpid(), me - 5_000_000)  # another process had this pid before
    assert not alive(0) and not alive(-3)
    child = _zombie_child()
    try:
        assert not alive(child.pid)  # exited, not yet waited for
    finally:
        child.wait(timeout=30)
    assert not alive(child.pid)
