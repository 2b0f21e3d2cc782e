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
| batch_size | 524288 | batch.size (16384): larger batches cut the broker's per-batch cost (librdkafka: 1000000) |
| buffer_memory | 67108864 | buffer.memory (32 MiB): one pool for the whole host (bench/results/pool-size.md) |
| max_block_ms | 60000 | max.block.ms (60000) |
| compression_type | "none" | compression.type (none) |
| compression_level | None | compression.{gzip,lz4,zstd}.level |
| max_request_size | 8388608 | max.request.size (1 MiB): the host's few connections per broker carry every process's batches, and bigger requests cut the broker's per-request cost; it also bounds one record (the broker refuses a batch above the topic's max.message.bytes with MESSAGE_TOO_LARGE) |
| request_timeout_ms | 30000 | request.timeout.ms (30000) |
| delivery_timeout_ms | 120000 | delivery.timeout.ms (120000) |
| retries | 2147483647 | retries (MAX_INT) |
| retry_backoff_ms | 100 | retry.backoff.ms (100) |
| retry_backoff_max_ms | 1000 | retry.backoff.max.ms (1000) |
| max_in_flight_requests_per_connection | 5 | max.in.flight.requests.per.connection (5) |
| connections_per_broker | 2 | none (Java: one per broker): the host's connections to each broker; each partition's requests stay on one of them (partition slot p on connection p % n), so its order and sequence numbers are kept. A broker works one connection's requests one at a time, so one connection caps the whole host's traffic at what the broker does on one core, where one producer per process would have had a connection each; 1 is Java's layout |
| enable_idempotence | True | enable.idempotence (true) |
| metadata_max_age_ms | 300000 | metadata.max.age.ms (300000) |
| partitioner | "murmur2" | partitioner.class (built-in murmur2 + sticky) |
| key_serializer / value_serializer | None (bytes only) | key.serializer / value.serializer |
| security_protocol | "PLAINTEXT" | security.protocol: PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL |
| ssl_cafile | None (system CAs) | ssl.truststore.location (PEM here, not JKS) |
| ssl_certfile / ssl_keyfile | None | ssl.keystore.location: a client certificate and key (PEM) |
| ssl_password | None (secret) | ssl.key.password: the password of an encrypted ssl_keyfile |
| ssl_check_hostname | True | ssl.endpoint.identification.algorithm ("https"; "" turns it off) |
| sasl_mechanism | None (required with SASL_*) | sasl.mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 |
| sasl_plain_username | None | sasl.jaas.config username (librdkafka: sasl.username) |
| sasl_plain_password | None (secret) | sasl.jaas.config password (librdkafka: sasl.password) |

Secrets (``ssl_password``, ``sasl_plain_password``) are masked in the repr, go to the
sender over a pipe (never its command line), and are replaced by :data:`REDACTED` in
the configuration given to workers (:meth:`ProducerConfig.for_workers`): workers never
talk to brokers.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from shmprod.errors import ConfigError
from shmprod.partitioner_names import check_partitioner_name
from shmprod.protocol.compression import codec_id

if TYPE_CHECKING:
    import ssl

    from shmprod.protocol.sasl_exchange import SaslCredentials

Serializer = Callable[[Any], bytes | None]

ACKS_VALUES = {0: 0, 1: 1, -1: -1, "0": 0, "1": 1, "all": -1, "-1": -1}
SECURITY_PROTOCOLS: Final = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SECRET_OPTIONS: Final = ("ssl_password", "sasl_plain_password")
REDACTED: Final = "[redacted]"
"""What a secret option holds in the configuration handed to workers."""
MAX_CONNECTIONS_PER_BROKER: Final = 16  # connections_per_broker's bound
DEFAULT_CONNECTIONS_PER_BROKER: Final = 2  # its default (its row in the table says why)

# numpy's OpenBLAS starts a thread per core beyond the first as numpy loads, and each
# spins for a while waiting for work. The processes shmprod starts for itself that
# load numpy (the host producer's daemon, the export's pool) never call BLAS, so they
# start with this set to 1 (exporter.pool_environment, host._start_daemon).
OPENBLAS_THREADS_VAR: Final = "OPENBLAS_NUM_THREADS"


