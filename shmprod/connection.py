"""A minimal blocking connection to one broker.

Used by the demo, the command line and the tests today, and the seed of the sender's
connections. All encoding and decoding is done by the sans-IO ``shmprod.protocol``
package; this module only moves bytes: ``socket.sendmsg`` of buffer segments (record
batches are never copied into the request) and a :class:`FrameDecoder` on the way back.

Security (:meth:`BrokerConnection.from_config` takes it from a ``ProducerConfig``): TLS
wraps the socket with an ``ssl.SSLContext`` (an ``SSLSocket`` has no ``sendmsg``: each
segment is encrypted and sent in turn), and SASL runs :class:`SaslExchange` right after
ApiVersions. A refused TLS handshake raises :class:`SslAuthenticationError`, refused
credentials :class:`AuthenticationError`.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from shmprod import __version__
from shmprod.errors import (
    AuthenticationError,
    DecodeError,
    KafkaConnectionError,
    SslAuthenticationError,
)
from shmprod.protocol.frames import FrameDecoder, peek_correlation_id
from shmprod.protocol.messages import (
    ApiVersionsResponse,
    CreatableTopic,
    CreateTopicsRequest,
    CreateTopicsResponse,
    FetchPartition,
    FetchRequest,
    FetchResponse,
    FetchTopic,
    MetadataRequest,
    MetadataRequestTopic,
    MetadataResponse,
    PartitionProduceData,
    ProduceRequest,
    ProduceResponse,
    Request,
    Response,
    TopicProduceData,
    VersionsHandshake,
    decode_response,
    encode_request_segments,
    version_for,
)
from shmprod.protocol.sasl_exchange import SaslCredentials, SaslExchange, SaslStep

if TYPE_CHECKING:
    from shmprod.config import ProducerConfig

R = TypeVar("R", bound=Response)
Buffer = bytes | bytearray | memoryview


def sendmsg_all(sock: socket.socket, segments: Sequence[Buffer]) -> int:
    """Sends every segment with ``sendmsg`` (gather write), resuming after partial sends.

    On a TLS socket (no ``sendmsg``) each segment is encrypted and sent with ``sendall``.
    """
    views = [memoryview(s).cast("B") for s in segments if len(s)]
    total = sum(len(v) for v in views)
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return total
    while views:
        sent = sock.sendmsg(views[:1024])  # IOV_MAX is 1024 on Linux
        while sent:
            head = views[0]
            if sent >= len(head):
                sent -= len(head)
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
    return total


class BrokerConnection:
    """One blocking TCP connection to a broker, with versions negotiated on connect.

    Not thread-safe; one request at a time unless the caller pipelines explicitly with
    :meth:`send` and :meth:`receive`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        client_id: str = "shmprod",
        timeout_s: float = 30.0,
        node_id: int = -1,
        ssl_context: ssl.SSLContext | None = None,
        sasl: SaslCredentials | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.node_id = node_id
        self.ssl_context = ssl_context
        self._sasl = sasl
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._correlation = itertools.count(1)
        self._inflight: dict[int, int] = {}  # correlation id -> version sent
        self._ready: dict[int, bytes] = {}
        # api key -> (min, max) offered by the broker
        self.api_versions: dict[int, tuple[int, int]] = {}

    @classmethod
    def from_config(
        cls, config: ProducerConfig, host: str, port: int, *, node_id: int = -1
    ) -> BrokerConnection:
        """A connection with the client id, timeout and security of ``config``."""
        return cls(
            host,
            port,
            client_id=config.client_id,
            timeout_s=config.request_timeout_ms / 1000,
            node_id=node_id,
            ssl_context=config.ssl_context(),
            sasl=config.sasl_credentials(),
        )

    # -- lifecycle --------------------------------------------------------------

    def connect(self) -> BrokerConnection:
        """Connects, completes TLS if configured, negotiates versions, authenticates."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            raise KafkaConnectionError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            sock = self._wrap_tls(sock, self.ssl_context)
        self._sock = sock
        try:
            self._negotiate()
            if self._sasl is not None:
                self._authenticate(self._sasl)
        except BaseException:
            self.close()
            raise
        return self

    def _wrap_tls(self, sock: socket.socket, ctx: ssl.SSLContext) -> ssl.SSLSocket:
        """The TLS handshake; SslAuthenticationError when the broker cannot be trusted."""
        try:
            return ctx.wrap_socket(sock, server_hostname=self.host)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise SslAuthenticationError(
                f"TLS to {self.host}:{self.port}: certificate not trusted: {exc.verify_message}"
            ) from None
        except ssl.SSLError as exc:
            sock.close()
            raise SslAuthenticationError(
                f"TLS handshake with {self.host}:{self.port} failed: {exc.reason or exc}"
            ) from None
        except OSError as exc:
            sock.close()
            raise KafkaConnectionError(
                f"TLS handshake with {self.host}:{self.port}: {exc}"
            ) from exc

    def _authenticate(self, credentials: SaslCredentials) -> None:
        """SaslHandshake then SaslAuthenticate rounds; AuthenticationError if refused."""
        exchange = SaslExchange(credentials, self.api_versions, f"{self.host}:{self.port}")
        step: SaslStep | None = exchange.start()
        while step is not None:
            try:
                resp = self.request(step.request, step.response_cls, step.version)
            except KafkaConnectionError as exc:
                raise AuthenticationError(
                    f"{exc} during SASL {credentials.mechanism} authentication "
                    "(brokers close the connection on a mechanism they do not enable)"
                ) from None
            step = exchange.on_response(resp)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._inflight.clear()
        self._ready.clear()

    def __enter__(self) -> BrokerConnection:
        return self if self._sock is not None else self.connect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- versions ---------------------------------------------------------------

    def _negotiate(self) -> None:
        """ApiVersions by the shared :class:`VersionsHandshake` (v3, stepping down, KIP-511)."""
        hs = VersionsHandshake(f"{self.host}:{self.port}", __version__)
        while True:  # each retry asks a lower version: at most four rounds
            offered = hs.answer(self.request(hs.request(), ApiVersionsResponse, hs.version))
            if offered is not None:
                self.api_versions = offered
                return

    def version_for(self, api_key: int) -> int:
        """Highest version of ``api_key`` both shmprod and this broker speak."""
        return version_for(self.api_versions, api_key, f"{self.host}:{self.port}")

    # -- requests -----------------------------------------------------------------

    def send(
        self, req: Request, version: int | None = None, *, expect_response: bool = True
    ) -> int:
        """Sends ``req`` (record batches uncopied, by ``sendmsg``); returns its correlation id."""
        sock = self._require()
        if version is None:
            version = self.version_for(req.API_KEY)
        correlation_id = next(self._correlation) & 0x7FFFFFFF
        segments = encode_request_segments(req, version, correlation_id, self.client_id)
        try:
            sendmsg_all(sock, segments)
        except OSError as exc:
            self.close()
            raise KafkaConnectionError(f"send to {self.host}:{self.port} failed: {exc}") from exc
        if expect_response:
            self._inflight[correlation_id] = version
        return correlation_id

    def receive(self, correlation_id: int, cls: type[R], deadline: float | None = None) -> R:
        """Waits for the response to ``correlation_id`` and decodes it as ``cls``."""
        version = self._inflight.get(correlation_id)
        if version is None:
            raise KafkaConnectionError(f"no request with correlation id {correlation_id} in flight")
        sock = self._require()
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        while correlation_id not in self._ready:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise KafkaConnectionError(
                    f"no response from {self.host}:{self.port} within {self.timeout_s}s"
                )
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError as exc:
                self.close()
                raise KafkaConnectionError(f"receive from {self.host}:{self.port}: {exc}") from exc
            if not chunk:
                self.close()
                raise KafkaConnectionError(f"{self.host}:{self.port} closed the connection")
            for payload in self._decoder.feed(chunk):
                corr = peek_correlation_id(payload)
                if corr not in self._inflight:
                    self.close()
                    raise DecodeError(f"response with unknown correlation id {corr}")
                self._ready[corr] = payload
        del self._inflight[correlation_id]
        _, resp = decode_response(cls, self._ready.pop(correlation_id), version)
        return resp

    def request(self, req: Request, cls: type[R], version: int | None = None) -> R:
        """Sends ``req`` and waits for its response, decoded as ``cls``."""
        return self.receive(self.send(req, version), cls)

    # -- the calls the demo, the CLI and the tests use ----------------------------

    def metadata(self, topics: Sequence[str] | None = None) -> MetadataResponse:
        """Metadata for ``topics`` (``None``: every topic); never creates topics."""
        req = MetadataRequest(
            topics=None if topics is None else [MetadataRequestTopic(name=t) for t in topics],
            allow_auto_topic_creation=False,
        )
        return self.request(req, MetadataResponse)

    def create_topics(
        self, topics: Mapping[str, int], *, replication_factor: int = 1, timeout_ms: int = 30_000
    ) -> dict[str, int]:
        """Creates ``{name: partitions}``; returns each topic's error code (36: exists)."""
        req = CreateTopicsRequest(
            topics=[
                CreatableTopic(name=n, num_partitions=p, replication_factor=replication_factor)
                for n, p in topics.items()
            ],
            timeout_ms=timeout_ms,
        )
        resp = self.request(req, CreateTopicsResponse)
        return {t.name: t.error_code for t in resp.topics}

    @staticmethod
    def produce_request(
        batches: Mapping[tuple[str, int], Buffer], *, acks: int = -1, timeout_ms: int = 30_000
    ) -> ProduceRequest:
        """A ProduceRequest with one record batch per (topic, partition), uncopied."""
        by_topic: dict[str, list[PartitionProduceData]] = {}
        for (topic, partition), batch in batches.items():
            by_topic.setdefault(topic, []).append(
                PartitionProduceData(index=partition, records=batch)
            )
        return ProduceRequest(
            acks=acks,
            timeout_ms=timeout_ms,
            topic_data=[TopicProduceData(name=t, partition_data=p) for t, p in by_topic.items()],
        )

    def produce(
        self,
        batches: Mapping[tuple[str, int], Buffer],
        *,
        acks: int = -1,
        timeout_ms: int = 30_000,
    ) -> ProduceResponse | None:
        """Sends one record batch per (topic, partition) and waits; ``None`` for ``acks=0``."""
        req = self.produce_request(batches, acks=acks, timeout_ms=timeout_ms)
        if acks == 0:
            self.send(req, expect_response=False)
            return None
        return self.request(req, ProduceResponse)

    def fetch(
        self,
        offsets: Mapping[tuple[str, int], int],
        *,
        max_wait_ms: int = 200,
        partition_max_bytes: int = 4 << 20,
    ) -> FetchResponse:
        """Reads from each (topic, partition) at its offset."""
        by_topic: dict[str, list[FetchPartition]] = {}
        for (topic, partition), offset in offsets.items():
            by_topic.setdefault(topic, []).append(
                FetchPartition(
                    partition=partition,
                    fetch_offset=offset,
                    partition_max_bytes=partition_max_bytes,
                )
            )
        req = FetchRequest(
            max_wait_ms=max_wait_ms,
            topics=[FetchTopic(topic=t, partitions=p) for t, p in by_topic.items()],
        )
        return self.request(req, FetchResponse)

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise KafkaConnectionError(f"connection to {self.host}:{self.port} is closed")
        return self._sock
