"""The content fingerprint (``dcp-plan --fingerprint content``): a sha256 of every token.

Definition (docs/PLAN_FORMAT.md; ``runtime.data.plan_source`` recomputes it through the
runtime's own token readers, and the tests prove both give the same digest for every format):

- A file's samples with a length > 0 (a skipped bad record holds no tokens), in file order, are
  cut into *blocks*: sample i belongs to block ``c_i // BLOCK_TOKENS``, where ``c_i`` is the
  number of tokens before it in the file; only non-empty blocks count. The cut depends on the
  lengths alone (which the lengths fingerprint already fixes), so any rank can hash any block.
- block digest = ``sha256(b"dcp-content-block-v1\\0" + its tokens as int64 little-endian)``;
- file fingerprint = ``"sha256:" + sha256(b"dcp-content-file-v1\\0" + the block digests)``;
- dataset fingerprint = ``"sha256:" + sha256(b"dcp-content-dataset-v1\\0" + each file's
  fingerprint as ASCII, one per line)``.

Tokens are hashed as the runtime reads them: int64 values, whatever the container (JSONL, Parquet,
Arrow, Megatron ``.bin`` of any integer width, compressed JSONL), so the same tokens give the same
fingerprint in any format. Reading is streaming: a few chunks of at most ``CHUNK_TOKENS`` tokens
(or one line chunk of JSONL) are in memory at a time, whatever the file's size.

Cost: every token is read once more at plan time (JSONL: one ``json.loads`` per record, the slow
case); BENCHMARKS.md has the measured rates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from numpy.typing import NDArray

from planner.planfile.schema import dataset_content_fingerprint
from planner.sources.compressed import compression_of, iter_decompressed_lines
from planner.sources.dataset import DataFile
from planner.sources.formats import (
    ARROW_ERRORS,
    CHUNK_BYTES,
    BadRecords,
    iter_line_chunks,
)
from planner.sources.jsonl import read_jsonl, record_tokens, token_fields
from planner.sources.megatron import DEFAULT_UNIT, read_megatron_samples

if TYPE_CHECKING:
    from planner.sources.lengths import LengthTable

__all__ = ["BLOCK_TOKENS", "CHUNK_TOKENS", "StreamHasher", "block_digest", "block_starts",
           "content_fingerprint", "dataset_content_fingerprint", "file_content_fingerprint",
           "file_digest", "token_column", "with_content"]

BLOCK_TOKENS = 1 << 24
"""Tokens per block (about: a block ends at the first sample boundary past a multiple)."""
CHUNK_TOKENS = 1 << 22
"""Tokens converted to int64 at once (32 MB)."""
_BLOCK_TAG = b"dcp-content-block-v1\0"
_FILE_TAG = b"dcp-content-file-v1\0"


def block_starts(lengths: NDArray[np.integer]) -> NDArray[np.int64]:
    """Sample index of the first sample of every block, then ``len(lengths)`` (see above)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    kept = np.flatnonzero(lengths > 0)
    before = (np.cumsum(lengths) - lengths)[kept]
    block = before // BLOCK_TOKENS
    first = kept[np.r_[True, block[1:] != block[:-1]]] if len(kept) else kept
    out: NDArray[np.int64] = np.r_[first, len(lengths)].astype(np.int64)
    return out


def block_digest(chunks: Iterator[NDArray[np.integer]]) -> bytes:
    """One block's digest from its tokens, given in order in any number of pieces."""
    h = hashlib.sha256(_BLOCK_TAG)
    for c in chunks:
        h.update(np.ascontiguousarray(c, dtype="<i8").data)
    return h.digest()


def file_digest(blocks: Sequence[bytes]) -> str:
    """A file's content fingerprint from its block digests in order."""
    h = hashlib.sha256(_FILE_TAG)
    for b in blocks:
        h.update(b)
    return "sha256:" + h.hexdigest()


def content_fingerprint(files: Sequence[DataFile]) -> str:
    """The dataset's content fingerprint, or "" when its files carry none (lengths only)."""
    fps = [f.content_fingerprint for f in files]
    if not any(fps):
        return ""
    if not all(fps):
        missing = next(f.path for f in files if not f.content_fingerprint)
        raise ValueError(f"{missing}: no content fingerprint, while other files have one")
    return dataset_content_fingerprint(fps)


