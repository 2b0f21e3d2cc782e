"""Version-gated message schemas: one declaration per field drives encode and decode.

A message is a dataclass whose fields are declared with :func:`fld`, one line per line
of the Kafka JSON schema (``clients/src/main/resources/common/message/*.json``)::

    @dataclass(kw_only=True, slots=True)
    class MetadataResponseBroker(Struct):
        node_id: int = fld(INT32, "0+")
        rack: str | None = fld(STRING, "1+", nullable="1+", default=None)

``versions`` and ``nullable`` use the JSON syntax ("3+", "8-10", "none"); ``tag`` marks
a tagged field (present in the same versions). Untagged fields are written in
declaration order. The first use of a (class, version, flexible) triple compiles the
declarations into a :class:`Plan` (one closure per field), cached afterwards.

Rules:

- A field absent at a version is skipped when encoding and gets its default on decode.
- A tagged field is written only when it differs from its default.
- Tags unknown at that version are kept raw in ``unknown_tags`` and written back, so a
  proxy can decode, edit and re-encode a message without losing them.
- ``RECORDS`` fields are never copied: encoding splices the caller's buffer into the
  :class:`Writer`'s segment list; decoding returns a memoryview into the input.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, TypeVar

from shmprod.errors import DecodeError, EncodeError
from shmprod.protocol import primitives as p
from shmprod.protocol.frames import UnsupportedVersionError, is_flexible
from shmprod.protocol.primitives import Reader

Decoder = Callable[[Reader], Any]
Encoder = Callable[["Writer", Any], None]
Segment = bytes | memoryview
"""One piece of an encoded message: our own bytes, or a caller's buffer passed through."""
RecordsBuffer = bytes | bytearray | memoryview
"""What a ``RECORDS`` field accepts: any contiguous buffer of encoded record batches."""

MAX_VERSION: Final = 0x7FFF
_SPEC: Final = "kafka"
ZERO_UUID: Final = uuid.UUID(int=0)


def parse_versions(spec: str) -> tuple[int, int]:
    """Parses a schema version range ("3+", "8-10", "5", "none") into inclusive bounds."""
    if spec == "none":
        return (1, 0)
    if spec.endswith("+"):
        return (int(spec[:-1]), MAX_VERSION)
    lo, sep, hi = spec.partition("-")
    return (int(lo), int(hi) if sep else int(lo))


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


class Writer:
    """Encoder output: bytes we write plus caller buffers spliced in without a copy.

    Encoders append to :attr:`buf`; :meth:`splice` closes the current chunk and inserts
    a caller's buffer after it. Always use ``w.buf`` afresh: splicing replaces it.
    """

    __slots__ = ("_chunks", "buf", "first")

    def __init__(self, reserve: int = 0) -> None:
        self.buf = bytearray(reserve)
        # The first chunk: where a frame's size prefix lives.
        self.first = self.buf
        self._chunks: list[bytearray | Segment] = []

    def splice(self, data: Segment) -> None:
        """Inserts ``data`` (a 1-D byte buffer) after what was written so far, uncopied."""
        self._chunks.append(self.buf)
        self._chunks.append(data)
        self.buf = bytearray()

    def nbytes(self) -> int:
        """Total encoded size, spliced buffers included."""
        return sum(len(c) for c in self._chunks) + len(self.buf)

    def segments(self) -> list[Segment]:
        """The output as a list of non-empty segments, spliced buffers as given."""
        out: list[Segment] = []
        for chunk in (*self._chunks, self.buf):
            if len(chunk):
                out.append(bytes(chunk) if isinstance(chunk, bytearray) else chunk)
        return out

    def getvalue(self) -> bytes:
        """The output as one ``bytes`` (copies spliced buffers)."""
        if not self._chunks:
            return bytes(self.buf)
        return b"".join((*self._chunks, self.buf))


# ---------------------------------------------------------------------------
# Wire types
# ---------------------------------------------------------------------------


