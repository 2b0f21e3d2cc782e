"""A scripted Kafka broker on shmprod's own two-way codec, and an in-process sender
driven by a fake clock: deterministic tests of the sender's logic in milliseconds.

:class:`ScriptedBroker` listens on one loopback port per node and answers ApiVersions,
Metadata, InitProducerId and Produce itself, as an idempotent Kafka broker does:
partition logs with offsets, producer ids, and per producer-partition sequences (a
batch resent with a sequence already written gets its first offset back, one ahead of
the next expected is OUT_OF_ORDER_SEQUENCE_NUMBER, a new epoch starts at 0). Nothing
runs in a thread: :meth:`ScriptedBroker.pump` accepts, reads and answers what is
there. A test scripts the next Produce answers per partition (:meth:`script`): an error
code, ``WRITE_THEN_DROP`` (the batch is written, the connection closes before the
answer: its fate is unknown to the sender) or ``SILENCE`` (never answered), and moves
leaders (:attr:`ScriptedBroker.leaders`).

:class:`SenderRig` runs a :class:`~shmprod.sender.loop.Sender` in the test's own process
over a real segment, with ``clock`` the rig's :attr:`~SenderRig.now` (nanoseconds,
advanced only by the test) and a select that never waits, so every deadline the
sender keeps -- request timeouts, delivery timeouts, backoffs -- passes exactly when the
test says. Its :class:`DrivenWorker` (the protocol-level worker of
:mod:`tests.support.sender_peers`) turns the rig one cycle (sender step, broker pump)
each time it looks for a message.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmprod import ipc
from shmprod.config import ProducerConfig
from shmprod.protocol import error_codes as ec
from shmprod.protocol.frames import FrameDecoder
from shmprod.protocol.messages import (
    REQUEST_TYPES,
    ApiVersion,
    ApiVersionsRequest,
    ApiVersionsResponse,
    InitProducerIdRequest,
    InitProducerIdResponse,
    MetadataRequest,
    MetadataResponse,
    MetadataResponseBroker,
    MetadataResponsePartition,
    MetadataResponseTopic,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    Request,
    Response,
    TopicProduceResponse,
    decode_request,
    encode_response,
)
from shmprod.protocol.records import RecordBatch, decode_batches
from shmprod.sender.loop import Sender
from tests.support.sender_peers import SMALL, Endpoint, FakeWorker, SenderHome

HOST = "127.0.0.1"
WRITE_THEN_DROP = "write-then-drop"
SILENCE = "silence"
IDLE_TURNS = 8  # turns that bring nothing before the clock jumps to the next timer
START_NS = 1_000_000_000_000
SEED = 20261125

Answer = int | str  # an error code, WRITE_THEN_DROP or SILENCE


@dataclass
class _Conn:
    node: int
    sock: socket.socket
    serial: int  # the order the broker accepted it in
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    out: bytearray = field(default_factory=bytearray)
    closed: bool = False


@dataclass
class _Seq:
    """A producer-partition's sequence state, as the broker keeps it."""

    epoch: int
    next_seq: int = 0
    written: dict[int, int] = field(default_factory=dict)  # base sequence -> base offset


@dataclass(frozen=True)
class Landed:
    """A Produce the broker saw for one partition, and what it answered."""

    node: int
    topic: str
    partition: int
    batch: RecordBatch
    answer: Answer | None  # None: written (or a duplicate of a written one)
    offset: int  # the base offset answered (-1 if none)
    conn: int  # the serial of the connection it came over


