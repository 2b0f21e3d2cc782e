"""Checking what a caller passes to ``send`` before anything touches shared memory.

Each check raises :class:`InvalidRecordError` naming what was wrong, so a bad record fails
at the call with nothing half-written. Explicit partitions are checked by
:func:`shmprod.partitioner.check_partition`.

Runs in: worker (pure functions, no shared state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from shmprod.config import Serializer
from shmprod.errors import EncodeError, InvalidRecordError
from shmprod.protocol import values
from shmprod.protocol.records import encode_headers

__all__ = [
    "NO_HEADERS",
    "as_bytes",
    "check_timestamp",
    "encoded_headers",
    "serialize",
    "serialized",
]

Blob = values.Blob

NO_HEADERS: Final = b"\x00"  # the headers section of a record without headers
_INT64_MAX: Final = 2**63 - 1


def as_bytes(obj: object, what: str) -> Blob | None:
    """``obj`` by the key/value input rule (:mod:`shmprod.protocol.values`): bytes-like
    as is, str as UTF-8, None; :class:`InvalidRecordError` naming the type otherwise."""
    try:
        return values.as_bytes(obj, what)
    except EncodeError as exc:
        raise InvalidRecordError(str(exc)) from None


def serialize(fn: Serializer, obj: object, what: str) -> object:
    """What the configured serializer makes of ``obj`` (checked by the caller, as a key
    or value named ``serialized(what)``); InvalidRecordError when it raises."""
    try:
        return fn(obj)
    except Exception as exc:
        raise InvalidRecordError(
            f"{what}_serializer failed on {type(obj).__name__}: {exc}"
        ) from exc


def serialized(what: str) -> str:
    """How errors name a key or value a serializer made."""
    return f"{what} (from {what}_serializer)"


def encoded_headers(headers: object) -> bytes:
    """The headers section of a record: a list of (str, bytes | None) pairs or a dict
    str -> bytes | None; :class:`InvalidRecordError` for anything else."""
    if headers is None:
        return NO_HEADERS
    items: Sequence[Any]
    if isinstance(headers, Mapping):
        items = list(headers.items())
    elif isinstance(headers, list | tuple):
        items = headers
    else:
        raise InvalidRecordError(
            f"headers must be a list of (str, bytes | None) pairs or a dict, "
            f"got {type(headers).__name__}"
        )
    if not items:
        return NO_HEADERS
    try:
        return encode_headers(items)
    except EncodeError as exc:
        raise InvalidRecordError(f"bad headers: {exc}") from None


def check_timestamp(ts: object) -> int:
    """A record timestamp: an int (milliseconds since the epoch) in [0, 2**63)."""
    if isinstance(ts, bool) or not isinstance(ts, int | np.integer):
        raise InvalidRecordError(
            f"timestamp_ms must be an int (milliseconds) or None, got {type(ts).__name__}"
        )
    t = int(ts)
    if not 0 <= t <= _INT64_MAX:
        raise InvalidRecordError(f"timestamp_ms must be in [0, 2**63), got {t}")
    return t
