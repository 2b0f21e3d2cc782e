"""``shmprod.export``: a table, a DataFrame or files to Kafka, from a pool of processes
that share one producer.

    report = shmprod.export("events/*.parquet", "events", bootstrap_servers="broker:9092",
                            key="user_id", value="json", timestamp="ts",
                            compression_type="lz4")
    print(report.records, report.rows_per_s)

The source is read with pyarrow's own readers, streamed (never whole in memory): a
path, glob or directory of Parquet, Arrow IPC/Feather, CSV or JSON-lines files (a job
per file, or for Parquet a run of row groups, read by the pool process itself), a
``pyarrow.dataset.Dataset``, a ``pyarrow.Table`` or ``RecordBatchReader``, or a
pandas DataFrame (their record batches are handed to the pool in memory files,
:mod:`shmprod.shared_batches`, a bounded number at a time). ``workers`` processes
(spawned; default the CPU count) attach to ONE producer
(:func:`shmprod.pool_initializer`) and send whole columns with ``send_batch``.

Everything the source says about itself is checked before anything is sent: every
file opens, the named columns exist with usable types. Each job waits for its
acknowledgements; the report counts acknowledged records and keeps the first errors.
``check=True`` (the default) raises :class:`ExportError` (carrying the report) when any
record failed: a failed export never passes silently. A pool process that dies (killed,
out of memory) stops the export with :class:`ExportError` at once; the jobs that had
not finished may have been sent in part.

Runs in: the caller (:func:`export`: the producer, the pool, progress) and the pool
processes (:func:`_run_job`).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import logging
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import numpy as np
import pyarrow as pa

from shmprod import shared_batches
from shmprod.config import OPENBLAS_THREADS_VAR
from shmprod.errors import ConfigError, ShmprodError
from shmprod.pool import current, pool_initializer
from shmprod.shared_batches import SharedBatch, SharedBatches
from shmprod.tables import binary_column, epoch_ms_column, header_rows, json_column

__all__ = ["ExportError", "ExportReport", "Plan", "export", "prepare"]

JSON: Final = "json"
BATCH_ROWS: Final = 65_536
# a Parquet job: consecutive row groups of a file, until it holds this many rows or
# bytes (uncompressed, as the file's metadata gives them) (_row_group_runs)
JOB_ROWS: Final = BATCH_ROWS
JOB_BYTES: Final = 64 << 20
# a batch read or handed over: at most BATCH_ROWS rows, and fewer where those would hold
# more than BATCH_BYTES (an in-memory batch is a job of its own: the same bound)
BATCH_BYTES: Final = JOB_BYTES
MAX_ERRORS: Final = 10
FORMATS: Final = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "ipc",
    ".feather": "ipc",
    ".ipc": "ipc",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
}


class ExportError(ShmprodError):
    """Some records were not acknowledged; ``report`` says how many were, and why not."""

    def __init__(self, message: str, report: ExportReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class ExportReport:
    """What an export did: records and value+key bytes acknowledged, per partition."""

    topic: str
    records: int = 0
    bytes: int = 0
    failed: int = 0
    seconds: float = 0.0
    per_partition: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    total_rows: int | None = None

    @property
    def rows_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        return self.failed == 0 and not self.errors

    def add(self, result: JobResult) -> None:
        self.records += result.records
        self.bytes += result.bytes
        self.failed += result.failed
        for p, n in result.per_partition:
            self.per_partition[p] += n
        if result.error is not None and len(self.errors) < MAX_ERRORS:
            self.errors.append(result.error)


# ----------------------------------------------------------------------------------
# what a job carries (picklable) and does (pool process)
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Columns:
    """The caller's choice of columns (checked against the schema by :func:`_check`)."""

    value: str
    key: str | None = None
    partition: str | None = None
    timestamp: str | None = None
    headers: str | None = None  # a column of list<struct<key, value>>
    static_headers: tuple[tuple[str, bytes | None], ...] | None = None

    @property
    def needed(self) -> list[str] | None:
        """The columns a job reads (None: all, for a JSON row)."""
        if JSON in (self.value, self.key):
            return None
        names = [self.value, self.key, self.partition, self.timestamp, self.headers]
        return list(dict.fromkeys(n for n in names if n is not None))


