"""The names of the built-in partitioners, checked without loading them: the sender
validates a configuration without importing :mod:`shmprod.partitioner` (numpy, Arrow),
which makes the partitioners these names stand for.

Runs in: any process.
"""

from __future__ import annotations

from typing import Final

from shmprod.errors import ConfigError

__all__ = ["PARTITIONER_NAMES", "check_partitioner_name"]

PARTITIONER_NAMES: Final = ("murmur2", "murmur2_random", "round_robin")
"""The built-in partitioners (shmprod.partitioner makes them)."""


def check_partitioner_name(name: str) -> None:
    """ConfigError unless ``name`` is a built-in partitioner."""
    if name not in PARTITIONER_NAMES:
        raise ConfigError(
            f"unknown partitioner {name!r}; expected one of {', '.join(PARTITIONER_NAMES)} "
            "or a callable (key, num_partitions) -> partition"
        )
