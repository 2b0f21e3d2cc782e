"""What a process holds for the ``send`` futures it keeps: its memory growth a record,
and its CPU and rate, keeping none of its futures or some.

    python bench/kept_futures.py            # 2,000,000 records a run, 3 interleaved runs
    python bench/kept_futures.py --quick    # 1,000,000 records, one run each (what CI runs)

One attached process (a fresh interpreter) sends 100 B values, with 16-byte random keys
or null keys, to a 12-partition topic on a fresh embedded broker per run, linger 5 ms, no
compression (every run read back and counted), and either keeps none of the futures ``send`` returns or the last of every
2,048 records (as the suite's ``send`` kind does, and as a caller that checks now and
then would). A ``send`` future points at its stage, so one kept future pins what its
stage keeps for all its rows. The process builds its records first and frees nothing
before the clock, so its heap has no freed memory to reuse and its resident anonymous
memory (``RssAnon``) grows by what the producer keeps. Medians of the runs with their
lowest and highest; JSON and markdown in ``bench/results/`` (``kept-futures-quick.*``
for quick runs, or ``--out``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite import bench_meta, count_back, write_json

KEEP_EVERY = 2048
TOPIC = "kept"
PARTITIONS = 12


def _rss_anon_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def worker(handle: Any, records: int, keyed: bool, keep: bool, out: Any) -> None:
    """One run's sending process. Runs in: a fresh interpreter (forkserver)."""
    from shmprod import attach

    rnd = random.Random(7)
    values = [rnd.randbytes(100) for _ in range(records)]
    keys: list[bytes | None] = (
        [rnd.randbytes(16) for _ in range(records)] if keyed else [None] * records
    )
    w = attach(handle)
    w.send(TOPIC, b"warm-up").result(60)
    anon0 = _rss_anon_bytes()
    c0, t0 = time.process_time(), time.perf_counter()
    send = w.send
    kept = []
    last = None
    for start in range(0, records, KEEP_EVERY):
        for i in range(start, min(start + KEEP_EVERY, records)):
            last = send(TOPIC, values[i], key=keys[i])
        if keep:
            kept.append(last)
    w.flush(600)
    assert last is not None
    last.result(600)  # every record acknowledged (one partition's order, the rest flushed)
    for f in kept:
        f.result(600)
    c1, t1 = time.process_time(), time.perf_counter()
    grown = _rss_anon_bytes() - anon0
    result_ns = None  # what result() of a done future costs: the middle of five passes
    if kept:
        passes = []
        for _ in range(5):
            r0 = time.perf_counter()
            for f in kept:
                f.result()
            passes.append((time.perf_counter() - r0) / len(kept) * 1e9)
        result_ns = statistics.median(passes)
    out.put(
        {
            "anon_bytes_per_record": grown / records,
            "cpu_ns_per_record": (c1 - c0) / records * 1e9,
            "records_per_s": records / (t1 - t0),
            "result_ns": result_ns,
            "kept": len(kept),
        }
    )
    w.close()


