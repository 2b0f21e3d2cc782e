"""Any Spark source in, Kafka out, through format("shmprod") (a spark-submit entry point).

    spark-submit workers/spark_job.py --bootstrap broker:9092 --topic events \\
        --input s3a://bucket/events/ --format parquet --key-column user_id \\
        --timestamp-column ts --value-json -o kafka.compression.type=lz4
    python -m workers.spark_job --bootstrap 127.0.0.1:9092 --topic events --rows 1000000

The DataFrame comes from ``--input`` (Parquet, CSV, JSON, ORC or any format Spark
reads: ``--format``; ``--table`` for a table) or is generated (``--rows``: a
clickstream-like table). Its columns become Spark's Kafka sink columns: ``value`` from
``--value-column`` (cast to string unless binary) or the whole row as JSON
(``--value-json``); ``key``, ``timestamp``, ``partition`` and ``topic`` from the
columns named, when named. It is written with ``df.write.format("shmprod")``, or, with
``--stream``, read as a stream and written with ``writeStream`` (``--checkpoint``
required; ``availableNow``: every file present, then it stops; run it again later
and it continues from the checkpoint). Each executor host shares one producer
(:func:`shmprod.host_producer`); ``-o kafka.<option>=<value>`` passes producer
options (Java names), ``-o idleTimeoutMs=...`` and ``-o includeLineage=true`` the
sink's own.

Under spark-submit the session is the one spark-submit configured (any master: the
same code runs in local mode and on a cluster); run directly, ``--master`` (default
``local[2]``) makes a local one. Prints a report. Delivery is at-least-once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import shmprod.spark
from shmprod.errors import ConfigError


def generated(spark: Any, rows: int, partitions: int, users: int = 10_000) -> Any:
    """A clickstream-like DataFrame of ``rows`` rows: user_id (string), payload (a JSON
    string) and ts (event time, one millisecond apart from now)."""
    base_ms = time.time_ns() // 1_000_000
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        f"cast(id % {users} as string) as user_id",
        f"to_json(named_struct('event', id, 'user', id % {users}, 'kind', "
        "element_at(array('view', 'click', 'buy'), cast(id % 3 as int) + 1))) as payload",
        f"timestamp_millis({base_ms} + id) as ts",
    )


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def sink_columns(
    df: Any,
    *,
    value_column: str | None = "value",
    value_json: bool = False,
    key_column: str | None = None,
    timestamp_column: str | None = None,
    partition_column: str | None = None,
    topic_column: str | None = None,
) -> Any:
    """``df`` as the Kafka sink's columns (names checked here, with the columns it has)."""
    have = set(df.columns)
    named = {
        "value": None if value_json else value_column,
        "key": key_column,
        "timestamp": timestamp_column,
        "partition": partition_column,
        "topic": topic_column,
    }
    for role, name in named.items():
        if name is not None and name not in have:
            raise ConfigError(
                f"--{role}-column {name!r}: no such column; the input has "
                + ", ".join(sorted(have))
            )
    exprs = []
    if value_json:
        exprs.append("to_json(struct(*)) AS value")
    elif value_column is not None:
        v = _quoted(value_column)
        is_binary = dict(df.dtypes)[value_column] == "binary"
        exprs.append(f"{v} AS value" if is_binary else f"cast({v} AS string) AS value")
    else:
        raise ConfigError("give --value-column or --value-json")
    if key_column:
        k = _quoted(key_column)
        is_binary = dict(df.dtypes)[key_column] == "binary"
        exprs.append(f"{k} AS key" if is_binary else f"cast({k} AS string) AS key")
    if timestamp_column:
        exprs.append(f"cast({_quoted(timestamp_column)} AS timestamp) AS timestamp")
    if partition_column:
        exprs.append(f"cast({_quoted(partition_column)} AS int) AS partition")
    if topic_column:
        exprs.append(f"cast({_quoted(topic_column)} AS string) AS topic")
    return df.selectExpr(*exprs)


def options(bootstrap: str, topic: str | None, extra: list[str]) -> dict[str, str]:
    """The data source's options: the bootstrap servers, the topic and ``-o k=v`` pairs."""
    out = {"kafka.bootstrap.servers": bootstrap}
    if topic:
        out["topic"] = topic
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"-o {item!r}: expected name=value")
        out[key.strip()] = value
    return out


