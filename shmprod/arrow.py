"""pyarrow, imported on first use.

``import pyarrow`` costs a process about 25 MB of private memory, and
``pyarrow.compute`` 9 MB more (measured with ``psutil``'s USS on Python 3.11,
pyarrow 26). A process that only calls ``Worker.send`` never needs Arrow: its common
case stages and writes records in C. The modules on ``send``'s import path take ``pa``
and ``pc`` from here instead of importing pyarrow, so Arrow loads at the first
attribute read (a ``send_batch``, an exporter, a ``send`` that needs the vectorized
encoder), once per process.

For the type checker these are the real modules: a module writes::

    if TYPE_CHECKING:
        import pyarrow as pa
    else:
        from shmprod.arrow import pa

:func:`arrow_loaded` lets a type test skip Arrow when it was never imported (no object
can then be an Arrow one). Runs in: any process (worker side; the sender never reads
them).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["LazyModule", "arrow_loaded", "pa", "pc"]


class LazyModule(types.ModuleType):
    """A stand-in for module ``name`` that imports it at its first attribute read.

    The real module's attributes are then copied in, so later reads are plain
    attribute reads with no call. A name the module gains later (a submodule such as
    ``pyarrow.parquet`` imported after) is still found: a missing name falls back to
    the module. Thread-safe: the import system locks the import, and the copy is
    idempotent."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__dict__["_lazy_name"])
        self.__dict__.update(vars(module))
        return getattr(module, attr)


def arrow_loaded() -> bool:
    """True once pyarrow was imported in this process (by anyone). Before that, no
    object can be an Arrow array, so type tests can skip loading it."""
    return "pyarrow" in sys.modules


pa: Any = LazyModule("pyarrow")
pc: Any = LazyModule("pyarrow.compute")
