"""What a page's first touch costs on this machine: memory freed a moment ago against
memory the machine has handed back to its host.

A virtual machine with free page reporting (``/sys/module/page_reporting``) hands free
memory back to its host, and the host must find a page again before the guest's first
write to it can finish. The embedded broker's CPU is mostly page faults (about 1,080
pages first touched per MB it stores at 100 B, 4.2 times the bytes, most of them pages
its allocator gave back and took again), so a run whose broker draws on handed-back
memory pays several times as much for the same faults. The suite holds memory through
each run's set-up for that reason, with :func:`touch` (``--warm-mb`` in
``bench/suite.py``; ``bench/results/cold-memory.md``), and records what was handed back
around each run with :func:`reported_mb`.

The measurement: map and touch ``--free-mb`` of anonymous memory, let it go, wait
``--wait`` seconds (the kernel reports free memory to the host a few seconds after it
is freed), then map and touch ``--touch-mb`` in steps of ``--step-mb``, holding every
step, and time each step's first touches (CPU time of this thread, per 4 KiB page). The
first steps take pages just freed; once those are used up, pages the host took back.
Results: ``bench/results/first-touch.{json,md}`` (``--quick``: ``first-touch-quick.*``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from typing import Any

import numpy as np

PAGE = 4096
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"


def reported_mb() -> float | None:
    """MB of free memory handed back to the host so far (None: not such a machine)."""
    try:
        with open(REPORTED) as f:
            return int(f.read()) / 1024
    except (OSError, ValueError):
        return None


def touch(mb: int) -> tuple[mmap.mmap, float]:
    """``mb`` MB of fresh anonymous memory, every page written once; and the CPU
    microseconds that took per page."""
    m = mmap.mmap(-1, mb << 20)
    a = np.frombuffer(m, np.uint8)
    t0 = time.thread_time()
    a[::PAGE] = 1
    us = (time.thread_time() - t0) * 1e6 / (mb * (1 << 20) // PAGE)
    del a  # the mmap can close once no array exports its buffer
    return m, us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="less memory, fewer steps")
    parser.add_argument("--free-mb", type=int, default=None, help="MB freed first (3072)")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds after freeing")
    parser.add_argument("--touch-mb", type=int, default=None, help="MB touched after (4096)")
    parser.add_argument("--step-mb", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    free_mb = args.free_mb or (2048 if args.quick else 3072)
    touch_mb = args.touch_mb or (3072 if args.quick else 4096)

    r0 = reported_mb()
    m, first_us = touch(free_mb)
    m.close()
    time.sleep(args.wait)
    r1 = reported_mb()
    held = []
    steps: list[dict[str, Any]] = []
    for k in range(touch_mb // args.step_mb):
        m, us = touch(args.step_mb)
        held.append(m)
        steps.append({"mb_from": k * args.step_mb, "us_per_page": round(us, 2)})
        print(f"{k * args.step_mb:>6,}-{(k + 1) * args.step_mb:,} MB  {us:6.2f} us a page")
    for m in held:
        m.close()

    result = {
        "free_mb": free_mb,
        "wait_s": args.wait,
        "us_per_page_while_freeing": round(first_us, 2),
        "reported_mb_while_waiting": None if r0 is None or r1 is None else round(r1 - r0, 1),
        "steps": steps,
    }
    out = args.out or os.path.join(
        os.path.dirname(__file__),
        "results",
        "first-touch-quick.json" if args.quick else "first-touch.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    md = out.rsplit(".", 1)[0] + ".md"
    reported = result["reported_mb_while_waiting"]
    with open(md, "w", encoding="utf-8") as fh:
        fh.write(
            "# First touch of a page: memory just freed against memory handed back\n\n"
            f"{free_mb:,} MB touched and freed (the touch took "
            f"{first_us:.2f} us a page), then {args.wait:g} s waited "
            + (
                f"(the kernel handed {reported:,.0f} MB back to its host meanwhile)"
                if reported is not None
                else "(this machine does not hand memory back to a host)"
            )
            + f", then {touch_mb:,} MB touched in steps of {args.step_mb} MB, every step"
            " held. CPU time of the first touches, per 4 KiB page:\n\n"
            "| MB touched before the step | us a page |\n|---:|---:|\n"
        )
        for s in steps:
            fh.write(f"| {s['mb_from']:,} | {s['us_per_page']:.2f} |\n")
    print(f"results: {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
