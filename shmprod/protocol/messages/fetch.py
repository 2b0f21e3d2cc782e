"""Fetch (key 1), versions 4-12: enough to read back what was produced.

shmprod is a producer; Fetch lets the demo, the command line and the tests check what
landed without another client. Schema: ``FetchRequest.json`` / ``FetchResponse.json``
in apache/kafka. v12 is the first flexible version; v13+ address topics by id and are
not offered.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey
from shmprod.protocol.messages.schema import (
    INT8,
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
class FetchPartition(Struct):
    """Where to read one partition from."""

    partition: int = fld(INT32, "0+")
    current_leader_epoch: int = fld(INT32, "9+", default=-1)
    fetch_offset: int = fld(INT64, "0+")
    last_fetched_epoch: int = fld(INT32, "12+", default=-1)
    log_start_offset: int = fld(INT64, "5+", default=-1)
    partition_max_bytes: int = fld(INT32, "0+", default=1 << 20)


@dataclass(kw_only=True, slots=True)
class FetchTopic(Struct):
    """The partitions of one topic to read."""

    topic: str = fld(STRING, "0+")
    partitions: list[FetchPartition] = fld(array(FetchPartition), "0+")


@dataclass(kw_only=True, slots=True)
class ForgottenTopic(Struct):
    """Partitions to drop from an incremental fetch session (v7+)."""

    topic: str = fld(STRING, "7+")
    partitions: list[int] = fld(array(INT32), "7+")


@dataclass(kw_only=True, slots=True)
class FetchRequest(Request):
    """A full fetch with no session (session_id 0, epoch -1)."""

    API_KEY: ClassVar[int] = ApiKey.FETCH
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.FETCH]

    cluster_id: str | None = fld(STRING, "12+", nullable="12+", tag=0, default=None)
    replica_id: int = fld(INT32, "0+", default=-1)
    max_wait_ms: int = fld(INT32, "0+", default=500)
    min_bytes: int = fld(INT32, "0+", default=1)
    max_bytes: int = fld(INT32, "3+", default=50 << 20)
    isolation_level: int = fld(INT8, "4+", default=0)
    session_id: int = fld(INT32, "7+", default=0)
    session_epoch: int = fld(INT32, "7+", default=-1)
    topics: list[FetchTopic] = fld(array(FetchTopic), "0+")
    forgotten_topics_data: list[ForgottenTopic] = fld(array(ForgottenTopic), "7+")
    rack_id: str = fld(STRING, "11+", default="")


@dataclass(kw_only=True, slots=True)
class AbortedTransaction(Struct):
    """An aborted transaction within the fetched range."""

    producer_id: int = fld(INT64, "4+")
    first_offset: int = fld(INT64, "4+")


@dataclass(kw_only=True, slots=True)
class EpochEndOffset(Struct):
    """Where the log diverged from the fetcher's epoch (v12+, tagged)."""

    epoch: int = fld(INT32, "12+", default=-1)
    end_offset: int = fld(INT64, "12+", default=-1)


@dataclass(kw_only=True, slots=True)
class LeaderIdAndEpoch(Struct):
    """The partition's current leader, when the fetcher asked the wrong one (v12+)."""

    leader_id: int = fld(INT32, "12+", default=-1)
    leader_epoch: int = fld(INT32, "12+", default=-1)


@dataclass(kw_only=True, slots=True)
class SnapshotId(Struct):
    """The snapshot to fetch instead (v12+, tagged)."""

    end_offset: int = fld(INT64, "0+", default=-1)
    epoch: int = fld(INT32, "0+", default=-1)


@dataclass(kw_only=True, slots=True)
class PartitionData(Struct):
    """One partition's answer: its error, watermarks and record batches."""

    partition_index: int = fld(INT32, "0+")
    error_code: int = fld(INT16, "0+")
    high_watermark: int = fld(INT64, "0+")
    last_stable_offset: int = fld(INT64, "4+", default=-1)
    log_start_offset: int = fld(INT64, "5+", default=-1)
    diverging_epoch: EpochEndOffset = fld(EpochEndOffset, "12+", tag=0)
    current_leader: LeaderIdAndEpoch = fld(LeaderIdAndEpoch, "12+", tag=1)
    snapshot_id: SnapshotId = fld(SnapshotId, "12+", tag=2)
    aborted_transactions: list[AbortedTransaction] | None = fld(
        array(AbortedTransaction), "4+", nullable="4+", default=None
    )
    preferred_read_replica: int = fld(INT32, "11+", default=-1)
    records: RecordsBuffer | None = fld(RECORDS, "0+", nullable="0+", default=None)


@dataclass(kw_only=True, slots=True)
class FetchableTopicResponse(Struct):
    """The partitions of one topic in a Fetch answer."""

    topic: str = fld(STRING, "0+")
    partitions: list[PartitionData] = fld(array(PartitionData), "0+")


@dataclass(kw_only=True, slots=True)
class FetchResponse(Response):
    """Record batches read from the partitions asked for."""

    API_KEY: ClassVar[int] = ApiKey.FETCH
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.FETCH]

    throttle_time_ms: int = fld(INT32, "1+")
    error_code: int = fld(INT16, "7+")
    session_id: int = fld(INT32, "7+")
    responses: list[FetchableTopicResponse] = fld(array(FetchableTopicResponse), "0+")
