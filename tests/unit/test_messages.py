"""Requests and responses: round trips, bytes derived by hand, kafka-python parity, framing."""

from __future__ import annotations

import functools
import itertools
import json
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.errors import DecodeError, EncodeError, KafkaError, ProtocolError
from shmprod.protocol import error_codes
from shmprod.protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FIRST_FLEXIBLE_VERSION,
    NEVER_FLEXIBLE,
    ApiKey,
    FrameDecoder,
    UnsupportedVersionError,
    build_request_frame,
    build_response_frame,
    decode_request_header,
    decode_response_header,
    is_flexible,
    peek_correlation_id,
    request_header_version,
    response_header_version,
)
from shmprod.protocol.messages import (
    REQUEST_TYPES,
    RESPONSE_TYPES,
    SUPPORTED_VERSIONS,
    ApiVersion,
    ApiVersionsRequest,
    ApiVersionsResponse,
    CreatableReplicaAssignment,
    CreatableTopic,
    CreatableTopicConfig,
    CreatableTopicResult,
    CreateTopicsRequest,
    CreateTopicsResponse,
    FetchRequest,
    FetchResponse,
    InitProducerIdRequest,
    InitProducerIdResponse,
    LeaderIdAndEpoch,
    Message,
    MetadataRequest,
    MetadataRequestTopic,
    MetadataResponse,
    MetadataResponseBroker,
    MetadataResponsePartition,
    MetadataResponseTopic,
    NodeEndpoint,
    PartitionProduceData,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    Request,
    Response,
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
    Struct,
    TopicProduceData,
    TopicProduceResponse,
    VersionsHandshake,
    choose_version,
    decode_body,
    decode_request,
    decode_response,
    encode_body,
    encode_produce_request,
    encode_produce_request_segments,
    encode_request,
    encode_request_segments,
    encode_response,
    negotiate_versions,
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

with warnings.catch_warnings():
    # kafka-python 3 loads its JSON schemas with a deprecated importlib call at import.
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.protocol import admin as kp_admin
    from kafka.protocol import metadata as kp_metadata
    from kafka.protocol import producer as kp_producer
    from kafka.protocol import sasl as kp_sasl
    from kafka.protocol import schemas as kp_schemas
    from kafka.protocol.consumer import fetch as kp_fetch

MESSAGE_TYPES: list[type[Message]] = [*REQUEST_TYPES.values(), *RESPONSE_TYPES.values()]
CASES = [(cls, v) for cls in MESSAGE_TYPES for v in range(cls.VERSIONS[0], cls.VERSIONS[1] + 1)]
CASE_IDS = [f"{cls.__name__}-v{v}" for cls, v in CASES]


def h(text: str) -> bytes:
    """Bytes from hex with spaces and ``|`` separators (to annotate hand-made vectors)."""
    return bytes.fromhex(text.replace("|", " "))


# ---------------------------------------------------------------------------
# Strategies derived from the field declarations
# ---------------------------------------------------------------------------

_SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "int8": st.integers(-(2**7), 2**7 - 1),
    "int16": st.integers(-(2**15), 2**15 - 1),
    "int32": st.integers(-(2**31), 2**31 - 1),
    "int64": st.integers(-(2**63), 2**63 - 1),
    "bool": st.booleans(),
    "uuid": st.uuids() | st.just(uuid.UUID(int=0)),
}


def value_strategy(
    kind: Kind, version: int, flexible: bool, nullable: bool, unknown_tags: bool
) -> st.SearchStrategy[Any]:
    """Values of one wire type."""
    s: st.SearchStrategy[Any]
    if isinstance(kind, ScalarKind):
        s = _SCALARS[kind.name]
    elif isinstance(kind, StringKind):
        s = st.text(max_size=10)
    elif isinstance(kind, RecordsKind):
        s = st.binary(max_size=30)
    elif isinstance(kind, ArrayKind):
        s = st.lists(value_strategy(kind.item, version, flexible, False, unknown_tags), max_size=3)
    elif isinstance(kind, StructKind):
        s = struct_strategy(kind.cls, version, flexible, unknown_tags)
    else:
        raise AssertionError(kind)
    return st.none() | s if nullable else s


