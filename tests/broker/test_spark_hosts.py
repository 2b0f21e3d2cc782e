"""shmprod.spark.write on a standalone Spark cluster of two "hosts": a master and two
workers started by the test from pyspark's own launcher, each worker given its own host
identity and runtime directory, so each host's executors start and use their own host
producer. confluent-kafka reads back every row.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.host import HOST_ID_ENV

pytest.importorskip("pyspark", reason="the spark extra is not installed")

import shmprod.spark
from shmprod.spark import stop_session
from tests.support.spark_cluster import (
    IDLE_MS,
    check_all,
    rows,
    session,
    standalone_cluster,
    times_landed,
    wait_for_executors,
    wait_gone,
)

pytestmark = [pytest.mark.broker, pytest.mark.spark, pytest.mark.slow]


def test_two_hosts_each_have_their_own_host_producer(
    fresh_broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    n = 200_000
    fresh_broker.create_topic(topic_name, 4)
    hosts = [
        {HOST_ID_ENV: "host-a", "XDG_RUNTIME_DIR": str(tmp_path / "a")},
        {HOST_ID_ENV: "host-b", "XDG_RUNTIME_DIR": str(tmp_path / "b")},
    ]
    for h in hosts:
        os.mkdir(h["XDG_RUNTIME_DIR"], 0o700)
    with standalone_cluster(hosts, work_dir=tmp_path / "cluster") as master:
        spark = session(master, "shmprod-two-hosts")
        try:
            spark.sparkContext.setLogLevel("ERROR")
            wait_for_executors(spark, 2)
            report = shmprod.spark.write(
                rows(spark, n, 8),
                topic_name,
                bootstrap_servers=fresh_broker.bootstrap,
                idle_timeout_ms=IDLE_MS,
                compression_type="lz4",
            )
        finally:
            stop_session(spark, timeout_s=30)
    assert report.records == n
    assert set(report.producers) == {"host-a", "host-b"}, report.producers
    a, b = (report.producers[h] for h in ("host-a", "host-b"))
    assert len(a) == len(b) == 1 and a != b  # one producer per host, used by its own
    landed = check_all(fresh_broker.bootstrap, topic_name, 4, n)
    assert set(times_landed(landed).values()) == {1}
    for h in hosts:
        assert wait_gone(Path(h["XDG_RUNTIME_DIR"]) / "shmprod", 30)
