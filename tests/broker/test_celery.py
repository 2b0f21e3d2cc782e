"""workers/celery_app.py: a real ``celery worker --pool prefork`` sharing one producer.

The worker runs as a subprocess with kombu's ``filesystem://`` transport and a file
result backend in a temporary directory (no message server). Every wait is bounded and
the worker, its pool children and the producer's sender are gone after the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shmprod.broker import EmbeddedBroker
from shmprod.errors import UnknownPartitionError
from shmprod.partitioner import murmur2
from tests.support.readback import consume_all

pytest.importorskip("celery", reason="the celery extra is not installed")

from tests.support.celery_worker import (
    BASE_MS,
    RESULT_TIMEOUT_S,
    CeleryWorker,
    start_worker,
    stop_and_check,
)
from workers import celery_app

pytestmark = [pytest.mark.broker, pytest.mark.celery]


@pytest.fixture(scope="module")
def worker(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryWorker]:
    data = tmp_path_factory.mktemp("celery")
    celery_app.configure(celery_app.app, data)  # this module's client: the app itself
    w = start_worker(broker.bootstrap, data, 2)
    try:
        yield w
    finally:
        try:
            stop_and_check(w)
        finally:
            celery_app.app.close()


def results(asyncs: list[Any]) -> list[dict[str, Any]]:
    return [a.get(timeout=RESULT_TIMEOUT_S, interval=0.05) for a in asyncs]


def test_export_rows_through_prefork_children(
    worker: CeleryWorker, broker: EmbeddedBroker, topic_name: str
) -> None:
    partitions, tasks, per_task = 3, 8, 1_500
    broker.create_topic(topic_name, partitions)
    asyncs = [
        celery_app.export_rows.delay(
            topic_name,
            [
                {"key": f"user-{i % 211}", "value": f"row-{i}", "timestamp_ms": BASE_MS + i}
                for i in range(t * per_task, (t + 1) * per_task)
            ],
        )
        for t in range(tasks)
    ]
    done = results(asyncs)
    n = tasks * per_task
    assert sum(r["records"] for r in done) == n
    assert all(r["pid"] != worker.proc.pid for r in done)  # ran in pool children
    stats = celery_app.producer_stats.delay().get(timeout=RESULT_TIMEOUT_S, interval=0.05)
    # the main process (owner) and each of the two children attached exactly once
    assert stats["sender"]["workers_attached"] == 3
    worker.segment = stats["segment"]
    landed = consume_all(broker.bootstrap, topic_name, partitions, n, 60)
    records = [r for recs in landed.values() for r in recs]
    assert len(records) == n == len({r.value for r in records})
    for r in records:
        assert r.value is not None and r.key is not None
        i = int(r.value.removeprefix(b"row-"))
        assert r.key == f"user-{i % 211}".encode()
        assert r.timestamp_ms == BASE_MS + i
        assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % partitions
    sent: dict[int, int] = {}
    for r in done:
        for p, c in r["partitions"].items():
            sent[int(p)] = sent.get(int(p), 0) + c
    assert sent == {p: len(recs) for p, recs in landed.items() if recs}


def test_export_parquet_row_groups(
    worker: CeleryWorker, broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    n, partitions = 6_000, 2
    table = pa.table(
        {
            "user_id": pa.array(np.arange(n) % 300),
            "payload": pa.array([f'{{"i":{i}}}' for i in range(n)]),
            "ts": pa.array((BASE_MS + np.arange(n)).astype("datetime64[ms]"), pa.timestamp("ms")),
        }
    )
    path = tmp_path / "events.parquet"
    pq.write_table(table, path, row_group_size=1_000)
    broker.create_topic(topic_name, partitions)
    asyncs = [
        celery_app.export_parquet.delay(
            str(path), topic_name, "payload", "user_id", "ts", row_groups=groups
        )
        for groups in ([0, 1, 2], [3, 4], [5])
    ]
    assert sum(r["records"] for r in results(asyncs)) == n
    landed = consume_all(broker.bootstrap, topic_name, partitions, n, 60)
    got = {r.value: r for recs in landed.values() for r in recs}
    assert len(got) == n == sum(len(recs) for recs in landed.values())
    for i in range(n):
        rec = got[f'{{"i":{i}}}'.encode()]
        assert rec.key == str(i % 300).encode()
        assert rec.timestamp_ms == BASE_MS + i
        assert rec.partition == (murmur2(rec.key) & 0x7FFFFFFF) % partitions


def test_a_failed_send_fails_the_task_with_the_typed_error(
    worker: CeleryWorker, broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 1)
    bad = celery_app.export_rows.delay(topic_name, [{"value": "x", "partition": 4}])
    with pytest.raises(UnknownPartitionError):
        bad.get(timeout=RESULT_TIMEOUT_S, interval=0.05)
    ok = celery_app.export_rows.delay(topic_name, [{"value": "y", "partition": 0}])
    assert ok.get(timeout=RESULT_TIMEOUT_S, interval=0.05)["records"] == 1
