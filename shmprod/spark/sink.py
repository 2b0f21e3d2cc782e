"""What Spark's Kafka sink does, on the host producer: options, columns, one task.

The DataFrame has the columns of Spark's own Kafka sink (matched without regard to
case, as Spark does; other columns are ignored):

| column | type | |
|---|---|---|
| value | string or binary | required; null is a tombstone |
| key | string or binary | optional; murmur2 partitioning |
| topic | string | per row, when the ``topic`` option is absent |
| partition | int | optional; null: the partitioner chooses |
| headers | array<struct<key: string, value: binary>> | optional |
| timestamp | timestamp | optional; null: now |

Options (case-insensitive, as Spark passes them): ``kafka.<Java producer option>``
(``kafka.bootstrap.servers`` required; ``kafka.linger.ms``, ``kafka.compression.type``,
``kafka.security.protocol``, ``kafka.sasl.jaas.config``, ...), ``topic``,
``idleTimeoutMs`` (the host producer's, default 60000), ``includeLineage``
(``true``: five headers per record, see :data:`LINEAGE_HEADERS`), ``timeoutMs`` (a
task's wait for its acknowledgements; default the producer's delivery timeout + 10 s).

:func:`check_schema` runs on the driver before any task; :func:`write_task` is the body
of every writer task (the data source's batch and streaming writers, ``write``'s
``mapInArrow`` and the ``foreachPartition`` function): it sends whole Arrow batches
with ``send_batch`` through its host's producer and returns once each of its records
was acknowledged, or raises. Delivery is at-least-once, as with Spark's own sink: a
task that fails and is run again sends its rows again.

Runs in: the driver (:func:`parse_options`, :func:`check_schema`) and Spark's Python
workers (:func:`write_task`). No pyspark import here.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shmprod.config import ProducerConfig, text_options
from shmprod.errors import ConfigError, InvalidRecordError
from shmprod.futures import BatchFuture
from shmprod.host import host_id
from shmprod.spark.attachments import attachment
from shmprod.spark.columns import rows_table
from shmprod.spark.task import Deliveries, task_identity
from shmprod.tables import binary_column, epoch_ms_column, header_rows
from shmprod.worker import Worker

__all__ = [
    "COLUMNS",
    "LINEAGE_HEADERS",
    "SinkColumns",
    "SinkOptions",
    "TaskResult",
    "check_schema",
    "parse_options",
    "rows_to_batches",
    "write_task",
]

KAFKA_PREFIX: Final = "kafka."
ROWS_PER_BATCH: Final = 10_000
"""Rows gathered into one Arrow batch where a writer is given rows."""
SPARK_OPTIONS: Final = frozenset({"path", "checkpointlocation", "queryname"})
"""Options Spark itself may pass to a sink: accepted and ignored."""
OWN_OPTIONS: Final = ("topic", "idleTimeoutMs", "includeLineage", "timeoutMs")

LINEAGE_HEADERS: Final = (
    "shmprod.query",
    "shmprod.batch",
    "shmprod.partition",
    "shmprod.attempt",
    "shmprod.row",
)
"""With ``includeLineage=true``, every record carries these headers (ASCII text): the
streaming query id (for a batch write, an id of that write), the micro-batch id (0 in
a batch write), the Spark partition, the task attempt and the row's index in its
partition. A re-run task's records repeat (query, batch, partition, row) with another
attempt, so a consumer can drop them; the row index identifies a row only when Spark
gives a partition its rows in the same order on a re-run (true of file and table
sources; not after an unordered shuffle)."""

_BINARY_OR_STRING: Final = frozenset({"string", "binary"})
_INTEGER: Final = frozenset({"int", "bigint", "smallint", "tinyint"})
COLUMNS: Final[dict[str, tuple[frozenset[str], str]]] = {
    "value": (_BINARY_OR_STRING, "string or binary"),
    "key": (_BINARY_OR_STRING, "string or binary"),
    "topic": (frozenset({"string"}), "string"),
    "partition": (_INTEGER, "int"),
    "headers": (
        frozenset(
            {
                "array<struct<key:string,value:binary>>",
                "array<struct<key:string,value:string>>",
            }
        ),
        "array<struct<key: string, value: binary>>",
    ),
    "timestamp": (frozenset({"timestamp"}), "timestamp"),
}
"""Spark's Kafka sink columns: the Spark types (``simpleString``) each may have."""


# ----------------------------------------------------------------------------------
# options (driver)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkOptions:
    """A write's options, checked (small and picklable: it travels to every task)."""

    producer: tuple[tuple[str, Any], ...]
    topic: str | None = None
    idle_timeout_ms: int = 60_000
    include_lineage: bool = False
    timeout_s: float | None = None
    write_id: str = field(default_factory=lambda: os.urandom(8).hex())

    @property
    def producer_options(self) -> dict[str, Any]:
        return dict(self.producer)

    @property
    def key(self) -> str:
        """Names the producer configuration in a Python worker's attachment cache."""
        blob = json.dumps([self.producer, self.idle_timeout_ms], default=str).encode()
        return hashlib.sha256(blob).hexdigest()


