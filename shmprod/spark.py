"""The Spark bridge: export a DataFrame through the host's shared producer.

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

import calendar
import datetime
import importlib
import os
import re
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shmprod.errors import (
    ConfigError,
    InvalidRecordError,
    KafkaError,
    ProducerError,
    ProducerHostError,
    ShmprodError,
)
from shmprod.extras import require
from shmprod.futures import BatchFuture
from shmprod.handle import Handle
from shmprod.shm import SharedMemoryError
from shmprod.worker import Worker, attach

if TYPE_CHECKING:
    from shmprod.producer import Producer

__all__ = [
    "REPORT_SCHEMA",
    "ExportSpec",
    "ProducerHostError",
    "SparkExportReport",
    "export_dataframe",
    "forget",
    "local_session",
    "stop_session",
    "task_error",
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
_MAX_PENDING: Final = 64  # futures a task keeps before it waits for the oldest

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
# columns
# ----------------------------------------------------------------------------------


def binary_column(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A key or value column for ``send_batch``: binary and strings as they are, any
    other type as its text (numbers as decimal)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t):
        return arr
    if pa.types.is_large_string(t) or pa.types.is_null(t):
        return arr
    return pc.cast(arr, pa.string())


_MS_PER: Final = {"s": (1000, 1), "ms": (1, 1), "us": (1, 1000), "ns": (1, 1_000_000)}


def epoch_ms_column(arr: pa.Array | pa.ChunkedArray, now_ms: int) -> np.ndarray[Any, Any]:
    """A timestamp column as int64 epoch milliseconds: Arrow timestamps of any unit
    (Spark's TimestampType arrives as microseconds since the epoch), dates, or integers
    taken as milliseconds. Nulls become ``now_ms``."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_timestamp(t):
        mul, div = _MS_PER[t.unit]
        ints = arr.cast(pa.int64())
    elif pa.types.is_date(t):
        mul, div = 86_400_000, 1
        ints = pc.cast(pc.cast(arr, pa.date32()), pa.int32()).cast(pa.int64())
    elif pa.types.is_integer(t):
        mul, div = 1, 1
        ints = arr.cast(pa.int64())
    else:
        raise InvalidRecordError(
            f"timestamp column of type {t}: need a timestamp, a date or integer epoch ms"
        )
    raw = np.asarray(pc.fill_null(ints, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    ms = raw * mul // div
    if ints.null_count:
        ms[np.asarray(ints.is_null().to_numpy(zero_copy_only=False), dtype=bool)] = now_ms
    return ms


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
                    task.submit(self.send_columns(task.w, _rows_table(cols, chunk)))
                    chunk = []
            if chunk:
                task.submit(self.send_columns(task.w, _rows_table(cols, chunk)))
        report.add(task.rows())


def _rows_table(cols: list[str], chunk: list[tuple[Any, ...]]) -> pa.Table:
    """A chunk of rows as an Arrow table. pyspark gives TimestampType as naive local
    datetimes: they become epoch milliseconds here (``datetime.timestamp`` reads a
    naive one as local time, which is how pyspark made it)."""
    arrays: list[pa.Array] = []
    for i in range(len(cols)):
        col = [r[i] for r in chunk]
        first = next((v for v in col if v is not None), None)
        if hasattr(first, "timestamp") and hasattr(first, "microsecond"):
            col = [None if v is None else _datetime_ms(v) for v in col]
        arrays.append(pa.array(col))
    return pa.table(arrays, names=cols)


def _datetime_ms(dt: datetime.datetime) -> int:
    """Exact epoch milliseconds of a datetime (naive ones are local time)."""
    seconds = (
        time.mktime(dt.timetuple()) if dt.tzinfo is None else calendar.timegm(dt.utctimetuple())
    )
    return int(seconds) * 1000 + dt.microsecond // 1000


class _Task:
    """One Spark task's sends: attaches, keeps its futures (waiting for the oldest when
    too many are pending, so a failure stops the task early), and on a clean exit
    flushes and takes every result. An error leaves as the typed shmprod error.
    Runs in: a Python worker."""

    def __init__(self, spec: ExportSpec) -> None:
        self.spec = spec
        self.w = spec.worker()
        self.pending: deque[BatchFuture] = deque()
        self.counts: Counter[int] = Counter()

    def __enter__(self) -> _Task:
        return self

    def submit(self, fut: BatchFuture) -> None:
        self.pending.append(fut)
        while self.pending and (self.pending[0].done() or len(self.pending) > _MAX_PENDING):
            self._take(self.pending.popleft())

    def _take(self, fut: BatchFuture) -> None:
        md = fut.result(timeout=self.spec.timeout_s)
        counts = np.bincount(md.partitions)
        for p in np.flatnonzero(counts):
            self.counts[int(p)] += int(counts[p])

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            if isinstance(exc, ProducerError) and not isinstance(exc, ProducerHostError):
                forget(self.spec.handle)
            return
        try:
            self.w.flush(self.spec.timeout_s)
            while self.pending:
                self._take(self.pending.popleft())
        except ProducerError:
            forget(self.spec.handle)
            raise

    def rows(self) -> list[ReportRow]:
        part, attempt = _task_identity()
        pid = os.getpid()
        if not self.counts:
            return [(part, attempt, pid, -1, 0)]
        return [(part, attempt, pid, p, n) for p, n in sorted(self.counts.items())]


def _task_identity() -> tuple[int, int]:
    """(Spark partition id, attempt number) of the running task, or (-1, 0) outside Spark."""
    try:
        TaskContext = require("pyspark", "spark").TaskContext
    except ImportError:
        return -1, 0
    ctx = TaskContext.get()
    return (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (-1, 0)


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
    try:
        if method == "arrow":
            report.add(selected.mapInArrow(spec.map_batches, _REPORT_DDL).collect())
        elif method == "rows":
            acc = df.sparkSession.sparkContext.accumulator([], _ReportParam())
            selected.foreachPartition(lambda rows: spec.send_rows(rows, chunk_rows, acc))
            report.add(acc.value)
        else:
            raise ValueError(f"method must be 'arrow' or 'rows', got {method!r}")
    except ShmprodError:
        raise
    except Exception as exc:
        typed = task_error(exc)
        if typed is None:
            raise
        raise typed from exc
    report.seconds = time.monotonic() - t0
    return report


# "shmprod.errors.DeliveryTimeoutError: message" as a Python traceback ends
_TYPED_LINE: Final = re.compile(r"^(shmprod(?:\.\w+)+)\.(\w+): (.*)$", re.MULTILINE)
_KAFKA_TEXT: Final = re.compile(r"^\[(-?\d+)\] \w+(?:: (.*))?$", re.DOTALL)


def task_error(exc: BaseException) -> ShmprodError | None:
    """The shmprod error a Spark task raised, rebuilt from the text of the error Spark
    raised on the driver (the task's Python traceback); None when it holds none."""
    found = _TYPED_LINE.findall(str(exc))
    if not found:
        return None
    module, name, message = found[-1]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, ShmprodError)):
        return None
    message = message.strip()
    if issubclass(cls, KafkaError):
        m = _KAFKA_TEXT.match(message)
        return KafkaError(int(m.group(1)), m.group(2) or "") if m else None
    try:
        return cls(message)
    except TypeError:
        return None


_PYTHON_OK: dict[str, str] = {}  # interpreter -> "" if it imports shmprod, else why not


def worker_python(spark: Any) -> tuple[str, str]:
    """(the Python Spark starts for its Python workers, where that comes from), as
    pyspark resolves it: ``spark.pyspark.python``, then ``PYSPARK_PYTHON``, else
    ``python3`` on the PATH. Runs in: the driver."""
    conf = spark.sparkContext.getConf()
    for key in ("spark.pyspark.python", "spark.executorEnv.PYSPARK_PYTHON"):
        value = conf.get(key)
        if value:
            return value, f"the Spark option {key}"
    env = os.environ.get("PYSPARK_PYTHON")
    if env:
        return env, "PYSPARK_PYTHON"
    return "python3", "pyspark's default (PYSPARK_PYTHON is not set)"


def check_worker_python(spark: Any) -> None:
    """Refuses, before any task runs, a job whose Python workers could not import
    shmprod (pyspark would fail each task with a Java stack trace ending in
    ModuleNotFoundError). Checked where the executors run on this host (local masters);
    elsewhere that is the cluster's business. Runs in: the driver."""
    import subprocess

    master = str(spark.sparkContext.master)
    if not master.startswith("local"):
        return
    python, source = worker_python(spark)
    why = _PYTHON_OK.get(python)
    if why is None:
        try:
            out = subprocess.run(
                [python, "-c", "import shmprod, pyarrow"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            why = "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{type(exc).__name__}: {exc}"
        _PYTHON_OK[python] = why
    if why:
        raise ConfigError(
            f"Spark's Python workers run {python!r} (from {source}), which cannot import "
            f"shmprod ({why}): set PYSPARK_PYTHON (or the Spark option "
            f"spark.pyspark.python) to an interpreter that has shmprod installed, such as "
            f"this one: {sys.executable}"
        )


def local_session(master: str = "local[2]", app_name: str = "shmprod-export", **conf: str) -> Any:
    """A small local SparkSession whose Python workers run this interpreter (so they
    import shmprod and pyarrow from the same environment; sets ``PYSPARK_PYTHON`` when
    it is not set, which pyspark reads for its workers): no UI, no progress bar, two
    shuffle partitions. ``conf`` adds Spark options (dots as in Spark:
    ``**{"spark.driver.memory": "1g"}``). Runs in: the driver."""
    import sys

    SparkSession = require("pyspark.sql", "spark").SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "512m",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        **conf,
    }
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def stop_session(spark: Any, timeout_s: float = 30.0) -> None:
    """Stops ``spark`` and the JVM pyspark started for it (``SparkSession.stop`` leaves
    that JVM running until the Python process exits): the JVM exits when its standard
    input closes, and is killed if it has not after ``timeout_s``. Runs in: the driver."""
    import subprocess

    SparkContext = require("pyspark", "spark").SparkContext

    gateway = SparkContext._gateway
    spark.stop()
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if isinstance(proc, subprocess.Popen):
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
