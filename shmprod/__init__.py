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

__all__ = [
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
