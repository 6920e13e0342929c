"""Never behind a baseline: per step, the plan's simulated time is at most static CP's (at the
job's cp) and Megatron's greedy's, on random workloads (pools 1-64, tp' 1-2), and the header's
predicted gain is those baselines' time over ours, step by step and in total.

The baselines come from the bench's whole-dataset planners (bench/baselines.py: their own row
assembly over the same global batches), so this checks the planner's candidate rows, choice and
recorded gain against an independent assembly of the same rules.
"""

from __future__ import annotations

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
from planner.solver.candidates import static_rows
from planner.solver.static_cp import padded_lengths, static_bins
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
    stats = plan.header.stats
    baselines = [("megatron-greedy", "vs_megatron", megatron_plan(lengths, config).plan)]
    # When some sample does not fit cp x C, static CP cannot run this dataset at all.
    try:
        baselines.append(("static-cp", "vs_static_cp", static_cp_plan(lengths, config).plan))
    except StaticCPInfeasible:
        assert stats["vs_static_cp"] is None
        assert stats["baselines"]["static-cp"]["infeasible_steps"] >= 1
    for name, key, base in baselines:
        theirs = _step_times(base, cost, pool)
        assert len(theirs) == len(ours)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a <= b * (1 + 1e-12), (i, name, a, b)
        # The recorded gain is the independent baseline's time over ours.
        recorded = stats["baselines"][name]
        assert recorded["infeasible_steps"] == 0
        assert recorded["per_step"] == pytest.approx(
            [b / a for a, b in zip(ours, theirs, strict=True)], abs=6e-5)
        assert stats[key] == pytest.approx(sum(theirs) / sum(ours), rel=1e-12)
        assert recorded["quantiles"]["min"] >= 1.0
    assert sum(stats["candidate_steps"].values()) == len(ours)


@given(seed=st.integers(0, 2**32 - 1), pool=st.sampled_from((1, 2, 4, 8, 12, 16)),
       capacity=st.sampled_from((512, 4096)), multiple=st.sampled_from((1, 2, 3)))
@settings(max_examples=60, deadline=None)
def test_static_rows_follow_the_list_rules(seed: int, pool: int, capacity: int,
                                           multiple: int) -> None:
    # static_layout (one numba pass) against static_bins (lists, as the bench assembles them).
    rng = np.random.default_rng(seed)
    cp = int(rng.choice(valid_cp_sizes(pool)))
    lengths = rng.integers(1, cp * capacity - 2 * cp, int(rng.integers(0, 90)), dtype=np.int64)
    padded = padded_lengths(lengths, cp, 1, "zigzag")
    bins, num_mb = static_bins(padded, pool_size=pool, cp=cp, capacity=capacity,
                               microbatch_multiple=multiple)
    pos = np.arange(len(lengths), dtype=np.int64)
    rows = static_rows(pos, np.zeros_like(pos), lengths, pool_size=pool, cp=cp,
                       capacity=capacity, tp_eff=1, layout="zigzag", multiple=multiple)
    groups = pool // cp
    want: list[tuple[int, int, int]] = []
    for m in range(num_mb):
        for j in range(groups):
            b = m * groups + j
            want += [(m, j * cp, i) for i in bins[b]] if b < len(bins) else [(m, j * cp, -1)]
    got = list(zip(rows.microbatch.tolist(), rows.rank_start.tolist(),
                   rows.sample_index.tolist(), strict=True))
    assert got == want
    assert (rows.cp_size == cp).all()
    real = rows.sample_index >= 0
    assert (rows.padded_tokens[real] == padded[rows.sample_index[real]]).all()
    assert (rows.padded_tokens[~real] == (2 * cp if cp > 1 else 1)).all()


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
    stats = plan.header.stats
    if 4 in cp_sizes:
        assert stats["vs_static_cp"] >= 1.0
    else:  # no number, and the reason
        assert stats["vs_static_cp"] is None
        assert "not an allowed group size" in stats["baselines"]["static-cp"]["not_scored"]


@pytest.mark.parametrize(("options", "static", "megatron"), [
    ({"pad_to_multiple": 16}, "--pad-to-multiple 16", "--pad-to-multiple 16"),
    ({"solver": SolverConfig(baselines=False)}, "turned off", "turned off"),
    ({"parallel": ParallelConfig(dp=2, cp=2, pp=2, vpp=2)}, None, "does not model VPP"),
])
def test_options_that_disable_a_baseline_say_why(options: dict[str, Any], static: str | None,
                                                  megatron: str) -> None:
    base: dict[str, Any] = dict(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=4096,
                                global_batch_size=8)
    plan = make_plan(_table(np.full(32, 1000, np.int64)), PlannerConfig(**{**base, **options}),
                     COSTS[0])
    stats = plan.header.stats
    for name, key, why in (("static-cp", "vs_static_cp", static),
                           ("megatron-greedy", "vs_megatron", megatron)):
        if why is None:
            assert stats[key] >= 1.0
            assert len(stats["baselines"][name]["per_step"]) == stats["num_steps"]
        else:
            assert stats[key] is None
            assert why in stats["baselines"][name]["not_scored"]