class ScriptedBroker:
    """See the module docstring."""

    def __init__(self, nodes: int = 1, topics: dict[str, int] | None = None) -> None:
        self.topics = dict(topics or {"t": 1})
        self.leaders: dict[tuple[str, int], int] = {
            (t, p): p % nodes for t, n in self.topics.items() for p in range(n)
        }
        self._listeners: dict[int, socket.socket] = {}
        for node in range(nodes):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            s.listen(16)
            s.setblocking(False)
            self._listeners[node] = s
        self._ports = {n: int(s.getsockname()[1]) for n, s in self._listeners.items()}
        self.closed = False
        self._conns: list[_Conn] = []
        self._scripts: dict[tuple[str, int], deque[Answer]] = defaultdict(deque)
        self._pid_errors: deque[int] = deque()
        self.logs: dict[tuple[str, int], list[RecordBatch]] = defaultdict(list)
        self.landed: list[Landed] = []
        self.requests: list[tuple[int, Request]] = []
        self._seqs: dict[tuple[int, str, int], _Seq] = {}
        self._next_pid = 4000

    # -- what a test controls ------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port(0)}"

    def port(self, node: int) -> int:
        return self._ports[node]

    def script(self, topic: str, partition: int, *answers: Answer) -> None:
        """The next Produce answers for ``topic``/``partition``, in order; after them,
        the broker answers as Kafka does."""
        self._scripts[(topic, partition)].extend(answers)

    def fail_producer_id(self, *codes: int) -> None:
        """The next InitProducerId answers: these error codes, in order."""
        self._pid_errors.extend(codes)

    def drop_connections(self, node: int | None = None) -> int:
        """Closes every client connection (of ``node``): what is in flight is lost."""
        n = 0
        for c in self._conns:
            if not c.closed and (node is None or c.node == node):
                self._close(c)
                n += 1
        return n

    def connections(self, node: int | None = None) -> int:
        return sum(1 for c in self._conns if not c.closed and (node is None or c.node == node))

    def seen(self, cls: type[Request]) -> list[Request]:
        return [r for _, r in self.requests if isinstance(r, cls)]

    def values(self, topic: str, partition: int) -> list[bytes | None]:
        return [r.value for b in self.logs[(topic, partition)] for r in b.records]

    def close(self) -> None:
        """Closes every connection and stops listening: connecting is refused."""
        self.closed = True
        for c in self._conns:
            self._close(c)
        for s in self._listeners.values():
            s.close()

    # -- the loop ------------------------------------------------------------------------

    def pump(self) -> None:
        """Accepts, reads and answers whatever is waiting; never blocks."""
        if self.closed:
            return
        for node, listener in self._listeners.items():
            while True:
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    break
                sock.setblocking(False)
                self._conns.append(_Conn(node, sock, len(self._conns)))
        for c in self._conns:
            if c.closed:
                continue
            while not c.closed:
                try:
                    data = c.sock.recv(1 << 20)
                except BlockingIOError:
                    break
                except OSError:
                    self._close(c)
                    break
                if not data:
                    self._close(c)
                    break
                for payload in c.decoder.feed(data):
                    self._on_request(c, payload)
            if c.out and not c.closed:
                try:
                    sent = c.sock.send(c.out)
                    del c.out[:sent]
                except BlockingIOError:
                    pass
                except OSError:
                    self._close(c)

    def _close(self, c: _Conn) -> None:
        if not c.closed:
            c.closed = True
            c.out.clear()
            with contextlib.suppress(OSError):
                c.sock.close()

    def _on_request(self, c: _Conn, payload: bytes) -> None:
        header, req = decode_request(payload)
        self.requests.append((c.node, req))
        resp: Response | None
        if isinstance(req, ApiVersionsRequest):
            resp = self._api_versions()
        elif isinstance(req, MetadataRequest):
            resp = self._metadata(req)
        elif isinstance(req, InitProducerIdRequest):
            resp = self._init_producer_id()
        elif isinstance(req, ProduceRequest):
            resp = self._produce(c, req)
        else:
            raise AssertionError(f"the scripted broker does not answer {type(req).__name__}")
        if resp is not None and not c.closed:
            c.out += encode_response(resp, header.api_version, header.correlation_id)

    @staticmethod
    def _api_versions() -> ApiVersionsResponse:
        keys = [
            ApiVersion(api_key=k, min_version=cls.VERSIONS[0], max_version=cls.VERSIONS[1])
            for k, cls in REQUEST_TYPES.items()
            if cls in (ApiVersionsRequest, MetadataRequest, InitProducerIdRequest, ProduceRequest)
        ]
        return ApiVersionsResponse(api_keys=keys)

    def _metadata(self, req: MetadataRequest) -> MetadataResponse:
        names = list(self.topics) if req.topics is None else [t.name for t in req.topics]
        topics = []
        for name in names:
            if name not in self.topics:
                topics.append(
                    MetadataResponseTopic(
                        error_code=ec.UNKNOWN_TOPIC_OR_PARTITION, name=name, partitions=[]
                    )
                )
                continue
            parts = [
                MetadataResponsePartition(
                    partition_index=p,
                    leader_id=self.leaders[(name, p)],
                    replica_nodes=[self.leaders[(name, p)]],
                    isr_nodes=[self.leaders[(name, p)]],
                )
                for p in range(self.topics[name])
            ]
            topics.append(MetadataResponseTopic(name=name, partitions=parts))
        brokers = [
            MetadataResponseBroker(node_id=n, host=HOST, port=self.port(n)) for n in self._listeners
        ]
        return MetadataResponse(brokers=brokers, controller_id=0, topics=topics)

    def _init_producer_id(self) -> InitProducerIdResponse:
        if self._pid_errors:
            return InitProducerIdResponse(error_code=self._pid_errors.popleft())
        self._next_pid += 1
        return InitProducerIdResponse(producer_id=self._next_pid, producer_epoch=0)

    def _produce(self, c: _Conn, req: ProduceRequest) -> ProduceResponse | None:
        answers: list[TopicProduceResponse] = []
        drop = silent = False
        for td in req.topic_data:
            parts = []
            for pd in td.partition_data:
                assert pd.records is not None
                (batch,) = decode_batches(bytes(pd.records))
                key = (td.name, pd.index)
                script = self._scripts.get(key)
                scripted = script.popleft() if script else None
                if self.leaders.get(key) != c.node:
                    code, offset = ec.NOT_LEADER_OR_FOLLOWER, -1
                elif isinstance(scripted, int):
                    code, offset = scripted, -1
                elif scripted == SILENCE:
                    silent = True
                    code, offset = 0, -1
                else:
                    code, offset = self._append(td.name, pd.index, batch)
                    drop = drop or scripted == WRITE_THEN_DROP
                self.landed.append(
                    Landed(
                        c.node,
                        td.name,
                        pd.index,
                        batch,
                        scripted if code == 0 else code,
                        offset,
                        c.serial,
                    )
                )
                parts.append(
                    PartitionProduceResponse(index=pd.index, error_code=code, base_offset=offset)
                )
            answers.append(TopicProduceResponse(name=td.name, partition_responses=parts))
        if drop:
            self._close(c)
            return None
        if silent or req.acks == 0:
            return None
        return ProduceResponse(responses=answers)

    def _append(self, topic: str, partition: int, batch: RecordBatch) -> tuple[int, int]:
        """Kafka's idempotent append: (error code, base offset)."""
        log = self.logs[(topic, partition)]
        offset = sum(b.record_count for b in log)
        if batch.producer_id >= 0:
            key = (batch.producer_id, topic, partition)
            seq = self._seqs.get(key)
            if seq is None or batch.producer_epoch > seq.epoch:
                if batch.base_sequence != 0:
                    return ec.OUT_OF_ORDER_SEQUENCE_NUMBER, -1
                seq = self._seqs[key] = _Seq(batch.producer_epoch)
            elif batch.producer_epoch < seq.epoch:
                return ec.INVALID_PRODUCER_EPOCH, -1
            if batch.base_sequence in seq.written:  # a resend of a written batch
                return 0, seq.written[batch.base_sequence]
            if batch.base_sequence != seq.next_seq:
                return ec.OUT_OF_ORDER_SEQUENCE_NUMBER, -1
            seq.written[batch.base_sequence] = offset
            seq.next_seq = batch.base_sequence + batch.record_count
        log.append(batch)
        return 0, offset


