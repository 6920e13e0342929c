"""Megatron indexed datasets (``prefix.bin`` + ``prefix.idx``): lengths by document or sequence.

The index (``prefix.idx``, little-endian), as Megatron-core's ``_IndexWriter``
(``megatron/core/datasets/indexed_dataset.py``) writes it::

    b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count <Q
    | document count <Q | sequence lengths int32[sequences] | sequence pointers int64[sequences]
    | document indices int64[document count]  (| sequence modes int8[sequences], multimodal)

A *sequence* is what one pointer and one length address (one ``IndexedDatasetBuilder.add_item``);
a *document* is a run of sequences: ``document_indices`` starts at 0, ends at the sequence count
and document d is sequences ``[document_indices[d], document_indices[d + 1])`` (one
``end_document`` each), so the header's document count is the number of documents + 1. Data
preprocessed without sentence splitting has one sequence per document; with
``--split-sentences`` a sequence is a sentence, and a 50-document dataset has, say, 150.

Unit (``dcp-plan --megatron-unit``, the plan header's ``dataset.megatron_unit``): a sample is a
*document* by default (its sequences' tokens, concatenated), or one *sequence*. The document is
the text a user wrote and the unit a long-context plan must keep whole (a sentence planned as
its own sample would never attend to the rest of its document). Megatron-core's GPTDataset
itself samples sequences (``GPTDataset.numel_low_level_dataset`` is the sequence count; BERT
and T5 sample documents): ``sequence`` plans what GPTDataset would see. Plans made before the
unit was recorded planned sequences, so a header without it reads as ``sequence``.

Lengths come from the index alone; ``prefix.bin`` is only measured (a stat), never read. Trade-
off: a document's sequences must lie back to back in ``.bin`` (Megatron's writer always puts
them so), so a document is one slice for every reader; an index with a gap inside a document is
refused rather than read through a second mapping.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.fileguard import check_input
from planner.planfile.schema import LEGACY_MEGATRON_UNIT, MEGATRON_UNITS
from planner.sources.formats import MAX_LENGTH, BadRecords

__all__ = ["DEFAULT_UNIT", "LEGACY_UNIT", "UNITS", "MegatronSamples", "read_megatron",
           "read_megatron_index", "read_megatron_samples", "write_megatron_dataset"]

UNITS = MEGATRON_UNITS
"""What one sample of a Megatron dataset is (``dcp-plan --megatron-unit``)."""
DEFAULT_UNIT = "document"
"""The unit of a plan made without ``--megatron-unit``."""
LEGACY_UNIT = LEGACY_MEGATRON_UNIT
"""The unit of a plan whose header records none (made before the unit was recorded)."""

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
_DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}
_FLOAT_CODES = (6, 7)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MegatronSamples:
    """A Megatron dataset's samples in one unit: where each one's tokens lie in ``.bin``."""

    unit: str
    """``document`` or ``sequence`` (UNITS)."""
    lengths: NDArray[np.int64]
    """Tokens per sample, as the index says (a damaged index may give a negative sequence)."""
    starts: NDArray[np.int64]
    """Token (element, not byte) offset of each sample's first token in ``.bin``."""
    dtype: np.dtype[Any]
    """The token dtype of ``.bin``."""
    num_sequences: int
    """Sequences of the index."""
    num_documents: int
    """Documents of the index (0: it has no document indices)."""


def _read_index(prefix: str | os.PathLike[str]) -> tuple[
        NDArray[np.int64], NDArray[np.int64], np.dtype[Any], NDArray[np.int64]]:
    """(sequence lengths, byte pointers, token dtype, document indices) of ``prefix.idx``."""
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
        documents = np.fromfile(f, dtype="<i8", count=doc_count).astype(np.int64)
    dtype = np.dtype(_DTYPES[code])
    _check_pointers(idx, sizes, pointers, dtype)
    return sizes, pointers, dtype, documents


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
    sizes, pointers, dtype, _ = _read_index(prefix)
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


