"""export_dataframe (a producer the driver built) with real pyspark in local mode.

One local[2] SparkSession (and its JVM) for the module; each test makes its own
producer and topic, exports through Spark's Python workers, and reads the topic back
with confluent-kafka.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from shmprod.errors import ProducerClosedError, UnknownPartitionError
from shmprod.partitioner import murmur2
from shmprod.spark import (
    ExportSpec,
    ProducerHostError,
    export_dataframe,
    forget,
    local_session,
    worker_for,
)
from tests.support.readback import Landed, consume_all
from tests.support.spark_cluster import children, stop_and_reap

pytest.importorskip("pyspark", reason="the spark extra is not installed")

pytestmark = [pytest.mark.broker, pytest.mark.spark]

BASE_MS = 1_700_000_000_000
PARTITIONS = 3


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """A small local[2] session for the module; its JVM and Python workers stopped after."""
    before = children()
    session = local_session(
        "local[2]",
        "shmprod-tests",
        **{"spark.python.worker.reuse": "true", "spark.driver.host": "127.0.0.1"},
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        alive = stop_and_reap(session, before)
        assert not alive, f"Spark left processes behind: {alive}"


def frame(spark: Any, n: int, spark_partitions: int) -> Any:
    """key (string, 0..n/7), value (unique string), ts (Spark timestamp, ms apart)."""
    return spark.range(0, n, numPartitions=spark_partitions).selectExpr(
        f"cast(id % {max(n // 7, 1)} as string) as key",
        "concat('value-', id) as value",
        f"timestamp_millis({BASE_MS} + id) as ts",
    )


def assert_closed(p: Producer) -> None:
    """The producer removed its segment (Spark's Python workers may still map it)."""
    assert not os.path.exists(f"/dev/shm/{p.handle.segment}")


def check_landed(landed: dict[int, list[Landed]], n: int) -> None:
    """Every row exactly once, with its key, timestamp and murmur2 partition."""
    records = [r for recs in landed.values() for r in recs]
    values = [r.value for r in records]
    assert len(values) == n == len(set(values)), (len(values), len(set(values)), n)
    for r in records:
        assert r.value is not None and r.key is not None
        i = int(r.value.removeprefix(b"value-"))
        assert r.key == str(i % max(n // 7, 1)).encode()
        assert r.timestamp_ms == BASE_MS + i
        assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % PARTITIONS


def test_export_with_map_in_arrow(spark: Any, broker: EmbeddedBroker, topic_name: str) -> None:
    n, tasks = 30_000, 6
    broker.create_topic(topic_name, PARTITIONS)
    with Producer(bootstrap_servers=broker.bootstrap, compression_type="lz4") as p:
        report = export_dataframe(
            frame(spark, n, tasks),
            p,
            topic_name,
            value_col="value",
            key_col="key",
            timestamp_col="ts",
        )
        attached = p.stats()["sender"]["workers_attached"]
    assert_closed(p)
    assert report.records == n
    assert sorted(report.per_task) == list(range(tasks))
    assert sum(report.per_task.values()) == n
    # Python workers are reused across tasks, and each attached once: the owner plus
    # one attachment per process, not per task.
    assert 1 <= len(report.pids) < tasks
    assert os.getpid() not in report.pids
    assert attached == 1 + len(report.pids)
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, n, 60)
    check_landed(landed, n)
    assert {p: len(recs) for p, recs in landed.items()} == dict(report.per_partition)


def test_export_with_foreach_partition(spark: Any, broker: EmbeddedBroker, topic_name: str) -> None:
    n = 12_000
    broker.create_topic(topic_name, PARTITIONS)
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        report = export_dataframe(
            frame(spark, n, 3),
            p.handle,
            topic_name,
            value_col="value",
            key_col="key",
            timestamp_col="ts",
            method="rows",
            chunk_rows=1_000,
        )
    assert_closed(p)
    assert report.records == n and sorted(report.per_task) == [0, 1, 2]
    landed = consume_all(broker.bootstrap, topic_name, PARTITIONS, n, 60)
    check_landed(landed, n)
    assert {p: len(recs) for p, recs in landed.items()} == dict(report.per_partition)


def test_a_failed_send_fails_the_job_with_the_typed_error(
    spark: Any, broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, PARTITIONS)
    df = spark.range(0, 100, numPartitions=2).selectExpr(
        "cast(id as string) as value", "cast(id % 5 + 1 as int) as p"
    )
    with (
        Producer(bootstrap_servers=broker.bootstrap) as p,
        pytest.raises(UnknownPartitionError) as info,
    ):
        export_dataframe(df, p, topic_name, value_col="value", partition_col="p")
    assert info.value.__cause__ is not None  # Spark's error, with the task's traceback


def test_an_executor_on_another_host_fails_at_once(
    spark: Any, broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 1)
    df = spark.range(0, 100, numPartitions=2).selectExpr("cast(id as string) as value")
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        t0 = time.monotonic()
        with pytest.raises(ProducerHostError, match="host-local") as info:
            export_dataframe(df, p, topic_name, value_col="value", host="another-host")
        assert time.monotonic() - t0 < 60
        assert "another-host" in str(info.value)
        assert p.stats()["sender"]["records_sent"] == 0


def test_a_closed_producer_is_named_as_closed(broker: EmbeddedBroker) -> None:
    p = Producer(bootstrap_servers=broker.bootstrap)
    p.close()
    spec = ExportSpec(handle=p.handle, topic="t", value_col="value")
    with pytest.raises(ProducerClosedError, match="the producer is closed"):
        spec.worker()


def test_attachments_are_cached_per_process(broker: EmbeddedBroker) -> None:
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        first = worker_for(p.handle)
        assert worker_for(p.handle) is first
        with Producer(bootstrap_servers=broker.bootstrap) as other:
            second = worker_for(other.handle)  # detaches this process from the first
            assert second is not first
            with pytest.raises(Exception, match="closed"):
                first.send(topic="t", value=b"x")
            forget(other.handle)
            assert second.worker_slot >= 0 and worker_for(other.handle) is not second
            forget(other.handle)


class _FakeSession:
    """What check_worker_python reads of a SparkSession: the master and the Python
    the context starts its workers with."""

    def __init__(self, master: str, python: str) -> None:
        self.sparkContext = type("Ctx", (), {"master": master, "pythonExec": python})()


def test_workers_that_cannot_import_shmprod_are_refused_before_the_job(
    tmp_path: Any,
) -> None:
    """Without PYSPARK_PYTHON pointing at an interpreter with shmprod, every task died
    with a Java stack trace ending in ModuleNotFoundError; the driver now says what to
    set, before any task runs."""
    from shmprod.errors import ConfigError
    from shmprod.spark import check_worker_python

    bare = tmp_path / "python-without-shmprod"
    bare.write_text(
        "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'shmprod'\" >&2\nexit 1\n"
    )
    bare.chmod(0o755)
    session = _FakeSession("local[2]", str(bare))
    with pytest.raises(ConfigError, match=r"from PYSPARK_PYTHON.*No module.*set PYSPARK_PYTHON"):
        check_worker_python(session)
    check_worker_python(_FakeSession("local[2]", sys.executable))  # this one has shmprod
    check_worker_python(_FakeSession("spark://elsewhere:7077", str(bare)))  # not checked there
