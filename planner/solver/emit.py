"""Rows of a placed step (numba): microbatch indices, fillers, and the plan's row order.

Microbatch index of a group of level l on block B: every rank of B first runs the groups of the
blocks that enclose B at larger levels (largest level first, each block's groups in creation
order), then B's own groups in creation order. All ranks of B share those enclosing blocks, so
they agree on the index (place.py explains why no group waits). After its real groups, each unit
(block of the smallest size k0) runs one filler group per remaining microbatch: a padding-only
row of one alignment unit (``sample_index`` -1), so every rank runs exactly M microbatches.

Rows are sorted by (microbatch, rank_start); a group's rows follow the placement order (heaviest
first), which is the order of its packed buffer.

Example: N=4, sizes (1, 2, 4), M=2: a group of 4 on block 0 and a group of 2 on block 1 of
level 1 give microbatch 0 = [the 4-group], microbatch 1 = [filler on rank 0, filler on rank 1,
the 2-group on ranks 2-3].
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel
from planner.solver.place import block_layout


@kernel
def emit_rows(sample: NDArray[np.int64], offset: NDArray[np.int64], tokens: NDArray[np.int64],
              padded: NDArray[np.int64], order: NDArray[np.int64],
              item_level: NDArray[np.int64], item_group: NDArray[np.int64],
              g_level: NDArray[np.int64], g_block: NDArray[np.int64], num_groups: int,
              sizes: NDArray[np.int64], pool_size: int, num_mb: int, filler_padded: int
              ) -> tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.int32],
                         NDArray[np.int64], NDArray[np.int64], NDArray[np.int32],
                         NDArray[np.int32]]:
    """The step's 7 plan columns (all but ``step``), sorted as the plan format demands.

    ``padded``: each segment's padded length at its level (``item_level``); ``order``: the
    placement order."""
    n = len(sample)
    num_levels = len(sizes)
    num_blocks, boff = block_layout(sizes, pool_size)
    total_blocks = boff[-1] + num_blocks[-1]
    blk_ng = np.zeros(total_blocks, dtype=np.int64)
    g_pos = np.empty(num_groups, dtype=np.int64)
    for g in range(num_groups):
        bb = boff[g_level[g]] + g_block[g]
        g_pos[g] = blk_ng[bb]
        blk_ng[bb] += 1
    # Groups of the enclosing blocks come first: count them per block, top level down.
    above = np.zeros(total_blocks, dtype=np.int64)
    for lv in range(num_levels - 2, -1, -1):
        r = sizes[lv + 1] // sizes[lv]
        for b in range(num_blocks[lv]):
            parent = boff[lv + 1] + b // r
            above[boff[lv] + b] = above[parent] + blk_ng[parent]
    units = num_blocks[0]
    unit_count = np.empty(units, dtype=np.int64)
    num_fillers = 0
    for u in range(units):
        unit_count[u] = above[u] + blk_ng[u]
        assert unit_count[u] <= num_mb
        num_fillers += num_mb - unit_count[u]
    total_groups = num_groups + num_fillers
    key = np.empty(total_groups, dtype=np.int64)
    grp_k = np.empty(total_groups, dtype=np.int64)
    grp_start = np.empty(total_groups, dtype=np.int64)
    grp_mb = np.empty(total_groups, dtype=np.int64)
    for g in range(num_groups):
        lv = g_level[g]
        grp_mb[g] = above[boff[lv] + g_block[g]] + g_pos[g]
        grp_k[g] = sizes[lv]
        grp_start[g] = g_block[g] * sizes[lv]
    f = num_groups
    for u in range(units):
        for m in range(unit_count[u], num_mb):
            grp_mb[f] = m
            grp_k[f] = sizes[0]
            grp_start[f] = u * sizes[0]
            f += 1
    for g in range(total_groups):
        key[g] = grp_mb[g] * pool_size + grp_start[g]
    gorder = np.argsort(key, kind="mergesort")
    # Members per group in placement order (heaviest first = the packed buffer's order).
    first = np.zeros(num_groups + 1, dtype=np.int64)
    for i in range(n):
        first[item_group[i] + 1] += 1
    for g in range(num_groups):
        first[g + 1] += first[g]
    pos = first[:-1].copy()
    members = np.empty(n, dtype=np.int64)
    for j in range(n):
        i = order[j]
        members[pos[item_group[i]]] = i
        pos[item_group[i]] += 1
    num_rows = n + num_fillers
    o_mb = np.empty(num_rows, dtype=np.int32)
    o_start = np.empty(num_rows, dtype=np.int32)
    o_k = np.empty(num_rows, dtype=np.int32)
    o_sample = np.empty(num_rows, dtype=np.int64)
    o_offset = np.empty(num_rows, dtype=np.int64)
    o_tokens = np.empty(num_rows, dtype=np.int32)
    o_padded = np.empty(num_rows, dtype=np.int32)
    row = 0
    for q in range(total_groups):
        g = gorder[q]
        if g < num_groups:
            for x in range(first[g], first[g + 1]):
                i = members[x]
                o_mb[row] = grp_mb[g]
                o_start[row] = grp_start[g]
                o_k[row] = grp_k[g]
                o_sample[row] = sample[i]
                o_offset[row] = offset[i]
                o_tokens[row] = tokens[i]
                o_padded[row] = padded[i]
                row += 1
        else:
            o_mb[row] = grp_mb[g]
            o_start[row] = grp_start[g]
            o_k[row] = grp_k[g]
            o_sample[row] = -1
            o_offset[row] = 0
            o_tokens[row] = 0
            o_padded[row] = filler_padded
            row += 1
    return o_mb, o_start, o_k, o_sample, o_offset, o_tokens, o_padded
