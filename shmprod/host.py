"""The host's shared producer for one configuration, found or started by whoever asks.

``shmprod.host_producer(bootstrap_servers=..., **config)`` returns a :class:`Worker`
attached to THE producer of this host, this user and this configuration:

* The first caller starts it: a small daemon process (``shmprod.host.main`` in a
  fresh interpreter in its own session) that owns an ordinary :class:`Producer` -- the
  same producer core and sender -- and writes its handle to a private file. Later
  callers attach to it.
* It closes itself ``idle_timeout_ms`` (default 60000) after the last other process
  detached. A crashed one (its daemon killed) is replaced by the next caller.
* Two racing callers never start two: everything happens under an ``fcntl`` lock on a
  file of the configuration, which the kernel releases when its holder dies.
* Keyed by the user id and a SHA-256 of the whole configuration (passwords included,
  serializers and partitioner by their importable names): only a process of the same
  user and configuration ever attaches. The files -- ``<key>.lock``, ``<key>.handle``
  (the handle: it carries the secret that lets a process attach, never a password),
  ``<key>.pid`` (the daemon's) and ``<key>.log`` (its log) -- live in a 0700 directory
  of the user (:func:`runtime_dir`), each 0600.

Runs in: any process that asks (:func:`host_producer`); the daemon (:func:`main`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from shmprod import shm
from shmprod.config import OPENBLAS_THREADS_VAR, ProducerConfig
from shmprod.errors import ConfigError, ProducerError, ShmprodError
from shmprod.handle import Handle
from shmprod.producer import _sender_env, fit_pool

if TYPE_CHECKING:
    from shmprod.worker import Worker

__all__ = ["find", "host_id", "host_producer", "runtime_dir"]

log = logging.getLogger("shmprod.host")

START_TIMEOUT_S: Final = 60.0
HOST_ID_ENV: Final = "SHMPROD_TEST_HOST_ID"
"""Tests only: makes the processes that carry it a host of that name (a key of its own),
so one machine can play several hosts of a cluster. Never set it in production."""
IDLE_CHECK_S: Final = 0.2


def runtime_dir() -> str:
    """This user's private directory for host producers (created 0700): under
    ``$XDG_RUNTIME_DIR`` when set, else ``shmprod-<uid>`` in the temp directory.
    Refuses one that is not a directory of this user with no access for others."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        os.path.join(base, "shmprod")
        if base
        else os.path.join(tempfile.gettempdir(), f"shmprod-{os.getuid()}")
    )
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ProducerError(
            f"{path} must be a directory of this user that nobody else may use (mode 0700)"
        )
    return path


def host_id() -> str:
    """The name of this host for host producers: its host name, or the tests' override."""
    return os.environ.get(HOST_ID_ENV) or socket.gethostname()


def _qualified(obj: Any) -> str:
    if obj is None or isinstance(obj, str):
        return str(obj)
    module = getattr(obj, "__module__", "?")
    name = getattr(obj, "__qualname__", type(obj).__qualname__)
    return f"{module}.{name}"


