"""The sender's lifecycle (:class:`Lifecycle`: its phase, the state workers read and its
exit status), and the process-level facts the loop needs: who is alive, and what to
remove when the owner is gone.

Phases: BOOTSTRAP (until metadata, and the producer id when idempotent, arrived), RUNNING,
CLOSING (the owner's ``Shutdown``: queued batches are still sent until its deadline),
ENDED (an exit status is set; the loop stops). Every transition writes H_STATE, so a
worker reads the same story the sender acts on.

Exit statuses of ``python -m shmprod.sender``:

- 0 (:data:`EXIT_OK`): clean shutdown after the owner's ``Shutdown``.
- 1 (:data:`EXIT_CRASHED`): an unexpected error; every worker got ``Fatal``.
- 2 (:data:`EXIT_BOOTSTRAP_FAILED`): no broker reachable (or no producer id) within
  ``max_block_ms``; the owner got ``Ready(error, message)``.
- 3 (:data:`EXIT_OWNER_DIED`): the owner died; workers got ``Fatal(OwnerDiedError)``
  and the sender removed the segment, the socket file and its directory.
- 4 (:data:`EXIT_FAILED`): a broker refused TLS or SASL after the start; every worker
  got ``Fatal`` with its error.
- 64 (:data:`EXIT_USAGE`): bad command line (not a SenderSpec).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from shmprod import layout as L
from shmprod import shm
from shmprod.ipc import process_start_us

if TYPE_CHECKING:
    from shmprod.sender.shmstate import SharedState

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_BOOTSTRAP_FAILED = 2
EXIT_OWNER_DIED = 3
EXIT_FAILED = 4
EXIT_USAGE = 64


class Phase(Enum):
    BOOTSTRAP = "bootstrap"
    RUNNING = "running"
    CLOSING = "closing"
    ENDED = "ended"


class Lifecycle:
    """The one home of the sender's phase, H_STATE and exit status. Runs in: sender."""

    __slots__ = ("_shared", "exit_status", "phase")

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared
        self.phase = Phase.BOOTSTRAP
        self.exit_status: int | None = None

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    def to_running(self) -> None:
        """Bootstrap done: workers may send."""
        assert self.phase is Phase.BOOTSTRAP, self.phase
        self.phase = Phase.RUNNING
        self._shared.set_state(L.STATE_RUNNING)

    def to_closing(self) -> None:
        """The owner's Shutdown: no new grants; what is queued is still sent."""
        assert self.phase in (Phase.BOOTSTRAP, Phase.RUNNING), self.phase
        self.phase = Phase.CLOSING
        self._shared.set_state(L.STATE_CLOSING)

    def to_ended(self, state: int, code: int, exit_status: int) -> None:
        """The end: H_STATE ``state`` (STATE_CLOSED, or STATE_FAILED with ``code``
        written first), and the exit status the loop returns."""
        assert state in (L.STATE_CLOSED, L.STATE_FAILED), state
        self._shared.set_state(state, code if state == L.STATE_FAILED else 0)
        self.phase = Phase.ENDED
        self.exit_status = exit_status


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
    empty: nothing else is ever removed). Runs in: sender, when the owner died or
    after its Shutdown (the owner's own removal then finds them gone)."""
    shm.unlink(segment)
    with contextlib.suppress(OSError):
        os.unlink(socket_path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(socket_path))


def wall_us() -> int:
    return time.time_ns() // 1000
