"""The placement kernel (numba): one pass that puts a step's segments into groups on rank blocks.

Structure. Group sizes are nested (each a power of two dividing N, or N itself), so the aligned
blocks of all levels form a tree: every block of size k lies inside exactly one block of each
larger size. If every rank runs its groups largest size first, the members of a group have run
the same larger groups before it (they share all enclosing blocks), so no group ever waits for a
member: the simulated critical path is the largest rank load, whatever the placement. That is
why the kernel only tracks, per block of every level, its ranks' largest load and largest group
count, and the microbatch index of a group is fixed only when rows are emitted (emit.py).

Rules. With the microbatch count M fixed, every rank runs M microbatches; a rank that is in no
group in some microbatch runs a filler at the smallest size k0, so each rank starts with M times
the k0 fixed cost, and opening a group of size k adds (k - k0) ring latencies to each member.
Segments come heaviest first (items.py order). For a segment, level by level from its smallest
fitting size up, the best option of a level is the block whose ranks end lowest if it takes the
segment, joining a group with room there (best fit) or opening a group (count < M).
- ``balance`` mode: take the first level whose best option ends within the limit (the least
  work that meets it). The limit is the target T, or the highest rank load so far if that is
  higher (ending below the current critical path costs nothing). T = +inf gives plain LPT at the
  cheapest sizes; T = the bound promotes exactly the segments whose cheap size would stick out
  above it, counting what larger groups already hold on the same ranks (a 156K-token sequence
  on 2 ranks that already run a 230K one on all 8 sticks out; on all 8 it does not). When no
  level meets the limit, take the option with the lowest max(its end, the average rank load it
  leads to, with the segments to come at their cheapest sizes): the end alone would favour the
  widest group, which ends low by pushing every rank up with ring work.
- ``pack`` mode: as balance, but within the chosen level prefer, among blocks that end within
  the limit, the one with the tightest room that fits (best fit in tokens): a tight M packs.
- ``forced`` items (level, block >= 0) go where they are told (cpsat.py's answer).
A segment that fits nowhere makes the pass fail (returns -1): the caller tries a larger M.

Bins (groups) exist only here and in cpsat.py; rows come from emit.py.
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.typing import NDArray

from planner.solver.blocktree import best_block, fix_up, set_leaf, tree_layout

BALANCE = 0
PACK = 1
TREE_MIN_BLOCKS = 128
"""Blocks of the smallest size from which the search tree beats the scan (same answer either
way), measured as a balance pass of 16 N segments on the Wikipedia lengths, scan vs tree: N = 64
0.20 vs 0.22 ms, 128 0.54 vs 0.51, 256 1.96 vs 1.65; at 1024 the scan took about 20 ms, the
tree 10.8 before its lowest-load shortcut (blocktree.py) and 7.3 with it."""


@numba.njit(cache=True)
def block_layout(sizes: NDArray[np.int64], pool_size: int
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(blocks per level, offset of each level's first block in the flat block arrays)."""
    num_levels = len(sizes)
    num_blocks = np.empty(num_levels, dtype=np.int64)
    offset = np.empty(num_levels, dtype=np.int64)
    acc = 0
    for lv in range(num_levels):
        num_blocks[lv] = pool_size // sizes[lv]
        offset[lv] = acc
        acc += num_blocks[lv]
    return num_blocks, offset


@numba.njit(cache=True)
def _add(lv: int, b: int, dload: float, dcount: int, sizes: NDArray[np.int64],
         offset: NDArray[np.int64], bload: NDArray[np.float64], bcount: NDArray[np.int64]) -> None:
    """Add ``dload`` >= 0 and ``dcount`` >= 0 to every rank of block (lv, b); keep every block's
    max load and max count exact.

    Loads and counts only grow, so an enclosing block's max is the larger of its own and the
    grown block's, and the walk up stops at the first enclosing block that does not change.
    """
    for sub in range(lv + 1):
        r = sizes[lv] // sizes[sub]
        for j in range(offset[sub] + b * r, offset[sub] + (b + 1) * r):
            bload[j] += dload
            bcount[j] += dcount
    child = offset[lv] + b
    blk = b
    for up in range(lv + 1, len(sizes)):
        blk //= sizes[up] // sizes[up - 1]
        parent = offset[up] + blk
        if bload[child] <= bload[parent] and bcount[child] <= bcount[parent]:
            return
        bload[parent] = max(bload[parent], bload[child])
        bcount[parent] = max(bcount[parent], bcount[child])
        child = parent