class Kind:
    """A wire type: builds the decoder and encoder of a field for one version.

    ``default`` is a field's default unless the field says otherwise; ``factory``
    (if set) builds a fresh mutable default instead.
    """

    name: str = "?"
    default: Any = None
    factory: Callable[[], Any] | None = None

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        """A function reading one value of this type."""
        raise NotImplementedError

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        """A function writing one value of this type."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class ScalarKind(Kind):
    """A fixed-size type (ints, bool, uuid): same bytes in every version."""

    def __init__(
        self,
        name: str,
        read: Callable[[Reader], Any],
        write: Callable[[bytearray, Any], None],
        default: Any,
    ) -> None:
        self.name = name
        self.default = default
        self._read = read
        self._write = write

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        return self._read

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        write = self._write

        def encode(w: Writer, v: Any) -> None:
            write(w.buf, v)

        return encode


def _write_bool(out: bytearray, v: Any) -> None:
    if not isinstance(v, bool):
        raise EncodeError(f"bool expected, got {type(v).__name__}")
    p.append_bool(out, v)


def _write_uuid(out: bytearray, v: Any) -> None:
    if not isinstance(v, uuid.UUID):
        raise EncodeError(f"uuid.UUID expected, got {type(v).__name__}")
    p.append_uuid(out, v)


INT8: Final = ScalarKind("int8", Reader.int8, p.append_int8, 0)
INT16: Final = ScalarKind("int16", Reader.int16, p.append_int16, 0)
INT32: Final = ScalarKind("int32", Reader.int32, p.append_int32, 0)
INT64: Final = ScalarKind("int64", Reader.int64, p.append_int64, 0)
BOOL: Final = ScalarKind("bool", Reader.bool, _write_bool, False)
UUID: Final = ScalarKind("uuid", Reader.uuid, _write_uuid, ZERO_UUID)


_STRING_WRITERS: Final[dict[tuple[bool, bool], Callable[[bytearray, Any], None]]] = {
    (False, False): p.append_string,
    (False, True): p.append_nullable_string,
    (True, False): p.append_compact_string,
    (True, True): p.append_compact_nullable_string,
}


class StringKind(Kind):
    """A UTF-8 string: int16 length, or uvarint length+1 in flexible versions."""

    name = "string"
    default = ""

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        if flexible:
            return Reader.compact_nullable_string if nullable else Reader.compact_string
        return Reader.nullable_string if nullable else Reader.string

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        write = _STRING_WRITERS[flexible, nullable]

        def encode(w: Writer, v: Any) -> None:
            if not isinstance(v, str) and not (nullable and v is None):
                raise EncodeError(f"str{' or None' if nullable else ''} expected, got {v!r:.40}")
            write(w.buf, v)

        return encode


def as_byte_view(data: RecordsBuffer) -> Segment:
    """``data`` as a segment whose ``len`` is its size in bytes, without copying it.

    bytes and 1-D byte memoryviews are returned as they are; anything else becomes a
    byte memoryview over the same memory.
    """
    if isinstance(data, bytes):
        return data
    try:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format not in ("B", "b", "c") or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"records must be a contiguous byte buffer: {exc}") from None
    if not view.contiguous:
        raise EncodeError("records must be a contiguous byte buffer")
    return view


class RecordsKind(Kind):
    """Encoded record batches: nullable bytes, passed through without copying."""

    name = "records"
    default = None

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        def decode(r: Reader) -> memoryview | None:
            if flexible:
                n = r.uvarint32() - 1
            else:
                n = r.int32()
                if n < -1:
                    raise DecodeError(f"invalid records length {n}")
            if n == -1:
                if not nullable:
                    raise DecodeError("null records where records are required")
                return None
            return r.view(n)

        return decode

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        def encode(w: Writer, v: Any) -> None:
            if v is None:
                if not nullable:
                    raise EncodeError("records are not nullable here")
                w.buf += b"\x00" if flexible else b"\xff\xff\xff\xff"
                return
            if not isinstance(v, bytes | bytearray | memoryview):
                raise EncodeError(f"records must be bytes, bytearray or memoryview: {v!r:.40}")
            seg = as_byte_view(v)
            n = len(seg)
            if flexible:
                p.append_uvarint(w.buf, n + 1)
            else:
                p.append_int32(w.buf, n)
            if n:
                w.splice(seg)

        return encode


STRING: Final = StringKind()
RECORDS: Final = RecordsKind()


class ArrayKind(Kind):
    """An array: int32 count (-1 = null), or uvarint count+1 (0 = null) when flexible."""

    factory = list

    def __init__(self, item: Kind) -> None:
        self.item = item
        self.name = f"[]{item.name}"

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        item = self.item.decoder(version, flexible, False)

        def decode(r: Reader) -> list[Any] | None:
            n = r.array_len(compact=flexible)
            if n is None:
                if not nullable:
                    raise DecodeError(f"null array of {self.item.name} where one is required")
                return None
            return [item(r) for _ in range(n)]

        return decode

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        item = self.item.encoder(version, flexible, False)

        def encode(w: Writer, v: Any) -> None:
            if v is None:
                if not nullable:
                    raise EncodeError(f"array of {self.item.name} is not nullable here")
                p.append_array_len(w.buf, None, compact=flexible)
                return
            if not isinstance(v, list | tuple):
                raise EncodeError(f"list expected for array of {self.item.name}: {v!r:.40}")
            p.append_array_len(w.buf, len(v), compact=flexible)
            for x in v:
                item(w, x)

        return encode


class StructKind(Kind):
    """A nested message structure (a :class:`Struct` subclass)."""

    def __init__(self, cls: type[Struct]) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.factory = cls

    def decoder(self, version: int, flexible: bool, nullable: bool) -> Decoder:
        return plan_for(self.cls, version, flexible).decode

    def encoder(self, version: int, flexible: bool, nullable: bool) -> Encoder:
        plan = plan_for(self.cls, version, flexible)
        cls = self.cls

        def encode(w: Writer, v: Any) -> None:
            if not isinstance(v, cls):
                raise EncodeError(f"{cls.__name__} expected, got {type(v).__name__}")
            plan.encode(w, v)

        return encode


def as_kind(kind: Kind | type[Struct]) -> Kind:
    """``kind`` itself, or a :class:`StructKind` for a struct class."""
    return kind if isinstance(kind, Kind) else StructKind(kind)


def array(item: Kind | type[Struct]) -> ArrayKind:
    """The array type of ``item`` (a wire type or a struct class)."""
    return ArrayKind(as_kind(item))


# ---------------------------------------------------------------------------
# Field declarations
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """The schema of one field: its type and the versions it exists / is nullable in."""

    kind: Kind
    versions: tuple[int, int]
    nullable_versions: tuple[int, int]
    tag: int | None

    def present(self, version: int) -> bool:
        """Whether the field exists at ``version``."""
        return self.versions[0] <= version <= self.versions[1]

    def nullable(self, version: int) -> bool:
        """Whether the field may be null at ``version``."""
        return self.nullable_versions[0] <= version <= self.nullable_versions[1]


def fld(
    kind: Kind | type[Struct],
    versions: str,
    *,
    nullable: str = "none",
    tag: int | None = None,
    default: Any = dataclasses.MISSING,
) -> Any:
    """Declares a message field: a dataclass field carrying its :class:`FieldSpec`."""
    k = as_kind(kind)
    meta = {_SPEC: FieldSpec(k, parse_versions(versions), parse_versions(nullable), tag)}
    if default is not dataclasses.MISSING:
        return field(default=default, metadata=meta)
    if k.factory is not None:
        return field(default_factory=k.factory, metadata=meta)
    return field(default=k.default, metadata=meta)


@dataclass(kw_only=True, slots=True)
class Struct:
    """Base of every message structure; keeps tagged fields it did not recognise."""

    unknown_tags: dict[int, bytes] = field(default_factory=dict, repr=False)


class Message(Struct):
    """A top-level request or response body of one API."""

    __slots__ = ()
    API_KEY: ClassVar[int]
    VERSIONS: ClassVar[tuple[int, int]]
    """The versions shmprod encodes and decodes (inclusive)."""


class Request(Message):
    """A request body."""

    __slots__ = ()


class Response(Message):
    """A response body."""

    __slots__ = ()


S = TypeVar("S", bound=Struct)
M = TypeVar("M", bound=Message)


def schema_fields(cls: type[Struct]) -> list[tuple[str, FieldSpec]]:
    """The declared fields of ``cls`` in order, with their specs (for tests and tools)."""
    return [(f.name, f.metadata[_SPEC]) for f in dataclasses.fields(cls) if _SPEC in f.metadata]


# ---------------------------------------------------------------------------
# Compiled plans
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tagged:
    name: str
    decode: Decoder
    encode: Encoder
    default: Any


class Plan:
    """The codec of one struct class at one version: a closure per present field."""

    __slots__ = ("cls", "decoders", "encoders", "flexible", "tagged")

    def __init__(self, cls: type[Struct], version: int, flexible: bool) -> None:
        self.cls = cls
        self.flexible = flexible
        self.decoders: list[tuple[str, Decoder]] = []
        self.encoders: list[tuple[str, Encoder]] = []
        self.tagged: dict[int, _Tagged] = {}
        for f in dataclasses.fields(cls):
            spec: FieldSpec | None = f.metadata.get(_SPEC)
            if spec is None or not spec.present(version):
                continue
            nullable = spec.nullable(version)
            dec = spec.kind.decoder(version, flexible, nullable)
            enc = spec.kind.encoder(version, flexible, nullable)
            if spec.tag is None:
                self.decoders.append((f.name, dec))
                self.encoders.append((f.name, enc))
            elif flexible:
                factory: Any = f.default_factory
                default = f.default if factory is dataclasses.MISSING else factory()
                self.tagged[spec.tag] = _Tagged(f.name, dec, enc, default)

    def decode(self, r: Reader) -> Any:
        """Reads one instance of the struct."""
        values: dict[str, Any] = {}
        for name, dec in self.decoders:
            values[name] = dec(r)
        if self.flexible:
            self._decode_tags(r, values)
        return self.cls(**values)

    def _decode_tags(self, r: Reader, values: dict[str, Any]) -> None:
        unknown: dict[int, bytes] = {}
        for tag, raw in r.tagged_fields().items():
            known = self.tagged.get(tag)
            if known is None:
                unknown[tag] = raw
                continue
            sub = Reader(raw)
            values[known.name] = known.decode(sub)
            sub.expect_end()
        if unknown:
            values["unknown_tags"] = unknown

    def encode(self, w: Writer, obj: Any) -> None:
        """Writes ``obj`` (an instance of the struct)."""
        for name, enc in self.encoders:
            enc(w, getattr(obj, name))
        if self.flexible:
            self._encode_tags(w, obj)

    def _encode_tags(self, w: Writer, obj: Any) -> None:
        unknown: dict[int, bytes] = obj.unknown_tags
        if not self.tagged and not unknown:
            w.buf.append(0)
            return
        fields: dict[int, bytes] = {}
        for tag, known in self.tagged.items():
            value = getattr(obj, known.name)
            if value != known.default:
                sub = Writer()
                known.encode(sub, value)
                fields[tag] = sub.getvalue()
        for tag, raw in unknown.items():
            if tag in self.tagged:
                raise EncodeError(f"unknown_tags holds tag {tag}, a known field of {self.cls}")
            if not isinstance(tag, int) or tag < 0 or not isinstance(raw, bytes | bytearray):
                raise EncodeError(f"bad unknown tag {tag!r}: {raw!r:.40}")
            fields[tag] = bytes(raw)
        p.append_tagged_fields(w.buf, fields)


_PLANS: dict[tuple[type[Struct], int, bool], Plan] = {}


def plan_for(cls: type[Struct], version: int, flexible: bool) -> Plan:
    """The (cached) compiled codec of ``cls`` at ``version``."""
    key = (cls, version, flexible)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = Plan(cls, version, flexible)
    return plan


# ---------------------------------------------------------------------------
# Message bodies
# ---------------------------------------------------------------------------


def check_version(cls: type[Message], version: int) -> None:
    """Raises :class:`UnsupportedVersionError` unless shmprod supports ``version``."""
    lo, hi = cls.VERSIONS
    if not isinstance(version, int) or not lo <= version <= hi:
        raise UnsupportedVersionError(
            f"{cls.__name__} version {version!r} not in supported range {lo}-{hi}",
            api_key=cls.API_KEY,
        )


def encode_body_into(w: Writer, msg: Message, version: int) -> None:
    """Appends the body of ``msg`` at ``version`` to ``w`` (no header, no size)."""
    cls = type(msg)
    check_version(cls, version)
    plan_for(cls, version, is_flexible(cls.API_KEY, version)).encode(w, msg)


def encode_body(msg: Message, version: int) -> bytes:
    """The body of ``msg`` at ``version`` as bytes (no header, no size prefix)."""
    w = Writer()
    encode_body_into(w, msg, version)
    return w.getvalue()


def decode_body(
    cls: type[M], data: bytes | bytearray | memoryview, version: int, offset: int = 0
) -> M:
    """Decodes a body of ``cls`` from ``data[offset:]``, which it must consume exactly."""
    check_version(cls, version)
    r = Reader(data, offset)
    msg: M = plan_for(cls, version, is_flexible(cls.API_KEY, version)).decode(r)
    r.expect_end()
    return msg
