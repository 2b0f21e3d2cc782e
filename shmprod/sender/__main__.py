"""``python -m shmprod.sender < spec.json``: run the sender process.

Imports its modules, then reads its :class:`SenderSpec` as JSON from stdin until EOF
(the owner starts this process first and writes the spec into the pipe once the pool
is made, then closes it): the spec holds the handle's secret and the broker
credentials, which a command line would show to every user. Maps the segment named in
the spec, wraps the listening socket inherited from the owner (``pass_fds``), records
this process's pid and start time in HEADER, runs the loop and exits with its status
(see :mod:`shmprod.sender.lifecycle`). Logs go to stderr at the level in
``SHMPROD_LOG_LEVEL`` (default WARNING) and never contain the secret or a password.
SIGINT is ignored: a Ctrl-C in the user's terminal reaches the whole process group, and
the owner decides when the producer closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from typing import NoReturn

from shmprod import layout
from shmprod.handle import SenderSpec
from shmprod.ipc import process_start_us
from shmprod.sender import lifecycle
from shmprod.sender.loop import Sender
from shmprod.shm import Segment

MAX_SPEC_BYTES = 1 << 20


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("SHMPROD_LOG_LEVEL", "WARNING").upper(),
        format="shmprod-sender[%(process)d] %(levelname)s %(message)s",
    )
    log = logging.getLogger("shmprod.sender")
    if args:
        log.error(
            "usage: python -m shmprod.sender < spec.json (a SenderSpec on stdin; no arguments)"
        )
        return lifecycle.EXIT_USAGE
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        text = sys.stdin.buffer.read(MAX_SPEC_BYTES + 1)
        if not text:
            log.warning("no spec on stdin: the owner stopped before the producer started")
            return lifecycle.EXIT_USAGE
        if len(text) > MAX_SPEC_BYTES:
            raise ValueError("spec too large")
        spec = SenderSpec.from_json(text.decode("utf-8"))
        sys.stdin.close()
    except (ValueError, TypeError, OSError) as exc:
        log.error("not a SenderSpec: %s", type(exc).__name__)
        return lifecycle.EXIT_USAGE
    return run(spec)


def run(spec: SenderSpec) -> int:
    """Runs a sender for ``spec`` in this process; returns its exit status."""
    log = logging.getLogger("shmprod.sender")
    listen = socket.socket(fileno=spec.listen_fd)
    try:
        segment = Segment.attach(spec.segment)
    except Exception as exc:
        log.error("cannot map the producer's segment: %s", exc)
        listen.close()
        return lifecycle.EXIT_CRASHED
    try:
        sender = Sender(spec, segment.view, listen)
        sender.shared.set_sender_identity(os.getpid(), process_start_us())
        status = sender.run()
    except Exception:
        log.exception("the sender could not start")
        with contextlib.suppress(Exception):
            layout.U32.pack_into(segment.view, layout.H_STATE, layout.STATE_FAILED)
        listen.close()
        return lifecycle.EXIT_CRASHED
    del sender
    with contextlib.suppress(BufferError):
        segment.close()
    return status


def _exit(status: int) -> NoReturn:
    """Ends the process with ``status`` at once, once the logs are flushed. By then the
    producer's files are removed and every socket is closed; the interpreter's
    finalization (freeing every module's objects: 18 ms of a 27 ms exit, traced) would
    only delay the owner's ``close()``, which waits for this process to end."""
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit(main())
