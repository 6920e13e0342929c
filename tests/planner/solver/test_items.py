"""Tables per distinct length (items.RunTables) give every segment the row its own length's
tables would, and the placement order of the tables computed segment by segment."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import load_cost_model
from planner.groups import MAX_SEGMENT_TOKENS
from planner.solver import items
from planner.solver.items import RunTables, _tables, placement_order

COST = load_cost_model("dense-7b-h200").as_array()
SIZES = np.array([1, 2, 4, 8], np.int64)
MULTS = np.array([1, 4, 8, 16], np.int64)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), distinct=st.integers(1, 40),
       dense=st.booleans())
@settings(max_examples=100, deadline=None)
def test_run_tables_give_each_segment_its_own_tables(seed: int, n: int, distinct: int,
                                                    dense: bool) -> None:
    rng = np.random.default_rng(seed)
    capacity = 512
    # Few distinct lengths: equal works (ties by position) and lengths that pad alike.
    pool = rng.integers(1, 8 * capacity, distinct)
    run_tokens = rng.choice(pool, 3 * n)
    step = rng.choice(run_tokens, n)
    # dense False: lengths found by binary search (as for lengths of 2^23 tokens and more).
    run = RunTables.of(run_tokens, SIZES, MULTS, capacity, COST,
                       dense_lengths=items.DENSE_LENGTHS if dense else 1)
    assert (len(run.row_of) > 0) == dense
    t = run.step(step)
    padded, fits, time, lone, work, min_level = _tables(step, SIZES, MULTS, capacity, COST,
                                                        MAX_SEGMENT_TOKENS)
    for mine, own in ((run.padded, padded), (run.fits, fits), (run.time, time),
                      (run.lone, lone), (run.work, work), (run.min_level, min_level)):
        assert (mine[t.row] == own).all()  # bit for bit
    assert (run.lengths[t.row] == step).all()
    level = rng.integers(0, len(SIZES), n)
    assert (t.at(level) == padded[np.arange(n), level]).all()
    assert t.padded_total(level) == int(padded[np.arange(n), level].sum())
    assert t.padded_total() == int(padded[np.arange(n), min_level].sum())
    # The placement order is a stable sort of descending work at the cheapest size.
    key = work[np.arange(n), min_level]
    assert (t.order == np.argsort(-key, kind="stable")).all()
    # Rows are stored in that order of work (equal works share a rank), so a step in
    # placement order reads them forwards.
    assert (np.diff(run.rank) >= 0).all()
    assert (np.diff(run.rank[t.row[t.order]]) >= 0).all()


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 500),
       top=st.sampled_from([1, 255, 256, 70_000, 2**40]))
@settings(max_examples=100, deadline=None)
def test_placement_order_is_the_stable_argsort(seed: int, n: int, top: int) -> None:
    rank = np.random.default_rng(seed).integers(0, top + 1, n).astype(np.int64)
    assert (placement_order(rank) == np.argsort(rank, kind="stable")).all()