def _int_option(name: str, text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"option {name!r} must be an integer, got {text!r}") from None
    if value < low:
        raise ConfigError(f"option {name!r} must be >= {low}, got {value}")
    return value


def parse_options(options: Mapping[str, str], **overrides: Any) -> SinkOptions:
    """The options of ``df.write.format("shmprod")`` (see the module docstring), checked
    as a whole: an unknown option or a bad producer option is a :class:`ConfigError`
    naming it. ``overrides``: producer keywords given in Python (``shmprod.spark.write``).
    Runs in: the driver."""
    producer_text: dict[str, str] = {}
    own: dict[str, str] = {}
    lower_own = {o.lower(): o for o in OWN_OPTIONS}
    for raw, value in options.items():
        name = raw.lower()
        if name.startswith(KAFKA_PREFIX):
            producer_text[name[len(KAFKA_PREFIX) :]] = str(value)
        elif name in lower_own:
            own[lower_own[name]] = str(value)
        elif name not in SPARK_OPTIONS:
            close = difflib.get_close_matches(name, list(lower_own), n=1, cutoff=0.6)
            hint = f"; did you mean {lower_own[close[0]]!r}?" if close else ""
            raise ConfigError(
                f"unknown option {raw!r} for format('shmprod'){hint} (producer options are "
                "'kafka.'-prefixed Java names, e.g. 'kafka.linger.ms')"
            )
    producer = text_options(producer_text)
    for name, value in overrides.items():
        if name in producer:
            raise ConfigError(f"producer option {name!r} given twice")
        producer[name] = value
    if not producer.get("bootstrap_servers"):
        raise ConfigError("option 'kafka.bootstrap.servers' is required")
    ProducerConfig.from_keywords(**producer)  # every producer option checked here
    lineage = own.get("includeLineage", "false").strip().lower()
    if lineage not in ("true", "false"):
        raise ConfigError(f"option 'includeLineage' must be true or false, got {lineage!r}")
    topic = own.get("topic")
    if topic is not None and not topic.strip():
        raise ConfigError("option 'topic' is empty")
    timeout_ms = own.get("timeoutMs")
    return SinkOptions(
        producer=tuple(sorted(producer.items())),
        topic=topic,
        idle_timeout_ms=_int_option("idleTimeoutMs", own.get("idleTimeoutMs", "60000"), 0),
        include_lineage=lineage == "true",
        timeout_s=_int_option("timeoutMs", timeout_ms, 1) / 1000 if timeout_ms else None,
    )


# ----------------------------------------------------------------------------------
# columns (driver checks them; tasks find them by name)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkColumns:
    """The names (as the DataFrame spells them) of the sink columns it has."""

    value: str
    key: str | None = None
    topic: str | None = None
    partition: str | None = None
    headers: str | None = None
    timestamp: str | None = None

    @property
    def names(self) -> list[str]:
        cols = (self.value, self.key, self.topic, self.partition, self.headers, self.timestamp)
        return [c for c in cols if c is not None]


def check_schema(fields: Sequence[tuple[str, str]], topic_option: str | None) -> SinkColumns:
    """The sink columns of a DataFrame with ``fields`` ((name, Spark ``simpleString``)
    pairs), or a :class:`ConfigError` naming the missing or ill-typed column. Runs in:
    the driver, before any task."""
    found: dict[str, str] = {}
    for name, spark_type in fields:
        role = name.lower()
        if role not in COLUMNS:
            continue  # other columns are ignored, as by Spark's sink
        if role in found:
            raise ConfigError(f"the DataFrame has two columns named {role!r} (ignoring case)")
        allowed, wanted = COLUMNS[role]
        if spark_type.replace(" ", "") not in allowed:
            raise ConfigError(
                f"column {name!r} has type {spark_type}; Kafka's {role!r} column must be {wanted}"
            )
        found[role] = name
    if "value" not in found:
        names = ", ".join(n for n, _ in fields) or "none"
        raise ConfigError(
            f"the DataFrame needs a 'value' column (string or binary) to write to Kafka; "
            f"its columns: {names}"
        )
    if topic_option is None and "topic" not in found:
        raise ConfigError(
            "no topic: set the option 'topic', or give the DataFrame a 'topic' column"
        )
    return SinkColumns(
        value=found["value"],
        key=found.get("key"),
        topic=found.get("topic") if topic_option is None else None,
        partition=found.get("partition"),
        headers=found.get("headers"),
        timestamp=found.get("timestamp"),
    )


# ----------------------------------------------------------------------------------
# one task (Python worker)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskResult:
    """What one task delivered: records per (topic, partition), and where it ran."""

    spark_partition: int
    attempt: int
    pid: int
    host: str
    producer: str  # the shared-memory segment of the host producer it used
    counts: tuple[tuple[str, int, int], ...]  # (topic, partition, records)
    seconds: float

    @property
    def records(self) -> int:
        return sum(n for _t, _p, n in self.counts)


@dataclass
class _Lineage:
    query: bytes
    batch: bytes
    partition: bytes
    attempt: bytes


