"""A segment is mapped with every page in place (Linux: MAP_POPULATE), so a process
writing into pool buffers takes no page fault per page as buffers come round to it."""

from __future__ import annotations

import mmap
import resource
import sys

import pytest

from shmprod import shm

SIZE = 4 << 20


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
    reason="MAP_POPULATE is Linux only",
)
def test_an_attached_segment_takes_no_fault_when_written() -> None:
    owner = shm.Segment.create(SIZE)
    try:
        attached = shm.Segment.attach(owner.name)
        try:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for off in range(0, SIZE, mmap.PAGESIZE):
                attached.view[off] = 1
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            assert faults < SIZE // mmap.PAGESIZE // 10, faults  # 1,024 pages written
            assert owner.view[SIZE - mmap.PAGESIZE] == 1  # one memory, two mappings
        finally:
            attached.close()
    finally:
        owner.close()
        owner.unlink()
