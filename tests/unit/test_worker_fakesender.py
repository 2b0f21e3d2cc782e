"""Tests of the fake sender itself (tests/support/fake_sender.py)."""

from __future__ import annotations

import os
import socket

from shmprod import ipc
from tests.support.fake_sender import FakeSender


def test_fake_rejects_a_wrong_secret(fake: FakeSender) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(fake.path)
        s.sendall(ipc.encode(ipc.Hello(b"x" * 16, os.getpid(), 0, False)))
        assert s.recv(100) == b""


def test_fake_grants_and_queues_fifo(fake: FakeSender) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(fake.path)
        s.sendall(ipc.encode(ipc.Hello(fake.secret, os.getpid(), 0, False)))
        reader = ipc.MessageReader()
        msgs: list[ipc.Message] = []
        n = fake.geo.n_buffers
        s.sendall(ipc.encode(ipc.Alloc(1, 1, n)) + ipc.encode(ipc.Alloc(2, 1, 1)))
        while len(msgs) < 2:
            msgs += reader.feed(s.recv(4096))
        assert isinstance(msgs[0], ipc.Welcome)
        grant = msgs[1]
        assert isinstance(grant, ipc.Grant) and len(grant.buffers) == n
        s.sendall(ipc.encode(ipc.Release(1, grant.buffers[:1])))
        while len(msgs) < 3:
            msgs += reader.feed(s.recv(4096))
        assert isinstance(msgs[2], ipc.Grant) and msgs[2].request_id == 2
