"""Celery workers sharing one producer: ``shmprod.celery.setup(app, **config)``.

    from celery import Celery
    import shmprod.celery

    app = Celery("etl")
    shmprod.celery.setup(app, bootstrap_servers="broker:9092", compression_type="lz4")

    @app.task
    def export(rows):
        w = shmprod.celery.producer()
        w.send_batch("events", [r["value"] for r in rows]).result(60)

``setup`` hooks Celery's signals for ``app``'s worker: the main worker process builds
ONE :class:`~shmprod.Producer` when it starts (``worker_init``, before the prefork pool
forks); each pool child attaches in ``worker_process_init`` (or at its first
``producer()`` call, for pools that do not send it) and detaches in
``worker_process_shutdown``, so children recycled by ``worker_max_tasks_per_child``
leave nothing behind and their successors attach again; the main process closes the
producer in ``worker_shutdown``. A client that only sends tasks builds nothing.

Delivery is at-least-once when tasks are acknowledged late: ``setup`` turns on
``task_acks_late`` and ``task_reject_on_worker_lost`` unless ``acks_late=False`` (a
task interrupted by a crash runs again; idempotence covers the producer's own retries,
not a task run twice). Runs in: the Celery worker's main process and pool children.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from shmprod.config import ProducerConfig
from shmprod.errors import ProducerClosedError
from shmprod.handle import Handle
from shmprod.producer import Producer
from shmprod.worker import Worker, attach

__all__ = ["handle", "producer", "setup"]

_lock = threading.Lock()
_apps: dict[int, dict[str, Any]] = {}  # id(app) -> producer keywords
_producer: Producer | None = None
_producer_pid = 0
_handle: Handle | None = None
_worker: Worker | None = None
_worker_pid = 0
_connected = False


def setup(app: Any, *, acks_late: bool = True, **producer_config: Any) -> None:
    """Gives ``app``'s worker one shared producer (see the module docstring); the
    options are :class:`~shmprod.Producer`'s, checked now. Runs in: wherever the app
    is defined (worker and clients)."""
    global _connected
    ProducerConfig.from_keywords(**producer_config)  # a bad option fails at import
    from celery import signals

    _apps[id(app)] = dict(producer_config)
    if acks_late:
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
    with _lock:
        if _connected:
            return
        signals.worker_init.connect(_start, weak=False)
        signals.worker_process_init.connect(_attach_child, weak=False)
        signals.worker_process_shutdown.connect(_detach_child, weak=False)
        signals.worker_shutdown.connect(_close, weak=False)
        _connected = True


def _start(sender: Any = None, **_: Any) -> None:
    """Runs in: the main worker process, before the pool starts."""
    global _producer, _producer_pid, _handle
    config = _apps.get(id(getattr(sender, "app", None)))
    if config is None:  # a worker of an app that setup() did not see
        return
    with _lock:
        if _producer is not None and _producer_pid == os.getpid():
            return
        _producer = Producer(**config)
        _producer_pid = os.getpid()
        _handle = _producer.handle


def _attach_child(**_: Any) -> None:
    """Runs in: each pool child, right after it started."""
    global _worker, _worker_pid
    with _lock:
        if _handle is not None and _worker_pid != os.getpid():
            _worker = attach(_handle)
            _worker_pid = os.getpid()


def _detach_child(**_: Any) -> None:
    """Runs in: a pool child that exits: flushes what it sent (bounded) and detaches."""
    global _worker
    with _lock:
        w, mine = _worker, _worker_pid == os.getpid()
        _worker = None
    if w is not None and mine:
        w.close(timeout=30)


def _close(**_: Any) -> None:
    """Runs in: the main worker process, after the pool stopped."""
    global _producer
    with _lock:
        p, mine = _producer, _producer_pid == os.getpid()
        _producer = None
    if p is not None and mine:
        p.close(timeout=30)


def producer() -> Producer | Worker:
    """This process's way to the shared producer, inside a task: the child's
    attachment (made now if the pool did not send ``worker_process_init``), or the
    producer itself in the main process (``--pool solo`` or threads)."""
    global _worker, _worker_pid
    pid = os.getpid()
    with _lock:
        if _worker is not None and _worker_pid == pid:
            return _worker
        if _producer is not None and _producer_pid == pid:
            return _producer
        if _handle is None:
            raise ProducerClosedError(
                "no shmprod producer in this process: call shmprod.celery.setup(app, "
                "bootstrap_servers=...) where the app is defined, and run the task in that "
                "app's worker"
            )
        _worker = attach(_handle)
        _worker_pid = pid
        return _worker


def handle() -> Handle | None:
    """The worker's producer handle (None outside a worker set up by :func:`setup`)."""
    return _handle
