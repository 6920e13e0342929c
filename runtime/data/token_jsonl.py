"""JSONL token source: a cached byte-offset index of the records, one line decoded per read.

The index comes from ``planner.sources.lengths.jsonl_index`` (the same definition of a record as the
planner's lengths). It is cached as ``<file>.dcpidx`` (npz) beside the file, or in ``cache_dir``
when that directory is not writable, keyed by the file's identity and the index options, and
rebuilt when stale. The identity is the device, inode, size, mtime_ns and ctime_ns: ``cp -p``
over the file (same inode and mtime), ``mv`` of another file onto it (another inode) and
``touch -r`` (mtime put back) all change it, since no user can set a ctime. A read checks the
record's token count against the index besides, so an index that still went stale (a file
system without ctimes) is refused as a changed file, never read as a prefix of other records.
The cache is written to a temporary name and renamed, so concurrent ranks never see half a
cache (they may each build it once; the last rename wins, with identical content).
A read decodes only its record's line with ``json.loads``: the slowest source (whole line per
read, even for a short segment of a long sample).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import tempfile
import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from planner.sources.compressed import compression_of, iter_decompressed
from planner.sources.jsonl import record_tokens, token_fields
from planner.sources.lengths import jsonl_index
from runtime.data.token_files import ArrayTokens, check_read

INDEX_SUFFIX = ".dcpidx"
INDEX_VERSION = 2
"""2: the arrays carry a sha256 (``digest``): npz members are read without their zip CRC, so a
flipped byte would otherwise seek to the wrong record."""


def _digest(*arrays: NDArray[np.int64]) -> str:
    h = hashlib.sha256(b"dcpidx-v2\0")
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype="<i8").data)
    return h.hexdigest()


def _record_tokens(raw: bytes, field: str | None) -> list[int]:
    """The token list of one JSONL record line (``planner.sources.jsonl.record_tokens``: the
    first of ``field`` or TOKEN_FIELDS that holds a list)."""
    return record_tokens(raw, token_fields(field))


class JsonlTokens:
    """One JSON record per line; sample i is the i-th record ``planner.sources.lengths`` counts."""

    def __init__(self, path: str | os.PathLike[str],
                 cache_dir: str | os.PathLike[str] | None = None, *, field: str | None = None,
                 skip_bad_records: bool = False) -> None:
        self.path = Path(path)
        self.field = field
        self.skip_bad_records = skip_bad_records
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        st = os.stat(self.path)
        self._stat = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        self._key = json.dumps({"version": INDEX_VERSION, "size": st.st_size,
                                "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                                "dev": st.st_dev, "ino": st.st_ino, "field": field,
                                "skip_bad_records": skip_bad_records}, sort_keys=True)
        self.index_built = False
        """True when this instance had to build the index (no valid cache was found)."""
        self.index_path: Path | None = None
        """Where the index cache was found or written (None: kept in memory only)."""
        loaded = self._load_cache()
        if loaded is None:
            offsets, nbytes, counts = jsonl_index(self.path, skip_bad_records=skip_bad_records,
                                                  field=field)
            loaded = (np.asarray(offsets, np.int64), np.asarray(nbytes, np.int64),
                      np.asarray(counts, np.int64))
            self.index_built = True
            self._write_cache(*loaded)
        self._offsets, self._nbytes, self._lengths = loaded
        self._fd_key = -1
        _FILES.open(self)  # the file as indexed, or a ValueError naming it

    def _candidates(self) -> list[Path]:
        beside = self.path.with_name(self.path.name + INDEX_SUFFIX)
        if self.cache_dir is None:
            return [beside]
        # One cache directory may serve datasets of the same name in different directories.
        tag = hashlib.sha1(str(self.path.resolve()).encode()).hexdigest()[:16]
        return [beside, self.cache_dir / f"{self.path.name}.{tag}{INDEX_SUFFIX}"]

    def _load_cache(self) -> tuple[NDArray[np.int64], ...] | None:
        for p in self._candidates():
            if not p.is_file():
                continue
            try:
                with np.load(p, allow_pickle=False) as z:
                    if str(z["key"]) != self._key:
                        continue  # stale (the file changed) or built with other options
                    arrays = tuple(np.asarray(z[k]) for k in ("offsets", "nbytes", "lengths"))
                    digest = str(z["digest"])
            except Exception:  # noqa: BLE001 - a damaged npz raises BadZipFile, EOFError, ...
                # A cache is never worth a failed run: rebuild it (and overwrite the bad one).
                continue
            n = len(arrays[0])
            if any(a.dtype != np.int64 or a.ndim != 1 or len(a) != n for a in arrays) or \
                    digest != _digest(*arrays):
                continue  # damaged inside a valid zip: rebuild
            self.index_path = p
            return arrays
        return None

    def _write_cache(self, offsets: NDArray[np.int64], nbytes: NDArray[np.int64],
                     lengths: NDArray[np.int64]) -> None:
        for p in self._candidates():
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
            except OSError:
                continue  # directory not writable: next candidate
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, key=np.array(self._key),
                             digest=np.array(_digest(offsets, nbytes, lengths)),
                             offsets=offsets, nbytes=nbytes,
                             lengths=lengths)
                os.replace(tmp, p)
            except OSError:
                # A full disk or a quota: a cache is never worth the run (next candidate). The
                # temporary goes; its removal's own failure never replaces the reason.
                with contextlib.suppress(OSError):
                    Path(tmp).unlink()
                continue
            except BaseException:
                with contextlib.suppress(OSError):
                    Path(tmp).unlink()
                raise
            self.index_path = p
            return
        warnings.warn(f"{self.path}: cannot write the index cache beside the file and no "
                      "writable cache_dir was given; the index lives in memory only", stacklevel=3)

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def lengths(self) -> NDArray[np.int64]:
        return self._lengths

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        check_read(str(self.path), self._lengths, sample_index, offset, length)
        line = _FILES.pread(self, int(self._nbytes[sample_index]),
                            int(self._offsets[sample_index]))
        try:
            toks = _record_tokens(line, self.field)
        except ValueError as e:
            if self._changed():
                raise ValueError(self._changed()) from None
            raise ValueError(f"{self.path}: record of sample {sample_index} "
                             f"({self._where(sample_index)}) does not decode: {e}") from None
        want = int(self._lengths[sample_index])
        if len(toks) != want and not (want == 0 and self.skip_bad_records):
            raise ValueError(self._changed() or (
                f"{self.path}: record of sample {sample_index} ({self._where(sample_index)}) "
                f"holds {len(toks)} tokens, its index says {want}: the file changed since it "
                "was indexed; this is not the dataset the plan was made for"))
        try:
            return np.asarray(toks[offset:offset + length], dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path}: record of sample {sample_index} "
                             f"({self._where(sample_index)}) holds a token that is not an int64 "
                             f"token id ({e})") from None

    def _changed(self) -> str:
        """A message naming the file if it is no longer the one indexed (replaced, edited,
        truncated), else ''."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"{self.path}: gone since it was opened ({e.strerror})"
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != self._stat:
            return (f"{self.path}: the file changed while it was read (replaced or edited); "
                    "this is not the dataset the plan was made for")
        return ""

    def _where(self, sample_index: int) -> str:
        """``line L, byte B`` of a sample's record; counts the newlines before it, so it is
        only for error messages (the index keeps byte offsets, not line numbers)."""
        offset = int(self._offsets[sample_index])
        newlines = pos = 0
        with open(self.path, "rb") as f:
            while pos < offset:
                chunk = f.read(min(1 << 24, offset - pos))
                if not chunk:
                    break
                newlines += chunk.count(b"\n")
                pos += len(chunk)
        return f"line {newlines + 1}, byte {offset}"

    def close(self) -> None:
        _FILES.close(self)


