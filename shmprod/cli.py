"""The ``shmprod`` command line: ``demo``, ``export``, ``broker`` and ``cleanup``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shmprod import __version__
from shmprod.config import parse_bootstrap
from shmprod.errors import ShmprodError
from shmprod.worker.topics import validate_topic


def _cmd_broker(args: argparse.Namespace) -> int:
    """Runs an embedded tansu broker on loopback until Ctrl-C or SIGTERM."""
    from shmprod.broker import EmbeddedBroker

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with EmbeddedBroker(port=args.port) as broker:
        for name in args.topic or ():
            topic, _, parts = name.partition(":")
            broker.create_topic(topic, int(parts or 1))
        print(f"broker ready: bootstrap_servers={broker.bootstrap} (Ctrl-C stops it)", flush=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    print("broker stopped", flush=True)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from shmprod.demo import run_demo

    return run_demo(
        records=args.records,
        value_size=args.value_size,
        partitions=args.partitions,
        compression=args.compression,
        bootstrap=args.bootstrap,
        report_path=args.report,
        progress=not args.quiet,
        workers=args.workers,
    )


EXPORT_EXAMPLE = """\
examples:
  shmprod export events/ --topic events --key user_id --value json --timestamp ts
  shmprod export 'data/*.csv' --topic t --bootstrap-servers broker:9092 \\
      --value payload -X linger.ms=20 -X compression.type=zstd

Without --bootstrap-servers an embedded broker is started (the broker extra) and the
topic created there. Exit status: 0 when every record was acknowledged, 1 when any
was not (the first error is printed), 2 for usage errors."""


def _cmd_export(args: argparse.Namespace) -> int:
    """``shmprod export``: files to Kafka through one shared producer (see
    :func:`shmprod.export`). Runs in: the caller."""
    from shmprod.config import text_options
    from shmprod.errors import ConfigError
    from shmprod.exporter import export, prepare

    try:
        options = text_options(dict(_pair(x, "-X") for x in args.X or ()))
    except ConfigError as exc:
        raise _Usage(str(exc)) from None
    options.setdefault("compression_type", args.compression)
    headers = [_pair(h, "--header") for h in args.header or ()]
    columns = {
        "key": args.key,
        "value": args.value,
        "partition": args.partition,
        "timestamp": args.timestamp,
        "headers": headers or None,
    }
    try:  # every file opened and every column checked before a broker or producer starts
        prepare(args.source, args.topic, workers=args.workers, **columns)
    except ConfigError as exc:
        raise _Usage(str(exc)) from None
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap_servers
        if bootstrap is None:
            bootstrap = _embedded(stack, args.topic, args.partitions)
        try:
            report = export(
                args.source,
                args.topic,
                bootstrap_servers=bootstrap,
                workers=args.workers,
                **columns,
                progress=None if args.progress is None else args.progress,
                check=False,
                **options,
            )
        except ConfigError as exc:
            raise _Usage(str(exc)) from None
        print(
            f"exported {report.records:,} records ({report.bytes / 1e6:,.1f} MB of keys and "
            f"values) to {args.topic!r} in {report.seconds:.2f}s "
            f"({report.rows_per_s:,.0f} records/s); per partition: "
            + ", ".join(f"{p}:{n:,}" for p, n in sorted(report.per_partition.items()))
        )
        if not report.ok:
            print(
                f"shmprod: error: {report.failed:,} records not acknowledged; "
                + "; ".join(report.errors[:3]),
                file=sys.stderr,
            )
            return 1
        if args.bootstrap_servers is None:
            _keep_broker(bootstrap, args.topic)
    return 0


class _Usage(Exception):
    """A usage error found after parsing (exit status 2)."""


def _pair(text: str, flag: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise _Usage(f"{flag} {text!r}: expected NAME=VALUE")
    return name.strip(), value


def _embedded(stack: Any, topic: str, partitions: int) -> str:
    try:
        from shmprod.broker import EmbeddedBroker

        broker = stack.enter_context(EmbeddedBroker())
    except ImportError as exc:
        raise _Usage(
            f"no --bootstrap-servers, and the embedded broker is not installed ({exc}): "
            "pip install 'shmprod[broker]', or give --bootstrap-servers"
        ) from None
    broker.create_topic(topic, partitions)
    print(f"embedded broker: bootstrap_servers={broker.bootstrap}", file=sys.stderr)
    return str(broker.bootstrap)


def _keep_broker(bootstrap: str, topic: str) -> None:
    """Says how to read the topic back; on a terminal keeps the embedded broker (its
    data is in memory) until Ctrl-C."""
    print(
        f"read it back while the broker runs, e.g.: kcat -C -b {bootstrap} -t {topic} -e"
        f"  (or kafka-console-consumer.sh --bootstrap-server {bootstrap} --topic {topic} "
        "--from-beginning)"
    )
    if not sys.stdin.isatty():
        print("the embedded broker stops now (its data is in memory)")
        return
    print("the embedded broker keeps the data in memory until you press Ctrl-C", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


def _writable(path: str) -> str:
    """An argparse type: a file path whose folder exists and is writable (usage error,
    exit status 2, before anything starts, not after the whole run)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write a report to {path!r}")
    return path


