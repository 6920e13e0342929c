"""Open the dataset a plan was made for and prove it is that dataset: one entry for every engine.

``open_plan_source(reader, paths)`` is what the native trainer, its oracle, the evaluators and
the Megatron and torchtitan adapters call, so they all read and check a dataset alike:

1. bad records are read as the planner counted them: a plan made with ``--skip-bad-records``
   that skipped some opens the source with ``skip_bad_records`` (those records are empty
   samples), so training does not stop on the line the planner skipped; and the tokens are
   read from the field the plan was made with (``dcp-plan --field``, the header's
   ``dataset.field``; ``field=`` overrides it, ``planner.sources.fieldname``), every file's
   first sample decoded once so a field that holds lengths, not tokens, fails here; a Megatron
   file is read in the plan's unit (``dataset.megatron_unit``: documents or sequences; none
   recorded: sequences, as plans made before it was recorded were);
2. the lengths fingerprint (``PlanReader.check_dataset``): a changed, reordered, truncated or
   extended dataset is refused;
3. with ``dcp-plan --fingerprint content``, the content fingerprint (``verify_content``): every
   token is read through this runtime's own readers (the tokens training would get) and hashed
   as ``planner.sources.content`` defines; a file whose tokens changed is refused, named.

Cost of 3, paid once at start-up, before any step: every token of every *copy* of the dataset
is read and hashed once. The ranks that read one copy (same host, same files by device and
inode: ``_copy_group``) deal its blocks (``planner.sources.content``) round-robin and sum their
digests in one all-reduce over their group (32 bytes per block), so each copy is hashed whole,
whatever the split: a node whose own copy was edited fails, and one all-reduce of a flag makes
every rank fail with it. Per rank that is ``tokens / ranks reading its copy`` reads (one copy on
a shared file system: ``tokens / world_size``); BENCHMARKS.md has the rates (Megatron ``.bin``
and Arrow are memory-bound, JSONL pays a ``json.loads`` per record). A run of one process
hashes everything itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray

from planner.sources.content import CHUNK_TOKENS, block_digest, block_starts, file_digest
from planner.sources.dataset import file_identity
from planner.sources.fieldname import field_hint, replay_field
from planner.sources.textenc import plan_encoder
from runtime.data.plan_reader import PlanReader
from runtime.data.token_text import (
    Reduce,
    Share,
    check_vocab,
    name_mismatch,
    open_text_source,
)
from runtime.data.tokens import MegatronTokens, TokenSource, open_token_source, read_segments

__all__ = ["check_plan_source", "open_plan_source", "plan_skips_records", "verify_content"]

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def plan_skips_records(reader: PlanReader) -> bool:
    """True if the plan was made with ``--skip-bad-records`` and skipped some: the token source
    must then read bad records as empty samples, as the planner counted them."""
    return reader.header.skips_bad_records


def open_plan_source(reader: PlanReader, paths: Paths, *, field: str | None = None,
                     tokenizer: str | None = None, vocab_size: int = 0,
                     vocab_flag: str = "vocab_size") -> TokenSource:
    """The plan's dataset, opened as the planner read it and checked against the plan.

    ``field`` overrides the record field the plan was made with (its header's
    ``dataset.field``; None: that one), for a dataset whose field was renamed since planning;
    the fingerprints still check what it reads.

    A plan of a text corpus (its header's ``dataset.tokenizer``) opens through
    ``runtime.data.token_text``: ``tokenizer`` overrides the recorded tokenizer path (the
    sha256 must match) and ``vocab_size`` (the model's, when known; named ``vocab_flag`` in
    messages) must hold the tokenizer's ids. Both are refused for a plan of token ids.

    Collective when the plan has content fingerprints or is of text, and a process group is
    initialised (every rank must call it, in the same order relative to other collectives).

    Raises:
        ValueError: the dataset is not the plan's (lengths or, with content fingerprints,
            tokens), or its records lack the field or hold no tokens under it, naming the plan
            and the file (and the line, for a record).
    """
    recorded = reader.header.dataset.field
    if reader.header.dataset.tokenizer:
        return _open_text(reader, paths, field, tokenizer, vocab_size, vocab_flag)
    if tokenizer is not None:
        raise ValueError(f"{reader.path}: --tokenizer {tokenizer} given, but the plan was made "
                         "from token ids (its header records no tokenizer); drop --tokenizer")
    try:
        source = open_token_source(paths, skip_bad_records=plan_skips_records(reader),
                                   field=replay_field(recorded, field),
                                   megatron_unit=reader.header.dataset.replay_megatron_unit)
    except ValueError as e:
        message = str(e)
        if message.endswith(": no such file"):
            listed = [str(f["path"]) for f in reader.header.dataset.files] or [
                reader.header.dataset.path]
            flag = "--eval-dataset" if reader.header.kind == "eval" else "--dataset"
            message += (f"; {reader.path} was made from {', '.join(listed)}: give that "
                        f"dataset with {flag}")
        raise ValueError(field_hint(message, recorded, field, str(reader.path))) from None
    try:
        try:
            check_plan_source(reader, source)
            _first_tokens(reader, source)
        except ValueError as e:
            raise ValueError(field_hint(str(e), recorded, field, str(reader.path))) from None
    except BaseException:
        _close(source)
        raise
    return source


def _close(source: object) -> None:
    """Close a source that failed its checks (sources over files have ``close``)."""
    close = getattr(source, "close", None)
    if close is not None:
        close()


def _open_text(reader: PlanReader, paths: Paths, field: str | None, tokenizer: str | None,
               vocab_size: int, vocab_flag: str) -> TokenSource:
    """``open_plan_source`` for a text plan: the plan's tokenizer, the records' counts through
    the fingerprints (the first contradicting sample named), the content fingerprint."""
    encoder = plan_encoder(reader.header.dataset.tokenizer, tokenizer, source=str(reader.path))
    check_vocab(encoder.spec, vocab_size, vocab_flag)
    items = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [
        os.fspath(p) for p in paths]
    name = replay_field(reader.header.dataset.field, field) or "text"
    try:
        source = open_text_source(items, encoder, name,
                                  skip_bad_records=plan_skips_records(reader),
                                  sharing=lambda files: _count_sharing(reader, files))
    except ValueError as e:
        message = str(e)
        if message.endswith(": no such file"):
            listed = [str(f["path"]) for f in reader.header.dataset.files]
            message += (f"; {reader.path} was made from {', '.join(listed)}: give that "
                        "dataset with --dataset")
        raise ValueError(message) from None
    try:
        try:
            reader.check_dataset(source.lengths(), _names(reader, source))
        except ValueError as e:
            rows: dict[str, list[NDArray[np.int64]]] = {
                "sample_index": [], "token_offset": [], "num_tokens": []}
            for step in range(reader.num_steps):
                cols = reader.columns(step)
                for k, v in rows.items():
                    v.append(np.asarray(cols[k], np.int64))
            flat = {k: np.concatenate(v) if v else np.zeros(0, np.int64)
                    for k, v in rows.items()}
            where = name_mismatch(source, flat, reader.header.stats.get("truncated_samples", []))
            raise ValueError(f"{e}{where}: the text or the tokenizer is not the plan's"
                             ) from None
        verify_content(reader, source)
    except BaseException:
        _close(source)
        raise
    return source


def _count_sharing(reader: PlanReader, files: list[str]) -> tuple[Share, Reduce | None]:
    """How the ranks reading one copy of a text corpus share its count at open (as
    ``verify_content`` shares the hashing): this rank's place among them, and the reduce that
    sums their counts and makes one rank's error every rank's. None in a world of one."""
    rank, world = _world()
    if world == 1:
        return (0, 1), None
    members, group = _copy_group(rank, world, files)

    def reduce(parts: list[NDArray[np.int64]], error: str
               ) -> tuple[list[NDArray[np.int64]], str]:
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(members) > 1 and len(flat):
            # Each batch is counted by one rank of the copy, zeros elsewhere: the sum is the count.
            t = torch.from_numpy(flat.copy()).to(_device())
            dist.all_reduce(t, group=group)
            flat = t.cpu().numpy()
        flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=_device())
        dist.all_reduce(flag)
        if int(flag.item()) and not error:
            error = (f"{reader.path}: another rank found a bad record in the text corpus (that "
                     "rank's message names it)")
        return np.split(flat, np.cumsum([len(p) for p in parts])[:-1].tolist()), error

    return (members.index(rank), len(members)), reduce


def check_plan_source(reader: PlanReader, source: TokenSource) -> None:
    """Steps 2 and 3 of the module docstring for a source the caller opened (collective with
    content fingerprints, as ``open_plan_source``)."""
    _check_megatron_unit(reader, source)
    reader.check_dataset(source.lengths(), _names(reader, source))
    verify_content(reader, source)


def _check_megatron_unit(reader: PlanReader, source: TokenSource) -> None:
    """A caller's own source must read Megatron files in the plan's unit: read in the other one
    the lengths fingerprint would refuse it as a changed dataset, which it is not."""
    want = reader.header.dataset.replay_megatron_unit
    for part in getattr(source, "sources", [source]):
        if isinstance(part, MegatronTokens) and part.unit != want:
            raise ValueError(f"{part.prefix}: read as Megatron {part.unit}s, {reader.path} was "
                             f"planned on {want}s (its header's dataset.megatron_unit): open it "
                             f"with open_token_source(..., megatron_unit={want!r}), or with "
                             "open_plan_source, which reads the plan's unit")


def _names(reader: PlanReader, source: TokenSource) -> list[str]:
    """The files ``source`` read, in the plan's order (a many-file source's names, a single
    file's own path), which may differ from the paths the plan lists (``--dataset elsewhere``)."""
    names = [str(n) for n in getattr(source, "names", [])]
    own = getattr(source, "path", None) or getattr(source, "prefix", None)
    if not names and len(reader.header.dataset.files) == 1 and own is not None:
        names = [str(own)]
    return names or [str(f["path"]) for f in reader.header.dataset.files]