class DrivenWorker(FakeWorker):
    """The protocol-level worker, turning the rig while it looks for a message (the rig
    is single-threaded: nothing else moves it). When a few turns bring nothing, the
    clock jumps to the sender's next timer, so waits of seconds take microseconds."""

    def __init__(self, rig: SenderRig, endpoint: Endpoint, **kw: Any) -> None:
        self.rig = rig
        super().__init__(endpoint, **kw)

    def _pump(self, deadline: float) -> bool:
        self.rig.cycle()
        return self._read(0)

    def expect(
        self,
        cls: Any,
        pred: Callable[[Any], bool] = lambda m: True,
        timeout: float | None = None,
        *,
        within_ms: float = 60_000,
    ) -> Any:
        """The first message of ``cls`` matching ``pred`` within ``within_ms`` of the
        rig's clock; AssertionError otherwise."""
        limit = self.rig.now + int(within_ms * 1_000_000)
        while True:
            found = self._take(cls, pred)
            if found is not None:
                return found
            if self.eof:
                raise AssertionError(f"no {cls.__name__}: the sender closed; got {self.stash!r}")
            if any(self._pump(0) for _ in range(IDLE_TURNS)):
                continue
            if self.rig.now >= limit:
                raise AssertionError(f"no {cls.__name__} within {within_ms} ms: {self.stash!r}")
            self.rig.jump(limit)

    def nothing(self, cls: type[ipc.Message], within: float = 0.0, *, within_ms: float = 0) -> None:
        """No ``cls`` message arrives within ``within_ms`` of the rig's clock."""
        limit = self.rig.now + int(within_ms * 1_000_000)
        while True:
            if not any(self._pump(0) for _ in range(IDLE_TURNS)):
                if self.rig.now >= limit:
                    break
                self.rig.jump(limit)
        assert not any(isinstance(m, cls) for m in self.stash), self.stash


