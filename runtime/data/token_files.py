"""Token sources over files and memory: one reader per format (see ``runtime.data.tokens``).

Each class implements ``runtime.data.tokens.TokenSource`` (and ``read_many`` for one vectorised
gather per microbatch): ``ArrayTokens`` (in memory), ``MegatronTokens`` (``np.memmap`` of
``.bin``; documents or sequences, pointers and dtype from the ``.idx`` via
``planner.sources.megatron``) and ``ArrowTokens`` (Arrow IPC file or stream, memory-mapped;
Parquet by row group with an LRU of decoded row groups). A bad record (null row, null token,
length <= 0) has length 0 as ``planner.sources.lengths`` counts it when skipping, so the dataset
fingerprint matches the plan's and a plan never asks for it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from numpy.typing import NDArray

from planner.sources.formats import ARROW_ERRORS, DEFAULT_FIELDS, LIST_FIELDS, MAX_LENGTH
from planner.sources.megatron import DEFAULT_UNIT, read_megatron_samples
from runtime.data.shard import ranges_to_indices

TOKEN_FIELDS = tuple(f for f in DEFAULT_FIELDS if f in LIST_FIELDS)
"""Token-list fields tried in order when none is named (planner.sources.formats' precedence)."""


def check_many(name: str, lengths: NDArray[np.int64], sample: NDArray[np.int64],
               offset: NDArray[np.int64], length: NDArray[np.int64]) -> None:
    """Raise ValueError naming the first segment outside its sample (vectorised check)."""
    bad = (sample < 0) | (sample >= len(lengths))
    if bad.any():
        s = int(sample[np.argmax(bad)])
        raise ValueError(f"{name}: sample {s} out of range 0..{len(lengths) - 1}")
    bad = (offset < 0) | (length < 0) | (offset + length > lengths[sample])
    if bad.any():
        j = int(np.argmax(bad))
        check_read(name, lengths, int(sample[j]), int(offset[j]), int(length[j]))


def gather(values: NDArray[np.integer], starts: NDArray[np.int64],
           length: NDArray[np.int64]) -> NDArray[np.int64]:
    """``values[starts[j]:starts[j] + length[j]]`` for all j, concatenated, as int64."""
    if len(starts) == 1:  # one slice: a plain copy beats a fancy index
        a = int(starts[0])
        return np.asarray(values[a:a + int(length[0])], dtype=np.int64)
    return np.asarray(values[ranges_to_indices(starts, length)], dtype=np.int64)


def check_read(name: str, lengths: NDArray[np.int64], sample: int, offset: int,
               length: int) -> None:
    """Raise ValueError naming the sample unless the segment lies inside it."""
    if not 0 <= sample < len(lengths):
        raise ValueError(f"{name}: sample {sample} out of range 0..{len(lengths) - 1}")
    if offset < 0 or length < 0 or offset + length > lengths[sample]:
        raise ValueError(f"{name}: sample {sample} has {int(lengths[sample])} tokens, asked for "
                         f"[{offset}, {offset + length})")


class ArrayTokens:
    """Samples held in memory as one flat array of values and offsets (``offsets[-1] == len``)."""

    def __init__(self, values: NDArray[np.integer], offsets: NDArray[np.integer], *,
                 path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else Path(path)
        """The file the samples were decoded from (a compressed JSONL), for messages."""
        self._values = np.asarray(values)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lengths = np.diff(self._offsets)
        if self._offsets[0] != 0 or self._offsets[-1] != len(self._values) or np.any(
                self._lengths < 0):
            raise ValueError("offsets must start at 0, not decrease and end at len(values)")

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int] | NDArray[np.integer]]) -> ArrayTokens:
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        values = np.concatenate([np.asarray(s, np.int64) for s in seqs]) if seqs else np.zeros(0)
        return cls(values.astype(np.int64), np.r_[0, np.cumsum(lens)])

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def lengths(self) -> NDArray[np.int64]:
        return self._lengths

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        check_read("memory", self._lengths, sample_index, offset, length)
        a = int(self._offsets[sample_index]) + offset
        return self._values[a:a + length].astype(np.int64)

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        check_many("memory", self._lengths, sample_index, offset, length)
        return gather(self._values, self._offsets[sample_index] + offset, length)


