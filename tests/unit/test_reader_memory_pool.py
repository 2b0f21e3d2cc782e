"""What ``shmprod.export``'s processes read with: jemalloc as Arrow's memory pool
(``reader_memory_pool``), configured at their start to keep the memory it frees
(``jemalloc_conf_for_children``), so that each job's new buffers reuse the last job's
pages. Counted as page faults, not timed. A configuration the user set is kept, and the
caller's environment is as it was afterwards. Each case runs a fresh interpreter:
jemalloc reads its configuration once, as pyarrow loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pytest

from shmprod.exporter import JEMALLOC_CONF, JEMALLOC_CONF_VAR, jemalloc_conf_for_children

pytestmark = pytest.mark.skipif(
    "jemalloc" not in pa.supported_memory_backends(), reason="pyarrow without jemalloc"
)

# 40 reads of 10 MB, each written through and dropped: the page faults they took
_READS = """
import os, resource
from shmprod.exporter import reader_memory_pool
reader_memory_pool()
import pyarrow as pa
pool = pa.default_memory_pool()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    buf = pa.allocate_buffer(10 << 20)
    view = memoryview(buf).cast("B")
    view[::4096] = b"x" * len(range(0, len(view), 4096))
    del view, buf
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(pool.backend_name, os.environ.get("JE_ARROW_MALLOC_CONF", "-"), faults)
"""


def _child() -> tuple[str, str, int]:
    """A process started from this one (its environment inherited) runs the reads."""
    out = subprocess.run(
        [sys.executable, "-c", _READS], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return out[0], out[1], int(out[2])


@pytest.fixture
def no_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JEMALLOC_CONF_VAR, raising=False)


def test_children_started_inside_reuse_their_pages(no_conf: None) -> None:
    with jemalloc_conf_for_children():
        backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", JEMALLOC_CONF)
    # 40 x 10 MB is 102,400 pages: given back after each read, every one faults again
    assert faults < 20_000
    assert JEMALLOC_CONF_VAR not in os.environ  # the caller's environment as it was


def test_children_started_outside_give_pages_back(no_conf: None) -> None:
    """Without it, pyarrow's jemalloc returns freed pages: what the export avoids."""
    backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", "-")
    assert faults > 80_000


def test_a_configuration_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JEMALLOC_CONF_VAR, "dirty_decay_ms:0,muzzy_decay_ms:0")
    with jemalloc_conf_for_children():
        backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", "dirty_decay_ms:0,muzzy_decay_ms:0")
    assert faults > 80_000  # given back at once, as the user asked
    assert os.environ[JEMALLOC_CONF_VAR] == "dirty_decay_ms:0,muzzy_decay_ms:0"
