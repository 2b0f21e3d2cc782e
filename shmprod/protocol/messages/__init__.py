"""The requests and responses shmprod speaks, in both directions.

One module per API (``api_versions``, ``metadata``, ``produce``, ``init_producer_id``,
``create_topics``, ``fetch``, ``sasl``) declares its dataclasses with version-gated
fields (see :mod:`.schema`); :mod:`.codec` turns them into whole frames and back. The
versions of each are in :data:`shmprod.protocol.frames.SUPPORTED_VERSIONS`;
``create_topics``, ``fetch`` and ``sasl``, which a producer without SASL never sends,
load at first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shmprod.protocol.frames import SUPPORTED_VERSIONS, UnsupportedVersionError
from shmprod.protocol.messages.api_versions import (
    ApiVersion,
    ApiVersionsRequest,
    ApiVersionsResponse,
    FinalizedFeatureKey,
    SupportedFeatureKey,
    VersionsHandshake,
)
from shmprod.protocol.messages.codec import (
    choose_version,
    decode_request,
    decode_response,
    encode_produce_request,
    encode_produce_request_segments,
    encode_request,
    encode_request_segments,
    encode_response,
    negotiate_versions,
    version_for,
)
from shmprod.protocol.messages.init_producer_id import (
    InitProducerIdRequest,
    InitProducerIdResponse,
)
from shmprod.protocol.messages.metadata import (
    MetadataRequest,
    MetadataRequestTopic,
    MetadataResponse,
    MetadataResponseBroker,
    MetadataResponsePartition,
    MetadataResponseTopic,
)
from shmprod.protocol.messages.produce import (
    BatchIndexAndErrorMessage,
    LeaderIdAndEpoch,
    NodeEndpoint,
    PartitionProduceData,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    TopicProduceData,
    TopicProduceResponse,
)
from shmprod.protocol.messages.schema import (
    Message,
    RecordsBuffer,
    Request,
    Response,
    Segment,
    Struct,
    decode_body,
    encode_body,
)

if TYPE_CHECKING:
    from shmprod.protocol.messages.codec import REQUEST_TYPES, RESPONSE_TYPES
    from shmprod.protocol.messages.create_topics import (
        CreatableReplicaAssignment,
        CreatableTopic,
        CreatableTopicConfig,
        CreatableTopicConfigs,
        CreatableTopicResult,
        CreateTopicsRequest,
        CreateTopicsResponse,
    )
    from shmprod.protocol.messages.fetch import (
        AbortedTransaction,
        FetchableTopicResponse,
        FetchPartition,
        FetchRequest,
        FetchResponse,
        FetchTopic,
        ForgottenTopic,
        PartitionData,
    )
    from shmprod.protocol.messages.sasl import (
        SaslAuthenticateRequest,
        SaslAuthenticateResponse,
        SaslHandshakeRequest,
        SaslHandshakeResponse,
    )


def __getattr__(name: str) -> object:
    """The names above imported only for type checking, loaded at first use: the
    registries of every API and the codecs of the APIs a producer's processes never
    speak (Fetch, CreateTopics; SASL's unless its ``security_protocol`` says so; see
    ``codec._registries``)."""
    import importlib

    if name in __all__:
        for module in ("codec", "create_topics", "fetch", "sasl"):
            found = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
            if found is not None:
                globals()[name] = found
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REQUEST_TYPES",
    "RESPONSE_TYPES",
    "SUPPORTED_VERSIONS",
    "AbortedTransaction",
    "ApiVersion",
    "ApiVersionsRequest",
    "ApiVersionsResponse",
    "BatchIndexAndErrorMessage",
    "CreatableReplicaAssignment",
    "CreatableTopic",
    "CreatableTopicConfig",
    "CreatableTopicConfigs",
    "CreatableTopicResult",
    "CreateTopicsRequest",
    "CreateTopicsResponse",
    "FetchPartition",
    "FetchRequest",
    "FetchResponse",
    "FetchTopic",
    "FetchableTopicResponse",
    "FinalizedFeatureKey",
    "ForgottenTopic",
    "InitProducerIdRequest",
    "InitProducerIdResponse",
    "LeaderIdAndEpoch",
    "Message",
    "MetadataRequest",
    "MetadataRequestTopic",
    "MetadataResponse",
    "MetadataResponseBroker",
    "MetadataResponsePartition",
    "MetadataResponseTopic",
    "NodeEndpoint",
    "PartitionData",
    "PartitionProduceData",
    "PartitionProduceResponse",
    "ProduceRequest",
    "ProduceResponse",
    "RecordsBuffer",
    "Request",
    "Response",
    "SaslAuthenticateRequest",
    "SaslAuthenticateResponse",
    "SaslHandshakeRequest",
    "SaslHandshakeResponse",
    "Segment",
    "Struct",
    "SupportedFeatureKey",
    "TopicProduceData",
    "TopicProduceResponse",
    "UnsupportedVersionError",
    "VersionsHandshake",
    "choose_version",
    "decode_body",
    "decode_request",
    "decode_response",
    "encode_body",
    "encode_produce_request",
    "encode_produce_request_segments",
    "encode_request",
    "encode_request_segments",
    "encode_response",
    "negotiate_versions",
    "version_for",
]
