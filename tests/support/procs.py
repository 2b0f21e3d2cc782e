"""What the process table and the sockets show: sender processes, connections to a
broker, shared-memory segments (tests count them from the outside)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from typing import Any

import psutil


def senders() -> set[int]:
    """Every sender process on the machine (``python -m shmprod.sender``)."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "shmprod.sender" in cmd:
            out.add(p.pid)
    return out


def broker_connections(port: int) -> Counter[int]:
    """Established TCP connections to the broker's port, by process id."""
    return Counter(
        c.pid
        for c in psutil.net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED and c.pid
    )


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmprod-")}


def free_port() -> int:
    """A free loopback TCP port (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kills ``proc`` if it still runs, waits for it, and closes its stdout pipe (a
    test's ``finally``: nothing left running, no ResourceWarning)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def python_output(code: str, *args: str, timeout: float = 120) -> str:
    """Runs ``code`` in a fresh interpreter (``python -c code args...``) and returns
    its stdout; fails the test, with its stderr, when it exits with an error."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
