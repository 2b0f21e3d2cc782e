"""Record-batch compression codecs: none, gzip, snappy, lz4, zstd.

Sans-IO: bytes in, bytes out. A Kafka batch compresses its whole records section as
ONE blob; this module only turns such a blob into its compressed form and back.

Wire formats (what Java's producer writes, so every consumer can read ours):

- gzip (1): one standard gzip member (RFC 1952), level 6 by default (zlib; cramjam at
  levels 1-2, where it is faster).
- snappy (2): xerial framing -- ``\\x82SNAPPY\\x00``, version 1, compatible version 1
  (big-endian int32s), then ``int32 length + raw snappy`` chunks of at most 32 KiB input.
  Java's SnappyInputStream and librdkafka also read raw snappy (librdkafka produces it),
  so :func:`decompress` reads both.
- lz4 (3): the LZ4 *frame* format with Java's ``Lz4BlockOutputStream`` settings:
  version 1, independent blocks, no block checksum, no content checksum, no content size,
  64 KiB maximum block size; a block that does not shrink is stored uncompressed.
  Early abort: once a block saves less than 1/32 of its size, the next 7 blocks of the
  frame are stored uncompressed without trying (an incompressible 64 KiB block costs
  as much CPU to try as a compressible one), and the 8th is tried again. A frame is
  one batch's records, so a batch of incompressible values (random ids, encrypted or
  already compressed payloads) is tried once per 512 KiB instead of throughout.
  A section encoded where its frame goes (:func:`lz4_frame_in_place`, for the rows a
  worker writes straight into the pool) whose every tried block saves too little stays
  where it is, as ONE stored block: the frame header then names the smallest maximum
  block size that holds it (64 KiB, 256 KiB, 1 MiB or 4 MiB; Java's reader takes all
  four, as does liblz4's frame decoder), and no byte of it is copied.
  Measured on 100-byte random values with 16-byte keys (what a batch's records section
  holds): the fast compressor runs at about 1.3 GB/s and saves 0.3%; a stored block
  costs a copy.
  Java's reader skips a content size and (depending on version) ignores or verifies a
  content checksum, so writing neither is the one choice every version accepts.
- zstd (4): one zstd frame (needs Produce v7+), level 3 by default like Java.

Decompression is always bounded by ``max_size`` so a hostile batch cannot exhaust memory,
and every failure raises :class:`CompressionError` -- never a library exception.

Choices measured in ``bench/results/codec-choice.md`` (``python bench/codec.py --choice``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any, Final

import lz4.block
import lz4.frame

from shmprod.errors import CompressionError

__all__ = [
    "CODEC_IDS",
    "CODEC_NAMES",
    "DEFAULT_MAX_DECOMPRESSED",
    "GZIP",
    "LZ4",
    "LZ4_BLOCK_SIZE",
    "LZ4_FRAME_HEADER",
    "LZ4_SECTION_OFFSET",
    "NONE",
    "SNAPPY",
    "XERIAL_BLOCK_SIZE",
    "XERIAL_MAGIC",
    "ZSTD",
    "codec_id",
    "codec_name",
    "compress",
    "compress_bound",
    "compress_into",
    "decompress",
    "is_xerial",
    "lz4_frame_in_place",
    "lz4_stored_whole",
    "slack",
]


def _cramjam() -> Any:
    """cramjam (snappy, zstd, gzip at levels 1-2), imported at first use: a producer of lz4
    or uncompressed batches never maps its library (cramjam has no type stubs)."""
    import cramjam

    return cramjam


Buffer = bytes | bytearray | memoryview

NONE: Final = 0
GZIP: Final = 1
SNAPPY: Final = 2
LZ4: Final = 3
ZSTD: Final = 4

CODEC_NAMES: Final[dict[int, str]] = {
    NONE: "none",
    GZIP: "gzip",
    SNAPPY: "snappy",
    LZ4: "lz4",
    ZSTD: "zstd",
}
CODEC_IDS: Final[dict[str, int]] = {name: cid for cid, name in CODEC_NAMES.items()}

# The largest records section decompress() hands back unless told otherwise.
DEFAULT_MAX_DECOMPRESSED: Final = 64 * 1024 * 1024

# --- snappy (xerial framing) ---------------------------------------------------------
XERIAL_MAGIC: Final = b"\x82SNAPPY\x00"
_XERIAL_HEADER: Final = XERIAL_MAGIC + struct.pack(">ii", 1, 1)
_XERIAL_HEADER_SIZE: Final = 16
XERIAL_BLOCK_SIZE: Final = 32 * 1024  # xerial SnappyOutputStream's default, used by Java
_BE_I32 = struct.Struct(">i")

# --- lz4 frame --------------------------------------------------------------------------
LZ4_BLOCK_SIZE: Final = 64 * 1024
# magic 0x184D2204 (LE), FLG 0x60 = version 1 + independent blocks, BD 0x40 = 64 KiB max,
# HC 0x82 = (xxh32(FLG, BD) >> 8) & 0xFF.
LZ4_FRAME_HEADER: Final = b"\x04\x22\x4d\x18\x60\x40\x82"
_LZ4_UNCOMPRESSED_BIT: Final = 0x80000000
_LZ4_END_MARK: Final = b"\x00\x00\x00\x00"
_LE_U32 = struct.Struct("<I")
_LZ4_JAVA_DEFAULT_LEVEL: Final = 9  # Java uses the fast compressor at its default level 9
# Early abort: a block that saves less than 1/2**_LZ4_MIN_SAVING_SHIFT of its size means
# the next _LZ4_PROBE_EVERY - 1 blocks of the frame are stored without being tried.
_LZ4_MIN_SAVING_SHIFT: Final = 5
_LZ4_PROBE_EVERY: Final = 8
# A frame of one stored block: the headers (FLG as above; BD 4-7, HC) by the largest
# block each allows, smallest first.
_LZ4_ONE_BLOCK_HEADERS: Final = (
    (64 * 1024, LZ4_FRAME_HEADER),
    (256 * 1024, b"\x04\x22\x4d\x18\x60\x50\xfb"),
    (1024 * 1024, b"\x04\x22\x4d\x18\x60\x60\x51"),
    (4 * 1024 * 1024, b"\x04\x22\x4d\x18\x60\x70\x73"),
)
# Where a records section goes for lz4_frame_in_place: after a frame and a block header.
LZ4_SECTION_OFFSET: Final = len(LZ4_FRAME_HEADER) + 4

# --- gzip -----------------------------------------------------------------------------
_CRAMJAM_GZIP_LEVELS: Final = (1, 2)  # faster than zlib here; zlib wins from level 3 up

# --- zstd -----------------------------------------------------------------------------
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
_ZSTD_DEFAULT_LEVEL: Final = 3


def codec_id(codec: str | int) -> int:
    """Codec id for a name (``"lz4"``) or an id (``3``); for parsing configuration."""
    if isinstance(codec, bool):
        raise CompressionError(f"unknown compression codec {codec!r}")
    if isinstance(codec, int):
        if codec in CODEC_NAMES:
            return codec
    elif isinstance(codec, str):
        cid = CODEC_IDS.get(codec.strip().lower())
        if cid is not None:
            return cid
    raise CompressionError(f"unknown compression codec {codec!r}")


def codec_name(codec: int) -> str:
    """Kafka's name for a codec id (``3`` -> ``"lz4"``)."""
    try:
        return CODEC_NAMES[codec]
    except (KeyError, TypeError):
        raise CompressionError(f"unknown compression codec id {codec!r}") from None


