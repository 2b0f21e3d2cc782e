"""The sweep of dead producers' files never takes a segment whose owner is still
writing its header: two producers starting at once on one host (each sweeps at start)
must not remove each other's segment."""

from __future__ import annotations

import os
from pathlib import Path

from shmprod import layout as L
from shmprod import shm
from shmprod.sweep import find_stale

_GEO = L.Geometry(n_buffers=4, buffer_size=4096, max_workers=4, max_topics=4, max_partitions=4)


def _segment(directory: Path, header: bytes) -> str:
    name = shm.NAME_PREFIX + os.urandom(6).hex()
    (directory / name).write_bytes(header.ljust(L.HEADER_SIZE, b"\0"))
    return name


def _header(owner_pid: int, owner_start_us: int) -> bytes:
    buf = bytearray(L.HEADER_SIZE)
    L.write_header(memoryview(buf), _GEO, owner_pid, owner_start_us)
    return bytes(buf)


def test_a_header_being_written_is_never_stale(tmp_path: Path) -> None:
    """Magic but no owner yet (another process mid-``write_header``): not swept. A
    complete header of a dead owner (pid that cannot exist) is."""
    being_written = bytearray(L.HEADER_SIZE)
    being_written[L.H_MAGIC : L.H_MAGIC + len(L.MAGIC)] = L.MAGIC
    young = _segment(tmp_path, bytes(being_written))
    dead = _segment(tmp_path, _header(2**22 + 12345, 1))
    stale = {s.segment for s in find_stale(str(tmp_path))}
    assert young not in stale
    assert dead in stale


def test_write_header_writes_the_magic_last() -> None:
    """When the magic lands, the owner's pid and start time are already there."""
    seen: list[tuple[int, int]] = []

    class Recording(bytearray):
        # struct.pack_into writes through the buffer protocol; only the magic's slice
        # assignment comes here, so this sees the header as it is right before it
        def __setitem__(self, key: object, value: object) -> None:
            owner = L.U64.unpack_from(self, L.H_OWNER_PID)[0]
            start = L.U64.unpack_from(self, L.H_OWNER_START_US)[0]
            seen.append((owner, start))
            super().__setitem__(key, value)  # type: ignore[index]

    buf = Recording(L.HEADER_SIZE)
    L.write_header(buf, _GEO, 4242, 99)  # type: ignore[arg-type]
    assert seen == [(4242, 99)]
    assert bytes(buf[L.H_MAGIC : L.H_MAGIC + len(L.MAGIC)]) == L.MAGIC
