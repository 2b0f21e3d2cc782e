"""Where the C extensions are loaded: ``shmprod._speedups``, once for every module that
uses it (the worker's staging, the sender's CRC patch), and the ``crc32c`` package's CRC.

``SHMPROD_PURE_PYTHON=1`` (any value but empty or 0) leaves it unloaded: every caller
then runs its Python twin (the tests run both). Runs in: any process, at import.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

__all__ = ["load_crc32c", "load_speedups"]


def load_speedups() -> ModuleType | None:
    """The extension module, or None when it is not built or is turned off."""
    if os.environ.get("SHMPROD_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module("shmprod._speedups")
    except ImportError:
        return None


def load_crc32c() -> Callable[..., int]:
    """``crc32c.crc32c`` (data, value=0) -> the CRC-32C, from the package's extension.

    The extension module is loaded by itself: the package's ``__init__`` imports
    ``importlib.metadata`` (for its version) and its command line, about 4 MB of modules
    in every process that writes or checks a batch (the sender, each worker). Any other
    layout of the package falls back to importing it whole.
    """
    try:
        package = importlib.util.find_spec("crc32c")
        places = package.submodule_search_locations if package is not None else None
        if not places:
            raise ImportError("crc32c is not a package")
        name = "crc32c._crc32c"
        module = sys.modules.get(name)
        if module is None:
            finder = importlib.machinery.FileFinder(
                places[0],
                (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
            )
            spec = finder.find_spec(name)
            if spec is None or spec.loader is None:
                raise ImportError(f"no {name} extension in {places[0]}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module  # the package, if imported later, takes this one
        function: Callable[..., int] = module.crc32c
        return function
    except (ImportError, AttributeError):
        import crc32c

        whole: Callable[..., int] = crc32c.crc32c
        return whole