class SenderRig:
    """A Sender in this process over a real segment, its clock :attr:`now`."""

    def __init__(self, broker: ScriptedBroker, **options: Any) -> None:
        options = {
            **SMALL,
            "retry_backoff_ms": 10,
            "retry_backoff_max_ms": 100,
            "delivery_timeout_ms": 30_000,
            **options,
        }
        self.broker = broker
        self.now = START_NS
        self._random = random.getstate()
        random.seed(SEED)  # the backoffs' jitter: the same turns every run
        self.cfg = ProducerConfig(bootstrap_servers=broker.bootstrap, **options)
        self.home = SenderHome(self.cfg)
        self.geo = self.home.geo
        self.view = self.home.view
        self.sender = Sender(
            self.home.spec,
            self.view,
            self.home.listen,
            clock=lambda: self.now,
            owner_alive=lambda: True,
        )
        select = self.sender.poller.select
        self.sender.poller.select = lambda timeout=None: select(0)  # type: ignore[method-assign]
        self.status: int | None = None
        self.worker = DrivenWorker(self, self.home.endpoint, as_owner=True)

    def cycle(self) -> None:
        """One turn: the sender's step, then the broker's pump."""
        if self.status is None:
            if self.sender.life.ended:
                self.status = self.sender.life.exit_status
                self.sender.close_everything()
            else:
                self.sender.step()
        self.broker.pump()

    def turn(self, n: int = 20) -> None:
        for _ in range(n):
            self.cycle()

    def jump(self, limit: int) -> None:
        """Moves the clock to the sender's next timer (at least 1 ms, at most
        ``limit``)."""
        nxt = self.sender.next_wakeup(self.now) if self.status is None else limit
        self.now = min(max(nxt, self.now + 1_000_000), max(limit, self.now))

    def stat(self, field: int) -> int:
        return self.home.stat(field)

    def close(self) -> None:
        self.worker.close()
        if self.status is None:
            self.sender.close_everything()
        del self.sender
        self.view = None  # type: ignore[assignment]
        self.worker.view = None  # type: ignore[assignment]
        self.home.remove()
        random.setstate(self._random)
