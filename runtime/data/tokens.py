"""Token sources: random access to one sample's tokens, so a rank reads only the rows it needs.

A ``TokenSource`` maps a sample index (the dataset row, in file order, as in the plan) to its
token ids. The definition of a record comes from ``planner.sources.lengths`` (the index that also
gives the
planner its lengths), so the planner and the runtime always agree on what sample i is.

Formats:
- JSONL (``JsonlTokens``): a byte-offset index of the lines, built once by
  ``planner.sources.lengths.jsonl_index`` and cached as ``<file>.dcpidx`` (npz) beside the file, or
  in
  ``cache_dir`` when that directory is not writable. The cache is keyed by the file's size and
  mtime_ns (and the index options) and rebuilt when stale; it is written to a temporary name and
  renamed, so concurrent ranks never see half a cache. A read seeks to one line and decodes only
  that line.
- Arrow IPC file or stream / Parquet (``ArrowTokens``): a list-of-integers column. IPC is
  memory-mapped and a read slices one record batch in place (no copy of the table). Parquet has
  no random access below a row group: a read decodes the sample's row group and an LRU keeps
  decoded row groups up to ``cache_bytes``; a plan drawn at random over a dataset much larger
  than that decodes a row group per row, so prefer IPC or Megatron files for training.
- Megatron indexed dataset (``MegatronTokens``): ``np.memmap`` of the ``.bin`` file, pointers and
  dtype from the ``.idx``.
- ``ArrayTokens``: sequences already in memory (synthetic data, tests, benchmarks).

Trade-off: ``read`` is one Python call per segment, which costs microseconds; a microbatch of
hundreds of short rows would spend most of its time there, so the memory, Megatron and Arrow
sources also offer ``read_many`` (one vectorised gather for all rows; ``read_segments`` picks it).
JSONL decodes every needed line with ``json.loads``: the slowest source by far.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from runtime.data.token_files import ArrayTokens, ArrowTokens, MegatronTokens
from runtime.data.token_jsonl import JsonlTokens

__all__ = [
    "ArrayTokens",
    "ArrowTokens",
    "BatchedTokenSource",
    "JsonlTokens",
    "MegatronTokens",
    "TokenSource",
    "open_token_source",
    "read_segments",
]


@runtime_checkable
class TokenSource(Protocol):
    """Random access to the tokens of a dataset's samples (rows in file order)."""

    @property
    def num_samples(self) -> int: ...

    def lengths(self) -> NDArray[np.int64]:
        """Tokens per sample, in file order (cached; cheap to call again)."""
        ...

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        """Tokens ``[offset, offset + length)`` of sample ``sample_index`` as int64."""
        ...


@runtime_checkable
class BatchedTokenSource(TokenSource, Protocol):
    """A source that also reads many segments in one vectorised call."""

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        """The segments' tokens concatenated in the order given."""
        ...


def read_segments(source: TokenSource, sample_index: NDArray[np.int64],
                  offset: NDArray[np.int64], length: NDArray[np.int64]) -> NDArray[np.int64]:
    """Tokens of many segments, concatenated in the order given (one call for batched sources).

    Per-row ``read`` calls cost microseconds each, which dominates a microbatch of hundreds of
    short rows; batched sources gather all rows with one fancy index instead.
    """
    # getattr, not isinstance: a runtime Protocol check costs tens of microseconds per call.
    read_many = getattr(source, "read_many", None)
    if read_many is not None:
        got: NDArray[np.int64] = read_many(sample_index, offset, length)
        return got
    pieces: list[NDArray[np.int64]] = [np.zeros(0, np.int64)] * len(sample_index)
    # Read in sample order: neighbours in the file share pages and cache lines.
    for j in np.argsort(sample_index, kind="stable"):
        s, off, n = int(sample_index[j]), int(offset[j]), int(length[j])
        got = source.read(s, off, n)
        if got.shape != (n,):
            raise ValueError(f"token source returned {got.shape[0]} tokens for sample {s} "
                             f"[{off}, {off + n}), expected {n}")
        pieces[j] = got
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def open_token_source(path: str | os.PathLike[str], **kwargs: object) -> TokenSource:
    """Open ``path`` by extension: .jsonl/.json, .arrow/.feather/.ipc, .parquet/.pq, or a
    Megatron ``.bin``/``.idx`` (either file, or the prefix without suffix)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return JsonlTokens(p, **kwargs)  # type: ignore[arg-type]
    if suffix in (".arrow", ".feather", ".ipc", ".parquet", ".pq"):
        return ArrowTokens(p, **kwargs)  # type: ignore[arg-type]
    if suffix in (".bin", ".idx"):
        return MegatronTokens(p.with_suffix(""))
    if Path(str(p) + ".idx").is_file():
        return MegatronTokens(p)
    raise ValueError(f"{p}: unknown dataset format (expected .jsonl, .arrow, .parquet or a "
                     "Megatron .bin/.idx prefix)")
