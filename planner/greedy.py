"""Greedy (LPT) assignment of one step's segments to CP groups and microbatches, in numba.

Structure. Group sizes are nested: every valid size is a power of two dividing N (or N itself),
so each aligned block of size k lies inside exactly one block of every larger size. Groups are
placed level by level, largest size first, each level by LPT onto its blocks; the smallest size
k0 (1 unless ``min_cp`` says otherwise) then fills the remaining per-unit microbatch *cells*.
Because every group placed so far spans a whole block of the current level or misses it, all
ranks of a block have the same load and microbatch count when its groups are placed: no group
ever waits for a member, a group's microbatch index is its block's count, and the simulated
critical path equals the largest rank load. Bins (groups, cells) exist only in this module.

Per-level rules (see cost.py for t):
1. Size: each segment takes the smallest size whose group holds it; a segment whose lone-group
   time exceeds the step's average rank load moves up to the smallest larger size that brings it
   under the average (else its fastest size): the critical path can't beat the costliest group.
2. Sizes > k0, heaviest first: join an open group of the level (adds t) or open one on the least
   loaded block (adds t plus the group's fixed cost), whichever ends lower.
3. Size k0, heaviest first: the least loaded unit with room, into its emptiest cell, so that
   tokens spread over microbatches (no all-filler microbatch; lower activation peaks). M starts at
   max(ceil(padded / (N*C)), the blocks' counts), rounded up to the microbatch multiple; if a
   segment fits nowhere (worst-fit, then best-fit) M grows by the multiple, bounded since
   M = counts + segments always fits. Effort ``balanced`` (``max``) also tries the next 1 (3)
   feasible counts and keeps the fastest: extra microbatches loosen capacity for balance.

Trade-off: one greedy pass per level costs O(segments x blocks) and lands within a few percent of
the lower bound on long-tail mixes; a solver (cpsat.py) can start from its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.cost import CostModel
from planner.groups import pad_multiple

SOLVER_NAME = "greedy-lpt"
SOLVER_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingParams:
    """What the kernel needs from the config and the cost model, as numba-friendly arrays."""

    pool_size: int
    capacity: int
    sizes: NDArray[np.int64]
    """Allowed group sizes, ascending."""
    multiples: NDArray[np.int64]
    """Padding multiple at each size (groups.pad_multiple)."""
    cost: NDArray[np.float64]
    """CostModel.as_array()."""
    microbatch_multiple: int
    extra_microbatches: int
    """Also try M + i*multiple for i up to this and keep the fastest (effort)."""

    @classmethod
    def from_config(cls, config: PlannerConfig, cost: CostModel) -> PackingParams:
        p = config.parallel
        sizes = np.asarray(config.sizes, dtype=np.int64)
        mults = np.array([pad_multiple(int(k), p.tp_eff, config.layout) for k in sizes], np.int64)
        extra = {"fast": 0, "balanced": 1, "max": 3}[config.effort]
        return cls(pool_size=p.pool_size, capacity=config.capacity_tokens_per_rank, sizes=sizes,
                   multiples=mults, cost=cost.as_array(),
                   microbatch_multiple=p.microbatch_multiple, extra_microbatches=extra)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepAssignment:
    """One step's rows (plan columns except ``step``), sorted as the plan format demands."""

    num_microbatches: int
    predicted_seconds: float
    """The kernel's critical path (fillers' token cost excluded)."""
    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]


def assign_step(sample_index: NDArray[np.int64], token_offset: NDArray[np.int64],
                num_tokens: NDArray[np.int64], params: PackingParams) -> StepAssignment:
    """Place one step's segments (each fits some allowed group) into groups and microbatches."""
    out = _assign_step(np.asarray(sample_index, np.int64), np.asarray(token_offset, np.int64),
                       np.asarray(num_tokens, np.int64), params.sizes, params.multiples,
                       params.capacity, params.pool_size, params.cost,
                       params.microbatch_multiple, params.extra_microbatches)
    m, t, mb, start, k, sample, offset, ntok, padded = out
    return StepAssignment(num_microbatches=int(m), predicted_seconds=float(t), microbatch=mb,
                          rank_start=start, cp_size=k, sample_index=sample, token_offset=offset,
                          num_tokens=ntok, padded_tokens=padded)


