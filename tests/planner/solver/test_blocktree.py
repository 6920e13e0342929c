"""The placement kernel's search trees answer exactly what a scan over every block answers, and a
pass with them places every segment where a pass without them does."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import load_cost_model
from planner.solver.blocktree import NO_THRESHOLD, best_fit, lowest_unit, put_units, tree_width
from planner.solver.leveltree import level_layout, lowest_block, mark_blocks, put_blocks
from planner.solver.place import BALANCE, PACK, place
from planner.solver.step import PackingParams, make_problem, min_microbatches


def _scan(load: np.ndarray, count: np.ndarray, room: np.ndarray, num_mb: int, p: int, t: float,
          open_cost: float) -> tuple[int, float]:
    """The kernel's linear scan: first block of lowest end (joining ends at load + t, opening at
    load + t + open_cost)."""
    best_b, best_end = -1, np.inf
    for b in range(len(load)):
        if room[b] >= p:
            end = load[b] + t
        elif count[b] < num_mb:
            end = load[b] + t + open_cost
        else:
            continue
        if end < best_end:
            best_b, best_end = b, end
    return best_b, best_end


def _loads(rng: np.random.Generator, n: int, ties: int) -> np.ndarray:
    # Few distinct loads make ties common: the lowest block must still win them. Loads a few
    # ulps apart (ties == 2) end equal after adding t by rounding: the first such block wins.
    if ties == 2:
        return 1.0 + rng.integers(0, 3, n) * np.finfo(np.float64).eps
    if ties == 1:
        return (rng.integers(0, 4, n) * 0.25).astype(np.float64)
    return rng.random(n)


def _ps(rng: np.random.Generator, questions: int, rising: bool) -> list[int]:
    """Segment sizes as the kernel asks them: non-increasing, with (``rising``) a few rises."""
    ps = sorted(rng.integers(1, 100, questions).tolist(), reverse=True)
    if rising:
        for q in rng.integers(0, questions, 3):
            ps[q] = int(rng.integers(1, 100))
    return ps


@given(n=st.integers(1, 70), seed=st.integers(0, 2**32 - 1), ties=st.sampled_from([0, 1, 2]),
       questions=st.integers(1, 30), rising=st.booleans())
@settings(max_examples=200, deadline=None)
def test_lowest_unit_equals_the_scan(n: int, seed: int, ties: int, questions: int,
                                     rising: bool) -> None:
    rng = np.random.default_rng(seed)
    num_mb = int(rng.integers(1, 4))
    load = _loads(rng, n, ties)
    count = rng.integers(0, num_mb + 1, n)
    room = np.where(rng.random(n) < 0.5, rng.integers(0, 100, n), -1)
    width = tree_width(n)
    a_load = np.full(2 * width, np.inf)
    a_arg = np.full(2 * width, -1, dtype=np.int64)
    a_room = np.full(2 * width, -1, dtype=np.int64)
    w_room = np.full(2 * width, -1, dtype=np.int64)
    state = np.full(1, NO_THRESHOLD, dtype=np.int64)
    put_units(0, n - 1, load, count, room, num_mb, state, width, a_load, a_arg, a_room, w_room)
    for q, p in enumerate(_ps(rng, questions, rising)):
        if q:
            # A placement: one unit, or an aligned run of them (a larger group), grows.
            lo = int(rng.integers(0, n))
            hi = min(n - 1, lo + int(rng.integers(0, 3)))
            load[lo:hi + 1] += float(rng.integers(0, 3)) * 0.25
            count[lo:hi + 1] = np.minimum(num_mb, count[lo:hi + 1] + int(rng.integers(0, 2)))
            room[lo:hi + 1] = rng.integers(-1, 100, hi + 1 - lo)
            put_units(lo, hi, load, count, room, num_mb, state, width, a_load, a_arg, a_room,
                      w_room)
        t = float(rng.integers(1, 4)) * (0.5 if ties == 2 else 0.125)  # 1 + t > 2 rounds
        got = lowest_unit(p, t, n, load, count, room, num_mb, state, width, a_load, a_arg, a_room,
                          w_room)
        assert got == _scan(load, count, room, num_mb, p, t, 0.0)


@given(n=st.integers(1, 70), seed=st.integers(0, 2**32 - 1), ties=st.sampled_from([0, 1, 2]),
       questions=st.integers(1, 30), rising=st.booleans())
@settings(max_examples=200, deadline=None)
def test_lowest_block_equals_the_scan(n: int, seed: int, ties: int, questions: int,
                                      rising: bool) -> None:
    """A level above the smallest (opening costs extra), its changes noted lazily; the blocks
    sit behind another level's in the flat arrays, as in the kernel."""
    rng = np.random.default_rng(seed)
    num_mb = int(rng.integers(1, 4))
    num_blocks = np.array([3, n], dtype=np.int64)
    first = 3
    load = np.r_[np.zeros(3), _loads(rng, n, ties)]
    count = np.r_[np.zeros(3, np.int64), rng.integers(0, num_mb + 1, n)]
    room = np.r_[-np.ones(3, np.int64), np.where(rng.random(n) < 0.5, rng.integers(0, 100, n),
                                                 -1)]
    width, base = level_layout(num_blocks)
    j_load = np.full(base[-1], np.inf)
    o_load = np.full(base[-1], np.inf)
    w_room = np.full(base[-1], -1, dtype=np.int64)
    threshold = np.full(2, NO_THRESHOLD, dtype=np.int64)
    dirty = np.zeros(first + n, dtype=np.bool_)
    d_list = np.empty(first + n, dtype=np.int64)
    n_dirty = np.zeros(2, dtype=np.int64)
    put_blocks(1, 0, n - 1, first, load, count, room, num_mb, threshold, width, base, j_load,
               o_load, w_room)
    for q, p in enumerate(_ps(rng, questions, rising)):
        for _ in range(int(rng.integers(0, 3)) if q else 0):
            lo = int(rng.integers(0, n))
            hi = min(n - 1, lo + int(rng.integers(0, 2 * n // 3 + 1)))
            sl = slice(first + lo, first + hi + 1)
            load[sl] += float(rng.integers(0, 3)) * 0.25
            count[sl] = np.minimum(num_mb, count[sl] + int(rng.integers(0, 2)))
            room[sl] = rng.integers(-1, 100, hi + 1 - lo)
            mark_blocks(1, lo, hi, first, n, dirty, d_list, n_dirty)
        t = float(rng.integers(1, 4)) * (0.5 if ties == 2 else 0.125)
        open_cost = float(rng.integers(0, 3)) * 0.125
        got = lowest_block(1, p, t, open_cost, n, first, load, count, room, num_mb, threshold,
                           dirty, d_list, n_dirty, width, base, j_load, o_load, w_room)
        assert got == _scan(load[first:], count[first:], room[first:], num_mb, p, t, open_cost)
        assert not dirty.any()


@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), groups=st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_best_fit_equals_the_scan(n: int, seed: int, groups: int) -> None:
    """Pack mode's best fit: among blocks with a group that holds p and load + t <= limit, the
    tightest room left, then the first block (exact fits included)."""
    rng = np.random.default_rng(seed)
    cap = 64
    fill = rng.integers(0, cap + 1, (n, groups))
    ng = rng.integers(0, groups + 1, n)
    blk_g = np.arange(n * groups, dtype=np.int64).reshape(n, groups)
    g_fill = fill.reshape(-1).astype(np.int64)
    room = np.array([max([cap - fill[b, r] for r in range(ng[b])], default=-1)
                     for b in range(n)], dtype=np.int64)
    load = (rng.integers(0, 5, n) * 0.25).astype(np.float64)
    count = rng.integers(0, 3, n)
    width = tree_width(n)
    a_load = np.full(2 * width, np.inf)
    a_arg = np.full(2 * width, -1, dtype=np.int64)
    a_room = np.full(2 * width, -1, dtype=np.int64)
    w_room = np.full(2 * width, -1, dtype=np.int64)
    state = np.full(1, NO_THRESHOLD, dtype=np.int64)
    put_units(0, n - 1, load, count, room, 2, state, width, a_load, a_arg, a_room, w_room)
    stack = np.empty(130, dtype=np.int64)
    for p in sorted(rng.integers(1, cap + 1, 8).tolist(), reverse=True):
        t, limit = 0.25, float(rng.integers(0, 6)) * 0.25
        lowest_unit(p, t, n, load, count, room, 2, state, width, a_load, a_arg, a_room, w_room)
        want, want_key = (-1, np.inf), (cap + 1, 0)
        for b in range(n):
            lefts = [cap - g_fill[blk_g[b, r]] - p for r in range(ng[b])]
            lefts = [x for x in lefts if x >= 0]
            if lefts and load[b] + t <= limit and (min(lefts), b) < want_key:
                want, want_key = (b, load[b] + t), (min(lefts), b)
        got = best_fit(p, t, limit, 0, width, 0, cap, a_load, a_room, True, load, ng, blk_g,
                       g_fill, stack)
        assert got == want


COST = load_cost_model("dense-7b-h200")
SCAN = 1 << 40
"""``place``'s tree thresholds for no tree at any level."""


@given(pool=st.sampled_from([4, 8, 12, 16, 32]), seed=st.integers(0, 2**32 - 1),
       capacity=st.sampled_from([512, 2048]), forced=st.booleans())
@settings(max_examples=60, deadline=None)
def test_a_pass_with_trees_places_as_the_scan_does(pool: int, seed: int, capacity: int,
                                                   forced: bool) -> None:
    """The kernel with trees at every level, at the levels of 4 blocks or more, and at none:
    the same groups, levels and makespan, in both modes, at several microbatch counts and
    targets, with CP-SAT-style forced placements."""
    rng = np.random.default_rng(seed)
    k = np.array([s for s in (1, 2, 4, 8, 16, 32) if pool % s == 0] + ([pool] if pool == 12
                                                                       else []), np.int64)
    k = np.unique(k)
    mults = np.array([1 if s == 1 else 2 * s for s in k], np.int64)
    params = PackingParams(pool_size=pool, capacity=capacity, sizes=k, multiples=mults,
                           cost=COST.as_array(), microbatch_multiple=1)
    n = int(rng.integers(1, 12 * pool))
    tokens = np.where(rng.random(n) < 0.1, rng.integers(1, pool * capacity // 2, n),
                      rng.integers(1, capacity, n)).astype(np.int64)
    problem = make_problem(tokens, params)
    q = problem.in_order
    r = problem.tables.run
    m0 = min_microbatches(problem.tables, params)
    none = np.full(n, -1, np.int64)

    def run(tree_blocks: int, fl: np.ndarray, fb: np.ndarray, num_mb: int, target: float,
            mode: int) -> tuple[tuple[int, float], list[np.ndarray]]:
        arrays = [np.full(n, -7, np.int64) for _ in range(4)]
        res = place(r.padded, r.fits, r.time, r.min_level, q.rows, k, capacity, pool,
                    params.cost, num_mb, target, mode, q.to_come, fl, fb, tree_blocks, tree_blocks,
                    *arrays)
        return res, arrays

    for num_mb in (m0, m0 + 1, m0 + 3):
        for target in (problem.bound(num_mb), problem.bound(num_mb) * 1.05, np.inf):
            for mode in (BALANCE, PACK):
                fl = fb = none
                if forced:
                    # Force a third of the segments where a free pass put them (cpsat.py's way).
                    res, (lv, grp, _, g_blk) = run(SCAN, none, none, num_mb, target, mode)
                    if res[0] > 0:
                        pick = rng.random(n) < 0.33
                        fl = np.where(pick, lv, -1)
                        fb = np.where(pick, g_blk[np.maximum(grp, 0)], -1)
                r0, a0 = run(SCAN, fl, fb, num_mb, target, mode)
                for tree_blocks in (1, 4):
                    r1, a1 = run(tree_blocks, fl, fb, num_mb, target, mode)
                    assert r0 == r1
                    if r0[0] > 0:
                        assert (a0[0] == a1[0]).all()
                        assert (a0[1] == a1[1]).all()
                        assert (a0[2][:r0[0]] == a1[2][:r0[0]]).all()
                        assert (a0[3][:r0[0]] == a1[3][:r0[0]]).all()
