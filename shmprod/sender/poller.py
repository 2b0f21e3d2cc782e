"""The sender's selector: which sockets it waits on and for what. Every socket is
registered for reading; writing is asked for exactly while bytes wait to go out, so an
idle connection never wakes the loop.

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
from collections.abc import Iterable

__all__ = ["Poller"]


class Poller:
    """A selector plus the event mask last asked for on each file descriptor (so an
    unchanged mask costs no system call)."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._masks: dict[int, int] = {}

    def add_reader(self, sock: socket.socket, data: object) -> None:
        """A socket only ever read (the listener, the resolver's wake-up)."""
        self.selector.register(sock, selectors.EVENT_READ, data)

    def select(self, timeout_s: float) -> list[tuple[selectors.SelectorKey, int]]:
        return self.selector.select(timeout_s)

    def watch(self, sock: socket.socket, data: object, write: bool) -> None:
        """Reads ``sock``, and writes it too when ``write``."""
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        fd = sock.fileno()
        old = self._masks.get(fd)
        if old == mask:
            return
        try:
            if old is None:
                self.selector.register(sock, mask, data)
            else:
                self.selector.modify(sock, mask, data)
        except KeyError:  # the selector and our map disagree (an fd number reused)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fd)
            self.selector.register(sock, mask, data)
        self._masks[fd] = mask

    def forget(self, sock: socket.socket | None) -> None:
        """Stops watching ``sock`` (before it is closed)."""
        if sock is None:
            return
        fd = sock.fileno()
        if fd >= 0 and self._masks.pop(fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(sock)

    def sync(self, peers: Iterable[tuple[socket.socket, object, bool]]) -> None:
        """Applies (socket, data, wants write) for every open peer."""
        for sock, data, write in peers:
            self.watch(sock, data, write)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.selector.close()
