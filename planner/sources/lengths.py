"""Dataset -> LengthTable: the token count of every sample, in file order, without reading tokens.

The sample index is the 0-based record number in file order; it is what a plan's
``sample_index`` means and what the runtime seeks to. A dataset of several files (paths,
directories, globs: ``planner.sources.dataset`` documents the order) numbers its samples through the
files in that order. Formats, chosen by extension:

- ``.jsonl``/``.json``: JSON Lines (``planner.sources.jsonl``); blank lines are not records. Also
  compressed, ``.jsonl.gz`` / ``.jsonl.zst`` (streamed, ``planner.sources.compressed``).
- ``.parquet``, ``.arrow``/``.feather``/``.ipc`` (Arrow IPC file or stream): a token-list column
  (``input_ids``/``tokens``) or an integer column (``length``/``num_tokens``).
- ``.idx``/``.bin``, or a prefix ``p`` with ``p.idx`` present: a Megatron indexed dataset, read from
  the ``.idx`` alone (``planner.sources.megatron``); a sample is a document (default) or a
  sequence (``megatron_unit``).
- ``.txt``: one integer length per line; blank lines are not records (also ``.txt.gz``/``.zst``).

A bad record (unparsable, no usable field, a non-integer token, a length <= 0) raises ValueError
naming the file, the line (or row) and the problem. With ``skip_bad_records`` it keeps its sample
index, gets length 0 and is listed in ``LengthTable.skipped``, so indices never shift.

The .txt reader parses digits with numpy (about 0.1 s per million lines); anything unusual in a
chunk (signs, spaces, blank lines, bad values) sends that chunk to a general path, and errors are
located by a line-by-line pass over the failing chunk only.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel
from planner.planfile.schema import fingerprint_lengths
from planner.sources.compressed import (
    COMPRESSIONS,
    compression_of,
    iter_decompressed_lines,
    strip_compression,
)
from planner.sources.dataset import DataFile, expand_paths
from planner.sources.formats import (
    CHUNK_BYTES,
    MAX_LENGTH,
    BadRecords,
    iter_line_chunks,
    read_arrow,
    read_parquet,
)
from planner.sources.jsonl import jsonl_index, read_jsonl
from planner.sources.megatron import (
    DEFAULT_UNIT,
    UNITS,
    read_megatron,
    read_megatron_index,
    write_megatron_dataset,
)

if TYPE_CHECKING:
    from planner.sources.textenc import TextEncoder

__all__ = [
    "DATASET_SUFFIXES",
    "FORMATS",
    "LengthTable",
    "jsonl_index",
    "read_lengths",
    "read_megatron_index",
    "write_megatron_dataset",
]

FORMATS = ("jsonl", "parquet", "arrow", "megatron", "text", "mixed")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow",
             ".feather": "arrow", ".ipc": "arrow", ".idx": "megatron", ".bin": "megatron",
             ".txt": "text"}
_COMPRESSIBLE = ("jsonl", "text")
DATASET_SUFFIXES = tuple(_SUFFIXES) + tuple(
    s + c for s, f in _SUFFIXES.items() if f in _COMPRESSIBLE for c in COMPRESSIONS)
"""File names a directory's dataset files end with (lower case)."""
_MULTI_FIELD = re.compile(rb"\S[ \t\r\x0b\x0c]+\S")
_MAX_DIGITS = 18  # 10**18 - 1 < 2**63: a strictly parsed line never overflows int64


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LengthTable:
    """Token counts of a dataset's samples in file order (arrays are read-only)."""

    path: str
    """The dataset path as given."""
    format: str
    """One of FORMATS."""
    lengths: NDArray[np.int64]
    """Tokens of each sample, one entry per sample in file order; 0 for a skipped bad record."""
    skipped: NDArray[np.int64]
    """Sorted sample indices of the bad records skipped with skip_bad_records."""
    files: tuple[DataFile, ...] = field(default=())
    """The dataset's files in sample order (read_lengths fills it; empty: one file, ``path``)."""
    field: str | None = None
    """The field or column the lengths were read from (``read_lengths(field=...)``); None: the
    default fields. A plan records it (``dataset.field``) so the runtime reads the same one."""
    tokenizer: dict[str, object] | None = None
    """A text corpus: the ``TokenizerSpec.to_dict()`` its counts were tokenized with (a plan
    records it as ``dataset.tokenizer``); None: token ids or lengths."""
    cached_files: int = 0
    """A text corpus: how many files' counts came from their lengths cache (not tokenized)."""
    megatron_unit: str = ""
    """What a sample of the Megatron files is, ``document`` or ``sequence``
    (``read_lengths(megatron_unit=...)``; a plan records it as ``dataset.megatron_unit``); empty:
    the dataset has no Megatron file."""

    def __post_init__(self) -> None:
        # A public constructor (notebooks, benchmarks build tables from arrays): bad input is a
        # ValueError, not an assert.
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")
        for name in ("lengths", "skipped"):
            # A read-only view: the caller's own array stays writable.
            arr = np.ascontiguousarray(getattr(self, name), dtype=np.int64).view()
            if arr.ndim != 1:
                raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        negative = np.flatnonzero(self.lengths < 0)
        if negative.size:
            i = int(negative[0])
            raise ValueError(f"{self.path}: sample {i} has length {int(self.lengths[i])}; "
                             "lengths must be >= 0 (0 marks a skipped record)")

    @property
    def num_samples(self) -> int:
        """Samples in the file, skipped ones included."""
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """Sum of the lengths."""
        return int(self.lengths.sum())


