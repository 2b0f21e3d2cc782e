"""shmprod: one Kafka producer per host, shared by every worker process through shared memory."""

from shmprod.errors import (
    BrokerError,
    CompressionError,
    ConfigError,
    DecodeError,
    EncodeError,
    KafkaConnectionError,
    KafkaError,
    ProtocolError,
    ShmprodError,
)

__version__ = "0.1.0"

from shmprod.futures import BatchFuture, BatchMetadata, RecordFuture, RecordMetadata  # noqa: E402
from shmprod.handle import Handle  # noqa: E402
from shmprod.producer import Producer, attach  # noqa: E402

__all__ = [
    "BatchFuture",
    "BatchMetadata",
    "Handle",
    "Producer",
    "RecordFuture",
    "RecordMetadata",
    "attach",
    "BrokerError",
    "CompressionError",
    "ConfigError",
    "DecodeError",
    "EncodeError",
    "KafkaConnectionError",
    "KafkaError",
    "ProtocolError",
    "ShmprodError",
    "__version__",
]
