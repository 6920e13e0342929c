"""Text corpora: the documents of a JSONL / Parquet / Arrow file of ``{"text": ...}`` records.

A text corpus (a Hugging Face dataset, a scraped corpus) is planned by its token counts under a
tokenizer (``planner.sources.textenc``): sample ``i`` is the ``i``-th record (a JSONL line that
is not blank, a Parquet or Arrow row), its length ``len(TextEncoder.encode([text])[0])``. Readers
here yield the texts in batches (``TextBatch``); ``count_lengths`` tokenizes them for the
planner, ``planner.sources.pretokenize`` for a Megatron dataset.

What is a bad record (ValueError naming the file and line or row, or with ``skip_bad_records``
length 0 and listed as skipped): a line that is not JSON or not an object, a missing or null
field, a field that is not a string, bytes that are not UTF-8 (the line and byte column), a
string with an unpaired surrogate escape (``"\\ud800"``: no tokenizer can encode it). An empty
text is not bad: it keeps its sample index with its count (0 tokens under ``--bos none`` without
EOD, and a sample of 0 tokens is never planned).

JSON is decoded with ``json.loads`` per line over chunks decoded from UTF-8 at once: about
0.3-1 us per short record, far below the tokenizer's cost (BENCHMARKS.md), so the numba scanner
of the token-id path is not needed here.

These rules are defined here once, for planning and training alike: the runtime reads a text
plan's records by sample index (``runtime.data.text_records``) through ``decode_record`` (one
JSONL line), ``BLANK`` and ``BOM`` (which lines are records) and ``check_text_column`` /
``null_problem`` (a Parquet / Arrow column), so a record the planner counted is the text
training tokenizes, and a record it called bad (length 0 under ``--skip-bad-records``) is bad
there too, with the same problem named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from planner.sources.compressed import compression_of, iter_decompressed_lines
from planner.sources.formats import (
    ARROW_ERRORS,
    CHUNK_BYTES,
    MAX_LENGTH,
    BadRecords,
    arrow_batches,
    iter_line_chunks,
)

if TYPE_CHECKING:
    from planner.sources.textenc import TextEncoder

__all__ = ["BLANK", "BOM", "TEXT_FIELD", "TEXT_FORMATS", "TextBatch", "check_text_column",
           "count_lengths", "decode_record", "encode_checked", "iter_texts", "null_problem",
           "place_text", "progress_total", "record_text", "surrogate_problem", "text_pieces",
           "text_unit"]

TEXT_FIELD = "text"
"""The field (JSONL) or column (Parquet, Arrow) read when ``--field`` is not given."""
TEXT_FORMATS = ("jsonl", "parquet", "arrow")
"""Formats a text corpus may have (``planner.sources.lengths.detect_format`` names)."""
BATCH_CHARS = 1 << 21
"""Characters tokenized per ``encode_batch`` call: enough documents for every core, and the
tokenizer's per-token encodings (~80 bytes each) stay in the tens of MB."""
_ROWS = 8192  # Parquet / Arrow rows read per batch
BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte order mark: skipped at the start of a JSONL file (elsewhere it is not JSON)."""
BLANK = b" \t\r"
"""The bytes a blank JSONL line holds (besides its newline): such a line is not a record."""
_BLANK = BLANK.decode()
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TextBatch:
    """The good records of consecutive samples ``sample0 .. sample0 + num_samples - 1``."""

    sample0: int
    """File-local index of the batch's first sample."""
    num_samples: int
    """Samples the batch covers, bad records included (they have no text here)."""
    texts: list[str]
    """The text of every good record, in order."""
    samples: NDArray[np.int64]
    """File-local sample index of each text."""
    places: NDArray[np.int64]
    """Each text's 1-based line (JSONL) or 0-based row (Parquet, Arrow), for messages."""
    nbytes: int = 0
    """Input bytes the batch was read from (JSONL), for progress."""


def place_text(path: str, fmt: str, place: int) -> str:
    """``file:line`` (JSONL) or ``file: row i`` (columnar) of one record."""
    return f"{path}:{place}" if fmt == "jsonl" else f"{path}: row {place}"


