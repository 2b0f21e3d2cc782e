"""Where the C extension ``shmprod._speedups`` is loaded, once for every module that
uses it (the worker's staging, the sender's CRC patch).

``SHMPROD_PURE_PYTHON=1`` (any value but empty or 0) leaves it unloaded: every caller
then runs its Python twin (the tests run both). Runs in: any process, at import.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load_speedups"]


def load_speedups() -> ModuleType | None:
    """The extension module, or None when it is not built or is turned off."""
    if os.environ.get("SHMPROD_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module("shmprod._speedups")
    except ImportError:
        return None
