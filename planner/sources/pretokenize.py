"""A text corpus tokenized once into a Megatron indexed dataset (``dcp-plan tokenize``).

Planning from text (``dcp-plan DATA --tokenizer``) keeps the text and tokenizes it at training
time too; tokenizing once instead gives the format Megatron-LM trains on (``PREFIX.bin`` /
``PREFIX.idx``, ``planner.sources.megatron_write``), which ``dcp-plan``, ``dcp-train`` and
Megatron-LM then read many times without a tokenizer.

Documents are the records of the files in dataset order (``planner.sources.dataset``), each
tokenized as ``TextEncoder.encode`` does for planning (the same BOS / EOD policies), so document
``d`` of the output has the token count a text plan gives its record. Two kinds of record are
not written, as Megatron-LM's ``preprocess_data.py`` writes no sequence for them: a document of
no tokens (an empty text without BOS or EOD) and, with ``skip_bad_records``, a bad record; the
result counts both, so the output's document ``d`` is the ``d``-th record that has tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.sources.formats import BadRecords
from planner.sources.megatron_write import MegatronWriter, optimal_dtype
from planner.sources.text import TEXT_FIELD, TEXT_FORMATS, encode_checked, iter_texts, text_pieces

if TYPE_CHECKING:
    from planner.sources.textenc import TextEncoder

__all__ = ["TokenizeResult", "tokenize_dataset"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeResult:
    """What ``tokenize_dataset`` wrote and skipped."""

    prefix: str
    num_records: int
    """Records read (bad ones included)."""
    num_documents: int
    """Documents written (one sequence each)."""
    num_tokens: int
    empty_documents: int
    """Records with no tokens, not written."""
    skipped_bad_records: int
    dtype: str
    """The ``.bin``'s token dtype (uint16 or int32)."""
    seconds: float
    """Wall time of the read, tokenization and write."""
    files: tuple[str, ...]


def tokenize_dataset(items: Sequence[str], encoder: TextEncoder, prefix: str, *,
                     field: str | None = None, skip_bad_records: bool = False,
                     overwrite: bool = False, progress: Callable[[int, int], None] | None = None,
                     notice: Callable[[str], None] | None = None) -> TokenizeResult:
    """Tokenize the text of every record of ``items`` into ``prefix.bin`` / ``prefix.idx``.

    Args:
        items: files, directories or globs of JSONL (also .gz/.zst), Parquet or Arrow files.
        encoder: the tokenizer and its policies.
        prefix: the output's prefix.
        field: the text field or column (default ``text``).
        skip_bad_records: leave bad records out (counted) instead of stopping at the first.
        overwrite: replace an existing Megatron dataset at ``prefix``.
        progress: ``progress(done, total)`` in input bytes (JSONL) or rows (Parquet).
        notice: told of dcp outputs found among the inputs (left out).

    Raises:
        ValueError: a file that is not a text corpus, a bad record (file and line), an output
            that exists (without ``overwrite``) or is an input.
    """
    from planner.sources.dataset import expand_paths
    from planner.sources.lengths import DATASET_SUFFIXES, detect_format
    from planner.sources.text import progress_total

    t0 = time.perf_counter()
    files = [name for name, _ in expand_paths(list(items), DATASET_SUFFIXES, notice=notice)]
    opened = [detect_format(f) for f in files]
    for f, (fmt, _) in zip(files, opened, strict=True):
        if fmt not in TEXT_FORMATS:
            raise ValueError(f"{f}: a {fmt} dataset holds token ids or lengths, not text; "
                             "dcp-plan tokenize reads JSONL, Parquet or Arrow files with a "
                             "string field")
    inputs = tuple(files)
    total = sum(progress_total(src, fmt) for fmt, src in opened) if progress else 0
    done = records = empty = skipped = 0
    name = field or TEXT_FIELD
    with MegatronWriter(prefix, optimal_dtype(encoder.spec.vocab_size), overwrite=overwrite,
                        inputs=inputs) as out:
        for fmt, src in opened:
            bad = BadRecords(skip=skip_bad_records)
            for batch in iter_texts(src, fmt, name, bad):
                for a, b in text_pieces(batch.texts):
                    ids, dropped = encode_checked(encoder.encode, batch.texts[a:b], batch, a,
                                                  src, fmt, bad)
                    for k, arr in enumerate(ids):
                        if len(arr) and k not in dropped:
                            out.add(arr)
                        elif k not in dropped:
                            empty += 1
                records += batch.num_samples
                done += batch.nbytes or batch.num_samples
                if progress is not None:
                    progress(done, max(total, done))
            skipped += len(bad.indices())
        if out.num_documents == 0:
            raise ValueError(f"{' '.join(items)}: no document has tokens ({records} records); "
                             "nothing to write")
        num_documents, num_tokens = out.num_documents, out.num_tokens
    return TokenizeResult(prefix=prefix, num_records=records, num_documents=num_documents,
                          num_tokens=num_tokens, empty_documents=empty,
                          skipped_bad_records=skipped, dtype=out.dtype.name,
                          seconds=time.perf_counter() - t0, files=tuple(files))
