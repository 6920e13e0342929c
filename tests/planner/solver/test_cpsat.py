"""CP-SAT refinement: never worse than the heuristic, reproducible, and placed where it says."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from planner.config import ParallelConfig, PlannerConfig, SolverConfig
from planner.cost import load_cost_model
from planner.solver.cpsat import refine_heavy, solve_heavy
from planner.solver.greedy import PackingParams, assign_step, make_problem, solve_step

COST = load_cost_model("small-2048-h200")


def params(dp: int, capacity: int, cpsat_seconds: float, **kw: object) -> PackingParams:
    cfg = PlannerConfig(parallel=ParallelConfig(dp=dp, cp=2), capacity_tokens_per_rank=capacity,
                        global_batch_size=1, effort="max",
                        solver=SolverConfig(cpsat_seconds=cpsat_seconds, **kw))  # type: ignore[arg-type]
    return PackingParams.from_config(cfg, COST)


def heavy_mix(seed: int, n: int, pool_tokens: int) -> NDArray[np.int64]:
    """ByteScale-like: a few sequences of 20-90% of the pool's tokens among short ones."""
    rng = np.random.default_rng(seed)
    short = rng.lognormal(6.5, 1.0, n).clip(32, 4096)
    heavy = rng.uniform(0.2, 0.9, rng.integers(1, 5)) * pool_tokens
    out: NDArray[np.int64] = np.concatenate([heavy, short]).astype(np.int64)
    return out


@given(seed=st.integers(0, 2**32 - 1), dp=st.sampled_from([4, 6]))
@settings(max_examples=12, deadline=None)
def test_cpsat_never_makes_a_step_worse(seed: int, dp: int) -> None:
    capacity = 16_384
    tokens = heavy_mix(seed, 120, 2 * dp * capacity)
    # refine_gap 0 refines every step, so CP-SAT runs on each example.
    with_cp = make_problem(tokens, params(dp, capacity, 0.05, refine_gap=0.0))
    without = make_problem(tokens, dataclasses.replace(with_cp.params, cpsat_seconds=0.0))
    a, b = solve_step(with_cp), solve_step(without)
    assert a.seconds <= b.seconds * (1 + 1e-12)
    assert a.num_mb == b.num_mb


def test_cpsat_is_reproducible_and_its_placement_is_kept() -> None:
    capacity = 16_384
    tokens = heavy_mix(5, 150, 8 * capacity)
    p = params(4, capacity, 0.2, refine_gap=0.0)
    problem = make_problem(tokens, p)
    heuristic = solve_step(make_problem(tokens, dataclasses.replace(p, cpsat_seconds=0.0)))
    answers = [solve_heavy(problem, heuristic) for _ in range(2)]
    assert answers[0] is not None
    assert answers[1] is not None
    level, block, target = answers[0]
    assert np.array_equal(level, answers[1][0])
    assert np.array_equal(block, answers[1][1])
    assert target == answers[1][2]
    # The fluid model's optimum is no worse than the heuristic's placement of the heavy part.
    assert target <= heuristic.seconds * (1 + 1e-3)
    refined = refine_heavy(problem, heuristic)
    if refined is not None:
        heavy = np.flatnonzero(level >= 0)
        assert np.array_equal(refined.item_level[heavy], level[heavy])
        assert np.array_equal(refined.g_block[refined.item_group[heavy]], block[heavy])
    # The whole step, twice: identical rows.
    runs = [assign_step(np.arange(len(tokens)), np.zeros(len(tokens), np.int64), tokens, p)
            for _ in range(2)]
    for name in ("microbatch", "rank_start", "cp_size", "sample_index", "padded_tokens"):
        assert np.array_equal(getattr(runs[0], name), getattr(runs[1], name))
