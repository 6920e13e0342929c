"""Search trees for Megatron's greedy (megatron.py): each sequence's best existing group of a
size in O(log groups) instead of a scan of every group of that size.

Megatron's rule, per sequence of padded length p and per size k (w = p^2 / k): among the groups
of size k whose tokens leave room (tokens <= k C - p), take the one whose resulting work
max(top, work + w) is smallest, the first created on ties. A scan over the groups made it
O(sequences x groups) per microbatch: 25 ms a step at N = 1024 on the Wikipedia lengths, half
of the planner's own time, which every step pays since the plan records the gain.

Per size, a tree over the groups in creation order holds each node's least tokens and least
work. The best group is found with two exact searches, both pruned by those minima (a subtree
whose least tokens exceed the room, or whose least work plus w exceeds the threshold, holds no
answer, since float addition is monotone):

1. the first group with room and work + w <= top: its result is top, the least possible;
2. otherwise the least work m among groups with room, then the first group with room and
   work + w <= m + w: the first of those whose result is the least.

Both give the group the scan gives, bit for bit (the comparisons are the scan's own float
expressions at the leaves; a test compares them on random steps). Leaves of groups not yet
created hold +inf, so they never match.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel, no_refcount

BIG = np.iinfo(np.int64).max


@kernel
def tree_offsets(pool_size: int, sizes: NDArray[np.int64]) -> tuple[NDArray[np.int64],
                                                                   NDArray[np.int64]]:
    """Per level, (offset of its tree in the flat arrays, its number of leaves: a power of two
    >= the most groups of that size a pool holds, N // k)."""
    num_levels = len(sizes)
    off = np.empty(num_levels + 1, dtype=np.int64)
    leaves = np.empty(num_levels, dtype=np.int64)
    off[0] = 0
    for lv in range(num_levels):
        s = 1
        while s < max(1, pool_size // sizes[lv]):
            s *= 2
        leaves[lv] = s
        off[lv + 1] = off[lv] + 2 * s
    return off, leaves


@no_refcount
def set_leaf(min_tok: NDArray[np.int64], min_work: NDArray[np.float64], off: int, leaves: int,
             q: int, tokens: int, work: float) -> None:
    """Group q of a level now holds ``tokens`` and ``work``: its leaf and its ancestors."""
    node = leaves + q
    min_tok[off + node] = tokens
    min_work[off + node] = work
    node //= 2
    while node >= 1:
        a, b = off + 2 * node, off + 2 * node + 1
        t = min(min_tok[a], min_tok[b])
        wk = min(min_work[a], min_work[b])
        if min_tok[off + node] == t and min_work[off + node] == wk:
            break  # nothing above changes either
        min_tok[off + node] = t
        min_work[off + node] = wk
        node //= 2


@no_refcount
def first_group(min_tok: NDArray[np.int64], min_work: NDArray[np.float64], off: int,
                leaves: int, limit: int, w: float, thr: float, stack: NDArray[np.int64]) -> int:
    """The first group (creation order) with tokens <= limit and work + w <= thr, or -1."""
    stack[0] = 1
    sp = 1
    while sp:
        sp -= 1
        node = stack[sp]
        if min_tok[off + node] > limit or min_work[off + node] + w > thr:
            continue
        if node >= leaves:
            return int(node - leaves)
        stack[sp] = 2 * node + 1  # the right child waits under the left one
        stack[sp + 1] = 2 * node
        sp += 2
    return -1


@no_refcount
def least_work(min_tok: NDArray[np.int64], min_work: NDArray[np.float64], off: int,
               leaves: int, limit: int, stack: NDArray[np.int64]) -> float:
    """The least work of a group with tokens <= limit (inf: none)."""
    best = np.inf
    stack[0] = 1
    sp = 1
    while sp:
        sp -= 1
        node = stack[sp]
        if min_tok[off + node] > limit or min_work[off + node] >= best:
            continue
        if node >= leaves:
            best = min_work[off + node]
            continue
        stack[sp] = 2 * node + 1
        stack[sp + 1] = 2 * node
        sp += 2
    return best
