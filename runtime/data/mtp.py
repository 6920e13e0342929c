"""Multi-token prediction's inputs for packed THD microbatches, prepared on the data side.

Multi-token prediction (MTP) of depth D adds, at every position i of a sequence, predictions of
the labels d positions further on (d = 1..D): MTP layer d embeds the token i + d and is trained
on the label of position i + d. For a packed buffer split over a CP group (zigzag), position
i + d may live on another rank, in the other half of the rank's shard, or past the end of its
sequence, where nothing may be read (the next sequence of the buffer, or padding). So the data
side, which reads every needed row whole, prepares per microbatch (``mtp_inputs``):

- ``labels[d - 1]`` / ``loss_mask[d - 1]``: for each of this rank's slots, the label and loss
  mask of the position d further on *in the same sequence*, and 0 / 0 where that position is
  past the sequence's real tokens (padding gets 0 / 0). The label of a sequence's last real
  token is the next token of its sample when the plan split the sample there (as the LM
  labels): so depth d's last counted position is the one whose label the LM loss counts too;
- ``successor``: for each slot, where the next position of its sequence sits among the CP
  group's slots (index into the group's slots, rank-major: ``cp_rank * slots + j``), -1 at a
  sequence's last real token and on padding. Megatron's MTP layers shift their own inputs (the
  token ids and positions they embed) by one per layer; the Megatron adapter's
  ``binding/mtp.py`` makes that shift a gather through this map, exact whatever the CP size,
  instead of Megatron's roll (which reads the real lengths as if they were split evenly over
  the ranks).

Both are the single-sequence rule applied to each sequence: the oracle runs every segment
alone and shifts its labels within the segment (``torch.roll``-and-zero, Megatron's rule for
one sequence), with code of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.data.plan_reader import GroupRows
from runtime.data.shard import cu_seqlens_np, shard_indices_np
from runtime.data.tokens import TokenSource, read_segments


@dataclass(frozen=True, slots=True)
class MTPInputs:
    """One microbatch's MTP targets and shift map on one rank (CPU tensors)."""

    labels: torch.Tensor
    """int64 [D, slots]: depth d's label of each slot (row d - 1)."""
    loss_mask: torch.Tensor
    """float32 [D, slots]: 1 where depth d's label counts."""
    successor: torch.Tensor
    """int64 [slots]: the slot of the next position of the same sequence among the group's
    slots (rank-major), -1 where there is none."""

    def to(self, device: torch.device | str) -> MTPInputs:
        return MTPInputs(labels=self.labels.to(device), loss_mask=self.loss_mask.to(device),
                         successor=self.successor.to(device))


def successor_map(rows: GroupRows, layout: str) -> np.ndarray:
    """``MTPInputs.successor`` for ``rows``' group and this rank (see the module docstring)."""
    n, padded = rows.num_tokens, rows.padded_tokens
    cu_pad = cu_seqlens_np(padded).astype(np.int64)
    shards = [shard_indices_np(layout, cu_pad, rows.cp_size, r) for r in range(rows.cp_size)]
    slots = len(shards[rows.cp_rank])
    where = np.full(int(cu_pad[-1]), -1, dtype=np.int64)  # global position -> group slot
    for r, idx in enumerate(shards):
        if len(idx) != slots:
            raise AssertionError(f"unequal shards in the CP group: {[len(s) for s in shards]}")
        where[idx] = r * slots + np.arange(slots)
    idx = shards[rows.cp_rank]
    row = np.searchsorted(cu_pad[1:], idx, side="right")
    pos = idx - cu_pad[row]
    has_next = pos + 1 < n[row]
    return np.where(has_next, where[np.minimum(idx + 1, len(where) - 1)], -1)


def mtp_inputs(rows: GroupRows, source: TokenSource, *, layout: str, depth: int) -> MTPInputs:
    """This rank's ``MTPInputs`` of depth ``depth`` for one microbatch (``rows``)."""
    if depth < 1:
        raise ValueError(f"MTP depth must be >= 1, got {depth}")
    n, padded = rows.num_tokens, rows.padded_tokens
    cu_pad = cu_seqlens_np(padded).astype(np.int64)
    idx = shard_indices_np(layout, cu_pad, rows.cp_size, rows.cp_rank)
    row = np.searchsorted(cu_pad[1:], idx, side="right")
    pos = idx - cu_pad[row]
    real = pos < n[row]
    # Every row this rank has a real slot of, read whole plus the sample's next token (the last
    # real token's label when the plan split the sample after it), as the LM labels are.
    needed = np.zeros(len(n), dtype=bool)
    needed[row[real]] = True
    has_next = np.zeros(len(n), dtype=np.int64)
    sel = needed & (rows.sample_index >= 0)
    ends = rows.token_offset[sel] + n[sel]
    has_next[sel] = ends < source.lengths()[rows.sample_index[sel]]
    read_len = np.where(needed, n + has_next, 0)
    read_rows = np.flatnonzero(read_len > 0)
    cat = read_segments(source, rows.sample_index[read_rows], rows.token_offset[read_rows],
                        read_len[read_rows])
    if cat.size == 0:
        cat = np.zeros(1, np.int64)
    start = (np.cumsum(read_len) - read_len)[row]
    labels = np.zeros((depth, len(idx)), dtype=np.int64)
    mask = np.zeros((depth, len(idx)), dtype=np.float32)
    for d in range(1, depth + 1):
        # Depth d at position p: the LM label of position p + d, i.e. the token p + d + 1.
        valid = real & (pos + d < n[row]) & (pos + d + 1 < read_len[row])
        labels[d - 1] = np.where(valid, cat[np.where(valid, start + pos + d + 1, 0)], 0)
        mask[d - 1] = valid
    return MTPInputs(labels=torch.from_numpy(labels), loss_mask=torch.from_numpy(mask),
                     successor=torch.from_numpy(successor_map(rows, layout)))