@numba.njit(cache=True)
def _pad(length: int, multiple: int) -> int:
    return (length + multiple - 1) // multiple * multiple


@numba.njit(cache=True)
def _seq_time(c: NDArray[np.float64], k: int, p: float) -> float:
    """A sequence's share of its group's per-rank time (cost.py's t without fixed terms)."""
    t = (c[0] * p + c[1] * p * p) / k
    if k > 1:
        t += (k - 1) * c[3] * p / k
    return float(t)


@numba.njit(cache=True)
def _fixed_time(c: NDArray[np.float64], k: int) -> float:
    """A group's fixed per-rank time: the microbatch cost plus k-1 ring-step latencies."""
    return float(c[4] + (k - 1) * c[2])


@numba.njit(cache=True)
def _choose_sizes(tokens: NDArray[np.int64], sizes: NDArray[np.int64],
                  mults: NDArray[np.int64], capacity: int, pool_size: int,
                  c: NDArray[np.float64]) -> NDArray[np.int64]:
    """Index into ``sizes`` per segment: the smallest that fits, raised for the heaviest ones."""
    n = len(tokens)
    num_sizes = len(sizes)
    sidx = np.empty(n, dtype=np.int64)
    lone = np.empty(n, dtype=np.float64)
    work = 0.0
    for i in range(n):
        sidx[i] = -1
        for s in range(num_sizes):
            if _pad(tokens[i], mults[s]) <= sizes[s] * capacity:
                sidx[i] = s
                break
        if sidx[i] < 0:
            raise ValueError("a segment does not fit the largest group")
        k = sizes[sidx[i]]
        t = _seq_time(c, k, float(_pad(tokens[i], mults[sidx[i]])))
        lone[i] = t + _fixed_time(c, k)
        work += k * t
    avg = work / pool_size
    order = np.argsort(-lone, kind="mergesort")
    for j in range(n):
        i = order[j]
        # Upgrades only raise the average, so once one segment is under it the rest are too.
        if lone[i] <= avg:
            break
        s0 = sidx[i]
        best = s0
        best_t = lone[i]
        chosen = -1
        for s in range(s0 + 1, num_sizes):
            p = _pad(tokens[i], mults[s])
            if p > sizes[s] * capacity:
                continue
            t = _seq_time(c, sizes[s], float(p)) + _fixed_time(c, sizes[s])
            if t <= avg:
                chosen = s
                break
            if t < best_t:
                best = s
                best_t = t
        if chosen < 0:
            chosen = best
        if chosen != s0:
            p0 = float(_pad(tokens[i], mults[s0]))
            p1 = float(_pad(tokens[i], mults[chosen]))
            work += (sizes[chosen] * _seq_time(c, sizes[chosen], p1)
                     - sizes[s0] * _seq_time(c, sizes[s0], p0))
            avg = work / pool_size
            sidx[i] = chosen
    return sidx


