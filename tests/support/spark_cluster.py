"""Test helper (not a test module): a real Spark standalone cluster on loopback.

``standalone_cluster`` starts one master and N workers with pyspark's own
``bin/spark-class`` from the pip package (the wheel has no ``sbin/start-*.sh``), each
as its own process group, everything bound to 127.0.0.1 with ports picked by the OS
(``--port 0``, ``--webui-port 0``), logs and work dirs under the caller's ``work_dir``.
On exit every process group is terminated, then killed, and waited, together with any
process the JVMs started (executor JVMs, pyspark daemons and their Python workers).

Environment: a worker's executor JVM inherits the worker JVM's environment (the
standalone ``ExecutorRunner`` starts it with a ``ProcessBuilder`` that keeps the
parent's environment and only adds ``spark.executorEnv.*``), and pyspark's Python
workers inherit the executor's. So a variable given to one worker is what
``os.environ`` shows in the Python code of tasks that run on that worker, unless the
application overrides it with ``spark.executorEnv.<NAME>``.

``session`` builds a small SparkSession for such a cluster; stop it with
``shmprod.spark.stop_session`` (``SparkSession.stop`` alone leaves the driver JVM up).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from tests.support.readback import Landed, consume_all

LOOPBACK = "127.0.0.1"
_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_MASTER_URL = re.compile(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
_REGISTERED = re.compile(r"Successfully registered with master")
_POLL_S = 0.2
_STOP_GRACE_S = 15.0
# Written to a properties file given to the master and the workers: no REST
# submission server, and no pointless cleanup thread.
_DAEMON_PROPERTIES = {
    "spark.master.rest.enabled": "false",
    "spark.worker.cleanup.enabled": "false",
}


class ClusterError(RuntimeError):
    """The cluster did not come up (the message has the relevant log tail)."""


def spark_home() -> str:
    """The pip-installed pyspark directory, which is a usable SPARK_HOME."""
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


class _Daemon:
    """One spark-class JVM (master or worker) in its own process group."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._out: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in close()
        try:
            self.proc = subprocess.Popen(
                [os.path.join(spark_home(), "bin", "spark-class"), *args],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                cwd=log.parent,
                start_new_session=True,
            )
        except BaseException:
            self._out.close()
            raise

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise ClusterError(
                f"spark {self.name} exited with {code}; {self.log}:\n{_tail(self.log)}"
            )

    def wait_for(self, pattern: re.Pattern[str], what: str, deadline: float) -> re.Match[str]:
        """Polls the log until ``pattern`` (described by ``what``) appears; bounded by
        ``deadline``."""
        max_polls = int((deadline - time.monotonic()) / _POLL_S) + 2
        for _ in range(max(max_polls, 1)):
            match = pattern.search(self.log.read_text(errors="replace"))
            if match is not None:
                return match
            self.check_alive()
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        raise ClusterError(
            f"spark {self.name}: {what} did not happen in time; {self.log}:\n{_tail(self.log)}"
        )

    def descendants(self) -> list[psutil.Process]:
        try:
            children: list[psutil.Process] = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return children

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        self._out.close()


def _stop(daemons: Sequence[_Daemon], timeout_s: float) -> None:
    """TERM every group (workers first, so they stop their executors), wait, KILL what
    is left (groups and every descendant seen before the TERM), and wait again."""
    if not daemons:
        return
    seen: list[psutil.Process] = []
    for d in daemons:
        seen.extend(d.descendants())
    for d in reversed(daemons):
        d.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + min(timeout_s, _STOP_GRACE_S)
    for d in reversed(daemons):
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(max(deadline - time.monotonic(), 0.01))
    for d in daemons:
        d.signal_group(signal.SIGKILL)
        if d.proc.poll() is None:
            d.proc.kill()
    for d in daemons:
        d.proc.wait(timeout_s)
        d.close()
    _, alive = psutil.wait_procs(seen, timeout=min(timeout_s, _STOP_GRACE_S))
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(alive, timeout=timeout_s)
    if alive:
        raise ClusterError(f"spark processes survived SIGKILL: {[p.pid for p in alive]}")


