"""One handler object per kind of broker request: what becomes of it once written (acks=0
produce), answered, lost with its connection, or aborted as the sender ends
(:class:`shmprod.sender.nodes.Handler`). A request carries its handler as its context,
so nothing tells request kinds apart by markers.

Each handler is given the parts it reports to, never the loop itself.

Runs in: sender (one thread; no lock).
"""

from __future__ import annotations

from collections.abc import Callable

from shmprod.protocol.messages import (
    InitProducerIdResponse,
    MetadataResponse,
    ProduceResponse,
    Response,
)
from shmprod.sender.completions import Completions
from shmprod.sender.inflight import InFlightLedger
from shmprod.sender.metadata import Metadata
from shmprod.sender.nodes import Nodes
from shmprod.sender.produce import BatchAnswer, ProduceContext, match_response
from shmprod.sender.producer_id import ProducerIdDriver
from shmprod.sender.workers import Workers

__all__ = ["FenceHandler", "MetadataHandler", "ProduceHandler", "ProducerIdHandler"]


class ProduceHandler:
    """A ProduceRequest's batches (``ctx``): out of the in-flight ledger when it ends,
    then answered, lost (retried or failed by the policy) or aborted."""

    __slots__ = ("_done", "_in_flight", "ctx")

    def __init__(self, ctx: ProduceContext, in_flight: InFlightLedger, done: Completions) -> None:
        self.ctx = ctx
        self._in_flight = in_flight
        self._done = done

    def on_written(self) -> None:
        self._in_flight.done(self.ctx.batches.values())
        for batch in self.ctx.batches.values():
            self._done.finish(batch, 0)

    def on_response(self, resp: Response, now: int) -> None:
        assert isinstance(resp, ProduceResponse)
        self._in_flight.done(self.ctx.batches.values())
        for ans in match_response(self.ctx, resp):
            ans.batch.unresolved = False  # the broker answered for it
            self._done.on_answer(ans, now)

    def on_lost(self, code: int, reason: str, now: int) -> None:
        self._in_flight.done(self.ctx.batches.values())
        for batch in self.ctx.batches.values():
            self._done.on_answer(BatchAnswer(batch, code, message=reason), now)

    def on_abort(self, code: int, message: str) -> None:
        self._in_flight.done(self.ctx.batches.values())
        for batch in self.ctx.batches.values():
            self._done.finish(batch, code, message=message)


class MetadataHandler:
    """A Metadata request: topic answers to the workers waiting, queued batches of
    partitions that are gone failed, bootstrap connections adopted as nodes'."""

    __slots__ = ("_done", "_metadata", "_nodes", "_workers")

    def __init__(
        self, metadata: Metadata, workers: Workers, done: Completions, nodes: Nodes
    ) -> None:
        self._metadata = metadata
        self._workers = workers
        self._done = done
        self._nodes = nodes

    def on_written(self) -> None:
        pass

    def on_response(self, resp: Response, now: int) -> None:
        assert isinstance(resp, MetadataResponse)
        self._workers.send_topic_answers(self._metadata.on_response(resp, now))
        self._done.fail_gone_partitions()
        self._nodes.adopt_bootstrap()

    def on_lost(self, code: int, reason: str, now: int) -> None:
        self._metadata.on_failure(now)

    def on_abort(self, code: int, message: str) -> None:
        pass


class ProducerIdHandler:
    """An InitProducerId request: its answer to ``on_response``, its loss to the
    producer-id driver (a retry after backoff)."""

    __slots__ = ("_on_response", "_pid")

    def __init__(
        self,
        pid: ProducerIdDriver,
        on_response: Callable[[InitProducerIdResponse, int], None],
    ) -> None:
        self._pid = pid
        self._on_response = on_response

    def on_written(self) -> None:
        pass

    def on_response(self, resp: Response, now: int) -> None:
        assert isinstance(resp, InitProducerIdResponse)
        self._on_response(resp, now)

    def on_lost(self, code: int, reason: str, now: int) -> None:
        self._pid.on_lost(now)

    def on_abort(self, code: int, message: str) -> None:
        pass


class FenceHandler:
    """A request sent at close with acks=0 only to learn, from its answer, that the
    broker read every produce request written before it on that connection: answered
    or lost, the connection is past its fence (``node`` leaves ``fences``)."""

    __slots__ = ("fences", "node")

    def __init__(self, fences: set[int], node: int) -> None:
        self.fences = fences
        self.node = node

    def on_written(self) -> None:
        pass

    def on_response(self, resp: Response, now: int) -> None:
        self.fences.discard(self.node)

    def on_lost(self, code: int, reason: str, now: int) -> None:
        self.fences.discard(self.node)

    def on_abort(self, code: int, message: str) -> None:
        pass