@numba.njit(cache=True)
def _refresh(lv: int, b: int, sizes: NDArray[np.int64], bload: NDArray[np.float64],
             bcount: NDArray[np.int64], blk_room: NDArray[np.int64], num_mb: int,
             width: NDArray[np.int64], base: NDArray[np.int64], t_load: NDArray[np.float64],
             t_open: NDArray[np.float64], t_room: NDArray[np.int64],
             t_arg: NDArray[np.int64]) -> None:
    """Mirror into the smallest size's search tree the blocks ``_add(lv, b, ...)`` changed."""
    r = sizes[lv] // sizes[0]
    for j in range(b * r, (b + 1) * r):
        set_leaf(0, j, bload[j], bcount[j] < num_mb, blk_room[j], width, base, t_load, t_open,
                 t_room, t_arg)
    fix_up(0, b * r, (b + 1) * r - 1, width, base, t_load, t_open, t_room, t_arg)


@numba.njit(cache=True)
def work_to_come(time: NDArray[np.float64], min_level: NDArray[np.int64],
                 sizes: NDArray[np.int64]) -> float:
    """Rank-seconds of every segment at its cheapest size, summed in row order (``place`` keeps
    what is still to come; the sum's order fixes its last bits, so callers sum the same rows)."""
    total = 0.0
    for i in range(len(min_level)):
        total += time[i, min_level[i]] * sizes[min_level[i]]
    return total


