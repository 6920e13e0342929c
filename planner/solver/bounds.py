"""A tighter lower bound on a step's time, for malleable sequences (each picks its group size).

Issue 3 defines the reported bound as max(sum of cheapest work / N, costliest single sequence)
(``cost.step_lower_bound``). It lets every sequence be both at its cheapest size (for the work
term) and at its fastest (for the single term), which no schedule can do at once: a 200K-token
sequence is cheapest on 16 ranks and fastest on 64. The classical bound for malleable tasks
closes that hole: in a schedule of makespan T every sequence runs at some size whose time is at
most T, so the total work is at least W(T) = sum_i min{work_i(k) : time_i(k) <= T}, and

    T >= T* = min over T >= max_i min_k time_i(k) of max(T, W(T) / N).

W is a non-increasing step function, so T* is attained at one of its steps and one ascending
sweep over them finds it. Latency and microbatch costs are handled as in cost.py: a sequence's
time includes its ring latency, its work does not (a group pays it once for all its sequences),
and every rank pays its microbatches' fixed cost on top (added by the caller).

The kernel uses T* as its target and its gap to T* to decide which steps are worth refining;
plan_stats reports the sum of T* next to the issue's bound.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel


@kernel
def malleable_bound(lone: NDArray[np.float64], work: NDArray[np.float64],
                    fits: NDArray[np.bool_], rows: NDArray[np.int64], pool_size: int) -> float:
    """T* (see the module docstring) of the segments of table rows ``rows`` (items.RunTables'
    ``lone``, ``work`` and ``fits``), in step order."""
    n = len(rows)
    num_levels = lone.shape[1]
    if n == 0:
        return 0.0
    floor = 0.0
    for q in range(n):
        i = rows[q]
        best = np.inf
        for lv in range(num_levels):
            if fits[i, lv] and lone[i, lv] < best:
                best = lone[i, lv]
        floor = max(floor, best)
    # Each item's level at T = floor: the smallest level whose time is within it.
    cur = np.empty(n, dtype=np.int64)
    total = 0.0
    for q in range(n):
        i = rows[q]
        for lv in range(num_levels):
            if fits[i, lv] and lone[i, lv] <= floor:
                cur[q] = lv
                total += work[i, lv]
                break
    upper = total / pool_size
    if upper <= floor:
        return floor
    # Events: as T rises past lone[i, l], level l becomes item i's cheapest feasible level when
    # it is a prefix minimum of lone (no smaller level is faster). Only T in (floor, upper)
    # can improve on max(floor, W(floor) / N) = upper.
    ev_t = np.empty(n * num_levels, dtype=np.float64)
    ev_dw = np.empty(n * num_levels, dtype=np.float64)
    records = np.empty(num_levels, dtype=np.int64)
    num = 0
    for q in range(n):
        i = rows[q]
        prev = cur[q]
        run_min = np.inf
        num_rec = 0
        for lv in range(cur[q]):
            if fits[i, lv] and lone[i, lv] < run_min:
                run_min = lone[i, lv]
                records[num_rec] = lv
                num_rec += 1
        # Records have decreasing times left to right: ascending T visits them right to left.
        for r in range(num_rec - 1, -1, -1):
            lv = records[r]
            if lone[i, lv] < upper:
                ev_t[num] = lone[i, lv]
                ev_dw[num] = work[i, lv] - work[i, prev]
                num += 1
            prev = lv
    best = upper
    idx = np.argsort(ev_t[:num], kind="mergesort")
    w = total
    j = 0
    while j < num:
        t = ev_t[idx[j]]
        if t >= best:
            break
        while j < num and ev_t[idx[j]] == t:
            w += ev_dw[idx[j]]
            j += 1
        best = min(best, max(t, w / pool_size))
    return best


@kernel
def full_pool_bound(padded: NDArray[np.int64], time: NDArray[np.float64],
                    work: NDArray[np.float64], fits: NDArray[np.bool_],
                    min_level: NDArray[np.int64], rows: NDArray[np.int64],
                    sizes: NDArray[np.int64], capacity: int, cost: NDArray[np.float64]) -> float:
    """The bound where segments need the whole pool (0 when none does), without fixed costs.

    A segment whose only fitting size is the whole pool N runs in a group of all N ranks, which
    overlaps nothing: every rank spends that group's time, ring latency (N - 1) x cp_fixed
    included, and at least ceil(their padded tokens / (N C)) such groups exist. Everything
    else at best spreads its cheapest rank-seconds (without any latency, which it may share
    with those groups) evenly, or adds its time at the full pool to theirs. So

        T >= sum_full time_N + G (N - k0) cp_fixed + max(sum_rest min work / N,
                                                         max_rest min(time_N, min time))

    on top of every rank's microbatch fixed costs (the caller adds those). The malleable bound
    takes the maximum of one such segment's time and the average work, which undercounts a
    full-pool segment next to work that cannot shrink below it.
    """
    num_levels = time.shape[1]
    top = num_levels - 1
    needs_pool = False
    for i in rows:
        if min_level[i] == top:
            needs_pool = True
            break
    if not needs_pool:
        return 0.0
    pool = sizes[top]
    k0 = sizes[0]
    full_time = 0.0
    full_tokens = 0
    rest_work = 0.0
    rest_single = 0.0
    for i in rows:
        if min_level[i] == top:
            full_time += time[i, top]
            full_tokens += padded[i, top]
            continue
        # Cheapest rank-seconds without the latency share (it may ride on a full-pool group).
        best = np.inf
        fastest = np.inf
        for lv in range(num_levels):
            if fits[i, lv]:
                k = sizes[lv]
                best = min(best, k * time[i, lv])
                fastest = min(fastest, time[i, lv] + (k - k0) * cost[2])
        if fits[i, top]:
            fastest = min(fastest, time[i, top])
        rest_work += best
        rest_single = max(rest_single, fastest)
    if full_tokens == 0:
        return 0.0
    groups = -(-full_tokens // (pool * capacity))
    return float(full_time + groups * (pool - k0) * cost[2] + max(rest_work / pool, rest_single))
