"""Producer configuration: kafka-python-style names with Java semantics.

:class:`ProducerConfig` holds every option with a type, a default suited to ETL
throughput, and a check. :func:`ProducerConfig.from_mapping` also takes Java's dotted
names (``"bootstrap.servers"``, ``"linger.ms"``). An unknown or ill-typed option raises
:class:`ConfigError` naming it.

| option | default | Java equivalent (Java default) |
|---|---|---|
| bootstrap_servers | required | bootstrap.servers |
| client_id | "shmprod" | client.id |
| acks | "all" (-1) | acks (all) |
| linger_ms | 5 | linger.ms (5) |
| batch_size | 131072 | batch.size (16384): larger batches cut per-request overhead for ETL |
| buffer_memory | 67108864 | buffer.memory (32 MiB): one pool for the whole host |
| max_block_ms | 60000 | max.block.ms (60000) |
| compression_type | "none" | compression.type (none) |
| compression_level | None | compression.{gzip,lz4,zstd}.level |
| max_request_size | 1048576 | max.request.size (1 MiB) |
| request_timeout_ms | 30000 | request.timeout.ms (30000) |
| delivery_timeout_ms | 120000 | delivery.timeout.ms (120000) |
| retries | 2147483647 | retries (MAX_INT) |
| retry_backoff_ms | 100 | retry.backoff.ms (100) |
| retry_backoff_max_ms | 1000 | retry.backoff.max.ms (1000) |
| max_in_flight_requests_per_connection | 5 | max.in.flight.requests.per.connection (5) |
| enable_idempotence | True | enable.idempotence (true) |
| metadata_max_age_ms | 300000 | metadata.max.age.ms (300000) |
| partitioner | "murmur2" | partitioner.class (built-in murmur2 + sticky) |
| key_serializer / value_serializer | None (bytes only) | key.serializer / value.serializer |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shmprod.errors import ConfigError
from shmprod.protocol.compression import codec_id

Serializer = Callable[[Any], bytes | None]

ACKS_VALUES = {0: 0, 1: 1, -1: -1, "0": 0, "1": 1, "all": -1, "-1": -1}


@dataclass(frozen=True)
class ProducerConfig:
    """Every producer option, checked. Build with :meth:`from_mapping` or keywords."""

    bootstrap_servers: str = ""
    client_id: str = "shmprod"
    acks: int = -1
    linger_ms: float = 5.0
    batch_size: int = 128 * 1024
    buffer_memory: int = 64 * 1024 * 1024
    max_block_ms: int = 60_000
    compression_type: str = "none"
    compression_level: int | None = None
    max_request_size: int = 1024 * 1024
    request_timeout_ms: int = 30_000
    delivery_timeout_ms: int = 120_000
    retries: int = 2**31 - 1
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 1000
    max_in_flight_requests_per_connection: int = 5
    enable_idempotence: bool = True
    metadata_max_age_ms: int = 300_000
    partitioner: Any = "murmur2"
    key_serializer: Serializer | None = field(default=None, compare=False)
    value_serializer: Serializer | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def compression_codec(self) -> int:
        """The RecordBatch codec id of ``compression_type``."""
        return codec_id(self.compression_type)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> ProducerConfig:
        """Options by kafka-python name or Java dotted name; unknown names are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw, value in options.items():
            if not isinstance(raw, str):
                raise ConfigError(f"option names are strings, got {raw!r}")
            name = JAVA_NAMES.get(raw, raw.replace(".", "_"))
            if name not in names:
                raise ConfigError(f"unknown producer option {raw!r}")
            if name in kwargs:
                raise ConfigError(f"option {raw!r} given twice (as {name!r})")
            kwargs[name] = value
        return cls(**kwargs)

    def to_wire(self) -> dict[str, Any]:
        """The plain-data options the sender needs (no callables), for its command line."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("key_serializer", "value_serializer"):
            out.pop(name)
        if not isinstance(self.partitioner, str):
            out["partitioner"] = "murmur2"
        return out


JAVA_NAMES: dict[str, str] = {
    "bootstrap.servers": "bootstrap_servers",
    "client.id": "client_id",
    "acks": "acks",
    "linger.ms": "linger_ms",
    "batch.size": "batch_size",
    "buffer.memory": "buffer_memory",
    "max.block.ms": "max_block_ms",
    "compression.type": "compression_type",
    "compression.level": "compression_level",
    "compression.gzip.level": "compression_level",
    "compression.lz4.level": "compression_level",
    "compression.zstd.level": "compression_level",
    "max.request.size": "max_request_size",
    "request.timeout.ms": "request_timeout_ms",
    "delivery.timeout.ms": "delivery_timeout_ms",
    "retries": "retries",
    "retry.backoff.ms": "retry_backoff_ms",
    "retry.backoff.max.ms": "retry_backoff_max_ms",
    "max.in.flight.requests.per.connection": "max_in_flight_requests_per_connection",
    "enable.idempotence": "enable_idempotence",
    "metadata.max.age.ms": "metadata_max_age_ms",
    "partitioner.class": "partitioner",
    "key.serializer": "key_serializer",
    "value.serializer": "value_serializer",
}


def _int(cfg: ProducerConfig, name: str, lo: int, hi: int = 2**63 - 1) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"option {name!r} must be an int, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise ConfigError(f"option {name!r} must be in [{lo}, {hi}], got {v}")


def _set(cfg: ProducerConfig, name: str, value: Any) -> None:
    object.__setattr__(cfg, name, value)


def _check(cfg: ProducerConfig) -> None:
    if not isinstance(cfg.bootstrap_servers, str) or not cfg.bootstrap_servers.strip():
        raise ConfigError("option 'bootstrap_servers' is required: 'host:port[,host:port...]'")
    from shmprod.connection import parse_bootstrap

    try:
        parse_bootstrap(cfg.bootstrap_servers)
    except ValueError as exc:
        raise ConfigError(f"option 'bootstrap_servers': {exc}") from None
    if not isinstance(cfg.client_id, str):
        raise ConfigError(f"option 'client_id' must be a str, got {cfg.client_id!r}")
    acks = cfg.acks
    if isinstance(acks, bool) or acks not in ACKS_VALUES:
        raise ConfigError(f"option 'acks' must be 0, 1 or 'all', got {acks!r}")
    _set(cfg, "acks", ACKS_VALUES[acks])
    linger = cfg.linger_ms
    if (
        isinstance(linger, bool)
        or not isinstance(linger, int | float)
        or not 0 <= linger <= 3_600_000
    ):
        raise ConfigError(f"option 'linger_ms' must be a number in [0, 3600000], got {linger!r}")
    _int(cfg, "batch_size", 1024, 64 * 1024 * 1024)
    _int(cfg, "buffer_memory", 64 * 1024, 2**40)
    if cfg.buffer_memory < 2 * cfg.batch_size:
        raise ConfigError(
            f"option 'buffer_memory' ({cfg.buffer_memory}) must hold at least two batches "
            f"of 'batch_size' ({cfg.batch_size})"
        )
    _int(cfg, "max_block_ms", 0)
    if not isinstance(cfg.compression_type, str):
        raise ConfigError(f"option 'compression_type' must be a str, got {cfg.compression_type!r}")
    try:
        codec_id(cfg.compression_type)
    except Exception:
        raise ConfigError(
            f"option 'compression_type' must be none, gzip, snappy, lz4 or zstd, "
            f"got {cfg.compression_type!r}"
        ) from None
    if cfg.compression_level is not None:
        _int(cfg, "compression_level", -131072, 22)
    _int(cfg, "max_request_size", 1024, 2**31 - 1)
    _int(cfg, "request_timeout_ms", 1, 2**31 - 1)
    _int(cfg, "delivery_timeout_ms", 1)
    if cfg.delivery_timeout_ms < cfg.linger_ms + cfg.request_timeout_ms:
        raise ConfigError(
            "option 'delivery_timeout_ms' must be at least linger_ms + request_timeout_ms "
            f"({cfg.linger_ms} + {cfg.request_timeout_ms}), got {cfg.delivery_timeout_ms}"
        )
    _int(cfg, "retries", 0, 2**31 - 1)
    _int(cfg, "retry_backoff_ms", 0)
    _int(cfg, "retry_backoff_max_ms", 0)
    _int(cfg, "max_in_flight_requests_per_connection", 1, 1000)
    if not isinstance(cfg.enable_idempotence, bool):
        raise ConfigError(
            f"option 'enable_idempotence' must be a bool, got {cfg.enable_idempotence!r}"
        )
    if cfg.enable_idempotence:
        if cfg.acks != -1:
            raise ConfigError("enable_idempotence needs acks='all'")
        if cfg.max_in_flight_requests_per_connection > 5:
            raise ConfigError("enable_idempotence needs max_in_flight_requests_per_connection <= 5")
        if cfg.retries < 1:
            raise ConfigError("enable_idempotence needs retries >= 1")
    _int(cfg, "metadata_max_age_ms", 0)
    from shmprod.partitioner import get_partitioner

    get_partitioner(cfg.partitioner)
    for name in ("key_serializer", "value_serializer"):
        fn = getattr(cfg, name)
        if fn is not None and not callable(fn):
            raise ConfigError(f"option {name!r} must be callable, got {fn!r}")
