"""Megatron-LM's ``default_dynamic_cp`` greedy for one step, re-implemented from its behaviour.

Source of the behaviour: megatron/core/datasets/data_schedule.py (``DefaultDynamicCPScheduler``)
and data_schedule_utils.py (``next_hdp_group_packing_aware``, ``dcp_gpus_needed``) on Megatron's
``dev`` branch, read to get the rules right; no code is copied. Per step:

1. Padding: every sequence is padded to a multiple of 2*N*tp' (the whole pool), whatever size it
   then runs at. Since k divides N this also satisfies our format's 2*k*tp' rule, so Megatron's
   padding never breaks an invariant; it only wastes capacity.
2. Cost: attention only, work = P^2 / k per rank (P the padded length). No GEMM or ring term.
3. Sort descending by padded length (stable: ties keep the drawn order).
4. Microbatches repeat until the step's sequences are placed. Each one starts from the longest
   remaining sequence ("tall"): its smallest valid size k (>= ceil(P/C)) on ranks [0, k). The cap
   on any rank's work is tall * C * 1.05. Every later sequence (in order) considers each allowed
   size >= its minimum, smallest first: joining an existing group of that size (capacity
   sum(P)/k <= C) or opening a new group on the least-loaded free ranks; it takes the candidate
   with the smallest resulting maximum rank work (<= cap), the first one on ties. A sequence
   with no candidate waits for the next microbatch.
5. Empty ranks: grow the first group of the smallest size to the next allowed size, shifting the
   groups after it right; repeat. When that cannot fill the pool, the microbatch is replaced by
   one full-pool group holding, in order, every remaining sequence that fits N x C.

Where we had to deviate or guess (each marked below):
- Group placement. Megatron allocates ranks left to right in creation order, so a later, larger
  group can start at a rank its size does not divide (ranks [1, 3) for a size-2 group); its
  runtime then looks up the aligned group of that size, which is not the planned one. Our format
  demands aligned blocks, so when Megatron's order is not aligned we re-place the groups largest
  first (a permutation of ranks within the microbatch: same groups, same per-group work).
- Growing a group on a non-power-of-two pool (N=12: two groups of 4 and 4 empty ranks, next
  size 12) makes Megatron's code index past the pool; we treat it as "cannot fill" and take the
  full-pool fallback, which is what its docstring says it intends.
- VPP (``align_sample_id_groups``) is not modelled: vpp > 1 raises ValueError.

The planner scores this greedy as a candidate for every step (candidates.py); the bench's
``megatron_plan`` plans whole datasets with it (bench/baseline_megatron.py).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel, no_refcount
from planner.solver.megatron_tree import BIG, first_group, least_work, set_leaf, tree_offsets

SOLVER_NAME = "megatron-greedy"
WORK_CAP_DELTA = 0.05
"""Megatron's slack on the per-rank work cap (tall * C * (1 + delta))."""


