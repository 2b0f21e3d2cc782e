"""ApiVersions (key 18), versions 0-3: which versions of each API a broker speaks.

Schema: ``ApiVersionsRequest.json`` / ``ApiVersionsResponse.json`` in apache/kafka.
Version 3 is flexible and sends the client's software name and version; brokers check
both against ``[a-zA-Z0-9](?:[a-zA-Z0-9\\-.]*[a-zA-Z0-9])?``.
"""

# Fields are declared by calling fld() (a dataclasses.field with a schema attached).
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmprod.errors import KafkaError
from shmprod.protocol.error_codes import UNSUPPORTED_VERSION
from shmprod.protocol.frames import SUPPORTED_VERSIONS, ApiKey, UnsupportedVersionError
from shmprod.protocol.messages.schema import (
    BOOL,
    INT16,
    INT32,
    INT64,
    STRING,
    Request,
    Response,
    Struct,
    array,
    fld,
)


@dataclass(kw_only=True, slots=True)
class ApiVersionsRequest(Request):
    """Asks the broker for its supported API versions."""

    API_KEY: ClassVar[int] = ApiKey.API_VERSIONS
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.API_VERSIONS]

    client_software_name: str = fld(STRING, "3+", default="shmprod")
    client_software_version: str = fld(STRING, "3+", default="unknown")


@dataclass(kw_only=True, slots=True)
class ApiVersion(Struct):
    """The version range the broker supports for one API key."""

    api_key: int = fld(INT16, "0+")
    min_version: int = fld(INT16, "0+")
    max_version: int = fld(INT16, "0+")


@dataclass(kw_only=True, slots=True)
class SupportedFeatureKey(Struct):
    """A feature the broker supports, with its version range (KIP-584)."""

    name: str = fld(STRING, "3+")
    min_version: int = fld(INT16, "3+")
    max_version: int = fld(INT16, "3+")


@dataclass(kw_only=True, slots=True)
class FinalizedFeatureKey(Struct):
    """A cluster-wide finalized feature level (KIP-584)."""

    name: str = fld(STRING, "3+")
    max_version_level: int = fld(INT16, "3+")
    min_version_level: int = fld(INT16, "3+")


@dataclass(kw_only=True, slots=True)
class ApiVersionsResponse(Response):
    """The broker's supported versions; its header is always v0 (see frames)."""

    API_KEY: ClassVar[int] = ApiKey.API_VERSIONS
    VERSIONS: ClassVar[tuple[int, int]] = SUPPORTED_VERSIONS[ApiKey.API_VERSIONS]

    error_code: int = fld(INT16, "0+")
    api_keys: list[ApiVersion] = fld(array(ApiVersion), "0+")
    throttle_time_ms: int = fld(INT32, "1+")
    supported_features: list[SupportedFeatureKey] = fld(array(SupportedFeatureKey), "3+", tag=0)
    finalized_features_epoch: int = fld(INT64, "3+", tag=1, default=-1)
    finalized_features: list[FinalizedFeatureKey] = fld(array(FinalizedFeatureKey), "3+", tag=2)
    zk_migration_ready: bool = fld(BOOL, "3+", tag=3, default=False)


class VersionsHandshake:
    """The ApiVersions exchange that opens every connection (KIP-511), sans-IO: send
    :meth:`request` at :attr:`version`, feed each answer to :meth:`answer`.

    It starts at the highest version shmprod speaks. A broker that does not speak it
    answers UNSUPPORTED_VERSION with its own ApiVersions range: the handshake then asks
    again at the lower of (this version - 1) and the broker's highest, until a version
    is accepted or none is left. Used by both connection kinds (the blocking one and
    the sender's non-blocking ones), so they follow one rule.
    """

    __slots__ = ("peer", "software_version", "version")

    def __init__(self, peer: str, software_version: str) -> None:
        self.peer = peer
        self.software_version = software_version
        self.version = ApiVersionsRequest.VERSIONS[1]

    def request(self) -> ApiVersionsRequest:
        """The request to send now, at :attr:`version`."""
        return ApiVersionsRequest(
            client_software_name="shmprod", client_software_version=self.software_version
        )

    def answer(self, resp: ApiVersionsResponse) -> dict[int, tuple[int, int]] | None:
        """The broker's ranges (api key -> (min, max)) once accepted; None when the
        request must be sent again at the new :attr:`version`. UnsupportedVersionError
        when no version is common, KafkaError for another error code."""
        offered = {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}
        if resp.error_code == UNSUPPORTED_VERSION and ApiKey.API_VERSIONS in offered:
            lower = min(self.version - 1, offered[ApiKey.API_VERSIONS][1])
            if lower < ApiVersionsRequest.VERSIONS[0]:
                raise UnsupportedVersionError(f"{self.peer}: no common ApiVersions version")
            self.version = lower
            return None
        if resp.error_code:
            raise KafkaError(resp.error_code, f"ApiVersions from {self.peer}")
        return offered
