"""Process pools that share one producer: ``pool_initializer`` and ``current``.

    from concurrent.futures import ProcessPoolExecutor
    import shmprod

    def task(rows):
        w = shmprod.current()                    # this process's Worker
        for r in rows:
            w.send("events", r)
        w.flush()

    with shmprod.Producer(bootstrap_servers="127.0.0.1:9092") as p:
        with ProcessPoolExecutor(4, initializer=shmprod.pool_initializer,
                                 initargs=(p.handle,)) as pool:
            list(pool.map(task, chunks))

Works with ``multiprocessing.Pool``, ``multiprocess.Pool`` and
``concurrent.futures.ProcessPoolExecutor``, under fork, spawn and forkserver: the
initializer runs in each pool process and attaches it to the producer (a forked child
never uses its parent's attachment: attachments belong to the process that made them).
A pool process detaches when it exits normally (multiprocessing's finalizers, or
``atexit``); one that is killed (``terminate()``, a recycled child) is noticed by the
sender, which frees what it held. Runs in: pool processes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from shmprod.errors import ProducerError
from shmprod.handle import Handle
from shmprod.worker import Worker, attach

__all__ = ["current", "pool_initializer"]

_lock = threading.Lock()
_pid = 0
_worker: Worker | None = None


def pool_initializer(handle: Handle) -> None:
    """The ``initializer`` of a process pool (``initargs=(producer.handle,)``): attaches
    this process to the producer. Runs in: each pool process, once."""
    global _pid, _worker
    with _lock:
        if _pid == os.getpid() and _worker is not None:
            return
        _worker = attach(handle)
        _pid = os.getpid()
    _at_exit()


def current() -> Worker:
    """This process's Worker, attached by :func:`pool_initializer`. Raises
    :class:`ProducerError` saying what to do in a process it did not run in."""
    with _lock:
        if _worker is None or _pid != os.getpid():
            raise ProducerError(
                "this process is not attached to a producer: create the pool with "
                "initializer=shmprod.pool_initializer, initargs=(producer.handle,)"
            )
        return _worker


def _detach() -> None:
    global _worker
    with _lock:
        w, mine = _worker, _pid == os.getpid()
        _worker = None
    if w is not None and mine:
        w.close(timeout=30)


def _at_exit() -> None:
    """Detaches when the process exits normally: pool processes of multiprocessing (and
    of ``multiprocess``) end with ``os._exit`` after running their finalizers, other
    processes run ``atexit``."""
    atexit.register(_detach)
    for name in ("multiprocessing.util", "multiprocess.util"):
        finalize = getattr(sys.modules.get(name), "Finalize", None)
        if finalize is not None:
            finalize(None, _detach, exitpriority=10)
