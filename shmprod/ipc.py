"""The control plane between workers and the sender: small messages on a UNIX socket.

Records never travel here: they are in shared memory. A message moves the ownership of
a buffer (``ALLOC``/``GRANT``/``CLAIMED``/``SEALED``/``RELEASE``), asks for a topic
(``TOPIC``), or reports a batch's outcome (``DONE``): one message per batch, never per
record. The socket also carries liveness: a worker sees EOF when the sender dies, the
sender when a worker dies, and reacts at once.

Wire form: ``u32 length | u8 type | payload`` (little-endian, ``length`` counts type and
payload). Sans-IO: :func:`encode` builds bytes, :class:`MessageReader` splits a byte
stream into decoded messages; both raise :class:`IpcError` on malformed input.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import ClassVar, Final

from shmprod.errors import ShmprodError

MAX_MESSAGE: Final = 1 << 20
SECRET_SIZE: Final = 16


_own_start_us: dict[int, int] = {}
_PROC: Final = os.path.isdir("/proc/self")
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if _PROC else 100


def _boot_time_s() -> float:
    """The boot time in seconds since the epoch (``btime`` of ``/proc/stat``), read each
    time as psutil does (it moves when the clock is stepped)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_state(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (``Z``: a zombie; ``?``: not readable) and its start
    time in microseconds since the epoch (0 if not readable); None if no process has it.

    Read from ``/proc/<pid>/stat`` on Linux, as psutil reads it, without importing psutil
    (about 2 MB of modules in every process that attaches); psutil elsewhere.
    """
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            # after "pid (comm) ": state is field 3, starttime (clock ticks after boot) 22
            fields = stat[stat.rindex(b")") + 2 :].split()
            ticks = int(fields[19])
            return fields[0].decode("ascii"), int((ticks / _CLOCK_TICKS + _boot_time_s()) * 1e6)
        except (FileNotFoundError, ProcessLookupError):
            return None
        except (OSError, ValueError, IndexError, UnicodeDecodeError):
            pass  # not readable here (a hidepid mount, say): ask psutil
    import psutil

    try:
        proc = psutil.Process(pid)
        state = "Z" if proc.status() == psutil.STATUS_ZOMBIE else "R"
        return state, int(proc.create_time() * 1_000_000)
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return "?", 0


def process_start_us(pid: int | None = None) -> int:
    """A process's start time in microseconds since the epoch, 0 if it does not exist
    (or cannot be read).

    With the pid it names one process for good (``Hello.start_us``, the sender's check
    that its owner is still the same process). This process's own value is cached.
    """
    me = os.getpid()
    if pid is None or pid == me:
        cached = _own_start_us.get(me)
        if cached is None:
            own = process_state(me)
            cached = _own_start_us[me] = own[1] if own is not None else 0
        return cached
    found = process_state(pid)
    return found[1] if found is not None else 0


class IpcError(ShmprodError):
    """A malformed control message (a bug or a stranger on the socket)."""


_LEN = struct.Struct("<IB")


@dataclass(frozen=True, slots=True)
class Hello:
    """worker → sender, first message: who is attaching (``owner``: the creating process)."""

    TYPE: ClassVar[int] = 1
    FMT: ClassVar[struct.Struct] = struct.Struct(f"<{SECRET_SIZE}sQQB")
    secret: bytes
    pid: int
    start_us: int
    owner: bool


@dataclass(frozen=True, slots=True)
class Welcome:
    """sender → worker: the worker slot it holds, and the producer id/epoch in use."""

    TYPE: ClassVar[int] = 2
    FMT: ClassVar[struct.Struct] = struct.Struct("<I")
    worker_slot: int


@dataclass(frozen=True, slots=True)
class Alloc:
    """worker → sender: ``count`` runs of ``run`` adjacent buffers each."""

    TYPE: ClassVar[int] = 3
    FMT: ClassVar[struct.Struct] = struct.Struct("<III")
    request_id: int
    run: int
    count: int


@dataclass(frozen=True, slots=True)
class Grant:
    """sender → worker: first buffer of each run granted (``error`` set: none granted)."""

    TYPE: ClassVar[int] = 4
    FMT: ClassVar[struct.Struct] = struct.Struct("<IIh")
    request_id: int
    run: int
    error: int
    buffers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Sealed:
    """worker → sender: a complete RecordBatch in ``buffer`` (and its run) is the
    sender's. The run may be the head of a longer one granted as one: the rest stays
    granted to the worker, one buffer at a time."""

    TYPE: ClassVar[int] = 5
    FMT: ClassVar[struct.Struct] = struct.Struct("<IIIQII")
    buffer: int
    run: int
    partition_slot: int
    batch_id: int
    length: int
    record_count: int


@dataclass(frozen=True, slots=True)
class Release:
    """worker → sender: buffers given back unused (runs of ``run``)."""

    TYPE: ClassVar[int] = 6
    FMT: ClassVar[struct.Struct] = struct.Struct("<I")
    run: int
    buffers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Claimed:
    """worker → sender: spare buffers this worker took without asking (each one's
    DESCRIPTOR word swapped from SPARE to GRANTED by this worker's slot); they are now
    granted to it, as if by a Grant. Sent before any Sealed of them."""

    TYPE: ClassVar[int] = 15
    FMT: ClassVar[struct.Struct] = struct.Struct("<")
    buffers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TopicRequest:
    """worker → sender: make ``name`` known in the metadata table."""

    TYPE: ClassVar[int] = 7
    FMT: ClassVar[struct.Struct] = struct.Struct("<I")
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """sender → worker: ``name``'s slot in the metadata table, or an error code.

    ``request_id`` 0 is a push (a partition count changed).
    """

    TYPE: ClassVar[int] = 8
    FMT: ClassVar[struct.Struct] = struct.Struct("<Iiih")
    request_id: int
    topic_slot: int
    partitions: int
    error: int
    name: str


@dataclass(frozen=True, slots=True)
class Done:
    """sender → worker: the outcome of one batch. ``error`` 0: ``base_offset`` is valid."""

    TYPE: ClassVar[int] = 9
    FMT: ClassVar[struct.Struct] = struct.Struct("<QhqqB")
    batch_id: int
    error: int
    base_offset: int
    log_append_time_ms: int
    retriable: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class Piece:
    """The outcome of records ``[first_index, first_index + record_count)`` of a batch
    that the sender split (MESSAGE_TOO_LARGE); ``error`` 0: ``base_offset`` is valid."""

    FMT: ClassVar[struct.Struct] = struct.Struct("<IIhqqB")
    first_index: int
    record_count: int
    error: int
    base_offset: int
    log_append_time_ms: int
    retriable: bool


@dataclass(frozen=True, slots=True)
class DoneSplit:
    """sender → worker: the outcome of a batch the sender split, piece by piece.

    Instead of ``Done``, never besides it. The pieces cover the batch's records in
    order; ``message`` describes the first failed piece, if any.
    """

    TYPE: ClassVar[int] = 14
    FMT: ClassVar[struct.Struct] = struct.Struct("<QH")
    batch_id: int
    pieces: tuple[Piece, ...]
    message: str = ""


@dataclass(frozen=True, slots=True)
class Fatal:
    """sender → worker: the producer failed or is closing; every pending send fails."""

    TYPE: ClassVar[int] = 10
    FMT: ClassVar[struct.Struct] = struct.Struct("<h")
    error: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class Bye:
    """worker → sender: detaching cleanly (its granted buffers may be reclaimed)."""

    TYPE: ClassVar[int] = 11
    FMT: ClassVar[struct.Struct] = struct.Struct("<B")
    flags: int = 0


@dataclass(frozen=True, slots=True)
class Shutdown:
    """owner → sender: finish what is queued (up to ``timeout_ms``), then exit."""

    TYPE: ClassVar[int] = 12
    FMT: ClassVar[struct.Struct] = struct.Struct("<Q")
    timeout_ms: int


@dataclass(frozen=True, slots=True)
class Ready:
    """sender → owner: bootstrap metadata fetched, the producer can send."""

    TYPE: ClassVar[int] = 13
    FMT: ClassVar[struct.Struct] = struct.Struct("<h")
    error: int
    message: str = ""


Message = (
    Hello
    | Welcome
    | Alloc
    | Grant
    | Sealed
    | Release
    | Claimed
    | TopicRequest
    | TopicInfo
    | Done
    | DoneSplit
    | Fatal
    | Bye
    | Shutdown
    | Ready
)

_TYPES: Final[dict[int, type[Message]]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Alloc,
        Grant,
        Sealed,
        Release,
        Claimed,
        TopicRequest,
        TopicInfo,
        Done,
        DoneSplit,
        Fatal,
        Bye,
        Shutdown,
        Ready,
    )
}
_U32 = struct.Struct("<I")
_STR_FIELD = {
    TopicRequest: "name",
    TopicInfo: "name",
    Done: "message",
    Fatal: "message",
    Ready: "message",
}
_LIST_FIELD = {Grant: "buffers", Release: "buffers", Claimed: "buffers"}


def encode(msg: Message) -> bytes:
    """One framed message."""
    cls = type(msg)
    if isinstance(msg, DoneSplit):
        body = bytearray(DoneSplit.FMT.pack(msg.batch_id, len(msg.pieces)))
        for p in msg.pieces:
            body += Piece.FMT.pack(
                p.first_index,
                p.record_count,
                p.error,
                p.base_offset,
                p.log_append_time_ms,
                p.retriable,
            )
        body += msg.message.encode("utf-8", "replace")
        return _frame(cls.TYPE, body)
    body = bytearray(cls.FMT.pack(*[getattr(msg, f) for f in _FIXED_FIELDS[cls]]))
    if cls in _STR_FIELD:
        body += getattr(msg, _STR_FIELD[cls]).encode("utf-8", "replace")
    elif cls in _LIST_FIELD:
        items: tuple[int, ...] = getattr(msg, _LIST_FIELD[cls])
        body += struct.pack(f"<{len(items)}I", *items)
    return _frame(cls.TYPE, body)


def _frame(mtype: int, body: bytearray) -> bytes:
    if len(body) + 1 > MAX_MESSAGE:
        raise IpcError(f"control message of {len(body)} bytes is too large")
    return _LEN.pack(len(body) + 1, mtype) + body


def _n_fixed(cls: type[Message]) -> int:
    return len(cls.FMT.unpack(bytes(cls.FMT.size)))


# the fields each message type packs with its FMT, in order (its first ones)
_FIXED_FIELDS: Final[dict[type[Message], tuple[str, ...]]] = {
    cls: tuple(cls.__slots__[: _n_fixed(cls)]) for cls in _TYPES.values()
}


def decode(mtype: int, body: bytes | memoryview) -> Message:
    """The message of type ``mtype`` from its payload."""
    cls = _TYPES.get(mtype)
    if cls is None:
        raise IpcError(f"unknown control message type {mtype}")
    size = cls.FMT.size
    if len(body) < size:
        raise IpcError(f"{cls.__name__} needs {size} bytes, got {len(body)}")
    fixed = cls.FMT.unpack_from(body, 0)
    rest = bytes(body[size:])
    if cls is DoneSplit:
        return _decode_done_split(fixed[0], fixed[1], rest)
    try:
        if cls in _STR_FIELD:
            return cls(*fixed, rest.decode("utf-8"))  # type: ignore[call-arg]
        if cls in _LIST_FIELD:
            if len(rest) % 4:
                raise IpcError(f"{cls.__name__} list is not whole u32s")
            return cls(*fixed, tuple(struct.unpack(f"<{len(rest) // 4}I", rest)))  # type: ignore[call-arg]
        if rest:
            raise IpcError(f"{cls.__name__} has {len(rest)} trailing bytes")
        return cls(*fixed)
    except (UnicodeDecodeError, TypeError) as exc:
        raise IpcError(f"bad {cls.__name__}: {exc}") from None


def _decode_done_split(batch_id: int, count: int, rest: bytes) -> DoneSplit:
    need = count * Piece.FMT.size
    if count < 2 or len(rest) < need:
        raise IpcError(f"DoneSplit with {count} pieces in {len(rest)} bytes")
    pieces: list[Piece] = []
    expected = 0
    for first, n, error, offset, lat, retriable in Piece.FMT.iter_unpack(rest[:need]):
        if first != expected or n < 1 or retriable > 1:
            raise IpcError("DoneSplit pieces do not cover the batch's records in order")
        pieces.append(Piece(first, n, error, offset, lat, bool(retriable)))
        expected += n
    try:
        return DoneSplit(batch_id, tuple(pieces), rest[need:].decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise IpcError(f"bad DoneSplit: {exc}") from None


class MessageReader:
    """Splits a control byte stream into messages; keeps partial ones for the next feed."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        buf = self._buf
        buf += data
        out: list[Message] = []
        pos = 0
        while len(buf) - pos >= 5:
            length, mtype = _LEN.unpack_from(buf, pos)
            if not 1 <= length <= MAX_MESSAGE:
                raise IpcError(f"control message length {length} out of range")
            end = pos + 4 + length
            if end > len(buf):
                break
            out.append(decode(mtype, bytes(buf[pos + 5 : end])))
            pos = end
        if pos:
            del buf[:pos]
        return out
