"""Files of producers whose processes are all dead: found and removed.

A producer's owner removes its shared-memory segment and control-socket directory at
``close()``; when only the owner dies, the sender does. When both are killed (SIGKILL of
the sender, then of the owner), nobody does: the segment (tens of MiB of /dev/shm) and
the directory stay for good. :func:`sweep` finds them -- segments of this user named
``shmprod-*`` whose HEADER names an owner and a sender (pid + start time) that are both
gone -- and removes them with their directory (``socket_dir(segment)``). It runs at
every ``Producer()`` start; ``shmprod cleanup`` runs it for operators (``--dry-run``
lists only). A segment that is not a readable shmprod segment, belongs to another user,
or has a live owner or sender is never touched.

Runs in: the owner (at ``Producer()``) or the ``shmprod cleanup`` command.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass

from shmprod import layout as L
from shmprod import shm
from shmprod.worker.cause import alive

__all__ = ["Stale", "socket_dir", "sweep"]


def socket_dir(segment: str) -> str:
    """The private directory (mode 0700) of a producer's control socket: named after its
    segment (96 random bits), so a sweep finds one from the other."""
    return os.path.join(tempfile.gettempdir(), segment)


@dataclass(frozen=True)
class Stale:
    """A producer's leftover files."""

    segment: str
    size: int
    directory: str | None  # its socket directory, if there is one
    owner_pid: int
    sender_pid: int


def _header(path: str) -> bytes | None:
    """The HEADER of a segment file, or None when it is not one to read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_size < L.HEADER_SIZE:
            return None
        with mmap.mmap(fd, L.HEADER_SIZE, prot=mmap.PROT_READ) as m:
            return bytes(m[: L.HEADER_SIZE])
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def find_stale(shm_dir: str = shm.SHM_DIR) -> list[Stale]:
    """Producers of this user whose owner and sender processes are both gone."""
    out: list[Stale] = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    for name in names:
        if not name.startswith(shm.NAME_PREFIX):
            continue
        raw = _header(os.path.join(shm_dir, name))
        if raw is None or raw[L.H_MAGIC : L.H_MAGIC + len(L.MAGIC)] != L.MAGIC:
            continue
        view = memoryview(raw)
        owner = int(L.U64.unpack_from(view, L.H_OWNER_PID)[0])
        owner_start = int(L.U64.unpack_from(view, L.H_OWNER_START_US)[0])
        sender = int(L.U64.unpack_from(view, L.H_SENDER_PID)[0])
        sender_start = int(L.U64.unpack_from(view, L.H_SENDER_START_US)[0])
        if owner <= 0 or alive(owner, owner_start) or (sender and alive(sender, sender_start)):
            continue  # no owner named yet: its owner is writing the header
        directory = socket_dir(name)
        size = 0
        with contextlib.suppress(OSError):
            size = os.stat(os.path.join(shm_dir, name)).st_size
        out.append(
            Stale(name, size, directory if os.path.isdir(directory) else None, owner, sender)
        )
    return out


def sweep(*, dry_run: bool = False, shm_dir: str = shm.SHM_DIR) -> list[Stale]:
    """Removes (unless ``dry_run``) the files of every stale producer; returns them."""
    stale = find_stale(shm_dir)
    if not dry_run:
        for s in stale:
            shm.unlink(s.segment)
            if s.directory is not None and os.stat(s.directory).st_uid == os.getuid():
                shutil.rmtree(s.directory, ignore_errors=True)
    return stale
