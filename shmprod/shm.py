"""POSIX shared-memory segments without the resource tracker.

``multiprocessing.shared_memory`` registers every segment with the resource tracker,
which unlinks it when an *attaching* process exits (cpython #82300). shmprod opens
segments with ``shm_open`` and maps them with ``mmap`` directly: the owner creates (mode
0600, an unguessable name) and unlinks; attachers only map.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import secrets
import sys
from types import TracebackType

from shmprod.errors import ShmprodError

NAME_PREFIX = "shmprod-"
SHM_DIR = "/dev/shm"


class SharedMemoryError(ShmprodError, OSError):
    """A segment could not be created, sized, mapped or found."""


def new_name() -> str:
    """An unguessable segment name (96 random bits)."""
    return NAME_PREFIX + secrets.token_hex(12)


def free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes free in the shared-memory file system (None where there is none to ask)."""
    if not os.path.isdir(path):
        return None
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(size: int, path: str = SHM_DIR) -> None:
    """Fails clearly now, instead of with SIGBUS later, when /dev/shm cannot hold ``size``."""
    free = free_bytes(path)
    if free is not None and free < size:
        raise SharedMemoryError(
            f"{path} has {free / 2**20:.1f} MiB free but the producer's pool needs "
            f"{size / 2**20:.1f} MiB: lower buffer_memory, or give the container more "
            f"shared memory (docker run --shm-size=...)"
        )


# Every page is mapped when the segment is (Linux: MAP_POPULATE). The owner reserves and
# touches every page at creation, so this costs no memory, only page-table entries: about
# 5-10 ms for 64 MiB at attach, where faulting them in one 4 KiB page at a time as buffers
# come round cost each worker about 7,200 minor faults per 40 MB it sent (measured with
# 8 processes sending 1 KB records: 0.3 us of worker CPU per record).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class Segment:
    """One mapped shared-memory segment. ``view`` is a writable memoryview over it, with
    every page mapped from the start where the platform can (``_MAP_FLAGS``)."""

    def __init__(self, name: str, fd: int, size: int, *, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        try:
            self._mmap = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, name: str | None = None, *, pretouch: bool = True) -> Segment:
        """Creates, sizes and maps a new segment (mode 0600). Runs in: owner."""
        check_space(size)
        name = name or new_name()
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except OSError as exc:
            raise SharedMemoryError(f"cannot create shared memory {name!r}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            if sys.platform.startswith("linux"):
                # Reserve the pages now: a full /dev/shm fails here, not with SIGBUS later.
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            _unlink(name)
            raise SharedMemoryError(
                f"cannot size shared memory {name!r} to {size / 2**20:.1f} MiB: {exc}"
            ) from exc
        seg = cls(name, fd, size, owner=True)
        if pretouch:
            seg.pretouch()
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Maps an existing segment by name. Runs in: any attaching process."""
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise SharedMemoryError(
                f"shared memory {name!r} does not exist: the producer was closed or its owner died"
            ) from None
        except OSError as exc:
            raise SharedMemoryError(f"cannot open shared memory {name!r}: {exc}") from exc
        size = os.fstat(fd).st_size
        if size <= 0:
            os.close(fd)
            raise SharedMemoryError(f"shared memory {name!r} is empty")
        return cls(name, fd, size, owner=False)

    def pretouch(self) -> None:
        """Writes one byte per page so every page is backed now."""
        step = mmap.PAGESIZE
        for off in range(0, self.size, step):
            self._mmap[off] = 0

    def close(self) -> None:
        """Unmaps. Callers must have released every view they took (numpy, memoryview)."""
        if self._mmap.closed:
            return
        self.view.release()
        self._mmap.close()

    def unlink(self) -> None:
        """Removes the name; the memory goes once every process has unmapped it."""
        _unlink(self.name)

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self.owner:
            self.unlink()


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def unlink(name: str) -> None:
    """Removes a segment by name; no error if it is already gone."""
    _unlink(name)
