"""Fuzz every parser of the sans-IO codec (seeded, bounded, deterministic).

Each decoder is fed random bytes and mutated valid encodings (bit flips, truncations,
insertions, deletions, hostile lengths). It must either decode or raise
:class:`ProtocolError` (normally :class:`DecodeError`), never any other exception.
Whatever does decode must survive re-encoding: decode(encode(decode(x))) == decode(x).
"""

from __future__ import annotations

import random
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from shmprod.errors import ProtocolError
from shmprod.protocol import primitives as p
from shmprod.protocol.frames import (
    ApiKey,
    FrameDecoder,
    build_request_frame,
    decode_request_header,
    decode_response_header,
    is_flexible,
)
from shmprod.protocol.messages import (
    REQUEST_TYPES,
    RESPONSE_TYPES,
    Message,
    PartitionProduceData,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    Request,
    Response,
    Struct,
    TopicProduceData,
    TopicProduceResponse,
    decode_body,
    decode_request,
    decode_response,
    encode_body,
    encode_request,
    encode_request_segments,
    encode_response,
    produce_fast,
)
from shmprod.protocol.messages.schema import (
    ArrayKind,
    Kind,
    RecordsKind,
    ScalarKind,
    StringKind,
    StructKind,
    schema_fields,
)

pytestmark = pytest.mark.timeout(60)
M = TypeVar("M", bound=Message)

SEED = 0x5EED
ITERATIONS_PER_API = 5000  # per API and direction, spread over its versions
SAMPLES_PER_VERSION = 6  # valid messages to mutate, per version

_INT_BOUNDS = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
}
_TEXT = "abcxyz-._ éß€😀"
_HOSTILE_INT32 = [-1, -2, 0, 1, 0x7FFFFFFF, -(2**31), 0x01000000, 0xFFFF]


def rng_for(*key: object) -> random.Random:
    """A generator seeded from the test's own key, so cases do not depend on order."""
    return random.Random(zlib.crc32(repr((SEED, *key)).encode()))


# ---------------------------------------------------------------------------
# Random valid messages, from the field declarations
# ---------------------------------------------------------------------------


def random_value(
    kind: Kind, version: int, flexible: bool, nullable: bool, rng: random.Random
) -> Any:
    """A random value of one wire type."""
    if nullable and rng.random() < 0.2:
        return None
    if isinstance(kind, ScalarKind):
        if kind.name == "bool":
            return rng.random() < 0.5
        if kind.name == "uuid":
            return uuid.UUID(int=rng.getrandbits(128)) if rng.random() < 0.7 else uuid.UUID(int=0)
        lo, hi = _INT_BOUNDS[kind.name]
        return rng.choice([lo, hi, -1, 0, 1, rng.randint(lo, hi), rng.randint(-5, 100)])
    if isinstance(kind, StringKind):
        return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 8)))
    if isinstance(kind, RecordsKind):
        return rng.randbytes(rng.randint(0, 40))
    if isinstance(kind, ArrayKind):
        return [
            random_value(kind.item, version, flexible, False, rng) for _ in range(rng.randint(0, 3))
        ]
    if isinstance(kind, StructKind):
        return random_struct(kind.cls, version, flexible, rng)
    raise AssertionError(kind)


def random_struct(cls: type[Struct], version: int, flexible: bool, rng: random.Random) -> Any:
    """A random instance of ``cls`` with the fields of ``version`` set."""
    kwargs: dict[str, Any] = {}
    known_tags: set[int] = set()
    for name, spec in schema_fields(cls):
        if not spec.present(version) or (spec.tag is not None and not flexible):
            continue
        if spec.tag is not None:
            known_tags.add(spec.tag)
            if rng.random() < 0.5:
                continue  # leave the tagged field at its default (not written)
        kwargs[name] = random_value(spec.kind, version, flexible, spec.nullable(version), rng)
    if flexible and rng.random() < 0.2:
        tag = rng.choice([t for t in range(8) if t not in known_tags])
        kwargs["unknown_tags"] = {tag: rng.randbytes(rng.randint(0, 4))}
    return cls(**kwargs)


def random_message(cls: type[M], version: int, rng: random.Random) -> M:
    """A random valid message of ``cls`` at ``version``."""
    msg: M = random_struct(cls, version, is_flexible(cls.API_KEY, version), rng)
    return msg


# ---------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------


def _flip_bit(d: bytearray, rng: random.Random) -> None:
    if d:
        i = rng.randrange(len(d))
        d[i] ^= 1 << rng.randrange(8)


