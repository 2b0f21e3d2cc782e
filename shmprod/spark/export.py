"""Export a DataFrame through a producer the driver built (its host only).

    from shmprod import Producer
    from shmprod.spark import export_dataframe

    with Producer(bootstrap_servers="127.0.0.1:9092", compression_type="lz4") as p:
        report = export_dataframe(df, p, "events", value_col="payload", key_col="user_id",
                                  timestamp_col="ts")
    print(report.records, report.per_partition)

:func:`export_dataframe` ships a small picklable :class:`ExportSpec` (the producer's
:class:`~shmprod.Handle`, the topic, the column names and the host the producer lives
on) in the closure of a Spark job. In each Python worker process the spec attaches to
the producer once (cached per process id: pyspark forks its Python workers from a
daemon and reuses them across tasks when ``spark.python.worker.reuse`` is on) and hands
whole columns to ``send_batch``:

* ``method="arrow"`` (the default): ``df.mapInArrow``. Each Arrow record batch Spark
  gives the worker goes to ``send_batch`` as columns; no per-row Python. The job's
  output is a few rows per task (records per Kafka partition), collected as the report.
* ``method="rows"``: ``df.foreachPartition``. Rows are gathered into chunks of
  ``chunk_rows`` and turned into columns (one Python step per row); counts travel back
  in an accumulator.

Each task waits for every one of its futures (``flush``, then each result) before it
returns, so a task that succeeded had all its records acknowledged; a failed send fails
the task with the typed shmprod error, and the driver re-raises that error type once
Spark gives up retrying. Delivery is **at-least-once**: Spark re-runs a failed task from
its first row, so the records a failed attempt had already delivered are written again
(and speculative execution, ``spark.speculation``, may run a task twice). Idempotence
covers the sender's own retries within one producer (no duplicate from a resent batch),
not a task re-run: the re-run's records are new records to the broker.

Shared memory is host-local: a Python worker on another host cannot attach. The spec
records the producer's host name; a worker elsewhere (or one that cannot see the
producer's segment) fails at once with :class:`ProducerHostError`, never waits.

pyspark is imported only inside the functions that need it: this module imports
without it. Runs in: the driver (``export_dataframe``) and Spark's Python workers
(``ExportSpec`` methods).
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import pyarrow as pa

from shmprod.errors import ProducerError, ProducerHostError
from shmprod.futures import BatchFuture
from shmprod.handle import Handle
from shmprod.shm import SharedMemoryError
from shmprod.spark.columns import rows_table
from shmprod.spark.session import check_worker_python, typed_task_errors
from shmprod.spark.task import Deliveries, task_identity
from shmprod.tables import binary_column, epoch_ms_column
from shmprod.worker import Worker, attach

if TYPE_CHECKING:
    from shmprod.producer import Producer

__all__ = [
    "REPORT_SCHEMA",
    "ExportSpec",
    "SparkExportReport",
    "export_dataframe",
    "forget",
    "worker_for",
]

# One row per (task, Kafka partition) it sent to; kafka_partition -1 for a task that
# sent nothing. The output of the mapInArrow job and the accumulator's items.
REPORT_SCHEMA: Final = pa.schema(
    [
        ("spark_partition", pa.int32()),
        ("attempt", pa.int32()),
        ("pid", pa.int64()),
        ("kafka_partition", pa.int32()),
        ("records", pa.int64()),
    ]
)
_REPORT_DDL: Final = "spark_partition int, attempt int, pid long, kafka_partition int, records long"

ReportRow = tuple[int, int, int, int, int]


_FIX: Final = (
    "shared memory is host-local, so every Spark executor that exports must run on the "
    "producer's host: run the job with master local[*] on that host, or on a cluster "
    "whose executors all run there"
)


# ----------------------------------------------------------------------------------
# attaching in a Python worker (cached per process id)
# ----------------------------------------------------------------------------------

_attached_pid = 0
_attached: dict[str, Worker] = {}


def worker_for(handle: Handle) -> Worker:
    """This process's attachment to ``handle``'s producer: attached on first use, then
    reused for as long as the process lives (a reused Spark Python worker runs many
    tasks). A forked child starts its own cache. Attaching to another producer detaches
    this process from the previous one. Runs in: any process on the producer's host."""
    global _attached_pid
    pid = os.getpid()
    if _attached_pid != pid:
        _attached.clear()  # inherited attachments belong to the parent
        _attached_pid = pid
    w = _attached.get(handle.segment)
    if w is not None:
        return w
    for other in list(_attached):
        _attached.pop(other).close(timeout=30)
    w = attach(handle)
    _attached[handle.segment] = w
    return w


