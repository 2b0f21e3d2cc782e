"""The PySpark data source ``"shmprod"``: Kafka out of ``df.write`` and ``df.writeStream``.

Registered by :func:`shmprod.spark.register`; options and columns are those of
Spark's own Kafka sink (:mod:`shmprod.spark.sink`). The driver checks them when Spark
asks for a writer, before any task runs. Each writer task sends whole Arrow batches
(``DataSourceArrowWriter``; for streams ``DataSourceStreamArrowWriter`` where pyspark
has it, since 4.1, else rows gathered into Arrow batches) through its host's producer
and returns a commit message once its records were acknowledged. A Kafka topic has no
transaction to commit or abort: ``commit`` logs what was written and ``abort`` says
that the records of the tasks that succeeded stay written (at-least-once).

This module imports pyspark (4.0 or later); the writers are pickled on the driver and
rebuilt from this module in each Python worker. Runs in: the driver (``writer``,
``streamWriter``, ``commit``, ``abort``) and Spark's Python workers (``write``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from shmprod.errors import ConfigError
from shmprod.spark.sink import (
    SinkColumns,
    SinkOptions,
    TaskResult,
    check_schema,
    parse_options,
    rows_to_batches,
    write_task,
)

try:  # pyspark 4.1 and later
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamBase

    STREAM_ARROW = True
except ImportError:  # pragma: no cover - pyspark 4.0
    _StreamBase = DataSourceStreamWriter  # type: ignore[misc,assignment]
    STREAM_ARROW = False

__all__ = ["STREAM_ARROW", "ShmprodCommitMessage", "ShmprodDataSource"]

log = logging.getLogger("shmprod.spark")


class ShmprodCommitMessage(WriterCommitMessage):
    """One task's :class:`~shmprod.spark.sink.TaskResult`."""

    def __init__(self, result: TaskResult) -> None:
        self.result = result


def _plan(options: Any, schema: StructType, overwrite: bool) -> tuple[SinkOptions, SinkColumns]:
    if overwrite:
        raise ConfigError("a Kafka topic can only be appended to: use mode('append')")
    opts = parse_options(dict(options))
    fields = [(f.name, f.dataType.simpleString()) for f in schema.fields]
    return opts, check_schema(fields, opts.topic)


def _summary(messages: list[WriterCommitMessage | None]) -> tuple[int, int]:
    results = [m.result for m in messages if isinstance(m, ShmprodCommitMessage)]
    return len(results), sum(r.records for r in results)


class ShmprodDataSource(DataSource):
    """``format("shmprod")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "shmprod"

    def writer(self, schema: StructType, overwrite: bool) -> ShmprodWriter:
        return ShmprodWriter(*_plan(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> ShmprodStreamWriter:
        return ShmprodStreamWriter(*_plan(self.options, schema, overwrite))


class ShmprodWriter(DataSourceArrowWriter):
    """A batch write: each task sends its Arrow batches."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns) -> None:
        self.opts = opts
        self.cols = cols

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ShmprodCommitMessage:
        return ShmprodCommitMessage(write_task(self.opts, self.cols, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        tasks, records = _summary(messages)
        log.info("format('shmprod'): %d records acknowledged from %d tasks", records, tasks)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        tasks, records = _summary(messages)
        log.warning(
            "format('shmprod') write failed: %d records of %d tasks that succeeded were "
            "delivered and stay in Kafka (at-least-once)",
            records,
            tasks,
        )


class ShmprodStreamWriter(_StreamBase):
    """A micro-batch of a streaming query: each task sends its rows."""

    def __init__(self, opts: SinkOptions, cols: SinkColumns) -> None:
        self.opts = opts
        self.cols = cols

    def write(self, iterator: Iterator[Any]) -> ShmprodCommitMessage:
        batches = iterator if STREAM_ARROW else rows_to_batches(iterator, self.cols)
        return ShmprodCommitMessage(write_task(self.opts, self.cols, batches))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        tasks, records = _summary(messages)
        log.info("micro-batch %d: %d records acknowledged from %d tasks", batchId, records, tasks)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        tasks, records = _summary(messages)
        log.warning(
            "micro-batch %d failed: %d records of %d tasks that succeeded were delivered "
            "and stay in Kafka (at-least-once; the batch runs again)",
            batchId,
            records,
            tasks,
        )