def record_text(line: str, field: str) -> tuple[str | None, str]:
    """(the text of one JSONL record line, "") or (None, the problem with it)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "not JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {type(obj).__name__}"
    value = obj.get(field)
    if isinstance(value, str):
        return value, ""
    if value is None:
        strings = [k for k, v in obj.items() if isinstance(v, str)]
        hint = (f"; its string fields are {', '.join(repr(k) for k in strings[:3])}: name one "
                "with --field" if strings else "")
        return None, f"no {field!r} field (or it is null){hint}"
    if isinstance(value, list) and all(type(t) is int for t in value):
        return None, f"{field!r} holds token ids, not text: plan this dataset without --tokenizer"
    return None, f"{field!r} is {type(value).__name__}, not a string of text"


def _utf8_problem(e: UnicodeDecodeError) -> str:
    """What is wrong with a line that ``e`` failed to decode (its first bad byte)."""
    return (f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start + 1} of the "
            "line); re-encode the file as UTF-8 (iconv -f LATIN1 -t UTF-8, say)")


def surrogate_problem(text: str) -> str:
    """Why no tokenizer can encode ``text`` (an unpaired surrogate, which a JSON escape such as
    ``"\\ud800"`` gives), or "" when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text holds an unpaired surrogate ({text[e.start]!r} at character "
                f"{e.start}), which no tokenizer encodes")
    return ""


def decode_record(raw: bytes, field: str) -> tuple[str | None, str]:
    """(text, "") or (None, the problem) of one JSONL record: a line's bytes without its
    newline (and, for a file's first line, without its ``BOM``).

    The records of a text plan are read by sample index through this at training
    (``runtime.data.text_records``), so training reads the very texts, and finds the very bad
    records, that the planner's ``iter_texts`` (decoding whole chunks at once, the same rules)
    counted. An unpaired surrogate is found here, where ``iter_texts`` leaves it to
    ``encode_checked`` (only when the tokenizer fails): the same records either way.
    """
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, _utf8_problem(e)
    text, problem = record_text(line, field)
    if text is not None and (problem := surrogate_problem(text)):
        return None, problem
    return text, problem


def _jsonl_texts(path: str, field: str, bad: BadRecords) -> Iterator[TextBatch]:
    chunks = (iter_decompressed_lines(path, CHUNK_BYTES) if compression_of(path)
              else iter_line_chunks(path))
    line0 = sample = 0
    for base, chunk in chunks:
        raw = bytes(chunk)
        if base == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        try:
            lines = raw.decode("utf-8").split("\n")[:-1]
            broken: dict[int, str] = {}
        except UnicodeDecodeError:
            lines, broken = [], {}
            for j, piece in enumerate(raw.split(b"\n")[:-1]):
                try:
                    lines.append(piece.decode("utf-8"))
                except UnicodeDecodeError as e:
                    broken[j] = _utf8_problem(e)
                    lines.append("x")  # a record: it takes a sample index
        sample0 = sample
        texts, samples, places = [], [], []
        for j, line in enumerate(lines):
            if not line.strip(_BLANK):
                continue
            text, problem = (None, broken[j]) if j in broken else record_text(line, field)
            if text is not None:
                texts.append(text)
                samples.append(sample)
                places.append(line0 + j + 1)
            else:
                bad.add(sample, f"{path}:{line0 + j + 1}", problem)
            sample += 1
        line0 += len(lines)
        yield TextBatch(sample0, sample - sample0, texts, np.array(samples, dtype=np.int64),
                        np.array(places, dtype=np.int64), len(chunk))


def _is_string(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_string_view(t))


def null_problem(field: str) -> str:
    """The problem of a Parquet / Arrow row whose text column is null."""
    return f"{field!r} is null"


def check_text_column(path: str, field: str, schema: pa.Schema) -> None:
    """Refuse a Parquet / Arrow file whose ``field`` is not a string column (``string``,
    ``large_string``, ``string_view``): its rows hold no text.

    Raises:
        ValueError: naming the file, the column's type and the string columns it has.
    """
    if field not in schema.names:
        strings = [f.name for f in schema if _is_string(f.type)]
        hint = f"; its string columns are {strings}: name one with --field" if strings else ""
        raise ValueError(f"{path}: no column {field!r} (columns are {schema.names}){hint}")
    t = schema.field(field).type
    if not _is_string(t):
        extra = (": it holds token ids; plan this dataset without --tokenizer"
                 if pa.types.is_list(t) or pa.types.is_large_list(t) else "")
        raise ValueError(f"{path}: column {field!r} has type {t}, not a string column of "
                         f"text{extra}")


def _columnar_texts(path: str, field: str, schema: pa.Schema, batches: Iterator[pa.RecordBatch],
                    bad: BadRecords) -> Iterator[TextBatch]:
    check_text_column(path, field, schema)
    row0 = 0
    try:
        for batch in batches:
            col = batch.column(field)
            n = batch.num_rows
            texts: list[str | None] = col.to_pylist()
            nulls = [i for i, s in enumerate(texts) if s is None]
            if nulls:
                bad.add_rows(np.array(nulls, dtype=np.int64) + row0,
                             lambda i: (f"{path}: row {i}", null_problem(field)))
            rows = np.arange(row0, row0 + n, dtype=np.int64)
            if nulls:
                keep = np.ones(n, dtype=bool)
                keep[nulls] = False
                rows = rows[keep]
            good = [s for s in texts if s is not None]
            yield TextBatch(row0, n, good, rows, rows)
            row0 += n
    except ARROW_ERRORS as e:
        raise ValueError(f"{path}: unreadable after row {row0} ({e})") from None


