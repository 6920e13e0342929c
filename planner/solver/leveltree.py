"""The placement kernel's search at the larger sizes (numba): per level a tree over its blocks.

Above the smallest size a level's question (place.py) has two kinds of answer: joining a group
with room for ``p`` padded tokens (ends at the block's load + t) and opening a group on a block
with a free microbatch (+ the ring latency it adds, ``open_cost``); the lowest (end, block)
wins. Per level, a binary tree over its blocks keeps in each node

- ``j_load``: the lowest load of a *join-active* block below it (room >= the level's
  threshold, the last ``p`` asked there), +inf if none;
- ``o_load``: the lowest load of an openable block (count below the microbatch count);
- ``w_room``: the largest room of a *waiting* block (room below the threshold).

As at the smallest size (blocktree.py), sizes reach a level in non-increasing ``p`` (the
kernel's order: by work, which grows with the padded length at every size), so a question first
activates the waiting blocks whose room reaches ``p`` (O(log) each), then descends twice, to
the first block of lowest join end and of lowest open end (rounding is monotone, so a subtree's
lowest load gives its lowest end), and compares the two. A larger ``p`` rewrites the level.

Blocks change far more often than a level is asked (every placement grows the loads of the
blocks inside its own and, up to where the maximum stops changing, of those around it; a
whole-pool group changes every block of every level), so changes are only noted
(``mark_blocks``) and written when the level is next asked: once per block however often it
changed, and the level whole once a quarter of it changed. Answers are the scan's exactly.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel, no_refcount
from planner.solver.blocktree import tree_width


@kernel
def level_layout(num_blocks: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(leaf slots per level, offset of each level's nodes in the flat level-tree arrays)."""
    num_levels = len(num_blocks)
    width = np.empty(num_levels, dtype=np.int64)
    base = np.empty(num_levels + 1, dtype=np.int64)
    acc = 0
    for lv in range(num_levels):
        width[lv] = tree_width(num_blocks[lv])
        base[lv] = acc
        acc += 2 * width[lv]
    base[num_levels] = acc
    return width, base


@no_refcount
def put_blocks(lv: int, lo: int, hi: int, first: int, load: NDArray[np.float64],
               count: NDArray[np.int64], room: NDArray[np.int64], num_mb: int,
               threshold: NDArray[np.int64], width: NDArray[np.int64], base: NDArray[np.int64],
               j_load: NDArray[np.float64], o_load: NDArray[np.float64],
               w_room: NDArray[np.int64]) -> None:
    """Blocks ``lo..hi`` of level ``lv`` changed (their load, count, room at ``first + b``):
    rewrite their leaves and the ancestors."""
    off = base[lv]
    w = width[lv]
    thr = threshold[lv]
    leaf_changed = False
    for b in range(lo, hi + 1):
        node = off + w + b
        x = first + b
        jl = load[x] if room[x] >= thr else np.inf
        rm = -1 if room[x] >= thr else room[x]
        ol = load[x] if count[x] < num_mb else np.inf
        if jl != j_load[node] or ol != o_load[node] or rm != w_room[node]:
            j_load[node] = jl
            o_load[node] = ol
            w_room[node] = rm
            leaf_changed = True
    if not leaf_changed:
        return
    lo += w
    hi += w
    while lo > 1:
        lo //= 2
        hi //= 2
        changed = False
        for j in range(lo, hi + 1):
            a = off + 2 * j
            jl = min(j_load[a], j_load[a + 1])
            ol = min(o_load[a], o_load[a + 1])
            rm = max(w_room[a], w_room[a + 1])
            if jl != j_load[off + j] or ol != o_load[off + j] or rm != w_room[off + j]:
                j_load[off + j] = jl
                o_load[off + j] = ol
                w_room[off + j] = rm
                changed = True
        if not changed:
            return


@no_refcount
def mark_blocks(lv: int, lo: int, hi: int, first: int, num_blocks: int,
                dirty: NDArray[np.bool_], d_list: NDArray[np.int64],
                n_dirty: NDArray[np.int64]) -> None:
    """Blocks ``lo..hi`` of level ``lv`` changed: note them for the level's next question
    (``n_dirty[lv]`` -1: every block of the level; a quarter of them or more is rewritten
    whole)."""
    if n_dirty[lv] < 0:
        return
    if 4 * (hi - lo + 1 + n_dirty[lv]) >= num_blocks:
        for q in range(n_dirty[lv]):
            dirty[first + d_list[first + q]] = False
        n_dirty[lv] = -1
        return
    for b in range(lo, hi + 1):
        if not dirty[first + b]:
            dirty[first + b] = True
            d_list[first + n_dirty[lv]] = b
            n_dirty[lv] += 1


@no_refcount
def lowest_block(lv: int, p: int, t: float, open_cost: float, num_blocks: int, first: int,
                 load: NDArray[np.float64], count: NDArray[np.int64], room: NDArray[np.int64],
                 num_mb: int, threshold: NDArray[np.int64], dirty: NDArray[np.bool_],
                 d_list: NDArray[np.int64], n_dirty: NDArray[np.int64],
                 width: NDArray[np.int64], base: NDArray[np.int64], j_load: NDArray[np.float64],
                 o_load: NDArray[np.float64], w_room: NDArray[np.int64]) -> tuple[int, float]:
    """(block, end) of level ``lv``'s lowest (end, block) for ``p`` padded tokens of time
    ``t``: joining (room >= p) ends at load + t, opening (count < num_mb) at load + t +
    open_cost; (-1, inf) when no block is a candidate. First rewrites the blocks
    ``mark_blocks`` noted since the level's last question."""
    off = base[lv]
    w = width[lv]
    if p > threshold[lv] or n_dirty[lv] < 0:
        # Every block rewritten against p (a larger p can shrink the candidates: rare).
        threshold[lv] = p
        for q in range(max(n_dirty[lv], 0)):
            dirty[first + d_list[first + q]] = False
        n_dirty[lv] = 0
        put_blocks(lv, 0, num_blocks - 1, first, load, count, room, num_mb, threshold, width,
                   base, j_load, o_load, w_room)
    else:
        for q in range(n_dirty[lv]):
            b = d_list[first + q]
            dirty[first + b] = False
            put_blocks(lv, b, b, first, load, count, room, num_mb, threshold, width, base,
                       j_load, o_load, w_room)
        n_dirty[lv] = 0
    if p < threshold[lv]:
        threshold[lv] = p
        while w_room[off + 1] >= p:
            node = 1
            while node < w:
                node = 2 * node + (w_room[off + 2 * node] < p)
            j_load[off + node] = load[first + node - w]
            w_room[off + node] = -1
            j = node // 2
            while j >= 1:
                jl = min(j_load[off + 2 * j], j_load[off + 2 * j + 1])
                rm = max(w_room[off + 2 * j], w_room[off + 2 * j + 1])
                if jl == j_load[off + j] and rm == w_room[off + j]:
                    break
                j_load[off + j] = jl
                w_room[off + j] = rm
                j //= 2
    best_b = -1
    best_end = np.inf
    low = j_load[off + 1]
    if low < np.inf:
        best_end = low + t
        node = 1
        while node < w:
            node = 2 * node + (j_load[off + 2 * node] + t > best_end)
        best_b = node - w
    low = o_load[off + 1]
    if low < np.inf:
        end = low + t + open_cost
        if end <= best_end:
            node = 1
            while node < w:
                node = 2 * node + (o_load[off + 2 * node] + t + open_cost > end)
            if end < best_end or node - w < best_b:
                best_end = end
                best_b = node - w
    return best_b, best_end
