"""The embedded broker's start-up (ports, and a port taken before tansu binds it) and
its end with an owner killed without cleanup."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shmprod.broker import EmbeddedBroker, free_port
from shmprod.errors import BrokerError
from tests.support.procs import reap

pytestmark = pytest.mark.broker


def test_free_ports_handed_out_one_after_the_other_differ() -> None:
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)


def test_a_picked_port_taken_meanwhile_is_picked_again() -> None:
    b = EmbeddedBroker()
    with socket.create_server(("127.0.0.1", b.port)):  # another process got there first
        taken = b.port
        with b:
            assert b.port != taken and b.advertised_port == b.port
            assert b.bootstrap == f"127.0.0.1:{b.port}"


def test_a_port_given_is_never_changed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        b = EmbeddedBroker(port=port, start_timeout=5)
        with pytest.raises(BrokerError, match=str(port)):
            b.start()
        assert b.port == port and b.pid is None


_OWNER = """
import sys, time
from shmprod.broker import EmbeddedBroker
b = EmbeddedBroker().start()
print(b.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie -- dead, not yet reaped -- counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_owner_killed_without_cleanup_takes_its_broker_with_it() -> None:
    """The broker runs in a session of its own; an owner killed by SIGKILL (a timeout, the
    OOM killer) runs no cleanup. Its watchdog stops the broker within about a second."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    broker = 0
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip(), "the owner did not start its broker"
        broker = int(line)
        assert _alive(broker)
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10
        while _alive(broker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(broker), "the broker outlived its owner"
    finally:
        reap(owner)
        if broker and _alive(broker):  # a failed run leaves no broker behind
            os.killpg(broker, signal.SIGKILL)


def test_stop_ends_the_watchdog() -> None:
    with EmbeddedBroker() as b:
        watchdog = b._watchdog
        assert watchdog is not None and watchdog.poll() is None
    assert watchdog.poll() is not None and b._watchdog is None
