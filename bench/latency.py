"""Send-to-acknowledgement latency at a moderate rate, by linger: shmprod against
confluent-kafka.

    python bench/latency.py            # linger 0 and 5 ms, 5 s a run, 3 interleaved runs
    python bench/latency.py --quick    # 2 s a run, one run each (what CI runs)

One process sends 2,000 records a second (100 B values, 16-byte random keys, no
compression, acks=all, idempotence on) to a 12-partition topic on a fresh embedded broker
per run, and times each record from the call to its acknowledgement (a done callback;
every record must be acknowledged): ``shmprod send`` through a producer of its host,
``confluent-kafka produce`` with ``poll`` while it waits. The suite measures the same at
linger 5 ms only; at linger 0 what remains is each client's own path to the broker and
back. Medians of the runs' p50 and p99 with their lowest and highest; JSON and markdown
in ``bench/results/`` (``latency-quick.*`` for quick runs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite import bench_meta, installed_version, measure_latency, write_json

KINDS = ("shmprod send", "confluent-kafka produce")
RATE = 2000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s a run, one run each")
    parser.add_argument("--repeat", type=int, default=None, help="interleaved runs (3; quick: 1)")
    parser.add_argument("--lingers", default="0,5", help="linger_ms values, comma-separated")
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    seconds = 2.0 if args.quick else 5.0
    lingers = [float(x) for x in args.lingers.split(",")]
    if repeat < 1 or any(x < 0 for x in lingers):
        parser.error("--repeat must be at least 1 and every linger at least 0")

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "pyarrow", "_peers", "shmprod", "confluent_kafka"])
    t0 = time.monotonic()
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for rep in range(repeat):
        for linger in lingers:
            kinds = KINDS if rep % 2 == 0 else KINDS[::-1]  # alternate who goes first
            for kind in kinds:
                r = measure_latency(ctx, kind, RATE, seconds, linger)
                runs.setdefault((linger, kind), []).append(r)
                print(
                    f"run {rep + 1} linger {linger:g} ms {kind:<24} "
                    f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms",
                    flush=True,
                )
    rows = []
    for (linger, kind), rs in runs.items():
        p50s = [r["p50"] for r in rs]
        p99s = [r["p99"] for r in rs]
        rows.append(
            {
                "linger_ms": linger,
                "kind": kind,
                "p50_ms": statistics.median(p50s),
                "p50_low": min(p50s),
                "p50_high": max(p50s),
                "p99_ms": statistics.median(p99s),
                "p99_low": min(p99s),
                "p99_high": max(p99s),
                "runs": rs,
            }
        )
    meta = bench_meta(
        "latency.py",
        argv,
        t0,
        confluent_kafka=installed_version("confluent-kafka"),
        rate=RATE,
        seconds=seconds,
        repeat=repeat,
    )
    prefix = write_json(None, "latency", args.quick, {"meta": meta, "rows": rows})
    with open(prefix + ".md", "w", encoding="utf-8") as fh:
        fh.write("# Send-to-acknowledgement latency by linger\n\n")
        fh.write(
            f"`{meta['command']}`: {meta['cpu']}, {meta['cores']} cores; shmprod "
            f"{meta['shmprod']}, confluent-kafka {meta['confluent_kafka']}. One process, "
            f"{RATE:,} records/s of 100 B with 16 B keys for {seconds:g} s, no "
            "compression, acks=all, idempotence on, 12 partitions, a fresh broker per "
            f"run; medians of {repeat} interleaved run(s), lowest - highest in brackets. "
            f"Took {meta['elapsed_s'] / 60:.0f} min.\n\n"
        )
        fh.write("| linger ms | producer | p50 ms | p99 ms | p99 vs confluent |\n")
        fh.write("|---:|---|---:|---:|---:|\n")
        base = {r["linger_ms"]: r["p99_ms"] for r in rows if r["kind"] == KINDS[1]}
        for r in sorted(rows, key=lambda r: (r["linger_ms"], r["kind"] != KINDS[0])):
            ratio = r["p99_ms"] / base[r["linger_ms"]] if base.get(r["linger_ms"]) else None
            fh.write(
                f"| {r['linger_ms']:g} | {r['kind']} | {r['p50_ms']:.2f} "
                f"({r['p50_low']:.2f} - {r['p50_high']:.2f}) | {r['p99_ms']:.2f} "
                f"({r['p99_low']:.2f} - {r['p99_high']:.2f}) | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} |\n"
            )
    print(f"results: {prefix}.json and .md ({meta['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