@functools.cache
def struct_strategy(
    cls: type[Struct], version: int, flexible: bool, unknown_tags: bool = True
) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` with only the fields that exist at ``version`` set."""
    kwargs: dict[str, st.SearchStrategy[Any]] = {}
    known_tags = set()
    for name, spec in schema_fields(cls):
        if not spec.present(version) or (spec.tag is not None and not flexible):
            continue
        if spec.tag is not None:
            known_tags.add(spec.tag)
        kwargs[name] = value_strategy(
            spec.kind, version, flexible, spec.nullable(version), unknown_tags
        )
    if flexible and unknown_tags:
        kwargs["unknown_tags"] = st.dictionaries(
            st.integers(0, 40).filter(lambda t: t not in known_tags),
            st.binary(max_size=6),
            max_size=2,
        )
    return st.builds(cls, **kwargs)


def message_strategy(
    cls: type[Message], version: int, unknown_tags: bool = True
) -> st.SearchStrategy[Any]:
    return struct_strategy(cls, version, is_flexible(cls.API_KEY, version), unknown_tags)


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "version"), CASES, ids=CASE_IDS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_body_and_frame_round_trip(cls: type[Message], version: int, data: st.DataObject) -> None:
    """encode -> decode gives the message back, as a bare body and as a whole frame."""
    msg = data.draw(message_strategy(cls, version))
    body = encode_body(msg, version)
    assert decode_body(cls, body, version) == msg

    correlation_id = data.draw(st.integers(-(2**31), 2**31 - 1))
    if isinstance(msg, Request):
        client_id = data.draw(st.none() | st.text(max_size=8))
        frame = encode_request(msg, version, correlation_id, client_id)
        assert frame == build_request_frame(msg.API_KEY, version, correlation_id, client_id, body)
        [payload] = FrameDecoder().feed(frame)
        header, decoded = decode_request(payload)
        assert (header.api_key, header.api_version) == (msg.API_KEY, version)
        assert (header.correlation_id, header.client_id) == (correlation_id, client_id)
        assert decoded == msg
    else:
        assert isinstance(msg, Response)
        frame = encode_response(msg, version, correlation_id)
        assert frame == build_response_frame(msg.API_KEY, version, correlation_id, body)
        [payload] = FrameDecoder().feed(frame)
        assert peek_correlation_id(payload) == correlation_id
        assert decode_response(type(msg), payload, version) == (correlation_id, msg)


@pytest.mark.parametrize(("cls", "version"), CASES, ids=CASE_IDS)
def test_trailing_bytes_are_rejected(cls: type[Message], version: int) -> None:
    body = encode_body(cls(), version)
    assert decode_body(cls, body, version) == cls()
    with pytest.raises(DecodeError, match="trailing"):
        decode_body(cls, body + b"\x00", version)


def test_fields_absent_at_a_version_get_their_defaults() -> None:
    full = PartitionProduceResponse(
        index=1, error_code=0, base_offset=5, log_append_time_ms=7, log_start_offset=2
    )
    resp = ProduceResponse(responses=[TopicProduceResponse(name="t", partition_responses=[full])])
    _, back = decode_response(ProduceResponse, encode_response(resp, 4, 1)[4:], 4)
    part = back.responses[0].partition_responses[0]
    assert (part.log_append_time_ms, part.log_start_offset) == (7, -1)


# ---------------------------------------------------------------------------
# Parity with an independent implementation (kafka-python, generated from Kafka's JSON)
# ---------------------------------------------------------------------------

KP_CLASSES: dict[type[Message], Any] = {
    ProduceRequest: kp_producer.ProduceRequest,
    ProduceResponse: kp_producer.ProduceResponse,
    FetchRequest: kp_fetch.FetchRequest,
    FetchResponse: kp_fetch.FetchResponse,
    InitProducerIdRequest: kp_producer.InitProducerIdRequest,
    InitProducerIdResponse: kp_producer.InitProducerIdResponse,
    MetadataRequest: kp_metadata.MetadataRequest,
    MetadataResponse: kp_metadata.MetadataResponse,
    ApiVersionsRequest: kp_metadata.ApiVersionsRequest,
    ApiVersionsResponse: kp_metadata.ApiVersionsResponse,
    CreateTopicsRequest: kp_admin.CreateTopicsRequest,
    CreateTopicsResponse: kp_admin.CreateTopicsResponse,
    SaslHandshakeRequest: kp_sasl.SaslHandshakeRequest,
    SaslHandshakeResponse: kp_sasl.SaslHandshakeResponse,
    SaslAuthenticateRequest: kp_sasl.SaslAuthenticateRequest,
    SaslAuthenticateResponse: kp_sasl.SaslAuthenticateResponse,
}


# kafka-python renames these two Metadata fields.
KP_RENAMED = {
    "topic_authorized_operations": "authorized_operations",
    "cluster_authorized_operations": "authorized_operations",
}


def _kp_name(name: str) -> str:
    return KP_RENAMED.get(name, name)


def _to_bits(v: int) -> set[int] | None:
    """Our int32 authorized-operations value as kafka-python's set of bit indices."""
    return None if v == -(2**31) else {i for i in range(32) if (v >> i) & 1}


def _from_bits(bits: set[int] | None) -> int:
    u = sum(1 << i for i in bits) if bits is not None else 2**31
    return u - 2**32 if u >= 2**31 else u


def _present(cls: type[Struct], version: int, flexible: bool) -> list[tuple[str, Kind]]:
    return [
        (name, spec.kind)
        for name, spec in schema_fields(cls)
        if spec.present(version) and (spec.tag is None or flexible)
    ]


def to_kp(value: Any, kind: Kind, kp_owner: Any, version: int, flexible: bool) -> Any:
    """Our value as kafka-python wants it (nested structs are classes of their parent)."""
    if value is None:
        return None
    if isinstance(kind, ArrayKind):
        return [to_kp(v, kind.item, kp_owner, version, flexible) for v in value]
    if isinstance(kind, StructKind):
        is_top = kp_owner.__name__ == kind.cls.__name__
        kp_cls = kp_owner if is_top else getattr(kp_owner, kind.cls.__name__)
        return kp_cls(
            version=version,
            **{
                _kp_name(name): _to_bits(getattr(value, name))
                if name in KP_RENAMED
                else to_kp(getattr(value, name), k, kp_cls, version, flexible)
                for name, k in _present(kind.cls, version, flexible)
            },
        )
    if isinstance(kind, RecordsKind):
        return bytes(value)
    return value


def from_kp(value: Any, kind: Kind, version: int, flexible: bool) -> Any:
    """A kafka-python value as ours."""
    if value is None:
        # kafka-python decodes the all-zero uuid as None.
        return uuid.UUID(int=0) if isinstance(kind, ScalarKind) and kind.name == "uuid" else None
    if isinstance(kind, ArrayKind):
        return [from_kp(v, kind.item, version, flexible) for v in value]
    if isinstance(kind, StructKind):
        return kind.cls(
            **{
                name: _from_bits(getattr(value, _kp_name(name)))
                if name in KP_RENAMED
                else from_kp(getattr(value, name), k, version, flexible)
                for name, k in _present(kind.cls, version, flexible)
            }
        )
    if isinstance(kind, RecordsKind):
        return bytes(value)
    return value


@pytest.mark.parametrize(("cls", "version"), CASES, ids=CASE_IDS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_kafka_python_reads_what_we_write_and_writes_what_we_read(
    cls: type[Message], version: int, data: st.DataObject
) -> None:
    msg = data.draw(message_strategy(cls, version, unknown_tags=False))
    if isinstance(msg, ApiVersionsResponse):
        msg.error_code = 0  # kafka-python decodes any error answer as version 0
    flexible = is_flexible(cls.API_KEY, version)
    kp_cls = KP_CLASSES[cls]
    kind = StructKind(cls)
    ours = encode_body(msg, version)

    theirs_decoded = kp_cls.decode(ours, version=version)
    assert from_kp(theirs_decoded, kind, version, flexible) == msg

    kp_msg = to_kp(msg, kind, kp_cls, version, flexible)
    theirs = bytes(kp_msg.encode(version=version))
    assert theirs == ours


# ---------------------------------------------------------------------------
# Field declarations against Kafka's own JSON schemas (the copy kafka-python ships)
# ---------------------------------------------------------------------------

KAFKA_SCHEMA_DIR = Path(kp_schemas.__file__).parent / "resources"


def load_kafka_schema(name: str) -> Any:
    """A Kafka message schema, its ``//`` comment lines removed."""
    text = (KAFKA_SCHEMA_DIR / f"{name}.json").read_text(encoding="utf-8")
    return json.loads(re.sub(r"(?m)^\s*//.*$", "", text))


def in_range(spec: str, version: int) -> bool:
    """Whether ``version`` is in a JSON version range ("3+", "0-12", "5", "none")."""
    if spec == "none":
        return False
    if spec.endswith("+"):
        return version >= int(spec[:-1])
    lo, _, hi = spec.partition("-")
    return int(lo) <= version <= int(hi or lo)


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def json_type(type_name: str) -> str:
    if type_name.startswith("[]"):
        return "[]" + json_type(type_name[2:])
    if type_name in ("bytes", "records"):
        return "records"
    return "struct" if type_name[0].isupper() else type_name


def our_type(kind: Kind) -> str:
    if isinstance(kind, ArrayKind):
        return "[]" + our_type(kind.item)
    return "struct" if isinstance(kind, StructKind) else kind.name


def assert_fields_match(json_fields: list[Any], cls: type[Struct], version: int, path: str) -> None:
    """Same fields, order, types, nullability and tags at ``version``, recursively."""
    ours = {name: spec for name, spec in schema_fields(cls) if spec.present(version)}
    theirs = [f for f in json_fields if in_range(f["versions"], version)]
    assert [snake(f["name"]) for f in theirs if "tag" not in f] == [
        name for name, spec in ours.items() if spec.tag is None
    ], f"{path} v{version}: untagged fields differ"
    assert {snake(f["name"]) for f in theirs} == set(ours), f"{path} v{version}"
    for f in theirs:
        name = snake(f["name"])
        spec = ours[name]
        where = f"{path}.{name} v{version}"
        assert our_type(spec.kind) == json_type(f["type"]), where
        assert spec.nullable(version) == in_range(f.get("nullableVersions", "none"), version), where
        assert spec.tag == f.get("tag"), where
        if "tag" in f:
            assert in_range(f["taggedVersions"], version), where
        if "fields" in f:
            kind = spec.kind.item if isinstance(spec.kind, ArrayKind) else spec.kind
            assert isinstance(kind, StructKind), where
            assert_fields_match(f["fields"], kind.cls, version, f"{path}.{name}")


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_declarations_match_kafka_json_schemas(cls: type[Message]) -> None:
    schema = load_kafka_schema(cls.__name__)
    assert schema["apiKey"] == cls.API_KEY
    # Kafka 4 dropped CreateTopics v0-1, which older brokers still speak: only the
    # newest version we use must still be valid.
    assert in_range(schema["validVersions"], cls.VERSIONS[1])
    first_flexible = FIRST_FLEXIBLE_VERSION[cls.API_KEY]
    expected = "none" if first_flexible == NEVER_FLEXIBLE else f"{first_flexible}+"
    assert schema["flexibleVersions"] == expected
    for version in range(cls.VERSIONS[0], cls.VERSIONS[1] + 1):
        assert_fields_match(schema["fields"], cls, version, cls.__name__)


# ---------------------------------------------------------------------------
# Bytes derived by hand from the Kafka protocol guide and the JSON schemas
# ---------------------------------------------------------------------------


def test_api_versions_v0_request_frame() -> None:
    frame = encode_request(ApiVersionsRequest(), 0, 1, "ab")
    # size 12 | api_key 18 | version 0 | correlation 1 | client_id "ab" | empty body
    assert frame == h("0000000c | 0012 | 0000 | 00000001 | 0002 6162")


def test_api_versions_v3_request_frame() -> None:
    req = ApiVersionsRequest(client_software_name="shm", client_software_version="1.0")
    frame = encode_request(req, 3, 7, None)
    assert frame == h(
        "00000014"  # size 20
        "| 0012 0003 00000007 ffff 00"  # header v2: null client id (int16), no tags
        "| 04 73686d | 04 312e30 | 00"  # compact "shm", compact "1.0", no tags
    )


def test_metadata_v1_and_v12_request_bodies() -> None:
    req = MetadataRequest(topics=[MetadataRequestTopic(name="t")])
    assert encode_body(req, 1) == h("00000001 | 0001 74")
    assert encode_body(req, 4) == h("00000001 | 0001 74 | 01")
    assert encode_body(MetadataRequest(topics=None), 1) == h("ffffffff")
    assert encode_body(req, 8) == h("00000001 | 0001 74 | 01 | 00 | 00")
    assert encode_body(req, 12) == h(
        "02"  # compact array of 1
        "| 00000000000000000000000000000000 | 02 74 | 00"  # topic id, name, tags
        "| 01 | 00 | 00"  # allow auto creation, topic authorized ops, tags
    )
    by_id = MetadataRequest(topics=[MetadataRequestTopic(topic_id=uuid.UUID(int=1), name=None)])
    assert encode_body(by_id, 12) == h("02 | 00000000000000000000000000000001 | 00 | 00 | 010000")
    with pytest.raises(EncodeError):
        encode_body(by_id, 9)  # name not nullable before v10


def test_produce_v3_request_frame() -> None:
    req = ProduceRequest(
        acks=-1,
        timeout_ms=30000,
        topic_data=[
            TopicProduceData(
                name="t", partition_data=[PartitionProduceData(index=2, records=b"abc")]
            )
        ],
    )
    assert encode_produce_request(req, 3, 5, "c") == h(
        "00000029"  # size 41
        "| 0000 0003 00000005 0001 63"  # header v1
        "| ffff | ffff | 00007530"  # null transactional id, acks -1, timeout 30000
        "| 00000001 | 0001 74"  # 1 topic "t"
        "| 00000001 | 00000002 | 00000003 616263"  # 1 partition: index 2, records
    )


def test_produce_v9_request_body() -> None:
    req = ProduceRequest(
        transactional_id="x",
        acks=1,
        timeout_ms=1000,
        topic_data=[
            TopicProduceData(
                name="t",
                partition_data=[
                    PartitionProduceData(index=0, records=b"ab"),
                    PartitionProduceData(index=1, records=None),
                ],
            )
        ],
    )
    assert encode_body(req, 9) == h(
        "02 78 | 0001 | 000003e8"  # compact "x", acks 1, timeout 1000
        "| 02 | 02 74"  # compact array of 1 topic, compact "t"
        "| 03 | 00000000 03 6162 00 | 00000001 00 00"  # 2 partitions, each with tags
        "| 00 | 00"  # topic tags, request tags
    )


def test_init_producer_id_request_bodies() -> None:
    req = InitProducerIdRequest(transaction_timeout_ms=60000)
    assert encode_body(req, 0) == h("ffff | 0000ea60")
    assert encode_body(req, 2) == h("00 | 0000ea60 | 00")
    bump = InitProducerIdRequest(transaction_timeout_ms=1, producer_id=42, producer_epoch=3)
    assert encode_body(bump, 4) == h("00 | 00000001 | 000000000000002a | 0003 | 00")
    assert encode_body(InitProducerIdRequest(), 1) == h("ffff 7fffffff")


def test_init_producer_id_response_bytes() -> None:
    data = h("00000000 | 0000 | 0000000000000007 | 0001 | 00")
    assert decode_body(InitProducerIdResponse, data, 4) == InitProducerIdResponse(
        throttle_time_ms=0, error_code=0, producer_id=7, producer_epoch=1
    )


def test_create_topics_request_bodies() -> None:
    req = CreateTopicsRequest(
        topics=[
            CreatableTopic(
                name="t",
                num_partitions=3,
                replication_factor=1,
                assignments=[CreatableReplicaAssignment(partition_index=0, broker_ids=[1])],
                configs=[CreatableTopicConfig(name="a", value=None)],
            )
        ],
        timeout_ms=1000,
        validate_only=True,
    )
    assert encode_body(req, 0) == h(
        "00000001 | 0001 74 | 00000003 | 0001"  # 1 topic: "t", 3 partitions, rf 1
        "| 00000001 | 00000000 | 00000001 00000001"  # assignments: partition 0 -> [1]
        "| 00000001 | 0001 61 | ffff"  # configs: a=null
        "| 000003e8"  # timeout; no validate_only in v0
    )
    assert encode_body(req, 5) == h(
        "02 | 02 74 | 00000003 | 0001"
        "| 02 | 00000000 | 02 00000001 | 00"
        "| 02 | 02 61 | 00 | 00"
        "| 00"  # topic tags
        "| 000003e8 | 01 | 00"
    )


def test_create_topics_response_bytes() -> None:
    data = h(
        "00000000 | 02 | 02 74 | 0024 | 00"  # throttle, 1 topic "t", TOPIC_ALREADY_EXISTS, null msg
        "| 00000001 | 0001 | 01"  # partitions 1, rf 1, empty configs
        "| 01 00 02 0005"  # tags: topic_config_error_code (tag 0) = 5
        "| 00"
    )
    resp = decode_body(CreateTopicsResponse, data, 5)
    assert resp == CreateTopicsResponse(
        topics=[
            CreatableTopicResult(
                name="t",
                error_code=error_codes.TOPIC_ALREADY_EXISTS,
                topic_config_error_code=5,
                num_partitions=1,
                replication_factor=1,
                configs=[],
            )
        ]
    )


def test_produce_v10_response_with_leader_hints() -> None:
    data = h(
        "02 | 02 74 | 02"  # 1 topic "t", 1 partition
        "| 00000000 | 0006 | ffffffffffffffff"  # index 0, NOT_LEADER_OR_FOLLOWER, offset -1
        "| ffffffffffffffff | ffffffffffffffff"  # log append time, log start offset
        "| 01 | 00"  # no record errors, null error message
        "| 01 00 09 00000002 00000005 00"  # tag 0: current leader 2, epoch 5
        "| 00"  # topic tags
        "| 00000000"  # throttle
        "| 01 00 0d | 02 00000002 02 68 00002384 00 00"  # tag 0: node 2 at h:9092
    )
    resp = decode_body(ProduceResponse, data, 10)
    part = resp.responses[0].partition_responses[0]
    assert part.error_code == error_codes.NOT_LEADER_OR_FOLLOWER
    assert part.current_leader == LeaderIdAndEpoch(leader_id=2, leader_epoch=5)
    assert resp.node_endpoints == [NodeEndpoint(node_id=2, host="h", port=9092)]
    assert encode_body(resp, 10) == data


def test_unknown_tags_are_skipped_and_kept() -> None:
    data = h("00000000 | 0000 | 0000000000000007 | 0001 | 02 05 01 aa 07 00")
    resp = decode_body(InitProducerIdResponse, data, 2)
    assert resp.producer_id == 7
    assert resp.unknown_tags == {5: b"\xaa", 7: b""}
    assert encode_body(resp, 2) == data
    # A tag known only from a later version is unknown at this one.
    v9 = h("01 | 00000000 | 01 00 02 abcd")
    assert decode_body(ProduceResponse, v9, 9).unknown_tags == {0: b"\xab\xcd"}


def test_known_tag_with_bad_contents_is_rejected() -> None:
    data = h("01 | 00000000 | 01 00 02 0102")  # node_endpoints tag too short to be an array
    with pytest.raises(DecodeError):
        decode_body(ProduceResponse, data, 10)


def test_metadata_v12_response_bytes() -> None:
    topic_id = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
    data = h(
        "00000000"  # throttle
        "| 02 | 00000001 02 68 00002384 00 00"  # 1 broker: node 1 at h:9092, rack null
        "| 02 63 | 00000001"  # cluster id "c", controller 1
        "| 02 | 0000 | 02 74 | 00112233445566778899aabbccddeeff | 00"  # topic "t", not internal
        "| 02 | 0000 00000000 00000001 00000000 | 02 00000001 | 02 00000001 | 01 | 00"
        "| 80000000 | 00"  # topic authorized operations unknown, topic tags
        "| 00"
    )
    resp = decode_body(MetadataResponse, data, 12)
    assert resp == MetadataResponse(
        brokers=[MetadataResponseBroker(node_id=1, host="h", port=9092)],
        cluster_id="c",
        controller_id=1,
        topics=[
            MetadataResponseTopic(
                name="t",
                topic_id=topic_id,
                partitions=[
                    MetadataResponsePartition(
                        partition_index=0,
                        leader_id=1,
                        leader_epoch=0,
                        replica_nodes=[1],
                        isr_nodes=[1],
                    )
                ],
            )
        ],
    )
    assert encode_body(resp, 12) == data


def test_proxy_can_rewrite_metadata_to_several_brokers() -> None:
    """The fault-injecting proxy's use: decode, edit, re-encode at the same version."""
    original = MetadataResponse(
        brokers=[MetadataResponseBroker(node_id=0, host="127.0.0.1", port=9092)],
        topics=[
            MetadataResponseTopic(
                name="t",
                partitions=[
                    MetadataResponsePartition(partition_index=i, leader_id=0) for i in range(4)
                ],
            )
        ],
    )
    corr, resp = decode_response(MetadataResponse, encode_response(original, 9, 3)[4:], 9)
    resp.brokers = [
        MetadataResponseBroker(node_id=n, host="127.0.0.1", port=9100 + n) for n in range(2)
    ]
    for part in resp.topics[0].partitions:
        part.leader_id = part.partition_index % 2
    _, again = decode_response(MetadataResponse, encode_response(resp, 9, corr)[4:], 9)
    assert [b.port for b in again.brokers] == [9100, 9101]
    assert [p.leader_id for p in again.topics[0].partitions] == [0, 1, 0, 1]


# ---------------------------------------------------------------------------
# ApiVersions specifics and negotiation
# ---------------------------------------------------------------------------


def test_api_versions_response_header_is_always_v0() -> None:
    resp = ApiVersionsResponse(api_keys=[ApiVersion(api_key=0, min_version=3, max_version=11)])
    frame = encode_response(resp, 3, 9)
    assert frame[4:8] == h("00000009")
    assert frame[8:10] == h("0000")  # error code right after the correlation id
    assert response_header_version(ApiKey.API_VERSIONS, 3) == 0
    assert request_header_version(ApiKey.API_VERSIONS, 3) == 2
    assert decode_response(ApiVersionsResponse, frame[4:], 3) == (9, resp)


def test_api_versions_falls_back_to_v0_when_the_broker_is_older() -> None:
    """KIP-511: a broker answers a too-new ApiVersions request in version 0."""
    v0 = h("00000005 | 0023 | 00000001 | 0012 0000 0002")
    corr, resp = decode_response(ApiVersionsResponse, v0, 3)
    assert corr == 5
    assert resp.error_code == error_codes.UNSUPPORTED_VERSION
    assert resp.api_keys == [ApiVersion(api_key=18, min_version=0, max_version=2)]
    with pytest.raises(DecodeError):
        decode_response(ApiVersionsResponse, v0 + b"\x01", 3)
    with pytest.raises(DecodeError):
        decode_response(MetadataResponse, h("00000005 00"), 9)


def test_choose_version() -> None:
    assert choose_version(ApiKey.PRODUCE, 0, 11) == 11
    assert choose_version(ApiKey.PRODUCE, 0, 8) == 8
    assert choose_version(ApiKey.PRODUCE, 0, 13) == 11
    assert choose_version(ApiKey.METADATA, 5, 9, ours=(1, 6)) == 6
    with pytest.raises(UnsupportedVersionError) as info:
        choose_version(ApiKey.PRODUCE, 0, 2)
    assert info.value.api_key == ApiKey.PRODUCE
    assert isinstance(info.value, ProtocolError)
    with pytest.raises(UnsupportedVersionError):
        choose_version(ApiKey.PRODUCE, 12, 13)
    with pytest.raises(UnsupportedVersionError):
        choose_version(99, 0, 5)


def test_negotiate_versions() -> None:
    resp = ApiVersionsResponse(
        api_keys=[
            ApiVersion(api_key=k, min_version=0, max_version=20)
            for k in (0, 1, 3, 17, 18, 19, 22, 36, 50)
        ]
    )
    assert negotiate_versions(resp) == {k: hi for k, (_, hi) in SUPPORTED_VERSIONS.items()}
    assert negotiate_versions(resp, wanted=[0]) == {0: 11}
    resp.api_keys = resp.api_keys[1:]
    with pytest.raises(UnsupportedVersionError):
        negotiate_versions(resp)


def test_supported_versions_match_the_flexible_table() -> None:
    assert set(SUPPORTED_VERSIONS) == set(REQUEST_TYPES) == set(RESPONSE_TYPES)
    for key, (lo, hi) in SUPPORTED_VERSIONS.items():
        assert (lo, hi) == REQUEST_TYPES[key].VERSIONS == RESPONSE_TYPES[key].VERSIONS
        is_flexible(key, lo)  # the header table knows every supported API
    assert [v for v in range(3, 12) if is_flexible(ApiKey.PRODUCE, v)] == [9, 10, 11]


# ---------------------------------------------------------------------------
# Zero-copy Produce encoding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 8, 9, 11])
def test_produce_segments_pass_record_buffers_through(version: int) -> None:
    shared = bytearray(b"0123456789" * 10)
    as_view = memoryview(shared)[10:40]
    as_bytes = b"batch-two"
    req = ProduceRequest(
        topic_data=[
            TopicProduceData(
                name="a",
                partition_data=[
                    PartitionProduceData(index=0, records=as_view),
                    PartitionProduceData(index=1, records=as_bytes),
                    PartitionProduceData(index=2, records=b""),
                    PartitionProduceData(index=3, records=None),
                ],
            ),
            TopicProduceData(
                name="b", partition_data=[PartitionProduceData(index=0, records=shared)]
            ),
        ]
    )
    segments = encode_produce_request_segments(req, version, 11, "cli")
    assert segments[1] is as_view
    assert segments[3] is as_bytes
    spliced = segments[5]
    assert isinstance(spliced, memoryview) and spliced.obj is shared  # wrapped, not copied
    total = sum(len(s) for s in segments)
    assert int.from_bytes(segments[0][:4], "big") == total - 4
    frame = b"".join(segments)
    assert frame == encode_request(req, version, 11, "cli")
    header, back = decode_request(frame[4:])
    assert header.correlation_id == 11 and back == req
    records = back.topic_data[0].partition_data[0].records
    assert isinstance(records, memoryview) and records.obj is not None  # a view of the frame

    shared[10:12] = b"XY"  # the segments see later writes: nothing was copied
    assert bytes(segments[1][:2]) == b"XY"


def test_produce_records_must_be_contiguous_bytes() -> None:
    strided = memoryview(b"abcdef")[::2]
    req = ProduceRequest(
        topic_data=[
            TopicProduceData(
                name="a", partition_data=[PartitionProduceData(index=0, records=strided)]
            )
        ]
    )
    with pytest.raises(EncodeError):
        encode_produce_request_segments(req, 9, 1, None)


def test_multibyte_memoryview_records_are_sized_in_bytes() -> None:
    words = memoryview(bytearray(8)).cast("I")  # 2 items of 4 bytes
    req = ProduceRequest(
        topic_data=[
            TopicProduceData(
                name="a", partition_data=[PartitionProduceData(index=0, records=words)]
            )
        ]
    )
    segments = encode_request_segments(req, 9, 1, None)
    assert len(segments[1]) == 8
    _, back = decode_request(b"".join(segments)[4:])
    assert isinstance(back, ProduceRequest)
    assert bytes(back.topic_data[0].partition_data[0].records or b"") == bytes(8)


def test_expects_response() -> None:
    assert ProduceRequest(acks=-1).expects_response
    assert ProduceRequest(acks=1).expects_response
    assert not ProduceRequest(acks=0).expects_response


# ---------------------------------------------------------------------------
# Encoding errors
# ---------------------------------------------------------------------------


def test_bad_values_raise_encode_error() -> None:
    with pytest.raises(EncodeError):
        encode_body(ProduceRequest(acks=2**15), 9)
    with pytest.raises(EncodeError):
        encode_body(ProduceRequest(topic_data=[TopicProduceData(name=None)]), 9)  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        encode_body(MetadataRequest(topics=None, allow_auto_topic_creation=1), 9)  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        encode_body(CreateTopicsRequest(topics=[MetadataRequestTopic()]), 5)  # type: ignore[list-item]
    with pytest.raises(EncodeError):
        encode_body(InitProducerIdResponse(unknown_tags={-1: b""}), 2)
    collide = ProduceResponse(unknown_tags={0: b"\x01"})
    with pytest.raises(EncodeError):
        encode_body(collide, 10)
    assert decode_body(ProduceResponse, encode_body(collide, 9), 9) == collide


@pytest.mark.parametrize(("cls", "version"), [(ProduceRequest, 2), (ProduceRequest, 12)])
def test_unsupported_versions_are_refused(cls: type[Message], version: int) -> None:
    with pytest.raises(UnsupportedVersionError):
        encode_body(cls(), version)
    with pytest.raises(UnsupportedVersionError):
        decode_body(cls, b"", version)


def test_decode_request_refuses_unknown_apis() -> None:
    frame = build_request_frame(ApiKey.LIST_OFFSETS, 6, 1, None, b"")  # no codec for it
    with pytest.raises(UnsupportedVersionError):
        decode_request(frame[4:])
    with pytest.raises(UnsupportedVersionError):
        decode_request(h("0063 0000 00000001 ffff"))  # header version unknown
    with pytest.raises(UnsupportedVersionError):
        decode_request_header(h("0063 0000 00000001 ffff"))
    header = decode_request_header(h("0063 0000 00000001 ffff 00"), flexible=True)
    assert (header.api_key, header.body_offset) == (99, 11)


# ---------------------------------------------------------------------------
# Headers and frames
# ---------------------------------------------------------------------------


def test_request_header_v1_and_v2() -> None:
    v1 = build_request_frame(ApiKey.METADATA, 8, 3, "ab", b"\xaa")
    assert v1 == h("0000000d | 0003 0008 00000003 0002 6162 | aa")
    v2 = build_request_frame(ApiKey.METADATA, 9, 3, "ab", b"\xaa")
    assert v2 == h("0000000e | 0003 0009 00000003 0002 6162 00 | aa")  # client id not compact
    header = decode_request_header(v2[4:])
    assert header.body_offset == 13
    assert header.client_id == "ab"
    tagged = h("0003 0009 00000003 ffff 01 05 02 abcd | aa")
    assert decode_request_header(tagged).body_offset == 15


def test_response_header_v0_and_v1() -> None:
    assert build_response_frame(ApiKey.PRODUCE, 8, 4, b"\xaa") == h("00000005 00000004 aa")
    assert build_response_frame(ApiKey.PRODUCE, 9, 4, b"\xaa") == h("00000006 00000004 00 aa")
    assert decode_response_header(h("00000004 00 aa"), ApiKey.PRODUCE, 9) == (4, 5)
    assert decode_response_header(h("00000004 01 03 01 ff aa"), ApiKey.PRODUCE, 9) == (4, 8)
    assert decode_response_header(h("00000004 aa"), ApiKey.PRODUCE, 8) == (4, 4)
    with pytest.raises(DecodeError):
        decode_response_header(h("000000"), ApiKey.PRODUCE, 8)


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=8),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
)
def test_frame_decoder_with_random_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(len(x).to_bytes(4, "big") + x for x in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    decoder = FrameDecoder()
    out: list[bytes] = []
    for lo, hi in itertools.pairwise(bounds):
        out += decoder.feed(memoryview(stream)[lo:hi])
    assert out == payloads
    assert decoder.buffered == 0


def test_frame_decoder_byte_by_byte_and_partial_state() -> None:
    decoder = FrameDecoder()
    frame = h("00000003 616263")
    for b in frame[:-1]:
        assert decoder.feed(bytes([b])) == []
    assert decoder.buffered == len(frame) - 1
    assert decoder.feed(frame[-1:] + h("00000000 000000")) == [b"abc", b""]
    assert decoder.buffered == 3
    assert decoder.feed(b"") == []


def test_frame_decoder_rejects_bad_sizes() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    assert decoder.feed(h("0000000a") + bytes(10)) == [bytes(10)]
    with pytest.raises(DecodeError):
        decoder.feed(h("0000000b"))  # oversized: refused before its body arrives
    with pytest.raises(DecodeError):
        decoder.feed(h("00000000"))  # the stream cannot be resynchronised
    with pytest.raises(DecodeError):
        FrameDecoder().feed(h("ffffffff"))
    with pytest.raises(DecodeError):
        FrameDecoder().feed(h("80000000"))
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=-1)
    assert FrameDecoder().max_frame_size == DEFAULT_MAX_FRAME_SIZE


def test_frame_decoder_big_frame_in_many_chunks() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    decoder = FrameDecoder()
    stream = len(payload).to_bytes(4, "big") + payload
    out: list[bytes] = []
    for i in range(0, len(stream), 65536):
        out += decoder.feed(stream[i : i + 65536])
    assert out == [payload]


# ---------------------------------------------------------------------------------------
# The ApiVersions handshake (sans-IO; both connection kinds use it)
# ---------------------------------------------------------------------------------------


def _versions_answer(code: int, api_versions_max: int | None) -> ApiVersionsResponse:
    keys = (
        [] if api_versions_max is None else [ApiVersion(api_key=18, max_version=api_versions_max)]
    )
    keys.append(ApiVersion(api_key=0, min_version=3, max_version=9))
    return ApiVersionsResponse(error_code=code, api_keys=keys)


def test_the_handshake_takes_the_first_accepted_answer() -> None:
    hs = VersionsHandshake("b:1", "1.2.3")
    assert hs.version == 3
    req = hs.request()
    assert (req.client_software_name, req.client_software_version) == ("shmprod", "1.2.3")
    assert hs.answer(_versions_answer(0, 3)) == {18: (0, 3), 0: (3, 9)}


def test_the_handshake_steps_down_to_what_the_broker_speaks() -> None:
    hs = VersionsHandshake("b:1", "1")
    assert hs.answer(_versions_answer(error_codes.UNSUPPORTED_VERSION, 1)) is None
    assert hs.version == 1  # the broker's highest
    hs = VersionsHandshake("b:1", "1")
    assert hs.answer(_versions_answer(error_codes.UNSUPPORTED_VERSION, 7)) is None
    assert hs.version == 2  # a broker claiming more than it takes: one lower each round
    for _ in range(2):
        assert hs.answer(_versions_answer(error_codes.UNSUPPORTED_VERSION, 7)) is None
    assert hs.version == 0
    with pytest.raises(UnsupportedVersionError, match="b:1: no common ApiVersions version"):
        hs.answer(_versions_answer(error_codes.UNSUPPORTED_VERSION, 7))


def test_the_handshake_raises_other_answers() -> None:
    with pytest.raises(KafkaError) as info:
        VersionsHandshake("b:1", "1").answer(
            _versions_answer(error_codes.UNSUPPORTED_VERSION, None)
        )
    assert info.value.code == error_codes.UNSUPPORTED_VERSION  # without a range to step to
    with pytest.raises(KafkaError, match="ApiVersions from b:1"):
        VersionsHandshake("b:1", "1").answer(_versions_answer(58, 3))
