"""Optional dependencies, imported when a feature needs them, with the extra to install.

``require("pyspark", "spark")`` imports pyspark or raises :class:`MissingExtraError`
(an ``ImportError``) that says ``pip install 'shmprod[spark]'``.

Runs in: any process.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ImportError):
    """An optional dependency of the feature is not installed."""


def require(module: str, extra: str) -> ModuleType:
    """``module``, imported; MissingExtraError naming the extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the module is there; something it imports is broken: say that
        raise MissingExtraError(
            f"{module} is not installed: this needs shmprod's {extra!r} extra, "
            f"pip install 'shmprod[{extra}]'",
            name=module,
        ) from exc