def _strict_digits(a: NDArray[np.uint8], ends: NDArray[np.intp]) -> NDArray[np.int64] | None:
    """Values of a chunk made only of lines of 1-18 ASCII digits; None if it is anything else."""
    values = np.empty(len(ends), dtype=np.int64)
    return values if _parse_digit_lines(a, values) else None


@kernel
def _parse_digit_lines(a: NDArray[np.uint8], values: NDArray[np.int64]) -> bool:
    """One pass: every newline-ended line's value into ``values``; False at the first byte that
    is not a digit, an empty line or one of more than ``_MAX_DIGITS`` digits. (Bytes after the
    last newline are not a line; chunks end with one.)"""
    line = 0
    value = 0
    size = 0
    for j in range(len(a)):
        c = a[j]
        if c == 10:  # newline
            if size < 1 or size > _MAX_DIGITS:
                return False
            values[line] = value
            line += 1
            value = 0
            size = 0
        elif 48 <= c <= 57:
            if size < _MAX_DIGITS:
                value = value * 10 + (c - 48)
            size += 1
        else:
            return False
    return True


def _text_lines(path: str, chunk: bytes, line0: int, sample0: int,
                bad: BadRecords) -> NDArray[np.int64]:
    """Lengths of a chunk's records, line by line: slow, but names every bad record."""
    out: list[int] = []
    for lineno, line in enumerate(chunk.split(b"\n")[:-1], start=line0 + 1):
        fields = line.split()
        if not fields:
            continue
        value = 0
        if len(fields) > 1:
            problem = f"expected one integer length, got {len(fields)} fields"
        else:
            try:
                value = int(fields[0])
                problem = ("" if 0 < value <= MAX_LENGTH else f"length {value} is not positive"
                           if value <= 0 else f"length {value} is more than the {MAX_LENGTH} "
                           "tokens a plan holds per sample")
            except ValueError:
                text = fields[0].decode("utf-8", "replace")
                problem = f"{text[:40]!r} is not an integer length"
        if problem:
            bad.add(sample0 + len(out), f"{path}:{lineno}", problem)
            value = 0
        out.append(value)
    return np.array(out, dtype=np.int64)