def config_key(cfg: ProducerConfig) -> str:
    """The name of a configuration's host producer: a hash of the user id and every
    option (passwords included; they are never written anywhere in clear)."""
    wire = cfg.to_wire()
    wire["key_serializer"] = _qualified(cfg.key_serializer)
    wire["value_serializer"] = _qualified(cfg.value_serializer)
    wire["partitioner"] = _qualified(cfg.partitioner)
    blob = json.dumps([os.getuid(), host_id(), wire], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: released when the holder dies, too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_handle(path: str) -> Handle | None:
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None
    return obj if isinstance(obj, Handle) else None


def host_producer(
    bootstrap_servers: str | None = None, *, idle_timeout_ms: int = 60_000, **options: Any
) -> Worker:
    """This process's attachment to the host's producer for this configuration,
    starting it if none runs (see the module docstring). Same options as
    :class:`~shmprod.Producer`; ``close()`` the Worker when done (the producer stays
    for the others, and closes ``idle_timeout_ms`` after the last one detached)."""
    if bootstrap_servers is not None:
        options["bootstrap_servers"] = bootstrap_servers
    if isinstance(idle_timeout_ms, bool) or not isinstance(idle_timeout_ms, int):
        raise ConfigError(f"idle_timeout_ms must be an int, got {idle_timeout_ms!r}")
    if idle_timeout_ms < 0:
        raise ConfigError(f"idle_timeout_ms must be >= 0, got {idle_timeout_ms}")
    from shmprod.worker import attach

    cfg = ProducerConfig.from_keywords(**options)
    cfg.ssl_context()  # a bad certificate file fails here, in the caller
    directory = runtime_dir()
    key = config_key(cfg)
    base = os.path.join(directory, key)
    with _locked(base + ".lock"):
        handle = _read_handle(base + ".handle")
        if handle is not None:
            try:
                return attach(handle)
            except ShmprodError as exc:  # its daemon died, or it closed: start anew
                log.info("host producer %s is gone (%s): starting a new one", key, exc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base + ".handle")
        fit_pool(cfg, shm.free_bytes())  # a pool that must shrink is said here too
        _start_daemon(cfg, options, base, idle_timeout_ms)
        handle = _read_handle(base + ".handle")
        assert handle is not None
        return attach(handle)


def find(bootstrap_servers: str | None = None, **options: Any) -> Handle | None:
    """The handle of the running host producer of this configuration (the options of
    :func:`host_producer`), or None: for readers such as ``shmprod stats``; it starts
    nothing. Runs in: any process of the user."""
    if bootstrap_servers is not None:
        options["bootstrap_servers"] = bootstrap_servers
    cfg = ProducerConfig.from_keywords(**options)
    return _read_handle(os.path.join(runtime_dir(), config_key(cfg)) + ".handle")


def _start_daemon(
    cfg: ProducerConfig, options: dict[str, Any], base: str, idle_timeout_ms: int
) -> None:
    """Starts the daemon and waits for its handle file. Runs in: a caller, holding the
    configuration's lock."""
    spec = pickle.dumps({"options": options, "base": base, "idle_timeout_ms": idle_timeout_ms})
    fd = os.open(base + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys, shmprod.host; sys.exit(shmprod.host.main())"],
            # what Python needs, not the caller's secrets; no BLAS threads spinning at
            # its start (about 80 ms of CPU on two cores: it never calls BLAS)
            env={**_sender_env(), OPENBLAS_THREADS_VAR: "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=fd,
            start_new_session=True,  # outlives the caller; Ctrl-C of its terminal spares it
            close_fds=True,
        )
    finally:
        os.close(fd)
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(spec)  # options may hold passwords: a pipe, never argv
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    # It forks the daemon and exits at once: the daemon is nobody's child here.
    daemon_pid = proc.wait(START_TIMEOUT_S)
    if daemon_pid != 0:
        raise ProducerError(f"the host producer did not start: see {base}.log")
    deadline = time.monotonic() + max(START_TIMEOUT_S, cfg.max_block_ms / 1000 + 10)
    pid_file = base + ".pid"
    while not os.path.exists(base + ".handle"):
        if time.monotonic() > deadline or not _daemon_alive(pid_file):
            raise ProducerError(f"the host producer did not start: see {base}.log")
        time.sleep(0.01)


def _daemon_alive(pid_file: str) -> bool:
    """Whether the daemon named in ``pid_file`` runs (True while it is not written)."""
    from shmprod.worker.cause import alive

    try:
        with open(pid_file) as f:
            return alive(int(f.read().strip() or 0))
    except (OSError, ValueError):
        return True


def main() -> int:
    """The daemon: owns the producer, publishes its handle, exits when idle."""
    from shmprod.producer import Producer

    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("SHMPROD_LOG_LEVEL", "WARNING").upper(),
        format="shmprod-host[%(process)d] %(asctime)s %(levelname)s %(message)s",
    )
    spec = pickle.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    base: str = spec["base"]
    child = os.fork()
    if child:  # the caller waits for this first process only: it names the daemon, exits
        tmp = f"{base}.pid.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(child))
        os.rename(tmp, base + ".pid")  # before the caller looks: never a dead one's pid
        os._exit(0)
    idle_s = spec["idle_timeout_ms"] / 1000.0
    try:
        producer = Producer(**spec["options"])
    except ShmprodError as exc:
        log.error("cannot start the host producer: %s", exc)
        return 1
    try:
        tmp = f"{base}.handle.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(producer.handle, f)
        os.rename(tmp, base + ".handle")  # appears whole
        idle_since = time.monotonic()
        while True:
            time.sleep(IDLE_CHECK_S)
            sender = producer.stats()["sender"]
            if sender["state"] != "running":  # its sender died: the next caller starts anew
                log.error("the host producer's sender is %s: exiting", sender["state"])
                return 1
            others = sender["workers_attached"] - 1  # not itself
            if others > 0:
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since < idle_s:
                continue
            with _locked(base + ".lock"):  # no caller is attaching meanwhile
                if producer.stats()["sender"]["workers_attached"] - 1 > 0:
                    idle_since = time.monotonic()
                    continue
                handle = _read_handle(base + ".handle")
                if handle is not None and handle.segment == producer.handle.segment:
                    os.unlink(base + ".handle")
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(base + ".pid")
            log.info("idle for %.0f s: closing", idle_s)
            return 0
    finally:
        producer.close()


if __name__ == "__main__":
    sys.exit(main())