@contextlib.contextmanager
def standalone_cluster(
    workers: Sequence[Mapping[str, str]],
    *,
    cores: int = 1,
    memory: str = "1g",
    work_dir: Path,
    timeout_s: float = 120.0,
) -> Iterator[str]:
    """Starts a master and one worker per item of `workers` (each item: extra environment
    variables for that worker, which its executors and their Python workers inherit);
    yields the master URL spark://127.0.0.1:PORT once every worker has registered; stops
    everything (process groups killed, waited) on exit.

    Layout under ``work_dir``: ``conf/`` (an empty SPARK_CONF_DIR and the daemons'
    properties file), ``master/master.log``, ``worker-<i>/worker.log`` and
    ``worker-<i>/work/<app-id>/<executor-id>/{stdout,stderr}`` (the executors' logs).
    """
    if not workers:
        raise ValueError("standalone_cluster needs at least one worker")
    deadline = time.monotonic() + timeout_s
    work_dir = Path(work_dir).resolve()
    conf_dir = work_dir / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    props = conf_dir / "daemons.properties"
    props.write_text("".join(f"{k}={v}\n" for k, v in _DAEMON_PROPERTIES.items()))
    base_env = {
        **os.environ,
        "SPARK_HOME": spark_home(),
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOCAL_IP": LOOPBACK,
        "SPARK_LOCAL_HOSTNAME": LOOPBACK,
        "SPARK_LOG_DIR": str(work_dir / "logs"),
        "SPARK_PID_DIR": str(work_dir / "pids"),
        "SPARK_DAEMON_MEMORY": "256m",
        "PYSPARK_PYTHON": sys.executable,
    }
    common = ["--host", LOOPBACK, "--port", "0", "--webui-port", "0"]
    common += ["--properties-file", str(props)]

    daemons: list[_Daemon] = []
    try:
        master_dir = work_dir / "master"
        master_dir.mkdir(parents=True, exist_ok=True)
        master = _Daemon("master", [_MASTER_CLASS, *common], base_env, master_dir / "master.log")
        daemons.append(master)
        url = master.wait_for(_MASTER_URL, "start-up", deadline).group(1)

        for i, extra in enumerate(workers):
            wdir = work_dir / f"worker-{i}"
            (wdir / "work").mkdir(parents=True, exist_ok=True)
            env = {**base_env, "SPARK_WORKER_DIR": str(wdir / "work"), **extra}
            args = [_WORKER_CLASS, *common, "--cores", str(cores), "--memory", memory]
            args += ["--work-dir", str(wdir / "work"), url]
            daemons.append(_Daemon(f"worker-{i}", args, env, wdir / "worker.log"))
        for d in daemons[1:]:
            d.wait_for(_REGISTERED, "registration with the master", deadline)
        master.check_alive()
        yield url
    finally:
        _stop(daemons, timeout_s)


def session(master: str, app: str, **conf: str) -> Any:
    """A SparkSession on ``master`` sized for the test cluster (1 core and 512m per
    executor, 2 cores in all, no UI nor progress bar, the driver on loopback, this
    interpreter for the Python workers); ``conf`` adds or overrides settings
    (``**{"spark.x": "v"}``). Stop it with ``shmprod.spark.stop_session`` so that the
    driver JVM goes too."""
    from pyspark.sql import SparkSession

    # pyspark starts Python workers with PYSPARK_PYTHON as it is when the context
    # starts (the option spark.pyspark.python counts only under spark-submit)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    settings = {
        "spark.executor.cores": "1",
        "spark.executor.memory": "512m",
        "spark.cores.max": "2",
        "spark.driver.host": LOOPBACK,
        "spark.driver.bindAddress": LOOPBACK,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        **conf,
    }
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if spark.sparkContext.master != master:
        raise RuntimeError(
            f"a SparkSession on {spark.sparkContext.master} is already active (wanted {master})"
        )
    return spark


def wait_for_executors(spark: Any, count: int, timeout_s: float = 60.0) -> None:
    """Waits until ``count`` executors have registered with ``spark``'s driver, so that
    a job's tasks spread over all of them; bounded by ``timeout_s``."""
    sc = spark.sparkContext
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / _POLL_S) + 2):
        # The driver's own block manager is in this map too.
        if sc._jsc.sc().getExecutorMemoryStatus().size() - 1 >= count:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    raise TimeoutError(f"fewer than {count} executors registered within {timeout_s}s")


def children() -> set[int]:
    """This process's descendants now (to tell later which ones a session started)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def stop_and_reap(spark: Any, before: set[int], timeout_s: float = 30.0) -> list[psutil.Process]:
    """Stops ``spark`` and its JVM, then waits for (and kills) every descendant started
    since ``before``; returns those that had to be killed."""
    from shmprod.spark import stop_session

    stop_session(spark, timeout_s=timeout_s)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=20)
    for p in alive:
        p.kill()
    return list(alive)


@contextlib.contextmanager
def private_runtime(base: Path) -> Iterator[Path]:
    """XDG_RUNTIME_DIR for this process and the JVMs (and Python workers) it starts:
    host producers' files go to ``base/shmprod``."""
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(base)
    try:
        yield base / "shmprod"
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old


def host_daemons(runtime: Path) -> list[int]:
    """The pids of the host producers whose files are in ``runtime``."""
    pids = []
    for f in runtime.glob("*.pid") if runtime.exists() else ():
        try:
            pid = int(f.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid and psutil.pid_exists(pid):
            pids.append(pid)
    return pids


def wait_gone(runtime: Path, timeout_s: float) -> bool:
    """Whether every host producer of ``runtime`` closed within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not host_daemons(runtime) and not list(runtime.glob("*.handle")):
            return True
        time.sleep(0.1)
    return False


# -- the rows the cluster tests write, and what they check ---------------------------------

IDLE_MS = 1500


def rows(spark: Any, n: int, parts: int) -> Any:
    return spark.range(0, n, numPartitions=parts).selectExpr(
        "concat('value-', id) AS value", "cast(id % 101 as string) AS key"
    )


def check_all(bootstrap: str, topic: str, partitions: int, n: int) -> list[Landed]:
    """Every row landed at least once; returns every record read."""
    landed = consume_all(bootstrap, topic, partitions, n, 120, extra_wait_s=1)
    records = [r for recs in landed.values() for r in recs]
    assert {r.value for r in records} == {b"value-%d" % i for i in range(n)}
    return records


def times_landed(records: list[Landed]) -> Counter[bytes | None]:
    return Counter(r.value for r in records)
