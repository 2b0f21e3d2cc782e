"""Record-batch encoding benchmark: per-record vs vectorized encoder, per codec.

    python bench/codec.py [--quick] [--out bench/results/codec.json] [--batch-size N]
    python bench/codec.py --choice [--quick]   # compression library candidates

Encodes N records (1M, or 50k with --quick) of 100-byte and 1 KiB JSON-like values,
split into batches of --batch-size bytes, each batch written into one preallocated
buffer (standing in for shared memory) with its header and CRC -- what a worker does.
Prints records/s and MB/s (MB of uncompressed records sections) and writes a JSON file
plus a markdown table next to it. ``--choice`` measures the compression libraries we
chose between and writes ``codec-choice.md``. Timings are best-of-N wall clock on one
core; the machine may be shared, so compare rows of one run rather than runs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import cramjam
import lz4.block
import lz4.frame
import numpy as np
import pyarrow as pa
import pyarrow.compute

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shmprod.protocol import compression as C
from shmprod.protocol import records as R
from shmprod.protocol import vectorized as V

RESULTS = Path(__file__).resolve().parent / "results"
BASE_TS = 1_700_000_000_000
CODECS = [C.NONE, C.GZIP, C.SNAPPY, C.LZ4, C.ZSTD]


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------


def json_values(n: int, size: int, seed: int = 7) -> pa.Array:
    """n JSON-like values of exactly ``size`` bytes: fixed keys, random ids and hex.

    Compresses about 2-3x with gzip/zstd, like typical event payloads.
    """
    rng = np.random.default_rng(seed)
    head = b'{"id":0000000000,"user":"u00000","event":"click","ts":1700000000000,"v":"'
    tail = b'"}'
    pad = size - len(head) - len(tail)
    assert pad > 0, "value size too small for the template"
    rows = np.empty((n, size), np.uint8)
    rows[:, : len(head)] = np.frombuffer(head, np.uint8)
    rows[:, size - len(tail) :] = np.frombuffer(tail, np.uint8)
    digits = np.frombuffer(b"0123456789", np.uint8)
    hexchars = np.frombuffer(b"0123456789abcdef", np.uint8)
    rows[:, 6:16] = digits[rng.integers(0, 10, (n, 10))]  # id
    rows[:, 26:31] = digits[rng.integers(0, 10, (n, 5))]  # user
    events = [b"click", b"views", b"buyer", b"share"]
    rows[:, 42:47] = np.frombuffer(b"".join(events), np.uint8).reshape(4, 5)[rng.integers(0, 4, n)]
    rows[:, 54:67] = digits[rng.integers(0, 10, (n, 13))]  # ts
    # half the padding random hex, half a repeated phrase: realistic redundancy
    rnd = pad // 2
    start = len(head)
    rows[:, start : start + rnd] = hexchars[rng.integers(0, 16, (n, rnd))]
    phrase = np.frombuffer(
        (b"lorem ipsum dolor sit amet " * (pad // 20 + 2))[: pad - rnd], np.uint8
    )
    rows[:, start + rnd : start + pad] = phrase
    offsets = np.arange(0, n * size + 1, size, dtype=np.int64)
    off_type = pa.binary() if n * size < 2**31 else pa.large_binary()
    off = offsets.astype(np.int32) if off_type == pa.binary() else offsets
    return pa.Array.from_buffers(off_type, n, [None, pa.py_buffer(off), pa.py_buffer(rows)])


def user_keys(n: int, seed: int = 8) -> pa.Array:
    """Keys like ``user-01234`` (10 bytes)."""
    rng = np.random.default_rng(seed)
    rows = np.empty((n, 10), np.uint8)
    rows[:, :5] = np.frombuffer(b"user-", np.uint8)
    rows[:, 5:] = np.frombuffer(b"0123456789", np.uint8)[rng.integers(0, 10, (n, 5))]
    offsets = np.arange(0, n * 10 + 1, 10, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(rows)])


# ---------------------------------------------------------------------------------------
# encoders under test
# ---------------------------------------------------------------------------------------


class Sink:
    """A preallocated buffer written like a ring (stands in for a shared-memory pool)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = 0
        self.written = 0

    def reserve(self, n: int) -> int:
        if self.pos + n > len(self.buf):
            self.pos = 0
        return self.pos

    def commit(self, start: int, end: int) -> None:
        self.written += end - start
        self.pos = end


