"""A fault-injecting Kafka proxy for tests: one upstream broker seen as ``nodes`` brokers.

:class:`KafkaProxy` listens on ``nodes`` loopback ports, one per fake node id
(``0 .. nodes-1``), and forwards every client connection to the upstream broker on a
connection of its own. Requests are parsed with shmprod's sans-IO codec so the proxy
knows each one's api key, version and correlation id; that lets it

- rewrite every Metadata answer: the brokers become the proxy's nodes, each partition's
  leader (and replicas / isr) follows :attr:`KafkaProxy.leaders` (default
  ``partition % nodes``), the controller is node 0;
- forge Produce answers with an error code instead of forwarding (:meth:`fail_next`),
  or refuse every batch over a size as a broker's ``max.message.bytes`` does
  (:meth:`set_max_message_bytes`);
- drop connections, stall a node, delay its answers, take it down and bring it up.

Answers reach a client in the order of its requests, forged ones included. Bytes the
codec does not understand are forwarded unchanged. Everything runs in one thread with a
selectors loop over non-blocking sockets; the control methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from shmprod.protocol.frames import FrameDecoder, peek_correlation_id
from shmprod.protocol.messages import (
    MetadataResponse,
    MetadataResponseBroker,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    TopicProduceData,
    TopicProduceResponse,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)

PRODUCE = 0
METADATA = 3
UNKNOWN_TOPIC_OR_PARTITION = 3
MESSAGE_TOO_LARGE = 10
HOST = "127.0.0.1"

_HEAD = struct.Struct(">hhi")  # api key, api version, correlation id
_SIZE = struct.Struct(">i")
_POLL_S = 0.05
_COMMAND_TIMEOUT_S = 5.0
_RECV = 1 << 20


@dataclass
class _FailRule:
    api_key: int
    error_code: int
    count: int
    partitions: frozenset[int] | None


@dataclass
class _Slot:
    """One answer a client waits for, in request order."""

    correlation_id: int
    api_key: int
    version: int
    frame: bytes | None = None  # size-prefixed, once known
    ready_at: float = 0.0
    forged: list[tuple[str, int, int]] = field(default_factory=list)  # merged into the answer


@dataclass(eq=False)
class _Link:
    """A client connection and its own upstream connection."""

    node: int
    client: socket.socket
    upstream: socket.socket
    connecting: bool = True
    raw: bool = False  # stopped parsing requests: forward as they come
    to_client: bytearray = field(default_factory=bytearray)
    to_upstream: bytearray = field(default_factory=bytearray)
    from_client: FrameDecoder = field(default_factory=FrameDecoder)
    from_upstream: FrameDecoder | None = field(default_factory=FrameDecoder)
    slots: deque[_Slot] = field(default_factory=deque)
    by_corr: dict[int, _Slot] = field(default_factory=dict)


def _framed(payload: bytes) -> bytes:
    return _SIZE.pack(len(payload)) + payload


class KafkaProxy:
    """``nodes`` fake brokers on loopback, all forwarding to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_host: str, upstream_port: int, nodes: int = 3) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.upstream = (upstream_host, upstream_port)
        self.nodes = nodes
        self._lock = threading.Lock()
        self._leaders: dict[tuple[str, int], int] = {}
        self._moves: dict[tuple[str, int], int] = {}
        self._rules: list[_FailRule] = []
        self._max_message_bytes: int | None = None
        self._visible: dict[str, int] = {}
        self._stalled_until: dict[int, float] = {}
        self._delay_s: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._sel = selectors.DefaultSelector()
        self._links: list[_Link] = []
        self._registered: dict[socket.socket, int] = {}
        self._listeners: dict[int, socket.socket | None] = {}
        self.ports: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        try:
            for node in range(nodes):
                listener = self._listen(0)
                self._listeners[node] = listener
                self.ports.append(listener.getsockname()[1])
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel.register(self._wake_r, selectors.EVENT_READ)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kafka-proxy", daemon=True)
        self._thread.start()

    # -- addresses ------------------------------------------------------------------

    def port(self, node: int) -> int:
        return self.ports[node]

    def address(self, node: int) -> str:
        return f"{HOST}:{self.ports[node]}"

    @property
    def bootstrap(self) -> str:
        """Every node, as a ``bootstrap.servers`` value."""
        return ",".join(self.address(n) for n in range(self.nodes))

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> KafkaProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stops the loop, joins its thread (bounded) and closes every socket."""
        if not self._stop.is_set():
            self._stop.set()
            self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- controls (thread-safe) ---------------------------------------------------------

    @property
    def leaders(self) -> dict[tuple[str, int], int]:
        """A copy of the leader overrides: ``{(topic, partition): node}``."""
        with self._lock:
            return dict(self._leaders)

    def leader_of(self, topic: str, partition: int) -> int:
        with self._lock:
            return self._leaders.get((topic, partition), partition % self.nodes)

    def set_leader(self, topic: str, partition: int, node: int) -> None:
        """Moves a partition's leadership: the next Metadata answers say so."""
        self._check_node(node)
        with self._lock:
            self._leaders[(topic, partition)] = node
            self._moves[(topic, partition)] = self._moves.get((topic, partition), 0) + 1

    def fail_next(
        self,
        api_key: int,
        error_code: int,
        count: int = 1,
        partitions: Iterable[int] | None = None,
    ) -> None:
        """Answers the next ``count`` matching Produce requests with ``error_code``.

        Without ``partitions`` every partition of a matching request fails and the
        request is not forwarded. With them, a request matches when it touches one of
        those partition indexes (of any topic): those fail, the rest is forwarded and
        the broker's answer is merged with the forged errors.
        """
        if api_key != PRODUCE:
            raise ValueError("only Produce (api key 0) answers can be forged")
        parts = None if partitions is None else frozenset(partitions)
        with self._lock:
            self._rules.append(_FailRule(api_key, error_code, count, parts))

    def set_max_message_bytes(self, limit: int | None) -> None:
        """Answers MESSAGE_TOO_LARGE for every batch over ``limit`` bytes (a broker's
        ``max.message.bytes``), forwarding the other partitions; None lifts it."""
        with self._lock:
            self._max_message_bytes = limit

    def show_partitions(self, topic: str, count: int | None) -> None:
        """``topic`` seems to have only partitions ``0 .. count-1``: Metadata answers list
        no others and Produce to the others is answered UNKNOWN_TOPIC_OR_PARTITION, as
        from a topic with fewer partitions. It grows when the count is raised (or lifted
        with None), it shrinks (a topic created again smaller) when it is lowered."""
        with self._lock:
            if count is None:
                self._visible.pop(topic, None)
            else:
                self._visible[topic] = count

    def pending_failures(self) -> int:
        with self._lock:
            return sum(r.count for r in self._rules)

    def requests_seen(self, api_key: int) -> int:
        """How many requests with ``api_key`` clients sent (forged answers included)."""
        with self._lock:
            return self._seen.get(api_key, 0)

    def stall(self, node: int, seconds: float) -> None:
        """Holds every byte from and to ``node``'s clients for ``seconds``."""
        self._check_node(node)
        with self._lock:
            self._stalled_until[node] = time.monotonic() + seconds
        self._wake()

    def delay_responses(self, node: int, seconds: float) -> None:
        """Holds every answer to ``node``'s clients for ``seconds`` (0 ends it)."""
        self._check_node(node)
        with self._lock:
            self._delay_s[node] = max(0.0, seconds)

    def drop_connections(self, node: int | None = None) -> int:
        """Closes the client connections (all, or ``node``'s); returns how many."""
        if node is not None:
            self._check_node(node)
        dropped = [0]

        def run() -> None:
            for link in list(self._links):
                if node is None or link.node == node:
                    self._drop(link)
                    dropped[0] += 1

        self._command(run)
        return dropped[0]

    def connections(self, node: int | None = None) -> int:
        """Client connections open now (all, or ``node``'s)."""
        count = [0]

        def run() -> None:
            count[0] = sum(1 for k in self._links if node is None or k.node == node)

        self._command(run)
        return count[0]

    def take_down(self, node: int) -> None:
        """``node`` refuses new connections (listening socket closed); its links drop."""
        self._check_node(node)

        def run() -> None:
            listener = self._listeners.get(node)
            if listener is not None:
                self._unregister(listener)
                listener.close()
                self._listeners[node] = None
            for link in list(self._links):
                if link.node == node:
                    self._drop(link)

        self._command(run)

    def bring_up(self, node: int) -> None:
        """``node`` listens again, on the same port."""
        self._check_node(node)

        def run() -> None:
            if self._listeners.get(node) is None:
                self._listeners[node] = self._listen(self.ports[node])

        self._command(run)

    def is_up(self, node: int) -> bool:
        return self._listeners.get(node) is not None

    # -- internals: plumbing --------------------------------------------------------------

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} outside 0..{self.nodes - 1}")

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.create_server((HOST, port), reuse_port=False)
        listener.setblocking(False)
        return listener

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _command(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` in the loop thread and waits (bounded) until it has run."""
        if self._stop.is_set() or not self._thread.is_alive():
            raise RuntimeError("proxy is closed")
        done = threading.Event()
        self._commands.put((fn, done))
        self._wake()
        if not done.wait(_COMMAND_TIMEOUT_S):
            raise TimeoutError("proxy loop did not run the command")

    def _close_sockets(self) -> None:
        for link in list(self._links):
            self._drop(link)
        for node, listener in list(self._listeners.items()):
            if listener is not None:
                self._unregister(listener)
                listener.close()
            self._listeners[node] = None
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._wake_r)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()

    def _unregister(self, sock: socket.socket) -> None:
        if self._registered.pop(sock, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)

    def _interest(self, sock: socket.socket, events: int) -> None:
        current = self._registered.get(sock, 0)
        if events == current:
            return
        if not events:
            self._unregister(sock)
        elif not current:
            self._sel.register(sock, events)
            self._registered[sock] = events
        else:
            self._sel.modify(sock, events)
            self._registered[sock] = events

    def _drop(self, link: _Link) -> None:
        if link in self._links:
            self._links.remove(link)
        for sock in (link.client, link.upstream):
            self._unregister(sock)
            sock.close()

    # -- internals: the loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                self._update_interest()
                for key, events in self._sel.select(_POLL_S):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            sock.recv(4096)
                    else:
                        self._on_event(sock, events)
                self._release_answers()
                self._flush_all()
        finally:
            self._run_commands()  # release any waiter

    def _run_commands(self) -> None:
        while True:
            try:
                fn, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            finally:
                done.set()

    def _stalled(self, node: int) -> bool:
        with self._lock:
            return self._stalled_until.get(node, 0.0) > time.monotonic()

    def _update_interest(self) -> None:
        for listener in self._listeners.values():
            if listener is not None:
                self._interest(listener, selectors.EVENT_READ)
        for link in self._links:
            stalled = self._stalled(link.node)
            client = 0 if stalled else selectors.EVENT_READ
            if link.to_client and not stalled:
                client |= selectors.EVENT_WRITE
            upstream = selectors.EVENT_READ
            if link.connecting or link.to_upstream:
                upstream |= selectors.EVENT_WRITE
            self._interest(link.client, client)
            self._interest(link.upstream, upstream)

    def _on_event(self, sock: socket.socket, events: int) -> None:
        for node, listener in self._listeners.items():
            if sock is listener:
                self._accept(node, listener)
                return
        for link in self._links:
            if sock is link.client:
                if events & selectors.EVENT_READ and not self._read_client(link):
                    return
                if events & selectors.EVENT_WRITE:
                    self._flush(link)
                return
            if sock is link.upstream:
                if events & selectors.EVENT_WRITE and link.connecting:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        self._drop(link)
                        return
                    link.connecting = False
                if events & selectors.EVENT_READ and not self._read_upstream(link):
                    return
                self._flush(link)
                return

    def _accept(self, node: int, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            client.setblocking(False)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(node, client, upstream)
            self._links.append(link)
            rc = upstream.connect_ex(self.upstream)
            if rc not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                self._drop(link)
            else:
                link.connecting = rc != 0

    def _recv(self, link: _Link, sock: socket.socket) -> bytes | None:
        """Bytes read; None when the link was dropped (peer closed or error)."""
        try:
            data = sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            data = b""
        if not data:
            self._drop(link)
            return None
        return data

    def _flush(self, link: _Link) -> None:
        if link not in self._links:
            return
        if (
            link.to_upstream
            and not link.connecting
            and not self._send(link, link.upstream, link.to_upstream)
        ):
            return
        if link.to_client and not self._stalled(link.node):
            self._send(link, link.client, link.to_client)

    def _send(self, link: _Link, sock: socket.socket, buf: bytearray) -> bool:
        try:
            sent = sock.send(buf)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self._drop(link)
            return False
        del buf[:sent]
        return True

    def _flush_all(self) -> None:
        for link in list(self._links):
            self._flush(link)

    # -- internals: requests ---------------------------------------------------------------

    def _read_client(self, link: _Link) -> bool:
        data = self._recv(link, link.client)
        if data is None:
            return False
        if not data:
            return True
        if link.raw:
            link.to_upstream += data
            return True
        try:
            frames = link.from_client.feed(data)
        except Exception:
            # cannot frame the stream any more: forward what it holds, then everything
            link.raw = True
            link.to_upstream += data
            return True
        for payload in frames:
            if link.raw:
                link.to_upstream += _framed(payload)
            else:
                self._on_request(link, payload)
        return True

    def _on_request(self, link: _Link, payload: bytes) -> None:
        if len(payload) < _HEAD.size:
            link.raw = True
            link.to_upstream += _framed(payload)
            return
        api_key, version, corr = _HEAD.unpack_from(payload)
        with self._lock:
            self._seen[api_key] = self._seen.get(api_key, 0) + 1
        if api_key != PRODUCE:
            self._add_slot(link, corr, api_key, version)
            link.to_upstream += _framed(payload)
            return
        try:
            header, req = decode_request(payload)
        except Exception:
            # a Produce we cannot read (we do not know whether it will be answered)
            link.raw = True
            link.to_upstream += _framed(payload)
            return
        assert isinstance(req, ProduceRequest)
        answered = req.expects_response
        failed, forward = self._apply_rules(req)
        if not failed:
            if answered:
                self._add_slot(link, corr, api_key, version)
            link.to_upstream += _framed(payload)
            return
        slot = self._add_slot(link, corr, api_key, version) if answered else None
        if slot is not None:
            slot.forged = failed
        if forward:
            req.topic_data = forward
            link.to_upstream += encode_request(req, version, corr, header.client_id)
        elif slot is not None:
            self._fill(link, slot, encode_response(_forged(failed, []), version, corr))

    def _apply_rules(
        self, req: ProduceRequest
    ) -> tuple[list[tuple[str, int, int]], list[TopicProduceData]]:
        """The (topic, partition, error) to forge and the topic data still to forward."""
        with self._lock:
            limit = self._max_message_bytes
            visible = dict(self._visible)
        refused: list[tuple[str, int, int]] = []
        for t in req.topic_data:
            shown = visible.get(t.name)
            for p in t.partition_data:
                if shown is not None and p.index >= shown:  # a partition the topic lacks
                    refused.append((t.name, p.index, UNKNOWN_TOPIC_OR_PARTITION))
                elif limit is not None and p.records is not None and len(p.records) > limit:
                    refused.append((t.name, p.index, MESSAGE_TOO_LARGE))
        if refused:
            out = {(name, index) for name, index, _ in refused}
            kept = [
                TopicProduceData(
                    name=t.name,
                    partition_data=[p for p in t.partition_data if (t.name, p.index) not in out],
                )
                for t in req.topic_data
            ]
            return refused, [t for t in kept if t.partition_data]
        touched = {p.index for t in req.topic_data for p in t.partition_data}
        with self._lock:
            rule = next(
                (
                    r
                    for r in self._rules
                    if r.count > 0 and (r.partitions is None or r.partitions & touched)
                ),
                None,
            )
            if rule is None:
                return [], req.topic_data
            rule.count -= 1
            self._rules = [r for r in self._rules if r.count > 0]
        failed: list[tuple[str, int, int]] = []
        forward: list[TopicProduceData] = []
        for topic in req.topic_data:
            keep = []
            for part in topic.partition_data:
                if rule.partitions is None or part.index in rule.partitions:
                    failed.append((topic.name, part.index, rule.error_code))
                else:
                    keep.append(part)
            if keep:
                forward.append(TopicProduceData(name=topic.name, partition_data=keep))
        return failed, forward

    def _add_slot(self, link: _Link, corr: int, api_key: int, version: int) -> _Slot:
        slot = _Slot(corr, api_key, version)
        link.slots.append(slot)
        link.by_corr[corr] = slot
        return slot

    def _fill(self, link: _Link, slot: _Slot, frame: bytes) -> None:
        with self._lock:
            delay = self._delay_s.get(link.node, 0.0)
        slot.frame = frame
        slot.ready_at = time.monotonic() + delay
        self._release(link)

    def _release(self, link: _Link) -> None:
        now = time.monotonic()
        while link.slots:
            head = link.slots[0]
            if head.frame is None or head.ready_at > now:
                return
            link.slots.popleft()
            link.by_corr.pop(head.correlation_id, None)
            link.to_client += head.frame

    def _release_answers(self) -> None:
        for link in self._links:
            self._release(link)

    # -- internals: answers ----------------------------------------------------------------

    def _read_upstream(self, link: _Link) -> bool:
        data = self._recv(link, link.upstream)
        if data is None:
            return False
        if not data:
            return True
        if link.from_upstream is None:
            link.to_client += data
            return True
        try:
            frames = link.from_upstream.feed(data)
        except Exception:
            link.from_upstream = None
            link.to_client += data
            return True
        for payload in frames:
            self._on_answer(link, payload)
        return True

    def _on_answer(self, link: _Link, payload: bytes) -> None:
        slot = link.by_corr.get(peek_correlation_id(payload)) if len(payload) >= 4 else None
        if slot is None:
            link.to_client += _framed(payload)
            return
        frame = _framed(payload)
        try:
            if slot.api_key == METADATA:
                frame = self._rewrite_metadata(payload, slot)
            elif slot.api_key == PRODUCE and slot.forged:
                corr, resp = decode_response(ProduceResponse, payload, slot.version)
                frame = encode_response(_forged(slot.forged, resp.responses), slot.version, corr)
        except Exception:
            frame = _framed(payload)  # not understood: unchanged
        self._fill(link, slot, frame)

    def _rewrite_metadata(self, payload: bytes, slot: _Slot) -> bytes:
        lo, hi = MetadataResponse.VERSIONS
        if not lo <= slot.version <= hi:
            return _framed(payload)
        corr, resp = decode_response(MetadataResponse, payload, slot.version)
        resp.brokers = [
            MetadataResponseBroker(node_id=n, host=HOST, port=self.ports[n], rack=None)
            for n in range(self.nodes)
        ]
        resp.controller_id = 0
        with self._lock:
            leaders = dict(self._leaders)
            moves = dict(self._moves)
            visible = dict(self._visible)
        for topic in resp.topics:
            shown = visible.get(topic.name or "")
            if shown is not None:
                topic.partitions = [p for p in topic.partitions if p.partition_index < shown]
            for part in topic.partitions:
                key = (topic.name or "", part.partition_index)
                leader = leaders.get(key, part.partition_index % self.nodes)
                others = [n for n in range(self.nodes) if n != leader]
                part.leader_id = leader
                part.replica_nodes = [leader, *others]
                part.isr_nodes = [leader, *others]
                part.offline_replicas = []
                if part.leader_epoch >= 0:
                    part.leader_epoch += moves.get(key, 0)
        return encode_response(resp, slot.version, corr)


def _forged(
    failed: list[tuple[str, int, int]], responses: list[TopicProduceResponse]
) -> ProduceResponse:
    """A ProduceResponse: the broker's ``responses`` plus an error for each failed partition."""
    by_name = {t.name: t for t in responses}
    for name, index, error in failed:
        topic = by_name.get(name)
        if topic is None:
            topic = TopicProduceResponse(name=name, partition_responses=[])
            by_name[name] = topic
            responses.append(topic)
        topic.partition_responses.append(
            PartitionProduceResponse(index=index, error_code=error, base_offset=-1)
        )
    return ProduceResponse(responses=responses)