class MegatronTokens:
    """A Megatron ``.bin``/``.idx`` pair, memory-mapped; ``prefix`` is the path without suffix.

    A sample is a ``unit`` (``planner.sources.megatron``): a document, whose tokens are its
    sequences' concatenated (they lie back to back in ``.bin``, so a document is one slice), or
    one sequence. A plan's unit is its header's (``open_plan_source`` passes it).
    """

    def __init__(self, prefix: str | os.PathLike[str], unit: str = DEFAULT_UNIT) -> None:
        self.prefix = str(prefix)
        self.unit = unit
        samples = read_megatron_samples(self.prefix, unit)
        # A sample of length <= 0 is a bad record; planner.sources.lengths counts it as 0 (and
        # one past the int32 a plan holds too: no plan can ask for it).
        lengths = np.asarray(samples.lengths, dtype=np.int64)
        self._lengths = np.where((lengths > 0) & (lengths <= MAX_LENGTH), lengths, 0)
        self._dtype = np.dtype(samples.dtype)
        # Element offsets into the memmapped .bin.
        self._starts = np.asarray(samples.starts, dtype=np.int64)
        path = self.prefix + ".bin"
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise ValueError(f"{path}: cannot open the Megatron token file ({e.strerror})"
                             ) from None
        # The index addresses every sequence's tokens: a .bin truncated or replaced after
        # planning fails here, naming the file, not as an IndexError inside a training step.
        ends = self._starts + self._lengths
        need = int(ends.max()) * self._dtype.itemsize if len(ends) else 0
        if size < need:
            last = int(np.argmax(ends * self._dtype.itemsize > size))
            raise ValueError(f"{path}: holds {size} bytes, its index addresses {need} ({unit} "
                             f"{last} and later lie past the end: truncated?)")
        usable = size // self._dtype.itemsize
        self._bin = (np.memmap(path, dtype=self._dtype, mode="r", shape=(usable,)) if usable
                     else np.zeros(0, self._dtype))

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def lengths(self) -> NDArray[np.int64]:
        return self._lengths

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        check_read(self.prefix, self._lengths, sample_index, offset, length)
        a = int(self._starts[sample_index]) + offset
        return np.asarray(self._bin[a:a + length], dtype=np.int64)

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        check_many(self.prefix, self._lengths, sample_index, offset, length)
        return gather(self._bin, self._starts[sample_index] + offset, length)


def _is_int_list(t: pa.DataType) -> bool:
    """A list of integers of any Arrow list layout the planner reads (list, large_list,
    fixed_size_list, list_view, large_list_view)."""
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                 or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
                and pa.types.is_integer(t.value_type))


def _as_offsets_list(arr: pa.Array) -> pa.Array:
    """``arr`` as a list array with offsets: a fixed_size_list or list_view (which have none)
    rebuilt from its row lengths and flattened values (a null row stays null)."""
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        return arr
    n = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = pa.array(np.r_[0, np.cumsum(n)], pa.int64())
    return pa.LargeListArray.from_arrays(offsets, pc.list_flatten(arr),
                                         mask=arr.is_null() if arr.null_count else None)