def forget(handle: Handle) -> None:
    """Drops (and closes) this process's cached attachment to ``handle``'s producer,
    after it failed: the next task attaches again, or fails with a clear error."""
    w = _attached.pop(handle.segment, None) if _attached_pid == os.getpid() else None
    if w is not None:
        w.close(timeout=0)


# ----------------------------------------------------------------------------------
# the spec: what travels in the closure
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportSpec:
    """What a Spark task needs to export its rows (small and picklable).

    ``host`` is the producer's host name (``socket.gethostname()`` where the spec was
    made); a worker on another host refuses to attach.
    """

    handle: Handle
    topic: str
    value_col: str
    key_col: str | None = None
    timestamp_col: str | None = None
    partition_col: str | None = None
    headers: tuple[tuple[str, bytes | None], ...] | None = None
    timeout_s: float | None = None
    host: str = field(default_factory=socket.gethostname)

    @property
    def columns(self) -> list[str]:
        cols = (self.value_col, self.key_col, self.timestamp_col, self.partition_col)
        return list(dict.fromkeys(c for c in cols if c))

    def worker(self) -> Worker:
        """This process's attachment, after the same-host check. Runs in: a Python worker."""
        here = socket.gethostname()
        if here != self.host:
            raise ProducerHostError(
                f"this Spark Python worker runs on host {here!r}, the producer on "
                f"{self.host!r}: {_FIX}"
            )
        try:
            return worker_for(self.handle)
        except SharedMemoryError as exc:
            raise ProducerHostError(
                f"cannot map the producer's shared memory on host {here!r} ({exc}); "
                f"either the producer was closed, or {_FIX}"
            ) from None

    def send_columns(self, w: Worker, table: pa.RecordBatch | pa.Table) -> BatchFuture:
        """Sends the spec's columns of ``table`` with one ``send_batch``. Runs in: worker."""
        now_ms = time.time_ns() // 1_000_000
        return w.send_batch(
            self.topic,
            binary_column(table.column(self.value_col)),
            keys=binary_column(table.column(self.key_col)) if self.key_col else None,
            timestamps_ms=(
                epoch_ms_column(table.column(self.timestamp_col), now_ms)
                if self.timestamp_col
                else None
            ),
            partitions=(
                np.asarray(
                    table.column(self.partition_col).to_numpy(zero_copy_only=False),
                    dtype=np.int64,
                )
                if self.partition_col
                else None
            ),
            headers=list(self.headers) if self.headers is not None else None,
        )

    # -- the two task bodies ----------------------------------------------------------

    def map_batches(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The ``mapInArrow`` function: sends every batch, waits for all of them, yields
        the task's counts (:data:`REPORT_SCHEMA`). Runs in: a Python worker."""
        with _Task(self) as task:
            for rb in batches:
                if rb.num_rows:
                    task.submit(self.send_columns(task.w, rb))
        yield pa.RecordBatch.from_pylist(
            [dict(zip(REPORT_SCHEMA.names, row, strict=True)) for row in task.rows()],
            schema=REPORT_SCHEMA,
        )

    def send_rows(self, rows: Iterable[Any], chunk_rows: int, report: Any) -> None:
        """The ``foreachPartition`` function: rows (pyspark ``Row``) in chunks of
        ``chunk_rows``, each turned into columns and sent; counts are added to the
        ``report`` accumulator. Runs in: a Python worker."""
        cols = self.columns
        with _Task(self) as task:
            chunk: list[tuple[Any, ...]] = []
            for row in rows:
                chunk.append(tuple(row[c] for c in cols))
                if len(chunk) >= chunk_rows:
                    task.submit(self.send_columns(task.w, rows_table(cols, chunk)))
                    chunk = []
            if chunk:
                task.submit(self.send_columns(task.w, rows_table(cols, chunk)))
        report.add(task.rows())


class _Task:
    """One Spark task's sends (:class:`~shmprod.spark.task.Deliveries`) through the
    spec's producer. An error leaves as the typed shmprod error; the attachment is
    dropped when the producer failed. Runs in: a Python worker."""

    def __init__(self, spec: ExportSpec) -> None:
        self.spec = spec
        self.w = spec.worker()
        self.deliveries = Deliveries(self.w, spec.timeout_s)

    def __enter__(self) -> _Task:
        return self

    def submit(self, fut: BatchFuture) -> None:
        self.deliveries.submit(fut)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            if isinstance(exc, ProducerError) and not isinstance(exc, ProducerHostError):
                forget(self.spec.handle)
            return
        try:
            self.deliveries.finish()
        except ProducerError:
            forget(self.spec.handle)
            raise

    def rows(self) -> list[ReportRow]:
        part, attempt = task_identity()
        pid = os.getpid()
        counts = self.deliveries.counts
        if not counts:
            return [(part, attempt, pid, -1, 0)]
        return [(part, attempt, pid, p, n) for (_t, p), n in sorted(counts.items())]


class _ReportParam:
    """Accumulator of report rows (a list; Spark merges only successful tasks' updates
    of an action, so a failed attempt's counts are not included)."""

    def zero(self, value: list[ReportRow]) -> list[ReportRow]:
        return []

    def addInPlace(self, a: list[ReportRow], b: list[ReportRow]) -> list[ReportRow]:
        a.extend(b)
        return a


# ----------------------------------------------------------------------------------
# the driver side
# ----------------------------------------------------------------------------------


@dataclass
class SparkExportReport:
    """What an export did: records acknowledged, by Kafka partition and by Spark task."""

    topic: str
    records: int = 0
    seconds: float = 0.0
    per_partition: Counter[int] = field(default_factory=Counter)
    per_task: Counter[int] = field(default_factory=Counter)
    pids: set[int] = field(default_factory=set)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    def add(self, rows: Iterable[Sequence[int]]) -> None:
        for part, _attempt, pid, kafka_partition, n in rows:
            self.pids.add(pid)
            self.per_task[part] += n
            if kafka_partition >= 0:
                self.per_partition[kafka_partition] += n
                self.records += n


def export_dataframe(
    df: Any,
    producer: Producer | Handle,
    topic: str,
    *,
    value_col: str,
    key_col: str | None = None,
    timestamp_col: str | None = None,
    partition_col: str | None = None,
    headers: Sequence[tuple[str, bytes | None]] | None = None,
    method: Literal["arrow", "rows"] = "arrow",
    chunk_rows: int = 10_000,
    timeout_s: float | None = None,
    host: str | None = None,
) -> SparkExportReport:
    """Exports every row of the Spark DataFrame ``df`` to ``topic``; returns once every
    task's records were acknowledged, or raises.

    ``producer``: the host's :class:`~shmprod.Producer` or its handle. Columns: the
    value (required), key (murmur2 partitioning), timestamp (Spark timestamp, date, or
    integer epoch ms; default now), explicit partition; ``headers`` go on every record.
    Key and value columns may be binary or string; other types are sent as their text.
    ``method``: ``"arrow"`` (``mapInArrow``, no per-row Python) or ``"rows"``
    (``foreachPartition``, rows to columns in chunks of ``chunk_rows``). ``timeout_s``
    bounds each task's wait for its acknowledgements (default: the producer's
    ``delivery_timeout_ms`` + 10 s). ``host``: the producer's host name (default: the
    one the handle records, else this host).

    Delivery is at-least-once (a re-run task sends its rows again). A task's failure
    re-raises on the driver as the shmprod error the task raised, Spark's error as its
    cause.
    """
    handle = producer if isinstance(producer, Handle) else producer.handle
    spec = ExportSpec(
        handle=handle,
        topic=topic,
        value_col=value_col,
        key_col=key_col,
        timestamp_col=timestamp_col,
        partition_col=partition_col,
        headers=tuple(headers) if headers is not None else None,
        timeout_s=timeout_s,
        host=host or handle.host or socket.gethostname(),
    )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    check_worker_python(df.sparkSession)
    report = SparkExportReport(topic)
    selected = df.select(*spec.columns)
    t0 = time.monotonic()
    with typed_task_errors():
        if method == "arrow":
            report.add(selected.mapInArrow(spec.map_batches, _REPORT_DDL).collect())
        elif method == "rows":
            acc = df.sparkSession.sparkContext.accumulator([], _ReportParam())
            selected.foreachPartition(lambda rows: spec.send_rows(rows, chunk_rows, acc))
            report.add(acc.value)
        else:
            raise ValueError(f"method must be 'arrow' or 'rows', got {method!r}")
    report.seconds = time.monotonic() - t0
    return report
