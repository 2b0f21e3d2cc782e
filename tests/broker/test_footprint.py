"""A process pays for what it uses: sending never imports pandas, ``send()`` alone never
imports Arrow, the sender never imports numpy or Arrow, and neither loads modules of
options it does not use (TLS, snappy and zstd; nor psutil, ``importlib.metadata``).

``pyarrow.array()`` imports pandas whenever pandas is installed: 0.2-0.3 s and tens of
MB in every process that sends. The first flush of each attached process used to do it,
so the first linger's worth of records waited a quarter of a second more (p99 latency of
a fresh worker at 2,000 records/s: 200 ms instead of 6 ms). Checked in a fresh
interpreter, since the test process itself has pandas loaded.

A process that only calls ``send()`` (with or without headers) stages and writes its
records in C:
importing pyarrow would cost it about 17 MB of PSS (a spawned worker sending 20,000
keyed records: 48 MB against 64-66 MB) and about 80 ms of imports (``python -X importtime``:
pyarrow 34 ms, ``pyarrow.compute`` 46 ms more). The modules on that
path take Arrow from :mod:`shmprod.arrow`, which imports it at first use.

The sender only moves bytes: numpy and Arrow (with OpenBLAS and its threads) doubled its
memory (PSS 48 MB against 24 MB) when the package's names and the config check loaded
them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import textwrap
import tracemalloc
from collections.abc import Iterator

import crc32c
import numpy as np
import pyarrow as pa
import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from tests.support.procs import python_output

pytestmark = pytest.mark.broker

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import pyarrow as pa
    from shmprod import Producer, attach

    with Producer(bootstrap_servers=sys.argv[1], linger_ms=5) as p:
        w = attach(p.handle)
        for i in range(200):  # keyed records of several partitions, some with headers
            w.send(sys.argv[2], b"v%d" % i, key=b"k%d" % i,
                   headers=[("h", b"x")] if i % 3 == 0 else None)
        w.send(sys.argv[2], b"explicit", partition=1)
        w.flush(30)
        vals = pa.Array.from_buffers(
            pa.binary(), 3, [None, pa.py_buffer(np.array([0, 1, 2, 3], np.int32)),
                             pa.py_buffer(b"abc")])
        w.send_batch(sys.argv[2], vals, keys=vals).result(30)
        w.close()
    loaded = sorted(m for m in ("pandas", "pyarrow.pandas_compat") if m in sys.modules)
    print("LOADED", loaded)
    """
)


def test_sending_never_imports_pandas(broker: EmbeddedBroker, topic_name: str) -> None:
    pytest.importorskip("pandas")  # only meaningful where pandas could be imported
    broker.create_topic(topic_name, 4)
    out = python_output(_CHILD, broker.bootstrap, topic_name)
    assert "LOADED []" in out, out


# Modules a producer of plaintext, lz4 or uncompressed batches never loads: ssl (TLS
# only), cramjam (snappy, zstd), psutil (/proc is read instead), importlib.metadata and
# argparse (the crc32c package's __init__; its extension is loaded alone), difflib (the
# error for an unknown option). About 4-5 MB a process (bench/results/lean-imports.md).
OPTIONAL = ("argparse", "cramjam", "difflib", "importlib.metadata", "psutil", "ssl")

_SEND_ONLY = textwrap.dedent(
    """
    import sys
    from shmprod import Producer, attach

    OPTIONAL = {OPTIONAL}
    with Producer(bootstrap_servers=sys.argv[1], linger_ms=5) as p:
        w = attach(p.handle)
        futures = []
        for i in range(300):  # keyed, null keys, explicit partitions, timestamps, headers
            headers = [("h", b"%d" % i)] if i % 4 == 0 else {"d": "x"} if i % 6 == 1 else None
            futures.append(w.send(sys.argv[2], b"v%d" % i, key=b"k%d" % i if i % 3 else None,
                                  partition=i % 4 if i % 5 == 0 else None,
                                  timestamp_ms=1_700_000_000_000 + i if i % 7 == 0 else None,
                                  headers=headers))
        w.flush(30)
        print("SENT", sum(1 for f in futures if f.result(30).offset >= 0))
        print("BEFORE", "pyarrow" in sys.modules)
        print("OPTIONAL", sorted(m for m in OPTIONAL if m in sys.modules))
        w.send_batch(sys.argv[2], [b"a", b"b"]).result(30)
        print("AFTER", "pyarrow" in sys.modules)
        w.close()
    """
).replace("{OPTIONAL}", repr(OPTIONAL))


def test_send_alone_never_imports_arrow(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 4)
    out = python_output(_SEND_ONLY, broker.bootstrap, topic_name)
    # every record landed without Arrow; a send_batch then loads it, and works
    assert "SENT 300" in out and "BEFORE False" in out and "AFTER True" in out, out
    assert "OPTIONAL []" in out, out


