"""The embedded broker's start-up: ports, and a port taken before tansu binds it."""

from __future__ import annotations

import socket

import pytest

from shmprod.broker import EmbeddedBroker, free_port
from shmprod.errors import BrokerError

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
