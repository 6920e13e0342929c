"""The text of one record of a text corpus, by sample index: what the runtime tokenizes.

A text plan's sample ``i`` is the ``i``-th record of its dataset (``docs/PLAN_FORMAT.md``).
What a record is, its text, and what makes it bad are the planner's definitions, imported from
``planner.sources.text`` rather than restated: a JSONL record is a line that is not blank
(``BLANK``; a file's leading ``BOM`` is skipped), decoded by ``decode_record`` (not UTF-8, not
JSON, no string field, an unpaired surrogate: bad, with the planner's problem); a Parquet /
Arrow record is a row of a string column (``check_text_column``; a null is bad). So training
reads the texts the planner counted, and a record the planner skipped (length 0 under
``--skip-bad-records``) is bad here too, never a text of U+FFFD replacements.

What this module adds is random access, which the planner's streaming reader does not need:

- ``JsonlText``: a byte-offset index of the records, built by one pass over the file (numpy over
  memory-mapped chunks, no JSON decoded); a read seeks to its records' lines and decodes those.
- ``MemoryText``: ``.jsonl.gz`` / ``.jsonl.zst``, decoded once into memory (a stream cannot be
  seeked into).
- ``ArrowText``: a string column; IPC is memory-mapped, Parquet decodes the row groups asked for.

``texts`` gives None for a bad record and ``problem`` says what is wrong with it: the caller
refuses it (naming ``where(i)``) or, for a plan made with ``--skip-bad-records``, reads it as an
empty sample.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from numpy.typing import NDArray

from planner.sources.compressed import compression_of, iter_decompressed_lines
from planner.sources.formats import ARROW_ERRORS, CHUNK_BYTES, iter_line_chunks
from planner.sources.lengths import detect_format
from planner.sources.text import BLANK, BOM, check_text_column, decode_record, null_problem

__all__ = ["TextRecords", "open_text_records"]

_SPACE = np.zeros(256, dtype=bool)
_SPACE[[*BLANK, ord("\n")]] = True


class TextRecords(Protocol):
    """Random access to the text field of a file's records."""

    path: str
    field: str

    @property
    def num_samples(self) -> int: ...

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        """The text of each row (None: a bad record), in the order given."""
        ...

    def problem(self, row: int) -> str:
        """What is wrong with a bad record (the planner's words); "" for a good one."""
        ...

    def where(self, row: int) -> str:
        """``line L`` or ``row R``: where a record is, for messages."""
        ...


def _chunk_index(chunk: bytes | memoryview, *, at_start: bool
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], int]:
    """(offset in the chunk, size, 0-based line in the chunk) of every record (non-blank line)
    of one newline-ended chunk, and its number of lines; ``at_start``: the chunk begins the
    file, whose ``BOM`` is not part of its first line (as the planner strips it)."""
    a = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(a == ord("\n"))
    start = np.r_[0, ends[:-1] + 1]
    if at_start and len(ends) and bytes(chunk[:len(BOM)]) == BOM:
        start[0] = len(BOM)  # a line of a BOM alone is blank, as the planner reads it
    # A line is blank when it holds no byte outside the whitespace set.
    filled = np.r_[0, np.cumsum(~_SPACE[a], dtype=np.int64)]
    record = filled[ends] > filled[start]
    return (start[record].astype(np.int64), (ends - start)[record].astype(np.int64),
            np.flatnonzero(record).astype(np.int64), len(ends))