def _documents(idx: str, sizes: NDArray[np.int64], pointers: NDArray[np.int64],
               dtype: np.dtype[Any], documents: NDArray[np.int64]
               ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(lengths, token starts) of the documents; refuses document indices that do not
    partition the sequences in order, or a document whose sequences are not back to back."""
    hint = "; plan its sequences with --megatron-unit sequence"
    count = len(sizes)
    if len(documents) == 0:
        raise ValueError(f"{idx}: the index has no document indices{hint}")
    if documents[0] != 0 or documents[-1] != count:
        raise ValueError(f"{idx}: document indices run from {int(documents[0])} to "
                         f"{int(documents[-1])}, not from 0 to the {count} sequences (a damaged "
                         f"index){hint}")
    back = np.flatnonzero(np.diff(documents) < 0)
    if back.size:
        d = int(back[0]) + 1
        raise ValueError(f"{idx}: document {d} starts at sequence {int(documents[d])}, before "
                         f"document {d - 1} (sequence {int(documents[d - 1])}): document "
                         f"indices must not decrease (a damaged index){hint}")
    item = dtype.itemsize
    # Sequence j + 1 continues document d's slice unless it starts a document.
    gap = pointers[1:] != pointers[:-1] + np.maximum(sizes[:-1], 0) * item
    first = np.zeros(count, dtype=bool)
    first[documents[:-1][documents[:-1] < count]] = True
    bad = np.flatnonzero(gap & ~first[1:]) + 1
    if bad.size:
        j = int(bad[0])
        d = int(np.searchsorted(documents, j, "right")) - 1
        raise ValueError(f"{idx}: document {d}: sequence {j} starts at byte {int(pointers[j])}, "
                         f"not where sequence {j - 1} ends: a document's sequences must lie "
                         f"back to back in the .bin (as Megatron's writer puts them){hint}")
    total = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(sizes, out=total[1:])
    lengths = total[documents[1:]] - total[documents[:-1]]
    negative = sizes < 0
    if negative.any():  # a document of a negative sequence is damaged: bad, like the sequence
        runs = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(negative, out=runs[1:])
        lengths[runs[documents[1:]] > runs[documents[:-1]]] = -1
    head = np.minimum(documents[:-1], max(count - 1, 0))
    starts = pointers[head] // item if count else np.zeros(len(lengths), np.int64)
    return lengths.astype(np.int64), starts.astype(np.int64)


def read_megatron_samples(prefix: str | os.PathLike[str], unit: str = DEFAULT_UNIT
                          ) -> MegatronSamples:
    """The samples of a Megatron dataset in ``unit`` (the module docstring defines both).

    Raises:
        ValueError: ``unit`` is not one of UNITS; the index is unreadable (``read_megatron_index``);
            for documents, document indices that do not run in order from 0 to the sequence
            count, or a document whose sequences are not back to back (naming it).
    """
    if unit not in UNITS:
        raise ValueError(f"Megatron unit {unit!r} is not one of {', '.join(UNITS)}")
    sizes, pointers, dtype, documents = _read_index(prefix)
    num_documents = max(len(documents) - 1, 0)
    if unit == "sequence":
        lengths, starts = sizes, pointers // dtype.itemsize
    else:
        lengths, starts = _documents(f"{os.fspath(prefix)}.idx", sizes, pointers, dtype,
                                     documents)
    return MegatronSamples(unit=unit, lengths=lengths, starts=starts, dtype=dtype,
                           num_sequences=len(sizes), num_documents=num_documents)


def read_megatron(prefix: str, bad: BadRecords, unit: str = DEFAULT_UNIT) -> MegatronSamples:
    """The samples of a Megatron dataset (``read_megatron_samples``) with lengths fit to plan:
    an empty (or negative) sample, or a document over MAX_LENGTH tokens, is a bad record."""
    samples = read_megatron_samples(prefix, unit)
    sizes, dtype = samples.lengths.copy(), samples.dtype
    bin_path = f"{prefix}.bin"
    if len(sizes) and os.path.isfile(bin_path):
        # Only the size of the token file is checked (a stat, not a read): a truncated or
        # mismatched .bin would otherwise fail much later, inside a training run.
        ends = (samples.starts + np.maximum(sizes, 0)) * dtype.itemsize
        need = int(np.max(ends))
        have = os.path.getsize(bin_path)
        if have < need:
            last = int(np.argmax(ends > have))
            raise ValueError(f"{bin_path}: holds {have} bytes, its index addresses {need} "
                             f"({unit} {last} and later lie past the end: truncated?)")

    def describe(i: int) -> tuple[str, str]:
        where = f"{prefix}.idx: {unit} {i}"
        if sizes[i] > MAX_LENGTH:
            return where, (f"length {sizes[i]}, more than the {MAX_LENGTH} tokens a plan holds "
                           "per sample (plan its sequences with --megatron-unit sequence)")
        if unit == "document" and sizes[i] < 0:
            return where, "holds a sequence of negative length (a damaged index)"
        return where, f"length {sizes[i]}; lengths must be positive"

    bad_rows = np.flatnonzero((sizes <= 0) | (sizes > MAX_LENGTH))
    bad.add_rows(bad_rows, describe)
    sizes[bad_rows] = 0
    return MegatronSamples(unit=unit, lengths=sizes, starts=samples.starts, dtype=dtype,
                           num_sequences=samples.num_sequences,
                           num_documents=samples.num_documents)


def write_megatron_dataset(prefix: str | os.PathLike[str],
                           docs: Sequence[Sequence[int] | NDArray[np.integer[Any]]],
                           dtype: type[np.integer[Any]] | np.dtype[Any] = np.int32) -> None:
    """Write ``prefix.bin`` and ``prefix.idx`` in Megatron's MMapIndexedDataset format.

    Each document is one sequence (document indices ``0..len(docs)``), as Megatron's
    preprocessing writes it without sentence splitting. For tests and sample data (documents of
    several sequences: Megatron-core's own ``IndexedDatasetBuilder``).

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