class ArrowTokens:
    """A list-of-integers column of an Arrow IPC file or stream (``.arrow``, ``.feather``,
    ``.ipc``) or of a Parquet file (``.parquet``, ``.pq``).

    ``column`` defaults to ``input_ids``, then ``tokens``, then the only list-of-integers column;
    with several others, name one. ``cache_bytes`` bounds the decoded Parquet row groups kept.
    """

    def __init__(self, path: str | os.PathLike[str], column: str | None = None, *,
                 cache_bytes: int = 256 << 20) -> None:
        self.path = Path(path)
        self._parquet = self.path.suffix.lower() in (".parquet", ".pq")
        try:
            self._open(column)
        except ARROW_ERRORS as e:
            raise ValueError(f"{self.path}: unreadable ({e})") from None
        self._cache_bytes = cache_bytes if self._parquet else 1 << 62
        self._cached = 0
        self._lengths: NDArray[np.int64] | None = None

    def _open(self, column: str | None) -> None:
        if self._parquet:
            self._pq = pq.ParquetFile(str(self.path), memory_map=True)
            schema = self._pq.schema_arrow
            counts = [self._pq.metadata.row_group(i).num_rows
                      for i in range(self._pq.num_row_groups)]
        else:
            source = pa.memory_map(str(self.path), "r")
            try:
                reader = ipc.open_file(source)
                self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            except ARROW_ERRORS:
                # The stream format has no footer to seek by; its batches still point into the
                # memory map, so holding them all costs no copy.
                source.seek(0)
                try:
                    reader = ipc.open_stream(source)
                except ARROW_ERRORS as e:
                    raise ValueError(f"{self.path}: not an Arrow IPC file or stream ({e})"
                                     ) from None
                self._batches = list(reader)
            schema = reader.schema
            counts = [b.num_rows for b in self._batches]
        candidates = [f.name for f in schema if _is_int_list(f.type)]
        if column is None:
            named = [c for c in TOKEN_FIELDS if c in candidates]
            if not named and len(candidates) != 1:
                raise ValueError(f"{self.path}: name the token column (list-of-integer columns: "
                                 f"{candidates or 'none'})")
            column = named[0] if named else candidates[0]
        elif column not in candidates:
            raise ValueError(f"{self.path}: column {column!r} is not a list-of-integers column "
                             f"(candidates: {candidates or 'none'})")
        self.column = column
        self._chunk_starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
        self._cache: OrderedDict[int, tuple[NDArray[np.int64], NDArray[np.int64],
                                            NDArray[np.integer]]] = OrderedDict()
        # IPC chunks are views of the memory map: keep them all. Decoded Parquet row groups are
        # copies: keep the most recently used ones up to ``cache_bytes`` (set by __init__).

    def _chunk(self, i: int) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.integer]]:
        """(offsets, lengths, values) of chunk i (record batch or row group) as numpy arrays.

        A null row, or a row holding a null token, is a bad record: length 0, as
        ``planner.sources.lengths`` counts it when skipping bad records (a plan never places it).
        """
        hit = self._cache.get(i)
        if hit is not None:
            self._cache.move_to_end(i)
            return hit
        if self._parquet:
            try:
                arr = self._pq.read_row_group(i, columns=[self.column]).column(0).combine_chunks()
            except ARROW_ERRORS as e:  # a corrupt page: "Corrupt snappy compressed data."
                raise ValueError(f"{self.path}: row group {i} is unreadable ({e})") from None
        else:
            arr = self._batches[i].column(self.column)
        arr = _as_offsets_list(arr)
        # ``offsets`` honours the array's slice offset and indexes into ``values``; both are
        # zero-copy views of the memory map for IPC when there are no nulls.
        offsets = arr.offsets.to_numpy().astype(np.int64, copy=False)
        lengths = np.diff(offsets)
        values = arr.values
        if arr.null_count:
            lengths[np.asarray(arr.is_null(), dtype=bool)] = 0
        if values.null_count:
            bad = np.searchsorted(offsets, np.flatnonzero(np.asarray(values.is_null())), "right")
            lengths[bad - 1] = 0
            values = values.fill_null(0)
        entry = (offsets, lengths, values.to_numpy())
        if entry[2].dtype == np.uint64 and len(entry[2]):
            top = np.flatnonzero(entry[2] > np.iinfo(np.int64).max)
            if len(top):  # cast to int64 it would read as a negative id
                row = int(np.searchsorted(offsets, top[0], "right")) - 1
                raise ValueError(f"{self.path}: sample {int(self._chunk_starts[i]) + row} holds "
                                 f"token id {int(entry[2][top[0]])}, past the int64 range of "
                                 "token ids")
        self._cache[i] = entry
        self._cached += entry[2].nbytes
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            self._cached -= self._cache.popitem(last=False)[1][2].nbytes
        return entry

    @property
    def num_samples(self) -> int:
        return int(self._chunk_starts[-1])

    def lengths(self) -> NDArray[np.int64]:
        if self._lengths is None:
            n = len(self._chunk_starts) - 1
            parts = [self._chunk(i)[1] for i in range(n)]
            self._lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return self._lengths

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        if not 0 <= sample_index < self.num_samples:
            raise ValueError(f"{self.path}: sample {sample_index} out of range "
                             f"0..{self.num_samples - 1}")
        c = int(np.searchsorted(self._chunk_starts, sample_index, "right")) - 1
        offsets, lengths, values = self._chunk(c)
        row = sample_index - int(self._chunk_starts[c])
        a, n = int(offsets[row]), int(lengths[row])
        if offset < 0 or length < 0 or offset + length > n:
            raise ValueError(f"{self.path}: sample {sample_index} has {n} tokens, asked for "
                             f"[{offset}, {offset + length})")
        return values[a + offset:a + offset + length].astype(np.int64)

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        bad = (sample_index < 0) | (sample_index >= self.num_samples)
        if bad.any():
            self.read(int(sample_index[np.argmax(bad)]), 0, 0)  # raises, naming the sample
        chunk = np.searchsorted(self._chunk_starts, sample_index, "right") - 1
        out = np.empty(int(length.sum()), dtype=np.int64)
        out_start = np.cumsum(length) - length
        for c in np.unique(chunk):  # ascending: Parquet row groups decode in file order
            sel = np.flatnonzero(chunk == c)
            offsets, lengths, values = self._chunk(int(c))
            row = sample_index[sel] - self._chunk_starts[c]
            bad = (offset[sel] < 0) | (length[sel] < 0) | (offset[sel] + length[sel] > lengths[row])
            if bad.any():
                j = int(sel[np.argmax(bad)])
                self.read(int(sample_index[j]), int(offset[j]), int(length[j]))  # raises
            src = ranges_to_indices(offsets[row] + offset[sel], length[sel])
            out[ranges_to_indices(out_start[sel], length[sel])] = values[src]
        return out
