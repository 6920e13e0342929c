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
from runtime.data.tokens import TokenSource
from runtime.data.walk import read, walk


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
    walks = [walk(rows, layout, r) for r in range(rows.cp_size)]
    slots = len(walks[rows.cp_rank].idx)
    where = np.full(int(rows.padded_tokens.sum()), -1, dtype=np.int64)  # position -> group slot
    for r, wr in enumerate(walks):
        if len(wr.idx) != slots:
            raise AssertionError(f"unequal shards in the CP group: {[len(x.idx) for x in walks]}")
        where[wr.idx] = r * slots + np.arange(slots)
    w = walks[rows.cp_rank]
    has_next = w.pos + 1 < rows.num_tokens[w.row]
    return np.where(has_next, where[np.minimum(w.idx + 1, len(where) - 1)], -1)


def mtp_inputs(rows: GroupRows, source: TokenSource, *, layout: str, depth: int) -> MTPInputs:
    """This rank's ``MTPInputs`` of depth ``depth`` for one microbatch (``rows``)."""
    if depth < 1:
        raise ValueError(f"MTP depth must be >= 1, got {depth}")
    # The same walk and reads as the LM labels (runtime.data.walk): every row this rank has a
    # real slot of, whole, plus the sample's next token where the plan split the sample.
    got = read(rows, source, walk(rows, layout), with_next=True)
    slots = len(got.walk.idx)
    labels = np.zeros((depth, slots), dtype=np.int64)
    mask = np.zeros((depth, slots), dtype=np.float32)
    for d in range(1, depth + 1):
        # Depth d at position p: the LM label of position p + d, i.e. the token p + d + 1.
        labels[d - 1], mask[d - 1] = got.labels(d)
    return MTPInputs(labels=torch.from_numpy(labels), loss_mask=torch.from_numpy(mask),
                     successor=torch.from_numpy(successor_map(rows, layout)))
