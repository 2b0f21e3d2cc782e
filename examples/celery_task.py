"""A Celery app whose prefork children share one producer (shmprod.celery.setup).

    SHMPROD_BOOTSTRAP=broker:9092 celery -A examples.celery_task worker --pool prefork
    python examples/celery_task.py      # a worker, ten tasks and a broker, all local

Run as a script it starts an embedded Kafka broker and a real prefork worker on a
server-less Celery transport (files in a temporary directory), sends ten tasks, and
stops everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from celery import Celery

import shmprod.celery

app = Celery("example")
if os.environ.get("SHMPROD_BOOTSTRAP"):  # the worker's producer; clients need none
    shmprod.celery.setup(app, bootstrap_servers=os.environ["SHMPROD_BOOTSTRAP"])


def use_files(directory: str) -> None:
    """Queues and results as files (kombu filesystem://): no message server needed."""
    for sub in ("q", "r", "c"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    app.conf.update(
        broker_url="filesystem://",
        broker_transport_options={
            "data_folder_in": os.path.join(directory, "q"),
            "data_folder_out": os.path.join(directory, "q"),
            "control_folder": os.path.join(directory, "c"),
            "polling_interval": 0.1,
        },
        result_backend=f"file://{os.path.join(directory, 'r')}",
    )


if os.environ.get("EXAMPLE_CELERY_DIR"):
    use_files(os.environ["EXAMPLE_CELERY_DIR"])


@app.task(name="example.greet")
def greet(name: str) -> int:
    """Runs in a prefork child: sends one record, returns its offset once acknowledged."""
    w = shmprod.celery.producer()
    return w.send("greetings", f"hello {name}".encode()).result(60).offset


def main() -> None:
    from shmprod.broker import EmbeddedBroker

    root = Path(__file__).resolve().parent.parent
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as d:
        broker.create_topic("greetings", 1)
        use_files(d)
        env = {
            **os.environ,
            "SHMPROD_BOOTSTRAP": broker.bootstrap,
            "EXAMPLE_CELERY_DIR": d,
            "PYTHONPATH": str(root),
        }
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "examples.celery_task",
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                "2",
                "--loglevel",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=root,
            env=env,
        )
        try:
            offsets = [greet.delay(f"n{i}").get(timeout=60, interval=0.05) for i in range(10)]
        finally:
            worker.terminate()
            worker.wait(60)
        print(f"10 tasks, offsets {sorted(offsets)}")


if __name__ == "__main__":
    main()