@dataclass(frozen=True)
class ProducerConfig:
    """Every producer option, checked. Build with :meth:`from_mapping` or keywords."""

    bootstrap_servers: str = ""
    client_id: str = "shmprod"
    acks: int = -1
    linger_ms: float = 5.0
    batch_size: int = 512 * 1024
    buffer_memory: int = 64 * 1024 * 1024
    max_block_ms: int = 60_000
    compression_type: str = "none"
    compression_level: int | None = None
    max_request_size: int = 8 * 1024 * 1024
    request_timeout_ms: int = 30_000
    delivery_timeout_ms: int = 120_000
    retries: int = 2**31 - 1
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 1000
    max_in_flight_requests_per_connection: int = 5
    connections_per_broker: int = DEFAULT_CONNECTIONS_PER_BROKER
    enable_idempotence: bool = True
    metadata_max_age_ms: int = 300_000
    partitioner: Any = "murmur2"
    key_serializer: Serializer | None = field(default=None, compare=False)
    value_serializer: Serializer | None = field(default=None, compare=False)
    security_protocol: str = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    ssl_check_hostname: bool = True
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None

    def __post_init__(self) -> None:
        _check(self)

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            shown = "***" if f.name in SECRET_OPTIONS and value is not None else repr(value)
            parts.append(f"{f.name}={shown}")
        return f"ProducerConfig({', '.join(parts)})"

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context of ``security_protocol`` SSL / SASL_SSL (else None).

        Certificates are always verified (against ``ssl_cafile``, or the system's CAs);
        ``ssl_check_hostname=False`` only skips matching the broker's name. Raises
        ConfigError naming the option whose file cannot be loaded.
        """
        if not self.uses_ssl:
            return None
        import ssl  # here: a producer without TLS never loads it (about 2 MB a process)

        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ssl_cafile is not None:
            try:
                ctx.load_verify_locations(cafile=self.ssl_cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"option 'ssl_cafile': cannot load {self.ssl_cafile!r}: {exc}"
                ) from None
        if self.ssl_certfile is not None:
            if self.ssl_password == REDACTED:
                raise ConfigError("option 'ssl_password' is redacted in this process")
            try:
                ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, self.ssl_password)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"options 'ssl_certfile'/'ssl_keyfile'/'ssl_password': cannot load the "
                    f"client certificate {self.ssl_certfile!r}: {type(exc).__name__}"
                ) from None
        ctx.check_hostname = self.ssl_check_hostname
        return ctx

    def sasl_credentials(self) -> SaslCredentials | None:
        """The :class:`SaslCredentials` of a SASL ``security_protocol`` (else None)."""
        if not self.uses_sasl:
            return None
        from shmprod.protocol.sasl_exchange import SaslCredentials

        if self.sasl_plain_password == REDACTED:
            raise ConfigError("option 'sasl_plain_password' is redacted in this process")
        assert self.sasl_mechanism is not None and self.sasl_plain_username is not None
        return SaslCredentials(
            self.sasl_mechanism, self.sasl_plain_username, self.sasl_plain_password or ""
        )

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
                raise unknown_option(raw)
            if name in kwargs:
                raise ConfigError(f"option {raw!r} given twice (as {name!r})")
            if raw == "ssl.endpoint.identification.algorithm":
                if value not in ("https", "HTTPS", "", None):
                    raise ConfigError(f"option {raw!r} must be 'https' or '', got {value!r}")
                value = value not in ("", None)
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def from_keywords(cls, **options: Any) -> ProducerConfig:
        """``ProducerConfig(**options)``, but a misspelled option is a ConfigError that
        names it and the closest valid names, not the dataclass's TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        for raw in options:
            if raw not in names:
                raise unknown_option(raw)
        return cls(**options)

    def to_wire(self) -> dict[str, Any]:
        """The plain-data options the sender needs (no callables), for its command line."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("key_serializer", "value_serializer"):
            out.pop(name)
        if not isinstance(self.partitioner, str):
            out["partitioner"] = "murmur2"
        return out

    def for_workers(self) -> dict[str, Any]:
        """:meth:`to_wire` with every secret replaced by :data:`REDACTED` (for the Handle)."""
        out = self.to_wire()
        for name in SECRET_OPTIONS:
            if out[name] is not None:
                out[name] = REDACTED
        return out


def parse_bootstrap(servers: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"h1:9092,h2:9093"`` or a list of ``"host:port"`` into ``[(host, port), ...]``."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out: list[tuple[str, int]] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        host, sep, port_s = item.rpartition(":")
        if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ValueError(f"bootstrap server {item!r} is not host:port")
        out.append((host.strip("[]"), int(port_s)))
    if not out:
        raise ValueError("bootstrap_servers names no server")
    return out


def unknown_option(raw: str) -> ConfigError:
    """The error for an option name nobody knows, with the closest valid names."""
    import difflib  # only for this error

    known = sorted({f.name for f in dataclasses.fields(ProducerConfig)} | set(JAVA_NAMES))
    close = difflib.get_close_matches(raw, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"unknown producer option {raw!r}{hint}")


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
    "security.protocol": "security_protocol",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.endpoint.identification.algorithm": "ssl_check_hostname",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
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
    _set(cfg, "linger_ms", float(linger))  # 5 and 5.0 (an option given as text) are one
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
    _int(cfg, "connections_per_broker", 1, MAX_CONNECTIONS_PER_BROKER)
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
    _check_partitioner(cfg.partitioner)
    for name in ("key_serializer", "value_serializer"):
        fn = getattr(cfg, name)
        if fn is not None and not callable(fn):
            raise ConfigError(f"option {name!r} must be callable, got {fn!r}")
    _check_security(cfg)


def _check_partitioner(spec: object) -> None:
    """A built-in name is checked here, so a process that never partitions (the sender)
    does not load the partitioner's numpy and Arrow code; callables and instances are
    checked by shmprod.partitioner."""
    if isinstance(spec, str):
        check_partitioner_name(spec)
        return
    from shmprod.partitioner import get_partitioner

    get_partitioner(spec)  # type: ignore[arg-type]  # it raises ConfigError for the rest


def _opt_str(cfg: ProducerConfig, name: str) -> str | None:
    v = getattr(cfg, name)
    if v is not None and not isinstance(v, str):
        shown = "***" if name in SECRET_OPTIONS else repr(v)
        raise ConfigError(f"option {name!r} must be a str or None, got {type(v).__name__} {shown}")
    return v


def _check_security(cfg: ProducerConfig) -> None:
    protocol = cfg.security_protocol
    if not isinstance(protocol, str) or protocol.upper() not in SECURITY_PROTOCOLS:
        raise ConfigError(
            f"option 'security_protocol' must be one of {', '.join(SECURITY_PROTOCOLS)}, "
            f"got {protocol!r}"
        )
    _set(cfg, "security_protocol", protocol.upper())
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        path = _opt_str(cfg, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"option {name!r}: no such file {path!r}")
    _opt_str(cfg, "ssl_password")
    if cfg.ssl_keyfile is not None and cfg.ssl_certfile is None:
        raise ConfigError("option 'ssl_keyfile' needs 'ssl_certfile' (the client certificate)")
    if not isinstance(cfg.ssl_check_hostname, bool):
        raise ConfigError(
            f"option 'ssl_check_hostname' must be a bool, got {cfg.ssl_check_hostname!r}"
        )
    mechanism = _opt_str(cfg, "sasl_mechanism")
    username = _opt_str(cfg, "sasl_plain_username")
    password = _opt_str(cfg, "sasl_plain_password")
    if mechanism is not None:
        if mechanism.upper() not in SASL_MECHANISMS:
            raise ConfigError(
                f"option 'sasl_mechanism' must be one of {', '.join(SASL_MECHANISMS)}, "
                f"got {mechanism!r}"
            )
        _set(cfg, "sasl_mechanism", mechanism.upper())
    if cfg.uses_sasl:
        if mechanism is None:
            raise ConfigError(f"option 'sasl_mechanism' is required with {cfg.security_protocol}")
        if not username:
            raise ConfigError(
                f"option 'sasl_plain_username' is required with {cfg.security_protocol}"
            )
        if password is None:
            raise ConfigError(
                f"option 'sasl_plain_password' is required with {cfg.security_protocol}"
            )


_TEXT_INTS: Final = frozenset(
    {
        "batch_size",
        "buffer_memory",
        "max_block_ms",
        "compression_level",
        "max_request_size",
        "request_timeout_ms",
        "delivery_timeout_ms",
        "retries",
        "retry_backoff_ms",
        "retry_backoff_max_ms",
        "max_in_flight_requests_per_connection",
        "connections_per_broker",
        "metadata_max_age_ms",
    }
)
_TEXT_BOOLS: Final = frozenset({"enable_idempotence", "ssl_check_hostname"})
_JAAS_MODULES: Final = ("PlainLoginModule", "ScramLoginModule")
_JAAS_FIELD: Final = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|(\S+?))\s*(?=\w+\s*=|;|$)')


def text_options(options: Mapping[str, str]) -> dict[str, Any]:
    """Options given as text (Java dotted names or kafka-python names, as a Spark or
    command-line user writes them) as keywords for :class:`ProducerConfig` /
    ``Producer``: numbers and booleans parsed, ``sasl.jaas.config`` of the PLAIN and
    SCRAM login modules read for its username and password. Serializers cannot be
    given as text. Raises :class:`ConfigError` naming the option."""
    names = {f.name for f in dataclasses.fields(ProducerConfig)}
    out: dict[str, Any] = {}
    for raw, text in options.items():
        if not isinstance(text, str):
            raise ConfigError(f"option {raw!r} must be text here, got {type(text).__name__}")
        if raw == "sasl.jaas.config":
            for jaas_name, secret in _jaas(text).items():
                _put(out, raw, jaas_name, secret)
            continue
        name = JAVA_NAMES.get(raw, raw.replace(".", "_"))
        if name not in names:
            raise unknown_option(raw)
        value: Any = text.strip()
        if name in ("key_serializer", "value_serializer"):
            raise ConfigError(
                f"option {raw!r} cannot be given as text: keys and values are sent as the "
                "bytes or strings they are"
            )
        if raw == "ssl.endpoint.identification.algorithm":
            if value.lower() not in ("https", ""):
                raise ConfigError(f"option {raw!r} must be 'https' or '', got {text!r}")
            value = value != ""
        elif name in _TEXT_BOOLS:
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"option {raw!r} must be true or false, got {text!r}")
            value = value.lower() == "true"
        elif name in _TEXT_INTS:
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"option {raw!r} must be an integer, got {text!r}") from None
        elif name == "linger_ms":
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"option {raw!r} must be a number, got {text!r}") from None
        _put(out, raw, name, value)
    return out


def _put(out: dict[str, Any], raw: str, name: str, value: Any) -> None:
    if name in out:
        raise ConfigError(f"option {raw!r} sets {name!r}, which another option already set")
    out[name] = value


def _jaas(text: str) -> dict[str, str]:
    """username and password of a PLAIN or SCRAM ``sasl.jaas.config`` (never echoed:
    it holds a password)."""
    body = text.strip()
    module, _, rest = body.partition(" ")
    if not module.endswith(_JAAS_MODULES):
        raise ConfigError(
            "option 'sasl.jaas.config' supports the PlainLoginModule and ScramLoginModule "
            f"(username and password), got the module {module!r}"
        )
    rest = rest.strip()
    if not rest.startswith("required"):
        raise ConfigError("option 'sasl.jaas.config' must read '<LoginModule> required ...;'")
    found = {
        m.group(1): m.group(2).replace('\\"', '"') if m.group(2) is not None else m.group(3)
        for m in _JAAS_FIELD.finditer(rest[len("required") :])
    }
    if "username" not in found or "password" not in found:
        raise ConfigError('option \'sasl.jaas.config\' must set username="..." password="..."')
    return {"sasl_plain_username": found["username"], "sasl_plain_password": found["password"]}
