"""Length readers for columnar files (Parquet, Arrow IPC), and what every reader shares.

Every reader returns one int64 length per sample in file order and reports bad records through
``BadRecords``, which raises on the first one (naming file and row) or, when skipping, records the
sample index and leaves its length at 0. Sample indices never shift: a skipped record keeps its
index, so a plan's ``sample_index`` is always the row of the source file. Megatron indexed
datasets have their own module, ``planner.sources.megatron``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.typing import NDArray

DEFAULT_FIELDS = ("input_ids", "tokens", "length", "num_tokens")
"""Fields tried in this order when no field is named."""
LIST_FIELDS = frozenset({"input_ids", "tokens"})
"""Fields that must hold token lists (length = number of tokens)."""
INT_FIELDS = frozenset({"length", "num_tokens"})
"""Fields that must hold an integer length."""
MAX_LENGTH = 2**31 - 1
"""The longest sample any plan can hold: a segment row's ``num_tokens`` and TE's ``cu_seqlens``
are int32. A longer record is a bad record (named, or skipped), refused before anything is
allocated per token or per segment."""
ARROW_ERRORS = (pa.ArrowException, OSError, EOFError)
"""What pyarrow raises for a damaged file: a corrupt page or a truncated stream is an OSError."""

CHUNK_BYTES = 1 << 24
"""Bytes per read in the line-oriented readers: bounds memory to a few chunks for any file size."""


def only_token_list_hint(names: list[str], what: str) -> str:
    """``; 'ids' is the only list-of-integers field: give --field ids`` when ``names`` (a
    record's fields or a file's columns that hold integer lists) has exactly one, else empty:
    for an error that found no usable field, the tokens are likely that one under another name.
    ``what`` is ``field`` (JSONL) or ``column`` (Parquet, Arrow)."""
    if len(names) != 1:
        return ""
    return f"; {names[0]!r} is the only list-of-integers {what}: give --field {names[0]}"


class BadRecords:
    """Raises on the first bad record, or collects the sample indices of bad records to skip."""

    __slots__ = ("_indices", "skip")

    def __init__(self, *, skip: bool) -> None:
        self.skip = skip
        self._indices: list[NDArray[np.int64]] = []

    def add(self, sample_index: int, location: str, problem: str) -> None:
        """Report one bad record at ``location`` (``file:line`` or ``file: row i``)."""
        if not self.skip:
            raise ValueError(f"{location}: {problem}")
        self._indices.append(np.array([sample_index], dtype=np.int64))

    def add_rows(self, indices: NDArray[np.int64],
                 describe: Callable[[int], tuple[str, str]]) -> None:
        """Report bad records; ``describe(i)`` gives the location and problem of record i."""
        if len(indices) == 0:
            return
        if not self.skip:
            raise ValueError("{}: {}".format(*describe(int(indices[0]))))
        self._indices.append(np.asarray(indices, dtype=np.int64))

    def indices(self) -> NDArray[np.int64]:
        """Sorted sample indices of the skipped records."""
        if not self._indices:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate(self._indices))


def iter_line_chunks(path: str) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(file offset, chunk)`` pieces of about CHUNK_BYTES that end with a newline.

    Chunks are zero-copy views of a read-only memory map (the page cache is the only copy). A
    final line without a newline comes as a copy with one appended, so every line of every chunk
    is terminated; offsets and line sizes computed from the chunks still describe the file.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        # Not closed explicitly: numpy arrays over a chunk keep the map alive until released.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    offset = 0
    while offset < size:
        cut = mm.rfind(b"\n", offset, min(offset + CHUNK_BYTES, size)) + 1
        if cut == 0:  # no newline in this window: one line longer than a chunk, or the last
            cut = mm.find(b"\n", offset) + 1
        if cut == 0:
            yield offset, memoryview(bytes(view[offset:]) + b"\n")
            return
        yield offset, view[offset:cut]
        offset = cut


# ---------------------------------------------------------------- Parquet and Arrow IPC


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _pick_columns(path: str, schema: pa.Schema, field: str | None) -> list[tuple[str, bool]]:
    """The length columns to read, in precedence order, each with ``is_list``.

    The first present candidate must have a usable type: a float or string column is a schema
    mistake, not a bad row, so it fails whatever the policy. A later candidate (used where the
    earlier ones are null) with another type -- say ``tokens`` holding token strings -- is not a
    length column and is left out, as a JSONL record ignores fields after the one it uses.
    """
    names = [field] if field is not None else [n for n in DEFAULT_FIELDS if n in schema.names]
    if not names and field is None:
        # docs/PLAN_FORMAT.md: input_ids, then tokens, then the only list-of-integers column
        # (the runtime's ArrowTokens and the content fingerprint take that one too).
        only = [f.name for f in schema if _is_list(f.type) and pa.types.is_integer(
            f.type.value_type)]
        names = only if len(only) == 1 else []
    if not names or names[0] not in schema.names:
        wanted = field if field is not None else ", ".join(DEFAULT_FIELDS)
        lists = [f.name for f in schema if _is_list(f.type) and pa.types.is_integer(
            f.type.value_type)]
        raise ValueError(f"{path}: no column {wanted}; columns are {schema.names}"
                         + only_token_list_hint(lists, "column"))
    picked = []
    for name in names:
        t = schema.field(name).type
        is_list = _is_list(t)
        ok = pa.types.is_integer(t.value_type) if is_list else pa.types.is_integer(t)
        if ok and not ((is_list and name in INT_FIELDS) or (not is_list and name in LIST_FIELDS)):
            picked.append((name, is_list))
        elif not picked:
            want = ("a list of integer token ids" if name in LIST_FIELDS else "integer lengths"
                    if name in INT_FIELDS else "token-id lists or integer lengths")
            raise ValueError(f"{path}: column {name!r} has type {t}; expected {want}")
    return picked


def _batch_lengths(path: str, batch: pa.RecordBatch, columns: list[tuple[str, bool]], row0: int,
                   bad: BadRecords) -> NDArray[np.int64]:
    """Lengths of one batch: per row, the first non-null column in precedence order."""
    import pyarrow.compute as pc  # only Parquet and Arrow inputs need it (60 ms to import)

    n = batch.num_rows
    out = np.zeros(n, dtype=np.int64)
    source = np.full(n, -1, dtype=np.int64)  # which column decided the row; -1: all null
    null_token = np.zeros(n, dtype=bool)
    for c, (name, is_list) in enumerate(columns):
        col = batch.column(name)
        values = pc.list_value_length(col) if is_list else pc.cast(col, pa.int64())
        take = (source < 0) & ~np.asarray(pc.is_null(values), dtype=bool)
        out[take] = np.asarray(values.fill_null(0), dtype=np.int64)[take]
        source[take] = c
        if is_list and (flat := pc.list_flatten(col)).null_count:
            parents = np.asarray(pc.list_parent_indices(col), dtype=np.int64)
            rows = parents[np.asarray(pc.is_null(flat), dtype=bool)]
            null_token[rows[source[rows] == c]] = True

    def describe(i: int) -> tuple[str, str]:
        where = f"{path}: row {row0 + i}"
        if source[i] < 0:
            if len(columns) == 1:
                return where, f"{columns[0][0]!r} is null"
            return where, "columns " + ", ".join(repr(n) for n, _ in columns) + " are all null"
        name, is_list = columns[source[i]]
        if null_token[i]:
            pos = batch.column(name)[i].as_py().index(None)
            return where, f"{name!r} holds a null token at position {pos}"
        if out[i] > MAX_LENGTH:
            return where, (f"{name!r} is {out[i]}, more than the {MAX_LENGTH} tokens a plan "
                           "holds per sample")
        if is_list:
            return where, f"{name!r} is empty"
        return where, f"{name!r} is {out[i]}; lengths must be positive"

    bad_rows = np.flatnonzero((source < 0) | (out <= 0) | (out > MAX_LENGTH) | null_token)
    bad.add_rows(row0 + bad_rows, lambda row: describe(row - row0))
    out[bad_rows] = 0
    return out


def _read_batches(path: str, batches: Iterator[pa.RecordBatch],
                  columns: list[tuple[str, bool]], bad: BadRecords) -> NDArray[np.int64]:
    parts = [np.zeros(0, dtype=np.int64)]
    row0 = 0
    try:
        for batch in batches:
            parts.append(_batch_lengths(path, batch, columns, row0, bad))
            row0 += batch.num_rows
    except ARROW_ERRORS as e:  # e.g. a uint64 length past int64, a corrupt page, truncation
        raise ValueError(f"{path}: unreadable after row {row0} ({e})") from None
    return np.concatenate(parts)


def read_parquet(path: str, field: str | None, bad: BadRecords) -> NDArray[np.int64]:
    """Lengths from a Parquet file, reading only the length columns, one row group at a time."""
    import pyarrow.parquet as pq  # only Parquet inputs need it

    try:
        pf = pq.ParquetFile(path)
    except ARROW_ERRORS as e:
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    with pf:
        columns = _pick_columns(path, pf.schema_arrow, field)
        batches = pf.iter_batches(columns=[name for name, _ in columns])
        return _read_batches(path, batches, columns, bad)


def arrow_batches(source: pa.MemoryMappedFile, path: str) -> tuple[
        pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and record batches of an Arrow IPC file (random-access format), or else of an
    Arrow IPC stream, in ``source`` (``path`` names it in the error).

    Raises:
        ValueError: neither.
    """
    try:
        reader = ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except ARROW_ERRORS:
        source.seek(0)
        try:
            stream = ipc.open_stream(source)
        except ARROW_ERRORS as e:
            raise ValueError(f"{path}: not an Arrow IPC file or stream ({e})") from None
        return stream.schema, iter(stream)


def read_arrow(path: str, field: str | None, bad: BadRecords) -> NDArray[np.int64]:
    """Lengths from an Arrow IPC file (random-access format) or stream, memory-mapped."""
    with pa.memory_map(path, "r") as source:
        schema, batches = arrow_batches(source, path)
        return _read_batches(path, batches, _pick_columns(path, schema, field), bad)
