"""format("shmprod") (batch and streaming), shmprod.spark.write and the foreachPartition
function, with real pyspark in local mode against the embedded broker; confluent-kafka
reads back every key, value, header, timestamp and partition.

One local[2] session for the module. Its Python workers find their host producer in a
private runtime directory made for the module (set before the JVM starts, so every
Python worker inherits it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.partitioner import murmur2
from tests.support.readback import Landed, consume_all

pytest.importorskip("pyspark", reason="the spark extra is not installed")

import shmprod.spark
from shmprod.spark import local_session
from shmprod.spark.sink import LINEAGE_HEADERS
from tests.support.spark_cluster import (
    children,
    host_daemons,
    private_runtime,
    stop_and_reap,
    wait_gone,
)

pytestmark = [pytest.mark.broker, pytest.mark.spark]

BASE_MS = 1_700_000_000_000
PARTITIONS = 6
IDLE_MS = 1000


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with private_runtime(tmp_path_factory.mktemp("xdg")) as path:
        yield path


@pytest.fixture(scope="module")
def spark(runtime: Path) -> Iterator[Any]:
    before = children()
    session = local_session(
        "local[2]",
        "shmprod-source-tests",
        **{"spark.driver.host": "127.0.0.1", "spark.sql.shuffle.partitions": "2"},
    )
    session.sparkContext.setLogLevel("ERROR")
    shmprod.spark.register(session)
    try:
        yield session
    finally:
        stop_and_reap(session, before)
        # Python workers gone: the host producers close idleTimeoutMs later
        assert wait_gone(runtime, 30), host_daemons(runtime)


def frame(spark: Any, n: int, parts: int) -> Any:
    """Every Kafka sink column, each a function of the row id: a key (string; every
    5th null), a binary value, a partition (every 3rd row explicit, else null), two
    headers and a timestamp."""
    return spark.range(0, n, numPartitions=parts).selectExpr(
        "CASE WHEN id % 5 = 0 THEN NULL ELSE cast(id % 1000 as string) END AS key",
        "cast(concat('value-', id) as binary) AS value",
        f"CASE WHEN id % 3 = 0 THEN cast(id % {PARTITIONS} as int) END AS partition",
        "array(named_struct('key', 'src', 'value', cast('spark' as binary)),"
        " named_struct('key', 'id', 'value', cast(cast(id as string) as binary))) AS headers",
        f"timestamp_millis({BASE_MS} + id) AS timestamp",
        "id * 2 AS ignored",  # not a sink column
    )


def check_frame_rows(records: list[Landed], n: int, lineage: bool = False) -> None:
    """Exactly the rows of :func:`frame`, every column as written."""
    ids = [int(r.value.removeprefix(b"value-")) for r in records if r.value is not None]
    assert len(ids) == len(records) == n == len(set(ids)), (len(records), len(set(ids)), n)
    for r, i in zip(records, ids, strict=True):
        key = None if i % 5 == 0 else str(i % 1000).encode()
        assert r.key == key
        assert r.timestamp_ms == BASE_MS + i
        assert r.headers[:2] == (("src", b"spark"), ("id", str(i).encode()))
        assert len(r.headers) == (7 if lineage else 2)
        if i % 3 == 0:
            assert r.partition == i % PARTITIONS
        elif key is not None:
            assert r.partition == (murmur2(key) & 0x7FFFFFFF) % PARTITIONS


def records_of(landed: dict[int, list[Landed]]) -> list[Landed]:
    return [r for recs in landed.values() for r in recs]


def test_format_shmprod_writes_a_million_rows_with_every_column(
    spark: Any, broker: EmbeddedBroker, topic_name: str, runtime: Path
) -> None:
    n = 1_000_000
    broker.create_topic(topic_name, PARTITIONS)
    (
        frame(spark, n, 8)
        .write.format("shmprod")
        .option("kafka.bootstrap.servers", broker.bootstrap)
        .option("kafka.compression.type", "lz4")
        .option("kafka.linger.ms", "20")
        .option("topic", topic_name)
        .option("idleTimeoutMs", str(IDLE_MS))
        .mode("append")
        .save()
    )
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, n, 120, extra_wait_s=1)
    check_frame_rows(records_of(landed), n)
    assert wait_gone(runtime, 30)  # the host producer closed once idle


def test_write_sends_to_each_rows_topic_with_lineage_headers(
    spark: Any, broker: EmbeddedBroker, topic_name: str
) -> None:
    n, parts = 1_000_000, 8
    even, odd = topic_name + "-even", topic_name + "-odd"
    broker.create_topic(even, PARTITIONS)
    broker.create_topic(odd, PARTITIONS)
    df = frame(spark, n, parts).selectExpr(
        "*", f"CASE WHEN ignored % 4 = 0 THEN '{even}' ELSE '{odd}' END AS topic"
    )
    report = shmprod.spark.write(
        df,
        bootstrap_servers=broker.bootstrap,
        include_lineage=True,
        idle_timeout_ms=IDLE_MS,
        compression_type="lz4",
    )
    assert report.records == n
    assert sorted(report.per_task) == list(range(parts))
    assert len(report.producers) == 1 and len(next(iter(report.producers.values()))) == 1
    got = {
        t: records_of(consume_all(broker.bootstrap, t, PARTITIONS, n // 2, 120, extra_wait_s=1))
        for t in (even, odd)
    }
    for t, parity in ((even, 0), (odd, 1)):
        check_frame_rows(got[t], n // 2, lineage=True)
        assert all(int(r.value.removeprefix(b"value-")) % 2 == parity for r in got[t])  # type: ignore[union-attr]
        per_topic = Counter({p: len(rs) for p, rs in _by_partition(got[t]).items()})
        assert per_topic == Counter(
            {p: c for (tt, p), c in report.per_partition.items() if tt == t}
        )
    # lineage: one write id, batch 0, attempt 0, and (Spark partition, row) unique and
    # covering each partition's rows 0..k-1
    lineage = [dict(r.headers[2:]) for t in got for r in got[t]]
    assert {h[LINEAGE_HEADERS[0]] for h in lineage} == {lineage[0][LINEAGE_HEADERS[0]]}
    assert {h[LINEAGE_HEADERS[1]] for h in lineage} == {b"0"}
    assert {h[LINEAGE_HEADERS[3]] for h in lineage} == {b"0"}
    rows: dict[int, set[int]] = {}
    for h in lineage:
        rows.setdefault(int(h[LINEAGE_HEADERS[2]]), set()).add(int(h[LINEAGE_HEADERS[4]]))
    assert sorted(rows) == list(range(parts))
    assert all(r == set(range(len(r))) for r in rows.values())
    assert sum(len(r) for r in rows.values()) == n


def _by_partition(records: list[Landed]) -> dict[int, list[Landed]]:
    out: dict[int, list[Landed]] = {}
    for r in records:
        out.setdefault(r.partition, []).append(r)
    return out


def test_the_foreach_partition_function(
    spark: Any, broker: EmbeddedBroker, topic_name: str
) -> None:
    n = 1_000_000
    broker.create_topic(topic_name, PARTITIONS)
    df = frame(spark, n, 8)
    df.foreachPartition(
        shmprod.spark.partition_writer(
            df, topic_name, bootstrap_servers=broker.bootstrap, idle_timeout_ms=IDLE_MS
        )
    )
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, n, 120, extra_wait_s=1)
    check_frame_rows(records_of(landed), n)


def _write(df: Any, bootstrap: str, topic: str | None = None) -> Any:
    w = df.write.format("shmprod").option("kafka.bootstrap.servers", bootstrap)
    return w.option("topic", topic) if topic else w


@pytest.mark.parametrize(
    ("select", "options", "match"),
    [
        (["cast(id as string) AS key"], {}, "needs a 'value' column"),
        (["id AS value"], {}, "column 'value' has type bigint"),
        (["cast(id as string) AS value", "1.5 AS key"], {}, "column 'key' has type"),
        (["cast(id as string) AS value"], {"includeLinage": "true"}, "includeLineage"),
        (["cast(id as string) AS value"], {"kafka.linger.ms": "x"}, "linger.ms"),
    ],
)
def test_bad_columns_and_options_are_refused_before_any_task(
    spark: Any,
    broker: EmbeddedBroker,
    topic_name: str,
    select: list[str],
    options: dict[str, str],
    match: str,
) -> None:
    broker.create_topic(topic_name, 1)
    sc = spark.sparkContext
    sc.setJobGroup(topic_name, "refused")
    try:
        w = _write(spark.range(10).selectExpr(*select), broker.bootstrap, topic_name)
        for k, v in options.items():
            w = w.option(k, v)
        with pytest.raises(Exception, match=match) as info:
            w.mode("append").save()
        assert "shmprod.errors.ConfigError" in str(info.value)
        assert sc.statusTracker().getJobIdsForGroup(topic_name) == []  # no task ran
    finally:
        sc.setJobGroup("", "")
    with pytest.raises(Exception, match="only be appended"):
        _write(spark.range(3).selectExpr("'v' AS value"), broker.bootstrap, topic_name).mode(
            "overwrite"
        ).save()
    from shmprod.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a 'value' column"):
        shmprod.spark.write(spark.range(3), topic_name, bootstrap_servers=broker.bootstrap)


def test_a_failed_record_fails_the_write_with_the_typed_error(
    spark: Any, broker: EmbeddedBroker, topic_name: str
) -> None:
    from shmprod.errors import UnknownPartitionError

    broker.create_topic(topic_name, 2)
    df = spark.range(0, 100, numPartitions=2).selectExpr(
        "cast(id as string) AS value", "cast(id % 3 as int) AS partition"
    )
    with pytest.raises(UnknownPartitionError, match="partition 2"):
        shmprod.spark.write(
            df, topic_name, bootstrap_servers=broker.bootstrap, idle_timeout_ms=IDLE_MS
        )
    with pytest.raises(Exception, match="UnknownPartitionError"):
        _write(df, broker.bootstrap, topic_name).option("idleTimeoutMs", str(IDLE_MS)).mode(
            "append"
        ).save()


def _files(spark: Any, directory: Path, start: int, n: int, files: int) -> None:
    """``files`` Parquet files of rows ``start .. start+n-1`` (value, key) into ``directory``."""
    tmp = directory.parent / f"staging-{start}"
    spark.range(start, start + n, numPartitions=files).selectExpr(
        "concat('value-', id) AS value", "cast(id % 97 as string) AS key"
    ).write.parquet(str(tmp))
    for f in tmp.glob("*.parquet"):
        f.rename(directory / f"{start}-{f.name}")  # whole files appear at once


def test_streaming_stopped_and_restarted_from_its_checkpoint_loses_nothing(
    spark: Any, broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    broker.create_topic(topic_name, 3)
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()
    _files(spark, source, 0, 60_000, 6)
    schema = "value string, key string"

    def start(trigger: dict[str, Any]) -> Any:
        stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 2)
        return (
            stream.parquet(str(source))
            .writeStream.format("shmprod")
            .option("kafka.bootstrap.servers", broker.bootstrap)
            .option("topic", topic_name)
            .option("includeLineage", "true")
            .option("idleTimeoutMs", str(IDLE_MS))
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    q = start({"processingTime": "100 milliseconds"})
    deadline = time.monotonic() + 120
    while not q.recentProgress and time.monotonic() < deadline:  # at least one micro-batch
        time.sleep(0.1)
    q.stop()  # maybe in the middle of the next micro-batch
    progress = list(q.recentProgress)
    first_id = str(q.id)
    _files(spark, source, 60_000, 30_000, 3)
    q = start({"availableNow": True})
    assert q.awaitTermination(180)
    assert q.exception() is None
    assert str(q.id) == first_id  # the same query, restarted from its checkpoint
    landed = records_of(consume_all(broker.bootstrap, topic_name, 3, 90_000, 120, extra_wait_s=1))
    values = Counter(r.value for r in landed)
    assert set(values) == {b"value-%d" % i for i in range(90_000)}  # nothing lost
    progress += q.recentProgress
    # each record names the micro-batch that wrote it: every batch that read rows, and
    # only those (an interrupted batch runs again under its id); how many batches Spark
    # plans for the files is its business
    batches = {dict(r.headers)[LINEAGE_HEADERS[1]] for r in landed}
    with_rows = {str(p["batchId"]).encode() for p in progress if p["numInputRows"]}
    assert with_rows <= batches <= {str(p["batchId"]).encode() for p in progress}, progress
    assert len(batches) >= 2
    assert {dict(r.headers)[LINEAGE_HEADERS[0]] for r in landed} == {first_id.encode()}
    # at-least-once: a repeat is a micro-batch re-run after the stop, identified by its
    # lineage (same batch, partition and row)
    repeats = [v for v, c in values.items() if c > 1]
    if repeats:
        keyed = Counter(
            tuple(dict(r.headers)[h] for h in (LINEAGE_HEADERS[1], *LINEAGE_HEADERS[2::2]))
            for r in landed
        )
        assert sum(c - 1 for c in keyed.values()) == sum(values[v] - 1 for v in repeats)


def test_the_spark_job_reads_any_source_and_streams_from_a_checkpoint(
    spark: Any, broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    from workers import spark_job

    broker.create_topic(topic_name, 2)
    csv = tmp_path / "csv"
    spark.range(0, 5_000, numPartitions=2).selectExpr(
        "id AS user", "concat('event-', id) AS what"
    ).write.option("header", "true").csv(str(csv))
    parser = spark_job.build_parser()
    common = ["--bootstrap", broker.bootstrap, "--topic", topic_name, "-o", "idleTimeoutMs=1000"]
    csv_in = ["--input", str(csv), "--format", "csv", "-r", "header=true"]
    batch = parser.parse_args([*common, *csv_in, "--value-json", "--key-column", "user"])
    assert "wrote 5,000 rows" in spark_job.run(spark, batch)
    checkpoint = ["--checkpoint", str(tmp_path / "checkpoint")]
    stream = parser.parse_args(
        [*common, *csv_in, "--stream", "--value-column", "what", *checkpoint]
    )
    assert "wrote 5,000 rows" in spark_job.run(spark, stream)
    assert "wrote 0 rows" in spark_job.run(spark, stream)  # the checkpoint has it all
    landed = records_of(consume_all(broker.bootstrap, topic_name, 2, 10_000, 60, extra_wait_s=1))
    assert len(landed) == 10_000
    as_json = sorted(r.value for r in landed if r.value and r.value.startswith(b"{"))
    assert len(as_json) == 5_000 and b'{"user":"0","what":"event-0"}' in as_json
    assert all(r.key == r.value.split(b'"')[3] for r in landed if r.value in as_json)  # type: ignore[union-attr]
    plain = {r.value for r in landed if r.value not in as_json}
    assert plain == {b"event-%d" % i for i in range(5_000)}
    bad = parser.parse_args([*common, "--rows", "10", "--key-column", "nope"])
    with pytest.raises(Exception, match="no such column"):
        spark_job.run(spark, bad)