# ---------------------------------------------------------------------------------------
# Compression
# ---------------------------------------------------------------------------------------


def compress_bound(codec: int, n: int) -> int:
    """An upper bound of the compressed size of ``n`` input bytes; for reserving space."""
    if codec == NONE:
        return n
    if codec == GZIP:
        # Stored deflate blocks cost 5 bytes per 16 KiB at worst; gzip adds 18.
        return n + 5 * (n // 16383 + 1) + 18 + 64
    if codec == SNAPPY:
        blocks = max(1, -(-n // XERIAL_BLOCK_SIZE))
        return _XERIAL_HEADER_SIZE + blocks * (4 + 32) + n + n // 6 + 32
    if codec == LZ4:
        blocks = -(-n // LZ4_BLOCK_SIZE)
        return len(LZ4_FRAME_HEADER) + blocks * 4 + n + len(_LZ4_END_MARK)
    if codec == ZSTD:
        return n + (n >> 7) + 512
    raise CompressionError(f"unknown compression codec id {codec!r}")


def slack(codec: int, n: int) -> int:
    """Bytes a writer keeps free after up to ``n`` bytes of records, so that their
    compressed form always fits where they are (and is written there in one pass): the
    codec's worst-case growth, ``compress_bound(codec, n) - n``, when it is at most 1/64
    of ``n`` -- lz4 and gzip store an incompressible block as is, zstd's overhead is
    bounded -- else 0: snappy's bound (a sixth more) is too loose to keep free, and a
    snappy section that outgrows its place takes the slow path (compressed to new
    bytes, or written uncompressed when even that does not fit)."""
    growth = compress_bound(codec, n) - n
    return growth if growth <= n // 64 else 0


def compress(codec: int, data: Buffer, level: int | None = None) -> bytes:
    """Compresses a records section with ``codec``; ``level=None`` is Kafka's default."""
    if codec == NONE:
        return bytes(data)
    try:
        if codec == GZIP:
            return _gzip_compress(data, level)
        if codec == SNAPPY:
            out = bytearray(compress_bound(SNAPPY, len(data)))
            n = _xerial_compress_into(data, memoryview(out))
            del out[n:]
            return bytes(out)
        if codec == LZ4:
            out = bytearray(compress_bound(LZ4, len(data)))
            n = _lz4_compress_into(data, memoryview(out), level)
            del out[n:]
            return bytes(out)
        if codec == ZSTD:
            return bytes(_cramjam().zstd.compress(data, level=_zstd_level(level)))
    except CompressionError:
        raise
    except Exception as exc:
        raise CompressionError(f"{codec_name(codec)} compression failed: {exc}") from None
    raise CompressionError(f"unknown compression codec id {codec!r}")


def compress_into(
    codec: int, data: Buffer, out: bytearray | memoryview, level: int | None = None
) -> int:
    """Compresses ``data`` into the start of ``out``; returns the number of bytes written.

    Snappy, lz4 and zstd compress straight into ``out`` (e.g. shared memory); gzip copies
    once. Raises :class:`CompressionError` when ``out`` is too small --
    ``compress_bound(codec, len(data))`` bytes are always enough.
    """
    mv = out if isinstance(out, memoryview) else memoryview(out)
    try:
        if codec == NONE:
            n = len(data)
            _check_room(n, len(mv))
            mv[:n] = data
            return n
        if codec == GZIP:
            blob = _gzip_compress(data, level)
            _check_room(len(blob), len(mv))
            mv[: len(blob)] = blob
            return len(blob)
        if codec == SNAPPY:
            return _xerial_compress_into(data, mv)
        if codec == LZ4:
            return _lz4_compress_into(data, mv, level)
        if codec == ZSTD:
            if len(mv) < compress_bound(ZSTD, len(data)):
                # cramjam fails without saying why when the room runs out; go via bytes.
                packed = bytes(_cramjam().zstd.compress(data, level=_zstd_level(level)))
                _check_room(len(packed), len(mv))
                mv[: len(packed)] = packed
                return len(packed)
            written: int = _cramjam().zstd.compress_into(data, mv, level=_zstd_level(level))
            return written
    except CompressionError:
        raise
    except Exception as exc:
        raise CompressionError(f"{codec_name(codec)} compression failed: {exc}") from None
    raise CompressionError(f"unknown compression codec id {codec!r}")


def _check_room(need: int, have: int) -> None:
    if need > have:
        raise CompressionError(f"compressed output needs {need} bytes, buffer has {have}")


def _gzip_compress(data: Buffer, level: int | None) -> bytes:
    """One gzip member: zlib, except cramjam at levels 1-2 where it measured faster."""
    lvl = zlib.Z_DEFAULT_COMPRESSION if level is None else level
    if not isinstance(lvl, int) or not -1 <= lvl <= 9:
        raise CompressionError(f"gzip level must be in -1..9, got {level!r}")
    if lvl in _CRAMJAM_GZIP_LEVELS:
        return bytes(_cramjam().gzip.compress(data, level=lvl))
    co = zlib.compressobj(lvl, zlib.DEFLATED, 31)
    return co.compress(data) + co.flush()


def _zstd_level(level: int | None) -> int:
    lvl = _ZSTD_DEFAULT_LEVEL if level is None else level
    if not isinstance(lvl, int) or not -131072 <= lvl <= 22:
        raise CompressionError(f"zstd level must be in -131072..22, got {level!r}")
    return lvl


def _xerial_compress_into(data: Buffer, out: memoryview) -> int:
    """xerial-framed snappy, each 32 KiB of input compressed straight into ``out``."""
    src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    n = len(src)
    _check_room(_XERIAL_HEADER_SIZE, len(out))
    out[:_XERIAL_HEADER_SIZE] = _XERIAL_HEADER
    pos = _XERIAL_HEADER_SIZE
    snappy = _cramjam().snappy
    for start in range(0, n, XERIAL_BLOCK_SIZE):
        block = src[start : start + XERIAL_BLOCK_SIZE]
        _check_room(pos + 4 + snappy.compress_raw_max_len(block), len(out))
        written: int = snappy.compress_raw_into(block, out[pos + 4 :])
        _BE_I32.pack_into(out, pos, written)
        pos += 4 + written
    return pos


def _lz4_level(level: int | None) -> int | None:
    """None for the fast compressor (Java's default), else an LZ4 HC level."""
    if level is None or level == _LZ4_JAVA_DEFAULT_LEVEL:
        return None
    if not isinstance(level, int) or not 1 <= level <= 17:
        raise CompressionError(f"lz4 level must be in 1..17, got {level!r}")
    return level


def _lz4_block_fn(level: int | None) -> Callable[[memoryview], bytes]:
    """One block's raw lz4: the fast compressor, or LZ4 HC at ``level``."""
    hc = _lz4_level(level)
    if hc is None:

        def block_fn(b: memoryview) -> bytes:
            return lz4.block.compress(b, store_size=False)  # type: ignore[no-any-return]
    else:

        def block_fn(b: memoryview) -> bytes:
            return lz4.block.compress(  # type: ignore[no-any-return]
                b, mode="high_compression", compression=hc, store_size=False
            )

    return block_fn


def _lz4_saves_enough(packed: bytes, block: memoryview) -> bool:
    """Whether a block's compressed form saves at least the early abort's share."""
    return len(packed) <= len(block) - (len(block) >> _LZ4_MIN_SAVING_SHIFT)


def _lz4_compress_into(data: Buffer, out: memoryview, level: int | None) -> int:
    """An LZ4 frame with Java's settings, written block by block into ``out``."""
    block_fn = _lz4_block_fn(level)
    src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    n = len(src)
    _check_room(compress_bound(LZ4, n), len(out))
    hdr = len(LZ4_FRAME_HEADER)
    out[:hdr] = LZ4_FRAME_HEADER
    pos = hdr
    untried = 0  # blocks still to store without trying (early abort)
    for start in range(0, n, LZ4_BLOCK_SIZE):
        block = src[start : start + LZ4_BLOCK_SIZE]
        packed = b""
        if untried:
            untried -= 1
        else:
            packed = block_fn(block)
            if not _lz4_saves_enough(packed, block):
                untried = _LZ4_PROBE_EVERY - 1
        if not packed or len(packed) >= len(block):  # untried or incompressible: as is
            _LE_U32.pack_into(out, pos, len(block) | _LZ4_UNCOMPRESSED_BIT)
            out[pos + 4 : pos + 4 + len(block)] = block
            pos += 4 + len(block)
        else:
            _LE_U32.pack_into(out, pos, len(packed))
            out[pos + 4 : pos + 4 + len(packed)] = packed
            pos += 4 + len(packed)
    out[pos : pos + 4] = _LZ4_END_MARK
    return pos + 4


def lz4_frame_in_place(out: memoryview, n: int, level: int | None = None) -> int:
    """Makes the ``n`` bytes at ``out[LZ4_SECTION_OFFSET:]`` an LZ4 frame at ``out[0:]``;
    returns the frame's length.

    The blocks the early abort would try (one in eight, from the first) are tried. When
    none saves enough and one block can hold the section (up to 4 MiB), the bytes stay
    where they are as one stored block: a frame header and a block header before them,
    the end mark after, ``n + 15`` bytes in all. Otherwise the section is copied out and
    compressed into ``out`` as :func:`compress_into` does. ``out`` must hold
    ``compress_bound(LZ4, n)`` bytes (the in-place frame is never longer).
    Raises :class:`CompressionError` when ``out`` is too small or the codec fails.
    Runs in: worker (or wherever a section was encoded in place).
    """
    _check_room(compress_bound(LZ4, n), len(out))
    try:
        section = out[LZ4_SECTION_OFFSET : LZ4_SECTION_OFFSET + n]
        block_fn = _lz4_block_fn(level)
        header = next((h for most, h in _LZ4_ONE_BLOCK_HEADERS if n <= most), None)
        if n and header is not None and not _lz4_any_tried_saves(section, block_fn):
            out[: len(header)] = header
            _LE_U32.pack_into(out, len(header), n | _LZ4_UNCOMPRESSED_BIT)
            end = LZ4_SECTION_OFFSET + n
            out[end : end + 4] = _LZ4_END_MARK
            return end + 4
        return _lz4_compress_into(bytes(section), out, level)
    except CompressionError:
        raise
    except Exception as exc:
        raise CompressionError(f"lz4 compression failed: {exc}") from None


def _lz4_any_tried_saves(section: memoryview, block_fn: Callable[[memoryview], bytes]) -> bool:
    """Whether any block the early abort would try (one in eight) saves enough."""
    for start in range(0, len(section), LZ4_BLOCK_SIZE * _LZ4_PROBE_EVERY):
        block = section[start : start + LZ4_BLOCK_SIZE]
        if _lz4_saves_enough(block_fn(block), block):
            return True
    return False


def lz4_stored_whole(n: int, length: int) -> bool:
    """Whether an LZ4 frame of ``length`` bytes for a section of ``n`` stored every block
    as is, and one block could hold the section: what tells a writer that its next
    section is worth encoding in place for :func:`lz4_frame_in_place`."""
    fits = n <= _LZ4_ONE_BLOCK_HEADERS[-1][0]
    return fits and length in (compress_bound(LZ4, n), n + LZ4_SECTION_OFFSET + 4)


# ---------------------------------------------------------------------------------------
# Decompression (bounded)
# ---------------------------------------------------------------------------------------


def decompress(codec: int, data: Buffer, max_size: int = DEFAULT_MAX_DECOMPRESSED) -> bytes:
    """Decompresses a records section; output larger than ``max_size`` is an error.

    Raises :class:`CompressionError` for an unknown codec, corrupt or truncated input,
    trailing garbage, or output beyond ``max_size``.
    """
    if max_size < 0:
        raise CompressionError(f"max_size must be >= 0, got {max_size}")
    try:
        if codec == NONE:
            if len(data) > max_size:
                raise _too_big(max_size)
            return bytes(data)
        if codec == GZIP:
            return _gzip_decompress(data, max_size)
        if codec == SNAPPY:
            return _snappy_decompress(data, max_size)
        if codec == LZ4:
            return _lz4_decompress(data, max_size)
        if codec == ZSTD:
            return _zstd_decompress(data, max_size)
    except CompressionError:
        raise
    except Exception as exc:  # every library failure becomes a CompressionError
        raise CompressionError(f"{codec_name(codec)} decompression failed: {exc}") from None
    raise CompressionError(f"unknown compression codec id {codec!r}")


def _too_big(max_size: int) -> CompressionError:
    return CompressionError(f"decompressed records exceed the {max_size}-byte limit")


def _gzip_decompress(data: Buffer, max_size: int) -> bytes:
    """One or more concatenated gzip members, at most ``max_size`` bytes out."""
    chunks: list[bytes] = []
    total = 0
    rest: Buffer = data
    if not len(rest):
        raise CompressionError("empty gzip stream")
    while True:
        d = zlib.decompressobj(31)
        try:
            chunk = d.decompress(rest, max_size - total + 1)
        except zlib.error as exc:
            raise CompressionError(f"corrupt gzip stream: {exc}") from None
        total += len(chunk)
        if total > max_size:
            raise _too_big(max_size)
        chunks.append(chunk)
        if not d.eof:
            raise CompressionError("truncated gzip stream")
        rest = d.unused_data
        if not rest:
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def is_xerial(data: Buffer) -> bool:
    """True when ``data`` starts with xerial snappy framing (what Java writes)."""
    return len(data) >= _XERIAL_HEADER_SIZE and bytes(data[:8]) == XERIAL_MAGIC


def _snappy_decompress(data: Buffer, max_size: int) -> bytes:
    src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    if is_xerial(src):
        return _xerial_decompress(src, max_size)
    return _raw_snappy_decompress([src], max_size)


def _raw_snappy_length(block: memoryview) -> int:
    try:
        n: int = _cramjam().snappy.decompress_raw_len(block)
    except Exception as exc:
        raise CompressionError(f"corrupt snappy block: {exc}") from None
    return n


def _raw_snappy_decompress(blocks: list[memoryview], max_size: int) -> bytes:
    """Raw snappy blocks into one buffer, sized from their headers before allocating."""
    sizes = []
    total = 0
    for block in blocks:
        n = _raw_snappy_length(block)
        total += n
        if total > max_size:
            raise _too_big(max_size)
        sizes.append(n)
    out = bytearray(total)
    view = memoryview(out)
    pos = 0
    snappy = _cramjam().snappy
    for block, n in zip(blocks, sizes, strict=True):
        try:
            written = snappy.decompress_raw_into(block, view[pos : pos + n])
        except Exception as exc:
            raise CompressionError(f"corrupt snappy block: {exc}") from None
        if written != n:
            raise CompressionError(f"snappy block decoded to {written} bytes, header said {n}")
        pos += n
    view.release()
    return bytes(out)


def _xerial_decompress(src: memoryview, max_size: int) -> bytes:
    version, compatible = struct.unpack_from(">ii", src, 8)
    if compatible < 1 or version < 1:
        raise CompressionError(f"unsupported xerial snappy version {version}/{compatible}")
    blocks = []
    pos = _XERIAL_HEADER_SIZE
    end = len(src)
    while pos < end:
        if pos + 4 > end:
            raise CompressionError("truncated xerial snappy chunk length")
        (n,) = _BE_I32.unpack_from(src, pos)
        pos += 4
        if n < 0 or pos + n > end:
            raise CompressionError(f"xerial snappy chunk of {n} bytes overruns the stream")
        blocks.append(src[pos : pos + n])
        pos += n
    return _raw_snappy_decompress(blocks, max_size)


def _lz4_decompress(data: Buffer, max_size: int) -> bytes:
    """Any valid LZ4 frame via liblz4's frame decoder, in growing bounded steps."""
    src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    if len(src) < 7 or bytes(src[:4]) != LZ4_FRAME_HEADER[:4]:
        raise CompressionError("not an lz4 frame (bad magic)")
    ctx = lz4.frame.create_decompression_context()
    chunks: list[bytes] = []
    total = 0
    pos = 0
    step = max(LZ4_BLOCK_SIZE, 4 * len(src))
    while True:
        want = min(step, max_size - total + 1)
        try:
            chunk, used, eof = lz4.frame.decompress_chunk(ctx, src[pos:], max_length=want)
        except Exception as exc:
            raise CompressionError(f"corrupt lz4 frame: {exc}") from None
        pos += used
        total += len(chunk)
        if total > max_size:
            raise _too_big(max_size)
        chunks.append(chunk)
        if eof:
            if pos != len(src):
                raise CompressionError(f"{len(src) - pos} bytes after the lz4 end mark")
            break
        if pos >= len(src) and len(chunk) < want:
            raise CompressionError("truncated lz4 frame")
        if used == 0 and not chunk:
            raise CompressionError("lz4 frame decoder made no progress")
        step *= 2
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _zstd_content_size(src: memoryview) -> int | None:
    """The frame content size a zstd frame header declares, or None if absent."""
    if len(src) < 5 or bytes(src[:4]) != _ZSTD_MAGIC:
        raise CompressionError("not a zstd frame (bad magic)")
    fhd = src[4]
    fcs_flag = fhd >> 6
    single_segment = (fhd >> 5) & 1
    dict_id_size = (0, 1, 2, 4)[fhd & 3]
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        return None
    start = 5 + (0 if single_segment else 1) + dict_id_size
    if start + fcs_size > len(src):
        raise CompressionError("truncated zstd frame header")
    size = int.from_bytes(src[start : start + fcs_size], "little")
    return size + 256 if fcs_size == 2 else size


def _zstd_decompress(data: Buffer, max_size: int) -> bytes:
    """zstd into a buffer sized from the frame header, or grown in bounded steps."""
    src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    declared = _zstd_content_size(src)
    if declared is not None:
        if declared > max_size:
            raise _too_big(max_size)
        out = bytearray(declared)
        try:
            n = _cramjam().zstd.decompress_into(src, out)
            if n == declared:
                return bytes(out)
        except Exception:  # more frames than the first declares: grow below
            pass
    size = min(max_size, max(LZ4_BLOCK_SIZE, 8 * len(src), declared or 0))
    while True:
        out = bytearray(size)
        try:
            n = _cramjam().zstd.decompress_into(src, out)
        except Exception as exc:
            if size >= max_size:
                raise CompressionError(
                    f"corrupt zstd frame or output beyond the {max_size}-byte limit: {exc}"
                ) from None
            size = min(max_size, size * 2)
            continue
        del out[n:]
        return bytes(out)
