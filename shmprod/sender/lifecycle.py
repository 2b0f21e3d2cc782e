"""Process-level facts the loop needs: who is alive, and what to remove when the owner
is gone.

Exit statuses of ``python -m shmprod.sender``:

- 0 (:data:`EXIT_OK`): clean shutdown after the owner's ``Shutdown``.
- 1 (:data:`EXIT_CRASHED`): an unexpected error; every worker got ``Fatal``.
- 2 (:data:`EXIT_BOOTSTRAP_FAILED`): no broker reachable (or no producer id) within
  ``max_block_ms``; the owner got ``Ready(error, message)``.
- 3 (:data:`EXIT_OWNER_DIED`): the owner died; workers got ``Fatal(OwnerDiedError)``
  and the sender removed the segment, the socket file and its directory.
- 64 (:data:`EXIT_USAGE`): bad command line (not a SenderSpec).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from shmprod import shm
from shmprod.ipc import process_start_us

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_BOOTSTRAP_FAILED = 2
EXIT_OWNER_DIED = 3
EXIT_USAGE = 64


def owner_watch(owner_pid: int, owner_start_us: int) -> Callable[[], bool]:
    """A cheap "is the owner alive?" check.

    The sender is normally the owner's child: then the owner is alive exactly while
    ``getppid()`` is still its pid (a dead parent reparents us). Otherwise fall back to
    the pid plus its start time (tolerance 1 s; pid reuse within the same second with
    the same pid is not a practical risk).
    """
    if os.getppid() == owner_pid:
        return lambda: os.getppid() == owner_pid

    def alive() -> bool:
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        if not owner_start_us:
            return True
        started = process_start_us(owner_pid)
        return started == 0 or abs(started - owner_start_us) < 1_000_000

    return alive


def remove_producer_files(segment: str, socket_path: str) -> None:
    """Unlinks the segment, the control socket file and its private directory (only if
    empty: nothing else is ever removed). Runs in: sender, when the owner died."""
    shm.unlink(segment)
    with contextlib.suppress(OSError):
        os.unlink(socket_path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(socket_path))


def wall_us() -> int:
    return time.time_ns() // 1000
