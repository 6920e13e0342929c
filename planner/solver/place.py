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

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel, no_refcount
from planner.solver.blocktree import (
    NO_THRESHOLD,
    best_fit,
    lowest_unit,
    put_units,
    tightest,
    tree_width,
)
from planner.solver.leveltree import level_layout, lowest_block, mark_blocks, put_blocks

BALANCE = 0
PACK = 1
UNIT_TREE_MIN = 128
LEVEL_TREE_MIN = 256
"""The smallest size asks its tree (blocktree.py) from UNIT_TREE_MIN units, a larger size its
tree (leveltree.py) from LEVEL_TREE_MIN blocks; fewer are scanned, which is cheaper there (the
same answers either way). A balance pass on the 1M Wikipedia lengths (BENCHMARKS.md, issue 24):
the unit tree at N = 128 0.34 ms instead of 0.83 scanning; level trees at 128 blocks cost more
than they save (N = 1024: 4.9 ms with them at levels of 128 blocks, 4.2 without)."""


@kernel
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


@no_refcount
def _add(lv: int, b: int, dload: float, dcount: int, sizes: NDArray[np.int64],
         offset: NDArray[np.int64], bload: NDArray[np.float64],
         bcount: NDArray[np.int64]) -> int:
    """Add ``dload`` >= 0 and ``dcount`` >= 0 to every rank of block (lv, b); keep every block's
    max load and max count exact.

    Loads and counts only grow, so an enclosing block's max is the larger of its own and the
    grown block's, and the walk up stops at the first enclosing block that does not change.
    Returns the largest level whose enclosing block changed (``lv`` if none did).
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
            return up - 1
        bload[parent] = max(bload[parent], bload[child])
        bcount[parent] = max(bcount[parent], bcount[child])
        child = parent
    return len(sizes) - 1


@kernel
def work_to_come(time: NDArray[np.float64], min_level: NDArray[np.int64],
                 sizes: NDArray[np.int64], rows: NDArray[np.int64]) -> float:
    """Rank-seconds of the segments of table rows ``rows`` at their cheapest sizes, summed in
    step order (``place`` keeps what is still to come; the sum's order fixes its last bits)."""
    total = 0.0
    for i in rows:
        total += time[i, min_level[i]] * sizes[min_level[i]]
    return total


@kernel
def place(padded: NDArray[np.int64], fits: NDArray[np.bool_], time: NDArray[np.float64],
          min_level: NDArray[np.int64], rows: NDArray[np.int64], sizes: NDArray[np.int64],
          capacity: int, pool_size: int, c: NDArray[np.float64], num_mb: int, target: float,
          mode: int, to_come: float, forced_level: NDArray[np.int64],
          forced_block: NDArray[np.int64], unit_tree_blocks: int, level_tree_blocks: int,
          item_level: NDArray[np.int64], item_group: NDArray[np.int64],
          g_level: NDArray[np.int64], g_block: NDArray[np.int64]) -> tuple[int, float]:
    """Place every segment; (number of groups, makespan), or (-1, inf) if one fits nowhere.

    The j-th segment placed has table row ``rows[j]`` (items.py: tables per distinct length,
    rows in order of work, so a step in placement order reads them forwards); ``forced_*`` and
    the outputs ``item_level``/``item_group`` are per placement position j, ``g_level``/
    ``g_block`` per group (in creation order, which emit.py keeps among the groups of one
    block). ``to_come`` is ``work_to_come`` of the step.

    Search. A level of many blocks (``unit_tree_blocks`` at the smallest size,
    ``level_tree_blocks`` above: UNIT_TREE_MIN and LEVEL_TREE_MIN) is asked through a tree in
    O(log N): blocktree.py at the smallest size, leveltree.py above it; pack mode's best fit
    walks the same trees (``best_fit``). Other levels are scanned. Either way the pick is the
    lowest (end, block) the scan finds (tests/planner/solver/test_blocktree.py compares them).
    """
    n = len(rows)
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
    units = num_blocks[0]
    width = tree_width(units)
    a_load = np.full(2 * width, np.inf, dtype=np.float64)
    a_arg = np.full(2 * width, -1, dtype=np.int64)
    a_room = np.full(2 * width, -1, dtype=np.int64)
    w_room = np.full(2 * width, -1, dtype=np.int64)
    state = np.full(1, NO_THRESHOLD, dtype=np.int64)
    stack = np.empty(130, dtype=np.int64)
    # The smallest size asks its tree from unit_tree_blocks units, larger sizes from
    # level_tree_blocks blocks (levels 1..tree_top; block counts fall with the level).
    trees = units >= unit_tree_blocks
    tree_top = 0 if trees else -1
    while trees and tree_top + 1 < num_levels and num_blocks[tree_top + 1] >= level_tree_blocks:
        tree_top += 1
    if trees:
        put_units(0, units - 1, bload, bcount, blk_room, num_mb, state, width, a_load, a_arg,
                  a_room, w_room)
    # Level trees for the larger sizes.
    l_width, l_base = level_layout(num_blocks)
    j_load = np.full(l_base[-1], np.inf, dtype=np.float64)
    o_load = np.full(l_base[-1], np.inf, dtype=np.float64)
    l_room = np.full(l_base[-1], -1, dtype=np.int64)
    thr = np.full(num_levels, NO_THRESHOLD, dtype=np.int64)
    dirty = np.zeros(total_blocks, dtype=np.bool_)
    d_list = np.empty(total_blocks, dtype=np.int64)
    n_dirty = np.zeros(num_levels, dtype=np.int64)
    if trees:
        for lv in range(1, tree_top + 1):
            put_blocks(lv, 0, num_blocks[lv] - 1, offset[lv], bload, bcount, blk_room, num_mb,
                       thr, l_width, l_base, j_load, o_load, l_room)
    # Once some rank ends above the target, anything that ends below that rank is free.
    limit = max(target, base)
    # Rank-seconds placed so far and still to come (at the cheapest sizes): an option that
    # ends above the limit is scored by max(its end, the average load it leads to), so that a
    # wide group (low end, much work) does not win by merely pushing every rank up.
    placed = base * pool_size
    for j in range(n):
        i = rows[j]
        to_come -= time[i, min_level[i]] * sizes[min_level[i]]
        lv_pick = -1
        b_pick = -1
        if forced_level[j] >= 0:
            lv_pick = forced_level[j]
            b_pick = forced_block[j]
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
                if trees and lv == 0:
                    best_b, best_end = lowest_unit(p, t, units, bload, bcount, blk_room, num_mb,
                                                   state, width, a_load, a_arg, a_room, w_room)
                    if mode == PACK:
                        fit_b, fit_end = best_fit(p, t, limit, 0, width, 0, sizes[0] * capacity,
                                                  a_load, a_room, True, bload, blk_ng, blk_g,
                                                  g_fill, stack)
                elif lv <= tree_top:
                    best_b, best_end = lowest_block(lv, p, t, open_cost, num_blocks[lv],
                                                    offset[lv], bload, bcount, blk_room, num_mb,
                                                    thr, dirty, d_list, n_dirty, l_width,
                                                    l_base, j_load, o_load, l_room)
                    if mode == PACK:
                        fit_b, fit_end = best_fit(p, t, limit, l_base[lv], l_width[lv],
                                                  offset[lv], sizes[lv] * capacity, j_load,
                                                  l_room, False, bload, blk_ng, blk_g, g_fill,
                                                  stack)
                else:
                    fit_room = 0
                    for b in range(num_blocks[lv]):
                        bb = offset[lv] + b
                        if blk_room[bb] >= p:
                            end = bload[bb] + t
                            if mode == PACK and end <= limit:
                                room = tightest(bb, p, sizes[lv] * capacity, blk_ng, blk_g,
                                                g_fill)
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
            top = _add(lv_pick, b_pick, time[i, lv_pick], 0, sizes, offset, bload, bcount)
        else:
            g_pick = num_groups
            num_groups += 1
            g_level[g_pick] = lv_pick
            g_block[g_pick] = b_pick
            g_fill[g_pick] = p
            blk_g[bb, blk_ng[bb]] = g_pick
            blk_ng[bb] += 1
            placed += (time[i, lv_pick] + (sizes[lv_pick] - k0) * c[2]) * sizes[lv_pick]
            top = _add(lv_pick, b_pick, time[i, lv_pick] + (sizes[lv_pick] - k0) * c[2], 1,
                       sizes, offset, bload, bcount)
        room = -1
        for q in range(blk_ng[bb]):
            room = max(room, room_cap - g_fill[blk_g[bb, q]])
        blk_room[bb] = room
        if trees:
            # The blocks _add changed: every block inside (lv_pick, b_pick), and the enclosing
            # ones up to level ``top``.
            r = sizes[lv_pick] // k0
            put_units(b_pick * r, (b_pick + 1) * r - 1, bload, bcount, blk_room, num_mb, state,
                      width, a_load, a_arg, a_room, w_room)
            for lv in range(1, min(lv_pick, tree_top) + 1):
                r = sizes[lv_pick] // sizes[lv]
                mark_blocks(lv, b_pick * r, (b_pick + 1) * r - 1, offset[lv], num_blocks[lv],
                            dirty, d_list, n_dirty)
            for lv in range(max(lv_pick + 1, 1), min(top, tree_top) + 1):
                blk = b_pick * sizes[lv_pick] // sizes[lv]
                mark_blocks(lv, blk, blk, offset[lv], num_blocks[lv], dirty, d_list, n_dirty)
        limit = max(limit, bload[bb])
        item_level[j] = lv_pick
        item_group[j] = g_pick
    makespan = 0.0
    for u in range(num_blocks[0]):
        makespan = max(makespan, bload[u])
    return num_groups, makespan
