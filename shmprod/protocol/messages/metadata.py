"""Metadata (key 3), versions 1-12: brokers, topics, partitions and their leaders.

Schema: ``MetadataRequest.json`` / ``MetadataResponse.json`` in apache/kafka. Version 9
is the first flexible one; 10 adds topic ids; 12 lets a topic be asked for by id (then
its name may be null).
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

AUTHORIZED_OPERATIONS_UNKNOWN = -(2**31)
"""The ``*_authorized_operations`` value meaning "not requested" (INT32_MIN)."""


@dataclass(kw_only=True, slots=True)
class MetadataRequestTopic(Struct):
    """One topic to describe: by name, or from v12 by id (name null)."""

    topic_id: uuid.UUID = fld(UUID, "10+", default=ZERO_UUID)
    name: str | None = fld(STRING, "0+", nullable="10+")


@dataclass(kw_only=True, slots=True)
class MetadataRequest(Request):
    """``topics=None`` asks for every topic; an empty list asks for none (brokers only)."""

    API_KEY: ClassVar[int] = ApiKey.METADATA
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.METADATA]

    topics: list[MetadataRequestTopic] | None = fld(
        array(MetadataRequestTopic), "0+", nullable="1+"
    )
    allow_auto_topic_creation: bool = fld(BOOL, "4+", default=True)
    include_cluster_authorized_operations: bool = fld(BOOL, "8-10")
    include_topic_authorized_operations: bool = fld(BOOL, "8+")


@dataclass(kw_only=True, slots=True)
class MetadataResponseBroker(Struct):
    """A broker of the cluster and where to reach it."""

    node_id: int = fld(INT32, "0+")
    host: str = fld(STRING, "0+")
    port: int = fld(INT32, "0+")
    rack: str | None = fld(STRING, "1+", nullable="1+", default=None)


@dataclass(kw_only=True, slots=True)
class MetadataResponsePartition(Struct):
    """One partition: its leader, epoch and replicas."""

    error_code: int = fld(INT16, "0+")
    partition_index: int = fld(INT32, "0+")
    leader_id: int = fld(INT32, "0+")
    leader_epoch: int = fld(INT32, "7+", default=-1)
    replica_nodes: list[int] = fld(array(INT32), "0+")
    isr_nodes: list[int] = fld(array(INT32), "0+")
    offline_replicas: list[int] = fld(array(INT32), "5+")


@dataclass(kw_only=True, slots=True)
class MetadataResponseTopic(Struct):
    """One topic: its error, id and partitions."""

    error_code: int = fld(INT16, "0+")
    name: str | None = fld(STRING, "0+", nullable="12+")
    topic_id: uuid.UUID = fld(UUID, "10+", default=ZERO_UUID)
    is_internal: bool = fld(BOOL, "1+")
    partitions: list[MetadataResponsePartition] = fld(array(MetadataResponsePartition), "0+")
    topic_authorized_operations: int = fld(INT32, "8+", default=AUTHORIZED_OPERATIONS_UNKNOWN)


@dataclass(kw_only=True, slots=True)
class MetadataResponse(Response):
    """The cluster's brokers, controller and the topics asked for."""

    API_KEY: ClassVar[int] = ApiKey.METADATA
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.METADATA]

    throttle_time_ms: int = fld(INT32, "3+")
    brokers: list[MetadataResponseBroker] = fld(array(MetadataResponseBroker), "0+")
    cluster_id: str | None = fld(STRING, "2+", nullable="2+", default=None)
    controller_id: int = fld(INT32, "1+", default=-1)
    topics: list[MetadataResponseTopic] = fld(array(MetadataResponseTopic), "0+")
    cluster_authorized_operations: int = fld(INT32, "8-10", default=AUTHORIZED_OPERATIONS_UNKNOWN)