def megatron_padded(lengths: NDArray[np.int64], pool_size: int, tp_eff: int) -> NDArray[np.int64]:
    """Megatron's padding: every length rounded up to a multiple of 2 * N * tp'."""
    m = 2 * pool_size * tp_eff
    return -(-np.asarray(lengths, dtype=np.int64) // m) * m


@no_refcount
def _fill_once(g_size: NDArray[np.int64], num_groups: int, pool_size: int,
               sizes: NDArray[np.int64]) -> bool:
    """Grow the first smallest group to the next size; False when Megatron's rule cannot."""
    used = 0
    smallest = pool_size + 1
    for g in range(num_groups):
        used += g_size[g]
        smallest = min(smallest, g_size[g])
    i = 0
    while sizes[i] != smallest:
        i += 1
    if i + 1 >= len(sizes):
        return False
    grow = sizes[i + 1] - smallest
    if grow > pool_size - used:
        # Guess: Megatron's code would write past the pool here (see module docstring).
        return False
    start = 0
    for g in range(num_groups):
        end = start + g_size[g] - 1
        if g_size[g] == smallest and end + grow < pool_size:
            g_size[g] = sizes[i + 1]
            return True
        start += g_size[g]
    return False


@kernel
def _microbatch(order: NDArray[np.int64], padded: NDArray[np.int64], pool_size: int,
                capacity: int, sizes: NDArray[np.int64], g_size: NDArray[np.int64],
                seq_group: NDArray[np.int64], placed: NDArray[np.int64],
                left: NDArray[np.int64], tree: bool) -> tuple[int, int, int]:
    """One microbatch from the remaining sequences ``order`` (sorted descending).

    Fills ``g_size`` (per group, creation order), ``seq_group`` and ``placed`` (the placed
    sequences in placement order) and ``left`` (the rest, in order). Returns (groups, placed,
    left), or groups = -1 when a sequence needs more ranks than the largest size. ``tree``:
    find each size's best existing group with megatron_tree's searches (the same answer as the
    scan over the groups, which ``tree=False`` keeps as the reference).
    """
    num_levels = len(sizes)
    n = len(order)
    off, leaves = tree_offsets(pool_size, sizes)
    min_tok = np.full(off[num_levels], BIG, dtype=np.int64)
    min_work = np.full(off[num_levels], np.inf)
    stack = np.empty(128, dtype=np.int64)
    q_of = np.empty(n, dtype=np.int64)
    g_tokens = np.zeros(n, dtype=np.int64)
    g_work = np.zeros(n, dtype=np.float64)
    by_size = np.empty((num_levels, n), dtype=np.int64)
    count = np.zeros(num_levels, dtype=np.int64)
    tall = padded[order[0]]
    cap = float(tall) * float(capacity) * (1.0 + WORK_CAP_DELTA)
    need = -(-tall // capacity)
    lv0 = 0
    while lv0 < num_levels and sizes[lv0] < need:
        lv0 += 1
    if lv0 == num_levels:
        return -1, 0, 0
    g_size[0] = sizes[lv0]
    g_tokens[0] = tall
    g_work[0] = tall * tall / sizes[lv0]
    by_size[lv0, 0] = 0
    count[lv0] = 1
    q_of[0] = 0
    set_leaf(min_tok, min_work, off[lv0], leaves[lv0], 0, g_tokens[0], g_work[0])
    num_groups = 1
    seq_group[order[0]] = 0
    placed[0] = order[0]
    num_placed = 1
    num_left = 0
    free = pool_size - sizes[lv0]
    top = g_work[0]
    for idx in range(1, n):
        j = order[idx]
        p = padded[j]
        need = -(-p // capacity)
        if need > sizes[num_levels - 1]:
            return -1, 0, 0
        best = -2
        best_lv = -1
        best_max = 0.0
        for lv in range(num_levels):
            k = sizes[lv]
            if k < need:
                continue
            w = p * p / k
            limit = k * capacity - p
            if tree:
                o, s = off[lv], leaves[lv]
                q = first_group(min_tok, min_work, o, s, limit, w, top, stack)
                if q < 0:
                    least = least_work(min_tok, min_work, o, s, limit, stack)
                    if least < np.inf:
                        q = first_group(min_tok, min_work, o, s, limit, w, least + w, stack)
                if q >= 0:
                    g = by_size[lv, q]
                    projected = max(top, g_work[g] + w)
                    if projected <= cap and (best_lv < 0 or projected < best_max):
                        best, best_lv, best_max = g, lv, projected
            else:
                for q in range(count[lv]):
                    g = by_size[lv, q]
                    if g_tokens[g] > limit:
                        continue
                    projected = max(top, g_work[g] + w)
                    if projected <= cap and (best_lv < 0 or projected < best_max):
                        best, best_lv, best_max = g, lv, projected
            if free >= k:
                projected = max(top, w)
                if projected <= cap and (best_lv < 0 or projected < best_max):
                    best, best_lv, best_max = -1, lv, projected
            if tree and best_lv >= 0 and best_max == top:
                break  # nothing is below top, and a later size must be strictly better
        if best_lv < 0:
            left[num_left] = j
            num_left += 1
            continue
        k = sizes[best_lv]
        if best == -1:
            # New group on the least-loaded free ranks: free ranks have no work, and Megatron's
            # stable sort then takes the lowest-numbered ones, i.e. the next ranks to the right.
            best = num_groups
            num_groups += 1
            g_size[best] = k
            by_size[best_lv, count[best_lv]] = best
            q_of[best] = count[best_lv]
            count[best_lv] += 1
            free -= k
        g_tokens[best] += p
        g_work[best] += p * p / k
        set_leaf(min_tok, min_work, off[best_lv], leaves[best_lv], q_of[best], g_tokens[best],
                 g_work[best])
        seq_group[j] = best
        placed[num_placed] = j
        num_placed += 1
        top = max(top, g_work[best])
    while g_size[:num_groups].sum() < pool_size:
        if not _fill_once(g_size, num_groups, pool_size, sizes):
            # Fallback: one full-pool group of everything that fits, in order.
            g_size[0] = pool_size
            tokens = 0
            num_placed = 0
            num_left = 0
            for idx in range(n):
                j = order[idx]
                if tokens + padded[j] <= pool_size * capacity:
                    tokens += padded[j]
                    seq_group[j] = 0
                    placed[num_placed] = j
                    num_placed += 1
                else:
                    left[num_left] = j
                    num_left += 1
            return 1, num_placed, num_left
    return num_groups, num_placed, num_left


@kernel
def _megatron(padded: NDArray[np.int64], pool_size: int, capacity: int,
              sizes: NDArray[np.int64], tree: bool) -> tuple[NDArray[np.int64], NDArray[np.int64],
                                                 NDArray[np.int64], NDArray[np.int64]]:
    n = len(padded)
    mb = np.empty(n, dtype=np.int64)
    start = np.empty(n, dtype=np.int64)
    size = np.empty(n, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    order = np.argsort(-padded, kind="mergesort")
    g_size = np.empty(n, dtype=np.int64)
    seq_group = np.empty(n, dtype=np.int64)
    placed = np.empty(n, dtype=np.int64)
    left = np.empty(n, dtype=np.int64)
    row = 0
    m = 0
    while len(order):
        num_groups, num_placed, num_left = _microbatch(order, padded, pool_size, capacity,
                                                       sizes, g_size, seq_group, placed, left,
                                                       tree)
        if num_groups < 0:
            return mb[:0], start[:0], size[:0], pos[:0]
        # Megatron's rank order if aligned, else re-placed largest first (module docstring:
        # sizes are powers of two dividing N, or N, so largest first is always aligned).
        rank = np.arange(num_groups)
        s = 0
        aligned = True
        for g in range(num_groups):
            if g_size[g] != pool_size and s % g_size[g] != 0:
                aligned = False
            s += g_size[g]
        if not aligned:
            rank = np.argsort(-g_size[:num_groups], kind="mergesort")
        g_start = np.empty(num_groups, dtype=np.int64)
        s = 0
        for q in range(num_groups):
            g_start[rank[q]] = s
            s += g_size[rank[q]]
        # Each group's sequences in placement order: a counting sort by group (one pass, not
        # one pass per group: 16M steps a microbatch at N = 1024).
        first = np.zeros(num_groups + 1, dtype=np.int64)
        for x in range(num_placed):
            first[seq_group[placed[x]] + 1] += 1
        for g in range(num_groups):
            first[g + 1] += first[g]
        by_group = np.empty(num_placed, dtype=np.int64)
        for x in range(num_placed):
            g = seq_group[placed[x]]
            by_group[first[g]] = placed[x]
            first[g] += 1
        for q in range(num_groups):
            g = rank[q]
            lo = first[g - 1] if g else 0
            for x in range(lo, first[g]):
                mb[row] = m
                start[row] = g_start[g]
                size[row] = g_size[g]
                pos[row] = by_group[x]
                row += 1
        order = left[:num_left].copy()
        m += 1
    return mb, start, size, pos


def megatron_groups(padded: NDArray[np.int64], *, pool_size: int, capacity: int,
                    sizes: tuple[int, ...]) -> list[list[tuple[int, int, list[int]]]]:
    """Per microbatch, its groups as (rank_start, size, positions in packing order).

    ``padded`` holds Megatron's padded lengths (``megatron_padded``), each fitting N x C.

    Raises:
        ValueError: a sequence needs more ranks than the largest size.
    """
    mb, start, size, pos = megatron_arrays(padded, pool_size=pool_size, capacity=capacity,
                                           sizes=sizes)
    out: list[list[tuple[int, int, list[int]]]] = []
    for m, s, k, j in zip(mb.tolist(), start.tolist(), size.tolist(), pos.tolist(),
                          strict=True):
        if m == len(out):
            out.append([])
        groups = out[m]
        if not groups or groups[-1][0] != s:
            groups.append((s, k, []))
        groups[-1][2].append(j)
    return out


def megatron_arrays(padded: NDArray[np.int64], *, pool_size: int, capacity: int,
                    sizes: tuple[int, ...], tree: bool = True
                    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                               NDArray[np.int64]]:
    """(microbatch, rank_start, size, position) per row, in plan order (see module docstring).

    ``tree`` False scans every group for each sequence (the reference the tree search is
    tested against; megatron_tree.py).

    Raises:
        ValueError: a sequence needs more ranks than the largest size.
    """
    padded = np.asarray(padded, dtype=np.int64)
    if not len(padded):
        z = np.zeros(0, np.int64)
        return z, z, z, z
    out = _megatron(padded, pool_size, capacity, np.asarray(sizes, dtype=np.int64), tree)
    if len(out[0]) != len(padded):
        raise ValueError(f"a sequence of {int(padded.max())} padded tokens needs more than "
                         f"the largest group ({sizes[-1]} ranks of {capacity} tokens)")
    return out
