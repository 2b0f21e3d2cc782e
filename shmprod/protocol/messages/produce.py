"""Produce (key 0), versions 3-11: record batches in, base offsets out.

Schema: ``ProduceRequest.json`` / ``ProduceResponse.json`` in apache/kafka. v3 brings
RecordBatch v2 and the transactional id; v7 zstd; v8 per-record errors; v9 is the first
flexible version; v10 adds the ``current_leader`` / ``node_endpoints`` hints (KIP-951)
to NOT_LEADER_OR_FOLLOWER answers. A v3+ request carries exactly one record batch per
partition. With ``acks=0`` the broker sends no response at all.

``records`` are never copied: encode them with
:func:`shmprod.protocol.messages.encode_request_segments` to send them straight from
the buffer they were built in; a decoded request holds memoryviews into its input.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey
from shmprod.protocol.messages.schema import (
    INT16,
    INT32,
    INT64,
    RECORDS,
    STRING,
    RecordsBuffer,
    Request,
    Response,
    Struct,
    array,
    fld,
)


@dataclass(kw_only=True, slots=True)
class PartitionProduceData(Struct):
    """One partition's record batch (exactly one batch in v3+)."""

    index: int = fld(INT32, "0+")
    records: RecordsBuffer | None = fld(RECORDS, "0+", nullable="0+")


@dataclass(kw_only=True, slots=True)
class TopicProduceData(Struct):
    """The partitions of one topic produced to."""

    name: str = fld(STRING, "0+")
    partition_data: list[PartitionProduceData] = fld(array(PartitionProduceData), "0+")


@dataclass(kw_only=True, slots=True)
class ProduceRequest(Request):
    """Record batches for one broker; ``acks`` 0 (no response), 1 (leader) or -1 (all)."""

    API_KEY: ClassVar[int] = ApiKey.PRODUCE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.PRODUCE]

    transactional_id: str | None = fld(STRING, "3+", nullable="3+", default=None)
    acks: int = fld(INT16, "0+", default=-1)
    timeout_ms: int = fld(INT32, "0+", default=30_000)
    topic_data: list[TopicProduceData] = fld(array(TopicProduceData), "0+")

    @property
    def expects_response(self) -> bool:
        """False for ``acks=0``: the broker will not answer this request."""
        return self.acks != 0


@dataclass(kw_only=True, slots=True)
class BatchIndexAndErrorMessage(Struct):
    """A record that made the broker drop its batch (v8+)."""

    batch_index: int = fld(INT32, "8+")
    batch_index_error_message: str | None = fld(STRING, "8+", nullable="8+", default=None)


@dataclass(kw_only=True, slots=True)
class LeaderIdAndEpoch(Struct):
    """The partition's current leader, sent with NOT_LEADER_OR_FOLLOWER (v10+)."""

    leader_id: int = fld(INT32, "10+", default=-1)
    leader_epoch: int = fld(INT32, "10+", default=-1)


@dataclass(kw_only=True, slots=True)
class PartitionProduceResponse(Struct):
    """The outcome for one partition: error code and the batch's base offset."""

    index: int = fld(INT32, "0+")
    error_code: int = fld(INT16, "0+")
    base_offset: int = fld(INT64, "0+")
    log_append_time_ms: int = fld(INT64, "2+", default=-1)
    log_start_offset: int = fld(INT64, "5+", default=-1)
    record_errors: list[BatchIndexAndErrorMessage] = fld(array(BatchIndexAndErrorMessage), "8+")
    error_message: str | None = fld(STRING, "8+", nullable="8+", default=None)
    current_leader: LeaderIdAndEpoch = fld(LeaderIdAndEpoch, "10+", tag=0)


@dataclass(kw_only=True, slots=True)
class TopicProduceResponse(Struct):
    """The outcomes for one topic's partitions."""

    name: str = fld(STRING, "0+")
    partition_responses: list[PartitionProduceResponse] = fld(array(PartitionProduceResponse), "0+")


@dataclass(kw_only=True, slots=True)
class NodeEndpoint(Struct):
    """Where to reach a leader named in ``current_leader`` (v10+)."""

    node_id: int = fld(INT32, "10+")
    host: str = fld(STRING, "10+")
    port: int = fld(INT32, "10+")
    rack: str | None = fld(STRING, "10+", nullable="10+", default=None)


@dataclass(kw_only=True, slots=True)
class ProduceResponse(Response):
    """Per-partition outcomes of a produce request."""

    API_KEY: ClassVar[int] = ApiKey.PRODUCE
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.PRODUCE]

    responses: list[TopicProduceResponse] = fld(array(TopicProduceResponse), "0+")
    throttle_time_ms: int = fld(INT32, "1+")
    node_endpoints: list[NodeEndpoint] = fld(array(NodeEndpoint), "10+", tag=0)