def _read_text(path: str, bad: BadRecords) -> NDArray[np.int64]:
    parts = [np.zeros(0, dtype=np.int64)]
    line0 = sample0 = 0
    chunks = (iter_decompressed_lines(path, CHUNK_BYTES) if compression_of(path)
              else iter_line_chunks(path))
    for _, chunk in chunks:
        a = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(a == ord("\n"))
        values = _strict_digits(a, ends)
        if values is None and _MULTI_FIELD.search(chunk) is None:
            try:  # int() semantics per field; blank lines vanish in split()
                values = np.array(bytes(chunk).split(), dtype=np.int64)
            except (ValueError, OverflowError):
                values = None
        if values is None or not np.all((values > 0) & (values <= MAX_LENGTH)):
            values = _text_lines(path, bytes(chunk), line0, sample0, bad)
        parts.append(values)
        line0 += len(ends)
        sample0 += len(values)
    return np.concatenate(parts)


def detect_format(path: str) -> tuple[str, str]:
    """(format, path to open) for ``path``; a Megatron dataset opens by its prefix.

    A compression suffix (``.gz``, ``.zst``) is looked through: ``a.jsonl.zst`` is JSONL.
    """
    suffix = Path(strip_compression(path)).suffix.lower()
    fmt = _SUFFIXES.get(suffix)
    if compression_of(path) and fmt not in _COMPRESSIBLE:
        if not os.path.exists(path):
            raise ValueError(f"{path}: no such file")
        raise ValueError(f"{path}: compressed {fmt or 'files of this kind'} cannot be read; "
                         "only JSONL and .txt may be compressed (.gz, .zst)")
    if fmt == "megatron":
        return fmt, path[: -len(suffix)]
    if fmt is None and os.path.isfile(f"{path}.idx"):
        return "megatron", path
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if fmt is None:
        raise ValueError(f"{path}: unknown dataset format; expected one of "
                         f"{', '.join(sorted(_SUFFIXES))} or a Megatron prefix with a .idx file")
    return fmt, path


def _read_file(given: str, bad: BadRecords, field: str | None, unit: str = DEFAULT_UNIT,
               text: _TextRead | None = None) -> tuple[str, NDArray[np.int64], tuple[int, int]]:
    """(format, lengths, (sequences, documents)) of one file; bad records go to ``bad`` with
    file-local indices. The counts are a Megatron file's (0, 0 for other formats)."""
    fmt, source = detect_format(given)
    counts = (0, 0)
    if text is not None:
        lengths = text.read(source, fmt, field, bad)
    elif fmt == "jsonl":
        lengths = read_jsonl(source, field, bad)[2]
    elif fmt == "parquet":
        lengths = read_parquet(source, field, bad)
    elif fmt == "arrow":
        lengths = read_arrow(source, field, bad)
    elif fmt == "megatron":
        samples = read_megatron(source, bad, unit)
        lengths = samples.lengths
        counts = (samples.num_sequences, samples.num_documents)
    else:
        lengths = _read_text(source, bad)
    if len(lengths) == 0:
        raise ValueError(f"{given}: no samples (the file is empty)")
    return fmt, lengths, counts


