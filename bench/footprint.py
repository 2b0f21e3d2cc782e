"""What each process of a producer holds besides the pool: the sender's memory and that
of an attached worker, and the optional modules they loaded.

    python bench/footprint.py            # 3 runs
    python bench/footprint.py --quick    # one run (what CI runs)

Per run a fresh embedded broker, a 12-partition topic and a producer (linger 5 ms, no
compression); two spawned worker processes (fresh interpreters that import only
shmprod) attach in turn: one sends 20,000 keyed 100 B records with ``send()``, the other
the same records with one ``send_batch`` call of numpy columns. Each reads its own
``/proc/self/smaps_rollup`` once its records are acknowledged, and the sender's is read
after both. Memory is PSS without the pool's shared pages (``Pss - Pss_Shmem``: the pool
is the same 64 MiB for every process count and counted once elsewhere) and the
anonymous part of it; MB are MiB. Medians of the runs with their lowest and highest;
JSON and markdown in ``bench/results/`` (``footprint-quick.*`` for quick runs, or
``--out``).
"""

from __future__ import annotations

# Few imports here: a spawned worker imports this file again (as ``__mp_main__``), and
# what it imports would count as the worker's own.
import multiprocessing as mp
import os
import sys
from typing import Any

TOPIC = "footprint"
PARTITIONS = 12
RECORDS = 20_000
# modules a producer of plaintext, lz4 or uncompressed batches has no use for
OPTIONAL = ("argparse", "cramjam", "difflib", "importlib.metadata", "psutil", "ssl")
PROCESSES = ("sender", "send() worker", "send_batch worker")


def rollup(pid: int | str) -> dict[str, float]:
    """PSS without the pool (``own``) and its anonymous part, MiB."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Pss_Anon", "Pss_Shmem"):
                fields[name] = int(rest.split()[0])
    return {
        "own_mb": (fields["Pss"] - fields["Pss_Shmem"]) / 1024,
        "anon_mb": fields["Pss_Anon"] / 1024,
    }


def worker(handle: Any, batch: bool, out: Any) -> None:
    """One attached process. Runs in: a fresh interpreter (spawn)."""
    from shmprod import attach

    values = [b"%0100d" % i for i in range(RECORDS)]
    keys = [b"%016d" % (i * 7919) for i in range(RECORDS)]
    with attach(handle) as w:
        if batch:
            import numpy as np

            w.send_batch(TOPIC, np.array(values), keys=np.array(keys)).result(60)
        else:
            futures = [w.send(TOPIC, v, key=k) for v, k in zip(values, keys, strict=True)]
            w.flush(60)
            for f in futures[-PARTITIONS:]:
                f.result(60)
        memory = rollup("self")
    out.put((memory, sorted(m for m in OPTIONAL if m in sys.modules)))


def measure(ctx: Any) -> dict[str, Any]:
    from suite import count_back

    from shmprod import Producer
    from shmprod.broker import embedded_broker

    run: dict[str, Any] = {}
    with embedded_broker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
            p.send(TOPIC, b"warm-up").result(60)
            for name, batch in ((PROCESSES[1], False), (PROCESSES[2], True)):
                q = ctx.Queue()
                proc = ctx.Process(target=worker, args=(p.handle, batch, q))
                proc.start()
                try:
                    memory, loaded = q.get(timeout=300)
                finally:
                    proc.join(60)
                    if proc.is_alive():
                        proc.kill()
                run[name] = dict(memory, loaded=loaded)
            sender_pid = int(p.stats()["sender"]["sender_pid"])
            with open(f"/proc/{sender_pid}/maps", encoding="utf-8") as fh:
                maps = fh.read()
            loaded = [m for m in ("_ssl", "cramjam", "psutil") if m in maps]
            run[PROCESSES[0]] = dict(rollup(sender_pid), loaded=loaded)
        landed = count_back(broker.bootstrap, 2 * RECORDS + 1, topic=TOPIC, partitions=PARTITIONS)
        if landed != 2 * RECORDS + 1:
            raise RuntimeError(f"sent {2 * RECORDS + 1:,}, the broker holds {landed:,}")
    return run


def main(argv: list[str] | None = None) -> int:
    import statistics
    import time

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from suite import bench_meta, repeat_of, runs_parser, write_json

    parser = runs_parser(__doc__, 3, 1, "runs")
    args = parser.parse_args(argv)
    repeat = repeat_of(parser, args)

    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    runs = []
    for rep in range(repeat):
        run = measure(ctx)
        runs.append(run)
        print(
            f"run {rep + 1}  "
            + "  ".join(
                f"{name}: {run[name]['own_mb']:.1f} MB ({run[name]['anon_mb']:.1f} anonymous)"
                for name in PROCESSES
            ),
            flush=True,
        )
    rows = []
    for name in PROCESSES:
        row: dict[str, Any] = {"process": name}
        for field in ("own_mb", "anon_mb"):
            xs = [r[name][field] for r in runs]
            row[field] = statistics.median(xs)
            row[field + "_low"] = min(xs)
            row[field + "_high"] = max(xs)
        row["loaded"] = sorted({m for r in runs for m in r[name]["loaded"]})
        rows.append(row)
    meta = bench_meta("footprint.py", argv, t0, records=RECORDS, repeat=repeat)
    prefix = write_json(
        args.out, "footprint", args.quick, {"meta": meta, "rows": rows, "runs": runs}
    )
    with open(prefix + ".md", "w", encoding="utf-8") as fh:
        fh.write("# What each process of a producer holds besides the pool\n\n")
        fh.write(
            f"`{meta['command']}`: {meta['cpu']}, {meta['cores']} cores; Python "
            f"{meta['python']}, shmprod {meta['shmprod']}. A fresh broker and producer a run "
            f"(linger 5 ms, no compression); one spawned worker sends {RECORDS:,} keyed "
            "100 B records with `send()`, another the same with one `send_batch` call. "
            "Memory: PSS without the pool's shared pages, MiB, and its anonymous part, "
            "read once the records are acknowledged (the sender's after both); PSS splits "
            "the interpreter's and the extensions' file pages among every process that "
            "maps them, so it moves with what else runs, the anonymous part does not. Optional "
            "modules loaded: the workers' from `sys.modules`, the sender's from the "
            "extensions it maps (`_ssl`, `cramjam`, `psutil`). Medians "
            f"of {repeat} run(s), lowest - highest in brackets. Took "
            f"{meta['elapsed_s']:.0f} s.\n\n"
        )
        fh.write(f"| process | MB | anonymous MB | loaded of {', '.join(OPTIONAL)} |\n")
        fh.write("|---|---:|---:|---|\n")
        for r in rows:
            fh.write(
                f"| {r['process']} | {r['own_mb']:.1f} ({r['own_mb_low']:.1f} - "
                f"{r['own_mb_high']:.1f}) | {r['anon_mb']:.1f} ({r['anon_mb_low']:.1f} - "
                f"{r['anon_mb_high']:.1f}) | {', '.join(r['loaded']) or 'none'} |\n"
            )
    print(f"wrote {prefix}.json and {prefix}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
