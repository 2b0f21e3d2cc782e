"""The worker side of the shared producer: ``attach(handle)`` -> :class:`Worker`.

Any process on the host that holds a :class:`~shmprod.handle.Handle` attaches, encodes
its records straight into pool buffers in shared memory and hands sealed batches to the
sender process; futures resolve in the process that sent.

Modules: :mod:`.client` (the Worker's public API: attach, send, send_batch, flush,
close, stats, fork and exit hooks), :mod:`.core` (state lock, buffers, batches, the
control-socket I/O thread), :mod:`.append` (open batches, seal), :mod:`.bulk` (``send_batch``,
vectorized), :mod:`.topics` (metadata cache, topic names), :mod:`.inputs` (argument
checks), :mod:`.shmstats` (counters read from shared memory).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shmprod.worker.client import Worker, attach

__all__ = ["Worker", "attach"]


def __getattr__(name: str) -> object:
    """``Worker`` and ``attach`` load the worker's modules (and numpy) at first use, so a
    module that needs only a light part of this package (``cause``, ``shmstats``) does
    not load them, nor does the owner before its sender is started (``Producer``)."""
    if name in __all__:
        from shmprod.worker import client

        found = getattr(client, name)
        globals()[name] = found
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
