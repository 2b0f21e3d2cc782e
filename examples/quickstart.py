"""shmprod in one page: one producer, records from this process and from a pool.

python examples/quickstart.py            # starts an embedded broker (needs shmprod[broker])
python examples/quickstart.py HOST:PORT  # or uses yours
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import pyarrow as pa

from shmprod import Handle, Producer, attach
from shmprod.broker import EmbeddedBroker


def export_chunk(args: tuple[Handle, int]) -> int:
    """Runs in a pool worker: attach by handle, send a column, detach."""
    handle, chunk = args
    values = pa.array([f"chunk {chunk} row {i}".encode() for i in range(10_000)])
    keys = pa.array([f"user-{i % 100}".encode() for i in range(10_000)])
    with attach(handle) as worker:
        md = worker.send_batch("quickstart", values, keys=keys).result(timeout=60)
    return len(md.offsets)


def main() -> None:
    broker = None if len(sys.argv) > 1 else EmbeddedBroker().start()
    bootstrap = sys.argv[1] if broker is None else broker.bootstrap
    try:
        with Producer(bootstrap_servers=bootstrap, linger_ms=5, compression_type="lz4") as p:
            md = p.send("quickstart", b"hello", key=b"k", headers=[("h", b"v")]).result(30)
            print(f"one record: partition {md.partition}, offset {md.offset}")
            with mp.get_context("spawn").Pool(4) as pool:
                sent = sum(pool.map(export_chunk, [(p.handle, c) for c in range(8)]))
            print(f"{sent:,} records from 4 worker processes through one producer")
            print("sender:", {k: v for k, v in p.stats()["sender"].items() if "sent" in k})
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
