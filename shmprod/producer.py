"""The owner's side: ``Producer`` creates the shared producer (``shmprod.attach`` joins
it).

Runs in: the owner. The owner spawns the sender as a fresh interpreter, creates the
segment and the control socket while it starts (its start-up spec, secrets included,
goes over its stdin, never its command line), and attaches to its own producer like any
worker. ``close()`` flushes, stops the sender and removes everything it created; if the
owner dies instead, the sender does that. Importing this module loads neither numpy nor
the worker's modules: ``Producer()`` loads them once its sender is started, so the two
load at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import shmprod
from shmprod import shm
from shmprod.config import ProducerConfig
from shmprod.errors import ProducerClosedError, SenderDiedError, ShmprodError
from shmprod.handle import Handle, SenderSpec
from shmprod.ipc import process_start_us
from shmprod.layout import Geometry, write_header
from shmprod.shm import Segment
from shmprod.sweep import socket_dir, sweep

if TYPE_CHECKING:
    from shmprod.futures import BatchFuture, RecordFuture
    from shmprod.worker import Worker

__all__ = ["Producer", "give_spec", "spawn_sender", "start_sender"]

SENDER_START_TIMEOUT_S = 30.0

log = logging.getLogger("shmprod.producer")

SHM_SHARE: Final = 0.8
"""The share of the free shared memory a pool may take when it must shrink to fit."""
MIN_POOL_BATCHES: Final = 4


def fit_pool(cfg: ProducerConfig, free: int | None) -> ProducerConfig:
    """``cfg``, or, where /dev/shm has less free room than its pool needs (containers
    often give 64 MiB), a copy whose ``buffer_memory`` fits in :data:`SHM_SHARE` of it,
    said at WARNING. A pool of fewer than :data:`MIN_POOL_BATCHES` batches is not
    worth starting: that stays the clear SharedMemoryError of creating the segment.
    Runs in: the owner, before the segment exists."""
    need = Geometry.for_pool(cfg.buffer_memory, cfg.batch_size).segment_size
    if free is None or need <= free:
        return cfg
    overhead = need - cfg.buffer_memory
    room = int(free * SHM_SHARE) - overhead
    if room < MIN_POOL_BATCHES * cfg.batch_size:
        return cfg
    fitted = dataclasses.replace(cfg, buffer_memory=room - room % cfg.batch_size)
    log.warning(
        "/dev/shm has %.1f MiB free, less than the %.1f MiB the pool needs: the pool is "
        "sized to %.1f MiB instead (buffer_memory). Give the container more shared memory "
        "(docker run --shm-size=...), or set buffer_memory to fit",
        free / 2**20,
        need / 2**20,
        fitted.buffer_memory / 2**20,
    )
    return fitted


# What the sender's interpreter and its TLS need from the owner's environment; nothing
# else passes (a KAFKA_PASSWORD of the owner's shell never reaches the sender).
_SENDER_ENV_NAMES = frozenset(
    {
        "PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "VIRTUAL_ENV",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "TZ",
        "TMPDIR",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "SYSTEMROOT",
    }
)
_SENDER_ENV_PREFIXES = ("LC_", "SHMPROD_")


def _sender_env() -> dict[str, str]:
    """The sender's environment: an allow-list of the owner's (what Python, locale and
    TLS need, and ``SHMPROD_*`` settings), with this shmprod importable even when not
    installed. Secrets in the owner's environment stay there."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in _SENDER_ENV_NAMES or k.startswith(_SENDER_ENV_PREFIXES)
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmprod.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def spawn_sender(
    spec: SenderSpec, *, env: Mapping[str, str] | None = None, start_new_session: bool = False
) -> subprocess.Popen[bytes]:
    """Starts ``python -m shmprod.sender`` and writes ``spec`` to its stdin. Runs in: owner.

    The spec (the handle's secret, broker credentials) goes through a pipe that is then
    closed, never on the command line: ``/proc/PID/cmdline`` is readable by every user.
    """
    proc = start_sender(spec.listen_fd, env=env, start_new_session=start_new_session)
    give_spec(proc, spec)
    return proc


def start_sender(
    listen_fd: int, *, env: Mapping[str, str] | None = None, start_new_session: bool = False
) -> subprocess.Popen[bytes]:
    """Starts ``python -m shmprod.sender`` with ``listen_fd`` (the control socket, bound
    or not yet) and its stdin a pipe: it imports its modules, then waits there for the
    spec (:func:`give_spec`). Runs in: owner."""
    return subprocess.Popen(
        [sys.executable, "-m", "shmprod.sender"],
        pass_fds=[listen_fd],
        stdin=subprocess.PIPE,
        env=None if env is None else dict(env),
        start_new_session=start_new_session,
    )