def with_content(table: LengthTable, field: str | None = None, *,
                 progress: Callable[[int, int], None] | None = None) -> LengthTable:
    """``table`` with every file's content fingerprint (reads every token of every file once;
    ``progress(files_done, files_total)`` after each)."""
    from planner.sources.lengths import detect_format

    if table.tokenizer:
        raise ValueError(f"{table.path}: a text corpus holds no token ids to fingerprint; "
                         "tokenize it (dcp-plan tokenize) and fingerprint that dataset")
    files = table.files
    if not files:
        raise ValueError(f"{table.path}: a table without files (built from arrays) has no tokens "
                         "to fingerprint")
    bounds = np.cumsum([0] + [f.num_samples for f in files])
    out = []
    for j, f in enumerate(files):
        fmt, source = detect_format(f.path)
        fp = file_content_fingerprint(source, fmt, table.lengths[bounds[j]:bounds[j + 1]], field,
                                      megatron_unit=table.megatron_unit or DEFAULT_UNIT)
        out.append(replace(f, content_fingerprint=fp))
        if progress is not None:
            progress(j + 1, len(files))
    return replace(table, files=tuple(out))


def check_content(files: Sequence[dict[str, object]], table: LengthTable, field: str | None,
                  *, source: str) -> bool:
    """Recompute the content fingerprint of every file of ``table`` whose entry in ``files``
    (the plan header's ``dataset.files``) has one; False if none has.

    Raises:
        ValueError: a file's tokens differ from the plan's, naming the file and ``source``.
    """
    if not any(f.get("content_fingerprint") for f in files):
        return False
    got = with_content(table, field).files
    for want, have in zip(files, got, strict=True):
        if have.content_fingerprint != want.get("content_fingerprint"):
            raise ValueError(f"{have.path}: its tokens changed since {source} was planned "
                             f"(content fingerprint {have.content_fingerprint}, the plan's "
                             f"{want.get('content_fingerprint')}); the lengths did not")
    return True


class StreamHasher:
    """Hashes a file's kept tokens fed in order in pieces of any size, cutting the blocks."""

    def __init__(self, lengths: NDArray[np.integer]) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        before = np.cumsum(lengths) - lengths
        starts = block_starts(lengths)
        # Block k starts at this offset of the stream of kept tokens (zeros add nothing).
        self._cuts = np.r_[before[starts[:-1]], int(lengths.sum())].astype(np.int64).tolist()
        self._pos = 0
        self._k = 0
        self._h = hashlib.sha256(_BLOCK_TAG)
        self.blocks: list[bytes] = []

    def update(self, tokens: NDArray[np.integer]) -> None:
        while len(tokens):
            if self._k + 1 >= len(self._cuts):
                raise ValueError("more tokens than the lengths hold")
            room = self._cuts[self._k + 1] - self._pos
            piece, tokens = tokens[:room], tokens[room:]
            self._h.update(np.ascontiguousarray(piece, dtype="<i8").data)
            self._pos += len(piece)
            if self._pos == self._cuts[self._k + 1]:
                self.blocks.append(self._h.digest())
                self._h = hashlib.sha256(_BLOCK_TAG)
                self._k += 1

    def hexdigest(self, path: str) -> str:
        if self._pos != self._cuts[-1]:
            raise ValueError(f"{path}: holds {self._pos} tokens, its lengths say {self._cuts[-1]}")
        return file_digest(self.blocks)


def file_content_fingerprint(path: str, fmt: str, lengths: NDArray[np.integer],
                             field: str | None = None, *,
                             megatron_unit: str = DEFAULT_UNIT) -> str:
    """The content fingerprint of one dataset file whose lengths (0: a skipped record) are
    ``lengths``; ``path`` is the file to open (a Megatron prefix for ``megatron``, whose
    samples are ``megatron_unit``: documents or sequences).

    Raises:
        ValueError: the file holds no tokens (a ``.txt`` of lengths, a ``length`` field), or is
            unreadable, naming it.
    """
    n: NDArray[np.int64] = np.asarray(lengths, dtype=np.int64)
    h = StreamHasher(n)
    if fmt == "jsonl":
        chunks = _jsonl(path, n, field)
    elif fmt in ("parquet", "arrow"):
        chunks = _columnar(path, fmt, n, field)
    elif fmt == "megatron":
        chunks = _megatron(path, n, megatron_unit)
    else:
        raise ValueError(f"{path}: --fingerprint content needs token data; a {fmt} file holds "
                         "lengths only")
    for c in chunks:
        h.update(c)
    return h.hexdigest(path)