class _OpenFiles:
    """The descriptors of open ``JsonlTokens``, at most ``limit`` at a time in the process
    (least recently read closed first, reopened on the next read): a dataset of 1,100 shards
    trains under ``ulimit -n 1024``. A reopened file must be the one indexed (device, inode,
    size, mtime, ctime), else the read is refused as a changed file; a failed open names the
    file and the cause."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._fds: OrderedDict[int, int] = OrderedDict()  # source's key -> descriptor
        self._lock = threading.Lock()
        self._keys = itertools.count()

    def _fd(self, source: JsonlTokens) -> int:
        key = source._fd_key
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        while len(self._fds) >= min(self.limit, _quarter_of_nofile()):
            os.close(self._fds.popitem(last=False)[1])
        try:
            fd = os.open(source.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            hint = (" (too many open files: raise ulimit -n)" if e.errno == errno.EMFILE
                    else "")
            raise ValueError(f"{source.path}: cannot open: {e.strerror}{hint}") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != source._stat:
            os.close(fd)
            raise ValueError(f"{source.path}: the file changed since it was indexed (replaced "
                             "or edited); this is not the dataset the plan was made for")
        self._fds[key] = fd
        return fd

    def open(self, source: JsonlTokens) -> None:
        with self._lock:
            source._fd_key = next(self._keys)  # never reused (an id() would be, after GC)
            self._fd(source)

    def pread(self, source: JsonlTokens, size: int, offset: int) -> bytes:
        with self._lock:  # an eviction never closes a descriptor another thread reads
            return os.pread(self._fd(source), size, offset)

    def close(self, source: JsonlTokens) -> None:
        with self._lock:
            fd = self._fds.pop(source._fd_key, None)
            if fd is not None:
                os.close(fd)


def _quarter_of_nofile() -> int:
    """A quarter of this process's open-files limit (``ulimit -n``), at least 4: the rest is
    for torch, the process group, the plan and the other sources."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return OPEN_FILES_LIMIT
    return OPEN_FILES_LIMIT if soft == resource.RLIM_INFINITY else max(4, soft // 4)


OPEN_FILES_LIMIT = 64
"""How many JSONL files the runtime holds open at once at most (``_OpenFiles``; fewer under a
small ``ulimit -n``)."""
_FILES = _OpenFiles(OPEN_FILES_LIMIT)


def decode_compressed_jsonl(path: str | os.PathLike[str], *, field: str | None = None,
                            skip_bad_records: bool = False) -> ArrayTokens:
    """Every record's tokens of a ``.jsonl.gz``/``.jsonl.zst`` file, decoded once into memory.

    A compressed stream cannot be seeked into, so the whole file is decompressed twice: once by
    ``planner.sources.jsonl`` for the index (the planner's definition of a record), then to cut
    the records out at those offsets. Memory: the file's tokens as int32 or int64. For
    corpora larger than memory, convert to Megatron .bin/.idx or Arrow first.
    """
    path = os.fspath(path)
    offsets, nbytes, counts = jsonl_index(path, skip_bad_records=skip_bad_records, field=field)
    values: list[NDArray[np.int64]] = []
    buf = bytearray()
    base = 0  # decompressed offset of buf[0]
    lines = 0  # newlines before buf[0], for error messages
    r = 0
    for block in iter_decompressed(path):
        buf += block
        while r < len(offsets) and offsets[r] + nbytes[r] <= base + len(buf):
            a = int(offsets[r]) - base
            line = bytes(buf[a:a + int(nbytes[r])])
            if counts[r] > 0:  # a skipped bad record holds no tokens (length 0)
                try:
                    toks = _record_tokens(line, field)
                except ValueError as e:
                    line_no = lines + buf.count(b"\n", 0, a) + 1
                    raise ValueError(f"{path}: record of sample {r} (line {line_no}) does not "
                                     f"decode: {e}") from None
                values.append(np.asarray(toks, dtype=np.int64))
            else:
                values.append(np.zeros(0, np.int64))
            r += 1
        # Keep only the bytes of records not yet cut out.
        keep = int(offsets[r]) - base if r < len(offsets) else len(buf)
        lines += buf.count(b"\n", 0, keep)
        del buf[:keep]
        base += keep
    if r != len(offsets):
        raise ValueError(f"{path}: the stream ended before record {r}")
    lens = np.array([len(v) for v in values], dtype=np.int64)
    flat = np.concatenate(values) if values else np.zeros(0, np.int64)
    if flat.size and flat.min() >= np.iinfo(np.int32).min and flat.max() <= np.iinfo(np.int32).max:
        flat = flat.astype(np.int32)
    return ArrayTokens(flat, np.r_[0, np.cumsum(lens)], path=path)


def is_compressed(path: str | os.PathLike[str]) -> bool:
    """True for a ``.gz``/``.zst`` file (decoded into memory, not indexed)."""
    return compression_of(path) is not None
