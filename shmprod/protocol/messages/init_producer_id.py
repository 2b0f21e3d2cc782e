"""InitProducerId (key 22), versions 0-5: a producer id and epoch for idempotence.

Schema: ``InitProducerIdRequest.json`` / ``InitProducerIdResponse.json`` in apache/kafka.
Version 2 is the first flexible one; version 3 lets a producer bump the epoch of an
existing id (KIP-360) by sending it back.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey
from shmprod.protocol.messages.schema import INT16, INT32, INT64, STRING, Request, Response, fld
from shmprod.protocol.primitives import INT32_MAX


@dataclass(kw_only=True, slots=True)
class InitProducerIdRequest(Request):
    """Asks for a producer id; the defaults are those of an idempotent, non-transactional
    producer (the Java client sends ``Integer.MAX_VALUE`` as its transaction timeout)."""

    API_KEY: ClassVar[int] = ApiKey.INIT_PRODUCER_ID
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.INIT_PRODUCER_ID]

    transactional_id: str | None = fld(STRING, "0+", nullable="0+", default=None)
    transaction_timeout_ms: int = fld(INT32, "0+", default=INT32_MAX)
    producer_id: int = fld(INT64, "3+", default=-1)
    producer_epoch: int = fld(INT16, "3+", default=-1)


@dataclass(kw_only=True, slots=True)
class InitProducerIdResponse(Response):
    """The producer id and epoch granted, or an error code."""

    API_KEY: ClassVar[int] = ApiKey.INIT_PRODUCER_ID
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.INIT_PRODUCER_ID]

    throttle_time_ms: int = fld(INT32, "0+")
    error_code: int = fld(INT16, "0+")
    producer_id: int = fld(INT64, "0+", default=-1)
    producer_epoch: int = fld(INT16, "0+")
