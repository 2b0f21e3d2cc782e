"""The control-plane codec: every message round-trips; malformed bytes raise IpcError only."""

from __future__ import annotations

import contextlib
import random

import pytest

from shmprod import ipc

MESSAGES: list[ipc.Message] = [
    ipc.Hello(b"s" * ipc.SECRET_SIZE, 42, 123456, True),
    ipc.Welcome(3),
    ipc.Alloc(1, 2, 3),
    ipc.Grant(1, 2, 0, (5, 9)),
    ipc.Sealed(5, 1, 7, 99, 4096, 12),
    ipc.Release(1, (5,)),
    ipc.TopicRequest(4, "tópico"),
    ipc.TopicInfo(4, 2, 6, 0, "tópico"),
    ipc.Done(99, 0, 1000, -1, False, ""),
    ipc.DoneSplit(
        99,
        (ipc.Piece(0, 3, 0, 1000, -1, False), ipc.Piece(3, 4, 10, -1, -1, False)),
        "MESSAGE_TOO_LARGE",
    ),
    ipc.Fatal(-1001, "gone"),
    ipc.Bye(),
    ipc.Shutdown(500),
    ipc.Ready(0, ""),
    ipc.Claimed((3, 4)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: ipc.Message) -> None:
    data = ipc.encode(msg)
    reader = ipc.MessageReader()
    assert reader.feed(data[:3]) == []  # partial frames wait for the rest
    assert reader.feed(data[3:]) == [msg]


def test_done_split_pieces_must_cover_the_batch_in_order() -> None:
    good = ipc.encode(MESSAGES[9])
    body = bytearray(good[5:])
    first = ipc.DoneSplit.FMT.size + ipc.Piece.FMT.size  # second piece's first_index
    body[first : first + 4] = (2).to_bytes(4, "little")  # overlaps the first piece
    with pytest.raises(ipc.IpcError):
        ipc.decode(ipc.DoneSplit.TYPE, bytes(body))
    one = bytearray(good[5:])
    one[8:10] = (1).to_bytes(2, "little")  # a split batch has at least two pieces
    with pytest.raises(ipc.IpcError):
        ipc.decode(ipc.DoneSplit.TYPE, bytes(one))


def test_fuzzed_streams_raise_only_ipc_errors() -> None:
    """Seeded and bounded: valid frames with flipped, cut or random bytes."""
    rnd = random.Random(0x1BC)
    frames = [ipc.encode(m) for m in MESSAGES]
    for _ in range(4000):
        data = bytearray(rnd.choice(frames))
        kind = rnd.randrange(4)
        if kind == 0:
            for _ in range(rnd.randrange(1, 4)):
                data[rnd.randrange(len(data))] = rnd.randrange(256)
        elif kind == 1:
            del data[rnd.randrange(5, len(data) + 1) :]
            data[0:4] = (len(data) - 4).to_bytes(4, "little")
        elif kind == 2:
            data = bytearray(rnd.randbytes(rnd.randrange(1, 64)))
        else:
            data[4] = rnd.randrange(256)  # any message type
        with contextlib.suppress(ipc.IpcError):
            ipc.MessageReader().feed(bytes(data))
