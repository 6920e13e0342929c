"""Baselines: valid plans, the same global batches as ours, Megatron's padding, next-fit packing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bench.baselines import (
    StaticCPInfeasible,
    megatron_padded,
    megatron_plan,
    megatron_step,
    next_fit,
    round_bins_up,
    smallest_static_cp,
    static_cp_plan,
    static_step,
)
from bench.workloads import NAMES, make_workload
from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model, simulate_step
from planner.groups import valid_cp_sizes
from planner.plan import make_plan
from planner.planfile.validate import validate
from planner.solver.batches import draw_global_batches
from planner.sources.lengths import LengthTable

POOLS = (1, 2, 4, 6, 8, 12, 16)


@st.composite
def setups(draw: Any) -> tuple[np.ndarray, PlannerConfig]:
    pool = draw(st.sampled_from(POOLS))
    cp = draw(st.sampled_from(valid_cp_sizes(pool)))
    tp = draw(st.sampled_from((1, 2)))
    sp = draw(st.booleans()) and tp > 1
    tp_eff = tp if sp else 1
    capacity = draw(st.integers(16, 2048))
    lengths = np.array(draw(st.lists(st.integers(1, 3 * capacity), min_size=1, max_size=60)),
                       dtype=np.int64)
    # Every sample must fit the whole pool after Megatron's 2N padding (else neither runs it).
    m = 2 * pool * tp_eff
    capacity = max(capacity, -(-(-(-int(lengths.max()) // m) * m) // pool))
    capacity = max(capacity, m)  # below the largest group's padding multiple is refused
    by_tokens = draw(st.booleans())
    config = PlannerConfig(
        parallel=ParallelConfig(dp=pool // cp, cp=cp, tp=tp, sequence_parallel=sp),
        capacity_tokens_per_rank=capacity,
        global_batch_size=0 if by_tokens else draw(st.integers(1, 16)),
        global_batch_tokens=draw(st.integers(1, 8 * capacity)) if by_tokens else 0,
        seed=draw(st.integers(0, 3)), epochs=draw(st.integers(1, 2)),
        drop_last=draw(st.booleans()))
    return lengths, config


def _steps_samples(plan: Any) -> list[np.ndarray]:
    out = []
    for cols in plan.steps:
        s = cols["sample_index"]
        out.append(np.sort(s[s >= 0]))
    return out


def _expected_batches(lengths: np.ndarray, config: PlannerConfig) -> list[np.ndarray]:
    out = []
    for e in range(config.epochs):
        batches, _ = draw_global_batches(
            lengths, lengths > 0, seed=config.seed, epoch=e,
            global_batch_size=config.global_batch_size,
            global_batch_tokens=config.global_batch_tokens, drop_last=config.drop_last)
        out += [np.sort(b) for b in batches]
    return out


def _check_scores(plan: Any) -> None:
    """Simulated time lies between the busiest rank's work and the sum of microbatch maxima."""
    cost = load_cost_model("default")
    n = plan.header.parallel.pool_size
    for cols in plan.steps:
        mb, start, k, pt = (cols[c] for c in ("microbatch", "rank_start", "cp_size",
                                              "padded_tokens"))
        t = simulate_step(cost, n, mb, start, k, pt)
        busy = np.zeros(n)
        mb_max: dict[int, float] = {}
        keys = list(zip(mb.tolist(), start.tolist(), strict=False))
        for key in dict.fromkeys(keys):
            rows = [i for i, kk in enumerate(keys) if kk == key]
            g = cost.group_time(int(k[rows[0]]), pt[rows])
            busy[key[1]:key[1] + int(k[rows[0]])] += g
            mb_max[key[0]] = max(mb_max.get(key[0], 0.0), g)
        assert busy.max() * (1 - 1e-9) <= t <= sum(mb_max.values()) * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_baselines_are_valid_and_draw_our_batches(setup: tuple[np.ndarray, PlannerConfig]) -> None:
    lengths, config = setup
    expected = _expected_batches(lengths, config)
    assume(expected)  # a plan with no step is refused (drop_last and too few samples)
    run = megatron_plan(lengths, config)
    validate(run.plan.header, list(run.plan.record_batches()), lengths)
    got = _steps_samples(run.plan)
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=False))
    _check_scores(run.plan)

    n, tp_eff = config.parallel.pool_size, config.parallel.tp_eff
    best = smallest_static_cp(lengths, n, config.capacity_tokens_per_rank, tp_eff, config.layout)
    assert best is not None  # the pool holds every sample, so static cp = N does
    for cp in {config.parallel.cp, best}:
        if cp < best:
            with pytest.raises(StaticCPInfeasible) as e:
                static_cp_plan(lengths, config, cp=cp)
            assert e.value.smallest_cp == best
            continue
        static = static_cp_plan(lengths, config, cp=cp)
        validate(static.plan.header, list(static.plan.record_batches()), lengths)
        got = _steps_samples(static.plan)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=False))
        for c in static.plan.steps:
            assert set(c["cp_size"].tolist()) == {cp}
        _check_scores(static.plan)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(POOLS), st.sampled_from((1, 2, 4)), st.booleans(),
       st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_megatron_pads_every_sequence_to_the_whole_pool(pool: int, tp: int, sp: bool,
                                                          lengths: list[int]) -> None:
    tp_eff = tp if sp else 1
    arr = np.array(lengths, dtype=np.int64)
    m = 2 * pool * tp_eff
    capacity = max(64, -(-(-(-int(arr.max()) // m) * m) // pool))
    mbs = megatron_step(np.arange(len(arr)), arr, pool_size=pool, capacity=capacity,
                        tp_eff=tp_eff, sizes=valid_cp_sizes(pool))
    seen = []
    for groups in mbs:
        assert sum(g.cp_size for g in groups) == pool
        for g in groups:
            assert g.rank_start % g.cp_size == 0 or g.cp_size == pool
            assert sum(g.padded) <= g.cp_size * capacity
            for s, t, p in zip(g.samples, g.num_tokens, g.padded, strict=False):
                assert p == -(-t // m) * m  # even at cp_size 1
                seen.append(s)
    assert sorted(seen) == list(range(len(arr)))
    assert np.array_equal(megatron_padded(arr, pool, tp_eff) % m, np.zeros(len(arr)))


def test_megatron_padding_wastes_capacity_as_documented() -> None:
    # DOMAIN.md: N=6, C=2048: twelve 1024-token sequences pad to 1032 and need two microbatches.
    mbs = megatron_step(np.arange(12), np.full(12, 1024), pool_size=6, capacity=2048, tp_eff=1,
                        sizes=valid_cp_sizes(6))
    assert len(mbs) == 2
    assert {p for groups in mbs for g in groups for p in g.padded} == {1032}


def test_megatron_reproduces_its_own_examples() -> None:
    # A short sequence joins the long one's group when that lowers the busiest rank's work.
    mbs = megatron_step(np.array([0, 1]), np.array([6144, 2048]), pool_size=2, capacity=4096,
                        tp_eff=1, sizes=valid_cp_sizes(2))
    assert [[(g.rank_start, g.cp_size, g.samples) for g in groups] for groups in mbs] == [
        [(0, 2, [0, 1])]]
    # Non-power-of-two pool: growing groups cannot fill 14 ranks, so one full-pool group.
    mbs = megatron_step(np.array([0, 1]), np.array([50, 50]), pool_size=14, capacity=100,
                        tp_eff=1, sizes=valid_cp_sizes(14))
    assert [[(g.rank_start, g.cp_size, g.samples) for g in groups] for groups in mbs] == [
        [(0, 14, [0, 1])]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=50), st.integers(100, 300))
def test_next_fit_packs_in_order_and_closes_only_full_bins(sizes: list[int], cap: int) -> None:
    bins = next_fit(sizes, cap)
    assert [i for b in bins for i in b] == list(range(len(sizes)))
    for a, b in zip(bins, bins[1:], strict=False):
        assert sum(sizes[i] for i in a) + sizes[b[0]] > cap  # next-fit: closed because full
    assert all(sum(sizes[i] for i in b) <= cap for b in bins)


def test_static_deals_next_fit_bins_and_rounds_up_like_megatron() -> None:
    # Next-fit of [6, 6, 3, 3, 3] into 10: [6] [6, 3] [3, 3]; 4 groups want 4 bins, so the last
    # bin gives its last sequence to a new bin, as Megatron's dp_balanced does.
    assert next_fit([6, 6, 3, 3, 3], 10) == [[0], [1, 2], [3, 4]]
    assert next_fit([5, 5, 1], 10) == [[0, 1], [2]]  # a bin may fill exactly
    assert round_bins_up([[0], [1, 2], [3, 4]], 4) == [[0], [1, 2], [3], [4]]
    mbs = static_step(np.arange(5) + 10, np.array([6, 6, 3, 3, 3]), pool_size=4, cp=1,
                      capacity=10, tp_eff=1, layout="zigzag")
    assert [[g.samples for g in groups] for groups in mbs] == [[[10], [11, 12], [13], [14]]]
    # Nothing left to split: the empty groups of the last microbatch get a filler row.
    mbs = static_step(np.array([7]), np.array([9]), pool_size=4, cp=2, capacity=10, tp_eff=1,
                      layout="zigzag")
    assert [[(g.rank_start, g.samples, g.padded) for g in groups] for groups in mbs] == [
        [(0, [7], [12]), (2, [-1], [4])]]


def test_static_reports_the_cp_it_needs() -> None:
    lengths = np.array([100, 5000, 300])
    config = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=1024,
                           global_batch_size=2)
    with pytest.raises(StaticCPInfeasible, match="needs static cp >= 8") as e:
        static_cp_plan(lengths, config)
    assert e.value.smallest_cp == 8
    assert static_cp_plan(lengths, config, cp=8).plan.header.parallel.dp == 1


def test_baselines_schedule_the_steps_of_our_plan() -> None:
    lengths = make_workload("lognormal", num_tokens=600_000, pool_size=8, capacity=4096)
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=4), capacity_tokens_per_rank=4096,
                           global_batch_tokens=4 * 8 * 4096, seed=3)
    table = LengthTable(path="mem", format="text", lengths=lengths,
                        skipped=np.zeros(0, dtype=np.int64))
    ours = _steps_samples(make_plan(table, config, load_cost_model("default")))
    for run in (megatron_plan(table, config), static_cp_plan(table, config)):
        theirs = _steps_samples(run.plan)
        assert len(theirs) == len(ours)
        assert all(np.array_equal(a, b) for a, b in zip(theirs, ours, strict=False))


@pytest.mark.parametrize("name", NAMES)
def test_workloads_are_deterministic(name: str) -> None:
    a = make_workload(name, num_tokens=2_000_000, pool_size=8, capacity=8192, seed=1)
    b = make_workload(name, num_tokens=2_000_000, pool_size=8, capacity=8192, seed=1)
    assert a.dtype == np.int64
    assert np.array_equal(a, b)
    assert a.min() >= 1
    assert 1_000_000 < a.sum() < 4_000_000 or name == "bytescale"
