"""Kafka error codes the producer meets, their names and how to treat them."""

from __future__ import annotations

from typing import Final

NONE: Final = 0
UNKNOWN_SERVER_ERROR: Final = -1
OFFSET_OUT_OF_RANGE: Final = 1
CORRUPT_MESSAGE: Final = 2
UNKNOWN_TOPIC_OR_PARTITION: Final = 3
INVALID_FETCH_SIZE: Final = 4
LEADER_NOT_AVAILABLE: Final = 5
NOT_LEADER_OR_FOLLOWER: Final = 6
REQUEST_TIMED_OUT: Final = 7
BROKER_NOT_AVAILABLE: Final = 8
REPLICA_NOT_AVAILABLE: Final = 9
MESSAGE_TOO_LARGE: Final = 10
NETWORK_EXCEPTION: Final = 13
COORDINATOR_LOAD_IN_PROGRESS: Final = 14
COORDINATOR_NOT_AVAILABLE: Final = 15
NOT_COORDINATOR: Final = 16
INVALID_TOPIC_EXCEPTION: Final = 17
RECORD_LIST_TOO_LARGE: Final = 18
NOT_ENOUGH_REPLICAS: Final = 19
NOT_ENOUGH_REPLICAS_AFTER_APPEND: Final = 20
INVALID_REQUIRED_ACKS: Final = 21
TOPIC_AUTHORIZATION_FAILED: Final = 29
CLUSTER_AUTHORIZATION_FAILED: Final = 31
INVALID_TIMESTAMP: Final = 32
UNSUPPORTED_SASL_MECHANISM: Final = 33
ILLEGAL_SASL_STATE: Final = 34
UNSUPPORTED_VERSION: Final = 35
TOPIC_ALREADY_EXISTS: Final = 36
INVALID_PARTITIONS: Final = 37
INVALID_REPLICATION_FACTOR: Final = 38
INVALID_REQUEST: Final = 42
UNSUPPORTED_FOR_MESSAGE_FORMAT: Final = 43
OUT_OF_ORDER_SEQUENCE_NUMBER: Final = 45
DUPLICATE_SEQUENCE_NUMBER: Final = 46
INVALID_PRODUCER_EPOCH: Final = 47
INVALID_TXN_STATE: Final = 48
INVALID_PRODUCER_ID_MAPPING: Final = 49
TRANSACTIONAL_ID_AUTHORIZATION_FAILED: Final = 53
CONCURRENT_TRANSACTIONS: Final = 51
SASL_AUTHENTICATION_FAILED: Final = 58
UNKNOWN_PRODUCER_ID: Final = 59
KAFKA_STORAGE_ERROR: Final = 56
FENCED_LEADER_EPOCH: Final = 74
UNKNOWN_LEADER_EPOCH: Final = 75
UNSUPPORTED_COMPRESSION_TYPE: Final = 76
INVALID_RECORD: Final = 87
THROTTLING_QUOTA_EXCEEDED: Final = 89
PRODUCER_FENCED: Final = 90

_NAMES: Final[dict[int, str]] = {
    value: name
    for name, value in list(globals().items())
    if name.isupper() and isinstance(value, int) and not name.startswith("_")
}

# Retriable without new metadata.
RETRIABLE: Final[frozenset[int]] = frozenset(
    {
        CORRUPT_MESSAGE,
        REQUEST_TIMED_OUT,
        NOT_ENOUGH_REPLICAS,
        NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        CONCURRENT_TRANSACTIONS,
        UNKNOWN_LEADER_EPOCH,
        THROTTLING_QUOTA_EXCEEDED,
        COORDINATOR_LOAD_IN_PROGRESS,
        COORDINATOR_NOT_AVAILABLE,
        NOT_COORDINATOR,
    }
)

# Retriable once metadata has been refreshed.
REFRESH_METADATA: Final[frozenset[int]] = frozenset(
    {
        UNKNOWN_TOPIC_OR_PARTITION,
        LEADER_NOT_AVAILABLE,
        NOT_LEADER_OR_FOLLOWER,
        REPLICA_NOT_AVAILABLE,
        NETWORK_EXCEPTION,
        KAFKA_STORAGE_ERROR,
        FENCED_LEADER_EPOCH,
    }
)


def error_name(code: int) -> str:
    return _NAMES.get(code, f"UNKNOWN_ERROR_CODE_{code}")


def is_retriable(code: int) -> bool:
    return code in RETRIABLE or code in REFRESH_METADATA


def needs_metadata_refresh(code: int) -> bool:
    return code in REFRESH_METADATA
