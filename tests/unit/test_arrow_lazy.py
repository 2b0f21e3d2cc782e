"""``shmprod.arrow``: pyarrow imported at its first use, not when ``send()``'s modules
load (that ``send()`` alone never imports it is checked end to end in
``tests/broker/test_footprint.py``); and the owner's modules, which load neither numpy
nor the worker's until ``Producer()`` has started its sender."""

from __future__ import annotations

import sys
import types

import pytest

from shmprod.arrow import LazyModule
from tests.support.procs import python_output


def test_a_lazy_module_imports_at_its_first_attribute_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lazy = LazyModule("shmprod_test_not_yet_there")  # nothing imported: no error yet
    real = types.ModuleType("shmprod_test_not_yet_there")
    real.answer = 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shmprod_test_not_yet_there", real)
    assert lazy.answer == 42
    assert lazy.__dict__["answer"] == 42  # copied: later reads make no call
    real.later = "added after the first read"  # type: ignore[attr-defined]
    assert lazy.later == "added after the first read"
    with pytest.raises(AttributeError):
        _ = lazy.missing


def test_a_lazy_module_of_a_missing_package_fails_at_first_use() -> None:
    lazy = LazyModule("shmprod_test_no_such_package")
    with pytest.raises(ModuleNotFoundError):
        _ = lazy.anything


def test_importing_the_send_path_leaves_arrow_unloaded() -> None:
    child = (
        "import sys; import shmprod.worker, shmprod.worker.bulk, shmprod.partitioner;"
        " from shmprod.arrow import arrow_loaded, pa;"
        " before = arrow_loaded(); t = pa.large_binary();"
        " print('LOADED', before, arrow_loaded(), t == __import__('pyarrow').large_binary())"
    )
    out = python_output(child, timeout=60)
    assert "LOADED False True True" in out, out


def test_the_owner_and_the_host_daemon_load_numpy_only_in_producer() -> None:
    """``from shmprod import Producer`` and the host daemon's module load neither the
    worker's modules nor numpy: ``Producer()`` starts the sender first and imports them
    while it starts. ``shmprod.attach`` and ``shmprod.worker.Worker`` still resolve."""
    child = (
        "import sys; from shmprod import Producer; import shmprod.host, shmprod.sweep;"
        " print('BEFORE', sorted(m for m in ('numpy', 'shmprod.worker.client')"
        " if m in sys.modules));"
        " import shmprod, shmprod.worker; from shmprod.worker.client import Worker, attach;"
        " print('AFTER', shmprod.attach is attach, shmprod.worker.Worker is Worker)"
    )
    out = python_output(child, timeout=60)
    assert "BEFORE []" in out and "AFTER True True" in out, out