@numba.njit(cache=True)
def _place_levels(sidx: NDArray[np.int64], padded: NDArray[np.int64], seq_t: NDArray[np.float64],
                  order: NDArray[np.int64], sizes: NDArray[np.int64], capacity: int,
                  pool_size: int, c: NDArray[np.float64], load: NDArray[np.float64],
                  count: NDArray[np.int64], g_start: NDArray[np.int64], g_k: NDArray[np.int64],
                  g_mb: NDArray[np.int64], seg_group: NDArray[np.int64]) -> int:
    """Place segments of sizes > sizes[0]; return the number of groups opened."""
    n = len(sidx)
    g_fill = np.zeros(n, dtype=np.int64)
    open_groups = np.empty(n, dtype=np.int64)
    num_groups = 0
    for s in range(len(sizes) - 1, 0, -1):
        k = sizes[s]
        room = k * capacity
        fixed = _fixed_time(c, k)
        num_blocks = pool_size // k
        # Groups that cannot take even the level's smallest segment leave the open list, so a
        # level of segments that each fill a group costs O(n), not O(n^2).
        min_p = room
        for i in range(n):
            if sidx[i] == s and padded[i] < min_p:
                min_p = padded[i]
        num_open = 0
        for j in range(n):
            i = order[j]
            if sidx[i] != s:
                continue
            p = padded[i]
            t = seq_t[i]
            join = -1
            join_at = -1
            join_end = np.inf
            for q in range(num_open):
                g = open_groups[q]
                if g_fill[g] + p > room:
                    continue
                end = load[g_start[g]] + t
                # Ties go to the fuller group (first-fit-decreasing keeps big holes open), then
                # to the older one, so the result does not depend on the open list's order.
                if end < join_end or (end == join_end and (
                        g_fill[g] > g_fill[join] or (g_fill[g] == g_fill[join] and g < join))):
                    join = g
                    join_at = q
                    join_end = end
            block = 0
            for b in range(1, num_blocks):
                if load[b * k] < load[block * k]:
                    block = b
            if join >= 0 and join_end <= load[block * k] + t + fixed:
                g = join
            else:
                g = num_groups
                num_groups += 1
                r0 = block * k
                g_start[g] = r0
                g_k[g] = k
                g_mb[g] = count[r0]
                for r in range(r0, r0 + k):
                    count[r] += 1
                    load[r] += fixed
                join_at = num_open
                open_groups[num_open] = g
                num_open += 1
            g_fill[g] += p
            for r in range(g_start[g], g_start[g] + k):
                load[r] += t
            seg_group[i] = g
            if g_fill[g] + min_p > room:
                num_open -= 1
                open_groups[join_at] = open_groups[num_open]
    return num_groups


@numba.njit(cache=True)
def _fill_cells(sidx: NDArray[np.int64], padded: NDArray[np.int64], seq_t: NDArray[np.float64],
                order: NDArray[np.int64], k0: int, capacity: int, pool_size: int,
                c: NDArray[np.float64], load: NDArray[np.float64], count: NDArray[np.int64],
                num_mb: int, best_fit: bool, seg_unit: NDArray[np.int64],
                seg_mb: NDArray[np.int64]) -> float:
    """Place size-k0 segments into the units' free microbatches; the makespan, or -1 if stuck."""
    units = pool_size // k0
    room = k0 * capacity
    fill = np.zeros((units, num_mb), dtype=np.int64)
    min_fill = np.zeros(units, dtype=np.int64)
    mb_fill = np.zeros(num_mb, dtype=np.int64)
    uload = np.empty(units, dtype=np.float64)
    for u in range(units):
        # Every free cell runs a microbatch (real or filler), so its fixed cost is paid anyway.
        uload[u] = load[u * k0] + (num_mb - count[u * k0]) * _fixed_time(c, k0)
        if count[u * k0] >= num_mb:
            min_fill[u] = room + 1  # no free cell: nothing fits
    for j in range(len(order)):
        i = order[j]
        if sidx[i] != 0:
            continue
        p = padded[i]
        best = -1
        for u in range(units):
            if min_fill[u] + p <= room and (best < 0 or uload[u] < uload[best]):
                best = u
        if best < 0:
            return -1.0
        cell = -1
        for m in range(count[best * k0], num_mb):
            f = fill[best, m]
            if f + p > room:
                continue
            if cell < 0:
                cell = m
                continue
            fc = fill[best, cell]
            better = f > fc if best_fit else f < fc
            # Equal fills go to the microbatch with the fewest tokens pool-wide, so that work
            # spreads over all M microbatches instead of leaving whole ones to fillers.
            if better or (f == fc and mb_fill[m] < mb_fill[cell]):
                cell = m
        fill[best, cell] += p
        mb_fill[cell] += p
        uload[best] += seq_t[i]
        lo = room + 1
        for m in range(count[best * k0], num_mb):
            if fill[best, m] < lo:
                lo = fill[best, m]
        min_fill[best] = lo
        seg_unit[i] = best
        seg_mb[i] = cell
    return float(uload.max())


