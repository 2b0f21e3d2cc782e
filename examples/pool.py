"""A multiprocessing pool whose processes share one producer.

python examples/pool.py [BOOTSTRAP]                 # default: an embedded broker
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import shmprod
from shmprod.broker import EmbeddedBroker


def work(chunk: range) -> int:
    """Runs in a pool process: shmprod.current() is its attachment to the producer."""
    w = shmprod.current()
    for i in chunk:
        w.send("jobs", b"result %d" % i, key=b"job-%d" % (i % 10))
    w.flush()
    return len(chunk)


def main(bootstrap: str) -> None:
    with shmprod.Producer(bootstrap_servers=bootstrap) as producer:
        ctx = mp.get_context("spawn")
        with ctx.Pool(4, initializer=shmprod.pool_initializer, initargs=(producer.handle,)) as pool:
            sent = sum(pool.map(work, [range(i, i + 1_000) for i in range(0, 8_000, 1_000)]))
            pool.close()
            pool.join()
    print(f"{sent:,} records from 4 pool processes through one producer")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with EmbeddedBroker() as broker:
            broker.create_topic("jobs", 4)
            main(broker.bootstrap)
