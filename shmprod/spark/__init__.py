"""Spark to Kafka through one shared producer per executor host.

On any cluster, each executor host's Python workers share that host's producer
(:func:`shmprod.host_producer`, started by the first task on the host, closed when the
host is idle):

    import shmprod.spark
    shmprod.spark.register(spark)                          # PySpark 4.x
    (df.write.format("shmprod")
       .option("kafka.bootstrap.servers", "broker:9092")
       .option("kafka.compression.type", "lz4")
       .option("topic", "events")
       .mode("append").save())
    # and df.writeStream.format("shmprod")...option("checkpointLocation", dir).start()

    report = shmprod.spark.write(df, "events", bootstrap_servers="broker:9092")
    df.foreachPartition(shmprod.spark.partition_writer(df, "events",
                                                        bootstrap_servers="broker:9092"))

The DataFrame has the columns of Spark's own Kafka sink (``value``, and optionally
``key``, ``topic``, ``partition``, ``headers``, ``timestamp``); options are
``kafka.``-prefixed Java producer names (:mod:`shmprod.spark.sink`). Delivery is
at-least-once, as with Spark's sink: a task that fails and runs again sends its rows
again (``includeLineage=true`` adds headers that let a consumer drop those repeats).

:func:`export_dataframe` (:mod:`shmprod.spark.export`) sends through a producer the
driver built, for executors on the driver's host (local mode).

Everything that runs in a Python worker lives in importable modules of this package
(never ``__main__``): Spark pickles the writers on the driver and rebuilds them there.
pyspark is imported only by the functions that need it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import pyarrow as pa

from shmprod.errors import ConfigError, ProducerHostError
from shmprod.extras import require
from shmprod.spark.export import (
    REPORT_SCHEMA,
    ExportSpec,
    SparkExportReport,
    export_dataframe,
    forget,
    worker_for,
)
from shmprod.spark.session import (
    check_worker_python,
    local_session,
    stop_session,
    task_error,
    typed_task_errors,
    worker_python,
)
from shmprod.spark.sink import (
    SinkColumns,
    SinkOptions,
    TaskResult,
    check_schema,
    parse_options,
    rows_to_batches,
    write_task,
)

__all__ = [
    "REPORT_SCHEMA",
    "ExportSpec",
    "PartitionWriter",
    "ProducerHostError",
    "SparkExportReport",
    "TaskResult",
    "WriteReport",
    "check_worker_python",
    "export_dataframe",
    "forget",
    "local_session",
    "partition_writer",
    "register",
    "stop_session",
    "task_error",
    "worker_for",
    "worker_python",
    "write",
]

_RESULT_DDL: Final = (
    "spark_partition int, attempt int, pid long, host string, producer string, "
    "topic string, kafka_partition int, records long, seconds double"
)


def register(spark: Any) -> None:
    """Registers the data source ``"shmprod"`` with ``spark`` (PySpark 4.0 or later;
    on 3.x use :func:`partition_writer`). Runs in: the driver."""
    require("pyspark", "spark")
    import pyspark

    major = int(pyspark.__version__.split(".")[0])
    if major < 4:
        raise ConfigError(
            f"format('shmprod') needs PySpark 4.0 or later (this is {pyspark.__version__}): "
            "use df.foreachPartition(shmprod.spark.partition_writer(df, topic, ...))"
        )
    check_worker_python(spark)  # on a local master: its Python workers import shmprod
    from shmprod.spark.source import ShmprodDataSource

    spark.dataSource.register(ShmprodDataSource)


def _options(
    topic: str | None,
    idle_timeout_ms: int,
    include_lineage: bool,
    timeout_s: float | None,
    bootstrap_servers: str,
    producer_config: dict[str, Any],
) -> SinkOptions:
    text = {"idleTimeoutMs": str(idle_timeout_ms), "includeLineage": str(include_lineage)}
    if topic is not None:
        text["topic"] = topic
    if timeout_s is not None:
        text["timeoutMs"] = str(max(1, round(timeout_s * 1000)))
    return parse_options(text, bootstrap_servers=bootstrap_servers, **producer_config)


def _columns(df: Any, opts: SinkOptions) -> SinkColumns:
    fields = [(f.name, f.dataType.simpleString()) for f in df.schema.fields]
    return check_schema(fields, opts.topic)


@dataclass
class WriteReport:
    """What :func:`write` delivered: records by (topic, partition), by Spark task, and
    which host producers the tasks used (host name -> producer segments)."""

    records: int = 0
    seconds: float = 0.0
    per_partition: Counter[tuple[str, int]] = field(default_factory=Counter)
    per_task: Counter[int] = field(default_factory=Counter)
    producers: dict[str, set[str]] = field(default_factory=dict)
    pids: set[int] = field(default_factory=set)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class _MapWrite:
    """The ``mapInArrow`` function of :func:`write` (picklable, importable)."""

    opts: SinkOptions
    cols: SinkColumns

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        result = write_task(self.opts, self.cols, batches)
        rows = [(t, p, n) for t, p, n in result.counts] or [("", -1, 0)]
        yield pa.RecordBatch.from_pydict(
            {
                "spark_partition": [result.spark_partition] * len(rows),
                "attempt": [result.attempt] * len(rows),
                "pid": [result.pid] * len(rows),
                "host": [result.host] * len(rows),
                "producer": [result.producer] * len(rows),
                "topic": [t for t, _p, _n in rows],
                "kafka_partition": [p for _t, p, _n in rows],
                "records": [n for _t, _p, n in rows],
                "seconds": [result.seconds] * len(rows),
            },
            schema=_result_schema(),
        )


def _result_schema() -> pa.Schema:
    return pa.schema(
        [
            ("spark_partition", pa.int32()),
            ("attempt", pa.int32()),
            ("pid", pa.int64()),
            ("host", pa.string()),
            ("producer", pa.string()),
            ("topic", pa.string()),
            ("kafka_partition", pa.int32()),
            ("records", pa.int64()),
            ("seconds", pa.float64()),
        ]
    )


def write(
    df: Any,
    topic: str | None = None,
    *,
    bootstrap_servers: str,
    idle_timeout_ms: int = 60_000,
    include_lineage: bool = False,
    timeout_s: float | None = None,
    **producer_config: Any,
) -> WriteReport:
    """Writes ``df`` (Spark's Kafka sink columns) to Kafka through each executor host's
    shared producer, in one call: the same as ``format("shmprod")``, and returns what
    was acknowledged. ``topic``: every row's topic (default: the ``topic`` column).
    ``producer_config``: :class:`~shmprod.Producer` options (``linger_ms=...``,
    ``compression_type="lz4"``, ...). Raises the shmprod error a task raised, or
    :class:`ConfigError` before any task runs. At-least-once. Runs in: the driver."""
    opts = _options(
        topic, idle_timeout_ms, include_lineage, timeout_s, bootstrap_servers, producer_config
    )
    cols = _columns(df, opts)
    check_worker_python(df.sparkSession)
    report = WriteReport()
    t0 = time.monotonic()
    with typed_task_errors():
        rows = df.select(*cols.names).mapInArrow(_MapWrite(opts, cols), _RESULT_DDL).collect()
    report.seconds = time.monotonic() - t0
    for r in rows:
        report.pids.add(r.pid)
        report.producers.setdefault(r.host, set()).add(r.producer)
        report.per_task[r.spark_partition] += r.records
        if r.kafka_partition >= 0:
            report.per_partition[r.topic, r.kafka_partition] += r.records
            report.records += r.records
    return report


@dataclass(frozen=True)
class PartitionWriter:
    """A ``foreachPartition`` function (Spark 3.x and later): the rows of one partition
    gathered into Arrow batches and sent through the host's producer (picklable)."""

    opts: SinkOptions
    cols: SinkColumns
    chunk_rows: int = 10_000

    def __call__(self, rows: Iterable[Any]) -> None:
        write_task(self.opts, self.cols, rows_to_batches(rows, self.cols, self.chunk_rows))


def partition_writer(
    df: Any,
    topic: str | None = None,
    *,
    bootstrap_servers: str,
    idle_timeout_ms: int = 60_000,
    include_lineage: bool = False,
    timeout_s: float | None = None,
    chunk_rows: int = 10_000,
    **producer_config: Any,
) -> PartitionWriter:
    """The function for ``df.foreachPartition(...)`` that writes ``df``'s rows like
    :func:`write` (columns checked here, on the driver, against ``df``'s schema).
    For Spark 3.x, where the data source API is missing; one Python step per row.
    Runs in: the driver."""
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
    opts = _options(
        topic, idle_timeout_ms, include_lineage, timeout_s, bootstrap_servers, producer_config
    )
    return PartitionWriter(opts, _columns(df, opts), chunk_rows)
