"""A pandas DataFrame to Kafka in one call, from a pool of processes sharing one producer.

python examples/export_dataframe.py [BOOTSTRAP]     # default: an embedded broker
"""

from __future__ import annotations

import sys

import pandas as pd

import shmprod
from shmprod.broker import EmbeddedBroker


def main(bootstrap: str) -> None:
    df = pd.DataFrame(
        {
            "user": [f"user-{i % 50}" for i in range(10_000)],
            "amount": [i * 0.5 for i in range(10_000)],
            "at": pd.date_range("2026-01-01", periods=10_000, freq="s"),
        }
    )
    report = shmprod.export(
        df,
        "orders",
        bootstrap_servers=bootstrap,
        key="user",
        value="json",
        timestamp="at",
        workers=2,
        compression_type="lz4",
    )
    print(f"exported {report.records:,} rows in {report.seconds:.2f}s")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with EmbeddedBroker() as broker:
            broker.create_topic("orders", 4)
            main(broker.bootstrap)
