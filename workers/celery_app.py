"""A Celery app whose prefork pool children share the host's one shmprod producer: an
example on top of :func:`shmprod.celery.setup`.

    SHMPROD_BOOTSTRAP=127.0.0.1:9092 SHMPROD_CELERY_DIR=/var/lib/exports \\
        celery -A workers.celery_app worker --pool prefork --concurrency 4

    >>> from workers.celery_app import app, configure, export_rows
    >>> configure(app, "/var/lib/exports")               # the same directory as the worker
    >>> export_rows.delay("events", [{"key": "u1", "value": "{...}"}]).get(timeout=60)
    {'records': 1, 'partitions': {'2': 1}, 'pid': 4242}

``shmprod.celery.setup`` makes the main worker process create ONE producer when it
starts, before the pool forks; every pool child attaches to it and detaches when it
exits (see :mod:`shmprod.celery`). Tasks send whole columns with ``send_batch`` and return their counts once every future
resolved, so a successful result means the broker acknowledged every record; a failed
send fails the task with the typed shmprod error.

Tasks are acknowledged late and rejected when their child dies (``task_acks_late``,
``task_reject_on_worker_lost``): a task interrupted by a crash runs again, so delivery
is at-least-once, as for a Spark task; the producer's idempotence removes duplicates of
its own retries, not of a task that runs twice.

Configuration (environment): ``SHMPROD_BOOTSTRAP`` (the worker's brokers, required),
``SHMPROD_PRODUCER_OPTIONS`` (JSON, e.g. ``{"compression_type": "lz4"}``), and
``SHMPROD_CELERY_DIR``: a directory for a Celery transport with no server (kombu's
``filesystem://`` queues, each message written whole before it appears (see
:class:`AtomicFilesystemTransport`), and a ``file://`` result backend). Without it,
Celery's own settings (``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``) apply.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

try:
    from celery import Celery
    from kombu.exceptions import ChannelError
    from kombu.transport import filesystem as kombu_filesystem
    from kombu.utils.json import dumps as kombu_dumps
except ImportError as exc:  # say which extra, not just the module
    raise ImportError(
        f"{exc}: workers.celery_app needs shmprod's 'celery' extra, pip install 'shmprod[celery]'"
    ) from exc

import shmprod.celery
from shmprod import BatchFuture
from shmprod.tables import binary_column, epoch_ms_column

app = Celery("shmprod_export")
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=None,
)

DEFAULT_TIMEOUT_S = 120.0


class _AtomicChannel(kombu_filesystem.Channel):  # type: ignore[misc]
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        """Writes the message under a name no reader takes (``.<id>.part``), then renames it to
        its queue's name in one step: ``<ns>_<id>.<queue>.msg``, where ``<ns>`` is the
        host's monotonic clock in 20 digits, so the readers' sorted listing takes one
        writer's messages in order (the stock name has milliseconds, and messages within one
        went in the order of their ids). The stock transport creates the file empty and then
        writes it: a worker polling the folder moved and read one before its bytes were
        there, and died on the empty message (JSONDecodeError)."""
        folder = self.data_folder_out
        msg_id = uuid.uuid4()
        part = os.path.join(folder, f".{msg_id.hex}.part")
        name = f"{time.monotonic_ns():020d}_{msg_id}.{queue}.msg"
        try:
            with open(part, "wb") as fh:
                fh.write(kombu_dumps(payload).encode("utf-8"))
            os.replace(part, os.path.join(folder, name))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise ChannelError(f"cannot add message {name!r} to {folder!r}: {exc}") from exc


class AtomicFilesystemTransport(kombu_filesystem.Transport):  # type: ignore[misc]
    """kombu's ``filesystem://`` transport, with each message file complete before it
    appears in the queue folder (see ``_AtomicChannel._put``)."""

    Channel = _AtomicChannel


def configure(celery_app: Celery, data_dir: str | os.PathLike[str]) -> None:
    """Points ``celery_app`` at a server-less transport in ``data_dir``: queues as files
    (kombu ``filesystem://``, written whole: :class:`AtomicFilesystemTransport`) and
    results as files (``file://``). The worker and every client must use the same
    directory, and import this module."""
    root = Path(data_dir).absolute()
    folders = {name: root / name for name in ("queue", "processed", "control", "results")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    celery_app.conf.update(
        broker_url="filesystem://",
        broker_transport=f"{__name__}:AtomicFilesystemTransport",
        broker_transport_options={
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
            "polling_interval": 0.1,
        },
        result_backend=f"file://{folders['results']}",
    )


if os.environ.get("SHMPROD_CELERY_DIR"):
    configure(app, os.environ["SHMPROD_CELERY_DIR"])


# the shared producer: shmprod.celery hooks the worker's signals (built in the main
# process before the pool forks, attached in each child); clients build nothing
if os.environ.get("SHMPROD_BOOTSTRAP"):
    shmprod.celery.setup(
        app,
        bootstrap_servers=os.environ["SHMPROD_BOOTSTRAP"],
        **json.loads(os.environ.get("SHMPROD_PRODUCER_OPTIONS") or "{}"),
    )
sender = shmprod.celery.producer


def _resolve(futures: list[BatchFuture], timeout_s: float) -> dict[str, Any]:
    """Waits for every future (raising the first typed error) and counts records per
    partition."""
    counts: Counter[int] = Counter()
    records = 0
    for fut in futures:
        md = fut.result(timeout=timeout_s)
        records += len(md.offsets)
        per = np.bincount(md.partitions)
        for p in np.flatnonzero(per):
            counts[int(p)] += int(per[p])
    return {
        "records": records,
        "partitions": {str(p): n for p, n in sorted(counts.items())},
        "pid": os.getpid(),
    }


def _timestamps(ts: list[Any]) -> np.ndarray[Any, Any] | None:
    """Epoch ms per row (a missing one is now), or None when no row has one."""
    if all(t is None for t in ts):
        return None
    now_ms = time.time_ns() // 1_000_000
    return np.asarray([now_ms if t is None else int(t) for t in ts], dtype=np.int64)


# ----------------------------------------------------------------------------------
# tasks
# ----------------------------------------------------------------------------------


@app.task(name="shmprod.export_rows")
def export_rows(
    topic: str, rows: list[dict[str, Any]], timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """Sends ``rows`` (dicts with ``value`` and optional ``key``, ``timestamp_ms``,
    ``partition``; strings are sent as UTF-8) with one ``send_batch``; returns the
    counts once the broker acknowledged every record."""
    values = pa.array([r.get("value") for r in rows], pa.string())
    keys = pa.array([r.get("key") for r in rows], pa.string())
    ts = [r.get("timestamp_ms") for r in rows]
    parts = [r.get("partition") for r in rows]
    if any(p is not None for p in parts) and any(p is None for p in parts):
        raise ValueError("give every row a partition, or none")
    fut = sender().send_batch(
        topic,
        values,
        keys=keys if keys.null_count < len(keys) else None,
        timestamps_ms=_timestamps(ts),
        partitions=np.asarray(parts, dtype=np.int64) if parts and parts[0] is not None else None,
    )
    return _resolve([fut], timeout_s)


@app.task(name="shmprod.export_parquet")
def export_parquet(
    path: str,
    topic: str,
    value_column: str,
    key_column: str | None = None,
    timestamp_column: str | None = None,
    row_groups: list[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Sends the Parquet file at ``path`` (or only its ``row_groups``), one
    ``send_batch`` per row group: key/value as binary (strings UTF-8, numbers as text),
    the timestamp column as epoch ms. Returns the counts once every record is
    acknowledged."""
    w = sender()
    pf = pq.ParquetFile(path)
    columns = [c for c in (value_column, key_column, timestamp_column) if c]
    futures = []
    for group in row_groups if row_groups is not None else range(pf.num_row_groups):
        table = pf.read_row_group(group, columns=columns)
        futures.append(
            w.send_batch(
                topic,
                binary_column(table[value_column]),
                keys=binary_column(table[key_column]) if key_column else None,
                timestamps_ms=(
                    epoch_ms_column(table[timestamp_column], time.time_ns() // 1_000_000)
                    if timestamp_column
                    else None
                ),
            )
        )
    return _resolve(futures, timeout_s)


@app.task(name="shmprod.producer_stats")
def producer_stats() -> dict[str, Any]:
    """The shared producer's counters (sender, pool), read from shared memory, and the
    name of its segment."""
    stats = sender().stats()
    handle = shmprod.celery.handle()
    segment = handle.segment if handle is not None else None
    return {"sender": stats["sender"], "pool": stats["pool"], "segment": segment}