def _first_tokens(reader: PlanReader, source: TokenSource) -> None:
    """Decode the first non-empty sample of every file: a JSONL field that holds integer
    lengths (a plan made from lengths) indexes fine and would fail only at its first step."""
    lengths = np.asarray(source.lengths(), dtype=np.int64)
    counts = [int(f["num_samples"]) for f in reader.header.dataset.files] or [len(lengths)]
    bounds = np.cumsum([0, *counts])
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        kept = np.flatnonzero(lengths[a:b] > 0)
        if len(kept):
            i = np.array([a + int(kept[0])], np.int64)
            read_segments(source, i, np.zeros(1, np.int64), np.ones(1, np.int64))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl" else torch.device("cpu"))


def _copy_group(rank: int, world: int, names: Sequence[str]
                ) -> tuple[list[int], dist.ProcessGroup | None]:
    """The ranks that read the same copy of the dataset as this one (same host, same files by
    device and inode) and their process group (collective: every rank creates every group,
    in the same order). Those ranks share the hashing; each copy is hashed whole."""
    if world == 1:
        return [0], None
    key = (socket.gethostname(), [repr(file_identity(n)) for n in names])
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, key)
    mine: tuple[list[int], dist.ProcessGroup | None] = ([rank], None)
    seen: list[Any] = []
    for k in keys:
        if k in seen:
            continue
        seen.append(k)
        ranks = [r for r, other in enumerate(keys) if other == k]
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (ranks, group)
    return mine


