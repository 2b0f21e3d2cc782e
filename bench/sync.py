"""What the synchronisation choices cost on this machine (ARCHITECTURE.md, "ownership").

Times, per operation: a process-local ``threading.Lock`` pair (what a ``send`` takes), a
``multiprocessing.Lock`` pair, an ``fcntl`` record-lock pair on a shared-memory file
(the crash-safe cross-process lock a shared open batch would need per append), one
control message through a UNIX socket pair (what a batch hand-over costs), and a
100-byte copy into shared memory. Results: ``bench/results/sync.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable

from shmprod import ipc
from shmprod.shm import Segment


def per_op_ns(fn: Callable[[], None], n: int) -> float:
    """Best of three runs of ``n`` calls, in nanoseconds per call."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else 200_000
    results: dict[str, float] = {}

    tlock = threading.Lock()

    def thread_lock() -> None:
        tlock.acquire()
        tlock.release()

    results["threading.Lock acquire+release"] = per_op_ns(thread_lock, n)

    mlock = multiprocessing.Lock()

    def mp_lock() -> None:
        mlock.acquire()
        mlock.release()

    results["multiprocessing.Lock acquire+release"] = per_op_ns(mp_lock, n)

    seg = Segment.create(1 << 20, pretouch=False)
    try:
        fd = os.open(f"/dev/shm/{seg.name}", os.O_RDWR)
        try:

            def fcntl_lock() -> None:
                fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)

            results["fcntl record lock + unlock"] = per_op_ns(fcntl_lock, n)
        finally:
            os.close(fd)
        payload = bytes(100)

        def copy() -> None:
            seg.view[4096:4196] = payload

        results["100-byte copy into shared memory"] = per_op_ns(copy, n)
    finally:
        seg.close()
        seg.unlink()

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    msg = ipc.encode(ipc.Sealed(1, 1, 2, 3, 4096, 40))
    reader = ipc.MessageReader()
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            data = b.recv(65536)
            if not data:
                return
            b.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()

    def round_trip() -> None:
        a.sendall(msg)
        got: list[ipc.Message] = []
        while not got:
            got = reader.feed(a.recv(65536))

    results["control message round trip (UNIX socket, encode+decode)"] = per_op_ns(
        round_trip, n // 10
    )
    stop.set()
    a.close()
    t.join(5)
    b.close()

    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", "sync-quick.json" if args.quick else "sync.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({k: round(v, 1) for k, v in results.items()}, fh, indent=2)
    md = out.rsplit(".", 1)[0] + ".md"
    with open(md, "w", encoding="utf-8") as fh:
        fh.write("# Cost of synchronisation primitives\n\n| operation | ns |\n|---|---:|\n")
        for k, v in results.items():
            fh.write(f"| {k} | {v:,.0f} |\n")
    for k, v in results.items():
        print(f"{k:<60} {v:>10,.0f} ns")
    print(f"results: {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
