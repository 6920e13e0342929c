"""Never behind a baseline: per step, the plan's simulated time is at most static CP's (at the
job's cp) and Megatron's greedy's, on random workloads (pools 1-64, tp' 1-2).

The baselines come from the bench's whole-dataset planners (bench/baselines.py: their own row
assembly over the same global batches), so this checks the planner's candidate rows, skip bounds
and choice against an independent assembly of the same rules.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.baselines import StaticCPInfeasible, megatron_plan, static_cp_plan
from planner.config import ParallelConfig, PlannerConfig, SolverConfig
from planner.cost import CostModel, load_cost_model, simulate_step
from planner.groups import valid_cp_sizes
from planner.plan import Plan, make_plan
from planner.planfile.validate import validate
from planner.solver.candidates import (
    megatron_bound,
    megatron_rows,
    simulate,
    static_bound,
    static_rows,
)
from planner.sources.lengths import LengthTable

COSTS = (load_cost_model("dense-7b-h200"), load_cost_model("small-2048-h200"),
         load_cost_model("h200-8x2048-te"))


def _table(lengths: np.ndarray) -> LengthTable:
    return LengthTable(path="mem.txt", format="text", lengths=lengths,
                       skipped=np.zeros(0, np.int64))


def _step_times(plan: Plan, cost: CostModel, pool: int) -> list[float]:
    return [simulate_step(cost, pool, c["microbatch"], c["rank_start"], c["cp_size"],
                          c["padded_tokens"]) for c in plan.steps]


@st.composite
def workloads(draw: Any) -> tuple[np.ndarray, PlannerConfig, CostModel]:
    pool = draw(st.integers(1, 64))
    cp = draw(st.sampled_from(valid_cp_sizes(pool)))
    tp_eff = draw(st.sampled_from((1, 2)))
    capacity = draw(st.sampled_from((256, 1024, 4096)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 120))
    # Long-tailed: mostly short, some up to the whole pool after Megatron's 2N padding.
    longest = pool * capacity - 2 * pool * tp_eff
    short = rng.lognormal(np.log(capacity / 4), 1.0, n)
    long = rng.uniform(0.1, 1.0, n) * longest
    share = draw(st.sampled_from((0.0, 0.05, 0.3, 1.0)))
    lengths = np.where(rng.random(n) < share, long, short).clip(1, longest).astype(np.int64)
    config = PlannerConfig(
        parallel=ParallelConfig(dp=pool // cp, cp=cp, tp=tp_eff, sequence_parallel=tp_eff > 1),
        capacity_tokens_per_rank=capacity, global_batch_size=draw(st.integers(1, 64)),
        seed=draw(st.integers(0, 3)), effort=draw(st.sampled_from(("fast", "balanced"))),
        solver=SolverConfig(cpsat_seconds=0.0))
    return lengths, config, draw(st.sampled_from(COSTS))


@given(case=workloads())
@settings(max_examples=60, deadline=None)
def test_no_step_is_slower_than_static_cp_or_megatron(
        case: tuple[np.ndarray, PlannerConfig, CostModel]) -> None:
    lengths, config, cost = case
    pool = config.parallel.pool_size
    plan = make_plan(_table(lengths), config, cost)
    validate(plan.header, list(plan.record_batches()), lengths)
    ours = _step_times(plan, cost, pool)
    baselines = [megatron_plan(lengths, config).plan]
    # When some sample does not fit cp x C, static CP cannot run this dataset at all.
    with contextlib.suppress(StaticCPInfeasible):
        baselines.append(static_cp_plan(lengths, config).plan)
    for base in baselines:
        theirs = _step_times(base, cost, pool)
        assert len(theirs) == len(ours)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a <= b * (1 + 1e-12), (i, base.header.solver["name"], a, b)
    assert sum(plan.header.stats["candidate_steps"].values()) == len(ours)


@given(case=workloads())
@settings(max_examples=40, deadline=None)
def test_skip_bounds_are_below_the_baselines_simulated_time(
        case: tuple[np.ndarray, PlannerConfig, CostModel]) -> None:
    # The planner skips a baseline whose bound is above our time: each bound must be a true
    # lower bound of the rows it stands for.
    lengths, config, cost = case
    p = config.parallel
    c = cost.as_array()
    sizes = np.asarray(config.sizes, np.int64)
    sample = np.arange(len(lengths), dtype=np.int64)
    offset = np.zeros(len(lengths), np.int64)
    kw = dict(pool_size=p.pool_size, cp=p.cp, capacity=config.capacity_tokens_per_rank,
              tp_eff=p.tp_eff, layout=config.layout, multiple=p.microbatch_multiple)
    lb = static_bound(lengths, c, **kw)
    if np.isfinite(lb):
        assert lb <= simulate(static_rows(sample, offset, lengths, **kw), c, p.pool_size) * (
            1 + 1e-12)
    kw2 = dict(pool_size=p.pool_size, capacity=config.capacity_tokens_per_rank,
               tp_eff=p.tp_eff, sizes=sizes)
    lb = megatron_bound(lengths, c, **kw2)
    rows = megatron_rows(sample, offset, lengths, **kw2)
    if np.isfinite(lb) and rows is not None:
        assert lb <= simulate(rows, c, p.pool_size) * (1 + 1e-12)


def test_baselines_off_gives_our_search_alone() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(6.5, 1.2, 400).astype(np.int64).clip(1, 30_000)
    base = dict(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=4096,
                global_batch_size=64, long_sequences="split")
    off = make_plan(_table(lengths), PlannerConfig(**base, solver=SolverConfig(baselines=False)),
                    COSTS[0])
    assert off.header.stats["candidate_steps"] == {"dcp": off.header.stats["num_steps"]}
    assert off.header.solver["candidates"] == []
    on = make_plan(_table(lengths), PlannerConfig(**base), COSTS[0])
    assert on.header.solver["candidates"] == ["static-cp-2", "megatron-greedy"]
    assert on.header.stats["simulated_seconds"] <= off.header.stats["simulated_seconds"]


@pytest.mark.parametrize("cp_sizes", [(1, 2), (2, 4, 8)])
def test_static_candidate_needs_an_allowed_size(cp_sizes: tuple[int, ...]) -> None:
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=4), capacity_tokens_per_rank=4096,
                           global_batch_size=8, cp_sizes=cp_sizes)
    plan = make_plan(_table(np.full(32, 1000, np.int64)), config, COSTS[0])
    names = plan.header.solver["candidates"]
    assert ("static-cp-4" in names) == (4 in cp_sizes)