def test_the_sender_modules_load_no_numpy_or_arrow() -> None:
    child = (
        "import sys; import shmprod.sender.__main__; from shmprod.config import ProducerConfig;"
        " ProducerConfig(bootstrap_servers='127.0.0.1:9', compression_type='lz4');"
        " print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'pyarrow'}));"
        f" print('OPTIONAL', sorted(m for m in {OPTIONAL!r} if m in sys.modules));"
        " print('CODECS', sorted(m for m in sys.modules if m.endswith(('.fetch',"
        " '.create_topics', '.sasl', '.sasl_exchange', '.scram'))))"
    )
    out = python_output(child, timeout=60)
    assert "LOADED []" in out and "OPTIONAL []" in out, out
    # nor the codecs of the APIs a producer without SASL never calls
    assert "CODECS []" in out, out


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/<pid>/maps")
def test_the_running_sender_maps_no_numpy_or_arrow(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 2)
    with Producer(bootstrap_servers=broker.bootstrap, compression_type="lz4") as p:
        for i in range(50):
            p.send(topic_name, b"v" * 100, key=b"k%d" % i)
        p.flush(30)
        pid = p.stats()["sender"]["sender_pid"]
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    assert "numpy" not in maps and "pyarrow" not in maps
    # nor the extensions of what it does not use: TLS, snappy/zstd, psutil
    assert "/_ssl." not in maps and "cramjam" not in maps and "psutil" not in maps, maps


class _Held:
    bytes = 0


@contextlib.contextmanager
def _traced_growth() -> Iterator[_Held]:
    """What the block allocated and still holds after a collection, as tracemalloc
    counts it (numpy's arrays included), in ``.bytes`` once the block is done."""
    held = _Held()
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield held
        gc.collect()
        held.bytes = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()


def _random_binary(rng: np.random.Generator, n: int, size: int) -> pa.Array:
    data = rng.integers(0, 256, n * size, dtype=np.uint8)
    offsets = np.arange(0, (n + 1) * size, size, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def test_resolved_send_batch_futures_keep_24_bytes_a_row(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """What a caller that keeps its ``send_batch`` futures holds once they resolved: the
    partition (4 bytes), the offset (8) and the timestamp (8) of every row, and the sort
    order of the call's rows (at most 4, int32), for calls held and written together and for
    calls written at once. A call's one timestamp is not kept per row before it is
    asked for. It was 36-44 bytes a row: every row's timestamp twice, and the order as
    int64."""
    broker.create_topic(topic_name, 4)
    rng = np.random.default_rng(7)
    calls = [(5_000, 40)] * 20 + [(40_000, 40)] * 2  # (rows, value bytes): held, then not
    columns = [(_random_binary(rng, n, size), _random_binary(rng, n, 16)) for n, size in calls]
    rows = sum(n for n, _ in calls)
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
        p.send_batch(topic_name, *columns[0]).result(30)  # warmed up
        with _traced_growth() as kept:
            futures = [p.send_batch(topic_name, v, keys=k) for v, k in columns]
            p.flush(60)
            metadata = [f.result(30) for f in futures]
        assert sum(len(m) for m in metadata) == rows
        assert (metadata[-1].offsets >= 0).all()
        assert kept.bytes / rows <= 26, f"{kept.bytes / rows:.1f} bytes a row"


def test_a_kept_send_future_pins_few_bytes_of_its_stage(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """What a caller that keeps some of its ``send`` futures holds once they resolved:
    every future points at its stage, so the stage's rows are pinned. A row keeps its
    batch and its index in it, each in the smallest type that holds them, and
    its timestamp as a run of rows with the same one. It was about 20 bytes a row: each
    timestamp in a list, the batch, the index and the partition as int32."""
    broker.create_topic(topic_name, 4)
    records = 60_000
    with Producer(bootstrap_servers=broker.bootstrap, linger_ms=5) as p:
        p.send(topic_name, b"warm-up", key=b"k").result(30)
        values = [b"%090d" % i for i in range(records)]
        keys = [b"%016d" % (i * 7919) for i in range(records)]
        with _traced_growth() as held:
            kept = [  # every 1,000th record's future, as a caller checking now and then
                f
                for i, (v, k) in enumerate(zip(values, keys, strict=True))
                if (f := p.send(topic_name, v, key=k)) is not None and i % 1_000 == 999
            ]
            p.flush(60)
            metadata = [f.result(30) for f in kept]
        assert len(metadata) == records // 1_000
        assert all(m.offset >= 0 and 0 <= m.partition < 4 for m in metadata)
        assert held.bytes / records <= 6, f"{held.bytes / records:.1f} bytes a row"


def test_a_fresh_process_checksums_without_the_package_s_other_imports() -> None:
    """The crc32c package's extension is loaded by itself: its ``__init__`` imports
    ``importlib.metadata`` and a command line (about 4 MB a process)."""
    out = python_output(
        "import sys; from shmprod.protocol import records as R;"
        " print(R.batch_crc(b'x' * 80, 0, 80),"
        " sorted(m for m in ('importlib.metadata', 'argparse', 'crc32c') if m in sys.modules))",
        timeout=60,
    )
    assert out.split(None, 1) == [str(crc32c.crc32c(b"x" * 59)), "[]\n"], out
