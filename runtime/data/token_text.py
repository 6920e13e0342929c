"""Token source of a text corpus: records tokenized on the fly with the plan's tokenizer.

A plan of a text corpus (``dcp-plan --tokenizer``) records its tokenizer in the header
(``dataset.tokenizer``: ``planner.sources.textenc.TokenizerSpec``); ``plan_source`` loads that
tokenizer with ``planner.sources.textenc.plan_encoder`` (from the recorded path, or
``--tokenizer PATH``: the sha256 must match), the planner's own loader, and
``open_text_source`` gives a ``TokenSource`` whose ``read`` / ``read_many`` tokenize the records a
microbatch needs through ``TextEncoder.encode``, the planner's own tokenization, so training
sees exactly the tokens whose counts were planned.

Checks, so a changed text or tokenizer never trains silently:

1. at open, every record is counted (``TextEncoder.count``, batches on every core) and those
   lengths go through the plan's fingerprints like any dataset's; when they differ, the first
   sample whose count contradicts the plan's rows is named (file, line or row, sample index);
2. at every read, each record's token count is checked against the count made at open (a file
   edited during the run is refused, naming the sample).

Trade-off: the count at open costs one pass of the tokenizer over the corpus, shared by the
ranks that read one copy of it (``plan_source``: batches dealt round-robin, one all-reduce of
the counts; BENCHMARKS.md has the rate); in exchange no sidecar file of token ids exists to go
stale, and a text or tokenizer that is not the plan's is refused before the first step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from planner.sources.dataset import expand_paths
from planner.sources.lengths import DATASET_SUFFIXES
from planner.sources.textenc import TextEncoder, TokenizerSpec
from runtime.data.shard import ranges_to_indices
from runtime.data.text_records import TextRecords, open_text_records
from runtime.data.token_files import check_many, check_read
from runtime.data.tokens import ConcatTokens, TokenSource

__all__ = ["COUNT_BATCH", "TextTokens", "check_vocab", "count_records", "name_mismatch",
           "open_text_source"]

COUNT_BATCH = 4096
"""Records per ``TextEncoder.count`` call at open: big enough for the tokenizer's threads,
small enough that the texts in flight stay a few MB."""
CACHE_TOKENS = 1 << 20
"""Token ids of the most recently read records kept (8 MB): a sample split over several
microbatches, or read again by the next step's rows, is tokenized once, not once a segment."""


def check_vocab(spec: TokenizerSpec, vocab_size: int, flag: str = "vocab_size") -> None:
    """Refuse a model vocabulary smaller than the tokenizer's (ids would be out of range)."""
    if vocab_size and vocab_size < spec.vocab_size:
        raise ValueError(f"{flag} {vocab_size} is below the vocabulary of the plan's tokenizer "
                         f"{spec.path} ({spec.vocab_size} ids): give {flag} {spec.vocab_size} "
                         "or more")


Share = tuple[int, int]
"""(this rank's place, ranks sharing the count): batch g of the corpus is counted by the rank
whose place is ``g % ranks``; (0, 1) counts everything."""
Reduce = Callable[[list[NDArray[np.int64]], str], tuple[list[NDArray[np.int64]], str]]
"""Sums the partial counts (one array per file) over the ranks sharing them and agrees on an
error (each rank's message, '' for none) on every rank: collective."""


def count_records(files: Sequence[TextRecords], encoder: TextEncoder, *,
                  skip_bad_records: bool = False, share: Share = (0, 1)
                  ) -> list[NDArray[np.int64]]:
    """Each file's record counts, for this rank's batches of ``COUNT_BATCH`` records (0 for the
    others'). Batches are dealt over the whole corpus, so many small files share too.

    Raises:
        ValueError: a bad record (``runtime.data.text_records``: file, line or row, sample, the
            planner's problem), unless ``skip_bad_records`` (then it counts 0, as planned).
    """
    mine, ranks = share
    out, g = [], 0
    for records in files:
        counts = np.zeros(records.num_samples, np.int64)
        for a in range(0, records.num_samples, COUNT_BATCH):
            g += 1
            if (g - 1) % ranks != mine:
                continue
            rows = range(a, min(a + COUNT_BATCH, records.num_samples))
            texts = records.texts(rows)
            bad = [j for j, t in enumerate(texts) if t is None]
            if bad and not skip_bad_records:
                raise ValueError(bad_record(records, int(rows[bad[0]])))
            part = encoder.count([t or "" for t in texts])
            part[bad] = 0
            counts[a:a + len(rows)] = part
        out.append(counts)
    return out


def bad_record(records: TextRecords, row: int) -> str:
    """``FILE: record of sample S (line L): PROBLEM`` for a bad record (the planner's problem,
    so the message says what ``dcp-plan`` says of that line)."""
    return (f"{records.path}: record of sample {row} ({records.where(row)}): "
            f"{records.problem(row)}")


