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

The planner scores this packing as a candidate for every step (candidates.py), through
``static_layout``, the same rules in one numba pass (a test checks it against the list version
below, which the bench's ``static_cp_plan`` uses: bench/baseline_static.py).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.groups import pad_multiple
from planner.jit import kernel


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


@kernel
def static_layout(padded: NDArray[np.int64], pool_size: int, cp: int, capacity: int,
                  microbatch_multiple: int) -> tuple[NDArray[np.int64], NDArray[np.int64],
                                                     NDArray[np.int64], int]:
    """``static_bins`` as plan rows, in one pass: (microbatch, rank_start, position, count).

    Rows are in plan order (microbatch, group, packing order); position -1 is a filler row. The
    first ``count`` entries of each array are used. Next-fit bins are runs of consecutive
    positions, so a bin is (first, end) and Megatron's fix-up moves a bin's last position into
    a new single-position bin (``round_bins_up``).
    """
    n = len(padded)
    num_groups = pool_size // cp
    first = np.empty(2 * n + 1, dtype=np.int64)
    end = np.empty(2 * n + 1, dtype=np.int64)
    num_bins = 0
    used = 0
    for i in range(n):
        if num_bins == 0 or used + padded[i] > cp * capacity:
            first[num_bins] = i
            num_bins += 1
            used = 0
        end[num_bins - 1] = i + 1
        used += padded[i]
    original = num_bins
    missing = (-num_bins) % (num_groups * microbatch_multiple)
    b = original - 1
    while missing > 0 and b >= 0:
        if end[b] - first[b] > 1:
            end[b] -= 1
            first[num_bins] = end[b]
            end[num_bins] = end[b] + 1
            num_bins += 1
            missing -= 1
        else:
            b -= 1
    num_mb = -(-num_bins // num_groups)
    num_mb = -(-num_mb // microbatch_multiple) * microbatch_multiple
    size = n + num_mb * num_groups
    mb = np.empty(size, dtype=np.int64)
    start = np.empty(size, dtype=np.int64)
    pos = np.empty(size, dtype=np.int64)
    row = 0
    for m in range(num_mb):
        for j in range(num_groups):
            b = m * num_groups + j
            if b >= num_bins:  # a filler: every rank is in exactly one group
                mb[row], start[row], pos[row] = m, j * cp, -1
                row += 1
                continue
            for q in range(first[b], end[b]):
                mb[row], start[row], pos[row] = m, j * cp, q
                row += 1
    return mb, start, pos, row
