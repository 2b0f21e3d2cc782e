"""CRC-32C of a record batch after a few of its bytes change, without reading it again.

The sender rewrites producerId, producerEpoch and baseSequence of a sealed batch right
before its first send (:func:`shmprod.protocol.records.patch_producer_state`). Computing
the CRC again over the whole batch would cost a pass over every byte, and would bless
bytes that changed since the batch was checked. The CRC is affine over GF(2): for two
messages of one length, ``crc(A) ^ crc(B)`` is the register (started at 0, no final
xor) after the bytes ``A ^ B``. When only a few bytes change, that is the register after
the changed bytes, carried through the unchanged bytes after them: a product with
``x^(8 * tail)`` modulo the polynomial, in O(log tail) steps. A batch whose CRC was wrong
stays wrong.

:func:`patched` is the C function ``shmprod._speedups.crc32c_patch`` when the extension
is built, else :func:`patched_py`, its twin here (about 100 us a call). Sans-IO: ints and
bytes in, an int out. Runs in: sender.
"""

from __future__ import annotations

from collections.abc import Callable

from shmprod.native import load_speedups

__all__ = ["patched", "patched_py"]

POLY = 0x82F63B78
"""The Castagnoli polynomial, reflected (bit 31 is x^0)."""

_X0 = 1 << 31  # the polynomial 1
_X8 = 1 << 23  # x^8: one zero byte


def _mulmod(a: int, b: int) -> int:
    """a * b modulo the polynomial, both reflected."""
    product = 0
    m = _X0
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
        m >>= 1
    return product


def _register(data: bytes) -> int:
    """The register after ``data``, started at 0, without the final xor."""
    reg = 0
    for byte in data:
        reg ^= byte
        for _ in range(8):
            reg = (reg >> 1) ^ POLY if reg & 1 else reg >> 1
    return reg


def _powers() -> list[int]:
    """x^(8 * 2^k) for k in 0..63: the factors of 2^k zero bytes."""
    powers = [_X8]
    for _ in range(63):
        powers.append(_mulmod(powers[-1], powers[-1]))
    return powers


_POWERS = _powers()


def _zeros(reg: int, nbytes: int) -> int:
    """The register after ``nbytes`` zero bytes (``nbytes`` < 2^64)."""
    k = 0
    while nbytes:
        if nbytes & 1:
            reg = _mulmod(reg, _POWERS[k])
        nbytes >>= 1
        k += 1
    return reg


def _check(crc: int, tail: int) -> None:
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"a CRC-32C is 32 bits, got {crc}")
    if not 0 <= tail < 1 << 64:
        raise ValueError(f"tail must be in [0, 2^64), got {tail}")


def patched_py(crc: int, delta: bytes, tail: int) -> int:
    """The CRC of the covered bytes after ``delta`` is xored into them at a place followed
    by ``tail`` unchanged bytes, given their CRC ``crc`` before."""
    _check(crc, tail)
    return crc ^ _zeros(_register(bytes(delta)), tail)


def _load() -> Callable[[int, bytes, int], int] | None:
    module = load_speedups()
    fn: Callable[[int, bytes, int], int] | None = getattr(module, "crc32c_patch", None)
    return fn


_C_PATCH = _load()


def patched(crc: int, delta: bytes, tail: int) -> int:
    """:func:`patched_py`, in C when the extension is built."""
    if _C_PATCH is None:
        return patched_py(crc, delta, tail)
    _check(crc, tail)
    return _C_PATCH(crc, delta, tail)