def run_vectorized(
    values: pa.Array, keys: pa.Array | None, ts: Any, codec: int, batch_size: int, sink: Sink
) -> int:
    """Split + encode + write every batch; returns the number of batches."""
    nb = 0
    base = None if ts is not None else BASE_TS
    for batch in V.iter_encoded_batches(
        values, keys, ts, batch_size=batch_size, base_timestamp_ms=base
    ):
        at = sink.reserve(batch.max_size(codec))
        sink.commit(at, batch.write_into(sink.view, at, settings=R.BatchSettings(codec)))
        nb += 1
    return nb


def run_per_record(
    batches: list[tuple[int, list[R.NewRecord]]], codec: int, batch_size: int, sink: Sink
) -> int:
    """encode_batch_into for each pre-split batch of NewRecord tuples."""
    for base, recs in batches:
        at = sink.reserve(C.compress_bound(codec, batch_size) + R.HEADER_SIZE)
        sink.commit(
            at,
            R.encode_batch_into(
                sink.view, at, recs, base_timestamp_ms=base, settings=R.BatchSettings(codec)
            ),
        )
    return len(batches)


def per_record_input(
    values: pa.Array, keys: pa.Array | None, ts: Any, batch_size: int
) -> list[tuple[int, list[R.NewRecord]]]:
    """The same batches as NewRecord lists (built outside the timed region)."""
    base = None if ts is not None else BASE_TS
    bounds = V.split_batches(values, keys, ts, batch_size=batch_size, base_timestamp_ms=base)
    vals = values.to_pylist()
    ks = keys.to_pylist() if keys is not None else [None] * len(vals)
    tss = [int(t) for t in ts] if ts is not None else [None] * len(vals)
    out = []
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        recs = [R.NewRecord(ks[i], vals[i], (), tss[i]) for i in range(s, e)]
        first = tss[s]
        out.append((first if first is not None else BASE_TS, recs))
    return out


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def records_bytes(values: pa.Array, keys: pa.Array | None, ts: Any, batch_size: int) -> int:
    """Uncompressed records-section bytes of all the batches (the MB in MB/s)."""
    base = None if ts is not None else BASE_TS
    return sum(
        len(b.records)
        for b in V.iter_encoded_batches(
            values, keys, ts, batch_size=batch_size, base_timestamp_ms=base
        )
    )


