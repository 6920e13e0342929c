"""One rank's share of one microbatch: plan rows + token source -> CPU tensors for TE's THD path.

A CP group packs its rows (sequence segments) back to back, each padded to the plan's
``padded_tokens``; every rank of the group derives, from the same plan rows, its own slots of that
packed buffer (``runtime.data.shard``). Rules, per DOMAIN.md:

- padded slots hold token 0, label 0, loss mask 0, position id 0;
- position ids restart at 0 for every row (also for the second segment of a split sample: with
  rotary embeddings only relative positions matter, and the segment cannot see the first one);
- labels are the next token of the same sample. A row's last real token is masked unless the
  sample continues past the row (a split or truncated sample): then it is labelled with the
  sample's next token, so every token keeps the label it has in the whole sample and splitting
  does not change the number of loss tokens. Fillers (``sample_index == -1``) are padding only;
  they appear in cu_seqlens as sequences of real length 0.

Example (k = 1): rows a = [5, 6, 7] (whole sample) and b = [8, 9] (tokens 0..1 of a 3-token
sample whose token 2 is 4), padded to 4 and 2, give tokens [5 6 7 0 8 9], positions
[0 1 2 0 0 1], labels [6 7 0 0 9 4], loss mask [1 1 0 0 1 1], cu_seqlens [0 3 5] and
cu_seqlens_padded [0 4 6].

Pipeline stages: the first stage gets tokens and positions, the last labels and loss mask, every
stage the metadata (cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size). A middle stage reads no
tokens at all. Everything is vectorised numpy over this rank's T / cp_size slots (the full
buffer is never materialised); only the reads loop over rows (not tokens), and only rows with a
slot on this rank are read (all of them with zigzag, a contiguous slice with contiguous).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from runtime.data.plan_reader import GroupRows
from runtime.data.shard import cu_seqlens_np
from runtime.data.tokens import TokenSource
from runtime.data.walk import read, walk


@dataclass(frozen=True, slots=True)
class MicrobatchInputs:
    """What one rank feeds the model for one microbatch (CPU tensors until ``to_device``)."""

    tokens: torch.Tensor | None
    """int64 [T / cp_size]: this rank's token ids; None unless first pipeline stage."""
    position_ids: torch.Tensor | None
    """int64 [T / cp_size]; None unless first pipeline stage."""
    labels: torch.Tensor | None
    """int64 [T / cp_size]; None unless last pipeline stage."""
    loss_mask: torch.Tensor | None
    """float32 [T / cp_size], 1 where the label counts; None unless last pipeline stage."""
    cu_seqlens: torch.Tensor
    """int32 [S + 1], cumulative real lengths of the group's rows (global, not divided by cp)."""
    cu_seqlens_padded: torch.Tensor
    """int32 [S + 1], cumulative padded lengths (global)."""
    max_seqlen: int
    """Largest padded length in the group, from the plan (saves TE a device sync)."""
    cp_size: int
    cp_rank: int
    rank_start: int
    microbatch: int
    num_tokens: int
    """Real tokens in the whole group (all its ranks)."""


def build_microbatch(group_rows: GroupRows, source: TokenSource, *, layout: str,
                     is_first_stage: bool = True, is_last_stage: bool = True) -> MicrobatchInputs:
    """Build this rank's inputs for one microbatch from its group's plan rows.

    Args:
        group_rows: the group's rows and this rank's ``cp_rank`` (``StepPlan.group_for``).
        source: where the tokens are; only the rows' samples are read.
        layout: ``zigzag`` or ``contiguous`` (the plan header's ``layout``).
        is_first_stage: build tokens and position ids (first pipeline stage).
        is_last_stage: build labels and loss mask (last pipeline stage).

    Returns:
        The rank's ``MicrobatchInputs``; see the module docstring for the rules.
    """
    rows = group_rows
    n, padded = rows.num_tokens, rows.padded_tokens
    bad = (padded < n) | (n < 0)
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(f"microbatch {rows.microbatch}: sample {int(rows.sample_index[j])} has "
                         f"{int(n[j])} tokens but {int(padded[j])} padded slots")
    cu_real, cu_pad = cu_seqlens_np(n), cu_seqlens_np(padded)
    meta = dict(
        cu_seqlens=torch.from_numpy(cu_real), cu_seqlens_padded=torch.from_numpy(cu_pad),
        max_seqlen=int(padded.max()) if padded.size else 0, cp_size=rows.cp_size,
        cp_rank=rows.cp_rank, rank_start=rows.rank_start, microbatch=rows.microbatch,
        num_tokens=int(cu_real[-1]),
    )
    if not (is_first_stage or is_last_stage):
        return MicrobatchInputs(tokens=None, position_ids=None, labels=None, loss_mask=None,
                                **meta)  # type: ignore[arg-type]

    # Work in shard space (runtime.data.walk, shared with the MTP targets): the cost scales
    # with T / cp_size, and rows without a slot here are never read.
    w = walk(rows, layout)
    got = read(rows, source, w, with_next=is_last_stage)
    out: dict[str, torch.Tensor | None] = dict(tokens=None, position_ids=None, labels=None,
                                               loss_mask=None)
    if is_first_stage:
        out["tokens"] = torch.from_numpy(got.tokens())
        out["position_ids"] = torch.from_numpy(np.where(w.real, w.pos, 0))
    if is_last_stage:
        # A token has a label when the next token was read: inside its row, or the extra one.
        labels, valid = got.labels(0)
        out["labels"] = torch.from_numpy(labels)
        out["loss_mask"] = torch.from_numpy(valid.astype(np.float32))
    return MicrobatchInputs(**out, **meta)  # type: ignore[arg-type]


def to_device(mb: MicrobatchInputs, device: torch.device | str, *,
              non_blocking: bool = True) -> MicrobatchInputs:
    """Copy ``mb``'s tensors to ``device``; on CUDA through pinned memory, without a host sync.

    The pinned staging buffers come from PyTorch's caching host allocator, which keeps each one
    alive until its copy has finished, so the caller may drop ``mb`` right away.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return mb
    pin = dev.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if pin else t).to(dev, non_blocking=non_blocking)

    def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else move(t)

    return dataclasses.replace(
        mb, tokens=maybe(mb.tokens), position_ids=maybe(mb.position_ids),
        labels=maybe(mb.labels), loss_mask=maybe(mb.loss_mask), cu_seqlens=move(mb.cu_seqlens),
        cu_seqlens_padded=move(mb.cu_seqlens_padded),
    )
