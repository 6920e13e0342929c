"""The text of one record of a text corpus, by sample index: what the runtime tokenizes.

A text plan's sample ``i`` is the ``i``-th record of its dataset (``docs/PLAN_FORMAT.md``): a
JSONL line that is not blank (a blank line holds only spaces, tabs and ``\\r``, as
``planner.sources.jsonl`` defines), or a row of a Parquet / Arrow string column. Readers:

- ``JsonlText``: a byte-offset index of the records, built by one pass over the file (numpy over
  memory-mapped chunks, no JSON decoded); a read seeks to its records' lines and decodes those.
- ``.jsonl.gz`` / ``.jsonl.zst``: decoded once into memory (a stream cannot be seeked into).
- ``ArrowText``: a ``string`` / ``large_string`` column; IPC is memory-mapped, Parquet decodes the
  row groups asked for.

A record whose field is absent, null or not a string is a bad record: ``texts`` gives None for
it, and the caller refuses it (naming ``where(i)``) or, for a plan made with
``--skip-bad-records``, reads it as an empty sample.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from numpy.typing import NDArray

from planner.sources.compressed import compression_of, iter_decompressed_lines
from planner.sources.formats import ARROW_ERRORS, CHUNK_BYTES, iter_line_chunks

__all__ = ["TextRecords", "open_text_records"]

_SPACE = np.zeros(256, dtype=bool)
_SPACE[[ord(" "), ord("\t"), ord("\r"), ord("\n")]] = True


class TextRecords(Protocol):
    """Random access to the text field of a file's records."""

    path: str

    @property
    def num_samples(self) -> int: ...

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        """The text of each row (None: a bad record), in the order given."""
        ...

    def where(self, row: int) -> str:
        """``line L`` or ``row R``: where a record is, for messages."""
        ...


def _line_index(chunks: Iterable[tuple[int, bytes | memoryview]]
                ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """(offset, size, 1-based line) of every non-blank line of newline-ended chunks."""
    offsets, sizes, lines = [], [], []
    lines_before = 0
    for base, chunk in chunks:
        a = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(a == ord("\n"))
        start = np.r_[0, ends[:-1] + 1]
        # A line is blank when it holds no byte outside the whitespace set.
        filled = np.r_[0, np.cumsum(~_SPACE[a], dtype=np.int64)]
        record = filled[ends] > filled[start]
        offsets.append(base + start[record])
        sizes.append((ends - start)[record])
        lines.append(lines_before + 1 + np.flatnonzero(record))
        lines_before += len(ends)
    if not offsets:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    return (np.concatenate(offsets).astype(np.int64), np.concatenate(sizes).astype(np.int64),
            np.concatenate(lines).astype(np.int64))


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """Device, inode, size, mtime and ctime: what an edit or a replacement changes."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _record_text(raw: bytes, field: str) -> str | None:
    try:
        obj = json.loads(raw.decode("utf-8-sig", "replace"))
    except (json.JSONDecodeError, RecursionError):
        return None
    value = obj.get(field) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


class JsonlText:
    """The ``field`` of each record of a JSONL file, by a byte-offset index of its lines."""

    def __init__(self, path: str, field: str) -> None:
        self.path, self.field = path, field
        self._identity = _identity(os.stat(path))
        self._offsets, self._sizes, self._lines = _line_index(iter_line_chunks(path))

    @property
    def num_samples(self) -> int:
        return len(self._offsets)

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        out: list[str | None] = []
        with open(self.path, "rb") as f:
            fd = f.fileno()
            if _identity(os.fstat(fd)) != self._identity:
                # The index's offsets would cut other records out of an edited file.
                raise ValueError(f"{self.path}: the file changed since it was opened (replaced "
                                 "or edited); this is not the dataset the plan was made for")
            for r in rows:
                raw = os.pread(fd, int(self._sizes[r]), int(self._offsets[r]))
                out.append(_record_text(raw, self.field))
        return out

    def where(self, row: int) -> str:
        return f"line {int(self._lines[row])}"


class MemoryText:
    """A compressed JSONL file's texts, decoded once (``.jsonl.gz``, ``.jsonl.zst``)."""

    def __init__(self, path: str, field: str) -> None:
        self.path, self.field = path, field
        self._texts: list[str | None] = []
        lines: list[NDArray[np.int64]] = []
        line0 = 0
        for _, chunk in iter_decompressed_lines(path, CHUNK_BYTES):
            offsets, sizes, numbers = _line_index([(0, chunk)])
            self._texts += [_record_text(chunk[a:a + n], field)
                            for a, n in zip(offsets.tolist(), sizes.tolist(), strict=True)]
            lines.append(numbers + line0)
            line0 += chunk.count(b"\n")
        self._lines = np.concatenate(lines) if lines else np.zeros(0, np.int64)

    @property
    def num_samples(self) -> int:
        return len(self._texts)

    def texts(self, rows: Sequence[int]) -> list[str | None]:
        return [self._texts[r] for r in rows]

    def where(self, row: int) -> str:
        return f"line {int(self._lines[row])}"


class ArrowText:
    """A string column of an Arrow IPC file or stream, or of a Parquet file.

    IPC record batches are views of the memory map; Parquet row groups are decoded when first
    read and kept, most recently used first, up to ``cache_bytes``. Only the rows asked for
    become Python strings (``take``), so a plan drawn at random costs a row group's decode per
    group touched, not a whole group's strings per row.
    """

    def __init__(self, path: str, field: str, *, cache_bytes: int = 256 << 20) -> None:
        self.path, self.field = path, field
        self._parquet = Path(path).suffix.lower() in (".parquet", ".pq")
        try:
            if self._parquet:
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
        strings = [f.name for f in schema
                   if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        if field not in strings:
            raise ValueError(f"{path}: column {field!r} is not a string column (string "
                             f"columns: {strings or 'none'})")
        self._starts = np.r_[0, np.cumsum(counts)].astype(np.int64)
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()
        self._cache_bytes, self._cached = cache_bytes, 0

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    def _column(self, c: int) -> pa.Array:
        if not self._parquet:
            return self._batches[c].column(self.field)
        hit = self._cache.get(c)
        if hit is not None:
            self._cache.move_to_end(c)
            return hit
        try:
            arr = self._pq.read_row_group(c, columns=[self.field]).column(0).combine_chunks()
        except ARROW_ERRORS as e:  # a corrupt page
            raise ValueError(f"{self.path}: row group {c} is unreadable ({e})") from None
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

    def where(self, row: int) -> str:
        return f"row {row}"


def open_text_records(path: str, field: str) -> TextRecords:
    """The text reader for ``path`` by its extension.

    Raises:
        ValueError: a missing file, a format without text records (a Megatron ``.bin`` holds
            token ids), or a columnar file without the string column ``field``.
    """
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    name = path.lower()
    if compression_of(path):
        return MemoryText(path, field)
    if name.endswith((".jsonl", ".json")):
        return JsonlText(path, field)
    if name.endswith((".arrow", ".feather", ".ipc", ".parquet", ".pq")):
        return ArrowText(path, field)
    raise ValueError(f"{path}: not a text dataset (a text plan reads .jsonl (also .gz, .zst), "
                     ".parquet or .arrow records with a string field)")
