"""Export a Spark DataFrame to Kafka through the host's one shared producer.

    python -m workers.spark_job --bootstrap 127.0.0.1:9092 --topic events --rows 1000000
    python -m workers.spark_job --bootstrap 127.0.0.1:9092 --topic events \\
        --input events.parquet --value-column payload --key-column user_id \\
        --timestamp-column ts

The driver creates ONE shmprod producer and a local SparkSession (``--master``,
``local[2]`` by default: shared memory is host-local, so every executor must run on
this host). The DataFrame is either generated (``--rows``: a clickstream-like table of
user ids, JSON payloads and event times) or read from a Parquet file. Each Spark task
attaches to the producer by handle in its Python worker and sends whole Arrow batches
with ``send_batch`` (``--method arrow``, ``mapInArrow``) or rows gathered into columns
(``--method rows``, ``foreachPartition``), waits until they are acknowledged, and
reports its counts. The driver prints a report. Delivery is at-least-once: a task Spark
re-runs sends its rows again.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from shmprod import Producer
from shmprod.spark import SparkExportReport, export_dataframe, local_session, stop_session


def generated(spark: Any, rows: int, partitions: int, users: int = 10_000) -> Any:
    """A clickstream-like DataFrame of ``rows`` rows: user_id (string key), payload (a
    JSON string) and ts (event time, one millisecond apart from now)."""
    base_ms = time.time_ns() // 1_000_000
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        f"cast(id % {users} as string) as user_id",
        f"to_json(named_struct('event', id, 'user', id % {users}, 'kind', "
        "element_at(array('view', 'click', 'buy'), cast(id % 3 as int) + 1))) as payload",
        f"timestamp_millis({base_ms} + id) as ts",
    )


def run(
    spark: Any,
    bootstrap_servers: str,
    topic: str,
    *,
    rows: int = 0,
    input_path: str | None = None,
    value_column: str = "payload",
    key_column: str | None = "user_id",
    timestamp_column: str | None = "ts",
    spark_partitions: int = 4,
    method: str = "arrow",
    **producer_options: Any,
) -> SparkExportReport:
    """Exports the generated or Parquet DataFrame with ``spark``; raises on failure."""
    df = spark.read.parquet(input_path) if input_path else generated(spark, rows, spark_partitions)
    with Producer(bootstrap_servers=bootstrap_servers, **producer_options) as producer:
        return export_dataframe(
            df,
            producer,
            topic,
            value_col=value_column,
            key_col=key_column,
            timestamp_col=timestamp_column,
            method="rows" if method == "rows" else "arrow",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rows", type=int, help="generate this many rows")
    source.add_argument("--input", help="a Parquet file (or directory)")
    parser.add_argument("--value-column", default="payload")
    parser.add_argument("--key-column", default="user_id")
    parser.add_argument("--timestamp-column", default="ts")
    parser.add_argument("--spark-partitions", type=int, default=4)
    parser.add_argument("--method", choices=("arrow", "rows"), default="arrow")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--compression", default="lz4")
    args = parser.parse_args(argv)
    spark = local_session(args.master, "shmprod-spark-job")
    try:
        spark.sparkContext.setLogLevel("WARN")
        report = run(
            spark,
            args.bootstrap,
            args.topic,
            rows=args.rows or 0,
            input_path=args.input,
            value_column=args.value_column,
            key_column=args.key_column or None,
            timestamp_column=args.timestamp_column or None,
            spark_partitions=args.spark_partitions,
            method=args.method,
            compression_type=args.compression,
        )
    finally:
        stop_session(spark)
    print(
        f"exported {report.records:,} records from {len(report.per_task)} Spark tasks "
        f"({len(report.pids)} Python workers) in {report.seconds:.2f}s "
        f"({report.records_per_s:,.0f} records/s); per partition: "
        + ", ".join(f"{p}:{n:,}" for p, n in sorted(report.per_partition.items()))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
