"""Each Spark Python worker's attachments to its host's producers, kept between tasks.

pyspark reuses a Python worker for many tasks (``spark.python.worker.reuse``, on by
default) and keeps idle ones for a while, so a worker attaches once
(:func:`shmprod.host_producer`) and keeps the attachment for its next tasks: a
streaming query's micro-batches do not pay an attach each. An attachment unused for
:func:`hold_s` seconds is closed by a daemon thread, so an idle executor lets its host
producer close ``idle_timeout_ms`` later; one whose producer failed (closed, sender or
owner died) is dropped at once, and the next task finds or starts a new producer.

Per process: a forked child starts with none (its parent's belong to the parent).
Runs in: Spark's Python workers (and any process that calls ``shmprod.spark.write``'s
task body).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from shmprod.errors import ShmprodError
from shmprod.host import host_producer
from shmprod.worker import Worker

__all__ = ["HOLD_MAX_S", "attachment", "hold_s"]

log = logging.getLogger("shmprod.spark")

HOLD_MAX_S: Final = 5.0
REAP_EVERY_S: Final = 0.5


def hold_s(idle_timeout_ms: int) -> float:
    """How long an unused attachment is kept: the host producer's idle timeout, at most
    :data:`HOLD_MAX_S` (re-attaching costs milliseconds)."""
    return min(idle_timeout_ms / 1000.0, HOLD_MAX_S)


@dataclass
class _Entry:
    worker: Worker
    users: int
    last_used: float
    hold_s: float


_lock = threading.Lock()
_pid = 0
_entries: dict[str, _Entry] = {}
_reaper: threading.Thread | None = None


def _here() -> None:
    """Forgets a parent's attachments in a forked child. Runs with ``_lock`` held."""
    global _pid, _reaper
    if _pid != os.getpid():
        _entries.clear()
        _reaper = None
        _pid = os.getpid()


@contextlib.contextmanager
def attachment(key: str, producer: Mapping[str, Any], idle_timeout_ms: int) -> Iterator[Worker]:
    """This process's Worker on the host producer of ``producer`` (keywords of
    :func:`shmprod.host_producer`; ``key`` names that configuration), for one task.
    The attachment is dropped when the task ends with a producer failure."""
    global _reaper
    with _lock:
        _here()
        entry = _entries.get(key)
        if entry is None:
            w = host_producer(idle_timeout_ms=idle_timeout_ms, **producer)
            entry = _entries[key] = _Entry(w, 0, 0.0, hold_s(idle_timeout_ms))
        entry.users += 1
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="shmprod-spark-reaper", daemon=True)
            _reaper.start()
    broken = False
    try:
        yield entry.worker
    except BaseException as exc:
        from shmprod.spark.task import BROKEN

        broken = isinstance(exc, BROKEN)
        raise
    finally:
        with _lock:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if broken and _entries.get(key) is entry:
                del _entries[key]
                _close(entry, 0.0)


def _close(entry: _Entry, timeout: float) -> None:
    try:
        entry.worker.close(timeout=timeout)
    except ShmprodError as exc:  # a dead producer: nothing left to detach from
        log.debug("closing an attachment: %s", exc)


def _reap() -> None:
    """Closes attachments unused for their hold time. Runs in: a daemon thread."""
    while True:
        time.sleep(REAP_EVERY_S)
        now = time.monotonic()
        with _lock:
            if _pid != os.getpid():
                return
            idle = [
                k for k, e in _entries.items() if e.users == 0 and now - e.last_used >= e.hold_s
            ]
            gone = [_entries.pop(k) for k in idle]
        for entry in gone:
            _close(entry, 30.0)
