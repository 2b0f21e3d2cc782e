"""What one record key or value may be, and its bytes.

The input rule of every key, value and header value, for ``send`` and ``send_batch``
alike (:mod:`shmprod.protocol.columns` applies it to whole columns):

* **bytes-like** (``bytes``, ``bytearray``, or a buffer of single bytes: a ``memoryview``
  of format ``B``, a numpy ``uint8`` array): the bytes as they are;
* **str**: its UTF-8 encoding (as confluent-kafka does);
* **None**: null.

Anything else is refused with :class:`EncodeError` naming the type (or dtype) and how to
convert it. Nothing is ever reinterpreted: an int is not its machine bytes, and a buffer
of numbers (``memoryview(array('i', ...))``, a numpy ``int8`` array, a numpy int scalar)
is not bytes.

Runs in: any process (pure functions; no numpy or pyarrow import: the sender uses it).
"""

from __future__ import annotations

from typing import Final

from shmprod.errors import EncodeError

__all__ = ["BYTE_FORMATS", "Blob", "as_bytes", "describe", "frozen"]

Blob = bytes | bytearray | memoryview
BYTE_FORMATS: Final = frozenset({"B", "c"})  # buffer formats of single bytes (not "b": int8)


def _fix(what: str) -> str:
    if what in ("key", "value"):
        return f"encode it (for numbers e.g. str(x).encode()) or set {what}_serializer"
    return "encode it (for numbers e.g. str(x).encode())"


def as_bytes(obj: object, what: str) -> Blob | None:
    """One key or value by the rule above: bytes-like as is, str as UTF-8, None as
    null; :class:`EncodeError` for anything else."""
    if obj is None:
        return None
    if isinstance(obj, bytes | bytearray):
        return obj
    if isinstance(obj, str):
        try:
            return obj.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates
            raise EncodeError(f"{what} is a str that is not valid UTF-8: {exc}") from None
    if getattr(obj, "ndim", None) == 0 and hasattr(obj, "dtype"):
        # a numpy scalar; datetime64 and timedelta64 ones export their 8 machine bytes
        # as a buffer of format "B", so the format check below would let them through
        raise EncodeError(
            f"{what} must be bytes, str or None, got {describe(obj)} (a single value, not "
            f"a byte string): {_fix(what)}"
        )
    try:
        mv = obj if isinstance(obj, memoryview) else memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise EncodeError(
            f"{what} must be bytes, str or None, got {describe(obj)}: {_fix(what)}"
        ) from None
    if mv.format not in BYTE_FORMATS or mv.itemsize != 1:
        raise EncodeError(
            f"{what} must be bytes, str or None, got {describe(obj)} (a buffer of "
            f"{mv.format!r} items, not bytes): {_fix(what)}"
        )
    if mv.ndim == 0:  # a numpy scalar such as np.uint8(5): a number, not a byte string
        raise EncodeError(
            f"{what} must be bytes, str or None, got {describe(obj)} (a single number): "
            f"{_fix(what)}"
        )
    if not mv.c_contiguous:
        raise EncodeError(f"{what} must be a C-contiguous buffer")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def frozen(b: Blob | None) -> bytes | None:
    """``b`` as immutable bytes (a copy unless it is bytes already): what is kept past
    the call that received it, so a caller who reuses a buffer cannot change it."""
    return b if b is None or type(b) is bytes else bytes(b)


def describe(obj: object) -> str:
    """The type of ``obj`` for an error message (with its dtype, for numpy and pandas)."""
    dtype = getattr(obj, "dtype", None)
    name = type(obj).__name__
    return f"{name} of dtype {dtype}" if dtype is not None else name
