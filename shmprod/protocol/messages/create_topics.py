"""CreateTopics (key 19), versions 0-7: create topics (tests, the demo, the CLI).

Schema: ``CreateTopicsRequest.json`` / ``CreateTopicsResponse.json`` in apache/kafka.
v1 adds ``validate_only``; v4 lets ``num_partitions`` / ``replication_factor`` be -1
(broker default); v5 is the first flexible version and returns the topic's configs;
v7 returns its id.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).
# ruff: noqa: RUF009

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import ClassVar

from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey
from shmprod.protocol.messages.schema import (
    BOOL,
    INT8,
    INT16,
    INT32,
    STRING,
    UUID,
    ZERO_UUID,
    Request,
    Response,
    Struct,
    array,
    fld,
)


@dataclass(kw_only=True, slots=True)
class CreatableReplicaAssignment(Struct):
    """The brokers to place one partition's replicas on."""

    partition_index: int = fld(INT32, "0+")
    broker_ids: list[int] = fld(array(INT32), "0+")


@dataclass(kw_only=True, slots=True)
class CreatableTopicConfig(Struct):
    """A topic config to set at creation."""

    name: str = fld(STRING, "0+")
    value: str | None = fld(STRING, "0+", nullable="0+", default=None)


@dataclass(kw_only=True, slots=True)
class CreatableTopic(Struct):
    """A topic to create; -1 partitions / replication factor mean the broker default."""

    name: str = fld(STRING, "0+")
    num_partitions: int = fld(INT32, "0+", default=-1)
    replication_factor: int = fld(INT16, "0+", default=-1)
    assignments: list[CreatableReplicaAssignment] = fld(array(CreatableReplicaAssignment), "0+")
    configs: list[CreatableTopicConfig] = fld(array(CreatableTopicConfig), "0+")


@dataclass(kw_only=True, slots=True)
class CreateTopicsRequest(Request):
    """Topics to create, and how long the broker may take."""

    API_KEY: ClassVar[int] = ApiKey.CREATE_TOPICS
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.CREATE_TOPICS]

    topics: list[CreatableTopic] = fld(array(CreatableTopic), "0+")
    timeout_ms: int = fld(INT32, "0+", default=60_000)
    validate_only: bool = fld(BOOL, "1+")


@dataclass(kw_only=True, slots=True)
class CreatableTopicConfigs(Struct):
    """A config of a created topic, as the broker reports it (v5+)."""

    name: str = fld(STRING, "5+")
    value: str | None = fld(STRING, "5+", nullable="5+", default=None)
    read_only: bool = fld(BOOL, "5+")
    config_source: int = fld(INT8, "5+", default=-1)
    is_sensitive: bool = fld(BOOL, "5+")


@dataclass(kw_only=True, slots=True)
class CreatableTopicResult(Struct):
    """The outcome for one topic."""

    name: str = fld(STRING, "0+")
    topic_id: uuid.UUID = fld(UUID, "7+", default=ZERO_UUID)
    error_code: int = fld(INT16, "0+")
    error_message: str | None = fld(STRING, "1+", nullable="0+", default=None)
    topic_config_error_code: int = fld(INT16, "5+", tag=0)
    num_partitions: int = fld(INT32, "5+", default=-1)
    replication_factor: int = fld(INT16, "5+", default=-1)
    configs: list[CreatableTopicConfigs] | None = fld(
        array(CreatableTopicConfigs), "5+", nullable="5+"
    )


@dataclass(kw_only=True, slots=True)
class CreateTopicsResponse(Response):
    """Per-topic outcomes of a create request."""

    API_KEY: ClassVar[int] = ApiKey.CREATE_TOPICS
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.CREATE_TOPICS]

    throttle_time_ms: int = fld(INT32, "2+")
    topics: list[CreatableTopicResult] = fld(array(CreatableTopicResult), "0+")
