"""The fault matrix: every fault, the same known records, the same counts.

Each row (``tests.support.faultrig.rows``) sends a known set of records through several
spawned worker processes, injects one fault, reads the topic back with confluent-kafka
and counts sent, acknowledged, failed (by error), duplicated and lost records. With
idempotence on, nothing acknowledged is lost, nothing is written twice, per-partition
order holds, and the log holds nothing nobody sent. ``python -m tests.support.faultrig
--table`` prints the same rows as README.md's "Fault matrix" table.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from shmprod import Producer, attach
from shmprod.broker import EmbeddedBroker
from shmprod.errors import SenderDiedError
from shmprod.worker import append as A
from tests.support.faultrig import Row, Tally, rows, run_row

pytestmark = pytest.mark.broker


def _params() -> list[object]:
    return [pytest.param(row, id=row.fault) for row in rows()]


def _no_harm(t: Tally) -> None:
    """What no fault may break: acknowledged records are in the log once, in order."""
    assert t.lost == 0, "acknowledged records missing from the log"
    assert t.duplicated == 0, "records written more than once"
    assert t.order_kept, "per-partition order broken"
    assert t.misplaced == 0, "records at another partition/offset than their futures said"
    assert t.foreign == 0, "records in the log that nobody sent"


@pytest.mark.parametrize("row", _params())
def test_fault(row: Row, broker: EmbeddedBroker, topic_name: str) -> None:
    t = run_row(row, broker, topic_name)
    failed_checks = [name for name, ok in t.checks.items() if not ok]
    assert not failed_checks, f"{row.fault}: {failed_checks}; failed: {t.failed_text()} {t.notes}"
    _no_harm(t)
    total = (row.workers + row.late_workers) * row.records
    if row.note == "kill":
        victims = len(row.hooks)
        assert t.acked == (row.workers - victims + row.late_workers) * row.records
        assert not t.failed and not t.refused
        assert t.no_outcome > 0  # the dead workers had handed records over
    elif row.note in ("sender", "owner"):
        allowed = {"SenderDiedError", "OwnerDiedError"}
        assert t.failed or t.refused, "no future failed after the kill"
        assert set(t.failed) | set(t.refused) <= allowed
        assert t.no_outcome == 0, "futures still pending after the kill"
        assert 0 < t.acked < total
    elif row.hooks:  # a worker scribbled over its own sealed batch
        assert set(t.failed) == {"CorruptBatchError"}, t.failed
        assert not t.refused and t.failed_but_written == 0
        assert t.acked + t.failed["CorruptBatchError"] == total
    elif "full pool" in row.fault:
        assert set(t.refused) == {"BufferExhaustedError"}, t.refused
        assert not t.failed
        assert t.acked == t.sent and t.acked + sum(t.refused.values()) == total
    elif row.note == "shrink":  # only batches for the partitions that went away fail
        assert set(t.failed) <= {"UNKNOWN_TOPIC_OR_PARTITION"}, t.failed
        assert not t.refused and t.no_outcome == 0 and t.failed_but_written == 0
        assert t.acked + sum(t.failed.values()) == t.sent == total
    elif "scribble" in row.fault:
        assert t.checks.get("scribbled_some")
        assert set(t.failed) == {"CorruptBatchError"}, t.failed
    else:  # broker and network faults: every record is delivered
        assert not t.failed and not t.refused and t.no_outcome == 0, t.failed_text()
        assert t.acked == t.sent == total


def test_growth_without_idempotence(broker: EmbeddedBroker, topic_name: str) -> None:
    """Without idempotence too, a topic-partition is one queue: a request never carries
    two batches of one partition (one would overwrite the other), nothing stays in flight."""
    growth = next(r for r in rows() if r.note == "growth")
    growth.options = {**growth.options, "enable_idempotence": False}
    t = run_row(growth, broker, topic_name)
    assert not [name for name, ok in t.checks.items() if not ok], t.checks
    _no_harm(t)
    assert not t.failed and not t.refused and t.no_outcome == 0, t.failed_text()
    assert t.acked == t.sent == growth.workers * growth.records


def test_send_batch_racing_a_dead_sender_fails_its_future(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """The sender dies while ``send_batch`` writes batches into buffers it already holds;
    the worker's I/O thread fails everything and exits before the batches are handed
    over. The call must raise, or its future fail at once; never wait until close()."""
    broker.create_topic(topic_name, 2)
    with Producer(bootstrap_servers=broker.bootstrap, batch_size=16 * 1024) as p:
        w = attach(p.handle)
        try:
            w.send_batch(topic_name, [b"warm-up"]).result(timeout=30)

            def kill_sender(point: str, view: memoryview, end: int) -> None:
                A.fault_hook = None
                os.kill(p.sender_pid, signal.SIGKILL)
                w._thread.join(10)  # the I/O thread saw EOF, failed everything, exited
                assert not w._thread.is_alive()

            A.fault_hook = kill_sender
            try:
                fut = w.send_batch(topic_name, [b"v%d" % i for i in range(5_000)])
            except SenderDiedError:
                pass  # nothing was handed over: the call raises
            else:
                assert isinstance(fut.exception(timeout=5), SenderDiedError)
        finally:
            A.fault_hook = None
            w.close(timeout=5)


# the network faults again with one connection to each broker (Java's layout; the matrix
# runs with the default connections_per_broker, two, each partition on one of them):
# nothing may change in what the table counts
LANE_FAULTS = (
    "connections dropped x5",
    "leaders moved (+ NOT_LEADER x2)",
    "node 1 down 1 s, then back",
)


@pytest.mark.parametrize("fault", LANE_FAULTS)
def test_fault_over_one_connection_per_broker(
    fault: str, broker: EmbeddedBroker, topic_name: str
) -> None:
    (row,) = [r for r in rows() if r.fault == fault]
    row = dataclasses.replace(row, options={**row.options, "connections_per_broker": 1})
    t = run_row(row, broker, topic_name)
    failed_checks = [name for name, ok in t.checks.items() if not ok]
    assert not failed_checks, f"{row.fault}: {failed_checks}; failed: {t.failed_text()} {t.notes}"
    _no_harm(t)
    assert not t.failed and not t.refused and t.no_outcome == 0, t.failed_text()
    assert t.acked == t.sent == row.workers * row.records
