"""The small picklable handle workers attach with, and the sender's start-up spec."""

from __future__ import annotations

import contextlib
import json
import pickle
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from shmprod.config import ProducerConfig, Serializer


@dataclass(frozen=True)
class Handle:
    """Everything a process on this host needs to attach to a producer.

    Pickles to a few hundred bytes (fork, spawn, forkserver, ``multiprocess``/dill,
    Celery, Spark closures). ``secret`` proves to the sender that the attaching process
    was given the handle; keep it as private as the producer itself. ``config`` holds
    no broker credential: passwords are replaced by ``config.REDACTED``
    (:meth:`ProducerConfig.for_workers`); workers never talk to brokers.
    """

    segment: str
    socket_path: str
    secret: bytes
    owner_pid: int
    config: dict[str, Any]
    key_serializer: Serializer | None = field(default=None, compare=False)
    value_serializer: Serializer | None = field(default=None, compare=False)
    partitioner: Any = field(default=None, compare=False)  # a user callable, if any
    host: str = ""  # the producer's host name (shared memory is host-local)

    def producer_config(self) -> ProducerConfig:
        """The producer's configuration, rebuilt in the attaching process."""
        config = dict(self.config)
        if self.partitioner is not None:
            config["partitioner"] = self.partitioner
        return ProducerConfig(
            **config,
            key_serializer=self.key_serializer,
            value_serializer=self.value_serializer,
        )

    def __repr__(self) -> str:  # never print the secret
        return f"Handle(segment={self.segment!r}, socket_path={self.socket_path!r}, owner_pid={self.owner_pid})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its fields; a serializer or partitioner that cannot travel raises a
        TypeError naming the option instead of pickle's attribute-lookup message."""
        for option in ("key_serializer", "value_serializer", "partitioner"):
            _check_picklable(option, getattr(self, option))
        return (
            Handle,
            (
                self.segment,
                self.socket_path,
                self.secret,
                self.owner_pid,
                self.config,
                self.key_serializer,
                self.value_serializer,
                self.partitioner,
                self.host,
            ),
        )


def _check_picklable(option: str, fn: Any) -> None:
    """TypeError unless ``fn`` pickles (with dill too, where the process imported it:
    the ``multiprocess`` package pickles with dill)."""
    if fn is None:
        return
    try:
        pickle.dumps(fn)
        return
    except Exception as exc:
        error: Exception = exc
    dill = sys.modules.get("dill")
    if dill is not None:
        with contextlib.suppress(Exception):
            dill.dumps(fn)
            return
    raise TypeError(
        f"the handle carries {option}={fn!r} to the processes that attach, so it must "
        f"pickle: use a function or class defined at the top level of an importable "
        f"module (not a lambda, a nested function or one defined in __main__ of a spawn "
        f"child), or serialize in your own code ({type(error).__name__}: {error})"
    ) from None


@dataclass(frozen=True)
class SenderSpec:
    """What the owner tells the sender process at start (``python -m shmprod.sender``).

    Travels as JSON on the sender's stdin, a pipe only the two processes hold: it carries
    the handle's secret and the broker credentials, which must never appear in a command
    line (``/proc/PID/cmdline`` is readable by every user). ``listen_fd`` is the owner's
    listening UNIX socket, inherited through ``pass_fds``, so workers can connect before
    the sender has started.
    """

    segment: str
    socket_path: str
    secret_hex: str
    owner_pid: int
    owner_start_us: int
    listen_fd: int
    config: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def __repr__(self) -> str:  # never the secret or the credentials
        return f"SenderSpec(segment={self.segment!r}, owner_pid={self.owner_pid})"

    @classmethod
    def from_json(cls, text: str) -> SenderSpec:
        return cls(**json.loads(text))