def _line_index(chunks: Iterable[tuple[int, bytes | memoryview]]
                ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(file offset, size, 1-based line) of every record of a file's newline-ended chunks."""
    offsets, sizes, lines = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [
        np.zeros(0, np.int64)]
    lines_before = 0
    for base, chunk in chunks:
        start, size, line, num_lines = _chunk_index(chunk, at_start=base == 0)
        offsets.append(base + start)
        sizes.append(size)
        lines.append(lines_before + 1 + line)
        lines_before += num_lines
    return np.concatenate(offsets), np.concatenate(sizes), np.concatenate(lines)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """Device, inode, size, mtime and ctime: what an edit or a replacement changes."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class JsonlText:
    """The ``field`` of each record of a JSONL file, by a byte-offset index of its lines."""

    def __init__(self, path: str, field: str) -> None:
        self.path, self.field = path, field
        self._identity = _identity(os.stat(path))
        self._offsets, self._sizes, self._lines = _line_index(iter_line_chunks(path))

    @property
    def num_samples(self) -> int:
        return len(self._offsets)

    def _decoded(self, rows: Sequence[int]) -> list[tuple[str | None, str]]:
        out = []
        with open(self.path, "rb") as f:
            fd = f.fileno()
            if _identity(os.fstat(fd)) != self._identity:
                # The index's offsets would cut other records out of an edited file.
                raise ValueError(f"{self.path}: the file changed since it was opened (replaced "
                                 "or edited); this is not the dataset the plan was made for")
            for r in rows:
                raw = os.pread(fd, int(self._sizes[r]), int(self._offsets[r]))
                out.append(decode_record(raw, self.field))
        return out

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        return [t for t, _ in self._decoded(rows)]

    def problem(self, row: int) -> str:
        return self._decoded([row])[0][1]

    def where(self, row: int) -> str:
        return f"line {int(self._lines[row])}"


class MemoryText:
    """A compressed JSONL file's texts, decoded once (``.jsonl.gz``, ``.jsonl.zst``)."""

    def __init__(self, path: str, field: str) -> None:
        self.path, self.field = path, field
        self._texts: list[str | None] = []
        self._problems: dict[int, str] = {}
        lines: list[NDArray[np.int64]] = []
        line0 = 0
        for base, chunk in iter_decompressed_lines(path, CHUNK_BYTES):
            start, size, line, num_lines = _chunk_index(chunk, at_start=base == 0)
            for a, n in zip(start.tolist(), size.tolist(), strict=True):
                text, problem = decode_record(chunk[a:a + n], field)
                if text is None:
                    self._problems[len(self._texts)] = problem
                self._texts.append(text)
            lines.append(line0 + 1 + line)
            line0 += num_lines
        self._lines = np.concatenate(lines) if lines else np.zeros(0, np.int64)

    @property
    def num_samples(self) -> int:
        return len(self._texts)

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        return [self._texts[r] for r in rows]

    def problem(self, row: int) -> str:
        return self._problems.get(row, "")

    def where(self, row: int) -> str:
        return f"line {int(self._lines[row])}"


class ArrowText:
    """A string column of an Arrow IPC file or stream, or of a Parquet file.

    IPC record batches are views of the memory map; Parquet row groups are decoded when first
    read and kept, most recently used first, up to ``cache_bytes`` (a ``string_view`` batch is
    cast to ``large_string`` and kept alike: Arrow's ``take`` has no kernel for views). Only the
    rows asked for become Python strings (``take``), so a plan drawn at random costs a row
    group's decode per group touched, not a whole group's strings per row.
    """

    def __init__(self, path: str, field: str, *, parquet: bool,
                 cache_bytes: int = 256 << 20) -> None:
        self.path, self.field = path, field
        self._parquet = parquet
        try:
            if parquet:
                self._pq = pq.ParquetFile(path, memory_map=True)
                schema = self._pq.schema_arrow
                counts = [self._pq.metadata.row_group(i).num_rows
                          for i in range(self._pq.num_row_groups)]
            else:
                source = pa.memory_map(path, "r")
                try:
                    reader = ipc.open_file(source)
                    self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                except ARROW_ERRORS:
                    source.seek(0)
                    stream = ipc.open_stream(source)
                    self._batches = list(stream)
                    schema = stream.schema
                else:
                    schema = reader.schema
                counts = [b.num_rows for b in self._batches]
        except ARROW_ERRORS as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        check_text_column(path, field, schema)  # the planner's rule and message
        self._view = pa.types.is_string_view(schema.field(field).type)
        self._starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    def _column(self, c: int) -> pa.Array:
        if not self._parquet and not self._view:
            return self._batches[c].column(self.field)
        hit = self._cache.get(c)
        if hit is not None:
            self._cache.move_to_end(c)
            return hit
        try:
            arr = (self._pq.read_row_group(c, columns=[self.field]).column(0).combine_chunks()
                   if self._parquet else self._batches[c].column(self.field))
        except ARROW_ERRORS as e:  # a corrupt page
            raise ValueError(f"{self.path}: row group {c} is unreadable ({e})") from None
        if pa.types.is_string_view(arr.type):
            arr = arr.cast(pa.large_string())
        self._cache[c] = arr
        self._cached += arr.nbytes
        while self._cached > self._cache_bytes and len(self._cache) > 1:
            self._cached -= self._cache.popitem(last=False)[1].nbytes
        return arr

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        out: list[str | None] = [None] * len(rows)
        index = np.asarray(rows, np.int64)
        chunk = np.searchsorted(self._starts, index, "right") - 1
        for c in np.unique(chunk).tolist():  # ascending: row groups decode in file order
            sel = np.flatnonzero(chunk == c)
            got = self._column(c).take(pa.array(index[sel] - self._starts[c])).to_pylist()
            for j, text in zip(sel.tolist(), got, strict=True):
                out[j] = text
        return out

    def problem(self, row: int) -> str:
        return null_problem(self.field) if self.texts([row])[0] is None else ""

    def where(self, row: int) -> str:
        return f"row {row}"


def open_text_records(path: str, field: str) -> TextRecords:
    """The text reader for ``path``, by the planner's format detection (``detect_format``).

    Raises:
        ValueError: a missing file, a format without text records (a Megatron ``.bin`` holds
            token ids), or a columnar file without the string column ``field``.
    """
    fmt, _ = detect_format(path)
    if fmt == "jsonl":
        return MemoryText(path, field) if compression_of(path) else JsonlText(path, field)
    if fmt in ("parquet", "arrow"):
        return ArrowText(path, field, parquet=fmt == "parquet")
    raise ValueError(f"{path}: a {fmt} dataset holds token ids or lengths, not text (a text "
                     "plan reads .jsonl (also .gz, .zst), .parquet or .arrow records with a "
                     "string field)")
