"""shmprod.export and ``shmprod export``: tables, DataFrames and files through a pool of
processes sharing one producer, read back row for row by confluent-kafka; refusals
before anything is sent; the progress bar on a terminal and none when piped."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import shmprod
from shmprod.broker import EmbeddedBroker
from shmprod.errors import ConfigError
from shmprod.partitioner import murmur2
from shmprod.shm import NAME_PREFIX
from tests.support.readback import Landed, consume_all

pytestmark = pytest.mark.broker

BASE_MS = 1_700_000_000_000


def table(n: int, start: int = 0) -> pa.Table:
    ids = list(range(start, start + n))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "user": pa.array([f"u{i % 97}" for i in ids]),
            "payload": pa.array([(b"p%d-" % i).ljust(100, b"x") for i in ids]),
            "ts": pa.array([BASE_MS + i for i in ids], pa.timestamp("ms")),
        }
    )


def records(bootstrap: str, topic: str, partitions: int, n: int) -> list[Landed]:
    landed = consume_all(bootstrap, topic, partitions, n, 90, extra_wait_s=0.5)
    return [r for recs in landed.values() for r in recs]


def check_rows(got: list[Landed], n: int, partitions: int, start: int = 0) -> None:
    """Exactly rows start..start+n-1 of :func:`table`, keyed by user, stamped by ts."""
    assert len(got) == n
    seen = set()
    for r in got:
        assert r.value is not None
        i = int(r.value.split(b"-")[0][1:])
        seen.add(i)
        assert r.key == f"u{i % 97}".encode()
        assert r.timestamp_ms == BASE_MS + i
        assert r.partition == (murmur2(r.key) & 0x7FFFFFFF) % partitions
    assert seen == set(range(start, start + n))


def export_users(broker: EmbeddedBroker, topic: str, source: Any, **extra: Any) -> Any:
    """``source`` exported by two processes, keyed by ``user``, valued by ``payload``."""
    return shmprod.export(
        source,
        topic,
        bootstrap_servers=broker.bootstrap,
        key="user",
        value="payload",
        workers=2,
        progress=False,
        **extra,
    )


def test_a_table_with_key_timestamp_and_headers(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 4)
    n = 50_000
    report = export_users(
        broker, topic_name, table(n), timestamp="ts", headers={"source": "test", "none": None}
    )
    assert report.ok and report.records == n and report.total_rows == n
    assert report.bytes == sum(100 + len(f"u{i % 97}") for i in range(n))
    got = records(broker.bootstrap, topic_name, 4, n)
    check_rows(got, n, 4)
    assert all(r.headers == (("source", b"test"), ("none", None)) for r in got)
    assert {p: len([r for r in got if r.partition == p]) for p in range(4)} == dict(
        report.per_partition
    )


def test_a_table_of_wide_rows_goes_in_batches_of_bounded_bytes(
    broker: EmbeddedBroker, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller cuts a table's batches at BATCH_BYTES (here 20,000: about 150 rows of
    these): every row still lands once, keyed and stamped."""
    from shmprod import exporter

    monkeypatch.setattr(exporter, "BATCH_BYTES", 20_000)
    broker.create_topic(topic_name, 3)
    n = 3_000
    with exporter.prepare(table(n), topic_name, key="user", value="payload") as plan:
        assert 15 <= sum(1 for _ in plan.jobs) <= 25
    report = export_users(broker, topic_name, table(n), timestamp="ts")
    assert report.ok and report.records == n
    check_rows(records(broker.bootstrap, topic_name, 3, n), n, 3)


def test_a_headers_column_gives_each_record_its_own(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """A list<struct<key, value>> column: each row's headers, none for a null or empty
    list, string values as UTF-8, null values as null."""
    broker.create_topic(topic_name, 3)
    n = 3_000
    hdr_type = pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))

    def row_headers(i: int) -> list[dict[str, str | None]] | None:
        if i % 5 == 0:
            return None
        return [{"key": "i", "value": str(i)}, {"key": "n", "value": None}][: i % 3]

    t = pa.table(
        {
            "payload": pa.array([b"p%d" % i for i in range(n)], pa.binary()),
            "user": pa.array([f"u{i % 7}" for i in range(n)]),
            "tags": pa.array([row_headers(i) for i in range(n)], hdr_type),
        }
    )
    report = export_users(broker, topic_name, t, headers="tags")
    assert report.ok and report.records == n
    got = records(broker.bootstrap, topic_name, 3, n)
    assert len(got) == n
    for r in got:
        i = int(r.value[1:])
        want = tuple(
            (h["key"], None if h["value"] is None else h["value"].encode())
            for h in row_headers(i) or ()
        )
        assert r.headers == want, i


