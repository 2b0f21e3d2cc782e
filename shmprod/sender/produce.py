"""ProduceRequests from drained batches, and their answers matched back to the batches.

Record batches are never copied: each is a memoryview slice of the shared-memory segment
spliced into the request's segments (``encode_request_segments``) and written with
``socket.sendmsg``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shmprod.protocol import error_codes as ec
from shmprod.protocol.messages import (
    PartitionProduceData,
    PartitionProduceResponse,
    ProduceRequest,
    ProduceResponse,
    TopicProduceData,
)
from shmprod.sender.batch import Batch


@dataclass(slots=True)
class ProduceContext:
    """What a produce request in flight carries, to complete its batches."""

    node: int
    batches: dict[tuple[str, int], Batch] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """One batch's part of a produce response."""

    batch: Batch
    code: int
    base_offset: int = -1
    log_append_time_ms: int = -1
    message: str = ""


def build_request(
    node: int,
    batches: list[Batch],
    locate: Callable[[int], tuple[str, int]],
    records_of: Callable[[Batch], memoryview],
    *,
    acks: int,
    timeout_ms: int,
) -> tuple[ProduceRequest, ProduceContext]:
    """A request with one batch per partition; ``locate`` maps a partition slot to
    (topic, partition), ``records_of`` gives the batch's bytes in shared memory."""
    ctx = ProduceContext(node)
    by_topic: dict[str, list[PartitionProduceData]] = {}
    for batch in batches:
        topic, partition = locate(batch.partition_slot)
        if (topic, partition) in ctx.batches:  # the drain's one rule: never overwrite
            raise ValueError(f"two batches for partition {partition} of {topic!r} in a request")
        ctx.batches[(topic, partition)] = batch
        by_topic.setdefault(topic, []).append(
            PartitionProduceData(index=partition, records=records_of(batch))
        )
    req = ProduceRequest(
        acks=acks,
        timeout_ms=timeout_ms,
        topic_data=[TopicProduceData(name=t, partition_data=p) for t, p in by_topic.items()],
    )
    return req, ctx


def match_response(ctx: ProduceContext, resp: ProduceResponse) -> list[BatchAnswer]:
    """Every batch of ``ctx`` with its answer. A batch the broker left out of its
    response counts as a retriable NETWORK_EXCEPTION (13): retried after a metadata
    refresh rather than lost."""
    pending = dict(ctx.batches)
    out: list[BatchAnswer] = []
    for topic in resp.responses:
        for p in topic.partition_responses:
            batch = pending.pop((topic.name, p.index), None)
            if batch is not None:
                out.append(_answer(batch, p))
    out.extend(
        BatchAnswer(b, ec.NETWORK_EXCEPTION, message="partition missing from the produce response")
        for b in pending.values()
    )
    return out


def _answer(batch: Batch, p: PartitionProduceResponse) -> BatchAnswer:
    message = p.error_message or ""
    if p.record_errors:
        first = p.record_errors[0]
        detail = first.batch_index_error_message or ""
        message = f"{message} (record {first.batch_index}: {detail})".strip()
    return BatchAnswer(batch, p.error_code, p.base_offset, p.log_append_time_ms, message)
