"""Token sources: random access to one sample's tokens, so a rank reads only the rows it needs.

A ``TokenSource`` maps a sample index (the dataset row, in file order, as in the plan) to its
token ids. The definition of a record comes from ``planner.sources.lengths`` (the index that also
gives the
planner its lengths), so the planner and the runtime always agree on what sample i is.

Formats:
- JSONL (``JsonlTokens``): a byte-offset index of the lines, built once by
  ``planner.sources.lengths.jsonl_index`` and cached as ``<file>.dcpidx`` (npz) beside the file, or
  in
  ``cache_dir`` when that directory is not writable. The cache is keyed by the file's device,
  inode, size, mtime_ns and ctime_ns (and the index options) and rebuilt when stale; it is
  written to a temporary name and renamed, so concurrent ranks never see half a cache. A read
  seeks to one line and decodes only that line.
- Arrow IPC file or stream / Parquet (``ArrowTokens``): a list-of-integers column. IPC is
  memory-mapped and a read slices one record batch in place (no copy of the table). Parquet has
  no random access below a row group: a read decodes the sample's row group and an LRU keeps
  decoded row groups up to ``cache_bytes``; a plan drawn at random over a dataset much larger
  than that decodes a row group per row, so prefer IPC or Megatron files for training.
- Megatron indexed dataset (``MegatronTokens``): ``np.memmap`` of the ``.bin`` file, pointers and
  dtype from the ``.idx``; a sample is a document (its sequences, concatenated) or a sequence.
- ``ArrayTokens``: sequences already in memory (synthetic data, tests, benchmarks).
- Compressed JSONL (``.jsonl.gz``, ``.jsonl.zst``): decoded once into an ``ArrayTokens``
  (a stream cannot be seeked into).
- Several files, a directory or a glob (``ConcatTokens``): one source per file, in the order
  ``planner.sources.dataset`` defines (the planner's), sample indices running through the files.

Trade-off: ``read`` is one Python call per segment, which costs microseconds; a microbatch of
hundreds of short rows would spend most of its time there, so the memory, Megatron and Arrow
sources also offer ``read_many`` (one vectorised gather for all rows; ``read_segments`` picks it).
JSONL decodes every needed line with ``json.loads``: the slowest source by far.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from planner.sources.dataset import expand_paths
from planner.sources.lengths import DATASET_SUFFIXES
from planner.sources.megatron import DEFAULT_UNIT
from runtime.data.shard import ranges_to_indices
from runtime.data.token_files import ArrayTokens, ArrowTokens, MegatronTokens
from runtime.data.token_jsonl import JsonlTokens, decode_compressed_jsonl, is_compressed

__all__ = [
    "ArrayTokens",
    "ArrowTokens",
    "BatchedTokenSource",
    "ConcatTokens",
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


class ConcatTokens:
    """Several sources as one dataset: file j's samples follow file j-1's."""

    def __init__(self, sources: Sequence[TokenSource], names: Sequence[str]) -> None:
        self.sources = list(sources)
        self.names = list(names)
        counts = [s.num_samples for s in self.sources]
        self._starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
        parts = [np.asarray(s.lengths(), dtype=np.int64) for s in self.sources]
        self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    def lengths(self) -> NDArray[np.int64]:
        return self._lengths

    def _file(self, sample_index: NDArray[np.int64]) -> NDArray[np.int64]:
        bad = (sample_index < 0) | (sample_index >= self.num_samples)
        if bad.any():
            s = int(sample_index[np.argmax(bad)])
            raise ValueError(f"{', '.join(self.names)}: sample {s} out of range "
                             f"0..{self.num_samples - 1}")
        return np.searchsorted(self._starts, sample_index, "right") - 1

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        j = int(self._file(np.array([sample_index], np.int64))[0])
        return self.sources[j].read(sample_index - int(self._starts[j]), offset, length)

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        sample_index = np.asarray(sample_index, np.int64)
        offset, length = np.asarray(offset, np.int64), np.asarray(length, np.int64)
        files = self._file(sample_index)
        out = np.empty(int(length.sum()), dtype=np.int64)
        out_start = np.cumsum(length) - length
        for j in np.unique(files).tolist():
            sel = np.flatnonzero(files == j)
            got = read_segments(self.sources[j], sample_index[sel] - self._starts[j],
                                offset[sel], length[sel])
            out[ranges_to_indices(out_start[sel], length[sel])] = got
        return out

    def close(self) -> None:
        for s in self.sources:
            close = getattr(s, "close", None)
            if close is not None:
                close()


def _open_one(p: Path, *, skip_bad_records: bool = False, field: str | None = None,
              megatron_unit: str = DEFAULT_UNIT, **kwargs: object) -> TokenSource:
    suffix = p.suffix.lower()
    if not os.path.lexists(p) and not (suffix in (".bin", ".idx") and p.with_suffix(
            ".idx").is_file()) and not Path(f"{p}.idx").is_file():
        raise ValueError(f"{p}: no such file")
    if is_compressed(p):
        return decode_compressed_jsonl(p, skip_bad_records=skip_bad_records, field=field)
    if suffix in (".jsonl", ".json"):
        return JsonlTokens(p, skip_bad_records=skip_bad_records, field=field,
                           **kwargs)  # type: ignore[arg-type]
    if suffix in (".arrow", ".feather", ".ipc", ".parquet", ".pq"):
        return ArrowTokens(p, field, **kwargs)  # type: ignore[arg-type]
    # A Megatron .bin has no fields (the planner ignores --field for it too).
    if suffix in (".bin", ".idx"):
        return MegatronTokens(p.with_suffix(""), megatron_unit)
    if Path(str(p) + ".idx").is_file():
        return MegatronTokens(p, megatron_unit)
    raise ValueError(f"{p}: unknown dataset format (expected .jsonl (also .gz, .zst), .arrow, "
                     ".parquet or a Megatron .bin/.idx prefix)")


def open_token_source(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                      *, skip_bad_records: bool = False, field: str | None = None,
                      megatron_unit: str = DEFAULT_UNIT, **kwargs: object) -> TokenSource:
    """Open a dataset by extension: .jsonl/.json (also .gz/.zst), .arrow/.feather/.ipc,
    .parquet/.pq, or a Megatron ``.bin``/``.idx`` (either file, or the prefix without suffix);
    or several of these, a directory or a glob (in ``planner.sources.dataset``'s order) as one
    source.

    ``field`` names the JSONL record field or the Parquet/Arrow column holding the tokens, as
    ``dcp-plan --field`` did (default: ``input_ids``, then ``tokens``); Megatron files have no
    fields. ``runtime.data.plan_source.open_plan_source`` passes the plan's recorded field.

    ``megatron_unit`` is what a sample of a Megatron file is, ``document`` (as ``dcp-plan``
    plans by default) or ``sequence``; ``open_plan_source`` passes the plan's.

    ``skip_bad_records`` reads the dataset as ``dcp-plan --skip-bad-records`` did: a bad JSONL
    record becomes an empty sample instead of an error (the columnar and Megatron sources
    always give bad records length 0, as the planner counts them when skipping).
    """
    items = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [
        os.fspath(p) for p in path]
    files = [f for f, _ in expand_paths(items, DATASET_SUFFIXES)]
    if len(files) == 1 and len(items) == 1 and files[0] == items[0]:
        return _open_one(Path(files[0]), skip_bad_records=skip_bad_records, field=field,
                         megatron_unit=megatron_unit, **kwargs)
    sources: list[TokenSource] = []
    try:
        for f in files:
            sources.append(_open_one(Path(f), skip_bad_records=skip_bad_records, field=field,
                                     megatron_unit=megatron_unit, **kwargs))
    except BaseException:
        for s in sources:
            close = getattr(s, "close", None)
            if close is not None:
                close()
        raise
    return ConcatTokens(sources, files)
