"""Search trees over each level's blocks (numba): the placement kernel's best block in O(log).

The kernel (place.py) asks, for one segment at one level, for the block where it would end
lowest: joining a group with room (ends at the block's load plus the segment's time) or opening
a group on a block with a free microbatch (plus the ring latency a new group adds), the lowest
block index on ties. A linear scan costs O(blocks) per question: O(N) at the smallest size,
which dominates planning at pools of hundreds of ranks. Here each level keeps a binary tree over
its blocks whose nodes hold, for their leaves, the lowest load (and the first leaf that has it),
the lowest load of a block that can still open a group, and the largest room; ``best_block``
walks it left to right and prunes every subtree that cannot beat the best end found so far.
Where opening costs nothing extra (the smallest size) the lowest-load block is the answer
whenever it is a candidate, which a walk up its path confirms without the search (most
segments: a pass at N = 1024 took 0.63x the time). The answer is exactly the scan's
(same arithmetic at the leaves, leaves visited in index order, replaced only when strictly
lower), so plans do not change; only the time to find them does.

Layout: level ``lv`` has ``width[lv]`` leaf slots (a power of two >= its block count) at nodes
``base[lv] + width[lv] + b``; node ``base[lv] + j`` has children ``base[lv] + 2j`` and
``+ 2j + 1``; node 1 of a level is its root. Empty slots hold +inf loads and room -1; ``t_arg``
holds a node's first lowest-load leaf (the left one on ties).
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.typing import NDArray


@numba.njit(cache=True)
def tree_layout(num_blocks: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(leaf slots per level, offset of each level's nodes in the flat tree arrays)."""
    num_levels = len(num_blocks)
    width = np.empty(num_levels, dtype=np.int64)
    base = np.empty(num_levels + 1, dtype=np.int64)
    acc = 0
    for lv in range(num_levels):
        w = 1
        while w < num_blocks[lv]:
            w *= 2
        width[lv] = w
        base[lv] = acc
        acc += 2 * w
    base[num_levels] = acc
    return width, base


@numba.njit(cache=True)
def set_leaf(lv: int, b: int, load: float, openable: bool, room: int,
             width: NDArray[np.int64], base: NDArray[np.int64], t_load: NDArray[np.float64],
             t_open: NDArray[np.float64], t_room: NDArray[np.int64],
             t_arg: NDArray[np.int64]) -> None:
    """Write block ``b`` of level ``lv`` into its leaf (parents are fixed by ``fix_up``)."""
    node = base[lv] + width[lv] + b
    t_load[node] = load
    t_open[node] = load if openable else np.inf
    t_room[node] = room
    t_arg[node] = b


@numba.njit(cache=True)
def fix_up(lv: int, lo: int, hi: int, width: NDArray[np.int64], base: NDArray[np.int64],
           t_load: NDArray[np.float64], t_open: NDArray[np.float64],
           t_room: NDArray[np.int64], t_arg: NDArray[np.int64]) -> None:
    """Recompute the ancestors of leaves ``lo..hi`` (inclusive) of level ``lv``.

    Stops early when a single ancestor comes out unchanged (nothing above it can change).
    """
    off = base[lv]
    lo += width[lv]
    hi += width[lv]
    while lo > 1:
        lo //= 2
        hi //= 2
        changed = False
        for j in range(lo, hi + 1):
            a = off + 2 * j
            ld = min(t_load[a], t_load[a + 1])
            op = min(t_open[a], t_open[a + 1])
            rm = max(t_room[a], t_room[a + 1])
            ag = t_arg[a] if t_load[a] <= t_load[a + 1] else t_arg[a + 1]
            if (ld != t_load[off + j] or op != t_open[off + j] or rm != t_room[off + j]
                    or ag != t_arg[off + j]):
                t_load[off + j] = ld
                t_open[off + j] = op
                t_room[off + j] = rm
                t_arg[off + j] = ag
                changed = True
        if not changed:
            return


@numba.njit(cache=True, inline="always")
def _bound(node: int, p: int, t: float, open_cost: float, t_load: NDArray[np.float64],
           t_open: NDArray[np.float64], t_room: NDArray[np.int64]) -> float:
    """The lowest end any leaf under ``node`` can offer (exact at a leaf)."""
    bound = np.inf
    if t_room[node] >= p:
        bound = t_load[node] + t
    if t_open[node] < np.inf:
        bound = min(bound, t_open[node] + t + open_cost)
    return bound


@numba.njit(cache=True)
def best_block(lv: int, p: int, t: float, open_cost: float, width: NDArray[np.int64],
               base: NDArray[np.int64], t_load: NDArray[np.float64],
               t_open: NDArray[np.float64], t_room: NDArray[np.int64], t_arg: NDArray[np.int64],
               stack: NDArray[np.int64], stack_bound: NDArray[np.float64]) -> tuple[int, float]:
    """(block, end) of the lowest end for a segment of ``p`` padded tokens and time ``t``.

    A block with a group of room >= p ends at load + t; otherwise, if it can open a group, at
    load + t + open_cost; otherwise it is not a candidate. Lowest end first, then lowest block;
    (-1, inf) when no block is a candidate. The walk goes to the better child first (left on
    ties) and skips a subtree whose bound cannot beat the best (end, block) found so far; the
    other child waits on a stack with its bound and the first leaf it covers.
    """
    off = base[lv]
    w = width[lv]
    if open_cost == 0.0:
        # Joining and opening end alike, so the answer is the lowest-load block when that block
        # is a candidate, unless a block before it ends just as low by rounding: every subtree
        # left of its path must end higher (then the walk below would find the same block).
        b = t_arg[off + 1]
        leaf = off + w + b
        if t_room[leaf] >= p or t_open[leaf] < np.inf:
            end = t_load[leaf] + t
            node = w + b
            while node > 1 and (node % 2 == 0 or t_load[off + node - 1] + t > end):
                node //= 2
            if node == 1:
                return b, end
    best_end = np.inf
    best_b = -1
    top = 0
    stack[0] = 1
    stack[1] = 0
    stack_bound[0] = _bound(off + 1, p, t, open_cost, t_load, t_open, t_room)
    while top >= 0:
        j = stack[2 * top]
        first = stack[2 * top + 1]
        bound = stack_bound[top]
        top -= 1
        # Descend from j to a leaf, always to the better child, queueing the other one.
        span = w
        d = j
        while d > 1:
            d //= 2
            span //= 2
        while True:
            if bound > best_end or (bound == best_end and first > best_b):
                break
            if j >= w:
                # A leaf: the bound is its exact end (joining beats opening on one block).
                best_end = bound
                best_b = j - w
                break
            span //= 2
            left = _bound(off + 2 * j, p, t, open_cost, t_load, t_open, t_room)
            right = _bound(off + 2 * j + 1, p, t, open_cost, t_load, t_open, t_room)
            top += 1
            if right < left:
                stack[2 * top] = 2 * j
                stack[2 * top + 1] = first
                stack_bound[top] = left
                j = 2 * j + 1
                first += span
                bound = right
            else:
                stack[2 * top] = 2 * j + 1
                stack[2 * top + 1] = first + span
                stack_bound[top] = right
                j = 2 * j
                bound = left
    return best_b, best_end
