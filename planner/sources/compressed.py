"""Compressed line files (``.gz``, ``.zst``), streamed: the only zstandard import.

Real corpora come as compressed JSONL shards (``shard-00000.jsonl.zst``). They are read as a
stream of decompressed chunks that end at a newline, the same shape ``formats.iter_line_chunks``
gives for plain files, so one JSONL reader serves both; memory stays at a few chunks whatever the
file's size. Offsets are positions in the *decompressed* stream: a compressed file cannot be
seeked into, so the runtime decodes it once instead (``runtime.data.token_jsonl``).

A truncated or corrupt stream is a ValueError naming the file; a zstd file may hold several
frames (``pzstd``, concatenated shards) and a gzip file several members, as their tools write.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["COMPRESSIONS", "compression_of", "iter_decompressed", "iter_decompressed_lines",
           "strip_compression"]

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
"""Compressed-file suffixes and the codec each means."""
READ_BYTES = 1 << 20
"""Compressed bytes read per call."""


def compression_of(path: str | os.PathLike[str]) -> str | None:
    """The codec of ``path`` by its last suffix (``gzip``, ``zstd``), or None."""
    return COMPRESSIONS.get(Path(path).suffix.lower())


def strip_compression(path: str | os.PathLike[str]) -> str:
    """``path`` without a compression suffix (``a.jsonl.zst`` -> ``a.jsonl``)."""
    p = os.fspath(path)
    suffix = Path(p).suffix
    return p[: -len(suffix)] if suffix.lower() in COMPRESSIONS else p


def _zstd_blocks(path: str) -> Iterator[bytes]:
    import zstandard

    with open(path, "rb") as f:
        dec = zstandard.ZstdDecompressor()
        obj = dec.decompressobj()
        fed = False  # bytes went into the current frame
        while True:
            data = f.read(READ_BYTES)
            if not data:
                break
            while data:
                out = obj.decompress(data)
                fed = True
                if out:
                    yield out
                if obj.eof:  # a frame ended: the rest may start another one
                    data = obj.unused_data
                    obj = dec.decompressobj()
                    fed = False
                else:
                    data = b""
        if fed and not obj.eof:
            raise ValueError(f"{path}: truncated zstd stream (the last frame does not end)")


def _gzip_blocks(path: str) -> Iterator[bytes]:
    with gzip.open(path, "rb") as f:
        while True:
            data = f.read(READ_BYTES)
            if not data:
                return
            yield data


def iter_decompressed(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """The decompressed bytes of ``path`` in blocks; ValueError on a corrupt or cut stream."""
    p = os.fspath(path)
    codec = compression_of(p)
    if codec is None:
        raise ValueError(f"{p}: not a compressed file ({', '.join(COMPRESSIONS)})")
    blocks = _zstd_blocks(p) if codec == "zstd" else _gzip_blocks(p)
    try:
        yield from blocks
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{p}: corrupt or truncated gzip stream ({e})") from None
    except ValueError:
        raise
    except Exception as e:  # zstandard.ZstdError derives from Exception only
        if type(e).__name__ == "ZstdError":
            raise ValueError(f"{p}: corrupt zstd stream ({e})") from None
        raise


def iter_decompressed_lines(path: str | os.PathLike[str],
                            chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(decompressed offset, chunk)`` pieces of about ``chunk_bytes`` ending in newlines.

    As ``formats.iter_line_chunks``: a final line without a newline gets one appended, so every
    line of every chunk is terminated.
    """
    pending = bytearray()
    offset = 0
    for block in iter_decompressed(path):
        pending += block
        if len(pending) < chunk_bytes:
            continue
        cut = pending.rfind(b"\n") + 1
        if cut == 0:
            continue  # one line longer than a chunk: keep reading until it ends
        yield offset, bytes(pending[:cut])
        offset += cut
        del pending[:cut]
    if pending:
        if not pending.endswith(b"\n"):
            pending += b"\n"
        yield offset, bytes(pending)
