"""Broker names are resolved off the sender's loop: a slow DNS server never blocks it."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from shmprod.sender.resolver import Resolver

S = 1_000_000_000


class SlowDns:
    """A getaddrinfo whose network lookups wait until released (numeric ones answer)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked: list[str] = []
        self.fail: set[str] = set()

    def __call__(self, host: str, port: int, **kw: Any) -> list[tuple[Any, ...]]:
        if kw.get("flags", 0) & socket.AI_NUMERICHOST:
            return socket.getaddrinfo(host, port, **kw)
        self.asked.append(host)
        assert self.release.wait(10)
        if host in self.fail:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return socket.getaddrinfo("127.0.0.1", port, type=socket.SOCK_STREAM)


def _wait_readable(r: Resolver, now: int) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(r.wake_socket, selectors.EVENT_READ)
        assert sel.select(10)
    r.on_readable(now)


def test_ip_literals_answer_at_once_names_never_block() -> None:
    dns = SlowDns()
    r = Resolver(dns, ttl_ns=5 * S)
    try:
        family, _, _, addr = r.lookup("127.0.0.1", 9092, 0)  # type: ignore[misc]
        assert family == socket.AF_INET and addr == ("127.0.0.1", 9092)
        started = time.monotonic()
        assert r.lookup("broker-1.example", 9092, 0) is None  # not yet: asked off the loop
        assert r.lookup("broker-1.example", 9092, 0) is None  # asked once, not twice
        assert time.monotonic() - started < 0.5
        dns.release.set()
        _wait_readable(r, 0)
        assert r.lookup("broker-1.example", 9092, 1 * S)[3] == ("127.0.0.1", 9092)  # type: ignore[index]
        assert dns.asked == ["broker-1.example"]  # cached
        assert r.lookup("broker-1.example", 9092, 6 * S) is None  # expired: asked again
    finally:
        r.close()


def test_a_failed_lookup_is_reported_once_then_asked_again() -> None:
    dns = SlowDns()
    dns.fail.add("nowhere.example")
    dns.release.set()
    r = Resolver(dns)
    try:
        assert r.lookup("nowhere.example", 9092, 0) is None
        _wait_readable(r, 0)
        error = r.lookup("nowhere.example", 9092, 0)
        assert isinstance(error, str) and "not known" in error
        assert r.lookup("nowhere.example", 9092, 0) is None  # the caller backed off: again
    finally:
        r.close()


@pytest.mark.broker
def test_a_producer_bootstraps_by_host_name(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    with Producer(bootstrap_servers=f"localhost:{broker.port}") as p:
        assert p.send(topic_name, b"by name").result(timeout=30).offset == 0