def _jsonl(path: str, lengths: NDArray[np.int64], field: str | None
           ) -> Iterator[NDArray[np.int64]]:
    # The record index (offsets and sizes, the planner's own definition of a record), then one
    # sequential pass over the same line chunks, decoding the records that hold tokens.
    offsets, sizes, _ = read_jsonl(path, field, BadRecords(skip=True))
    if len(offsets) != len(lengths):
        raise ValueError(f"{path}: holds {len(offsets)} records, its lengths {len(lengths)}")
    fields = token_fields(field)
    chunks = (iter_decompressed_lines(path, CHUNK_BYTES) if compression_of(path)
              else iter_line_chunks(path))
    r = 0
    for base, chunk in chunks:
        end = base + len(chunk)
        flat: list[int] = []
        first = r
        while r < len(offsets) and offsets[r] + sizes[r] <= end:
            if lengths[r] > 0:
                a = int(offsets[r]) - base
                try:
                    toks = record_tokens(bytes(chunk[a:a + int(sizes[r])]), fields)
                except ValueError as e:
                    raise ValueError(f"{path}: record of sample {r} does not decode: {e}"
                                     ) from None
                if len(toks) != lengths[r]:
                    raise ValueError(f"{path}: sample {r} holds {len(toks)} tokens, its length "
                                     f"is {int(lengths[r])}")
                flat.extend(toks)
            r += 1
        try:
            yield np.array(flat, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: samples {first}..{r - 1} hold a token that is not an "
                             f"int64 token id ({e})") from None
    if r != len(offsets):
        raise ValueError(f"{path}: the file ended before record {r}")


def _int_list(t: pa.DataType) -> bool:
    """A list of integers of any layout the lengths reader takes (fixed-size and views too)."""
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                 or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
                and pa.types.is_integer(t.value_type))


def token_column(path: str, schema: pa.Schema, field: str | None) -> str:
    """The token column the runtime reads (``runtime.data.token_files.ArrowTokens``' rule):
    ``field``, else ``input_ids``, then ``tokens``, then the only list-of-integers column."""
    candidates: list[str] = [str(f.name) for f in schema if _int_list(f.type)]
    if field is not None:
        if field not in candidates:
            raise ValueError(f"{path}: column {field!r} is not a list-of-integers column; "
                             "--fingerprint content needs token data")
        return field
    named = [c for c in token_fields(None) if c in candidates]
    if named:
        return named[0]
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(f"{path}: --fingerprint content needs one token-list column (list-of-"
                     f"integer columns: {candidates or 'none'})")


def _columnar(path: str, fmt: str, lengths: NDArray[np.int64], field: str | None
              ) -> Iterator[NDArray[np.int64]]:
    import pyarrow.parquet as pq  # only Parquet inputs need it (import cost)

    row0 = 0
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(path)
            column = token_column(path, pf.schema_arrow, field)
            batches: Iterator[pa.RecordBatch] = pf.iter_batches(columns=[column])
        else:
            source = pa.memory_map(path, "r")
            try:
                reader = ipc.open_file(source)
                schema = reader.schema
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except ARROW_ERRORS:
                source.seek(0)
                stream = ipc.open_stream(source)
                schema, batches = stream.schema, iter(stream)
            column = token_column(path, schema, field)
        for batch in batches:
            col = batch.column(column)
            keep = lengths[row0:row0 + batch.num_rows] > 0
            row0 += batch.num_rows
            if not keep.all():  # skipped bad records (null rows, null tokens) hold no tokens
                col = col.filter(pa.array(keep))
            values = col.flatten()
            for a in range(0, len(values), CHUNK_TOKENS):
                yield np.asarray(values.slice(a, CHUNK_TOKENS).to_numpy(zero_copy_only=False),
                                 dtype=np.int64)
    except ARROW_ERRORS as e:
        raise ValueError(f"{path}: unreadable after row {row0} ({e})") from None


def _megatron(prefix: str, lengths: NDArray[np.int64], unit: str
              ) -> Iterator[NDArray[np.int64]]:
    samples = read_megatron_samples(prefix, unit)
    dtype = samples.dtype
    path = f"{prefix}.bin"
    kept = np.flatnonzero(lengths > 0)
    if not len(kept):
        return
    starts = samples.starts[kept]
    n = lengths[kept]
    need = int((starts + n).max())
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the Megatron token file ({e})") from None
    if len(tokens) < need:
        raise ValueError(f"{path}: holds {len(tokens)} tokens, its index addresses {need} "
                         "(truncated?)")
    # Runs of samples stored back to back (the usual layout) are read as one slice each.
    run = np.flatnonzero(np.r_[True, starts[1:] != starts[:-1] + n[:-1]])
    run_end = np.r_[run[1:], len(kept)]
    for a, b in zip(run.tolist(), run_end.tolist(), strict=True):
        lo, hi = int(starts[a]), int(starts[b - 1] + n[b - 1])
        for x in range(lo, hi, CHUNK_TOKENS):
            yield np.asarray(tokens[x:min(hi, x + CHUNK_TOKENS)], dtype=np.int64)
