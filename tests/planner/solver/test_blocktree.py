"""The placement kernel's search trees answer exactly what a scan over every block answers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solver.blocktree import best_block, fix_up, set_leaf, tree_layout


def _scan(load: np.ndarray, count: np.ndarray, room: np.ndarray, num_mb: int, p: int, t: float,
          open_cost: float) -> tuple[int, float]:
    """The kernel's linear scan (place.py before the trees): first block of lowest end."""
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


@given(n=st.integers(1, 70), seed=st.integers(0, 2**32 - 1), ties=st.sampled_from([0, 1, 2]),
       updates=st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_best_block_equals_the_scan(n: int, seed: int, ties: int, updates: int) -> None:
    rng = np.random.default_rng(seed)
    num_mb = int(rng.integers(1, 4))
    # Few distinct loads make ties common: the lowest block must still win them. Loads a few
    # ulps apart (ties == 2) end equal after adding t by rounding: the first such block wins.
    if ties == 2:
        load = 1.0 + rng.integers(0, 3, n) * np.finfo(np.float64).eps
    elif ties == 1:
        load = (rng.integers(0, 4, n) * 0.25).astype(np.float64)
    else:
        load = rng.random(n)
    count = rng.integers(0, num_mb + 1, n)
    room = np.where(rng.random(n) < 0.5, rng.integers(0, 100, n), -1)
    width, base = tree_layout(np.array([n], dtype=np.int64))
    t_load = np.full(base[-1], np.inf)
    t_open = np.full(base[-1], np.inf)
    t_room = np.full(base[-1], -1, dtype=np.int64)
    t_arg = np.full(base[-1], -1, dtype=np.int64)
    for b in range(n):
        set_leaf(0, b, load[b], count[b] < num_mb, room[b], width, base, t_load, t_open, t_room,
                 t_arg)
    fix_up(0, 0, n - 1, width, base, t_load, t_open, t_room, t_arg)
    stack = np.empty(132, dtype=np.int64)
    stack_bound = np.empty(66)
    for q in range(updates + 1):
        if q:
            b = int(rng.integers(0, n))
            load[b] += float(rng.integers(0, 3)) * 0.25
            count[b] = min(num_mb, count[b] + int(rng.integers(0, 2)))
            room[b] = int(rng.integers(-1, 100))
            set_leaf(0, b, load[b], count[b] < num_mb, room[b], width, base, t_load, t_open,
                     t_room, t_arg)
            fix_up(0, b, b, width, base, t_load, t_open, t_room, t_arg)
        p = int(rng.integers(1, 100))
        t = float(rng.integers(1, 4)) * (0.5 if ties == 2 else 0.125)  # 1 + t > 2 rounds
        open_cost = float(rng.integers(0, 3)) * 0.125
        got = best_block(0, p, t, open_cost, width, base, t_load, t_open, t_room, t_arg, stack,
                         stack_bound)
        assert got == _scan(load, count, room, num_mb, p, t, open_cost)