class TextTokens:
    """One file's records, tokenized when read (see the module docstring); ``lengths``: their
    counts (``count_records``)."""

    def __init__(self, records: TextRecords, encoder: TextEncoder,
                 lengths: NDArray[np.int64], *, skip_bad_records: bool = False) -> None:
        self.path = records.path
        self.records, self.encoder = records, encoder
        self.skip_bad_records = skip_bad_records
        assert len(lengths) == records.num_samples
        self._lengths = np.asarray(lengths, np.int64)
        self._cache: OrderedDict[int, NDArray[np.int64]] = OrderedDict()
        self._cached = 0

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    def lengths(self) -> NDArray[np.int64]:
        return self._lengths

    def tokens(self, rows: Sequence[int]) -> list[NDArray[np.int64]]:
        """Each row's whole token ids, checked against the count made at open."""
        missing = [r for r in dict.fromkeys(rows) if r not in self._cache]
        texts = self.records.texts(missing)
        for r, t, ids in zip(missing, texts, self.encoder.encode([t or "" for t in texts]),
                             strict=True):
            if t is None:  # bad since open (a file edited) unless skipped as planned
                if not self.skip_bad_records:
                    raise ValueError(bad_record(self.records, r))
                ids = ids[:0]  # a skipped record is an empty sample: the plan's length 0
            want = int(self._lengths[r])
            if len(ids) != want:
                raise ValueError(
                    f"{self.path}: record of sample {r} ({self.records.where(r)}) tokenizes to "
                    f"{len(ids)} tokens, {want} when the run started: the file changed while "
                    "it was read; this is not the dataset the plan was made for")
            self._cache[r] = ids
            self._cached += len(ids)
        out = []
        for r in rows:
            self._cache.move_to_end(r)
            out.append(self._cache[r])
        # Least recently read first out; this call's rows stay (they were just moved last).
        while self._cached > CACHE_TOKENS and len(self._cache) > len(rows):
            self._cached -= len(self._cache.popitem(last=False)[1])
        return out

    def read(self, sample_index: int, offset: int, length: int) -> NDArray[np.int64]:
        check_read(self.path, self._lengths, sample_index, offset, length)
        return self.tokens([sample_index])[0][offset:offset + length]

    def read_many(self, sample_index: NDArray[np.int64], offset: NDArray[np.int64],
                  length: NDArray[np.int64]) -> NDArray[np.int64]:
        check_many(self.path, self._lengths, sample_index, offset, length)
        # One encode for the distinct samples (a split sample appears once per segment).
        unique, inverse = np.unique(sample_index, return_inverse=True)
        ids = self.tokens(unique.tolist())
        starts = np.cumsum([0] + [len(t) for t in ids])
        flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        return flat[ranges_to_indices(starts[inverse] + offset, length)]


def open_text_source(paths: Sequence[str], encoder: TextEncoder, field: str, *,
                     skip_bad_records: bool = False,
                     sharing: Callable[[list[str]], tuple[Share, Reduce | None]] | None = None
                     ) -> TokenSource:
    """The text corpus at ``paths`` (files, directories, globs in the planner's order) as one
    token source tokenized by ``encoder`` from the records' ``field``.

    ``sharing(files)`` gives this rank's share of the count at open and the collective that
    completes it (``plan_source``: the ranks reading one copy of the files); None: this
    process counts every record.
    """
    files = [f for f, _ in expand_paths(list(paths), DATASET_SUFFIXES)]
    records = [open_text_records(f, field) for f in files]
    share, reduce = sharing(files) if sharing is not None else ((0, 1), None)
    error = ""
    try:
        counts = count_records(records, encoder, skip_bad_records=skip_bad_records, share=share)
    except ValueError as e:
        error, counts = str(e), [np.zeros(r.num_samples, np.int64) for r in records]
    if reduce is not None:  # every rank, an error or not: the collective must not hang
        counts, error = reduce(counts, error)
    if error:
        raise ValueError(error)
    sources = [TextTokens(r, encoder, n, skip_bad_records=skip_bad_records)
               for r, n in zip(records, counts, strict=True)]
    if len(sources) == 1 and list(paths) == files:
        return sources[0]
    return ConcatTokens(sources, files)


def name_mismatch(source: TokenSource, rows: dict[str, NDArray[np.int64]],
                  truncated: Sequence[Sequence[int]] = ()) -> str:
    """The first sample whose count contradicts the plan's rows (``rows``: every step's
    ``sample_index``, ``token_offset``, ``num_tokens``; ``truncated``: the header's
    ``[sample, kept tokens]``), as ``; sample S (FILE, line L) holds N tokens with this
    tokenizer, the plan's rows cover M``; '' if none does (a sample the plan never places)."""
    lengths = np.asarray(source.lengths(), np.int64)
    s, end = rows["sample_index"], rows["token_offset"] + rows["num_tokens"]
    if len(s) and int(s.max()) >= len(lengths):
        return f"; the plan reads sample {int(s.max())}, the dataset holds {len(lengths)}"
    covered = np.zeros(len(lengths), np.int64)
    np.maximum.at(covered, s, end)
    want = lengths.copy()
    for i, kept in truncated:
        want[int(i)] = min(int(want[int(i)]), int(kept))
    bad = np.flatnonzero((covered > 0) & (covered != want))
    if not len(bad):
        return ""
    i = int(bad[0])
    sub, local = source, i
    if isinstance(source, ConcatTokens):
        f = int(np.searchsorted(source._starts, i, "right")) - 1
        sub, local = source.sources[f], i - int(source._starts[f])
    place = f"{sub.path}, {sub.records.where(local)}" if isinstance(sub, TextTokens) else "?"
    return (f"; sample {i} ({place}) holds {int(lengths[i])} tokens with this tokenizer, the "
            f"plan's rows cover {int(covered[i])}")