@numba.njit(cache=True)
def place(padded: NDArray[np.int64], fits: NDArray[np.bool_], time: NDArray[np.float64],
          min_level: NDArray[np.int64], order: NDArray[np.int64], sizes: NDArray[np.int64],
          capacity: int, pool_size: int, c: NDArray[np.float64], num_mb: int, target: float,
          mode: int, to_come: float, forced_level: NDArray[np.int64],
          forced_block: NDArray[np.int64],
          item_level: NDArray[np.int64], item_group: NDArray[np.int64],
          g_level: NDArray[np.int64], g_block: NDArray[np.int64]) -> tuple[int, float]:
    """Place every segment; (number of groups, makespan), or (-1, inf) if one fits nowhere.

    Outputs: ``item_level``/``item_group`` per segment, ``g_level``/``g_block`` per group (in
    creation order, which emit.py keeps among the groups of one block). ``to_come`` is
    ``work_to_come`` of the tables. The tables' rows may come in any order (``order`` says which
    to place when); step.py passes them already in placement order, which reads them one after
    another instead of at random: 0.64x a balance pass at N = 1024, 0.75x at 256.
    """
    n = len(order)
    num_levels = len(sizes)
    num_blocks, offset = block_layout(sizes, pool_size)
    total_blocks = offset[-1] + num_blocks[-1]
    k0 = sizes[0]
    base = num_mb * (c[4] + (k0 - 1) * c[2])
    bload = np.full(total_blocks, base, dtype=np.float64)
    bcount = np.zeros(total_blocks, dtype=np.int64)
    # Groups of each block (at most num_mb: each takes a microbatch of all its ranks).
    blk_ng = np.zeros(total_blocks, dtype=np.int64)
    blk_g = np.empty((total_blocks, num_mb), dtype=np.int64)
    blk_room = np.full(total_blocks, -1, dtype=np.int64)
    g_fill = np.zeros(n, dtype=np.int64)
    num_groups = 0
    # Balance mode asks a search tree (blocktree.py) instead of scanning every block at the
    # smallest size, which nearly every segment searches. Larger sizes are searched rarely
    # (0.6% of searches at N = 1024): a tree's upkeep on every placement costs more there.
    use_tree = mode == BALANCE and num_blocks[0] >= TREE_MIN_BLOCKS
    width, tbase = tree_layout(num_blocks[:1])
    t_load = np.full(tbase[-1], np.inf, dtype=np.float64)
    t_open = np.full(tbase[-1], np.inf, dtype=np.float64)
    t_room = np.full(tbase[-1], -1, dtype=np.int64)
    t_arg = np.full(tbase[-1], -1, dtype=np.int64)
    stack = np.empty(2 * 66, dtype=np.int64)
    stack_bound = np.empty(66, dtype=np.float64)
    if use_tree:
        for b in range(num_blocks[0]):
            set_leaf(0, b, base, num_mb > 0, -1, width, tbase, t_load, t_open, t_room, t_arg)
        fix_up(0, 0, num_blocks[0] - 1, width, tbase, t_load, t_open, t_room, t_arg)
    # Once some rank ends above the target, anything that ends below that rank is free.
    limit = max(target, base)
    # Rank-seconds placed so far and still to come (at the cheapest sizes): an option that
    # ends above the limit is scored by max(its end, the average load it leads to), so that a
    # wide group (low end, much work) does not win by merely pushing every rank up.
    placed = base * pool_size
    for j in range(n):
        i = order[j]
        to_come -= time[i, min_level[i]] * sizes[min_level[i]]
        lv_pick = -1
        b_pick = -1
        if forced_level[i] >= 0:
            lv_pick = forced_level[i]
            b_pick = forced_block[i]
            bb = offset[lv_pick] + b_pick
            if blk_room[bb] < padded[i, lv_pick] and bcount[bb] >= num_mb:
                return -1, np.inf
        else:
            any_end = np.inf
            any_lv = -1
            any_b = -1
            for lv in range(min_level[i], num_levels):
                if not fits[i, lv]:
                    continue
                p = padded[i, lv]
                t = time[i, lv]
                open_cost = (sizes[lv] - k0) * c[2]
                best_end = np.inf
                best_b = -1
                fit_end = np.inf
                fit_b = -1
                fit_room = 0
                if use_tree and lv == 0:
                    best_b, best_end = best_block(lv, p, t, open_cost, width, tbase, t_load,
                                                  t_open, t_room, t_arg, stack, stack_bound)
                for b in range(0 if use_tree and lv == 0 else num_blocks[lv]):
                    bb = offset[lv] + b
                    if blk_room[bb] >= p:
                        end = bload[bb] + t
                        if mode == PACK and end <= limit:
                            room = sizes[lv] * capacity
                            for q in range(blk_ng[bb]):
                                g = blk_g[bb, q]
                                left = sizes[lv] * capacity - g_fill[g] - p
                                if 0 <= left < room:
                                    room = left
                            if fit_b < 0 or room < fit_room:
                                fit_b = b
                                fit_room = room
                                fit_end = end
                    elif bcount[bb] < num_mb:
                        end = bload[bb] + t + open_cost
                    else:
                        continue
                    if end < best_end:
                        best_end = end
                        best_b = b
                if fit_b >= 0:
                    best_b = fit_b
                    best_end = fit_end
                if best_b < 0:
                    continue
                if best_end <= limit:
                    lv_pick = lv
                    b_pick = best_b
                    break
                score = max(best_end, (placed + to_come + (best_end - bload[offset[lv] + best_b])
                                       * sizes[lv]) / pool_size)
                if score < any_end:
                    any_end = score
                    any_lv = lv
                    any_b = best_b
            if lv_pick < 0:
                if any_lv < 0:
                    return -1, np.inf
                lv_pick = any_lv
                b_pick = any_b
        # Join the fullest group of the block that still holds the segment, else open one.
        bb = offset[lv_pick] + b_pick
        p = padded[i, lv_pick]
        room_cap = sizes[lv_pick] * capacity
        g_pick = -1
        for q in range(blk_ng[bb]):
            g = blk_g[bb, q]
            if g_fill[g] + p <= room_cap and (g_pick < 0 or g_fill[g] > g_fill[g_pick]):
                g_pick = g
        if g_pick >= 0:
            g_fill[g_pick] += p
            placed += time[i, lv_pick] * sizes[lv_pick]
            _add(lv_pick, b_pick, time[i, lv_pick], 0, sizes, offset, bload, bcount)
        else:
            g_pick = num_groups
            num_groups += 1
            g_level[g_pick] = lv_pick
            g_block[g_pick] = b_pick
            g_fill[g_pick] = p
            blk_g[bb, blk_ng[bb]] = g_pick
            blk_ng[bb] += 1
            placed += (time[i, lv_pick] + (sizes[lv_pick] - k0) * c[2]) * sizes[lv_pick]
            _add(lv_pick, b_pick, time[i, lv_pick] + (sizes[lv_pick] - k0) * c[2], 1, sizes,
                 offset, bload, bcount)
        room = -1
        for q in range(blk_ng[bb]):
            room = max(room, room_cap - g_fill[blk_g[bb, q]])
        blk_room[bb] = room
        if use_tree:
            _refresh(lv_pick, b_pick, sizes, bload, bcount, blk_room, num_mb, width, tbase,
                     t_load, t_open, t_room, t_arg)
        limit = max(limit, bload[bb])
        item_level[i] = lv_pick
        item_group[i] = g_pick
    makespan = 0.0
    for u in range(num_blocks[0]):
        makespan = max(makespan, bload[u])
    return num_groups, makespan


@numba.njit(cache=True)
def spread(padded: NDArray[np.int64], order: NDArray[np.int64], item_level: NDArray[np.int64],
           item_group: NDArray[np.int64], g_level: NDArray[np.int64], g_block: NDArray[np.int64],
           num_groups: int, sizes: NDArray[np.int64], capacity: int, pool_size: int,
           num_mb: int) -> int:
    """Spread each unit's smallest-size groups over its free microbatches; the new group count.

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
                if fill[r] + padded[i, 0] <= room and (best < 0 or fill[r] < fill[best]):
                    best = r
            if best < 0:
                ok = False
                break
            fill[best] += padded[i, 0]
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
