"""What a producer costs to start and to end, in a fresh process: shmprod's `Producer()`
(the shared-memory pool, the sender process and its connection) against
confluent-kafka's.

    python bench/start.py            # 10 runs of each, interleaved
    python bench/start.py --quick    # 3 runs of each (what CI runs)

One embedded broker and a 12-partition topic for the whole invocation. Each run is a
fresh interpreter (`python bench/start.py --child NAME ...`) that times the client's
imports, its producer built (`Producer(...)` returned), its first record acknowledged
(one keyed 100 B record, `send(...).result()` / `produce` and `flush`), its close
(`close()` / `flush()` and the producer dropped), and the whole process from its first
line to the close; then a second producer built and its first record acknowledged in
the same process ("again": the modules loaded, and numpy's OpenBLAS threads, which spin
for about 0.1 s after numpy loads in a process without `OPENBLAS_NUM_THREADS=1`,
quiet). Both clients run with acks=all, idempotence on and linger 5 ms. The CPU is the
process's and its children's (shmprod's sender) up to the first close, from
`getrusage`. Runs of the two clients alternate; medians with the lowest and highest
run. JSON and markdown in ``bench/results/`` (``start-quick.*`` for quick runs, or
``--out``). The topic is read back: it must hold exactly the records acknowledged.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.perf_counter()  # the process's first line (see child())

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

TOPIC = "start"
PARTITIONS = 12
CLIENTS = ("shmprod", "confluent-kafka")
PHASES = (
    "import_ms",
    "built_ms",
    "first_ack_ms",
    "close_ms",
    "total_ms",
    "cpu_ms",
    "again_built_ms",
    "again_first_ack_ms",
)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def _cpu_ms() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1e3 * (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime)


def _produce_one(client: str, bootstrap: str) -> tuple[float, float, float]:
    """Builds a producer, has one record acknowledged, closes it: ms to build, to the
    acknowledgement (from the constructor) and of the close."""
    value, key = b"v" * 100, b"k" * 16
    if client == "shmprod":
        from shmprod import Producer

        t = time.perf_counter()
        p = Producer(bootstrap_servers=bootstrap, linger_ms=5)
        built = _ms(t)
        p.send(TOPIC, value, key=key).result(60)
        first = _ms(t)
        t_close = time.perf_counter()
        p.close()
    elif client == "confluent-kafka":
        from confluent_kafka import KafkaError
        from confluent_kafka import Producer as CKProducer

        t = time.perf_counter()
        ck = CKProducer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 5,
            }
        )
        built = _ms(t)
        errors: list[KafkaError] = []
        ck.produce(TOPIC, value, key, on_delivery=lambda err, _m: err and errors.append(err))
        if ck.flush(60) != 0 or errors:
            raise RuntimeError(f"confluent-kafka: not delivered ({errors})")
        first = _ms(t)
        t_close = time.perf_counter()
        ck.flush(60)
        del ck
    else:
        raise ValueError(f"unknown client {client!r}")
    return built, first, _ms(t_close)


def child(client: str, bootstrap: str) -> dict[str, float]:
    """One run: times a producer's start, first acknowledgement and close, then a second
    producer's in the same process (its modules loaded, numpy's OpenBLAS threads, which
    spin for about 0.1 s after numpy loads, quiet). Runs in: a fresh interpreter
    (``total_ms`` from this file's first line)."""
    t_import = time.perf_counter()
    if client == "shmprod":
        from shmprod import Producer  # noqa: F401
    else:
        from confluent_kafka import Producer as _
    imported = _ms(t_import)
    built, first, closed = _produce_one(client, bootstrap)
    total, cpu = _ms(T0), _cpu_ms()
    again_built, again_first, _ = _produce_one(client, bootstrap)
    return {
        "import_ms": imported,
        "built_ms": built,
        "first_ack_ms": first,
        "close_ms": closed,
        "total_ms": total,
        "cpu_ms": cpu,
        "again_built_ms": again_built,
        "again_first_ack_ms": again_first,
    }


def run_child(client: str, bootstrap: str) -> dict[str, float]:
    """Runs :func:`child` in a fresh interpreter and returns what it measured."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", client, bootstrap],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{client} run failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--child"]:
        print(json.dumps(child(args_list[1], args_list[2])))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from suite import bench_meta, count_back, installed_version, repeat_of, runs_parser, write_json

    from shmprod.broker import embedded_broker

    parser = runs_parser(__doc__, 10, 3, "runs of each client")
    args = parser.parse_args(args_list)
    repeat = repeat_of(parser, args)

    t0 = time.monotonic()
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CLIENTS}
    with embedded_broker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        for rep in range(repeat):
            order = CLIENTS if rep % 2 == 0 else CLIENTS[::-1]
            for client in order:
                r = run_child(client, broker.bootstrap)
                runs[client].append(r)
                print(
                    f"run {rep + 1} {client}: "
                    + "  ".join(f"{k[:-3]} {r[k]:.0f} ms" for k in PHASES),
                    flush=True,
                )
        sent = 2 * len(CLIENTS) * repeat
        landed = count_back(broker.bootstrap, sent, topic=TOPIC, partitions=PARTITIONS)
        if landed != sent:
            raise RuntimeError(f"sent {sent}, the broker holds {landed}")
    rows = []
    for client in CLIENTS:
        row: dict[str, Any] = {"client": client}
        for phase in PHASES:
            xs = [r[phase] for r in runs[client]]
            row[phase] = statistics.median(xs)
            row[phase + "_low"] = min(xs)
            row[phase + "_high"] = max(xs)
        rows.append(row)
    meta = bench_meta(
        "start.py",
        args_list,
        t0,
        confluent_kafka=installed_version("confluent-kafka"),
        repeat=repeat,
    )
    prefix = write_json(args.out, "start", args.quick, {"meta": meta, "rows": rows, "runs": runs})
    with open(prefix + ".md", "w", encoding="utf-8") as fh:
        fh.write("# A producer's start and end, in a fresh process\n\n")
        fh.write(
            f"`{meta['command']}`: {meta['cpu']}, {meta['cores']} cores; Python "
            f"{meta['python']}, shmprod {meta['shmprod']}, confluent-kafka "
            f"{meta['confluent_kafka']}. One embedded broker, a {PARTITIONS}-partition "
            "topic; each run a fresh interpreter that imports the client, builds a "
            "producer (acks=all, idempotence on, linger 5 ms), has one keyed 100 B "
            "record acknowledged and closes the producer, then builds a second and has "
            "one record acknowledged again. ms of the client's imports, from the "
            "producer's constructor (built, first ack), of the close, and from the "
            "process's first line to the close (whole process); CPU of the process and "
            "its children (shmprod's sender) to the first close; again: the second "
            "producer's, its modules loaded and numpy's OpenBLAS threads quiet. Medians "
            f"of {repeat} run(s) of each client, interleaved, lowest - highest in "
            f"brackets. Took {meta['elapsed_s']:.0f} s.\n\n"
        )
        fh.write(
            "| client | imports ms | built ms | first ack ms | close ms | whole process ms "
            "| CPU ms | again: built ms | again: first ack ms |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        )
        for r in rows:
            cells = " | ".join(
                f"{r[p]:.0f} ({r[p + '_low']:.0f} - {r[p + '_high']:.0f})" for p in PHASES
            )
            fh.write(f"| {r['client']} | {cells} |\n")
    print(f"wrote {prefix}.json and {prefix}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
