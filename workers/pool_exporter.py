"""Export files to Kafka from a pool of processes sharing one producer: a thin wrapper
on :func:`shmprod.export` (the same as ``shmprod export``).

    python -m workers.pool_exporter --bootstrap 127.0.0.1:9092 --topic events \\
        --input events.parquet --value-column payload --key-column user_id --workers 4

Parquet, Arrow IPC, CSV or JSON-lines files (a file, glob or directory); a job per
file, or for Parquet a run of row groups, read and sent by the pool process itself
with ``send_batch``.
"""

from __future__ import annotations

import argparse
from typing import Any

import shmprod
from shmprod.exporter import ExportReport


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
    """Exports every row of the files at ``path`` to ``topic``; raises on failure."""
    return shmprod.export(
        path,
        topic,
        bootstrap_servers=bootstrap_servers,
        value=value_column,
        key=key_column,
        timestamp=timestamp_column,
        workers=workers,
        progress=progress,
        **producer_options,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True, help="a file, glob or directory")
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
        f"exported {report.records:,} records in {report.seconds:.2f}s "
        f"({report.rows_per_s:,.0f} records/s); per partition: "
        + ", ".join(f"{p}:{n:,}" for p, n in sorted(report.per_partition.items()))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