def test_a_pandas_dataframe_as_json_rows(broker: EmbeddedBroker, topic_name: str) -> None:
    pd = pytest.importorskip("pandas")
    broker.create_topic(topic_name, 2)
    df = pd.DataFrame(
        {
            "id": [1, 2, 3],
            "name": ["a", None, "c"],
            "when": pd.to_datetime(
                ["2026-01-01T00:00:00", "2026-01-02T00:00:00", "2026-01-03T00:00:00"]
            ),
            "part": pd.array([1, None, 0], dtype="Int32"),
        }
    )
    report = shmprod.export(
        df,
        topic_name,
        bootstrap_servers=broker.bootstrap,
        value="json",
        partition="part",
        workers=1,
        progress=False,
    )
    assert report.records == 3
    got = sorted(records(broker.bootstrap, topic_name, 2, 3), key=lambda r: r.value or b"")
    rows = [json.loads(r.value or b"") for r in got]
    assert rows[0] == {"id": 1, "name": "a", "when": "2026-01-01T00:00:00", "part": 1}
    assert rows[1]["name"] is None and rows[1]["part"] is None
    assert got[0].partition == 1 and got[2].partition == 0


def test_csv_json_lines_ipc_a_reader_and_a_dataset(
    broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    broker.create_topic(topic_name, 3)
    t = table(3_000).drop_columns(["ts"])
    (tmp_path / "csv").mkdir()
    pcsv.write_csv(t.slice(0, 1_000), tmp_path / "csv" / "a.csv")
    with open(tmp_path / "rows.jsonl", "w") as f:
        for row in t.slice(1_000, 1_000).to_pylist():
            f.write(json.dumps({"user": row["user"], "payload": row["payload"].decode()}) + "\n")
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t.slice(2_000, 500))
    total = 0
    for source in (
        tmp_path / "csv",
        str(tmp_path / "rows.jsonl"),
        str(tmp_path / "t.arrow"),
        t.slice(2_500, 250).to_reader(),
        ds.dataset(t.slice(2_750, 250)),
    ):
        r = shmprod.export(
            source,
            topic_name,
            bootstrap_servers=broker.bootstrap,
            key="user",
            value="payload",
            workers=2,
            progress=False,
        )
        total += r.records
    assert total == 3_000
    got = records(broker.bootstrap, topic_name, 3, 3_000)
    assert sorted(r.value for r in got) == sorted(t.column("payload").to_pylist())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"value": "nope"}, "value column 'nope' is not in"),
        ({"value": "payload", "timestamp": "user"}, "timestamp column 'user' has type string"),
        ({"value": "payload", "partition": "user"}, "partition column 'user' has type string"),
        ({"value": "payload", "headers": "user"}, "headers column 'user' has type string"),
        ({"value": "payload", "workers": 0}, "workers must be an int >= 1"),
        ({"value": "payload", "headers": [("k",)]}, "headers: need"),
    ],
)
def test_bad_columns_are_refused_before_anything_is_sent(
    broker: EmbeddedBroker, tmp_path: Path, kwargs: dict[str, object], match: str
) -> None:
    pq.write_table(table(10), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=match):
        shmprod.export(tmp_path, "never", bootstrap_servers="127.0.0.1:1", **kwargs)  # type: ignore[arg-type]


def test_bad_sources_are_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        (tmp_path / "broken.parquet", "cannot read .*broken.parquet"),
        (tmp_path / "notes.txt", "unknown file type"),
        (tmp_path / "missing.parquet", "no such file"),
        (str(tmp_path / "*.csv"), "no files in"),
        (42, "cannot export a int"),
    ]
    for source, match in cases:
        with pytest.raises(ConfigError, match=match):
            shmprod.export(source, "t", bootstrap_servers="127.0.0.1:1")


