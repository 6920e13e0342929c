"""Length readers for columnar files (Parquet, Arrow IPC) and Megatron indexed datasets.

Every reader returns one int64 length per sample in file order and reports bad records through
``BadRecords``, which raises on the first one (naming file and row) or, when skipping, records the
sample index and leaves its length at 0. Sample indices never shift: a skipped record keeps its
index, so a plan's ``sample_index`` is always the row of the source file.

Megatron's ``MMapIndexedDataset`` index (``prefix.idx``, little-endian), as written by Megatron-LM
``megatron/core/datasets/indexed_dataset.py``::

    b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count <Q | document count <Q
    | sequence lengths int32[count] | sequence pointers int64[count] | document indices int64[docs]

Lengths come from the index alone; the token file ``prefix.bin`` is never read. A sample is one
*sequence* (what a pointer and a length address), which is one document unless the data was
preprocessed with sentence splitting.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.typing import NDArray

from planner.fileguard import check_input

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
        raise ValueError(f"{path}: no column {wanted}; columns are {schema.names}")
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


def read_arrow(path: str, field: str | None, bad: BadRecords) -> NDArray[np.int64]:
    """Lengths from an Arrow IPC file (random-access format) or stream, memory-mapped."""
    with pa.memory_map(path, "r") as source:
        try:
            reader = ipc.open_file(source)
            batches: Iterator[pa.RecordBatch] = (
                reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
        except ARROW_ERRORS:
            source.seek(0)
            try:
                stream = ipc.open_stream(source)
            except ARROW_ERRORS as e:
                raise ValueError(f"{path}: not an Arrow IPC file or stream ({e})") from None
            batches, schema = iter(stream), stream.schema
        return _read_batches(path, batches, _pick_columns(path, schema, field), bad)


# ---------------------------------------------------------------- Megatron indexed dataset

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}
_FLOAT_CODES = (6, 7)


def read_megatron_index(
    prefix: str | os.PathLike[str],
) -> tuple[NDArray[np.int64], NDArray[np.int64], np.dtype[Any]]:
    """Read ``prefix.idx``: (sequence lengths, byte pointers into ``prefix.bin``, token dtype).

    Raises:
        ValueError: the index is missing, truncated, of another format or version, declares a
            float token dtype (token ids are integers), or holds a pointer that is negative,
            not a multiple of the token size, or before the end of the sequence before it
            (naming the sequence).
    """
    idx = f"{os.fspath(prefix)}.idx"
    check_input(idx, "a Megatron index")
    check_input(f"{os.fspath(prefix)}.bin", "a Megatron token file")
    if not os.path.isfile(idx):
        raise ValueError(f"{idx}: no such Megatron index file")
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or not head.startswith(_MAGIC):
            raise ValueError(f"{idx}: not a Megatron MMapIndexedDataset index (bad header)")
        _, version, code, count, doc_count = _HEADER.unpack(head)
        if version != 1:
            raise ValueError(f"{idx}: index version {version}, only version 1 is supported")
        if code not in _DTYPES or code in _FLOAT_CODES:
            name = _DTYPES[code].__name__ if code in _DTYPES else "unknown"
            raise ValueError(f"{idx}: token dtype code {code} ({name}) is not an integer type")
        need = _HEADER.size + 12 * count + 8 * doc_count
        if os.fstat(f.fileno()).st_size < need:
            raise ValueError(f"{idx}: truncated: {count} sequences need {need} bytes, "
                             f"the file has {os.fstat(f.fileno()).st_size}")
        sizes = np.fromfile(f, dtype="<i4", count=count).astype(np.int64)
        pointers = np.fromfile(f, dtype="<i8", count=count).astype(np.int64)
    dtype = np.dtype(_DTYPES[code])
    _check_pointers(idx, sizes, pointers, dtype)
    return sizes, pointers, dtype


def _check_pointers(idx: str, sizes: NDArray[np.int64], pointers: NDArray[np.int64],
                    dtype: np.dtype[Any]) -> None:
    """Every sequence's byte pointer: >= 0, a multiple of the token size, and at or after the
    end of the sequence before it (Megatron's writer makes them the running sum of the
    sequences' bytes). A negative pointer would read the end of the ``.bin`` (numpy's negative
    indexing), a misaligned one would be rounded down: both are a damaged index, not data."""
    if len(pointers) == 0:
        return
    item = dtype.itemsize

    def fail(i: int, problem: str) -> None:
        raise ValueError(f"{idx}: sequence {i}: {problem} (a damaged or foreign index: "
                         "rebuild it with Megatron's preprocessing)")

    bad = np.flatnonzero(pointers < 0)
    if bad.size:
        fail(int(bad[0]), f"byte pointer {int(pointers[bad[0]])} is negative")
    bad = np.flatnonzero(pointers % item)
    if bad.size:
        fail(int(bad[0]), f"byte pointer {int(pointers[bad[0]])} is not a multiple of the "
                          f"{item}-byte token size ({dtype.name})")
    ends = pointers + np.maximum(sizes, 0) * item
    bad = np.flatnonzero(pointers[1:] < ends[:-1]) + 1
    if bad.size:
        i = int(bad[0])
        fail(i, f"starts at byte {int(pointers[i])}, before sequence {i - 1} ends (byte "
                f"{int(ends[i - 1])}): pointers must follow the sequences in order")


def read_megatron(prefix: str, bad: BadRecords) -> NDArray[np.int64]:
    """Sequence lengths of a Megatron dataset; an empty (or negative) sequence is a bad record."""
    sizes, pointers, dtype = read_megatron_index(prefix)
    bin_path = f"{prefix}.bin"
    if len(sizes) and os.path.isfile(bin_path):
        # Only the size of the token file is checked (a stat, not a read): a truncated or
        # mismatched .bin would otherwise fail much later, inside a training run.
        ends = pointers + np.maximum(sizes, 0) * dtype.itemsize
        need = int(np.max(ends))
        have = os.path.getsize(bin_path)
        if have < need:
            last = int(np.argmax(ends > have))
            raise ValueError(f"{bin_path}: holds {have} bytes, its index addresses {need} "
                             f"(sequence {last} and later lie past the end: truncated?)")
    bad_rows = np.flatnonzero(sizes <= 0)
    bad.add_rows(bad_rows, lambda i: (f"{prefix}.idx: sequence {i}",
                                      f"length {sizes[i]}; lengths must be positive"))
    sizes[bad_rows] = 0
    return sizes


def write_megatron_dataset(prefix: str | os.PathLike[str],
                           docs: Sequence[Sequence[int] | NDArray[np.integer[Any]]],
                           dtype: type[np.integer[Any]] | np.dtype[Any] = np.int32) -> None:
    """Write ``prefix.bin`` and ``prefix.idx`` in Megatron's MMapIndexedDataset format.

    Each document is one sequence (document indices ``0..len(docs)``), as Megatron's
    preprocessing writes it without sentence splitting. For tests and sample data.

    Raises:
        ValueError: ``dtype`` is not one of Megatron's integer token dtypes, or a token does not
            fit it.
    """
    np_dtype = np.dtype(dtype)
    codes = {np.dtype(t): c for c, t in _DTYPES.items() if c not in _FLOAT_CODES}
    if np_dtype not in codes:
        raise ValueError(f"token dtype {np_dtype} is not a Megatron integer token dtype")
    info = np.iinfo(np_dtype)
    prefix = os.fspath(prefix)
    sizes = np.zeros(len(docs), dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for i, doc in enumerate(docs):
            arr = np.asarray(doc)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise ValueError(f"document {i}: tokens outside {np_dtype} range")
            arr.astype(np_dtype.newbyteorder("<")).tofile(f)
            sizes[i] = arr.size
    pointers = np.zeros(len(docs), dtype="<i8")
    np.cumsum(sizes[:-1] * np_dtype.itemsize, out=pointers[1:])
    doc_index = np.arange(len(docs) + 1, dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(_MAGIC, 1, codes[np_dtype], len(docs), len(doc_index)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(doc_index.tobytes())
