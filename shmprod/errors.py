"""The error hierarchy every shmprod call raises from.

Errors are data first: a Kafka error carries its numeric code and whether it is
retriable, so it can cross a process boundary as ``(code, retriable, message)``.
"""

from __future__ import annotations

from typing import Any


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
        self.message = message
        text = f"[{code}] {self.name}"
        if message:
            text += f": {message}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as (code, message, retriable): it crosses processes intact (Celery
        results, multiprocessing pools)."""
        return (_kafka_error, (self.code, self.message, self.retriable))


def _kafka_error(code: int, message: str, retriable: bool) -> KafkaError:
    return KafkaError(code, message, retriable=retriable)


# ---------------------------------------------------------------------------
# Producer errors. Each has a code so it can cross a process boundary as data
# (code, retriable, message); negative codes are shmprod's own, positive ones Kafka's.
# ---------------------------------------------------------------------------


class ProducerError(ShmprodError):
    """Base of errors about sending records through the shared producer."""

    code = -1000
    retriable = False


class ProducerClosedError(ProducerError):
    """A send after close, or a producer that is closing."""

    code = -1001


class SenderDiedError(ProducerError):
    """The sender process is gone; nothing more can be delivered by this producer."""

    code = -1002


class OwnerDiedError(ProducerError):
    """The process that created the producer died; the producer has shut down."""

    code = -1003


class BufferExhaustedError(ProducerError):
    """No pool space came free within ``max_block_ms`` (back-pressure)."""

    code = -1004
    retriable = True


class MetadataTimeoutError(ProducerError):
    """A topic's metadata was not available within ``max_block_ms``."""

    code = -1005
    retriable = True


class DeliveryTimeoutError(ProducerError):
    """A batch was not acknowledged within ``delivery_timeout_ms`` (KIP-91)."""

    code = -1006
    retriable = True


class RecordTooLargeError(ProducerError, ValueError):
    """A record larger than ``max_request_size`` or the whole pool."""

    code = -1007


class InvalidRecordError(ProducerError, TypeError):
    """A key, value, header, timestamp or partition of the wrong type or out of range."""

    code = -1008


class InvalidTopicError(ProducerError, ValueError):
    """A topic name Kafka would refuse (empty, too long, illegal characters)."""

    code = -1009


class UnknownPartitionError(ProducerError, ValueError):
    """An explicit partition outside the topic's partitions."""

    code = -1010


class CorruptBatchError(ProducerError):
    """A batch in shared memory failed validation in the sender; only it was failed."""

    code = -1011


class FlushTimeoutError(ProducerError, TimeoutError):
    """``flush(timeout)`` returned with records still pending."""

    code = -1012
    retriable = True


class AuthenticationError(ProducerError):
    """The broker refused the client's credentials (SASL), or the exchange could not
    complete. Fatal: retrying with the same credentials cannot succeed."""

    code = -1013


class SslAuthenticationError(AuthenticationError):
    """The TLS handshake failed: an untrusted certificate, a host name that does not
    match it, or a peer that does not speak TLS. Fatal, like any authentication error."""

    code = -1014


class ProducerHostError(ProducerError):
    """This process cannot attach to the producer: it runs on another host (shared
    memory is host-local) or cannot see the producer's segment (another container, or
    the producer was closed)."""

    code = -1015


_BY_CODE: dict[int, type[ProducerError]] = {
    cls.code: cls
    for cls in (
        ProducerError,
        ProducerClosedError,
        SenderDiedError,
        OwnerDiedError,
        BufferExhaustedError,
        MetadataTimeoutError,
        DeliveryTimeoutError,
        RecordTooLargeError,
        InvalidRecordError,
        InvalidTopicError,
        UnknownPartitionError,
        CorruptBatchError,
        FlushTimeoutError,
        AuthenticationError,
        SslAuthenticationError,
        ProducerHostError,
    )
}


def error_from_code(code: int, message: str = "", retriable: bool | None = None) -> ShmprodError:
    """The exception for an error that crossed a process boundary as (code, message)."""
    if code > 0 or code == -1:
        return KafkaError(code, message, retriable=retriable)
    cls = _BY_CODE.get(code, ProducerError)
    exc = cls(message or cls.__doc__ or cls.__name__)
    if retriable is not None:
        exc.retriable = retriable
    return exc