def test_files_decode_on_one_thread_per_process_when_several_export(tmp_path: Path) -> None:
    """Several pool processes are the parallelism: each reads single-threaded (pyarrow's
    pool would add a thread per core in every process); one process keeps the pool."""
    from shmprod.exporter import prepare

    pq.write_table(table(10), tmp_path / "a.parquet")
    pcsv.write_csv(table(10).select(["user"]), tmp_path / "b.csv")
    for source, value in ((tmp_path / "a.parquet", "payload"), (tmp_path / "b.csv", "user")):
        assert [j.threads for j in prepare(source, "t", value=value, workers=1).jobs] == [True]
        assert [j.threads for j in prepare(source, "t", value=value, workers=3).jobs] == [False]


def test_a_failed_record_fails_the_export_with_its_report(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    broker.create_topic(topic_name, 2)
    t = table(100).append_column("p", pa.array([i % 3 for i in range(100)], pa.int32()))
    with pytest.raises(shmprod.ExportError, match="UnknownPartitionError") as info:
        shmprod.export(
            t, topic_name, bootstrap_servers=broker.bootstrap, value="payload", partition="p"
        )
    assert info.value.report.records == 0 and not info.value.report.ok


def _cli(args: list[str], *, tty: bool = False) -> tuple[int, str, str]:
    """Runs ``python -m shmprod`` (stderr on a pseudo-terminal when ``tty``)."""
    cmd = [sys.executable, "-m", "shmprod", *args]
    if not tty:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout, out.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        err += chunk
    assert proc.stdout is not None
    with proc.stdout:
        stdout = proc.stdout.read().decode()
    os.close(master)
    return proc.wait(300), stdout, err.decode(errors="replace")


def test_the_command_exports_a_million_parquet_rows_with_a_bar_on_a_terminal(
    broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    n, files = 1_000_000, 4
    broker.create_topic(topic_name, 6)
    for i in range(files):
        part = n // files
        pq.write_table(table(part, i * part), tmp_path / f"part-{i}.parquet", row_group_size=50_000)
    rc, out, err = _cli(
        [
            "export",
            str(tmp_path),
            "--topic",
            topic_name,
            "--bootstrap-servers",
            broker.bootstrap,
            "--key",
            "user",
            "--value",
            "payload",
            "--timestamp",
            "ts",
            "--workers",
            "2",
            "-X",
            "linger.ms=10",
        ],
        tty=True,
    )
    assert rc == 0, err
    assert "exported 1,000,000 records" in out
    assert "\r[" in err and "100%" in err and "rows/s" in err  # the bar, redrawn in place
    check_rows(records(broker.bootstrap, topic_name, 6, n), n, 6)


def test_the_command_piped_has_no_bar_and_exit_codes_say_what_happened(
    broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    broker.create_topic(topic_name, 2)
    pq.write_table(table(2_000), tmp_path / "a.parquet")
    base = ["export", str(tmp_path), "--topic", topic_name, "--bootstrap-servers", broker.bootstrap]
    rc, out, err = _cli([*base, "--key", "user", "--value", "payload"])
    assert rc == 0 and "exported 2,000 records" in out and "\r" not in err
    rc, _, err = _cli([*base, "--value", "nope"])
    assert rc == 2 and "value column 'nope' is not in" in err
    rc, _, err = _cli([*base, "--value", "payload", "-X", "lingr.ms=5"])
    assert rc == 2 and "did you mean 'linger.ms'" in err
    rc, out, err = _cli([*base, "--value", "payload", "--partition", "id"])  # ids past 1
    assert rc == 1 and "not acknowledged" in err and "UnknownPartitionError" in err, (out, err)
    rc, out, _ = _cli(["export", "--help"])
    assert rc == 0 and "examples:" in out
    assert len(records(broker.bootstrap, topic_name, 2, 2_000)) == 2_000  # nothing else sent


def test_the_command_starts_an_embedded_broker_without_bootstrap_servers(tmp_path: Path) -> None:
    pq.write_table(table(500), tmp_path / "a.parquet")
    rc, out, err = _cli(
        ["export", str(tmp_path / "a.parquet"), "--topic", "t", "--value", "payload"]
    )
    assert rc == 0, err
    assert "embedded broker: bootstrap_servers=127.0.0.1:" in err
    assert "exported 500 records" in out and "kcat -C -b 127.0.0.1:" in out


def test_timestamps_of_dates_and_integers(broker: EmbeddedBroker, topic_name: str) -> None:
    broker.create_topic(topic_name, 1)
    t = pa.table(
        {
            "value": ["a", "b"],
            "d": pa.array([datetime.date(2026, 1, 2), None], pa.date32()),
        }
    )
    shmprod.export(t, topic_name, bootstrap_servers=broker.bootstrap, timestamp="d", workers=1)
    got = sorted(records(broker.bootstrap, topic_name, 1, 2), key=lambda r: r.value or b"")
    assert got[0].timestamp_ms == int(
        datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC).timestamp() * 1000
    )
    assert got[1].timestamp_ms > got[0].timestamp_ms  # null: now


def test_tombstones_a_null_value_column(broker: EmbeddedBroker, topic_name: str) -> None:
    """A value column of nulls (Arrow's null type) sends tombstones with their keys."""
    broker.create_topic(topic_name, 1)
    t = pa.table({"key": ["a", "b"], "value": pa.nulls(2)})
    r = shmprod.export(t, topic_name, bootstrap_servers=broker.bootstrap, key="key", workers=1)
    assert r.records == 2 and r.bytes == 2
    got = sorted(records(broker.bootstrap, topic_name, 1, 2), key=lambda x: x.key or b"")
    assert [(x.key, x.value) for x in got] == [(b"a", None), (b"b", None)]


def _pool_processes() -> list[psutil.Process]:
    """This process's spawned pool children (not multiprocessing's resource tracker)."""
    out = []
    for c in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(c.cmdline())
            if "--multiprocessing-fork" in cmd and "resource_tracker" not in cmd:
                out.append(c)
    return out


@pytest.mark.timeout(120)
def test_a_pool_process_that_dies_stops_the_export_with_an_error(
    broker: EmbeddedBroker, topic_name: str, tmp_path: Path
) -> None:
    """A pool process killed mid-export (out of memory, say) fails the export at once:
    the dead process's job is never waited for."""
    broker.create_topic(topic_name, 4)
    n = 2_000_000
    path = tmp_path / "big.parquet"
    pq.write_table(
        pa.table({"payload": pa.array([b"v" * 100] * 1000, pa.binary())}).take(
            pa.array([i % 1000 for i in range(n)])
        ),
        path,
        row_group_size=50_000,
    )
    killed: list[int] = []

    def kill_one() -> None:
        """Kills a pool process 0.2 s after it attached: in the middle of its jobs."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for p in _pool_processes():
                with contextlib.suppress(psutil.Error):
                    if any(NAME_PREFIX in m.path for m in p.memory_maps()):
                        time.sleep(0.2)
                        p.kill()
                        killed.append(p.pid)
                        return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    with pytest.raises(shmprod.ExportError, match="a pool process died") as info:
        shmprod.export(
            str(path), topic_name, bootstrap_servers=broker.bootstrap, value="payload", workers=2
        )
    killer.join(5)
    assert killed, "the export ended before a pool process could be killed"
    report = info.value.report
    assert not report.ok and report.records < n
    assert any("may have been sent in part" in e for e in report.errors)
    assert not _pool_processes()


@pytest.mark.timeout(120)
def test_a_producer_that_cannot_start_ends_the_pool(
    broker: EmbeddedBroker, topic_name: str
) -> None:
    """The pool's processes start before the producer; when the producer refuses its
    configuration, they end too (nobody waits for a handle that never comes)."""
    broker.create_topic(topic_name, 2)
    with pytest.raises(ConfigError, match="linger_ms"):
        shmprod.export(
            table(10),
            topic_name,
            bootstrap_servers=broker.bootstrap,
            value="payload",
            workers=2,
            linger_ms=-1,
        )
    assert not _pool_processes()
