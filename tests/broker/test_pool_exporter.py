"""workers/pool_exporter.py: a Parquet file exported by a spawned pool through one producer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shmprod.broker import EmbeddedBroker
from tests.support.readback import consume_all
from workers.pool_exporter import export

pytestmark = pytest.mark.broker


def test_parquet_export(broker: EmbeddedBroker, tmp_path: Path) -> None:
    n = 9_000
    table = pa.table(
        {
            "user_id": pa.array(np.arange(n) % 500),
            "payload": pa.array([f'{{"i":{i}}}' for i in range(n)]),
            "ts": pa.array(
                (1_700_000_000_000 + np.arange(n)).astype("datetime64[ms]"), pa.timestamp("ms")
            ),
        }
    )
    path = tmp_path / "events.parquet"
    pq.write_table(table, path, row_group_size=2_000)
    broker.create_topic("exported", 3)
    report = export(
        str(path),
        "exported",
        bootstrap_servers=broker.bootstrap,
        value_column="payload",
        key_column="user_id",
        timestamp_column="ts",
        workers=2,
        progress=False,
    )
    assert report.records == n and report.total_rows == n
    assert sum(report.per_partition.values()) == n
    landed = consume_all(broker.bootstrap, "exported", 3, n, 60)
    got = {r.value: r for recs in landed.values() for r in recs}
    assert len(got) == n
    for i in (0, 1, 4_321, n - 1):
        rec = got[f'{{"i":{i}}}'.encode()]
        assert rec.key == str(i % 500).encode()
        assert rec.timestamp_ms == 1_700_000_000_000 + i
