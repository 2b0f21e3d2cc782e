"""Export a Parquet file to Kafka from a pool of worker processes sharing one producer.

    python -m workers.pool_exporter --bootstrap 127.0.0.1:9092 --topic events \\
        --input events.parquet --value-column payload --key-column user_id --workers 4

The parent creates ONE shmprod producer; a ``multiprocessing`` pool of spawned workers
attaches to it by handle. Each job is one Parquet row group: the worker reads it, turns
the key/value columns into binary (strings as UTF-8, numbers as their decimal text) and
the optional timestamp column into epoch milliseconds, and hands the columns to
``send_batch``: partitioning, encoding and compression happen in the worker, straight
into shared memory, with no per-row Python. The parent prints progress and a report.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shmprod import Handle, Producer, attach
from shmprod.worker import Worker

_worker: Worker | None = None


@dataclass
class ExportReport:
    """What an export did."""

    records: int = 0
    row_groups: int = 0
    seconds: float = 0.0
    per_partition: Counter[int] = field(default_factory=Counter)

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def as_binary(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A key or value column as Arrow binary: bytes as they are, anything else as text."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return arr
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = pc.cast(arr, pa.string())
    return pc.cast(arr, pa.binary())


def as_epoch_ms(column: pa.ChunkedArray | pa.Array) -> np.ndarray[Any, np.dtype[np.int64]]:
    """A timestamp (or integer milliseconds) column as int64 epoch milliseconds."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_timestamp(arr.type):
        arr = pc.cast(pc.cast(arr, pa.timestamp("ms")), pa.int64())
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)


def _attach(handle: Handle) -> None:
    global _worker
    _worker = attach(handle)


def _export_row_group(job: tuple[str, int, str, str, str | None, str | None]) -> tuple[int, Any]:
    """Runs in a pool worker: sends one row group; returns (rows, partitions)."""
    path, group, topic, value_col, key_col, ts_col = job
    assert _worker is not None, "the pool initializer did not attach"
    columns = [c for c in (value_col, key_col, ts_col) if c]
    table = pq.ParquetFile(path).read_row_group(group, columns=columns)
    fut = _worker.send_batch(
        topic,
        as_binary(table[value_col]),
        keys=as_binary(table[key_col]) if key_col else None,
        timestamps_ms=as_epoch_ms(table[ts_col]) if ts_col else None,
    )
    md = fut.result(timeout=600)
    return len(md.offsets), md.partitions


def _detach(_: int) -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


def export(
    path: str,
    topic: str,
    *,
    bootstrap_servers: str,
    value_column: str,
    key_column: str | None = None,
    timestamp_column: str | None = None,
    workers: int = 4,
    progress: bool = True,
    **producer_options: Any,
) -> ExportReport:
    """Exports every row of the Parquet file at ``path`` to ``topic``; raises on failure."""
    groups = pq.ParquetFile(path).num_row_groups
    jobs = [(path, g, topic, value_column, key_column, timestamp_column) for g in range(groups)]
    report = ExportReport(row_groups=groups)
    t0 = time.monotonic()
    with Producer(bootstrap_servers=bootstrap_servers, **producer_options) as producer:
        ctx = mp.get_context("spawn")
        with ctx.Pool(workers, initializer=_attach, initargs=(producer.handle,)) as pool:
            for rows, partitions in pool.imap_unordered(_export_row_group, jobs):
                report.records += rows
                counts = np.bincount(partitions)
                for p in np.flatnonzero(counts):
                    report.per_partition[int(p)] += int(counts[p])
                if progress:
                    rate = report.records / max(time.monotonic() - t0, 1e-9)
                    print(
                        f"\r  exported {report.records:,} records ({rate:,.0f}/s)",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
            pool.map(_detach, range(workers))
    report.seconds = time.monotonic() - t0
    if progress:
        print(file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True, help="a Parquet file")
    parser.add_argument("--value-column", required=True)
    parser.add_argument("--key-column")
    parser.add_argument("--timestamp-column")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--compression", default="lz4")
    args = parser.parse_args(argv)
    report = export(
        args.input,
        args.topic,
        bootstrap_servers=args.bootstrap,
        value_column=args.value_column,
        key_column=args.key_column,
        timestamp_column=args.timestamp_column,
        workers=args.workers,
        compression_type=args.compression,
    )
    print(
        f"exported {report.records:,} records from {report.row_groups} row groups in "
        f"{report.seconds:.2f}s ({report.records_per_s:,.0f} records/s); per partition: "
        + ", ".join(f"{p}:{n:,}" for p, n in sorted(report.per_partition.items()))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
