"""What ``shmprod.export``'s processes start with (``pool_environment``): jemalloc as
Arrow's memory pool (``reader_memory_pool``), configured to keep the memory it frees, so
that each job's new buffers reuse the last job's pages (counted as page faults, not
timed); and numpy's OpenBLAS without threads of its own (counted as threads). A value
the user set is kept, and the caller's environment is as it was afterwards. Each case
runs a fresh interpreter: both are read once, as the libraries load. And how they end:
at once, with their output flushed (``_end_at_exit``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pytest

from shmprod.exporter import (
    JEMALLOC_CONF,
    JEMALLOC_CONF_VAR,
    OPENBLAS_THREADS_VAR,
    pool_environment,
)

needs_jemalloc = pytest.mark.skipif(
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


def _words(script: str) -> list[str]:
    """What ``script`` prints, run by a process started from this one (its environment
    inherited)."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()


def _child() -> tuple[str, str, int]:
    """The reads, in a process started from this one."""
    out = _words(_READS)
    return out[0], out[1], int(out[2])


@pytest.fixture
def no_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JEMALLOC_CONF_VAR, raising=False)
    monkeypatch.delenv(OPENBLAS_THREADS_VAR, raising=False)


@needs_jemalloc
def test_children_started_inside_reuse_their_pages(no_conf: None) -> None:
    with pool_environment():
        backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", JEMALLOC_CONF)
    # 40 x 10 MB is 102,400 pages: given back after each read, every one faults again
    assert faults < 20_000
    assert JEMALLOC_CONF_VAR not in os.environ  # the caller's environment as it was


@needs_jemalloc
def test_children_started_outside_give_pages_back(no_conf: None) -> None:
    """Without it, pyarrow's jemalloc returns freed pages: what the export avoids."""
    backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", "-")
    assert faults > 80_000


@needs_jemalloc
def test_a_configuration_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JEMALLOC_CONF_VAR, "dirty_decay_ms:0,muzzy_decay_ms:0")
    with pool_environment():
        backend, conf, faults = _child()
    assert (backend, conf) == ("jemalloc", "dirty_decay_ms:0,muzzy_decay_ms:0")
    assert faults > 80_000  # given back at once, as the user asked
    assert os.environ[JEMALLOC_CONF_VAR] == "dirty_decay_ms:0,muzzy_decay_ms:0"


# the threads a process has once numpy is imported, and what OpenBLAS was told
_THREADS = """
import os
import numpy
with open("/proc/self/status") as f:
    threads = next(line.split()[1] for line in f if line.startswith("Threads:"))
print(threads, os.environ.get("OPENBLAS_NUM_THREADS", "-"))
"""


def _threads() -> tuple[int, str]:
    out = _words(_THREADS)
    return int(out[0]), out[1]


def test_children_started_inside_import_numpy_without_blas_threads(no_conf: None) -> None:
    with pool_environment():
        threads, conf = _threads()
    assert (threads, conf) == (1, "1")
    assert OPENBLAS_THREADS_VAR not in os.environ  # the caller's environment as it was
    if len(os.sched_getaffinity(0)) > 1:  # outside, OpenBLAS starts one per extra core
        assert _threads()[0] > 1


def test_blas_threads_the_user_set_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPENBLAS_THREADS_VAR, "2")
    with pool_environment():
        _, conf = _threads()
    assert conf == "2"
    assert os.environ[OPENBLAS_THREADS_VAR] == "2"


# a pool process's end: output still buffered, a log line, a handler that must run
# (registered after, so run before), one that must not (registered before: what the
# interpreter's finalization stands for), then the exit
_END = """
import atexit, logging, sys
from shmprod.exporter import _end_at_exit
atexit.register(lambda: print("finalized"))
atexit.register(_end_at_exit)
atexit.register(lambda: print("detached"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
logging.getLogger("x").info("logged")
sys.stdout.write("buffered")
raise SystemExit(0)
"""


def test_a_pool_process_ends_at_once_with_its_output_flushed() -> None:
    out = subprocess.run([sys.executable, "-c", _END], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert out.stdout == "buffereddetached\n"
    assert out.stderr == "logged\n"
