"""Static context parallelism with next-fit packing (Megatron's ``dp_balanced``), one step.

Written from the behaviour of Megatron-LM's ``DpBalancedScheduler`` (megatron/core/datasets/
data_schedule.py), not from its code:

- The pool of N ranks is cut into G = N / cp groups of the static size cp in *every* microbatch:
  group j holds ranks [j*cp, (j+1)*cp).
- Every sequence is padded for its group size: to a multiple of 2*cp*tp' (zigzag; tp' at cp=1).
- Order: none. Megatron packs "in their original order", the order in which the data-parallel
  ranks delivered the global batch; ours is the drawn order of the global batch, the same thing.
  No sort, so a long sequence closes a half-full bin as often as the data says.
- Next-fit: fill a bin of capacity cp*C until the next sequence would overflow it, then open the
  next bin. Bins are dealt to microbatches in order: microbatch m, group j gets bin m*G + j.
- Bin count: Megatron wants a multiple of G (times the VPP microbatch group size); it moves the
  last sequence of the tail bins that hold more than one into new single-sequence bins until the
  count is a multiple. When too few bins can give a sequence (Megatron asserts), the remaining
  groups of the last microbatch get a filler row (sample -1, the smallest padded length the
  layout allows), so every rank still belongs to exactly one group.

The planner scores this packing as a candidate for every step (candidates.py); the bench's
``static_cp_plan`` plans whole datasets with it (bench/baseline_static.py).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.groups import pad_multiple


def padded_lengths(lengths: NDArray[np.int64], cp: int, tp_eff: int, layout: str
                   ) -> NDArray[np.int64]:
    """Every length rounded up to the padding multiple of group size ``cp``."""
    m = pad_multiple(cp, tp_eff, layout)
    return -(-np.asarray(lengths, dtype=np.int64) // m) * m


def next_fit(padded: list[int], capacity: int) -> list[list[int]]:
    """Positions of ``padded`` packed next-fit into bins of ``capacity`` (input order kept)."""
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, p in enumerate(padded):
        if current and used + p > capacity:
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += p
    if current:
        bins.append(current)
    return bins


def round_bins_up(bins: list[list[int]], multiple: int) -> list[list[int]]:
    """Megatron's fix-up: split tail bins' last items into new bins until len % multiple == 0.

    Walks from the last original bin backwards; a bin with more than one item gives its last
    item to a new single-item bin appended at the end. Stops early (leaving fillers to the
    caller) when no bin can give an item, where Megatron would assert.
    """
    bins = [list(b) for b in bins]
    missing = (-len(bins)) % multiple
    i = len(bins) - 1
    while missing > 0 and i >= 0:
        if len(bins[i]) > 1:
            bins.append([bins[i].pop()])
            missing -= 1
        else:
            i -= 1
    return bins


def static_bins(padded: NDArray[np.int64], *, pool_size: int, cp: int, capacity: int,
                microbatch_multiple: int = 1) -> tuple[list[list[int]], int]:
    """(bins of positions, microbatch count): bin m*G + j is group j of microbatch m.

    Positions past ``len(bins)`` are the fillers of the last microbatch. The caller checks that
    every padded length fits cp x C.
    """
    num_groups = pool_size // cp
    bins = round_bins_up(next_fit(padded.tolist(), cp * capacity),
                         num_groups * microbatch_multiple)
    num_mb = -(-len(bins) // num_groups)
    num_mb = -(-num_mb // microbatch_multiple) * microbatch_multiple
    return bins, num_mb