def session(master: str | None) -> Any:
    """spark-submit's session when run by it (any master), else a local one."""
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = "local[2]"
    if master is not None:
        return shmprod.spark.local_session(master, "shmprod-spark-job")
    from pyspark.sql import SparkSession

    return SparkSession.builder.appName("shmprod-spark-job").getOrCreate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="host:port[,host:port...]")
    parser.add_argument("--topic", help="every row's topic (else --topic-column)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a path Spark reads with --format")
    source.add_argument("--table", help="a table name")
    source.add_argument("--rows", type=int, help="generate this many rows")
    parser.add_argument("--format", default="parquet", help="parquet, csv, json, orc, ...")
    parser.add_argument(
        "-r",
        "--read-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a reader option (csv: header=true, inferSchema=true)",
    )
    parser.add_argument("--value-column", default=None)
    parser.add_argument("--value-json", action="store_true", help="the whole row as JSON")
    parser.add_argument("--key-column")
    parser.add_argument("--timestamp-column")
    parser.add_argument("--partition-column")
    parser.add_argument("--topic-column")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a sink option: kafka.<producer option>, idleTimeoutMs, includeLineage",
    )
    parser.add_argument("--stream", action="store_true", help="a streaming read and write")
    parser.add_argument("--checkpoint", help="the streaming query's checkpoint directory")
    parser.add_argument("--spark-partitions", type=int, default=4, help="for --rows")
    parser.add_argument("--master", help="run locally with this master (not spark-submit)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stream and (not args.input or not args.checkpoint):
        parser.error("--stream needs --input and --checkpoint")
    if not args.topic and not args.topic_column:
        parser.error("give --topic or --topic-column")
    spark = session(args.master)
    try:
        shmprod.spark.register(spark)
        report = run(spark, args)
    except ConfigError as exc:
        print(f"spark_job: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.master is not None or "PYSPARK_GATEWAY_PORT" not in os.environ:
            shmprod.spark.stop_session(spark)
    print(report)
    return 0


def run(spark: Any, args: argparse.Namespace) -> str:
    """Reads, shapes and writes (the data source registered on ``spark``); returns the
    report line. Runs in: the driver."""
    sink = options(args.bootstrap, args.topic, args.option)
    read = options("-", None, args.read_option)
    read.pop("kafka.bootstrap.servers")
    value_column, key_column, ts_column = args.value_column, args.key_column, args.timestamp_column
    if args.rows is not None:
        df = generated(spark, args.rows, args.spark_partitions)
        if not args.value_json:
            value_column = value_column or "payload"
            key_column = key_column or "user_id"
            ts_column = ts_column or "ts"
    elif args.table:
        df = spark.read.table(args.table)
    elif args.stream:
        schema = spark.read.format(args.format).options(**read).load(args.input).schema
        reader = spark.readStream.format(args.format).options(**read).schema(schema)
        df = reader.load(args.input)
    else:
        df = spark.read.format(args.format).options(**read).load(args.input)
    if value_column is None and not args.value_json:
        value_column = "value"
    shaped = sink_columns(
        df,
        value_column=value_column,
        value_json=args.value_json,
        key_column=key_column,
        timestamp_column=ts_column,
        partition_column=args.partition_column,
        topic_column=args.topic_column,
    )
    t0 = time.monotonic()
    if args.stream:
        query = (
            shaped.writeStream.format("shmprod")
            .options(**sink)
            .option("checkpointLocation", args.checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        seconds = time.monotonic() - t0
        rows = sum(int(p.get("numInputRows", 0)) for p in query.recentProgress)
        what = f"{len(query.recentProgress)} micro-batches"
    else:
        shaped.write.format("shmprod").options(**sink).mode("append").save()
        seconds = time.monotonic() - t0
        rows = df.count()  # what was written: the input's rows
        what = f"{shaped.rdd.getNumPartitions()} Spark partitions"
    rate = rows / seconds if seconds else 0.0
    return (
        f"wrote {rows:,} rows ({what}) to Kafka in {seconds:.2f}s ({rate:,.0f} rows/s) "
        "through format('shmprod'), one producer per executor host"
    )


if __name__ == "__main__":
    raise SystemExit(main())