def iter_texts(path: str, fmt: str, field: str, bad: BadRecords) -> Iterator[TextBatch]:
    """The documents of one file in batches of consecutive samples (bad ones go to ``bad``).

    Raises:
        ValueError: a format that holds no text, a missing or non-string column, or a bad
            record without ``skip_bad_records``.
    """
    if fmt == "jsonl":
        yield from _jsonl_texts(path, field, bad)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except ARROW_ERRORS as e:
            raise ValueError(f"{path}: not a Parquet file ({e})") from None
        with pf:
            cols = [field] if field in pf.schema_arrow.names else None
            yield from _columnar_texts(path, field, pf.schema_arrow, pf.iter_batches(
                batch_size=_ROWS, columns=cols), bad)
    elif fmt == "arrow":
        with pa.memory_map(path, "r") as source:
            schema, batches = arrow_batches(source, path)
            yield from _columnar_texts(path, field, schema, batches, bad)
    else:
        raise ValueError(f"{path}: a {fmt} dataset holds token ids or lengths, not text: plan "
                         "it without --tokenizer (text corpora are JSONL, Parquet or Arrow "
                         "files with a string field)")


def text_pieces(texts: list[str]) -> Iterator[tuple[int, int]]:
    """(start, stop) slices of ``texts`` of about ``BATCH_CHARS`` characters each."""
    start = size = 0
    for i, t in enumerate(texts):
        size += len(t)
        if size >= BATCH_CHARS:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def encode_checked(run: Callable[[list[str]], T], texts: list[str], batch: TextBatch,
                   first: int, path: str, fmt: str, bad: BadRecords) -> tuple[T, list[int]]:
    """(``run(texts)``, positions in ``texts`` of bad records whose text was blanked).

    ``texts`` are ``batch.texts[first:]``. A text no tokenizer can take (an unpaired surrogate
    escape such as ``"\\ud800"``, which JSON allows) is a bad record: named, or blanked and
    run again when skipping.
    """
    try:
        return run(texts), []
    except Exception:  # tokenizers raises its own errors for a str it cannot convert
        dropped = []
        for k, t in enumerate(texts):
            problem = surrogate_problem(t)
            if problem:
                bad.add(int(batch.samples[first + k]),
                        place_text(path, fmt, int(batch.places[first + k])), problem)
                dropped.append(k)
        if not dropped:
            raise
        texts = [("" if k in dropped else t) for k, t in enumerate(texts)]
        return run(texts), dropped


def count_lengths(path: str, fmt: str, field: str, encoder: TextEncoder, bad: BadRecords,
                  progress: Callable[[int], None] | None = None) -> NDArray[np.int64]:
    """Token count of every sample of one text file; bad records get 0 (and go to ``bad``).

    ``progress(n)`` is told of each batch's input bytes (JSONL) or rows (columnar).
    """
    parts = [np.zeros(0, dtype=np.int64)]
    for batch in iter_texts(path, fmt, field, bad):
        out = np.zeros(batch.num_samples, dtype=np.int64)
        for a, b in text_pieces(batch.texts):
            counts, dropped = encode_checked(encoder.count, batch.texts[a:b], batch, a, path,
                                             fmt, bad)
            counts[dropped] = 0
            out[batch.samples[a:b] - batch.sample0] = counts
        over = np.flatnonzero(out > MAX_LENGTH)
        for i in over.tolist():
            k = int(np.searchsorted(batch.samples, batch.sample0 + i))
            bad.add(batch.sample0 + i, place_text(path, fmt, int(batch.places[k])),
                    f"{int(out[i])} tokens, more than the {MAX_LENGTH} a plan holds per sample")
            out[i] = 0
        parts.append(out)
        if progress is not None:
            progress(batch.nbytes or batch.num_samples)
    return np.concatenate(parts)


def progress_total(path: str, fmt: str) -> int:
    """What ``count_lengths`` reports progress in for one file: bytes of a plain JSONL file
    (a compressed one counts decompressed bytes, so 0: unknown), rows of a columnar one."""
    if fmt == "jsonl":
        return 0 if compression_of(path) else os.path.getsize(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return int(pq.ParquetFile(path).metadata.num_rows)
        except ARROW_ERRORS:
            return 0
    return 0


def text_unit(items: list[str]) -> str:
    """The progress unit of tokenizing ``items``: bytes of JSONL, rows of columnar files."""
    return "B" if items and ".jsonl" in items[0].lower() else "row"

