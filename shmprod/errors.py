"""The error hierarchy every shmprod call raises from.

Errors are data first: a Kafka error carries its numeric code and whether it is
retriable, so it can cross a process boundary as ``(code, retriable, message)``.
"""

from __future__ import annotations


class ShmprodError(Exception):
    """Base of every error shmprod raises on purpose."""


class ConfigError(ShmprodError, ValueError):
    """An unknown, ill-typed or out-of-range configuration option."""


class ProtocolError(ShmprodError):
    """Bytes that do not follow the Kafka protocol (raised by the sans-IO codec)."""


class DecodeError(ProtocolError):
    """A response, frame or record batch could not be decoded."""


class EncodeError(ProtocolError, ValueError):
    """A value cannot be encoded (too long, out of range, wrong type)."""


class CompressionError(ProtocolError):
    """A compression codec failed or is unknown."""


class BrokerError(ShmprodError):
    """The embedded broker could not be started or stopped."""


class KafkaConnectionError(ShmprodError):
    """A broker connection failed (refused, closed, timed out)."""


class KafkaError(ShmprodError):
    """An error code answered by a broker."""

    def __init__(self, code: int, message: str = "", *, retriable: bool | None = None) -> None:
        from shmprod.protocol.error_codes import error_name, is_retriable

        self.code = code
        self.name = error_name(code)
        self.retriable = is_retriable(code) if retriable is None else retriable
        text = f"[{code}] {self.name}"
        if message:
            text += f": {message}"
        super().__init__(text)
