"""The requests and responses shmprod speaks, in both directions.

One module per API (``api_versions``, ``metadata``, ``produce``, ``init_producer_id``,
``create_topics``) declares its dataclasses with version-gated fields (see
:mod:`.schema`); :mod:`.codec` turns them into whole frames and back.
"""

from __future__ import annotations

from shmprod.protocol.frames import UnsupportedVersionError
from shmprod.protocol.messages.api_versions import (
    ApiVersion,
    ApiVersionsRequest,
    ApiVersionsResponse,
    FinalizedFeatureKey,
    SupportedFeatureKey,
)
from shmprod.protocol.messages.codec import (
    REQUEST_TYPES,
    RESPONSE_TYPES,
    SUPPORTED_VERSIONS,
    choose_version,
    decode_request,
    decode_response,
    encode_produce_request,
    encode_produce_request_segments,
    encode_request,
    encode_request_segments,
    encode_response,
    negotiate_versions,
)
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
    "Segment",
    "Struct",
    "SupportedFeatureKey",
    "TopicProduceData",
    "TopicProduceResponse",
    "UnsupportedVersionError",
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
]