@dataclass(frozen=True)
class Job:
    """One unit of work: a file (or some of a Parquet file's row groups), or batches."""

    topic: str
    columns: Columns
    path: str | None = None
    file_format: str | None = None
    row_groups: tuple[int, ...] | None = None
    read_options: tuple[tuple[str, Any], ...] = ()
    # an in-memory batch as an Arrow IPC stream: in a file of the caller's
    # (shmprod.shared_batches), or pickled where there are no such files
    batch: SharedBatch | bytes | None = None
    threads: bool = True  # decode a file with pyarrow's thread pool (one process only)


def _to_ipc(batch: pa.RecordBatch) -> bytes:
    """A batch as an Arrow IPC stream: only its own rows. (A pickled slice carries its
    parent's whole buffers: a 65,536-row slice of a million-row table pickles to the
    whole table.)"""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return bytes(sink.getvalue())


@dataclass(frozen=True)
class JobResult:
    records: int
    bytes: int
    failed: int
    per_partition: tuple[tuple[int, int], ...]
    error: str | None = None


def _batches(job: Job) -> Iterator[pa.RecordBatch]:
    """The job's record batches, streamed. Runs in: a pool process."""
    if job.batch is not None:
        reader = (
            shared_batches.read(job.batch)
            if isinstance(job.batch, SharedBatch)
            else pa.ipc.open_stream(job.batch)
        )
        for b in reader:
            # offsets and lengths checked before the encoder reads by them: a damaged
            # stream is an ArrowInvalid in the job's result, never a read out of bounds
            b.validate(full=True)
            yield b
        return
    assert job.path is not None
    if job.file_format == "parquet":
        import pyarrow.parquet as pq

        assert job.row_groups is not None  # a Parquet job is a run of row groups
        f = pq.ParquetFile(job.path)
        # one row group at a time: read across several, a batch of BATCH_ROWS rows
        # would decode them all at once (1 KB rows in row groups of 10,000: 196 MB
        # at the peak against 48 MB one at a time)
        for g in job.row_groups:
            meta = f.metadata.row_group(g)
            yield from f.iter_batches(
                _rows_per_batch(meta.num_rows, meta.total_byte_size),
                row_groups=[g],
                columns=job.columns.needed,
                use_threads=job.threads,
            )
        return
    import pyarrow.dataset as ds  # imports pandas: only where files are read

    data = ds.dataset(job.path, format=_format(job.file_format, dict(job.read_options)))
    yield from data.to_batches(
        columns=job.columns.needed, batch_size=BATCH_ROWS, use_threads=job.threads
    )


