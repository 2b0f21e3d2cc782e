"""The CRC-32C update from changed bytes alone (shmprod.protocol.crc): the C function and
its Python twin against a full crc32c of the changed bytes, and the patch of a batch's
producer state that uses it never blessing bytes that do not match their CRC."""

from __future__ import annotations

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmprod import native, speedups
from shmprod.errors import DecodeError
from shmprod.protocol import crc
from shmprod.protocol import records as R

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _versions() -> list[object]:
    out: list[object] = [crc.patched_py]
    if speedups.ACCELERATED:
        out.append(crc.patched)
    return out


@SETTINGS
@given(st.binary(min_size=1, max_size=3000), st.data())
def test_patched_equals_a_full_crc_of_the_changed_bytes(data: bytes, draw: st.DataObject) -> None:
    at = draw.draw(st.integers(0, len(data) - 1))
    new = draw.draw(st.binary(min_size=1, max_size=len(data) - at))
    changed = data[:at] + new + data[at + len(new) :]
    delta = bytes(a ^ b for a, b in zip(data[at : at + len(new)], new, strict=True))
    tail = len(data) - at - len(new)
    want = crc32c.crc32c(changed)
    for fn in _versions():
        assert fn(crc32c.crc32c(data), delta, tail) == want  # type: ignore[operator]


@given(st.integers(0, 2**32 - 1), st.binary(max_size=20), st.integers(0, 2**40))
@SETTINGS
def test_c_and_python_agree_on_long_tails(old: int, delta: bytes, tail: int) -> None:
    assert crc.patched(old, delta, tail) == crc.patched_py(old, delta, tail)


def test_an_all_zero_delta_changes_nothing() -> None:
    for fn in _versions():
        assert fn(0xDEADBEEF, bytes(14), 10**6) == 0xDEADBEEF  # type: ignore[operator]


@pytest.mark.parametrize("fn", _versions())
@pytest.mark.parametrize(("old", "tail"), [(-1, 0), (2**32, 0), (0, -1), (0, 2**64)])
def test_out_of_range_arguments_are_refused(fn: object, old: int, tail: int) -> None:
    with pytest.raises(ValueError):
        fn(old, b"\x01", tail)  # type: ignore[operator]


@SETTINGS
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=20),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**15 - 1),
    st.integers(0, 2**31 - 1),
    st.integers(0, 10_000),
)
def test_patching_a_batch_never_blesses_bytes_that_changed(
    values: list[bytes], pid: int, epoch: int, seq: int, flip: int
) -> None:
    """A batch changed after its CRC was written still fails validation after the patch
    (recomputing the CRC over all of it would have made it pass)."""
    batch = bytearray(R.encode_batch([R.NewRecord(None, v) for v in values], base_timestamp_ms=1))
    at = R.RECORDS + flip % (len(batch) - R.RECORDS)
    batch[at] ^= 0x01
    R.patch_producer_state(batch, 0, pid, epoch, seq)
    hdr = R.read_batch_header(batch, 0)
    assert (hdr.producer_id, hdr.producer_epoch, hdr.base_sequence) == (pid, epoch, seq)
    with pytest.raises(DecodeError, match="CRC mismatch"):
        R.validate_batch(batch, 0, len(batch))
    batch[at] ^= 0x01  # undone: the patched CRC is the right one for the patched fields
    R.validate_batch(batch, 0, len(batch))


def test_validate_without_crc_reads_the_header_only() -> None:
    batch = bytearray(R.encode_batch([R.NewRecord(None, b"value")], base_timestamp_ms=1))
    batch[-1] ^= 0xFF
    with pytest.raises(DecodeError, match="CRC mismatch"):
        R.validate_batch(batch, 0, len(batch))
    assert R.validate_batch(batch, 0, len(batch), check_crc=False).record_count == 1


@SETTINGS
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_the_crc_loaded_alone_is_the_package_s(data: bytes, start: int) -> None:
    """Batches are checksummed by the crc32c package's extension loaded by itself (not
    its ``__init__``, which imports ``importlib.metadata`` and a command line)."""
    fn = native.load_crc32c()
    assert fn(data) == crc32c.crc32c(data)
    assert fn(memoryview(data), start) == crc32c.crc32c(data, start)
    assert fn(b"123456789") == 0xE3069283  # the check value of CRC-32C


def test_a_crc32c_package_of_another_layout_is_imported_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: None)
    fn = native.load_crc32c()
    assert fn is crc32c.crc32c and fn(b"123456789") == 0xE3069283