@numba.njit(cache=True)
def _search_microbatches(sidx: NDArray[np.int64], padded: NDArray[np.int64],
                         seq_t: NDArray[np.float64], order: NDArray[np.int64], k0: int,
                         capacity: int, pool_size: int, c: NDArray[np.float64],
                         load: NDArray[np.float64], count: NDArray[np.int64], mb_multiple: int,
                         extra: int, seg_unit: NDArray[np.int64], seg_mb: NDArray[np.int64]
                         ) -> tuple[int, float]:
    """Fill the size-k0 cells for the smallest feasible M (and ``extra`` more); (M, makespan)."""
    n = len(sidx)
    n0 = 0
    total = 0
    for i in range(n):
        total += padded[i]
        if sidx[i] == 0:
            n0 += 1
    max_count = count.max()
    num_mb = max(max_count, -(-total // (pool_size * capacity)), 1)
    num_mb = -(-num_mb // mb_multiple) * mb_multiple
    # With max_count + n0 microbatches every size-k0 segment has an empty cell of its own, so
    # the search ends by then at the latest.
    limit = -(-(max_count + n0 + 1) // mb_multiple) * mb_multiple
    try_unit = np.full(n, -1, dtype=np.int64)
    try_mb = np.full(n, -1, dtype=np.int64)
    best_t = np.inf
    best_m = 0
    tries_left = extra + 1
    while tries_left > 0 and num_mb <= limit:
        # Worst-fit spreads tokens; when it strands a segment, best-fit may still pack this M.
        t = _fill_cells(sidx, padded, seq_t, order, k0, capacity, pool_size, c, load, count,
                        num_mb, False, try_unit, try_mb)
        if t < 0:
            t = _fill_cells(sidx, padded, seq_t, order, k0, capacity, pool_size, c, load, count,
                            num_mb, True, try_unit, try_mb)
        if t >= 0:
            # A larger M must be strictly faster to win: fewer microbatches are cheaper to run.
            if t < best_t * (1.0 - 1e-9):
                best_t = t
                best_m = num_mb
                seg_unit[:] = try_unit
                seg_mb[:] = try_mb
            tries_left -= 1
        num_mb += mb_multiple
    if best_m == 0:
        raise ValueError("no microbatch count up to the bound fits the step (internal error)")
    return best_m, best_t


@numba.njit(cache=True)
def _emit_rows(sample: NDArray[np.int64], offset: NDArray[np.int64], tokens: NDArray[np.int64],
               padded: NDArray[np.int64], order: NDArray[np.int64], seg_gid: NDArray[np.int64],
               grid: NDArray[np.int64], grp_k: NDArray[np.int64], filler_padded: int
               ) -> tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.int32],
                          NDArray[np.int64], NDArray[np.int64], NDArray[np.int32],
                          NDArray[np.int32]]:
    """Rows sorted by (microbatch, rank_start); ``grid[m, r]`` = group starting at rank r."""
    n = len(sample)
    num_mb, pool_size = grid.shape
    members = np.zeros(len(grp_k) + 1, dtype=np.int64)
    for i in range(n):
        members[seg_gid[i] + 1] += 1
    num_rows = n
    for m in range(num_mb):
        for r in range(pool_size):
            if grid[m, r] >= 0 and members[grid[m, r] + 1] == 0:
                num_rows += 1
    for g in range(len(grp_k)):
        members[g + 1] += members[g]
    # Segments per group in placement order (heaviest first) = the group's packing order.
    pos = members[:-1].copy()
    by_group = np.empty(n, dtype=np.int64)
    for j in range(n):
        i = order[j]
        by_group[pos[seg_gid[i]]] = i
        pos[seg_gid[i]] += 1
    o_mb = np.empty(num_rows, dtype=np.int32)
    o_start = np.empty(num_rows, dtype=np.int32)
    o_k = np.empty(num_rows, dtype=np.int32)
    o_sample = np.empty(num_rows, dtype=np.int64)
    o_offset = np.empty(num_rows, dtype=np.int64)
    o_tokens = np.empty(num_rows, dtype=np.int32)
    o_padded = np.empty(num_rows, dtype=np.int32)
    row = 0
    for m in range(num_mb):
        r = 0
        while r < pool_size:
            g = grid[m, r]
            if g < 0:
                raise ValueError("microbatch partition has a hole (internal error)")
            a = members[g]
            b = members[g + 1]
            for q in range(a, max(b, a + 1)):
                o_mb[row] = m
                o_start[row] = r
                o_k[row] = grp_k[g]
                if q < b:
                    i = by_group[q]
                    o_sample[row] = sample[i]
                    o_offset[row] = offset[i]
                    o_tokens[row] = tokens[i]
                    o_padded[row] = padded[i]
                else:
                    # Filler: an idle group still runs the microbatch, with one alignment unit.
                    o_sample[row] = -1
                    o_offset[row] = 0
                    o_tokens[row] = 0
                    o_padded[row] = filler_padded
                row += 1
            r += grp_k[g]
    return o_mb, o_start, o_k, o_sample, o_offset, o_tokens, o_padded


@numba.njit(cache=True)
def _assign_step(sample: NDArray[np.int64], offset: NDArray[np.int64], tokens: NDArray[np.int64],
                 sizes: NDArray[np.int64], mults: NDArray[np.int64], capacity: int,
                 pool_size: int, c: NDArray[np.float64], mb_multiple: int, extra: int
                 ) -> tuple[int, float, NDArray[np.int32], NDArray[np.int32], NDArray[np.int32],
                            NDArray[np.int64], NDArray[np.int64], NDArray[np.int32],
                            NDArray[np.int32]]:
    n = len(tokens)
    sidx = _choose_sizes(tokens, sizes, mults, capacity, pool_size, c)
    padded = np.empty(n, dtype=np.int64)
    seq_t = np.empty(n, dtype=np.float64)
    for i in range(n):
        padded[i] = _pad(tokens[i], mults[sidx[i]])
        seq_t[i] = _seq_time(c, sizes[sidx[i]], float(padded[i]))
    # Heaviest first; the stable sort makes ties follow the step's own (permutation) order.
    order = np.argsort(-seq_t, kind="mergesort")
    load = np.zeros(pool_size, dtype=np.float64)
    count = np.zeros(pool_size, dtype=np.int64)
    g_start = np.empty(n, dtype=np.int64)
    g_k = np.empty(n, dtype=np.int64)
    g_mb = np.empty(n, dtype=np.int64)
    seg_group = np.full(n, -1, dtype=np.int64)
    num_groups = _place_levels(sidx, padded, seq_t, order, sizes, capacity, pool_size, c, load,
                               count, g_start, g_k, g_mb, seg_group)
    k0 = sizes[0]
    seg_unit = np.full(n, -1, dtype=np.int64)
    seg_mb = np.full(n, -1, dtype=np.int64)
    num_mb, makespan = _search_microbatches(sidx, padded, seq_t, order, k0, capacity, pool_size,
                                            c, load, count, mb_multiple, extra, seg_unit, seg_mb)

    # Groups: the level groups, then one per (unit, free microbatch), real or filler.
    units = pool_size // k0
    grid = np.full((num_mb, pool_size), -1, dtype=np.int64)
    grp_k = np.full(num_groups + units * num_mb, k0, dtype=np.int64)
    for g in range(num_groups):
        grid[g_mb[g], g_start[g]] = g
        grp_k[g] = g_k[g]
    for u in range(units):
        for m in range(count[u * k0], num_mb):
            grid[m, u * k0] = num_groups + u * num_mb + m
    seg_gid = seg_group.copy()
    for i in range(n):
        if sidx[i] == 0:
            seg_gid[i] = num_groups + seg_unit[i] * num_mb + seg_mb[i]
    rows = _emit_rows(sample, offset, tokens, padded, order, seg_gid, grid, grp_k, mults[0])
    return (num_mb, makespan) + rows
