"""Broker host names resolved off the sender's loop.

``getaddrinfo`` blocks for as long as the DNS server takes; in the loop it would stall
every partition's sending. :class:`Resolver` answers at once: IP literals are resolved
in place (``AI_NUMERICHOST`` never touches the network); other names go to one helper
thread, and :meth:`Resolver.lookup` says "not yet" (None) until the answer is in. The
thread wakes the loop through a socket pair the loop selects on; the loop then calls
:meth:`Resolver.on_readable` and connects on its next pass. Answers are cached for
``ttl_ns``; a failure is reported once (the caller backs off, then asks again).

Runs in: sender. The helper thread touches only the job queue, the result queue and
the wake socket; the cache and the pending set are the loop's alone.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = ["Address", "Resolver"]

Address = tuple[int, int, int, Any]
"""``(family, type, proto, sockaddr)``: what ``socket.socket`` and ``connect`` take."""

GetAddrInfo = Callable[..., list[tuple[Any, ...]]]

TTL_NS: Final = 30 * 1_000_000_000  # as long as the JVM caches a name by default


class Resolver:
    """Host name lookups for the sender's loop, never blocking it. Runs in: sender."""

    def __init__(self, getaddrinfo: GetAddrInfo = socket.getaddrinfo, ttl_ns: int = TTL_NS) -> None:
        self._getaddrinfo = getaddrinfo
        self._ttl_ns = ttl_ns
        self._cache: dict[tuple[str, int], tuple[Address, int]] = {}  # -> address, expiry
        self._failed: dict[tuple[str, int], str] = {}
        self._pending: set[tuple[str, int]] = set()
        self._jobs: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[tuple[str, int], Address | str]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        """The socket the loop selects on for finished lookups."""
        return self._wake_r.fileno()

    @property
    def wake_socket(self) -> socket.socket:
        return self._wake_r

    def lookup(self, host: str, port: int, now_ns: int) -> Address | str | None:
        """The address to connect to, an error message, or None while resolving."""
        key = (host, port)
        numeric = self._resolve(host, port, numeric=True)
        if not isinstance(numeric, str):
            return numeric
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now_ns:
            return hit[0]
        failure = self._failed.pop(key, None)
        if failure is not None:
            return failure
        if key not in self._pending:
            self._pending.add(key)
            self._start()
            self._jobs.put(key)
        return None

    def on_readable(self, now_ns: int) -> None:
        """Takes the finished lookups into the cache. Runs in: sender loop."""
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                key, result = self._done.get_nowait()
            except queue.Empty:
                return
            self._pending.discard(key)
            if isinstance(result, str):
                self._failed[key] = result
            else:
                self._cache[key] = (result, now_ns + self._ttl_ns)

    def close(self) -> None:
        """Stops the helper thread (it may be inside getaddrinfo: it is a daemon)."""
        if self._thread is not None:
            self._jobs.put(None)
        for s in (self._wake_r, self._wake_w):
            s.close()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="shmprod-sender-dns", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        """Runs in: the helper thread."""
        while True:
            key = self._jobs.get()
            if key is None:
                return
            self._done.put((key, self._resolve(*key, numeric=False)))
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _resolve(self, host: str, port: int, *, numeric: bool) -> Address | str:
        flags = socket.AI_NUMERICHOST if numeric else 0
        try:
            infos = self._getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
        except (OSError, UnicodeError) as exc:
            return str(exc) or type(exc).__name__
        if not infos:
            return "no address"
        family, socktype, proto, _, sockaddr = infos[0]
        return (family, socktype, proto, sockaddr)
