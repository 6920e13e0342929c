"""The token counts of a text file, cached beside it and keyed by its content.

Tokenizing a corpus is the slow part of planning it (BENCHMARKS.md); re-planning (another
``--cp``, another capacity, another seed) must not pay it again. The counts of
``corpus.jsonl`` under one tokenizer and policy are kept in ``corpus.jsonl.<key>.dcplen``
(``<key>``: 12 hex digits of the tokenizer's sha256, its policies, the field and the
``tokenizers`` version), or, where the dataset's directory cannot be written, under
``$XDG_CACHE_HOME/dcp-planner/lengths/`` (default ``~/.cache``).

A cache is used only when it was made from the same bytes: it records the sha256 of the file's
content (the compressed bytes of a ``.zst``), which is recomputed every time (about 1 GB/s,
far below tokenizing's cost). Not the size and mtime: a file copied, touched or restored keeps
its cache, and one edited in place, even keeping its size and mtime, never uses a stale one.
Files are written atomically (a temporary and a rename) and carry a sha256 of their arrays, so
a cut or flipped cache is rebuilt, never read. A cache that cannot be written costs only the
next run's time: planning goes on without it.

Format: ``b"DCPLEN1\\n"``, one JSON line (``key``, ``content_sha256``, ``num_samples``,
``num_skipped``, ``digest``), then the lengths and the skipped indices as int64 little-endian.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from planner.sources.compressed import READ_BYTES
from planner.sources.formats import BadRecords

if TYPE_CHECKING:
    from planner.sources.textenc import TextEncoder

__all__ = ["CACHE_SUFFIX", "cache_key", "cached_counts", "content_sha256", "text_file_lengths"]

CACHE_SUFFIX = ".dcplen"
MAGIC = b"DCPLEN1\n"
VERSION = 1

Counts = tuple[NDArray[np.int64], NDArray[np.int64]]
"""(lengths, skipped sample indices) of one file."""


def content_sha256(path: str) -> str:
    """sha256 of the file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(READ_BYTES * 8):
            h.update(block)
    return h.hexdigest()


def cache_key(tokenizer: dict[str, object], field: str) -> dict[str, object]:
    """What besides the content decides the counts: the tokenizer's bytes and policies, the
    field, and the ``tokenizers`` version (a new release may split text differently)."""
    from importlib import metadata

    try:
        version = metadata.version("tokenizers")
    except metadata.PackageNotFoundError:  # pragma: no cover - textenc needs it installed
        version = ""
    policy = {k: tokenizer.get(k) for k in ("sha256", "bos", "append_eod", "bos_id", "eod_id")}
    return {"version": VERSION, "tokenizer": policy, "field": field, "tokenizers": version}


def _digest(*arrays: NDArray[np.int64]) -> str:
    h = hashlib.sha256(b"dcplen-v1\0")
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype="<i8").data)
    return h.hexdigest()


def _places(path: str, key: dict[str, object], content: str) -> list[Path]:
    """Where the cache may be: beside the file, then the user's cache directory."""
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    p = Path(path)
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [p.with_name(f"{p.name}.{tag}{CACHE_SUFFIX}"),
            Path(home) / "dcp-planner" / "lengths" / f"{content[:24]}.{tag}{CACHE_SUFFIX}"]


def _load(place: Path, key: dict[str, object], content: str) -> Counts | None:
    try:
        with open(place, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            head = json.loads(f.readline())
            if head.get("key") != key or head.get("content_sha256") != content:
                return None
            n, k = int(head["num_samples"]), int(head["num_skipped"])
            lengths = np.fromfile(f, dtype="<i8", count=n).astype(np.int64)
            skipped = np.fromfile(f, dtype="<i8", count=k).astype(np.int64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(lengths) != n or len(skipped) != k or head.get("digest") != _digest(lengths, skipped):
        return None
    return lengths, skipped


def _store(place: Path, key: dict[str, object], content: str, counts: Counts) -> bool:
    from planner.fileguard import atomic_output

    lengths, skipped = counts
    head = {"key": key, "content_sha256": content, "num_samples": len(lengths),
            "num_skipped": len(skipped), "digest": _digest(lengths, skipped)}
    try:
        with atomic_output(place, kind="lengths-cache") as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + json.dumps(head, sort_keys=True).encode() + b"\n")
            f.write(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
            f.write(np.ascontiguousarray(skipped, dtype="<i8").tobytes())
    except (OSError, ValueError):
        return False
    return True


def cached_counts(path: str, key: dict[str, object], compute: Callable[[], Counts], *,
                  use_cache: bool = True) -> tuple[Counts, str]:
    """The counts of ``path`` from a valid cache, else ``compute()`` (then cached).

    Returns:
        (counts, where): ``where`` is the cache file read, or ``""`` when computed.
    """
    if not use_cache:
        return compute(), ""
    content = content_sha256(path)
    places = _places(path, key, content)
    for place in places:
        got = _load(place, key, content)
        if got is not None:
            return got, str(place)
    counts = compute()
    for place in places:
        if _store(place, key, content, counts):
            break
    return counts, ""


def text_file_lengths(path: str, fmt: str, field: str, encoder: TextEncoder, bad: BadRecords, *,
                      use_cache: bool = True, progress: Callable[[int], None] | None = None
                      ) -> tuple[NDArray[np.int64], str]:
    """(token counts of one text file, the cache read or ""): ``count_lengths``, cached.

    A cache made with ``skip_bad_records`` that skipped records is not used without it: the
    file is read again, so the first bad record is named as it would be.
    """
    from planner.sources.text import count_lengths

    def compute() -> Counts:
        mine = BadRecords(skip=bad.skip)
        lengths = count_lengths(path, fmt, field, encoder, mine, progress)
        return lengths, mine.indices()

    key = cache_key(encoder.spec.to_dict(), field)
    (lengths, skipped), where = cached_counts(path, key, compute, use_cache=use_cache)
    if where and len(skipped) and not bad.skip:
        (lengths, skipped), where = cached_counts(path, key, compute, use_cache=False)
    if len(skipped):
        bad.add_rows(skipped, lambda i: ("", ""))
    return lengths, where
