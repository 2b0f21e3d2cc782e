"""A worker process pays for what it uses: sending never imports pandas.

``pyarrow.array()`` imports pandas whenever pandas is installed: 0.2-0.3 s and tens of
MB in every process that sends. The first flush of each attached process used to do it,
so the first linger's worth of records waited a quarter of a second more (p99 latency of
a fresh worker at 2,000 records/s: 200 ms instead of 6 ms). Checked in a fresh
interpreter, since the test process itself has pandas loaded.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shmprod.broker import EmbeddedBroker

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
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, broker.bootstrap, topic_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