def _lineage(opts: SinkOptions, part: int, attempt: int) -> _Lineage:
    """This task's lineage values (streaming: the query's id and micro-batch id from
    the task's local properties; a batch write: its write id and batch 0)."""
    query, batch = opts.write_id, "0"
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
    except ImportError:
        ctx = None
    if ctx is not None:
        query = ctx.getLocalProperty("sql.streaming.queryId") or query
        batch = ctx.getLocalProperty("streaming.sql.batchId") or batch
    return _Lineage(query.encode(), batch.encode(), str(part).encode(), str(attempt).encode())


def _column(rb: pa.RecordBatch, name: str | None) -> pa.Array | None:
    return None if name is None else rb.column(name)


def send_record_batch(
    w: Worker,
    opts: SinkOptions,
    cols: SinkColumns,
    rb: pa.RecordBatch,
    lineage: _Lineage | None,
    first_row: int,
) -> list[BatchFuture]:
    """Sends one Arrow batch of sink columns: one ``send_batch`` per topic in it.
    Runs in: worker."""
    n = rb.num_rows
    now_ms = time.time_ns() // 1_000_000
    value = binary_column(rb.column(cols.value))
    key_arr = _column(rb, cols.key)
    keys = binary_column(key_arr) if key_arr is not None else None
    ts_arr = _column(rb, cols.timestamp)
    stamps = epoch_ms_column(ts_arr, now_ms) if ts_arr is not None else None
    parts = _column(rb, cols.partition)
    hdr_arr = _column(rb, cols.headers)
    headers: list[list[tuple[str, bytes | None]]] | None = (
        header_rows(hdr_arr) if hdr_arr is not None else None
    )
    if lineage is not None:
        fixed = [
            (LINEAGE_HEADERS[0], lineage.query),
            (LINEAGE_HEADERS[1], lineage.batch),
            (LINEAGE_HEADERS[2], lineage.partition),
            (LINEAGE_HEADERS[3], lineage.attempt),
        ]
        rows = range(first_row, first_row + n)
        if headers is None:
            headers = [[*fixed, (LINEAGE_HEADERS[4], b"%d" % i)] for i in rows]
        else:
            headers = [
                [*h, *fixed, (LINEAGE_HEADERS[4], b"%d" % i)]
                for h, i in zip(headers, rows, strict=True)
            ]
    if opts.topic is not None:
        return [w.send_batch(opts.topic, value, keys, parts, stamps, headers)]
    topic_arr = rb.column(cols.topic) if cols.topic is not None else None
    if topic_arr is None:  # check_schema makes this impossible
        raise ConfigError("no topic: set the option 'topic', or give a 'topic' column")
    if topic_arr.null_count:
        row = int(np.flatnonzero(topic_arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise InvalidRecordError(
            f"row {first_row + row} has a null 'topic' and no 'topic' option is set"
        )
    topics = pc.unique(topic_arr).to_pylist()
    if len(topics) == 1:
        return [w.send_batch(topics[0], value, keys, parts, stamps, headers)]
    futures = []
    for topic in topics:  # one call per topic; rows keep their order within each
        idx = np.flatnonzero(pc.equal(topic_arr, topic).to_numpy(zero_copy_only=False))
        take = pa.array(idx)
        futures.append(
            w.send_batch(
                topic,
                value.take(take),
                keys.take(take) if keys is not None else None,
                parts.take(take) if parts is not None else None,
                stamps[idx] if stamps is not None else None,
                [headers[i] for i in idx] if headers is not None else None,
            )
        )
    return futures


def rows_to_batches(
    rows: Iterable[Any], cols: SinkColumns, chunk_rows: int = ROWS_PER_BATCH
) -> Iterator[pa.RecordBatch]:
    """pyspark Rows as Arrow batches of the sink columns (for writers given rows)."""
    names = cols.names
    chunk: list[tuple[Any, ...]] = []
    for row in rows:
        chunk.append(tuple(row[n] for n in names))
        if len(chunk) >= chunk_rows:
            yield from rows_table(names, chunk).to_batches()
            chunk = []
    if chunk:
        yield from rows_table(names, chunk).to_batches()


def write_task(
    opts: SinkOptions, cols: SinkColumns, batches: Iterable[pa.RecordBatch]
) -> TaskResult:
    """The body of one writer task: every batch sent through this host's producer for
    ``opts``, then every record's acknowledgement awaited. Raises the typed shmprod
    error of the first failure. Runs in: a Spark Python worker."""
    t0 = time.monotonic()
    part, attempt = task_identity()
    lineage = _lineage(opts, part, attempt) if opts.include_lineage else None
    with attachment(opts.key, opts.producer_options, opts.idle_timeout_ms) as w:
        deliveries = Deliveries(w, opts.timeout_s)
        row = 0
        for rb in batches:
            if not rb.num_rows:
                continue
            for fut in send_record_batch(w, opts, cols, rb, lineage, row):
                deliveries.submit(fut)
            row += rb.num_rows
        deliveries.finish()
        segment = w.segment_name
    counts = tuple((t, p, n) for (t, p), n in sorted(deliveries.counts.items()))
    return TaskResult(part, attempt, os.getpid(), host_id(), segment, counts, time.monotonic() - t0)
