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

from shmprod.futures import BatchFuture, BatchMetadata, RecordFuture, RecordMetadata
from shmprod.handle import Handle
from shmprod.host import host_producer
from shmprod.pool import current, pool_initializer
from shmprod.producer import Producer, attach

__all__ = [
    "BatchFuture",
    "BatchMetadata",
    "BrokerError",
    "CompressionError",
    "ConfigError",
    "DecodeError",
    "EncodeError",
    "ExportError",
    "ExportReport",
    "Handle",
    "KafkaConnectionError",
    "KafkaError",
    "Producer",
    "ProtocolError",
    "RecordFuture",
    "RecordMetadata",
    "ShmprodError",
    "__version__",
    "attach",
    "current",
    "export",
    "host_producer",
    "pool_initializer",
]


_LAZY = {
    "export": "shmprod.exporter",
    "ExportError": "shmprod.exporter",
    "ExportReport": "shmprod.exporter",
}


def __getattr__(name: str) -> object:
    """``export`` and its types load on first use: importing shmprod stays light for
    the processes that only send (workers, the sender, a host producer)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmprod' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
