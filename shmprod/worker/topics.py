"""The worker's cache of the shared metadata table (TOPIC slots written by the sender).

A worker asks for a topic once (``TopicRequest``); the sender fetches its metadata,
writes a TOPIC slot and answers ``TopicInfo``. The worker then caches topic ->
(slot, partitions, first PARTITION slot) and, on every call, compares
``H_METADATA_EPOCH`` with the epoch it last saw: when the sender changed the table the
cached slots are read again (a partition count change moves a topic to a new range).
Pushed ``TopicInfo`` (request id 0) also refresh a cached topic.

A partition is always addressed by its HOME slot (``P_HOME`` of its slot in the topic's
range: see :mod:`shmprod.layout`), never by ``base + partition`` directly: after the
topic grows, the partitions it had keep their first slot, so this process keeps
appending to the same open batch and its batches of a partition stay in order.

Topic names are checked here first, with Kafka's rules: 1-249 characters of
``[a-zA-Z0-9._-]``, and not ``.`` or ``..`` (:class:`InvalidTopicError`).

Runs in: worker. Every method expects the caller to hold the Worker's state lock
(one process-local lock; the TOPIC slots themselves are written by the sender only).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from shmprod import layout as L
from shmprod.errors import (
    InvalidTopicError,
    MetadataTimeoutError,
    ShmprodError,
    error_from_code,
)
from shmprod.ipc import TopicInfo, TopicRequest
from shmprod.partitioner import RandomSource, StickyPartitioner

__all__ = ["TopicEntry", "TopicTable", "validate_topic"]

_LEGAL: Final = re.compile(r"[A-Za-z0-9._-]{1,249}")


def validate_topic(name: object) -> str:
    """``name`` as a plain ``str`` if Kafka accepts it as a topic name, else
    :class:`InvalidTopicError`. A ``str`` subclass comes back as a plain copy, so no
    user ``__eq__`` or ``__hash__`` runs where topics are looked up (the C stager looks
    a topic up in the stages while it stages a row)."""
    if not isinstance(name, str):
        raise InvalidTopicError(f"topic must be a str, got {type(name).__name__}")
    if _LEGAL.fullmatch(name) is None or name in (".", ".."):
        if not name:
            raise InvalidTopicError("topic name is empty")
        if len(name) > L.MAX_TOPIC_NAME:
            raise InvalidTopicError(
                f"topic name of {len(name)} characters is longer than {L.MAX_TOPIC_NAME}"
            )
        raise InvalidTopicError(
            f"topic name {name!r} is not legal: use 1-249 of [a-zA-Z0-9._-], not '.' or '..'"
        )
    return name if type(name) is str else str.__str__(name)


@dataclass(slots=True)
class TopicEntry:
    """One cached topic: its TOPIC slot and the home PARTITION slot of each partition
    (``slots[p]``; ``slot_array`` the same as numpy int32 for ``send_batch``).

    ``sticky`` is this process's null-key partitioner for the topic; ``next_bulk`` the
    partition the next ``send_batch`` of null-key rows starts at.
    """

    name: str
    slot: int
    partitions: int
    slots: list[int]
    sticky: StickyPartitioner
    next_bulk: int = field(default=-1)
    slot_array: npt.NDArray[np.int32] = field(init=False)

    def __post_init__(self) -> None:
        self.slot_array = np.array(self.slots, np.int32)

    def partition_slot(self, partition: int) -> int:
        return self.slots[partition]


@dataclass(slots=True)
class _Pending:
    request_id: int
    error: ShmprodError | None = None
    answered: bool = False


class TopicTable:
    """Topic name -> :class:`TopicEntry`, over the TOPIC slots of one segment."""

    def __init__(
        self,
        view: memoryview,
        geo: L.Geometry,
        batch_size: int,
        rand: RandomSource,
    ) -> None:
        self._view = view
        self._geo = geo
        self._batch_size = batch_size
        self._rand = rand
        self.entries: dict[str, TopicEntry] = {}
        self._pending: dict[str, _Pending] = {}
        self._by_request: dict[int, str] = {}
        self.epoch = self.read_epoch()

    def read_epoch(self) -> int:
        """H_METADATA_EPOCH. Runs in: worker; no lock (one aligned 8-byte read)."""
        epoch: int = L.U64.unpack_from(self._view, L.H_METADATA_EPOCH)[0]
        return epoch

    def read_slot(self, slot: int, name: str) -> tuple[int, list[int]] | None:
        """(partitions, home slot of each partition) of TOPIC ``slot`` if it is READY and
        names ``name`` with a range inside the table; None otherwise.

        Runs in: worker (the sender writes slots under a seqlock: the epoch is odd while
        it writes, so an odd epoch, or one that changed while reading, is retried, a
        bounded number of times).
        """
        geo = self._geo
        if not 0 <= slot < geo.max_topics:
            return None
        off = geo.topic(slot)
        view = self._view
        for attempt in range(1000):
            before = self.read_epoch()
            if before % 2:  # the sender is writing the table (seqlock): read again
                time.sleep(0 if attempt < 100 else 0.001)
                continue
            state = L.U32.unpack_from(view, off + L.T_STATE)[0]
            n = L.U32.unpack_from(view, off + L.T_N_PARTITIONS)[0]
            base = L.U32.unpack_from(view, off + L.T_PARTITION_BASE)[0]
            name_len = L.U16.unpack_from(view, off + L.T_NAME_LEN)[0]
            raw = bytes(view[off + L.T_NAME : off + L.T_NAME + min(name_len, L.MAX_TOPIC_NAME)])
            homes: list[int] = []
            if state == L.TOPIC_READY and n >= 1 and base + n <= geo.max_partitions:
                homes = [
                    L.U32.unpack_from(view, geo.partition(base + i) + L.P_HOME)[0] for i in range(n)
                ]
            if self.read_epoch() == before:
                break
        else:
            return None
        if state != L.TOPIC_READY or n < 1 or base + n > geo.max_partitions:
            return None
        if raw != name.encode("utf-8", "replace"):
            return None
        if any(h >= geo.max_partitions for h in homes):
            return None
        return n, homes

    def check_epoch(self) -> None:
        """Re-reads every cached slot when the sender changed the table. Runs in: worker."""
        epoch = self.read_epoch()
        if epoch == self.epoch:
            return
        self.epoch = epoch
        for name, entry in list(self.entries.items()):
            got = self.read_slot(entry.slot, name)
            if got is None:
                del self.entries[name]  # asked again on next use
            else:
                self._update(entry, *got)

    def _update(self, entry: TopicEntry, partitions: int, slots: list[int]) -> None:
        if partitions != entry.partitions:
            entry.sticky.state.partition = -1  # choose again among the new partitions
            entry.next_bulk = -1
        entry.partitions = partitions
        if slots != entry.slots:
            entry.slots = slots
            entry.slot_array = np.array(slots, np.int32)

    def get(
        self,
        name: str,
        wait: Callable[[float], None],
        send: Callable[[TopicRequest], None],
        next_request_id: Callable[[], int],
        check_alive: Callable[[], None],
        max_block_ms: int,
    ) -> TopicEntry:
        """The cached entry for ``name``, asking the sender first if needed.

        Waits with ``wait(seconds)`` (the Worker's wait over its state lock, held by the
        caller) for the ``TopicInfo`` answer at most ``max_block_ms``; raises
        :class:`MetadataTimeoutError`, the sender's error for the topic, or whatever
        ``check_alive`` raises (producer closed, sender died). Runs in: worker.
        """
        self.check_epoch()
        entry = self.entries.get(name)
        if entry is not None:
            return entry
        validate_topic(name)
        deadline = time.monotonic() + max_block_ms / 1000.0
        while True:
            check_alive()
            entry = self.entries.get(name)
            if entry is not None:
                return entry
            pending = self._pending.get(name)
            if pending is None:
                rid = next_request_id()
                pending = self._pending[name] = _Pending(rid)
                self._by_request[rid] = name
                send(TopicRequest(rid, name))
            elif pending.answered:
                del self._pending[name]
                self._by_request.pop(pending.request_id, None)
                if pending.error is not None:
                    raise pending.error
                continue  # answered without an entry: ask again
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MetadataTimeoutError(
                    f"metadata for topic {name!r} not available within max_block_ms={max_block_ms}"
                )
            wait(remaining)

    def on_info(self, info: TopicInfo) -> bool:
        """Applies a ``TopicInfo`` (an answer, or a push with request id 0).

        Returns True when a waiter should be woken. Runs in: worker I/O thread.
        """
        name = self._by_request.pop(info.request_id, None) if info.request_id else None
        if name is None:
            name = info.name
        pending = self._pending.get(name)
        if info.error != 0:
            if pending is not None:
                pending.answered = True
                pending.error = error_from_code(
                    info.error, f"metadata for topic {name!r}: sender answered error"
                )
                return True
            self.entries.pop(name, None)
            return False
        got = self.read_slot(info.topic_slot, name)
        entry = self.entries.get(name)
        if got is None:
            if pending is not None:
                pending.answered = True
            return pending is not None
        partitions, slots = got
        if entry is None:
            sticky = StickyPartitioner(self._batch_size, self._rand)
            self.entries[name] = TopicEntry(name, info.topic_slot, partitions, slots, sticky)
        else:
            entry.slot = info.topic_slot
            self._update(entry, partitions, slots)
        if pending is not None:
            pending.answered = True
        return True

    def forget_pending(self) -> None:
        """Drops unanswered requests (the sender is gone). Runs in: worker."""
        self._pending.clear()
        self._by_request.clear()
