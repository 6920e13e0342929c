"""Megatron's greedy: the tree search of each size's best group (megatron_tree.py) places every
sequence exactly as the scan over every group does (the rules' reference, ``tree=False``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.groups import valid_cp_sizes
from planner.solver.megatron import megatron_arrays, megatron_padded


@given(seed=st.integers(0, 2**32 - 1), pool=st.sampled_from((1, 2, 4, 6, 8, 12, 16, 32, 64)),
       capacity=st.sampled_from((256, 1024, 4096)), n=st.integers(1, 300),
       spread=st.sampled_from((0.3, 1.0, 2.0)), equal=st.booleans())
@settings(max_examples=150, deadline=None)
def test_tree_search_places_as_the_scan(seed: int, pool: int, capacity: int, n: int,
                                        spread: float, equal: bool) -> None:
    rng = np.random.default_rng(seed)
    longest = pool * capacity - 2 * pool
    lengths = (np.full(n, capacity // 3) if equal  # ties everywhere: creation order decides
               else rng.lognormal(np.log(capacity / 4), spread, n)).astype(np.int64)
    padded = megatron_padded(lengths.clip(1, longest), pool, 1)
    sizes = tuple(valid_cp_sizes(pool))
    try:
        want = megatron_arrays(padded, pool_size=pool, capacity=capacity, sizes=sizes, tree=False)
    except ValueError:
        return
    got = megatron_arrays(padded, pool_size=pool, capacity=capacity, sizes=sizes)
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)
    assert sorted(got[3].tolist()) == list(range(n))   # every sequence placed once
