"""Record batches handed from :func:`shmprod.export`'s caller to its pool processes in
memory, not through a pipe.

An export of a table, DataFrame or stream cuts it into batches of up to 65,536 rows and
hands each to a pool process. Pickled into the pool's call queue, a batch was copied
on every step of its way: into an Arrow IPC stream, out of it into ``bytes``, into the
pickle, through the pipe (64 KiB at a time) and out of the pickle again.

Here a batch is written once, as an Arrow IPC stream, into an anonymous memory file of
the caller's (``memfd_create``). The job carries only a :class:`SharedBatch`: the
caller's pid, the descriptor, the file's inode and size. The pool process opens the file
through ``/proc/<pid>/fd/<fd>``, checks that it is the same file (inode and size), maps
it and reads the batch in place.

Nothing is named in /dev/shm: the kernel frees a file once every process that holds or
maps it has let go, or died. A killed caller leaves nothing behind.

The caller closes a batch's descriptor when its job's result is in (:meth:`release`),
or when the export ends, after its pool has stopped (:meth:`close`): a pool process
always finds the file open. Where there is no ``memfd_create`` or no ``/proc``, or the
caller is not dumpable (:func:`available`), the export pickles the IPC stream as
before.

Runs in: the caller (:class:`SharedBatches`) and the pool processes (:func:`read`).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Final

import pyarrow as pa

__all__ = ["SUPPORTED", "SharedBatch", "SharedBatches", "available", "read"]

SUPPORTED: Final = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
_PR_GET_DUMPABLE: Final = 3
_SUID_DUMP_USER: Final = 1  # the one value that lets a process of the same user in
NAME: Final = "shmprod-export-batch"  # the file's name in /proc/<pid>/fd links
_MAP_FLAGS: Final = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def available() -> bool:
    """Whether this process can hand batches over in memory files: :data:`SUPPORTED`,
    and dumpable. The kernel lets another process of the same user open
    ``/proc/<pid>/fd/<fd>`` only of a dumpable process; one made otherwise (by
    ``prctl(PR_SET_DUMPABLE, 0)``, or a set-user-ID program) lets in only root, and its
    pool processes could not read its files. Runs in: the caller, per export."""
    if not SUPPORTED:
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == _SUID_DUMP_USER)


@dataclass(frozen=True)
class SharedBatch:
    """Where a pool process finds a batch: the caller's descriptor of its file."""

    pid: int
    fd: int
    inode: int
    size: int


class SharedBatches:
    """The caller's files of batches handed to pool processes, each open until its job's
    result is in. Runs in: the caller (one thread)."""

    def __init__(self) -> None:
        self._open: dict[int, SharedBatch] = {}  # by descriptor

    def __len__(self) -> int:
        return len(self._open)

    def share(self, batch: pa.RecordBatch) -> SharedBatch:
        """Writes ``batch`` as an Arrow IPC stream into a new memory file."""
        fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        try:
            with (
                open(fd, "wb", closefd=False) as f,  # buffered: writes all, or raises
                pa.ipc.new_stream(pa.PythonFile(f, mode="w"), batch.schema) as w,
            ):
                w.write_batch(batch)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        ref = SharedBatch(os.getpid(), fd, st.st_ino, st.st_size)
        self._open[fd] = ref
        return ref

    def release(self, ref: SharedBatch) -> None:
        """Closes a batch's file: its job has finished (a pool process that mapped it
        keeps its mapping)."""
        if self._open.get(ref.fd) == ref:
            del self._open[ref.fd]
            os.close(ref.fd)

    def close(self) -> None:
        """Closes every file still open. Call it once no pool process can start another
        job: a job whose file is closed can no longer read it."""
        while self._open:
            os.close(self._open.popitem()[0])


def read(ref: SharedBatch) -> pa.RecordBatchReader:
    """The batches of a shared file, read in place from a read-only mapping (kept while
    any of them is). Raises ``OSError`` when the file is gone or is not the one named
    (inode or size differ). Runs in: a pool process."""
    fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_ino, st.st_size) != (ref.inode, ref.size) or ref.size <= 0:
            raise OSError(
                f"descriptor {ref.fd} of process {ref.pid} is not the batch's file "
                f"(inode {st.st_ino}, {st.st_size} bytes; expected inode {ref.inode}, "
                f"{ref.size} bytes)"
            )
        m = mmap.mmap(fd, ref.size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return pa.ipc.open_stream(pa.py_buffer(m))
