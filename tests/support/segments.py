"""A plain bytearray "segment" for the sender's logic without processes: its
SharedState, and a STATS counter read back as a reader in another process would."""

from __future__ import annotations

from shmprod import layout as L
from shmprod.sender.shmstate import SharedState


def shared(n_buffers: int = 8) -> SharedState:
    geo = L.Geometry(
        n_buffers=n_buffers, buffer_size=1024, max_workers=4, max_topics=4, max_partitions=16
    )
    return SharedState(memoryview(bytearray(geo.segment_size)), geo)


def stat(s: SharedState, field: int) -> int:
    return int(L.U64.unpack_from(s.view, s.geo.stats + field)[0])
