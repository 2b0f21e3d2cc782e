"""A directory of Parquet files to Kafka, streamed row group by row group.

    python examples/export_parquet_dir.py [BOOTSTRAP]   # default: an embedded broker

The same from a shell: shmprod export DIR --topic events --key user --value payload
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import shmprod
from shmprod.broker import EmbeddedBroker


def main(bootstrap: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        for part in range(3):  # three files of 20,000 rows
            ids = range(part * 20_000, (part + 1) * 20_000)
            table = pa.table(
                {"user": [f"u{i % 97}" for i in ids], "payload": [f"event {i}" for i in ids]}
            )
            pq.write_table(table, Path(d) / f"part-{part}.parquet", row_group_size=5_000)
        report = shmprod.export(
            d, "events", bootstrap_servers=bootstrap, key="user", value="payload", workers=2
        )
    print(
        f"exported {report.records:,} rows; per partition {dict(sorted(report.per_partition.items()))}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with EmbeddedBroker() as broker:
            broker.create_topic("events", 4)
            main(broker.bootstrap)