def _rows_per_batch(rows: int, nbytes: int) -> int:
    """Rows a batch of a row group of ``rows`` rows and ``nbytes`` bytes (uncompressed)
    takes: :data:`BATCH_ROWS`, or fewer so that a batch holds about
    :data:`BATCH_BYTES` (rows of 1 MB: 64 a batch, not 64 GB). Never below one."""
    if nbytes <= 0 or rows <= 0:
        return BATCH_ROWS
    return max(1, min(BATCH_ROWS, rows * BATCH_BYTES // nbytes))


def _byte_slices(batch: pa.RecordBatch, limit: int) -> list[pa.RecordBatch]:
    """``batch`` as consecutive slices of at most ``limit`` bytes (a single row wider
    than that is a slice of its own), zero-copy. A row's bytes: its values in each
    variable-width column (by the offsets), and an even share of every other column.
    Runs in: the caller (a table's batches, before they are handed over)."""
    n = batch.num_rows
    if n <= 1 or batch.nbytes <= limit:
        return [batch]
    sizes = np.zeros(n, np.float64)
    for col in batch.columns:
        offsets = _offsets(col)
        sizes += col.nbytes / n if offsets is None else np.diff(offsets)
    ends = np.cumsum(sizes)
    out: list[pa.RecordBatch] = []
    start = 0
    while start < n:
        before = ends[start - 1] if start else 0.0
        stop = max(start + 1, int(np.searchsorted(ends, before + limit, side="right")))
        out.append(batch.slice(start, stop - start))
        start = stop
    return out


def _send(batch: pa.RecordBatch, job: Job) -> Any:
    """One ``send_batch`` of ``batch``'s columns. Runs in: a pool process."""
    c = job.columns
    now_ms = time.time_ns() // 1_000_000
    value = json_column(batch) if c.value == JSON else binary_column(batch.column(c.value))
    key = None
    if c.key is not None:
        key = json_column(batch) if c.key == JSON else binary_column(batch.column(c.key))
    headers: Any = list(c.static_headers) if c.static_headers else None
    if c.headers is not None:
        per_row = header_rows(batch.column(c.headers))
        headers = [list(c.static_headers or ()) + h for h in per_row]
    return (
        current().send_batch(
            job.topic,
            value,
            keys=key,
            partitions=batch.column(c.partition) if c.partition else None,
            timestamps_ms=(
                epoch_ms_column(batch.column(c.timestamp), now_ms) if c.timestamp else None
            ),
            headers=headers,
        ),
        int(_nbytes(value) + (_nbytes(key) if key is not None else 0)),
    )


def _offsets(arr: pa.Array) -> Any:
    """The ``len(arr) + 1`` value offsets of a binary or string column, as numpy (a view
    of its buffer); None for any other type."""
    t = arr.type
    large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
    if not (large or pa.types.is_binary(t) or pa.types.is_string(t)):
        return None
    offsets = np.frombuffer(arr.buffers()[1], np.int64 if large else np.int32)
    return offsets[arr.offset : arr.offset + len(arr) + 1]


def _nbytes(arr: pa.Array) -> int:
    """Bytes of a binary or string column's values (a null-typed column: none)."""
    offsets = _offsets(arr)
    return 0 if offsets is None or len(offsets) < 2 else int(offsets[-1] - offsets[0])


HANDLE_WAIT_S: Final = 300.0


# pyarrow's jemalloc as the export's processes configure it: freed memory kept for reuse
JEMALLOC_CONF: Final = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_CONF_VAR: Final = "JE_ARROW_MALLOC_CONF"
# what the export's processes start with: that jemalloc, and numpy's OpenBLAS with no
# threads of its own (they never call it; see pool_environment)
POOL_ENVIRONMENT: Final = {JEMALLOC_CONF_VAR: JEMALLOC_CONF, OPENBLAS_THREADS_VAR: "1"}


@contextlib.contextmanager
def pool_environment() -> Iterator[None]:
    """While it lasts, processes started from this one inherit :data:`POOL_ENVIRONMENT`:
    each variable that is not set already; one the user set is kept as it is. Afterwards
    the environment is as before. Runs in: the caller, around starting the pool's
    processes. Both are read once, as a process loads the library, so a process can
    only be given them at its start:

    - ``JE_ARROW_MALLOC_CONF``: jemalloc keeps the memory it frees
      (:func:`reader_memory_pool`).
    - ``OPENBLAS_NUM_THREADS=1``: numpy's OpenBLAS starts no thread of its own
      (shmprod and pyarrow import numpy). At import it starts one per core beyond the
      first, and each spins for about a tenth of a second waiting for work that a pool
      process never gives it. On a two-core machine ``import shmprod.exporter`` took
      303-308 ms of CPU in 186-192 ms, and 182 ms of CPU with one thread. Every pool
      process paid it while the others, the sender and the broker were starting on
      the same cores."""
    added = [k for k in POOL_ENVIRONMENT if k not in os.environ]
    for k in added:
        os.environ[k] = POOL_ENVIRONMENT[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def reader_memory_pool() -> None:
    """Makes jemalloc Arrow's memory pool in this process, where pyarrow has it (its
    Linux wheels do); else leaves the pool as it is. The export's processes start with
    jemalloc told to keep the memory it frees (:func:`pool_environment`).

    Why: each job reads its rows into new Arrow buffers and drops them.

    - pyarrow's default pool (mimalloc) hands freed pages back within milliseconds.
      With eight processes each reading a row group in turn, every read faulted in and
      zeroed new pages. perf put 29% of eight exporter processes' samples in page faults,
      most under mimalloc, against 16% with one process.
    - pyarrow configures its jemalloc to return freed pages within about a second. That
      also refaulted every 10 MB row group (1 KB rows).
    - With nothing returned, the pages are reused. The suite's exporter, before and
      after, three alternated pairs (``bench/results/exporter-allocator.md``):
      - 100 B lz4 keyed, eight processes: 2.67 M records/s (2.58-2.70) against 2.33 M
        (2.21-2.39); CPU per GB 3.55 -> 2.72.
      - 1 KB uncompressed keyed, eight processes: 365 k (362-367 k) against 374 k
        (359-375 k); CPU per GB 1.58 -> 1.41; peak memory 1,286 -> 1,157 MB.
      - One process: 2.94 M against 2.73 M and 403 k against 388 k, both inside the
        spreads.

    A process keeps the most it held at once until it exits. This is only for the
    processes :func:`export` starts: a user's own process keeps its allocator.
    Runs in: a pool process, before its first job."""
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without it
        return
    pa.set_memory_pool(pool)


def _attach_from(handles: Any) -> None:
    """The pool's initializer: sets Arrow's memory pool (:func:`reader_memory_pool`),
    waits for the producer's handle, then attaches; the process will end at once at its
    exit (:func:`_end_at_exit`). Runs in: a pool process (killed by :func:`_stop` if
    the producer never starts)."""
    atexit.register(_end_at_exit)  # first: atexit runs the last registered first
    reader_memory_pool()
    pool_initializer(handles.get(timeout=HANDLE_WAIT_S))


def _end_at_exit() -> None:
    """The last thing a pool process does: ends it with status 0 (``os._exit``) instead
    of the interpreter's finalization, which frees every module's objects, pyarrow's
    and numpy's too: 10-60 ms of wall time, 40-60 in four runs of five (``import
    shmprod.exporter`` then exit, against the same then ``os._exit``). ``export``
    shuts its pool down and waits for every process to end before it closes the
    producer.

    By then the process has detached from the producer (a finalizer of multiprocessing,
    run before it exits: :func:`shmprod.pool.pool_initializer`) and written every
    result (a pipe, written at once). Its status is 0: what the pool's processes end
    with but for an error in the pool's own loop, whose traceback is printed before;
    ``export`` reads failures from the jobs' results and a dead process from the pool,
    never from an exit status. Runs in: a pool process, from ``atexit``."""
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _run_job(job: Job) -> JobResult:
    """Sends a job's rows and waits for their acknowledgements. Never raises: errors
    come back in the result. Runs in: a pool process."""
    records = nbytes = failed = 0
    counts: Counter[int] = Counter()
    error: str | None = None
    pending: deque[tuple[Any, int, int]] = deque()

    def take(fut: Any, n: int, size: int) -> None:
        nonlocal records, nbytes, failed, error
        try:
            md = fut.result(timeout=None)
        except ShmprodError as exc:
            failed += n
            error = error or f"{type(exc).__name__}: {exc}"
            return
        records += n
        nbytes += size
        binc = np.bincount(md.partitions)
        for p in np.flatnonzero(binc):
            counts[int(p)] += int(binc[p])

    try:
        for batch in _batches(job):
            if not batch.num_rows:
                continue
            fut, size = _send(batch, job)
            pending.append((fut, batch.num_rows, size))
            while pending and (pending[0][0].done() or len(pending) > 8):
                take(*pending.popleft())
        current().flush()
    except ShmprodError as exc:
        error = error or f"{type(exc).__name__}: {exc}"
    except (OSError, pa.ArrowException) as exc:
        error = error or f"reading {job.path or 'a batch'}: {type(exc).__name__}: {exc}"
    while pending:
        take(*pending.popleft())
    return JobResult(records, nbytes, failed, tuple(sorted(counts.items())), error)


# ----------------------------------------------------------------------------------
# the caller: sources into jobs, checked
# ----------------------------------------------------------------------------------


def _format(name: str | None, options: Mapping[str, Any]) -> Any:
    if name == "csv" and options:
        import pyarrow.csv as pcsv

        parse = {k: v for k, v in options.items() if k in ("delimiter", "quote_char")}
        import pyarrow.dataset as ds

        return ds.CsvFileFormat(parse_options=pcsv.ParseOptions(**parse))
    return name


def _paths(source: str | os.PathLike[str]) -> tuple[list[str], str]:
    """The files of a path, glob or directory, and their format."""
    text = os.fspath(source)
    if os.path.isdir(text):
        files = sorted(
            os.path.join(root, f)
            for root, _dirs, names in os.walk(text)
            for f in names
            if not f.startswith((".", "_"))
        )
    elif any(ch in text for ch in "*?["):
        files = sorted(f for f in glob.glob(text, recursive=True) if os.path.isfile(f))
    else:
        if not os.path.exists(text):
            raise ConfigError(f"no such file or directory: {text!r}")
        files = [text]
    if not files:
        raise ConfigError(f"no files in {text!r}")
    formats = {FORMATS.get(_suffix(f)) for f in files}
    if None in formats:
        odd = next(f for f in files if FORMATS.get(_suffix(f)) is None)
        raise ConfigError(
            f"{odd!r}: unknown file type; export reads "
            + ", ".join(sorted(set(FORMATS)))
            + " (and .gz of csv/json)"
        )
    if len(formats) > 1:
        raise ConfigError(f"{text!r} mixes file types: {sorted(str(f) for f in formats)}")
    return files, str(formats.pop())


def _suffix(path: str) -> str:
    name = path.lower().removesuffix(".gz").removesuffix(".bz2")
    return os.path.splitext(name)[1]


def _check(schema: pa.Schema, c: Columns, what: str) -> None:
    """Refuses a column that is missing or of a type it cannot be sent as."""
    names = set(schema.names)

    def field_of(role: str, name: str) -> pa.Field:
        if name not in names:
            raise ConfigError(
                f"{role} column {name!r} is not in {what}; its columns: " + ", ".join(schema.names)
            )
        return schema.field(name)

    for role, name in (("value", c.value), ("key", c.key)):
        if name is None or name == JSON:
            continue
        t = field_of(role, name).type
        if pa.types.is_nested(t):
            raise ConfigError(
                f"{role} column {name!r} has type {t}: give a binary, string or scalar "
                f"column, or {JSON!r} for the whole row as JSON"
            )
    if c.partition is not None:
        t = field_of("partition", c.partition).type
        if not pa.types.is_integer(t):
            raise ConfigError(f"partition column {c.partition!r} has type {t}: need integers")
    if c.timestamp is not None:
        t = field_of("timestamp", c.timestamp).type
        if not (pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_integer(t)):
            raise ConfigError(
                f"timestamp column {c.timestamp!r} has type {t}: need a timestamp, a date "
                "or integer epoch milliseconds"
            )
    if c.headers is not None:
        t = field_of("headers", c.headers).type
        ok = pa.types.is_list(t) and pa.types.is_struct(t.value_type)
        if not ok or {t.value_type.field(i).name for i in range(t.value_type.num_fields)} != {
            "key",
            "value",
        }:
            raise ConfigError(
                f"headers column {c.headers!r} has type {t}: need list<struct<key: string, "
                "value: binary>>"
            )


def _file_jobs(
    files: list[str],
    fmt: str,
    topic: str,
    c: Columns,
    read_options: Mapping[str, Any],
    workers: int,
) -> tuple[list[Job], int | None]:
    """The jobs of ``files``, every file opened and its schema checked first: a job per
    file, or for Parquet consecutive row groups of one file (:func:`_row_group_runs`).
    Returns (jobs, total rows if known).

    A job decodes with pyarrow's thread pool only when one process exports. With several
    processes the pool of processes is the parallelism, and each decodes on its own
    thread: pyarrow's pool has a thread per core in every process. (Measured, eight
    processes each reading its Parquet row groups of 100 B records and sending them,
    on two cores, 4 alternating runs: 0.80-1.08 M records/s with threads, 0.90-1.30 M
    without, peak memory 670-700 MB against 470-570 MB; one process, and 1 KB
    records, no worse.)"""
    jobs: list[Job] = []
    total: int | None = 0
    options = tuple(sorted(read_options.items()))
    threads = workers == 1
    groups: list[tuple[str, list[tuple[int, int]]]] = []  # (rows, bytes) per row group
    for path in files:
        try:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                meta = pq.ParquetFile(path)
                _check(meta.schema_arrow, c, path)
                md = meta.metadata
                row_groups = [md.row_group(g) for g in range(md.num_row_groups)]
                groups.append((path, [(r.num_rows, r.total_byte_size) for r in row_groups]))
                if total is not None:
                    total += md.num_rows
            else:
                import pyarrow.dataset as ds

                frag = ds.dataset(path, format=_format(fmt, read_options))
                _check(frag.schema, c, path)
                jobs.append(Job(topic, c, path, fmt, None, options, threads=threads))
                if fmt == "ipc" and total is not None:
                    total += frag.count_rows()
                else:
                    total = None
        except ConfigError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise ConfigError(f"cannot read {path!r}: {exc}") from None
    if groups:
        target = min(JOB_ROWS, -(-(total or 0) // (2 * workers)))
        for path, sizes in groups:
            for run in _row_group_runs(sizes, target, JOB_BYTES):
                jobs.append(Job(topic, c, path, fmt, run, options, threads=threads))
    return jobs, total


def _row_group_runs(sizes: list[tuple[int, int]], rows: int, nbytes: int) -> list[tuple[int, ...]]:
    """A Parquet file's row groups cut into runs of consecutive ones, given each
    group's (rows, bytes): a run ends where it holds at least ``rows`` rows or
    ``nbytes`` bytes (the last run may hold less).

    Why: every job pays for itself. Its file is opened, its rows flushed, and every one
    of them acknowledged before its process takes the next job. Each flush writes a
    partly filled batch per partition. A row group can be small: with one job per row
    group, ``bench/export.py`` (a million rows of 100 B, row groups of 10,000, two
    processes, ``bench/results/export-row-group-runs.md``) made 0.70 M records/s
    against 0.95 M with these runs, and spent 17% more CPU per GB.

    ``rows`` is :data:`JOB_ROWS`, less where that would give a process under two jobs.
    The bytes (:data:`JOB_BYTES`) keep a job of wide rows as short as one of 1 KB rows:
    a process that dies leaves its unfinished jobs sent in part, and the progress shows
    finished jobs. A run is read one row group at a time (:func:`_batches`), so a long
    run holds no more memory than a short one. Runs in: the caller.
    """
    runs: list[tuple[int, ...]] = []
    run: list[int] = []
    held_rows = held_bytes = 0
    for g, (n, b) in enumerate(sizes):
        run.append(g)
        held_rows += n
        held_bytes += b
        if held_rows >= rows or held_bytes >= nbytes:
            runs.append(tuple(run))
            run, held_rows, held_bytes = [], 0, 0
    if run:
        runs.append(tuple(run))
    return runs


def _batch_source(source: Any) -> tuple[pa.Schema, Iterator[pa.RecordBatch], int | None]:
    """(schema, batches, total rows if known) of an in-memory source."""
    if type(source).__module__.startswith("pandas"):
        source = pa.Table.from_pandas(source, preserve_index=False)
    if isinstance(source, pa.Table):
        return source.schema, iter(source.to_batches(BATCH_ROWS)), source.num_rows
    if isinstance(source, pa.RecordBatch):
        return source.schema, iter([source]), source.num_rows
    if isinstance(source, pa.RecordBatchReader):
        return source.schema, iter(source), None
    ds = sys.modules.get("pyarrow.dataset")  # a Dataset means it is imported already
    if ds is not None and isinstance(source, ds.Dataset):
        return source.schema, source.to_batches(batch_size=BATCH_ROWS), None
    raise ConfigError(
        f"cannot export a {type(source).__name__}: give a path, glob or directory of "
        "Parquet, Arrow IPC, CSV or JSON-lines files, a pyarrow Table, RecordBatchReader "
        "or Dataset, or a pandas DataFrame"
    )


def _static_headers(headers: Any) -> tuple[tuple[str, bytes | None], ...] | None:
    if headers is None:
        return None
    items = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    out = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ConfigError(f"headers: need (str, bytes | str | None) pairs, got {item!r}")
        k, v = item
        out.append((k, v.encode() if isinstance(v, str) else v))
    return tuple(out)


# ----------------------------------------------------------------------------------
# progress
# ----------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal: rows, MB, rows/s and, when the total is
    known, percent and ETA. Refreshed at most 5 times a second."""

    def __init__(self, stream: TextIO, total: int | None, now: float) -> None:
        self.stream = stream
        self.total = total
        self.t0 = now
        self.last = 0.0

    def show(self, report: ExportReport, now: float, final: bool = False) -> None:
        if not final and now - self.last < 0.2:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        rate = report.records / elapsed
        parts = [f"{report.records:,} rows", f"{report.bytes / 1e6:,.1f} MB", f"{rate:,.0f} rows/s"]
        bar = ""
        if self.total:
            done = min(report.records / self.total, 1.0)
            filled = int(done * 24)
            bar = "[" + "#" * filled + "." * (24 - filled) + f"] {done:4.0%} "
            if rate > 0 and not final:
                parts.append(f"ETA {max(self.total - report.records, 0) / rate:,.0f}s")
        self.stream.write("\r" + bar + " | ".join(parts) + "\x1b[K")
        if final:
            self.stream.write("\n")
        self.stream.flush()


# ----------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------


@dataclass
class Plan:
    """An export checked and cut into jobs, before any producer exists. A table's jobs
    hold files of the caller's (``shared``) from when they are taken from ``jobs``:
    :meth:`close` (or ``with``) closes those still open."""

    topic: str
    workers: int
    jobs: Iterator[Job]
    total_rows: int | None
    shared: SharedBatches = field(default_factory=SharedBatches)

    def release(self, job: Job) -> None:
        """Frees a finished job's shared batch, if it has one."""
        if isinstance(job.batch, SharedBatch):
            self.shared.release(job.batch)

    def close(self) -> None:
        self.shared.close()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepare(
    source: Any,
    topic: str,
    *,
    key: str | None = None,
    value: str = "value",
    partition: str | None = None,
    timestamp: str | None = None,
    headers: Any = None,
    workers: int | None = None,
    read_options: Mapping[str, Any] | None = None,
) -> Plan:
    """Checks ``source`` and the columns (every file opened) and cuts the work into
    jobs; raises :class:`ConfigError` naming what is wrong. Nothing is sent. Runs in:
    the caller."""
    if not isinstance(topic, str) or not topic:
        raise ConfigError(f"topic must be a non-empty str, got {topic!r}")
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1, got {workers!r}")
    header_column = headers if isinstance(headers, str) else None
    cols = Columns(
        value,
        key,
        partition,
        timestamp,
        header_column,
        None if header_column else _static_headers(headers),
    )
    shared = SharedBatches()
    jobs: Iterator[Job]
    if isinstance(source, str | os.PathLike):
        files, fmt = _paths(source)
        job_list, total = _file_jobs(files, fmt, topic, cols, read_options or {}, workers)
        jobs = iter(job_list)
    else:
        schema, batches, total = _batch_source(source)
        _check(schema, cols, f"the {type(source).__name__}")
        needed = cols.needed
        handoff = shared.share if shared_batches.available() else _to_ipc
        jobs = (
            Job(topic, cols, batch=handoff(part))
            for b in batches
            for part in _byte_slices(b if needed is None else b.select(needed), BATCH_BYTES)
        )
    return Plan(topic, workers, jobs, total, shared)


def export(
    source: Any,
    topic: str,
    *,
    bootstrap_servers: str,
    key: str | None = None,
    value: str = "value",
    partition: str | None = None,
    timestamp: str | None = None,
    headers: Any = None,
    workers: int | None = None,
    progress: bool | None = None,
    check: bool = True,
    read_options: Mapping[str, Any] | None = None,
    **producer_config: Any,
) -> ExportReport:
    """Exports every row of ``source`` to ``topic`` (see the module docstring).

    ``value``/``key``: a column (binary and strings as they are, other types as their
    text) or ``"json"`` for the row as a JSON object. ``partition``: an integer column
    (nulls: the partitioner's choice). ``timestamp``: a timestamp, date or integer
    epoch-ms column. ``headers``: (name, value) pairs for every record, or the name of
    a list<struct<key, value>> column. ``workers``: processes (default the CPU count).
    ``progress``: a bar on stderr (default: when stderr is a terminal).
    ``read_options``: for CSV files, ``delimiter`` and ``quote_char``.
    ``producer_config``: :class:`~shmprod.Producer` options. Raises
    :class:`ConfigError` before anything is sent for a bad source or column, and
    :class:`ExportError` after, when ``check`` and any record failed.
    """
    from shmprod.producer import Producer

    plan = prepare(
        source,
        topic,
        key=key,
        value=value,
        partition=partition,
        timestamp=timestamp,
        headers=headers,
        workers=workers,
        read_options=read_options,
    )
    workers, jobs, total = plan.workers, plan.jobs, plan.total_rows
    show = sys.stderr.isatty() if progress is None else progress
    report = ExportReport(topic, total_rows=total)
    t0 = time.monotonic()
    bar = Progress(sys.stderr, total, t0) if show else None
    ctx = mp.get_context("spawn")
    handles = ctx.Queue()
    # A pool process that dies (killed, out of memory) breaks a ProcessPoolExecutor:
    # every job not yet collected fails at once. (A multiprocessing.Pool would start a
    # new process and wait forever for the dead one's job.)
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_attach_from, initargs=(handles,)
    )
    window: deque[tuple[Future[JobResult], Job]] = deque()
    died: str | None = None
    clean = False
    try:
        # The first jobs start the pool's processes (they import shmprod and pyarrow)
        # while the producer starts; each then takes the producer's handle and attaches.
        # At most 2 jobs per process are pending: a stream stays a stream.
        # (a spawning pool starts a process at a submit that finds none idle, up to
        # ``workers``: these submits start them all, or all there will be)
        with pool_environment():
            for job in itertools.islice(jobs, 2 * workers):
                window.append((pool.submit(_run_job, job), job))
        with Producer(bootstrap_servers=bootstrap_servers, **producer_config) as producer:
            for _ in range(workers):
                handles.put(producer.handle)
            try:
                for job in jobs:
                    _collect(window, 2 * workers - 1, report, bar, plan)
                    window.append((pool.submit(_run_job, job), job))
                _collect(window, 0, report, bar, plan)
            except BrokenProcessPool as exc:
                died = (
                    f"a pool process died; {len(window):,} unfinished job(s) may have been "
                    f"sent in part ({exc})"
                )
                report.errors.append(died)
            pool.shutdown(wait=True)  # every process detached before the producer closes
            clean = True
    finally:
        if not clean:  # the producer did not start, or the caller was interrupted
            _stop(pool)
        plan.close()  # the pool has stopped: no process will read a shared batch again
        handles.close()
    report.seconds = time.monotonic() - t0
    if bar:
        bar.show(report, time.monotonic(), final=True)
    if check and died is not None:
        raise ExportError(
            f"the export stopped after {report.records:,} acknowledged records: {died}",
            report,
        )
    if check and not report.ok:
        raise ExportError(
            f"{report.failed:,} of {report.records + report.failed:,} records were not "
            f"acknowledged; first error: {report.errors[0] if report.errors else '?'}",
            report,
        )
    return report


def _collect(
    window: deque[tuple[Future[JobResult], Job]],
    keep: int,
    report: ExportReport,
    bar: Progress | None,
    plan: Plan,
) -> None:
    """Adds finished jobs to the report, oldest first, until ``keep`` are pending, and
    frees their shared batches. Raises ``BrokenProcessPool`` when a pool process died.
    Runs in: the caller."""
    while len(window) > keep:
        report.add(window[0][0].result())
        plan.release(window.popleft()[1])
        if bar:
            bar.show(report, time.monotonic())


def _stop(pool: ProcessPoolExecutor) -> None:
    """Ends the pool at once: its processes are killed, whether they wait for a handle
    or run a job (the sender frees what an attached one held). Runs in: the caller."""
    processes = list(pool._processes.values())  # no public way before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(5)
