"""One worker's control connection: non-blocking UNIX socket, framed ipc messages.

Incoming bytes go through :class:`shmprod.ipc.MessageReader`; outgoing messages are
buffered and written when the socket takes them, so a slow or stuck worker never
blocks the loop. A worker that lets more than ``MAX_OUTBOX`` bytes pile up unread is
treated as dead.
"""

from __future__ import annotations

import itertools
import socket

from shmprod import ipc

MAX_OUTBOX = 64 << 20
RECV_SIZE = 256 << 10

_ids = itertools.count(1)


class ControlClosed(Exception):
    """The peer closed the connection, or it broke."""


class ControlConn:
    """A worker (or the owner) attached over the control socket. Runs in: sender."""

    __slots__ = (
        "_out",
        "_reader",
        "accepted_ns",
        "bye",
        "closed",
        "id",
        "owner",
        "pid",
        "slot",
        "sock",
        "start_us",
    )

    def __init__(self, sock: socket.socket, now_ns: int) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.id = next(_ids)
        self.accepted_ns = now_ns
        self.slot = -1  # WORKER slot once welcomed
        self.pid = 0
        self.start_us = 0
        self.owner = False
        self.bye = False
        self.closed = False
        self._reader = ipc.MessageReader()
        self._out = bytearray()

    def __repr__(self) -> str:
        who = "owner" if self.owner else "worker"
        return f"ControlConn(#{self.id} {who} pid={self.pid} slot={self.slot})"

    @property
    def authenticated(self) -> bool:
        return self.slot >= 0

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._out) and not self.closed

    def read(self) -> list[ipc.Message]:
        """Messages that arrived. Raises ControlClosed on EOF or error, IpcError on
        malformed bytes."""
        try:
            data = self.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            raise ControlClosed(str(exc)) from None
        if not data:
            raise ControlClosed("end of stream")
        return self._reader.feed(data)

    def queue(self, msg: ipc.Message) -> None:
        """Buffers ``msg``; :meth:`flush` writes it."""
        if self.closed:
            return
        self._out += ipc.encode(msg)

    def flush(self) -> None:
        """Writes what the socket takes. Raises ControlClosed if it broke or the worker
        stopped reading."""
        if not self._out or self.closed:
            return
        try:
            n = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as exc:
            raise ControlClosed(str(exc)) from None
        if n:
            del self._out[:n]
        if len(self._out) > MAX_OUTBOX:
            raise ControlClosed(f"{len(self._out)} bytes of control messages unread")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.clear()
            self.sock.close()
