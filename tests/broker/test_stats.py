"""``shmprod stats``: a running producer read from another process without attaching;
--json and the metrics endpoint report counters that match what the test sent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker
from shmprod.stats import StatsError, live_producers, snapshot
from tests.support.procs import free_port

pytestmark = pytest.mark.broker


def _send(p: Producer, topic: str, n: int) -> None:
    futs = [p.send(topic, b"v%d" % i, partition=i % 3) for i in range(n)]
    p.flush(30)
    assert all(f.exception(0) is None for f in futs)


def test_stats_json_counts_what_was_sent_without_attaching(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 3)
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        _send(p, topic_name, 3_000)
        seg = p.handle.segment
        assert seg in live_producers()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "shmprod",
                "stats",
                seg,
                "--json",
                "--count",
                "2",
                "--interval",
                "0.1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(lines) == 2
        snap = lines[-1]
        assert snap["sender"]["records_sent"] == 3_000
        assert snap["topics"][topic_name]["records_sent"] == [1_000, 1_000, 1_000]
        assert snap["topics"][topic_name]["queue_depth"] == [0, 0, 0]
        assert [w["pid"] for w in snap["workers"]] == [p._pid]  # the reader never attached
        assert p.stats()["sender"]["workers_attached"] == 1
        text = subprocess.run(
            [sys.executable, "-m", "shmprod", "stats", seg, "--count", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "sent 3,000 records" in text and "attached processes 1" in text
    with pytest.raises(StatsError, match="no producer"):
        snapshot(seg)


def test_metrics_endpoint_serves_the_counters(broker: EmbeddedBroker, topic_name: str) -> None:
    pytest.importorskip("prometheus_client")
    broker.create_topic(topic_name, 3)
    port = free_port()
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        _send(p, topic_name, 1_200)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmprod",
                "stats",
                p.handle.segment,
                "--serve",
                str(port),
                "--count",
                "60",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert "serving" in proc.stdout.readline()
            deadline = time.monotonic() + 20
            body = ""
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        body = r.read().decode()
                    break
                except OSError:
                    time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(20)
            if proc.stdout:
                proc.stdout.close()
    seg = p.handle.segment
    assert f'shmprod_records_sent_total{{segment="{seg}"}} 1200.0' in body
    assert f'shmprod_workers_attached{{segment="{seg}"}} 1.0' in body
    assert (
        f'shmprod_partition_queued_batches{{partition="0",segment="{seg}",topic="{topic_name}"}} 0.0'
        in body
    )


def test_stats_refuses_what_it_cannot_read(tmp_path: object) -> None:
    with pytest.raises(StatsError, match="not a shmprod segment name"):
        snapshot("etc-passwd")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmprod",
            "stats",
            "shmprod-000000000000000000000000",
            "--count",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no producer" in out.stderr


def test_snapshot_of_scribbled_bytes_is_a_stats_error_or_a_reading(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """Fuzz: a copy of a real segment with random bytes overwritten anywhere (header,
    tables, counters) is read as a snapshot or refused with StatsError; never another
    exception."""
    import os
    import random

    from shmprod.shm import NAME_PREFIX, SHM_DIR

    broker.create_topic(topic_name, 3)
    with Producer(bootstrap_servers=broker.bootstrap) as p:
        _send(p, topic_name, 300)
        with open(os.path.join(SHM_DIR, p.handle.segment), "rb") as f:
            real = f.read(2 * 1024 * 1024)  # the header and tables come first
    rng = random.Random(7)
    name = f"{NAME_PREFIX}fuzz{os.getpid()}"
    path = os.path.join(SHM_DIR, name)
    tables_end = min(len(real), 256 * 1024)
    try:
        for _ in range(200):
            data = bytearray(real)
            for _ in range(rng.randint(1, 16)):
                at = rng.randrange(tables_end)
                data[at : at + 4] = rng.randbytes(4)
            if rng.random() < 0.1:
                data = data[: rng.randrange(len(data))]
            with open(path, "wb") as f:
                f.write(data)
            try:
                snap = snapshot(name)
            except StatsError:
                continue
            assert isinstance(snap["sender"]["records_sent"], int)
    finally:
        os.unlink(path)


def test_stats_finds_a_host_producer_by_its_configuration(
    broker: EmbeddedBroker, topic_name: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--bootstrap-servers`` and ``-X`` name a host producer's configuration; options
    given as text (linger.ms=5) are the same configuration as keywords (linger_ms=5)."""
    import os

    from shmprod import host_producer

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    broker.create_topic(topic_name, 1)
    with host_producer(broker.bootstrap, linger_ms=5, idle_timeout_ms=300) as w:
        w.send(topic_name, b"x", partition=0).result(30)
        args = ["stats", "--bootstrap-servers", broker.bootstrap, "--json", "--count", "1"]
        out = subprocess.run(
            [sys.executable, "-m", "shmprod", *args, "-X", "linger.ms=5"],
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["segment"] == w.segment_name
        other = subprocess.run(
            [sys.executable, "-m", "shmprod", *args, "-X", "linger.ms=6"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 1 and "no host producer of that configuration" in other.stderr