def _int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (usage error, exit status 2, otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}")
        return value

    parse.__name__ = "integer"
    return parse


def _topic_spec(text: str) -> str:
    """``NAME`` or ``NAME:PARTITIONS`` with a legal name and at least one partition."""
    name, sep, count = text.partition(":")
    _topic_spec_plain(name)
    if sep:
        _int_range(1, 1_000_000)(count)
    return text


def _topic_spec_plain(text: str) -> str:
    """A legal topic name."""
    try:
        validate_topic(text)
    except ShmprodError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _bootstrap(text: str) -> str:
    try:
        parse_bootstrap(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmprod", description="One Kafka producer per host, shared by every worker process."
    )
    parser.add_argument("--version", action="version", version=f"shmprod {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="export a generated data set from a pool of worker processes through one shared "
        "producer to the embedded broker, and verify every record",
    )
    demo.add_argument(
        "--records", type=_int_range(1), default=200_000, help="rows to export (200000)"
    )
    demo.add_argument(
        "--value-size",
        type=_int_range(16, 64 << 10),  # a record must fit max_request_size (1 MiB)
        default=100,
        help="approximate value bytes, 16 to 65536 (100)",
    )
    demo.add_argument(
        "--partitions", type=_int_range(1, 10_000), default=8, help="topic partitions (8)"
    )
    demo.add_argument(
        "--workers", type=_int_range(1, 256), default=4, help="worker processes, 1-256 (4)"
    )
    demo.add_argument(
        "--compression",
        default="lz4",
        choices=["none", "gzip", "snappy", "lz4", "zstd"],
        help="batch compression (lz4)",
    )
    demo.add_argument(
        "--bootstrap",
        type=_bootstrap,
        default=None,
        help="use this broker (host:port) instead of starting an embedded one",
    )
    demo.add_argument(
        "--report",
        type=_writable,
        default="shmprod-demo-report.json",
        help="JSON report path",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress line")
    demo.set_defaults(func=_cmd_demo)

    exp = sub.add_parser(
        "export",
        help="export Parquet, Arrow IPC, CSV or JSON-lines files to Kafka from a pool of "
        "processes sharing one producer",
        epilog=EXPORT_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("source", help="a file, glob or directory")
    exp.add_argument("--topic", type=_topic_spec_plain, required=True)
    exp.add_argument("--bootstrap-servers", type=_bootstrap, default=None)
    exp.add_argument("--key", help="the key column, or 'json' for the row (default: none)")
    exp.add_argument("--value", default="value", help="the value column, or 'json' (value)")
    exp.add_argument("--timestamp", help="a timestamp, date or epoch-ms column")
    exp.add_argument("--partition", help="an integer partition column")
    exp.add_argument(
        "--header", action="append", metavar="NAME=VALUE", help="a header on every record"
    )
    exp.add_argument(
        "--workers", type=_int_range(1, 256), default=None, help="processes (the CPU count)"
    )
    exp.add_argument(
        "--compression",
        default="lz4",
        choices=["none", "gzip", "snappy", "lz4", "zstd"],
        help="batch compression (lz4)",
    )
    exp.add_argument(
        "-X", action="append", metavar="NAME=VALUE", help="a producer option (Java name)"
    )
    exp.add_argument(
        "--partitions",
        type=_int_range(1, 10_000),
        default=8,
        help="partitions of the topic on the embedded broker (8)",
    )
    bar = exp.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    exp.set_defaults(func=_cmd_export)

    st = sub.add_parser(
        "stats",
        help="watch a running producer of this user (read-only): rates, queues, pool, "
        "attached processes",
    )
    st.add_argument(
        "segment", nargs="?", help="its shared-memory name (default: the only running one)"
    )
    st.add_argument(
        "--bootstrap-servers",
        type=_bootstrap,
        help="find the host producer (shmprod.host_producer) of this configuration...",
    )
    st.add_argument(
        "-X", action="append", metavar="NAME=VALUE", help="...with these producer options"
    )
    st.add_argument("--json", action="store_true", help="one JSON object per refresh")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1)")
    st.add_argument("--count", type=_int_range(1), default=None, help="refreshes, then exit")
    st.add_argument(
        "--serve",
        type=_int_range(1, 65535),
        metavar="PORT",
        help="serve Prometheus/OpenMetrics text on 127.0.0.1:PORT/metrics until Ctrl-C",
    )
    st.set_defaults(func=_cmd_stats)

    broker = sub.add_parser("broker", help="run a local development broker (tansu) on loopback")
    broker.add_argument(
        "--port", type=_int_range(1, 65535), default=None, help="listen port (a free one)"
    )
    broker.add_argument(
        "--topic",
        type=_topic_spec,
        action="append",
        help="create a topic, NAME or NAME:PARTITIONS (repeatable)",
    )
    broker.set_defaults(func=_cmd_broker)

    cleanup = sub.add_parser(
        "cleanup",
        help="remove the shared memory and socket files of this user's producers whose "
        "owner and sender processes are all dead",
    )
    cleanup.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    cleanup.set_defaults(func=_cmd_cleanup)
    return parser


def _cmd_stats(args: argparse.Namespace) -> int:
    """``shmprod stats``: see :mod:`shmprod.stats`."""
    from shmprod.stats import live_producers, serve_metrics, watch

    segment = args.segment
    if segment is None and args.bootstrap_servers is not None:
        from shmprod.config import text_options
        from shmprod.errors import ConfigError
        from shmprod.host import find

        try:
            options = text_options(dict(_pair(x, "-X") for x in args.X or ()))
            handle = find(args.bootstrap_servers, **options)
        except ConfigError as exc:
            raise _Usage(str(exc)) from None
        if handle is None:
            print("shmprod stats: no host producer of that configuration runs", file=sys.stderr)
            return 1
        segment = handle.segment
    if segment is None:
        running = live_producers()
        if not running:
            print("shmprod stats: no running producer of this user", file=sys.stderr)
            return 1
        if len(running) > 1:
            raise _Usage("several producers run; name one: " + ", ".join(running))
        segment = running[0]
    if args.serve is not None:
        server = serve_metrics(segment, args.serve)
        print(f"serving http://127.0.0.1:{args.serve}/metrics (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait(None if args.count is None else args.count * args.interval)
        server.shutdown()
        return 0
    return watch(segment, interval_s=args.interval, count=args.count, as_json=args.json)


def _cmd_cleanup(args: argparse.Namespace) -> int:
    from shmprod.sweep import sweep

    stale = sweep(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for s in stale:
        extra = f" and {s.directory}" if s.directory else ""
        print(
            f"{verb} {s.segment} ({s.size / 2**20:.1f} MiB){extra}: owner pid {s.owner_pid} "
            f"and sender pid {s.sender_pid} are gone"
        )
    if not stale:
        print("nothing to clean up: every producer of this user has a live process")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
    except _Usage as exc:
        parser.exit(2, f"shmprod {args.command}: error: {exc}\n")
    except ShmprodError as exc:
        print(f"shmprod: error: {exc}", file=sys.stderr)
        return 1
    return rc