def _block(source: TokenSource, lengths: NDArray[np.int64], a: int, b: int) -> bytes:
    """Digest of the block holding samples [a, b), read in pieces of about CHUNK_TOKENS."""
    kept = a + np.flatnonzero(lengths[a:b] > 0)
    n = lengths[kept]
    piece = (np.cumsum(n) - n) // CHUNK_TOKENS
    cuts = np.r_[0, np.flatnonzero(np.diff(piece)) + 1, len(kept)]

    def pieces() -> Iterator[NDArray[np.int64]]:
        for x, y in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
            s = kept[x:y]
            yield read_segments(source, s, np.zeros(len(s), np.int64), lengths[s])

    return block_digest(pieces())


def verify_content(reader: PlanReader, source: TokenSource) -> None:
    """Refuse ``source`` unless every file's tokens hash to the plan's content fingerprint
    (nothing to do for a plan with lengths fingerprints only). See the module docstring for
    the cost and the collective.

    Raises:
        ValueError: naming every file whose tokens changed (on every rank alike).
    """
    files = reader.header.dataset.files
    if not any(f.get("content_fingerprint") for f in files):
        return
    lengths = np.asarray(source.lengths(), dtype=np.int64)
    names = _names(reader, source)
    bounds = np.cumsum([0] + [int(f["num_samples"]) for f in files])
    blocks: list[tuple[int, int, int]] = []  # (file, first sample, end sample), global indices
    for j in range(len(files)):
        starts = block_starts(lengths[bounds[j]:bounds[j + 1]]) + bounds[j]
        blocks += [(j, int(x), int(y)) for x, y in zip(starts[:-1], starts[1:], strict=True)]
    rank, world = _world()
    members, group = _copy_group(rank, world, names)
    mine, share = members.index(rank), len(members)
    digests = np.zeros((len(blocks), 32), dtype=np.uint8)
    for g in range(mine, len(blocks), share):
        _, a, b = blocks[g]
        digests[g] = np.frombuffer(_block(source, lengths, a, b), dtype=np.uint8)
    if share > 1 and len(blocks):
        # Each block's digest is non-zero on one rank of the copy only: the sum is that digest.
        t = torch.from_numpy(digests.view(np.int64).copy()).to(_device())
        dist.all_reduce(t, group=group)
        digests = t.cpu().numpy().view(np.uint8).reshape(len(blocks), 32)
    owner = np.array([j for j, _, _ in blocks], dtype=np.int64)
    changed = []
    for j, f in enumerate(files):
        got = file_digest([digests[g].tobytes() for g in np.flatnonzero(owner == j)])
        if got != f.get("content_fingerprint"):
            changed.append(f"{names[j] if j < len(names) else f['path']} (content fingerprint "
                           f"{got}, the plan's {f.get('content_fingerprint')})")
    if world > 1:
        # Every copy is checked by its own ranks: a copy edited on one node fails every rank.
        flags = torch.tensor([1 if changed else 0], dtype=torch.int64, device=_device())
        dist.all_reduce(flags)
        if int(flags.item()) and not changed:
            raise ValueError(f"{reader.path}: the tokens of the dataset changed since planning "
                             "in the copy another rank reads (another node's copy; its ranks "
                             "name the file): this is not the dataset the plan was made for")
    if changed:
        raise ValueError(f"{reader.path}: the tokens of {'; '.join(changed)} changed since "
                         "planning (the lengths did not): this is not the dataset the plan was "
                         "made for")
