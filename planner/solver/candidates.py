"""Baselines as candidates: no step of a plan is slower than static CP or Megatron's greedy.

Per step, after the search (greedy.py) has placed the segments, two baselines are candidates,
scored by the same simulator (``cost.simulate_step``, critical path) as our own rows:

- ``static-cp``: static CP at the job's cp (static_cp.py): every microbatch cut into N / cp
  groups of size cp, next-fit packed in the drawn order (only when cp is an allowed size);
- ``megatron-greedy``: Megatron's ``default_dynamic_cp`` greedy (megatron.py): 2 N tp' padding,
  attention-only balance (only without VPP, which it does not model).

The step keeps the fastest; on equal time, fewer microbatches, then less padding, then ours.
So a plan's simulated time is never above either baseline's, step by step (a property test
checks it on random workloads), and a planner that can choose "all groups of cp" never loses to
plain static CP by a rounding of its heuristics.

Cost. A baseline is built only when it could win: first a lower bound of its simulated time,
valid for any rows it can produce, is compared with our simulated time, and a baseline whose
bound is above ours is skipped (margin 1e-9 for rounding). Static CP: the average rank load,
every sequence at size cp plus the microbatches' fixed cost, or its slowest sequence.
Megatron: the malleable bound (bounds.py) of its 2N-padded lengths, unless a floor of it (the
average rank load, or the longest segment's fastest time) already decides, which spares the
bound's tables. On the Wikipedia lengths both are above ours on almost every step (static CP
is 2-4x slower, 2N padding alone costs more than our gap to the bound), so the check costs
O(segments) and the baselines almost never run.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numpy.typing import NDArray

from planner.cost import _simulate
from planner.groups import MAX_SEGMENT_TOKENS, pad_multiple
from planner.solver.bounds import malleable_bound
from planner.solver.items import item_tables, seq_time
from planner.solver.megatron import megatron_arrays, megatron_padded
from planner.solver.static_cp import padded_lengths, static_bins

OURS = "dcp"
STATIC = "static-cp"
MEGATRON = "megatron-greedy"
MARGIN = 1e-9
"""Relative slack between a baseline's bound and our time before it is skipped (rounding)."""


class Rows(NamedTuple):
    """One step's 7 plan columns (all but ``step``), sorted as the plan format demands."""

    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]

    @property
    def num_microbatches(self) -> int:
        return int(self.microbatch[-1]) + 1 if len(self.microbatch) else 0


def simulate(rows: Rows, cost: NDArray[np.float64], pool_size: int) -> float:
    """The simulator's step time (``cost.simulate_step``) of ``rows``."""
    t, _ = _simulate(cost, pool_size, rows.microbatch, rows.rank_start, rows.cp_size,
                     rows.padded_tokens)
    return float(t)


def _rows(groups: list[tuple[int, int, int, list[int], int]], sample: NDArray[np.int64],
          offset: NDArray[np.int64], tokens: NDArray[np.int64], padded: NDArray[np.int64]
          ) -> Rows:
    """Rows of (microbatch, rank_start, size, positions, filler padded) groups in plan order."""
    mb: list[int] = []
    start: list[int] = []
    size: list[int] = []
    pos: list[int] = []
    for m, s, k, members, filler in groups:
        n = len(members) if members else 1
        mb += [m] * n
        start += [s] * n
        size += [k] * n
        pos += members if members else [-1 - filler]
    p = np.asarray(pos, dtype=np.int64)
    real = p >= 0
    q = np.where(real, p, 0)
    return Rows(microbatch=np.asarray(mb, np.int32), rank_start=np.asarray(start, np.int32),
                cp_size=np.asarray(size, np.int32),
                sample_index=np.where(real, sample[q], -1).astype(np.int64),
                token_offset=np.where(real, offset[q], 0).astype(np.int64),
                num_tokens=np.where(real, tokens[q], 0).astype(np.int32),
                padded_tokens=np.where(real, padded[q], -1 - p).astype(np.int32))


