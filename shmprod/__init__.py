"""shmprod: one Kafka producer per host, shared by every worker process through shared memory."""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the names below load on first use (see __getattr__)
    from shmprod.exporter import ExportError, ExportReport, export
    from shmprod.futures import BatchFuture, BatchMetadata, RecordFuture, RecordMetadata
    from shmprod.handle import Handle
    from shmprod.host import host_producer
    from shmprod.pool import current, pool_initializer
    from shmprod.producer import Producer
    from shmprod.worker import attach

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
    "BatchFuture": "shmprod.futures",
    "BatchMetadata": "shmprod.futures",
    "RecordFuture": "shmprod.futures",
    "RecordMetadata": "shmprod.futures",
    "Handle": "shmprod.handle",
    "host_producer": "shmprod.host",
    "current": "shmprod.pool",
    "pool_initializer": "shmprod.pool",
    "Producer": "shmprod.producer",
    "attach": "shmprod.worker",
    "export": "shmprod.exporter",
    "ExportError": "shmprod.exporter",
    "ExportReport": "shmprod.exporter",
}


def __getattr__(name: str) -> object:
    """The public names load on first use, so importing a part of shmprod loads only
    what that part needs: the sender (a fresh interpreter that runs
    ``shmprod.sender``) never loads the worker's numpy and Arrow code, and ``export``
    is loaded only by those who call it."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmprod' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
