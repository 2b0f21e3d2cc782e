"""The driver's side of Spark: a local session for scripts and tests, stopping it with
its JVM, the check that Spark's Python workers can import shmprod, and the shmprod
error a failed task raised, rebuilt from Spark's error text. Runs in: the driver."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, Final

from shmprod.errors import ConfigError, KafkaError, ShmprodError
from shmprod.extras import require

__all__ = [
    "check_worker_python",
    "local_session",
    "stop_session",
    "task_error",
    "typed_task_errors",
    "worker_python",
]

# "shmprod.errors.DeliveryTimeoutError: message" as a Python traceback ends
_TYPED_LINE: Final = re.compile(r"^(shmprod(?:\.\w+)+)\.(\w+): (.*)$", re.MULTILINE)
_KAFKA_TEXT: Final = re.compile(r"^\[(-?\d+)\] \w+(?:: (.*))?$", re.DOTALL)


@contextlib.contextmanager
def typed_task_errors() -> Iterator[None]:
    """Re-raises a failed Spark action's error as the shmprod error its task raised
    (Spark's error as its cause); other errors pass as they are. Runs in: the driver."""
    try:
        yield
    except ShmprodError:
        raise
    except Exception as exc:
        typed = task_error(exc)
        if typed is None:
            raise
        raise typed from exc


def task_error(exc: BaseException) -> ShmprodError | None:
    """The shmprod error a Spark task raised, rebuilt from the text of the error Spark
    raised on the driver (the task's Python traceback); None when it holds none."""
    found = _TYPED_LINE.findall(str(exc))
    if not found:
        return None
    module, name, message = found[-1]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, ShmprodError)):
        return None
    message = message.strip()
    if issubclass(cls, KafkaError):
        m = _KAFKA_TEXT.match(message)
        return KafkaError(int(m.group(1)), m.group(2) or "") if m else None
    try:
        return cls(message)
    except TypeError:
        return None


_PYTHON_OK: dict[str, str] = {}  # interpreter -> "" if it imports shmprod, else why not


def worker_python(spark: Any) -> tuple[str, str]:
    """(the Python Spark starts for its Python workers, where that comes from): the
    SparkContext's ``pythonExec``, which pyspark takes from ``PYSPARK_PYTHON`` as it was
    when the context started (spark-submit sets it from ``spark.pyspark.python``; a
    script that only sets that option on its session builder gets ``python3``), else
    ``python3`` on the PATH. Runs in: the driver."""
    python = getattr(spark.sparkContext, "pythonExec", None) or os.environ.get("PYSPARK_PYTHON")
    if python and python != "python3":
        return python, "PYSPARK_PYTHON when the SparkContext started"
    return "python3", (
        "pyspark's default: PYSPARK_PYTHON was not set when the SparkContext started "
        "(the option spark.pyspark.python counts only under spark-submit)"
    )


def check_worker_python(spark: Any) -> None:
    """Refuses, before any task runs, a job whose Python workers could not import
    shmprod (pyspark would fail each task with a Java stack trace ending in
    ModuleNotFoundError). Checked where the executors run on this host (local masters);
    elsewhere that is the cluster's business. Runs in: the driver."""
    import subprocess

    master = str(spark.sparkContext.master)
    if not master.startswith("local"):
        return
    python, source = worker_python(spark)
    why = _PYTHON_OK.get(python)
    if why is None:
        try:
            out = subprocess.run(
                [python, "-c", "import shmprod, pyarrow"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            why = "" if out.returncode == 0 else (out.stderr.strip().splitlines() or ["?"])[-1]
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{type(exc).__name__}: {exc}"
        _PYTHON_OK[python] = why
    if why:
        raise ConfigError(
            f"Spark's Python workers run {python!r} (from {source}), which cannot import "
            f"shmprod ({why}): set PYSPARK_PYTHON, before the SparkContext starts (with "
            f"spark-submit: or the option spark.pyspark.python), to an interpreter that "
            f"has shmprod installed, such as this one: {sys.executable}"
        )


def local_session(master: str = "local[2]", app_name: str = "shmprod-export", **conf: str) -> Any:
    """A small local SparkSession whose Python workers run this interpreter (so they
    import shmprod and pyarrow from the same environment; sets ``PYSPARK_PYTHON`` when
    it is not set, which pyspark reads for its workers): no UI, no progress bar, two
    shuffle partitions. ``conf`` adds Spark options (dots as in Spark:
    ``**{"spark.driver.memory": "1g"}``). Runs in: the driver."""
    import sys

    SparkSession = require("pyspark.sql", "spark").SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "512m",
        "spark.sql.session.timeZone": "UTC",
        "spark.pyspark.python": os.environ["PYSPARK_PYTHON"],
        **conf,
    }
    builder = SparkSession.builder.master(master).appName(app_name)
    for k, v in settings.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def stop_session(spark: Any, timeout_s: float = 30.0) -> None:
    """Stops ``spark`` and the JVM pyspark started for it (``SparkSession.stop`` leaves
    that JVM running until the Python process exits): the JVM exits when its standard
    input closes, and is killed if it has not after ``timeout_s``. Runs in: the driver."""
    import subprocess

    SparkContext = require("pyspark", "spark").SparkContext

    gateway = SparkContext._gateway
    spark.stop()
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if isinstance(proc, subprocess.Popen):
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