def static_bound(tokens: NDArray[np.int64], cost: NDArray[np.float64], *, pool_size: int,
                 cp: int, capacity: int, tp_eff: int, layout: str, multiple: int) -> float:
    """A lower bound of static CP's simulated time; inf when a segment does not fit cp x C."""
    P = padded_lengths(tokens, cp, tp_eff, layout)
    if not len(P) or int(P.max()) > cp * capacity:
        return np.inf
    pf = P.astype(np.float64)
    st = (cost[0] * pf + cost[1] * pf * pf) / cp
    if cp > 1:
        st = st + (cp - 1) * cost[3] * pf / cp
    m = max(1, -(-int(P.sum()) // (pool_size * capacity)))
    m = -(-m // multiple) * multiple
    fixed = cost[4] + (cp - 1) * cost[2]
    return float(max(st.sum() * cp / pool_size, st.max()) + m * fixed)


def static_rows(sample: NDArray[np.int64], offset: NDArray[np.int64],
                tokens: NDArray[np.int64], *, pool_size: int, cp: int, capacity: int,
                tp_eff: int, layout: str, multiple: int) -> Rows:
    """Static CP ``cp`` rows of one step (every segment fits cp x C)."""
    padded = padded_lengths(tokens, cp, tp_eff, layout)
    bins, num_mb = static_bins(padded, pool_size=pool_size, cp=cp, capacity=capacity,
                               microbatch_multiple=multiple)
    filler = pad_multiple(cp, tp_eff, layout)
    num_groups = pool_size // cp
    groups = []
    for m in range(num_mb):
        for j in range(num_groups):
            b = m * num_groups + j
            groups.append((m, j * cp, cp, bins[b] if b < len(bins) else [], filler))
    return _rows(groups, sample, offset, tokens, padded)


@numba.njit(cache=True)
def _malleable_floor(padded: NDArray[np.int64], sizes: NDArray[np.int64], capacity: int,
                     pool_size: int, c: NDArray[np.float64]) -> float:
    """A lower bound of ``malleable_bound`` (every segment must fit the largest size): the
    segments' rank-seconds, each at the smallest size that holds it and without latency, over
    N, or the fastest time of the longest segment (its best size, latency included; a longer
    segment is never faster), whichever is larger."""
    total = 0.0
    longest = 0
    for i in range(len(padded)):
        p = float(padded[i])
        lv = 0
        while sizes[lv] * capacity < padded[i]:
            lv += 1
        total += c[0] * p + c[1] * p * p + (sizes[lv] - 1) * c[3] * p
        longest = max(longest, padded[i])
    fastest = np.inf
    for lv in range(len(sizes)):
        if sizes[lv] * capacity >= longest:
            fastest = min(fastest, seq_time(c, sizes[lv], float(longest))
                          + (sizes[lv] - sizes[0]) * c[2])
    return max(total / pool_size, fastest)


def megatron_bound(tokens: NDArray[np.int64], cost: NDArray[np.float64], *, pool_size: int,
                   capacity: int, tp_eff: int, sizes: NDArray[np.int64],
                   ours: float = np.inf) -> float:
    """A lower bound of Megatron's simulated time; inf when it cannot place a segment.

    The malleable bound (bounds.py) of its 2N-padded lengths, unless a cheaper bound that never
    exceeds it (``_malleable_floor``) already rules Megatron out against ``ours``, our step
    time: that spares the bound's tables (4 ms a step at N = 1024).
    """
    P = megatron_padded(tokens, pool_size, tp_eff)
    fits = min(pool_size, int(sizes[-1])) * capacity
    if not len(P) or int(P.max()) > min(fits, MAX_SEGMENT_TOKENS):
        return np.inf
    fixed = cost[4] + (sizes[0] - 1) * cost[2]
    m = max(1, -(-int(P.sum()) // (pool_size * capacity)))
    cheap = _malleable_floor(P, sizes, capacity, pool_size, cost)
    if ours < (cheap + m * fixed) * (1 - MARGIN):
        return float(cheap + m * fixed)
    mults = np.full(len(sizes), 2 * pool_size * tp_eff, dtype=np.int64)
    t = item_tables(P, sizes, mults, capacity, cost)
    core = malleable_bound(t.lone, t.work, t.fits, pool_size)
    return float(core + m * fixed)


def megatron_rows(sample: NDArray[np.int64], offset: NDArray[np.int64],
                  tokens: NDArray[np.int64], *, pool_size: int, capacity: int, tp_eff: int,
                  sizes: NDArray[np.int64]) -> Rows | None:
    """Megatron's rows of one step, or None when they would need a size the plan may not use."""
    padded = megatron_padded(tokens, pool_size, tp_eff)
    allowed = tuple(int(k) for k in sizes)
    try:
        mb, start, k, pos = megatron_arrays(padded, pool_size=pool_size, capacity=capacity,
                                            sizes=allowed)
    except ValueError:
        return None
    if not np.isin(k, sizes).all():
        return None  # the full-pool fallback needs N, which cp_sizes may leave out
    return Rows(microbatch=mb.astype(np.int32), rank_start=start.astype(np.int32),
                cp_size=k.astype(np.int32), sample_index=sample[pos].astype(np.int64),
                token_offset=offset[pos].astype(np.int64),
                num_tokens=tokens[pos].astype(np.int32),
                padded_tokens=padded[pos].astype(np.int32))


def _key(rows: Rows, seconds: float, rank: int) -> tuple[float, int, int, int]:
    return (seconds, rows.num_microbatches, int(rows.padded_tokens.sum(dtype=np.int64)), rank)


def best_rows(ours: Rows, sample: NDArray[np.int64], offset: NDArray[np.int64],
              tokens: NDArray[np.int64], *, cost: NDArray[np.float64], pool_size: int,
              capacity: int, sizes: NDArray[np.int64], static_cp: int, megatron: bool,
              tp_eff: int, layout: str, multiple: int) -> tuple[Rows, str, float]:
    """(rows, candidate name, simulated seconds) of the best candidate for one step.

    ``static_cp`` 0 leaves static CP out; ``megatron`` False leaves Megatron's greedy out (it
    does not model VPP: callers pass False when ``multiple`` > 1).
    """
    best, name = ours, OURS
    key = _key(ours, simulate(ours, cost, pool_size), 0)
    tokens = np.asarray(tokens, dtype=np.int64)
    if static_cp:
        lb = static_bound(tokens, cost, pool_size=pool_size, cp=static_cp, capacity=capacity,
                          tp_eff=tp_eff, layout=layout, multiple=multiple)
        if np.isfinite(lb) and key[0] >= lb * (1 - MARGIN):
            rows = static_rows(sample, offset, tokens, pool_size=pool_size, cp=static_cp,
                               capacity=capacity, tp_eff=tp_eff, layout=layout,
                               multiple=multiple)
            k = _key(rows, simulate(rows, cost, pool_size), 1)
            if k < key:
                best, name, key = rows, STATIC, k
    if megatron and multiple == 1:
        lb = megatron_bound(tokens, cost, pool_size=pool_size, capacity=capacity, tp_eff=tp_eff,
                            sizes=sizes, ours=key[0])
        if np.isfinite(lb) and key[0] >= lb * (1 - MARGIN):
            got = megatron_rows(sample, offset, tokens, pool_size=pool_size, capacity=capacity,
                                tp_eff=tp_eff, sizes=sizes)
            if got is not None:
                k = _key(got, simulate(got, cost, pool_size), 2)
                if k < key:
                    best, name, key = got, MEGATRON, k
    return best, name, key[0]
