"""Why a producer cannot be reached: what a worker tells its caller.

The segment HEADER records the producer's state and the identities (pid + start time)
of its owner and its sender, so a worker whose control connection ended, or that cannot
attach, names what actually happened instead of a generic "closed or died":

* the owner closed it (``STATE_CLOSED``/``STATE_CLOSING``): :class:`ProducerClosedError`;
* the owner process is gone: :class:`OwnerDiedError`;
* the sender process is gone: :class:`SenderDiedError` (with its pid);
* the producer failed (``STATE_FAILED``): the error of the code it recorded.

Runs in: worker (reads the HEADER only; no lock: single aligned fields).
"""

from __future__ import annotations

import time

from shmprod import layout as L
from shmprod.errors import (
    OwnerDiedError,
    ProducerClosedError,
    ProducerError,
    SenderDiedError,
    ShmprodError,
    error_from_code,
)
from shmprod.ipc import process_state

__all__ = ["alive", "cause_after_break", "cause_from_header", "cause_without_segment"]

_DYING_S = 0.5  # how long a broken connection waits for a dying process to show


def alive(pid: int, start_us: int = 0) -> bool:
    """Whether process ``pid`` runs (and, given its start time, is still that process)."""
    if pid <= 0:
        return False
    found = process_state(pid)
    if found is None or found[0] == "Z":
        return False
    started = found[1]  # 0: not readable here, taken as running
    # a start time that differs: the pid was reused by another process
    return not start_us or not started or abs(started - start_us) <= 1_000_000


def cause_from_header(view: memoryview) -> ShmprodError:
    """The error that says why the producer of this segment cannot be reached."""
    state = L.U32.unpack_from(view, L.H_STATE)[0]
    owner = int(L.U64.unpack_from(view, L.H_OWNER_PID)[0])
    owner_start = int(L.U64.unpack_from(view, L.H_OWNER_START_US)[0])
    sender = int(L.U64.unpack_from(view, L.H_SENDER_PID)[0])
    sender_start = int(L.U64.unpack_from(view, L.H_SENDER_START_US)[0])
    if state in (L.STATE_CLOSED, L.STATE_CLOSING):
        return ProducerClosedError("the producer was closed by its owner")
    if state == L.STATE_FAILED:
        code = int(L.I32.unpack_from(view, L.H_FATAL_CODE)[0])
        if code:
            return error_from_code(code, "the producer failed")
    if not alive(owner, owner_start):
        return OwnerDiedError(f"the process that created the producer (pid {owner}) died")
    if sender and not alive(sender, sender_start):
        return SenderDiedError(
            f"the producer's sender process (pid {sender}) died: the producer cannot send "
            "any more; its owner must create a new Producer"
        )
    return ProducerError("the producer's control connection ended")


def cause_after_break(view: memoryview, wait_s: float = _DYING_S) -> ShmprodError:
    """:func:`cause_from_header` once a connection broke. A SIGKILLed process closes its
    sockets before it is a zombie, so a producer that still looks alive is looked at
    again for up to ``wait_s`` (the generic ProducerError when nothing shows)."""
    cause = cause_from_header(view)
    deadline = time.monotonic() + wait_s
    while type(cause) is ProducerError and time.monotonic() < deadline:
        time.sleep(0.01)
        cause = cause_from_header(view)
    return cause


def cause_without_segment(owner_pid: int) -> ShmprodError:
    """The error for a producer whose segment is gone (it is removed at close)."""
    if alive(owner_pid):
        return ProducerClosedError(
            f"the producer is closed (its owner is pid {owner_pid}): its shared memory was removed"
        )
    return OwnerDiedError(
        f"the process that created the producer (pid {owner_pid}) is gone, and its shared "
        "memory with it"
    )