def give_spec(proc: subprocess.Popen[bytes], spec: SenderSpec) -> None:
    """Writes ``spec`` to a sender started by :func:`start_sender` and closes its stdin.
    Runs in: owner.

    The spec is a few KiB, far below a pipe's buffer, so the write never waits for the
    sender; a sender that died at once shows up as EPIPE here, or as EOF to ``attach``.
    """
    assert proc.stdin is not None
    try:
        proc.stdin.write(spec.to_json().encode("utf-8"))
    except BrokenPipeError:
        pass
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()


def _stop_sender(proc: subprocess.Popen[bytes]) -> None:
    """Kills a sender and reaps it. Runs in: owner."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _cleanup(segment: Segment, tmpdir: str, proc: subprocess.Popen[bytes]) -> None:
    """Last-resort cleanup (garbage collection or interpreter exit without close())."""
    _stop_sender(proc)
    with contextlib.suppress(BufferError):
        segment.close()
    segment.unlink()
    shutil.rmtree(tmpdir, ignore_errors=True)


class Producer:
    """The host's one Kafka producer. Options: see :class:`shmprod.config.ProducerConfig`.

    >>> with Producer(bootstrap_servers="127.0.0.1:9092") as p:   # doctest: +SKIP
    ...     p.send("events", b"value", key=b"k").result(timeout=30)
    """

    def __init__(
        self, bootstrap_servers: str | Sequence[str] | None = None, **options: Any
    ) -> None:
        if bootstrap_servers is not None:
            options["bootstrap_servers"] = (
                bootstrap_servers
                if isinstance(bootstrap_servers, str)
                else ",".join(bootstrap_servers)
            )
        self.config = ProducerConfig.from_keywords(**options)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: dict[int, Worker] = {}
        self._own: Worker | None = None  # the owner's Worker, for send()'s fast path
        self._start()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Producer cannot be pickled (it owns the sender process, sockets and locks): "
            "pass producer.handle to the other process and call shmprod.attach(handle) "
            "there; the Worker it returns has the same send/send_batch/flush"
        )

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> Producer:
        """A producer from kafka-python names or Java dotted names (``"linger.ms"``)."""
        config = ProducerConfig.from_mapping(options)
        fields = {k: getattr(config, k) for k in config.to_wire()}
        fields["key_serializer"] = config.key_serializer
        fields["value_serializer"] = config.value_serializer
        fields["partitioner"] = config.partitioner
        return cls(**fields)

    # -- start and stop ---------------------------------------------------------------

    def _start(self) -> None:
        """Creates the segment and socket, spawns the sender, attaches. Runs in: owner."""
        self.config = fit_pool(self.config, shm.free_bytes())
        cfg = self.config
        cfg.ssl_context()  # a bad certificate file fails here, in the caller, as ConfigError
        geo = Geometry.for_pool(cfg.buffer_memory, cfg.batch_size)
        try:  # producers of this user whose processes all died: their files go first
            removed = sweep()
        except OSError as exc:
            log.warning("could not look for stale producers: %s", exc)
        else:
            for stale in removed:
                log.warning(
                    "removed the files of a producer whose processes died (owner pid %d, "
                    "sender pid %d): %s, %.1f MiB",
                    stale.owner_pid,
                    stale.sender_pid,
                    stale.segment,
                    stale.size / 2**20,
                )
        # The sender starts first: its interpreter imports its modules (about 100 ms)
        # while this process reserves the pool (about 35 ms for 64 MiB: every page
        # allocated, zeroed and mapped), and waits on its stdin for the spec. Until the
        # spec is written it has only a pipe and an unbound socket: a failure here kills
        # it, and if this process dies it reads EOF and exits.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        proc: subprocess.Popen[bytes] | None = None
        segment: Segment | None = None
        tmpdir: str | None = None
        try:
            proc = start_sender(listener.fileno(), env=_sender_env(), start_new_session=True)
            segment = Segment.create(geo.segment_size)
            log.info(
                "producer in shared memory %s/%s (watch it: shmprod stats %s)",
                shm.SHM_DIR,
                segment.name,
                segment.name,
            )
            start_us = process_start_us()
            write_header(segment.view, geo, self._pid, start_us)
            tmpdir = socket_dir(segment.name)
            os.mkdir(tmpdir, 0o700)
            socket_path = os.path.join(tmpdir, "ctl.sock")
            listener.bind(socket_path)
            listener.listen(256)
            secret = os.urandom(16)
            spec = SenderSpec(
                segment=segment.name,
                socket_path=socket_path,
                secret_hex=secret.hex(),
                owner_pid=self._pid,
                owner_start_us=start_us,
                listen_fd=listener.fileno(),
                config=cfg.to_wire(),
            )
            give_spec(proc, spec)
        except BaseException:
            listener.close()
            if proc is not None:
                _stop_sender(proc)
            if segment is not None:
                segment.close()
                segment.unlink()
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        listener.close()  # the sender has its own copy
        self._segment, self._tmpdir, self._proc = segment, tmpdir, proc
        self._finalizer = weakref.finalize(self, _cleanup, self._segment, self._tmpdir, self._proc)
        self.handle = Handle(
            segment=self._segment.name,
            socket_path=socket_path,
            secret=secret,
            owner_pid=self._pid,
            config=cfg.for_workers(),
            key_serializer=cfg.key_serializer,
            value_serializer=cfg.value_serializer,
            partitioner=None if isinstance(cfg.partitioner, str) else cfg.partitioner,
            host=socket.gethostname(),
        )
        worker: Worker | None = None
        try:
            # The worker's modules (numpy among them, about 100 ms) load only now, while
            # the sender starts: importing this module does not load them.
            from shmprod.worker import attach

            worker = attach(self.handle, owner=True)
            worker.wait_ready(timeout=max(SENDER_START_TIMEOUT_S, cfg.max_block_ms / 1000))
        except BaseException as exc:
            if worker is not None:  # e.g. the sender refused by the broker (TLS, SASL)
                with contextlib.suppress(Exception):
                    worker.close(0)
            died = self._sender_died_at_start(exc)
            self._finalizer()
            if died is not None:
                raise died from exc
            raise
        self._workers[self._pid] = worker
        self._own = worker

    def _sender_died_at_start(self, exc: BaseException) -> SenderDiedError | None:
        """The error to raise when ``exc`` (nobody listening on the control socket) came
        from a sender that exited before it served it, e.g. its interpreter failed to
        import shmprod: it names the sender's exit status, where ``exc`` would blame the
        handle. Runs in: owner, while ``Producer()`` fails."""
        if not isinstance(exc, ProducerClosedError):
            return None
        try:
            status = self._proc.wait(1.0)  # its socket was closed: it is exiting
        except subprocess.TimeoutExpired:
            return None
        return SenderDiedError(
            f"the sender process (pid {self._proc.pid}) exited with status {status} as it "
            "started, before it served the producer; its error is on this process's stderr"
        )

    def _worker(self) -> Worker:
        """This process's worker: the owner's own, or one attached after a fork."""
        if self._closed:
            raise ProducerClosedError("the producer is closed")
        pid = os.getpid()
        worker = self._workers.get(pid)
        if worker is None:
            with self._lock:
                worker = self._workers.get(pid)
                if worker is None:
                    from shmprod.worker import attach

                    worker = attach(self.handle)
                    self._workers[pid] = worker
        return worker

    def close(self, timeout: float | None = None) -> None:
        """Flushes, stops the sender and removes every segment and file. Runs in: owner.

        Called from an attached (forked) process it only detaches that process.
        """
        if self._closed:
            return
        pid = os.getpid()
        if pid != self._pid:
            worker = self._workers.pop(pid, None)
            if worker is not None:
                worker.close(timeout)
            return
        self._closed = True
        self._own = None
        deadline = None if timeout is None else time.monotonic() + timeout
        worker = self._workers.pop(pid)
        try:
            worker.flush(timeout)
        except ShmprodError:
            pass
        finally:
            remaining = 30.0 if deadline is None else max(0.0, deadline - time.monotonic())
            worker.shutdown_producer(int(remaining * 1000))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(remaining + 5)
            worker.close(0)
            self._finalizer()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sending ----------------------------------------------------------------------

    def send(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        headers: Any = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> RecordFuture:
        """Appends one record; the future resolves to its :class:`RecordMetadata`."""
        w = self._own
        if w is None or w._state:  # closing or closed, or a forked child (its copy is FORKED)
            w = self._worker()
        return w.send(topic, value, key, headers, partition, timestamp_ms)

    def send_batch(
        self,
        topic: str,
        values: Any,
        keys: Any = None,
        *,
        partitions: Any = None,
        timestamps_ms: Any = None,
        headers: Any = None,
    ) -> BatchFuture:
        """Appends whole columns at once (vectorized); resolves to :class:`BatchMetadata`."""
        return self._worker().send_batch(
            topic,
            values,
            keys=keys,
            partitions=partitions,
            timestamps_ms=timestamps_ms,
            headers=headers,
        )

    def flush(self, timeout: float | None = None) -> None:
        """Waits until everything this process sent is acknowledged or failed."""
        self._worker().flush(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters of this process, the sender, the pool and every partition queue."""
        return self._worker().stats()

    @property
    def sender_pid(self) -> int:
        return self._proc.pid