def bench_encoders(n: int, batch_size: int, quick: bool) -> list[dict[str, Any]]:
    """Every (value size, keys, timestamps, codec, encoder) combination."""
    results = []
    sink = Sink(64 << 20)
    cases: list[tuple[int, bool, bool, list[int]]] = [
        (100, False, False, CODECS),
        (100, True, False, [C.NONE]),
        (100, True, True, [C.NONE, C.LZ4]),
        (1000, False, False, CODECS),
    ]
    for size, with_keys, row_ts, codecs in cases:
        count = n if size == 100 else max(n // 4, 1)
        values = json_values(count, size)
        keys = user_keys(count) if with_keys else None
        ts = (BASE_TS + np.arange(count, dtype=np.int64)) if row_ts else None
        payload = records_bytes(values, keys, ts, batch_size)
        recs = per_record_input(values, keys, ts, batch_size)
        check_identical(values, keys, ts, recs, batch_size)
        for codec in codecs:
            for encoder in ("per-record", "vectorized"):
                sink.written = 0
                if encoder == "vectorized":
                    fn: Callable[[], int] = partial(
                        run_vectorized, values, keys, ts, codec, batch_size, sink
                    )
                    repeats = 3
                else:
                    fn = partial(run_per_record, recs, codec, batch_size, sink)
                    repeats = 2 if quick else 1
                secs = best_of(fn, repeats)
                out_bytes = sink.written // repeats
                row: dict[str, Any] = {
                    "encoder": encoder, "value_bytes": size, "keys": with_keys,
                    "timestamps": "per-row" if row_ts else "one", "codec": C.codec_name(codec),
                    "records": count, "batch_size": batch_size, "seconds": round(secs, 4),
                    "records_per_s": round(count / secs), "mb_per_s": round(payload / secs / 1e6, 1),
                    "ratio": round(payload / max(out_bytes, 1), 2),
                }  # fmt: skip
                results.append(row)
                print(
                    f"{encoder:>10} {size:>5} B keys={with_keys!s:5} ts={row['timestamps']:7} "
                    f"{row['codec']:>6}: {row['records_per_s'] / 1e6:7.2f} M rec/s "
                    f"{row['mb_per_s']:8.1f} MB/s  ratio {row['ratio']}",
                    flush=True,
                )
    return results


def check_identical(
    values: pa.Array,
    keys: pa.Array | None,
    ts: Any,
    recs: list[tuple[int, list[R.NewRecord]]],
    batch_size: int,
) -> None:
    """The two encoders must produce the same first and last batch."""
    base = None if ts is not None else BASE_TS
    got = list(
        V.iter_encoded_batches(values, keys, ts, batch_size=batch_size, base_timestamp_ms=base)
    )
    for i in (0, -1):
        want = R.encode_batch(recs[i][1], base_timestamp_ms=recs[i][0])
        if got[i].to_bytes() != want:
            raise SystemExit("vectorized and per-record encoders disagree")


# ---------------------------------------------------------------------------------------
# assembling the records section: BinaryView cast vs binary_join_element_wise
# ---------------------------------------------------------------------------------------


def bench_assembly(n: int, repeats: int = 5) -> list[dict[str, Any]]:
    """Cost per row of turning (prefix, value, suffix) into one buffer, both ways.

    The inputs are what the encoder has at that point: a 7-byte prefix per row as an
    inline BinaryView array, the values, and a 1-byte suffix shared by every row.
    """
    rows = []
    chunk = min(n, 37_000)  # about one CHUNK_BYTES of 100-byte records
    values = json_values(chunk, 100)
    words = np.zeros((chunk, 2), np.uint64)
    words[:, 0] = np.uint64(7) | (np.uint64(0x01020304) << np.uint64(32))
    words[:, 1] = np.uint64(0x050607)
    prefix = pa.Array.from_buffers(pa.binary_view(), chunk, [None, pa.py_buffer(words)])
    sep = pa.scalar(b"", pa.binary())

    def via_join() -> pa.Buffer:
        joined = pa.compute.binary_join_element_wise(
            prefix.cast(pa.binary()), values, pa.scalar(b"\x00", pa.binary()), sep
        )
        return joined.buffers()[2]

    def via_views() -> pa.Buffer:
        vv = values.cast(pa.binary_view())
        vw = np.frombuffer(vv.buffers()[1], np.uint64).reshape(-1, 2)
        views = np.empty((chunk, 3, 2), np.uint64)
        as16 = views.view("V16").reshape(chunk, 3)
        as16[:, 0] = words.view("V16").reshape(chunk)
        as16[:, 1] = vw.view("V16").reshape(chunk)
        views[:, 2, 0] = 1
        views[:, 2, 1] = 0
        flat = pa.Array.from_buffers(
            pa.binary_view(), 3 * chunk, [None, pa.py_buffer(views), *vv.buffers()[2:]]
        ).cast(pa.binary())
        return flat.buffers()[2]

    total = chunk * 108
    if via_join()[:total] != via_views()[:total]:
        raise SystemExit("assembly variants disagree")
    for name, fn in (
        ("binary_join_element_wise", via_join),
        ("BinaryView cast (chosen)", via_views),
    ):
        secs = best_of(fn, repeats * 4)
        rows.append({"method": name, "rows": chunk, "ns_per_row": round(secs / chunk * 1e9, 1)})
        print(f"assembly {name:28}: {rows[-1]['ns_per_row']} ns/row", flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# compression library candidates (--choice)
# ---------------------------------------------------------------------------------------


def _lz4_own_frame(data: bytes, block: Callable[[memoryview], bytes]) -> bytes:
    return C.LZ4_FRAME_HEADER + b"".join(_lz4_blocks(memoryview(data), block)) + b"\0\0\0\0"


def _lz4_blocks(mv: memoryview, block: Callable[[memoryview], bytes]) -> Iterator[bytes]:
    for i in range(0, len(mv), C.LZ4_BLOCK_SIZE):
        chunk = mv[i : i + C.LZ4_BLOCK_SIZE]
        packed = block(chunk)
        if len(packed) >= len(chunk):
            yield (len(chunk) | 0x80000000).to_bytes(4, "little") + bytes(chunk)
        else:
            yield len(packed).to_bytes(4, "little") + packed


def _zlib_gzip(level: int) -> Callable[[bytes], bytes]:
    def fn(d: bytes) -> bytes:
        co = zlib.compressobj(level, zlib.DEFLATED, 31)
        return co.compress(d) + co.flush()

    return fn


def _cramjam_gzip(d: bytes, level: int) -> bytes:
    return bytes(cramjam.gzip.compress(d, level=level))


def _zlib_gunzip(d: bytes) -> bytes:
    return zlib.decompressobj(31).decompress(d, 1 << 30)


def choice_candidates() -> list[
    tuple[str, str, Callable[[bytes], bytes], Callable[[bytes], bytes] | None]
]:
    """(codec, candidate, compress, decompress) -- decompress None when not bounded."""
    return [
        ("gzip", "stdlib zlib level 6 (chosen)", _zlib_gzip(6), _zlib_gunzip),
        ("gzip", "stdlib gzip.compress level 6", lambda d: gzip.compress(d, 6, mtime=0), None),
        ("gzip", "cramjam.gzip level 6", lambda d: bytes(cramjam.gzip.compress(d, level=6)),
         lambda d: bytes(cramjam.gzip.decompress(d))),
        *(
            row
            for lvl in (1, 2, 3)
            for row in (
                (
                    "gzip",
                    f"stdlib zlib level {lvl}" + (" (chosen)" if lvl >= 3 else ""),
                    _zlib_gzip(lvl),
                    None,
                ),
                (
                    "gzip",
                    f"cramjam.gzip level {lvl}" + (" (chosen)" if lvl < 3 else ""),
                    partial(_cramjam_gzip, level=lvl),
                    None,
                ),
            )
        ),
        ("lz4", "own frame + lz4.block (chosen)", lambda d: C.compress(C.LZ4, d),
         lambda d: C.decompress(C.LZ4, d, 1 << 30)),
        ("lz4", "lz4.frame.compress, Java settings",
         lambda d: lz4.frame.compress(d, block_size=lz4.frame.BLOCKSIZE_MAX64KB, block_linked=False,
                                      content_checksum=False, store_size=False),
         lambda d: lz4.frame.decompress(d)),
        ("lz4", "own frame + cramjam.lz4.compress_block",
         lambda d: _lz4_own_frame(d, lambda b: bytes(cramjam.lz4.compress_block(b, store_size=False))), None),
        ("lz4", "cramjam.lz4.compress (linked blocks: Java rejects)", lambda d: bytes(cramjam.lz4.compress(d)),
         lambda d: bytes(cramjam.lz4.decompress(d))),
        ("snappy", "xerial 32 KiB blocks, cramjam raw (chosen)", lambda d: C.compress(C.SNAPPY, d),
         lambda d: C.decompress(C.SNAPPY, d, 1 << 30)),
        ("snappy", "raw snappy, cramjam (librdkafka's framing)",
         lambda d: bytes(cramjam.snappy.compress_raw(d)), lambda d: bytes(cramjam.snappy.decompress_raw(d))),
        ("zstd", "cramjam level 3 (chosen)", lambda d: C.compress(C.ZSTD, d),
         lambda d: C.decompress(C.ZSTD, d, 1 << 30)),
        ("zstd", "cramjam level 1", lambda d: bytes(cramjam.zstd.compress(d, level=1)), None),
    ]  # fmt: skip


def bench_choice(quick: bool) -> list[dict[str, Any]]:
    """Compress/decompress MB/s of each candidate on a 1 MiB records section."""
    values = json_values(9000, 100)
    data = bytes(V.encode_columns(values, base_timestamp_ms=BASE_TS)[R.HEADER_SIZE :])
    repeats = 5 if quick else 20
    rows = []
    for codec, name, comp, decomp in choice_candidates():
        blob = comp(data)
        c_secs = best_of(lambda: comp(data), repeats)  # noqa: B023
        d_secs = best_of(lambda: decomp(blob), repeats) if decomp else None  # noqa: B023
        if decomp is not None and decomp(blob) != data:
            raise SystemExit(f"{name}: round trip failed")
        rows.append({
            "codec": codec, "candidate": name, "ratio": round(len(data) / len(blob), 2),
            "compress_mb_s": round(len(data) / c_secs / 1e6),
            "decompress_mb_s": round(len(data) / d_secs / 1e6) if d_secs else None,
        })  # fmt: skip
        print(
            f"{codec:6} {name:52} ratio {rows[-1]['ratio']:5}  "
            f"c {rows[-1]['compress_mb_s']:6} MB/s  d {rows[-1]['decompress_mb_s']} MB/s",
            flush=True,
        )
    return rows


CHOICE_NOTES = """
## Decisions

- **gzip**: stdlib `zlib` (`compressobj(level, DEFLATED, 31)`, one gzip member) at the
  default level 6 and levels 3-9, where it beats `cramjam.gzip`; `cramjam.gzip` at levels
  1-2, where it is faster and compresses better (measured level by level when choosing).
  Decompression is always `zlib.decompressobj(31).decompress(data, max_length)`: the only
  candidate with a bounded output, and it reads concatenated members like Java.
- **lz4**: our own frame writer over `lz4.block.compress` (independent 64 KiB blocks, FLG
  0x60, BD 0x40 -- exactly Java's `Lz4BlockOutputStream`: no block/content checksum, no
  content size; an incompressible block is stored raw). About 35% faster than
  `lz4.frame.compress` with the same settings (for a ratio ~3% lower on this data) and it
  writes straight into the destination buffer (shared memory).
  `cramjam.lz4.compress` writes *linked* blocks with checksums, which Java rejects
  ("Dependent block stream is unsupported"), so it is out. Decompression goes through
  liblz4's frame decoder (`lz4.frame.decompress_chunk` with `max_length`) in bounded
  steps, which reads any valid frame (content checksum, content size, other block sizes).
  No content checksum because Java writes none and its reader skips it (one revision in
  apache/kafka's history instead verifies an XOR of per-block hashes, which is not the
  LZ4 spec's checksum of a multi-block frame): writing none is safe for every reader.
- **snappy**: xerial framing (`\\x82SNAPPY\\x00`, version 1, compatible 1, int32-length
  chunks of 32 KiB input) via `cramjam.snappy.compress_raw_into` -- what Java writes;
  Java (xerial `SnappyInputStream` falls back to raw) and librdkafka
  (`rd_kafka_snappy_java_uncompress` when the magic matches) read both framings, and the
  broker accepts both. Decompression reads both and sizes output from each block header
  before allocating.
- **zstd**: `cramjam.zstd` level 3 (Java's default). On this data level 1 is both faster
  and smaller (zstd's level-1 strategy suits it); callers can pass `level=1`. Decompression
  sizes its buffer from the frame content size, or grows it geometrically up to the limit;
  libzstd refuses frames whose window exceeds 128 MiB.

Checked beyond our own round trips: kafka-python 3 and we read each other's none, gzip,
lz4 and snappy batches (snappy through kafka-python's own xerial code over a raw-snappy
shim; tests/unit/test_records.py), and confluent-kafka's consumer
(librdkafka {librdkafka}) reads multi-block batches of every codec from both encoders
through the embedded broker.
"""


def _librdkafka_version() -> str:
    try:
        import confluent_kafka

        return str(confluent_kafka.libversion()[0])
    except ImportError:
        return "?"


def write_choice(rows: list[dict[str, Any]], quick: bool) -> Path:
    lines = [
        "# Compression library choice",
        "",
        "Measured by `python bench/codec.py --choice" + (" --quick" if quick else "") + "` on a "
        "1 MiB records section of 9000 JSON-like 100-byte values (best of N, one core, shared "
        f"machine). Python {platform.python_version()}, cramjam {cramjam.__version__}, "
        f"lz4 {lz4.library_version_string()} (python-lz4 {lz4.VERSION}), zlib {zlib.ZLIB_RUNTIME_VERSION}.",
        "",
        "| codec | candidate | ratio | compress MB/s | decompress MB/s |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        d = "-" if r["decompress_mb_s"] is None else str(r["decompress_mb_s"])
        lines.append(
            f"| {r['codec']} | {r['candidate']} | {r['ratio']} | {r['compress_mb_s']} | {d} |"
        )
    lines.append(CHOICE_NOTES.format(librdkafka=_librdkafka_version()))
    path = RESULTS / "codec-choice.md"
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------


def write_results(
    results: list[dict[str, Any]], assembly: list[dict[str, Any]], meta: dict[str, Any], out: Path
) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results, "assembly": assembly}, indent=1))
    md = out.with_suffix(".md")
    lines = [
        "# Record-batch encoding: per-record vs vectorized",
        "",
        f"`python bench/codec.py{' --quick' if meta['quick'] else ''}`: {meta['records']} records "
        f"(1 KiB values: a quarter as many), batches of {meta['batch_size']} bytes written into "
        "one preallocated buffer with header and CRC. MB/s counts uncompressed records-section "
        f"bytes. One core of a shared {meta['cpu']}; Python {meta['python']}, numpy "
        f"{meta['numpy']}, pyarrow {meta['pyarrow']}.",
        "",
        "| value | keys | timestamps | codec | encoder | M records/s | MB/s | ratio | speed-up |",
        "|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    per_record: dict[tuple[Any, ...], float] = {}
    for r in results:
        key = (r["value_bytes"], r["keys"], r["timestamps"], r["codec"])
        if r["encoder"] == "per-record":
            per_record[key] = r["records_per_s"]
            speedup = ""
        else:
            speedup = f"{r['records_per_s'] / per_record[key]:.1f}x" if key in per_record else ""
        lines.append(
            f"| {r['value_bytes']} B | {'yes' if r['keys'] else 'no'} | {r['timestamps']} | "
            f"{r['codec']} | {r['encoder']} | {r['records_per_s'] / 1e6:.2f} | {r['mb_per_s']} | "
            f"{r['ratio']} | {speedup} |"
        )
    lines += [
        "",
        "Assembling a chunk of records (prefix + value + shared suffix per row) into one "
        "buffer, the step after the numpy varint work:",
        "",
        "| method | rows | ns/row |",
        "|---|---:|---:|",
    ]
    lines += [f"| {a['method']} | {a['rows']} | {a['ns_per_row']} |" for a in assembly]
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="50k records instead of 1M")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (markdown goes next to it)")
    ap.add_argument("--batch-size", type=int, default=1 << 20, help="batch byte budget")
    ap.add_argument("--choice", action="store_true", help="measure compression libraries instead")
    args = ap.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.choice:
        print("wrote", write_choice(bench_choice(args.quick), args.quick))
        return
    n = 50_000 if args.quick else 1_000_000
    out = args.out or RESULTS / ("codec-quick.json" if args.quick else "codec.json")
    meta = {
        "quick": args.quick, "records": n, "batch_size": args.batch_size,
        "python": platform.python_version(), "numpy": np.__version__, "pyarrow": pa.__version__,
        "cpu": platform.processor() or platform.machine(),
    }  # fmt: skip
    results = bench_encoders(n, args.batch_size, args.quick)
    assembly = bench_assembly(n)
    print("wrote", out, "and", write_results(results, assembly, meta, out))


if __name__ == "__main__":
    main()