def measure(ctx: Any, records: int, keyed: bool, keep: bool) -> dict[str, Any]:
    from shmprod import Producer
    from shmprod.broker import embedded_broker

    with embedded_broker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
            p.send(TOPIC, b"warm-up").result(60)
            q = ctx.Queue()
            proc = ctx.Process(target=worker, args=(p.handle, records, keyed, keep, q))
            proc.start()
            try:
                r: dict[str, Any] = q.get(timeout=600)
            finally:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
        warm = 2  # the owner's and the worker's
        landed = count_back(broker.bootstrap, records + warm, topic=TOPIC, partitions=PARTITIONS)
        if landed - warm != records:
            raise RuntimeError(f"sent {records:,}, the broker holds {landed - warm:,}")
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000,000 records, one run each")
    parser.add_argument("--repeat", type=int, default=None, help="interleaved runs (3; quick: 1)")
    parser.add_argument("--records", type=int, default=None, help="records a run")
    parser.add_argument("--out", default=None, help="path prefix of the JSON and markdown")
    args = parser.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    records = args.records or (1_000_000 if args.quick else 2_000_000)
    if repeat < 1 or records < KEEP_EVERY:
        parser.error(f"--repeat must be at least 1 and --records at least {KEEP_EVERY}")

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "shmprod"])
    cells = [(keyed, keep) for keyed in (True, False) for keep in (False, True)]
    t0 = time.monotonic()
    runs: dict[tuple[bool, bool], list[dict[str, Any]]] = {}
    for rep in range(repeat):
        for keyed, keep in cells if rep % 2 == 0 else cells[::-1]:  # alternate the order
            r = measure(ctx, records, keyed, keep)
            runs.setdefault((keyed, keep), []).append(r)
            print(
                f"run {rep + 1} {'keyed' if keyed else 'null keys':<9} "
                f"{'every 2,048th future kept' if keep else 'no future kept':<25} "
                f"{r['anon_bytes_per_record']:6.1f} B/record  "
                f"{r['cpu_ns_per_record']:5.0f} ns CPU/record  "
                f"{r['records_per_s'] / 1e6:5.2f} M records/s"
                + (f"  result() {r['result_ns']:4.0f} ns" if r["result_ns"] else ""),
                flush=True,
            )
    rows = []
    for (keyed, keep), rs in runs.items():
        row: dict[str, Any] = {"keyed": keyed, "keep_every": KEEP_EVERY if keep else 0}
        names = ["anon_bytes_per_record", "cpu_ns_per_record", "records_per_s"]
        for name in names + (["result_ns"] if keep else []):  # result(): only when kept
            xs = [r[name] for r in rs]
            row[name] = statistics.median(xs)
            row[name + "_low"] = min(xs)
            row[name + "_high"] = max(xs)
        row["runs"] = rs
        rows.append(row)
    meta = bench_meta("kept_futures.py", argv, t0, records=records, repeat=repeat)
    prefix = write_json(args.out, "kept-futures", args.quick, {"meta": meta, "rows": rows})
    with open(prefix + ".md", "w", encoding="utf-8") as fh:
        fh.write("# What a process holds for the send futures it keeps\n\n")
        fh.write(
            f"`{meta['command']}`: {meta['cpu']}, {meta['cores']} cores; shmprod "
            f"{meta['shmprod']}. One attached process sends {records:,} records of 100 B "
            "(16-byte random keys or null keys) to 12 partitions, linger 5 ms, no "
            "compression, a fresh broker per run; memory is the growth of its resident "
            "anonymous memory over the run. Medians of "
            f"{repeat} interleaved run(s), lowest - highest in brackets. Took "
            f"{meta['elapsed_s'] / 60:.0f} min.\n\n"
        )
        fh.write("| keys | futures kept | bytes a record | CPU ns a record | M records/s |\n")
        fh.write("|---|---|---:|---:|---:|\n")
        for r in rows:
            fh.write(
                f"| {'keyed' if r['keyed'] else 'null'} | "
                f"{'every 2,048th' if r['keep_every'] else 'none'} | "
                f"{r['anon_bytes_per_record']:.1f} ({r['anon_bytes_per_record_low']:.1f} - "
                f"{r['anon_bytes_per_record_high']:.1f}) | "
                f"{r['cpu_ns_per_record']:.0f} ({r['cpu_ns_per_record_low']:.0f} - "
                f"{r['cpu_ns_per_record_high']:.0f}) | "
                f"{r['records_per_s'] / 1e6:.2f} ({r['records_per_s_low'] / 1e6:.2f} - "
                f"{r['records_per_s_high'] / 1e6:.2f}) |\n"
            )
        fh.write(
            "\nWhat the kept futures pin, the median growth with every 2,048th future kept "
            "less the median with none kept: "
        )
        by = {(r["keyed"], bool(r["keep_every"])): r["anon_bytes_per_record"] for r in rows}
        fh.write(
            ", ".join(
                f"{by[(keyed, True)] - by[(keyed, False)]:.1f} bytes a record "
                f"{'keyed' if keyed else 'with null keys'}"
                for keyed in (True, False)
            )
            + ".\n"
        )
        fh.write(
            "\n`result()` of a done kept future (the middle of five passes over them, after "
            "the clock): "
            + ", ".join(
                f"{r['result_ns']:.0f} ns ({r['result_ns_low']:.0f} - {r['result_ns_high']:.0f}) "
                f"{'keyed' if r['keyed'] else 'with null keys'}"
                for r in rows
                if r["keep_every"]
            )
            + ".\n"
        )
    print(f"wrote {prefix}.json and {prefix}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