class _TextRead:
    """Token counts of text files under one encoder, with their caches and a byte-or-row
    progress callback (``progress(done, total)`` over all files)."""

    def __init__(self, encoder: TextEncoder, use_cache: bool,
                 progress: Callable[[int, int], None] | None, files: list[str]) -> None:
        from planner.sources.text import progress_total

        self.encoder, self.use_cache, self.cached = encoder, use_cache, 0
        self.progress, self.done = progress, 0
        self.total = 0
        if progress is not None:
            for f in files:
                with_fmt = detect_format(f)
                self.total += progress_total(with_fmt[1], with_fmt[0])

    def _step(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, max(self.total, self.done))

    def read(self, path: str, fmt: str, field: str | None,
             bad: BadRecords) -> NDArray[np.int64]:
        from planner.sources.text import TEXT_FIELD, TEXT_FORMATS
        from planner.sources.textcache import text_file_lengths

        if fmt not in TEXT_FORMATS:
            raise ValueError(f"{path}: a {fmt} dataset holds token ids or lengths, not text: "
                             "plan it without --tokenizer (text corpora are JSONL, Parquet or "
                             "Arrow files with a string field)")
        lengths, where = text_file_lengths(path, fmt, field or TEXT_FIELD, self.encoder, bad,
                                           use_cache=self.use_cache, progress=self._step)
        self.cached += bool(where)
        return lengths


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def read_lengths(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 skip_bad_records: bool = False, field: str | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 notice: Callable[[str], None] | None = None,
                 megatron_unit: str = DEFAULT_UNIT,
                 encoder: TextEncoder | None = None, use_cache: bool = True,
                 text_progress: Callable[[int, int], None] | None = None) -> LengthTable:
    """Read the token count of every sample of a dataset, in file order.

    Args:
        path: a JSONL (also .gz/.zst), Parquet, Arrow IPC, .txt file, a Megatron
            ``.idx``/``.bin``/prefix, a directory or a glob of such files, or a list of these
            (one dataset; ``planner.sources.dataset`` gives the order).
        skip_bad_records: give bad records length 0 and list them in ``skipped`` instead of
            raising.
        field: the field or column holding token lists or lengths; default: the first non-null
            of ``input_ids``, ``tokens``, ``length``, ``num_tokens``. Ignored, with a warning, by
            formats without fields (Megatron, .txt).
        progress: called as ``progress(files_done, files_total)`` after each file.
        notice: told of every dcp plan a directory or glob held (left out: a plan is not
            data); default: a ``UserWarning``.
        megatron_unit: what a sample of a Megatron file is: ``document`` (its sequences'
            tokens, concatenated) or ``sequence`` (``planner.sources.megatron``).
        encoder: a text corpus (``planner.sources.text``): each record's ``field`` (default
            ``text``) is tokenized and its token count is the length; the table records the
            tokenizer. JSONL, Parquet and Arrow files only.
        use_cache: with ``encoder``, read and write each file's lengths cache
            (``planner.sources.textcache``).
        text_progress: with ``encoder``, called as ``(done, total)`` in input bytes (plain
            JSONL) or rows (Parquet) as the tokenizer goes.

    Raises:
        ValueError: an unknown format, a missing or empty file, a bad record (naming file, line
            or row, and the problem) without ``skip_bad_records``, or only bad records.
    """
    items = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [
        os.fspath(p) for p in path]
    if not items:
        raise ValueError("no dataset given")
    if megatron_unit not in UNITS:
        raise ValueError(f"Megatron unit {megatron_unit!r} is not one of {', '.join(UNITS)}")
    files = expand_paths(items, DATASET_SUFFIXES, notice=notice or _warn)
    parts: list[NDArray[np.int64]] = []
    skipped: list[NDArray[np.int64]] = []
    infos: list[DataFile] = []
    start = 0
    warned = False
    text = None if encoder is None else _TextRead(encoder, use_cache, text_progress,
                                                  [name for name, _ in files])
    for j, (name, group) in enumerate(files):
        bad = BadRecords(skip=skip_bad_records)
        fmt, lengths, counts = _read_file(name, bad, field, megatron_unit, text)
        if field is not None and fmt in ("megatron", "text") and not warned:
            warnings.warn(f"field={field!r} is ignored for {fmt} datasets", stacklevel=2)
            warned = True
        parts.append(lengths)
        skipped.append(bad.indices() + start)
        infos.append(DataFile(path=name, format=fmt, num_samples=len(lengths),
                              num_tokens=int(lengths.sum()),
                              fingerprint=fingerprint_lengths(lengths), group=group,
                              num_sequences=counts[0], num_documents=counts[1]))
        start += len(lengths)
        if progress is not None:
            progress(j + 1, len(files))
    all_lengths = np.concatenate(parts)
    all_skipped = np.concatenate(skipped)
    given = items[0] if len(items) == 1 else " ".join(items)
    if len(all_skipped) == len(all_lengths):
        raise ValueError(f"{given}: all {len(all_lengths)} samples are bad records")
    formats = {f.format for f in infos}
    unit = megatron_unit if "megatron" in formats else ""
    return LengthTable(path=given, format=formats.pop() if len(formats) == 1 else "mixed",
                       lengths=all_lengths, skipped=all_skipped, files=tuple(infos),
                       field=field if text is None else field or "text",
                       megatron_unit=unit,
                       tokenizer=None if encoder is None else encoder.spec.to_dict(),
                       cached_files=0 if text is None else text.cached)
