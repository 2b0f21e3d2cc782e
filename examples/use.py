"""The README's "Use" section, runnable: one producer, a spawn pool of workers attached
by handle, send, send_batch (with its arguments) and a pandas DataFrame.

    python examples/use.py [BOOTSTRAP]     # without BOOTSTRAP: an embedded broker
"""

from __future__ import annotations

import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack

import pandas as pd

from shmprod import Handle, Producer, attach


def export_part(handle: Handle, part: int) -> int:
    """Runs in a pool process: attach by handle, send, detach."""
    with attach(handle) as w:  # close() sends what was staged, then detaches
        values = [f'{{"part": {part}, "row": {i}}}' for i in range(1000)]  # str: UTF-8
        md = w.send_batch("events", values, keys=[f"user-{i % 50}" for i in range(1000)])
        return len(md.result(timeout=30))


def main(bootstrap: str | None) -> None:
    with ExitStack() as stack:
        if bootstrap is None:
            from shmprod.broker import EmbeddedBroker

            bootstrap = stack.enter_context(EmbeddedBroker()).bootstrap
        with Producer(bootstrap_servers=bootstrap, linger_ms=5, compression_type="lz4") as p:
            # one record at a time
            fut = p.send("events", b"value", key=b"k", headers=[("source", b"use.py")])
            md = fut.result(timeout=30)  # RecordMetadata(topic, partition, offset, timestamp_ms)
            print("send:", md)

            # whole columns at once, with their optional arguments
            bmd = p.send_batch(
                "events",
                [b"a", b"b", b"c"],
                keys=[b"k1", None, b"k3"],
                partitions=[0, 1, 2],  # one int for all rows, or one per row; default: by key
                timestamps_ms=1_700_000_000_000,  # one int, or one per row; default: now
                headers=[("source", b"use.py")],  # one list for all rows, or one per row
            ).result(timeout=30)
            print("send_batch:", bmd.partitions.tolist(), bmd.offsets.tolist())

            # a pandas DataFrame: text columns as UTF-8; numbers converted explicitly
            df = pd.DataFrame({"user": [17, 42, 17], "event": ['{"a": 1}', '{"b": 2}', "{}"]})
            dmd = p.send_batch("events", df["event"], keys=df["user"].astype("string"))
            print("DataFrame rows:", len(dmd.result(timeout=30)))

            # other processes of this host: give them the handle, attach there
            with ProcessPoolExecutor(4) as pool:  # spawn, fork or forkserver alike
                sent = sum(pool.map(export_part, [p.handle] * 4, range(4)))
            print(f"{sent:,} records from 4 pool processes through one producer")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