def _set_byte(d: bytearray, rng: random.Random) -> None:
    if d:
        d[rng.randrange(len(d))] = rng.choice([0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF])


def _set_int32(d: bytearray, rng: random.Random) -> None:
    if len(d) >= 4:
        i = rng.randrange(len(d) - 3)
        d[i : i + 4] = (rng.choice(_HOSTILE_INT32) & 0xFFFFFFFF).to_bytes(4, "big")


def _set_varint(d: bytearray, rng: random.Random) -> None:
    if d:
        i = rng.randrange(len(d))
        d[i : i + 1] = rng.choice(
            [b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x80\x01", b"\xff" * 11]
        )


def _truncate(d: bytearray, rng: random.Random) -> None:
    del d[rng.randrange(len(d) + 1) :]


def _insert(d: bytearray, rng: random.Random) -> None:
    i = rng.randrange(len(d) + 1)
    d[i:i] = rng.randbytes(rng.randint(1, 6))


def _delete(d: bytearray, rng: random.Random) -> None:
    if d:
        i = rng.randrange(len(d))
        del d[i : i + rng.randint(1, 6)]


def _duplicate(d: bytearray, rng: random.Random) -> None:
    if d:
        i = rng.randrange(len(d))
        chunk = d[i : i + rng.randint(1, 12)]
        j = rng.randrange(len(d) + 1)
        d[j:j] = chunk


def _append(d: bytearray, rng: random.Random) -> None:
    d += rng.randbytes(rng.randint(1, 4))


MUTATIONS: list[Callable[[bytearray, random.Random], None]] = [
    _flip_bit,
    _flip_bit,
    _set_byte,
    _set_int32,
    _set_varint,
    _truncate,
    _insert,
    _delete,
    _duplicate,
    _append,
]


def mutate(data: bytes, rng: random.Random, keep: int = 0) -> bytes:
    """``data`` with one to three random mutations, leaving the first ``keep`` bytes."""
    head, d = data[:keep], bytearray(data[keep:])
    for _ in range(rng.randint(1, 3)):
        rng.choice(MUTATIONS)(d, rng)
    return head + bytes(d)


def inputs(valid: list[bytes], rng: random.Random, n: int, keep: int = 0) -> list[bytes]:
    """``n`` fuzz inputs: mostly mutated valid encodings, some random bytes."""
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append(rng.randbytes(rng.randint(0, 64)))
        else:
            out.append(mutate(rng.choice(valid), rng, keep))
    return out


def attempt(decode: Callable[[bytes], Any], data: bytes) -> Any:
    """``decode(data)``; None if it raised ProtocolError; fails the test on anything else."""
    try:
        return decode(data)
    except ProtocolError:
        return None
    except Exception as exc:  # the point of the test: report what escaped, and on what
        pytest.fail(f"{decode.__name__} raised {type(exc).__name__}: {exc} on {data.hex()}")


# ---------------------------------------------------------------------------
# Fuzz tests
# ---------------------------------------------------------------------------


def _versions(cls: type[Message]) -> range:
    return range(cls.VERSIONS[0], cls.VERSIONS[1] + 1)


@pytest.mark.parametrize("api_key", sorted(RESPONSE_TYPES), ids=lambda k: ApiKey(k).name)
def test_fuzz_response_decoders(api_key: int) -> None:
    cls = RESPONSE_TYPES[api_key]
    versions = _versions(cls)
    per_version = ITERATIONS_PER_API // len(versions)
    decoded = 0
    for version in versions:
        rng = rng_for("response", api_key, version)
        msgs = [random_message(cls, version, rng) for _ in range(SAMPLES_PER_VERSION)]
        valid = [encode_response(m, version, rng.randint(0, 99))[4:] for m in msgs]

        def decode(data: bytes, cls: type[Response] = cls, version: int = version) -> Any:
            return decode_response(cls, data, version)

        for data in inputs(valid, rng, per_version, keep=rng.choice([0, 4])):
            result = attempt(decode, data)
            if result is not None:
                decoded += 1
                corr, body = result
                again = encode_response(body, version, corr)[4:]
                assert decode_response(cls, again, version) == (corr, body)
    assert decoded > 0  # the mutations do not only produce garbage


@pytest.mark.parametrize("api_key", sorted(REQUEST_TYPES), ids=lambda k: ApiKey(k).name)
def test_fuzz_request_decoders(api_key: int) -> None:
    cls = REQUEST_TYPES[api_key]
    versions = _versions(cls)
    per_version = ITERATIONS_PER_API // len(versions)
    decoded = 0
    for version in versions:
        rng = rng_for("request", api_key, version)
        msgs = [random_message(cls, version, rng) for _ in range(SAMPLES_PER_VERSION)]
        frames = [encode_request(m, version, rng.randint(0, 99), "fuzz")[4:] for m in msgs]
        bodies = [encode_body(m, version) for m in msgs]

        def decode_one_body(data: bytes, cls: type[Request] = cls, version: int = version) -> Any:
            return decode_body(cls, data, version)

        for data in inputs(frames, rng, per_version // 2, keep=rng.choice([0, 4])):
            result = attempt(decode_request, data)
            if result is not None:
                decoded += 1
                header, body = result
                again = encode_request(body, header.api_version, header.correlation_id, None)
                assert decode_request(again[4:])[1] == body
        for data in inputs(bodies, rng, per_version // 2):
            body = attempt(decode_one_body, data)
            if body is not None:
                decoded += 1
                assert decode_body(cls, encode_body(body, version), version) == body
    assert decoded > 0


def test_fuzz_headers() -> None:
    rng = rng_for("headers")
    client_ids = [None, "", "c-1"]
    valid = [
        build_request_frame(key, version, rng.randint(-5, 5), rng.choice(client_ids), b"")[4:]
        for key in (*REQUEST_TYPES, ApiKey.FETCH, ApiKey.LIST_OFFSETS)
        for version in (0, 3, 9, 12)
    ]
    for data in inputs(valid, rng, 2000):
        header = attempt(decode_request_header, data)
        if header is not None:
            assert 0 <= header.body_offset <= len(data)

    def response_header(data: bytes) -> Any:
        return decode_response_header(data, ApiKey.PRODUCE, 9)

    responses = [h + b"\x00" for h in (b"\x00\x00\x00\x01", b"\x7f\xff\xff\xff")]
    for data in inputs(responses, rng, 1000):
        attempt(response_header, data)


def test_fuzz_frame_decoder() -> None:
    rng = rng_for("frames")
    for _ in range(400):
        max_size = rng.choice([0, 3, 64, 1 << 20])
        payloads = [rng.randbytes(rng.randint(0, 80)) for _ in range(rng.randint(0, 5))]
        stream = b"".join(len(x).to_bytes(4, "big") + x for x in payloads)
        if rng.random() < 0.7:
            stream = mutate(stream, rng)
        decoder = FrameDecoder(max_frame_size=max_size)
        pos = 0
        total = 0
        while pos < len(stream):
            step = rng.randint(1, 40)
            frames = attempt(decoder.feed, stream[pos : pos + step])
            if frames is None:
                break
            total += sum(4 + len(f) for f in frames)
            assert all(len(f) <= max_size for f in frames)
            pos += step
        else:
            assert total + decoder.buffered == len(stream)


READERS: list[Callable[[p.Reader], Any]] = [
    p.Reader.int8,
    p.Reader.int16,
    p.Reader.int32,
    p.Reader.int64,
    p.Reader.uint32,
    p.Reader.uuid,
    p.Reader.uvarint,
    p.Reader.varint,
    p.Reader.varlong,
    p.Reader.string,
    p.Reader.nullable_string,
    p.Reader.compact_string,
    p.Reader.compact_nullable_string,
    p.Reader.bytes_,
    p.Reader.nullable_bytes,
    p.Reader.compact_bytes,
    p.Reader.compact_nullable_bytes,
    p.Reader.tagged_fields,
]


def test_fuzz_primitive_readers() -> None:
    rng = rng_for("primitives")
    for _ in range(3000):
        data = rng.randbytes(rng.randint(0, 12))
        if rng.random() < 0.5 and data:
            data = bytes([rng.choice([0x00, 0x01, 0x7F, 0x80, 0xFF])]) + data
        read = rng.choice(READERS)

        def decode(d: bytes, read: Callable[[p.Reader], Any] = read) -> Any:
            return read(p.Reader(d))

        attempt(decode, data)


# ---------------------------------------------------------------------------
# Produce's short path: the same bytes and objects as the generic codec
# ---------------------------------------------------------------------------


def plain_produce_request(version: int, rng: random.Random) -> ProduceRequest:
    """A request of the shape the sender sends: no tags, records of every buffer type."""
    flexible = is_flexible(ApiKey.PRODUCE, version)
    topics = []
    for _ in range(rng.randint(0, 3)):
        parts = []
        for _ in range(rng.choice([0, 1, 3, 8, 130])):
            raw = rng.randbytes(rng.choice([0, 1, 61, 200]))
            records: Any = rng.choice([raw, bytearray(raw), memoryview(raw), None])
            parts.append(PartitionProduceData(index=rng.randint(-1, 2**31 - 1), records=records))
        name = "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 200)))
        topics.append(TopicProduceData(name=name, partition_data=parts))
    tid = rng.choice([None, "", "tx-é"]) if flexible or rng.random() < 0.5 else None
    return ProduceRequest(
        transactional_id=tid,
        acks=rng.choice([-1, 0, 1]),
        timeout_ms=rng.randint(0, 2**31 - 1),
        topic_data=topics,
    )


def plain_produce_response(version: int, rng: random.Random) -> ProduceResponse:
    """An answer of the shape brokers send: error codes and offsets, nothing else."""
    topics = []
    for _ in range(rng.randint(0, 3)):
        parts = [
            PartitionProduceResponse(
                index=rng.randint(-(2**31), 2**31 - 1),
                error_code=rng.choice([0, 0, 0, 6, 47, -1]),
                base_offset=rng.choice([-1, 0, rng.randint(0, 2**63 - 1)]),
                log_append_time_ms=rng.choice([-1, rng.randint(0, 2**41)]),
                log_start_offset=rng.choice([-1, 0, 7]) if version >= 5 else -1,
            )
            for _ in range(rng.choice([0, 1, 3, 12, 140]))
        ]
        name = "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 200)))
        topics.append(TopicProduceResponse(name=name, partition_responses=parts))
    return ProduceResponse(responses=topics, throttle_time_ms=rng.randint(-1, 2**31 - 1))


def produce_samples(
    cls: type[M], plain_of: Callable[[int, random.Random], M], version: int
) -> Iterator[tuple[bool, M, random.Random]]:
    """150 messages of ``cls`` at ``version``, with whether each is of the plain shape
    (two in three) or random from the declarations, and the generator that made it."""
    rng = rng_for("produce short path", cls.__name__, version)
    for i in range(150):
        plain = i % 3 != 2
        yield plain, plain_of(version, rng) if plain else random_message(cls, version, rng), rng


@pytest.mark.parametrize("version", _versions(ProduceRequest))
def test_produce_short_path_writes_the_generic_bytes(version: int) -> None:
    short = 0
    for plain, msg, rng in produce_samples(ProduceRequest, plain_produce_request, version):
        corr = rng.randint(0, 2**31 - 1)
        client_id = rng.choice([None, "", "shmprod-é"])
        expected = encode_request(msg, version, corr, client_id)
        segments = produce_fast.encode_request_segments(msg, version, corr, client_id)
        if segments is None:
            assert not plain, msg
            continue
        short += 1
        assert b"".join(segments) == expected
        assert all(len(s) for s in segments)
        spliced = [
            pd.records
            for td in msg.topic_data
            for pd in td.partition_data
            if pd.records is not None and len(pd.records)
        ]
        # each non-empty record buffer is its own segment, in order, uncopied
        wanted = iter(spliced)
        want = next(wanted, None)
        for seg in segments:
            if seg is want or (isinstance(seg, memoryview) and seg.obj is want):
                want = next(wanted, None)
        assert want is None
        assert encode_request_segments(msg, version, corr, client_id) == segments
    assert short >= 100


@pytest.mark.parametrize("version", _versions(ProduceResponse))
def test_produce_short_path_reads_the_generic_objects(version: int) -> None:
    short = 0
    for plain, msg, _ in produce_samples(ProduceResponse, plain_produce_response, version):
        payload = encode_response(msg, version, 5)[4:]
        _, offset = decode_response_header(payload, ApiKey.PRODUCE, version)
        got = produce_fast.decode_response_body(payload, offset, version)
        expected = decode_response(ProduceResponse, payload, version)[1]
        if got is None:
            assert not plain, msg
            continue
        short += 1
        assert got == expected == msg
    assert short >= 100


@pytest.mark.parametrize("version", _versions(ProduceResponse))
def test_fuzz_produce_short_path(version: int) -> None:
    """Whatever the short path reads from mangled bytes, the generic codec reads the
    same; whatever it refuses, it refuses without raising."""
    rng = rng_for("produce short path, fuzz", version)
    valid = [
        encode_response(plain_produce_response(version, rng), version, 1)[4:] for _ in range(8)
    ]
    short = 0
    for data in inputs(valid, rng, 1500):
        try:
            _, offset = decode_response_header(data, ApiKey.PRODUCE, version)
        except ProtocolError:
            continue
        got = produce_fast.decode_response_body(data, offset, version)
        if got is None:
            continue
        short += 1
        assert decode_body(ProduceResponse, data, version, offset) == got
    assert short > 0
