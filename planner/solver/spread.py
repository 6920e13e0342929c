"""Spreading (numba): after a pass, each unit's smallest-size groups take its free microbatches.

Called once per step on the chosen placement (greedy.assign_step), before the rows are emitted.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel
from planner.solver.place import block_layout


@kernel
def spread(padded0: NDArray[np.int64], order: NDArray[np.int64], item_level: NDArray[np.int64],
           item_group: NDArray[np.int64], g_level: NDArray[np.int64], g_block: NDArray[np.int64],
           num_groups: int, sizes: NDArray[np.int64], capacity: int, pool_size: int,
           num_mb: int) -> int:
    """Spread each unit's smallest-size groups over its free microbatches; the new group count.

    ``padded0``: each segment's padded length at the smallest size; ``order``: the placement
    order.

    A unit's k0 groups and its fillers all cost the k0 fixed time, so re-packing its k0 segments
    into more groups (worst fit, heaviest first) changes no rank's load: it only turns fillers
    into real groups, which lowers the activation peak and leaves no microbatch of fillers only
    when M was rounded up to the microbatch multiple. A unit whose re-pack fails keeps its groups.
    """
    num_blocks, offset = block_layout(sizes, pool_size)
    total_blocks = offset[-1] + num_blocks[-1]
    blk_ng = np.zeros(total_blocks, dtype=np.int64)
    for g in range(num_groups):
        blk_ng[offset[g_level[g]] + g_block[g]] += 1
    count = blk_ng[:num_blocks[0]].copy()
    for u in range(num_blocks[0]):
        b = u
        for lv in range(1, len(sizes)):
            b = b // (sizes[lv] // sizes[lv - 1])
            count[u] += blk_ng[offset[lv] + b]
    # Each unit's k0 groups (ascending) and k0 segments (in placement order), bucketed once:
    # the pass below then costs O(segments + groups), not O(units x segments).
    n = len(order)
    units = num_blocks[0]
    g_start = np.zeros(units + 1, dtype=np.int64)
    for g in range(num_groups):
        if g_level[g] == 0:
            g_start[g_block[g] + 1] += 1
    i_start = np.zeros(units + 1, dtype=np.int64)
    for i in range(n):
        if item_level[i] == 0:
            i_start[g_block[item_group[i]] + 1] += 1
    for u in range(units):
        g_start[u + 1] += g_start[u]
        i_start[u + 1] += i_start[u]
    unit_groups = np.empty(g_start[units], dtype=np.int64)
    unit_order = np.empty(i_start[units], dtype=np.int64)
    g_next = g_start[:units].copy()
    i_next = i_start[:units].copy()
    for g in range(num_groups):
        if g_level[g] == 0:
            u = g_block[g]
            unit_groups[g_next[u]] = g
            g_next[u] += 1
    for j in range(n):
        i = order[j]
        if item_level[i] == 0:
            u = g_block[item_group[i]]
            unit_order[i_next[u]] = i
            i_next[u] += 1
    room = sizes[0] * capacity
    bins = np.empty(num_mb, dtype=np.int64)
    fill = np.empty(num_mb, dtype=np.int64)
    new_group = np.empty(n, dtype=np.int64)
    for u in range(units):
        own = blk_ng[u]
        extra = min(num_mb - count[u], i_start[u + 1] - i_start[u] - own)
        if own == 0 or extra <= 0:
            continue
        num_bins = 0
        for q in range(g_start[u], g_start[u + 1]):
            bins[num_bins] = unit_groups[q]
            num_bins += 1
        for q in range(extra):
            bins[num_bins + q] = num_groups + q
        num_bins += extra
        fill[:num_bins] = 0
        ok = True
        for q in range(i_start[u], i_start[u + 1]):
            i = unit_order[q]
            best = -1
            for r in range(num_bins):
                if fill[r] + padded0[i] <= room and (best < 0 or fill[r] < fill[best]):
                    best = r
            if best < 0:
                ok = False
                break
            fill[best] += padded0[i]
            new_group[i] = bins[best]
        if not ok:
            continue
        for q in range(i_start[u], i_start[u + 1]):
            i = unit_order[q]
            item_group[i] = new_group[i]
        for q in range(extra):
            g_level[num_groups + q] = 0
            g_block[num_groups + q] = u
        num_groups += extra
    return num_groups
