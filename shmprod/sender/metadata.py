"""Cluster metadata: nodes, topics, leaders, and the topic table in shared memory.

Sans-IO: :meth:`Metadata.build_request` says what to ask, :meth:`Metadata.on_response`
takes the answer; the loop moves the bytes (on any ready connection, one Metadata
request at a time).

The topic table (written only here, read by workers):

- A worker asks ``TopicRequest(request_id, name)``. A known topic is answered at once;
  an unknown one is fetched (Metadata with ``allow_auto_topic_creation`` true, Java's
  default) and retried with exponential backoff while it stays unknown
  (UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE or any retriable code). A waiter is
  answered ``MetadataTimeoutError``'s code after ``max_block_ms`` (the worker enforces
  the same bound; the late answer is harmless). A non-retriable code (INVALID_TOPIC 17,
  TOPIC_AUTHORIZATION_FAILED 29, ...) is answered at once and the topic is forgotten.
- A topic gets a TOPIC slot and a contiguous range of PARTITION slots
  (``partition_slot = base + partition``). Publication order: every PARTITION slot of
  the range (leader), then the TOPIC slot (name, base, count, error, state), then
  H_METADATA_EPOCH is bumped, then TopicInfo is sent.
- A topic-partition has ONE home slot for good: its queue, in-flight count, sequences
  and counters live there, whatever range a worker found it through. A partition count
  increase gets a NEW contiguous range (workers need ``base + partition``); the slots of
  the partitions that existed before are aliases: their ``P_HOME`` names the old slot,
  and the sender maps every sealed batch to its home (:meth:`Metadata.home`). The new
  range's PARTITION slots are written first, then the TOPIC slot (base first, then
  count), so a concurrent reader sees (old base, old count), (new base, old count) or
  (new base, new count): all valid. The epoch is bumped and ``TopicInfo(request_id=0,
  ...)`` is pushed to every worker.
- A smaller count (a topic deleted and created again with fewer partitions): the TOPIC
  slot keeps its range with the smaller count, and the partitions beyond it are *gone*
  (:meth:`Metadata.gone`): batches for them fail with UNKNOWN_TOPIC_OR_PARTITION instead
  of being retried until their delivery timeout. A later increase within the range
  brings them back; beyond it, a new range as above.
- Slots are never reused: a full table answers the worker ProducerError's code (-1000).

Refreshes: every ``metadata_max_age_ms``; on demand (a partition without a leader, or a
produce error that calls for it), at most once per ``retry_backoff_ms``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from shmprod import layout as L
from shmprod.errors import MetadataTimeoutError, ProducerError
from shmprod.ipc import TopicInfo
from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import (
    MetadataRequest,
    MetadataRequestTopic,
    MetadataResponse,
    MetadataResponsePartition,
)
from shmprod.sender.policy import backoff_ns
from shmprod.sender.shmstate import SharedState
from shmprod.sender.units import MS

log = logging.getLogger("shmprod.sender")


@dataclass(frozen=True, slots=True)
class TopicAnswer:
    """A TopicInfo to send: to ``owner``, or to every worker when ``owner`` is None."""

    owner: int | None
    info: TopicInfo


@dataclass(slots=True)
class _Waiter:
    owner: int
    request_id: int
    since_ns: int


@dataclass(slots=True)
class _Topic:
    name: str
    slot: int = -1
    n_partitions: int = 0
    base: int = -1
    width: int = 0  # slots in the current range (n_partitions after a shrink is smaller)
    homes: list[int] = field(default_factory=list)  # partition -> its home slot
    ranges: list[tuple[int, int]] = field(default_factory=list)  # every (base, count) used
    waiters: list[_Waiter] = field(default_factory=list)
    attempts: int = 0  # consecutive answers that left it unknown

    @property
    def ready(self) -> bool:
        return self.slot >= 0


class Metadata:
    """Nodes, leaders and the topic table. Runs in: sender (the only writer of TOPIC
    slots, P_LEADER and H_METADATA_EPOCH; no lock needed)."""

    def __init__(
        self,
        shared: SharedState,
        *,
        max_age_ms: int,
        retry_backoff_ms: int,
        retry_backoff_max_ms: int,
        max_block_ms: int,
    ) -> None:
        self._shared = shared
        self._max_age_ns = max(max_age_ms, retry_backoff_ms, 1) * MS
        self._backoff_ms = retry_backoff_ms
        self._backoff_max_ms = retry_backoff_max_ms
        self._max_block_ns = max_block_ms * MS
        self.nodes: dict[int, tuple[str, int]] = {}
        self._topics: dict[str, _Topic] = {}
        self._leaders: dict[int, int] = {}  # partition slot -> node id (-1 unknown)
        self._where: dict[int, tuple[str, int]] = {}  # partition slot -> (topic, partition)
        self._home: dict[int, int] = {}  # partition slot -> home slot of its partition
        self._gone: set[int] = set()  # home slots of partitions the topic no longer has
        self._next_topic_slot = 0
        self._next_partition_slot = 0
        self.in_flight = False
        self.updated_ns: int | None = None  # time of the last answer
        self._next_at_ns: int | None = 0  # a request is wanted from then on (now: bootstrap)
        self._failures = 0

    # -- lookups -------------------------------------------------------------------------

    @property
    def bootstrapped(self) -> bool:
        return self.updated_ns is not None

    def leader(self, partition_slot: int) -> int:
        return self._leaders.get(partition_slot, -1)

    def locate(self, partition_slot: int) -> tuple[str, int] | None:
        """(topic, partition) of a PARTITION slot, None if no topic owns it."""
        return self._where.get(partition_slot)

    def home(self, partition_slot: int) -> int | None:
        """The home slot of the topic-partition a PARTITION slot names (itself, or the
        partition's first slot when the slot belongs to a range made by growth); None if
        no topic owns the slot."""
        return self._home.get(partition_slot)

    def gone(self, home_slot: int) -> bool:
        """Whether the topic no longer has this partition (it shrank: recreated)."""
        return home_slot in self._gone

    def address(self, node_id: int) -> tuple[str, int] | None:
        return self.nodes.get(node_id)

    # -- worker requests -----------------------------------------------------------------

    def topic_request(
        self, owner: int, request_id: int, name: str, now_ns: int
    ) -> TopicInfo | None:
        """Answers at once for a known topic, else remembers the waiter (answered from
        :meth:`on_response` or :meth:`expire_waiters`)."""
        topic = self._topics.get(name)
        if topic is not None and topic.ready:
            return TopicInfo(request_id, topic.slot, topic.n_partitions, 0, name)
        if topic is None:
            topic = self._topics[name] = _Topic(name)
        topic.waiters.append(_Waiter(owner, request_id, now_ns))
        self._want(now_ns)
        return None

    def expire_waiters(self, now_ns: int) -> list[TopicAnswer]:
        """Answers waiters older than ``max_block_ms`` with MetadataTimeoutError's code."""
        out: list[TopicAnswer] = []
        for topic in list(self._topics.values()):
            if not topic.waiters:
                continue
            late = [w for w in topic.waiters if now_ns - w.since_ns >= self._max_block_ns]
            if not late:
                continue
            topic.waiters = [w for w in topic.waiters if w not in late]
            out.extend(_answer(w, topic, MetadataTimeoutError.code) for w in late)
            if not topic.ready and not topic.waiters:
                del self._topics[topic.name]
        return out

    def drop_owner(self, owner: int) -> None:
        """Forgets the waiters of a worker that left."""
        for topic in self._topics.values():
            if topic.waiters:
                topic.waiters = [w for w in topic.waiters if w.owner != owner]

    def fail_waiters(self, code: int) -> list[TopicAnswer]:
        """Answers every waiter with ``code`` (shutdown)."""
        out: list[TopicAnswer] = []
        for topic in list(self._topics.values()):
            out.extend(_answer(w, topic, code) for w in topic.waiters)
            topic.waiters = []
            if not topic.ready:
                del self._topics[topic.name]
        return out

    @property
    def has_waiters(self) -> bool:
        return any(t.waiters for t in self._topics.values())

    # -- scheduling ----------------------------------------------------------------------

    def _want(self, at_ns: int) -> None:
        if self._next_at_ns is None or at_ns < self._next_at_ns:
            self._next_at_ns = at_ns

    def request_refresh(self, now_ns: int) -> None:
        """Asks for a refresh soon: at most once per ``retry_backoff_ms`` after the last
        answer (leaders changed, a node failed, a partition has no leader)."""
        earliest = now_ns
        if self.updated_ns is not None:
            earliest = max(now_ns, self.updated_ns + self._backoff_ms * MS)
        self._want(earliest)

    def next_due_ns(self) -> int | None:
        """When a Metadata request should next go out (None: in flight)."""
        if self.in_flight:
            return None
        due = None if self.updated_ns is None else self.updated_ns + self._max_age_ns
        if self._next_at_ns is not None and (due is None or self._next_at_ns < due):
            due = self._next_at_ns
        return due

    def due(self, now_ns: int) -> bool:
        at = self.next_due_ns()
        return at is not None and at <= now_ns

    def build_request(self) -> MetadataRequest:
        """The next Metadata request: every known and wanted topic (none: brokers only).

        Marks a request in flight; answer with :meth:`on_response` or :meth:`on_failure`.
        """
        self.in_flight = True
        self._next_at_ns = None
        return MetadataRequest(
            topics=[MetadataRequestTopic(name=n) for n in self._topics],
            allow_auto_topic_creation=True,
        )

    def on_failure(self, now_ns: int) -> None:
        """The request was lost with its connection: ask again after a backoff."""
        self.in_flight = False
        self._failures += 1
        self._want(now_ns + backoff_ns(self._failures, self._backoff_ms, self._backoff_max_ms))

    # -- answers -------------------------------------------------------------------------

    def on_response(self, resp: MetadataResponse, now_ns: int) -> list[TopicAnswer]:
        """Applies an answer to the table; returns the TopicInfos to send."""
        self.in_flight = False
        self._failures = 0
        self.updated_ns = now_ns
        if resp.brokers:
            self.nodes = {b.node_id: (b.host, b.port) for b in resp.brokers}
        out: list[TopicAnswer] = []
        changed = False
        seen: set[str] = set()
        for t in resp.topics:
            topic = self._topics.get(t.name) if t.name is not None else None
            if topic is None:
                continue  # not asked for (some brokers answer every topic)
            seen.add(topic.name)
            if t.error_code == ec.NONE and t.partitions:
                changed |= self._apply_partitions(topic, t.partitions, out)
            elif t.error_code == ec.NONE or ec.is_retriable(t.error_code):
                self._still_unknown(topic, now_ns)
            else:
                out.extend(_answer(w, topic, t.error_code) for w in topic.waiters)
                topic.waiters = []
                if not topic.ready:
                    del self._topics[topic.name]
        for topic in list(self._topics.values()):
            if topic.name not in seen and not topic.ready:
                self._still_unknown(topic, now_ns)
        if changed:
            self._shared.bump_metadata_epoch()
        return out

    def _still_unknown(self, topic: _Topic, now_ns: int) -> None:
        if topic.ready:
            return
        topic.attempts += 1
        self._want(now_ns + backoff_ns(topic.attempts, self._backoff_ms, self._backoff_max_ms))

    def _apply_partitions(
        self,
        topic: _Topic,
        partitions: Iterable[MetadataResponsePartition],
        out: list[TopicAnswer],
    ) -> bool:
        """Leaders and partition count of a topic the broker knows; True if the table
        changed (the caller bumps the epoch after all topics)."""
        leaders: dict[int, int] = {}
        for p in partitions:
            if p.partition_index < 0:
                continue
            leader = -1 if p.error_code == ec.LEADER_NOT_AVAILABLE else p.leader_id
            leaders[p.partition_index] = leader
        count = max(leaders) + 1 if leaders else 0
        if count == 0:
            return False
        if topic.ready and count == topic.n_partitions:
            self._set_leaders(topic, leaders)
            return False
        if topic.ready and count <= topic.width:
            self._resize(topic, count, out)  # shrank, or grew back within its range
            self._set_leaders(topic, leaders)
            return True
        base = self._next_partition_slot
        if base + count > self._shared.geo.max_partitions or (
            not topic.ready and self._next_topic_slot >= self._shared.geo.max_topics
        ):
            out.extend(_answer(w, topic, ProducerError.code) for w in topic.waiters)
            topic.waiters = []
            if not topic.ready:
                del self._topics[topic.name]
            return False
        self._next_partition_slot += count
        for i in range(count):
            slot = base + i
            if i == len(topic.homes):
                topic.homes.append(slot)
            home = topic.homes[i]
            self._where[slot] = (topic.name, i)
            self._home[slot] = home
            self._gone.discard(home)
            self._leaders[slot] = leaders.get(i, -1)
            self._shared.init_partition(slot, leaders.get(i, -1), home)
        for i in range(count, len(topic.homes)):
            self._gone.add(topic.homes[i])  # it had more partitions once (recreated)
        grown = topic.ready
        if not topic.ready:
            topic.slot = self._next_topic_slot
            self._next_topic_slot += 1
        topic.base = base
        topic.width = count
        topic.n_partitions = count
        topic.ranges.append((base, count))
        topic.attempts = 0
        self._set_leaders(topic, leaders)
        self._shared.write_topic(
            topic.slot,
            name=topic.name,
            state=L.TOPIC_READY,
            n_partitions=count,
            base=base,
            error=0,
        )
        if grown:
            out.append(TopicAnswer(None, TopicInfo(0, topic.slot, count, 0, topic.name)))
        out.extend(
            TopicAnswer(w.owner, TopicInfo(w.request_id, topic.slot, count, 0, topic.name))
            for w in topic.waiters
        )
        topic.waiters = []
        return True

    def _resize(self, topic: _Topic, count: int, out: list[TopicAnswer]) -> None:
        """A new partition count within the topic's current range: partitions from
        ``count`` on are gone (or back, when it grew again). Every worker is told."""
        old = topic.n_partitions
        topic.n_partitions = count
        for i, home in enumerate(topic.homes):
            if i < count:
                self._gone.discard(home)
            else:
                self._gone.add(home)
        self._shared.write_topic(
            topic.slot,
            name=topic.name,
            state=L.TOPIC_READY,
            n_partitions=count,
            base=topic.base,
            error=0,
        )
        out.append(TopicAnswer(None, TopicInfo(0, topic.slot, count, 0, topic.name)))
        if count < old:
            log.warning(
                "topic %r now has %d partitions, not %d: batches for partitions %d-%d fail",
                topic.name,
                count,
                old,
                count,
                old - 1,
            )

    def _set_leaders(self, topic: _Topic, leaders: dict[int, int]) -> None:
        for base, count in topic.ranges:
            for i in range(count):
                slot = base + i
                leader = leaders.get(i, -1)
                if self._leaders.get(slot) != leader:
                    self._leaders[slot] = leader
                    self._shared.set_leader(slot, leader)


def _answer(w: _Waiter, topic: _Topic, code: int) -> TopicAnswer:
    return TopicAnswer(w.owner, TopicInfo(w.request_id, -1, 0, code, topic.name))
