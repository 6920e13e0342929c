"""Per-segment tables the step kernels share: padded length, time and work at every group size.

For a step's segments and the allowed sizes s_0 < ... < s_{L-1} (levels), ``item_tables`` gives,
per segment i and level l (cost.py's formula, split into the parts the kernels need):

- ``padded[i, l]``: the segment padded to the level's multiple (groups.pad_multiple);
- ``fits[i, l]``: whether it fits one group of the level (padded <= s_l * C, and <= 2^31-1);
- ``time[i, l]``: its share of a group's per-rank time, (a P + b P^2) / s_l plus the ring's
  per-token term (s_l - 1) * cp_token * P / s_l, without any per-group fixed cost;
- ``lone[i, l]``: the time of a group holding it alone, with the ring latency beyond what a
  group of the smallest size k0 pays ((s_l - k0) * cp_fixed: every microbatch of every rank
  pays k0's, and the callers count that with the microbatch cost);
- ``work[i, l]`` = s_l * time[i, l] plus its share of that extra latency, (s_l - k0) * cp_fixed
  * P / C (a group holds at most s_l * C tokens, so the shares never exceed the latency it
  pays): rank-seconds a schedule must spend on the segment at that size. Work grows
  with the size (the ring adds work and padding only grows): the smallest fitting level is the
  cheapest.

``min_level[i]`` is the smallest fitting level, ``order`` the placement order: largest work at
the smallest level first (LPT), ties by position in the step (the drawn order), so the result
does not depend on the sort algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numpy.typing import NDArray

from planner.groups import MAX_SEGMENT_TOKENS
from planner.solver.batches import radix_argsort


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemTables:
    """Per-segment, per-level tables of one step (see the module docstring)."""

    padded: NDArray[np.int64]
    fits: NDArray[np.bool_]
    time: NDArray[np.float64]
    lone: NDArray[np.float64]
    work: NDArray[np.float64]
    min_level: NDArray[np.int64]
    order: NDArray[np.int64]


@numba.njit(cache=True)
def seq_time(c: NDArray[np.float64], k: int, p: float) -> float:
    """A sequence's share of its group's per-rank time (cost.py's t without fixed terms)."""
    t = (c[0] * p + c[1] * p * p) / k
    if k > 1:
        t += (k - 1) * c[3] * p / k
    return float(t)


@numba.njit(cache=True)
def _tables(tokens: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
            capacity: int, c: NDArray[np.float64], max_segment: int
            ) -> tuple[NDArray[np.int64], NDArray[np.bool_], NDArray[np.float64],
                       NDArray[np.float64], NDArray[np.float64], NDArray[np.int64],
                       NDArray[np.int64]]:
    n = len(tokens)
    num_levels = len(sizes)
    padded = np.empty((n, num_levels), dtype=np.int64)
    fits = np.empty((n, num_levels), dtype=np.bool_)
    time = np.empty((n, num_levels), dtype=np.float64)
    lone = np.empty((n, num_levels), dtype=np.float64)
    work = np.empty((n, num_levels), dtype=np.float64)
    min_level = np.full(n, -1, dtype=np.int64)
    key = np.empty(n, dtype=np.float64)
    k0 = sizes[0]
    # Power-of-two multiples (every one but a pad_to_multiple's) round up with a mask: an
    # integer division per segment and level was a third of this function's time.
    mask = np.zeros(num_levels, dtype=np.int64)
    for lv in range(num_levels):
        if mults[lv] & (mults[lv] - 1) == 0:
            mask[lv] = -mults[lv]
    for i in range(n):
        for lv in range(num_levels):
            k = sizes[lv]
            m = mults[lv]
            p = (tokens[i] + m - 1) & mask[lv] if mask[lv] != 0 else (tokens[i] + m - 1) // m * m
            padded[i, lv] = p
            # Plan rows are int32: a segment never pads past MAX_SEGMENT_TOKENS.
            fits[i, lv] = p <= k * capacity and p <= max_segment
            t = seq_time(c, k, float(p))
            time[i, lv] = t
            # Ring latency beyond the smallest size's, which every microbatch of every rank
            # pays anyway (counted with the microbatch cost). A group's extra latency,
            # (k - k0) c2 on each of k ranks, is shared by at most k C padded tokens: charging
            # each segment its token share keeps the bound valid.
            lone[i, lv] = t + (k - k0) * c[2]
            work[i, lv] = k * t + (k - k0) * c[2] * p / capacity
            if min_level[i] < 0 and fits[i, lv]:
                min_level[i] = lv
        if min_level[i] < 0:
            raise ValueError("a segment does not fit the largest group")
        key[i] = work[i, min_level[i]]
    # Descending work, ties by position: a stable radix sort of the inverted bits (works are
    # >= 0, whose IEEE bits order as their values); the same order as a stable argsort of
    # -work, at 0.1x its time for 16,384 segments.
    order = radix_argsort(~key.view(np.uint64))
    return padded, fits, time, lone, work, min_level, order


def item_tables(tokens: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
                capacity: int, cost: NDArray[np.float64]) -> ItemTables:
    """The step's tables; ``cost`` is CostModel.as_array(). Raises if a segment fits no size."""
    padded, fits, time, lone, work, min_level, order = _tables(
        np.asarray(tokens, np.int64), sizes, mults, capacity, cost, MAX_SEGMENT_TOKENS)
    return ItemTables(padded=padded, fits=fits, time=time, lone=lone, work=work,
                      min_level=min_level, order=order)
