"""Tests for planner.plan.make_plan (and the greedy kernel behind it).

Every plan is checked by ``check_plan``: planfile.validate with the lengths (partition, alignment,
capacity, padding, coverage, microbatch multiple), each sample segment exactly once per epoch,
and each step holding exactly the global batch drawn for it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from planner.config import ParallelConfig, PlannerConfig, SolverConfig
from planner.cost import CostModel, load_cost_model, simulate_step
from planner.groups import LAYOUTS, pad_multiple, valid_cp_sizes
from planner.plan import Plan, apply_long_policy, make_plan
from planner.planfile.io import write_plan
from planner.planfile.schema import COLUMN_NAMES
from planner.planfile.validate import validate
from planner.solver.batches import draw_global_batches
from planner.solver.greedy import PackingParams, assign_step
from planner.sources.lengths import LengthTable

COST = load_cost_model()


def table(lengths: Any, skipped: Any = ()) -> LengthTable:
    return LengthTable(path="mem.txt", format="text", lengths=np.asarray(lengths, np.int64),
                       skipped=np.asarray(skipped, np.int64))


def config(dp: int = 4, cp: int = 2, capacity: int = 4096, gbs: int = 32, **kw: Any
           ) -> PlannerConfig:
    par = {k: kw.pop(k) for k in ("tp", "pp", "vpp", "sequence_parallel",
                                  "microbatch_group_size") if k in kw}
    if "global_batch_tokens" in kw:
        gbs = 0
    return PlannerConfig(parallel=ParallelConfig(dp=dp, cp=cp, **par),
                         capacity_tokens_per_rank=capacity, global_batch_size=gbs, **kw)


def long_tail(n: int, seed: int, cap: int = 32768) -> NDArray[np.int64]:
    rng = np.random.default_rng(seed)
    short = rng.lognormal(6.0, 1.2, n)
    long = rng.uniform(4000, cap, n)
    return np.where(rng.random(n) < 0.05, long, short).astype(np.int64).clip(1, cap)


def check_plan(plan: Plan, tab: LengthTable, cfg: PlannerConfig) -> None:
    lengths = tab.lengths
    validate(plan.header, list(plan.record_batches()), lengths)
    policy = apply_long_policy(lengths, cfg)
    for e, (first, count) in enumerate(plan.header.epochs):
        drawn, _ = draw_global_batches(
            policy.tokens, policy.tokens > 0, seed=cfg.seed, epoch=e,
            global_batch_size=cfg.global_batch_size,
            global_batch_tokens=cfg.global_batch_tokens, drop_last=cfg.drop_last)
        assert len(drawn) == count
        keys = []
        for j, batch in enumerate(drawn):
            cols = plan.steps[first + j]
            assert tuple(cols) == COLUMN_NAMES
            real = cols["sample_index"] >= 0
            assert np.array_equal(np.unique(cols["sample_index"][real]), np.sort(batch))
            keys.append(cols["sample_index"][real] * (1 << 32) + cols["token_offset"][real])
        if keys:
            cat = np.concatenate(keys)
            assert len(np.unique(cat)) == len(cat), "a segment is placed twice in one epoch"


def rows_of(plan: Plan, sample: int) -> list[tuple[int, ...]]:
    out = []
    for cols in plan.steps:
        for i in np.flatnonzero(cols["sample_index"] == sample):
            out.append(tuple(int(cols[c][i]) for c in ("step", "microbatch", "cp_size",
                                                       "token_offset", "num_tokens")))
    return out


# --- properties on random distributions and configurations -------------------------------------

@st.composite
def cases(draw: st.DrawFn) -> tuple[LengthTable, PlannerConfig]:
    dp, cp = draw(st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 2), (4, 2), (6, 2), (8, 1)]))
    tp = draw(st.sampled_from([1, 2]))
    sp = tp > 1 and draw(st.booleans())
    pp, vpp, mbg = draw(st.sampled_from([(1, 1, 0), (2, 2, 0), (2, 2, 3), (4, 2, 0)]))
    cap = draw(st.sampled_from([64, 100, 256, 1000]))
    n = dp * cp
    sizes = draw(st.lists(st.sampled_from(valid_cp_sizes(n)), min_size=1, unique=True))
    min_cp = draw(st.sampled_from([1, *sorted(sizes)]))
    lengths = draw(st.lists(st.one_of(st.integers(1, cap), st.integers(1, 3 * n * cap),
                                      st.just(0)), min_size=1, max_size=120))
    skipped = [i for i, v in enumerate(lengths) if v == 0]
    batch = draw(st.one_of(st.builds(lambda s: {"global_batch_size": s}, st.integers(1, 40)),
                           st.builds(lambda t: {"global_batch_tokens": t},
                                     st.integers(1, 4 * n * cap))))
    cfg = PlannerConfig(
        parallel=ParallelConfig(dp=dp, cp=cp, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp,
                                microbatch_group_size=mbg),
        capacity_tokens_per_rank=cap, seed=draw(st.integers(0, 2**32)), cp_sizes=tuple(sizes),
        epochs=draw(st.integers(1, 2)), layout=draw(st.sampled_from(LAYOUTS)), min_cp=min_cp,
        long_sequences=draw(st.sampled_from(["split", "truncate", "drop"])),
        drop_last=draw(st.booleans()), effort=draw(st.sampled_from(["fast", "balanced", "max"])),
        **batch)
    return table(lengths, skipped), cfg


@given(case=cases())
@settings(max_examples=60, deadline=None)
def test_random_plans_are_valid_and_deterministic(case: tuple[LengthTable, PlannerConfig]
                                                  ) -> None:
    tab, cfg = case
    try:
        plan = make_plan(tab, cfg, COST)
    except ValueError as e:
        # Only a plan with no step at all is refused: too few samples for one global batch
        # with drop_last, or no sample left once the long-sequence policy dropped some.
        assert "the plan would have no steps" in str(e)  # noqa: PT017
        assert cfg.drop_last or cfg.long_sequences == "drop" or not (tab.lengths > 0).any()
        return
    check_plan(plan, tab, cfg)
    stats = plan.header.stats
    real = sum(int(s["num_tokens"].sum()) for s in plan.steps)
    assert stats["real_tokens"] == real
    assert stats["num_microbatches"] == sum(int(s["microbatch"][-1]) + 1 for s in plan.steps)
    again = make_plan(tab, cfg, COST)
    assert again.header == plan.header
    for a, b in zip(plan.steps, again.steps, strict=True):
        for c in COLUMN_NAMES:
            assert np.array_equal(a[c], b[c])
            assert a[c].dtype == b[c].dtype


def test_plan_file_is_byte_identical(tmp_path: Path) -> None:
    tab, cfg = table(long_tail(600, 1)), config(dp=4, cp=2, capacity=16384, gbs=64, epochs=2)
    digests = []
    for name in ("a.arrow", "b.arrow"):
        plan = make_plan(tab, cfg, COST)
        path = write_plan(tmp_path / name, plan.header, plan.record_batches())
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@given(lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=300),
       dp=st.sampled_from([1, 3, 4, 8]), effort=st.sampled_from(["fast", "balanced"]))
@settings(max_examples=40, deadline=None)
def test_kernel_prediction_is_the_simulated_time(lengths: list[int], dp: int, effort: str
                                                 ) -> None:
    # Nested levels mean no group ever waits for a member, so the kernel's makespan (sum of
    # its rank loads) is the simulator's critical path, up to the fillers' one-token cost.
    cfg = config(dp=dp, cp=2, capacity=8192, long_sequences="split", effort=effort,
                 solver=SolverConfig(baselines=False))
    params = PackingParams.from_config(cfg, COST)
    tokens = np.asarray(lengths, dtype=np.int64)
    tokens = tokens[tokens <= 2 * dp * 8192]
    if tokens.size == 0:
        return
    out = assign_step(np.arange(len(tokens)), np.zeros(len(tokens), np.int64), tokens, params)
    sim = simulate_step(COST, 2 * dp, out.microbatch, out.rank_start, out.cp_size,
                        out.padded_tokens)
    filler = COST.linear_s_per_token + COST.attention_s_per_token2
    assert out.predicted_seconds - 1e-9 <= sim
    assert sim <= out.predicted_seconds + out.num_microbatches * filler + 1e-9


# --- edge cases ----------------------------------------------------------------------------------

def test_all_length_one() -> None:
    tab, cfg = table(np.ones(100, np.int64)), config(dp=2, cp=2, capacity=8, gbs=30)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert set(np.concatenate([s["cp_size"] for s in plan.steps]).tolist()) == {1}
    # 30 one-token samples fit one microbatch of 4 ranks x 8 tokens.
    assert plan.header.stats["microbatches_per_step"]["max"] == 1


GIANT = [100, 50_000, 200, 300]  # pool of 4 ranks x 4096 = 16384 tokens


def test_giant_error_names_the_sample() -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 50000 tokens.*4 ranks x 4096"):
        make_plan(table(GIANT), config(dp=2, cp=2, long_sequences="error"), COST)


def test_giant_split_places_segments_in_one_step() -> None:
    tab, cfg = table(GIANT), config(dp=2, cp=2, gbs=2, long_sequences="split")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    rows = rows_of(plan, 1)
    assert len({r[0] for r in rows}) == 1
    assert [(r[3], r[4]) for r in sorted(rows, key=lambda r: r[3])] == [
        (0, 16384), (16384, 16384), (32768, 16384), (49152, 848)]
    assert plan.header.stats["split_samples"] == [1]
    # Full-pool segments take a microbatch each.
    assert sorted(r[2] for r in rows)[-3:] == [4, 4, 4]


def test_giant_truncate_and_drop() -> None:
    tab = table(GIANT)
    cfg = config(dp=2, cp=2, long_sequences="truncate")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert plan.header.stats["truncated_samples"] == [[1, 16384]]
    assert [r[4] for r in rows_of(plan, 1)] == [16384]
    cfg = config(dp=2, cp=2, long_sequences="drop")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert plan.header.stats["dropped_samples"] == [1]
    assert rows_of(plan, 1) == []


def test_skipped_records_are_dropped_and_counted() -> None:
    tab, cfg = table([10, 0, 20, 0, 30], skipped=[1, 3]), config(dp=1, cp=2, gbs=2)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert plan.header.stats["dropped_samples"] == [1, 3]
    assert plan.header.stats["skipped_bad_records"] == 2


@pytest.mark.parametrize(("dp", "cp"), [(3, 2), (6, 2), (12, 1)])
def test_pools_of_6_and_12(dp: int, cp: int) -> None:
    n = dp * cp
    lengths = long_tail(400, n, cap=n * 2048)
    tab, cfg = table(lengths), config(dp=dp, cp=cp, capacity=2048, gbs=50)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    used = set(np.concatenate([s["cp_size"] for s in plan.steps]).tolist())
    assert n in used
    assert used <= set(valid_cp_sizes(n))


def test_sequence_parallel_alignment() -> None:
    tab = table(long_tail(300, 3, cap=8 * 1000))
    cfg = config(dp=4, cp=2, tp=2, sequence_parallel=True, capacity=1000, gbs=40,
                 long_sequences="split")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    cat = {c: np.concatenate([s[c] for s in plan.steps]) for c in ("cp_size", "padded_tokens")}
    mult = np.where(cat["cp_size"] == 1, 2, 4 * cat["cp_size"])
    assert np.all(cat["padded_tokens"] % mult == 0)


@pytest.mark.parametrize("group", [2, 3])
def test_vpp_microbatch_multiple_spreads_work(group: int) -> None:
    # About 1.3 microbatches of tokens per step; M is rounded up to the multiple and the work
    # spreads so that no microbatch is made of fillers only.
    lengths = np.full(400, 500, dtype=np.int64)
    tab = table(lengths)
    cfg = config(dp=2, cp=2, pp=2, vpp=2, microbatch_group_size=group, capacity=1000, gbs=10)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    for cols in plan.steps:
        m = int(cols["microbatch"][-1]) + 1
        assert m % group == 0
        real = cols["sample_index"] >= 0
        assert set(cols["microbatch"][real].tolist()) == set(range(m))


def test_large_microbatch_multiple_is_bounded() -> None:
    tab = table([5, 6, 7])
    cfg = config(dp=2, cp=1, pp=2, vpp=3, microbatch_group_size=64, gbs=3)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert plan.header.stats["microbatches_per_step"] == {"min": 64, "mean": 64.0, "max": 64}


def test_global_batch_tokens_drop_last_and_epochs() -> None:
    tab = table(long_tail(500, 4, cap=16384))
    cfg = config(dp=4, cp=2, capacity=4096, global_batch_tokens=20_000, drop_last=True, epochs=3,
                 long_sequences="split")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert len(plan.header.epochs) == 3
    undrawn = plan.header.stats["undrawn_samples"]
    assert len(undrawn) == 3
    assert all(len(u) > 0 for u in undrawn)
    steps = plan.header.epochs
    assert steps[1][0] == steps[0][0] + steps[0][1]
    assert steps[2][0] == steps[1][0] + steps[1][1]


def test_min_cp_fills_idle_blocks_with_its_size() -> None:
    tab, cfg = table([10, 20, 30]), config(dp=4, cp=2, min_cp=2, gbs=3)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    cols = plan.steps[0]
    assert set(cols["cp_size"].tolist()) == {2}
    filler = cols["sample_index"] < 0
    assert filler.sum() == 1
    assert np.all(cols["padded_tokens"][filler] == 4)


def test_heavy_sequence_moves_to_a_larger_group() -> None:
    # A 60K sequence fits CP 4 at C = 16K, but there it would take longer than the step's
    # average rank load; CP 8 shortens the critical path.
    lengths = np.r_[60_000, np.full(200, 1000)].astype(np.int64)
    tab, cfg = table(lengths), config(dp=4, cp=2, capacity=16384, gbs=201)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert [r[2] for r in rows_of(plan, 0)] == [8]
    # At CP 4 that one group alone would outlast the whole step as planned.
    assert plan.header.stats["simulated_seconds"] < COST.group_time(4, [60_000])


# --- quality against static CP -------------------------------------------------------------------

def static_cp_step(lengths: NDArray[np.int64], cp: int, n: int, cap: int, cost: CostModel
                   ) -> float:
    """Static CP: every microbatch is n/cp groups of size cp; next-fit bins of cp*C, in order."""
    m = pad_multiple(cp, 1, "zigzag")
    bins: list[list[int]] = [[]]
    fill = 0
    for length in lengths.tolist():
        p = -(-length // m) * m
        assert p <= cp * cap
        if fill + p > cp * cap:
            bins.append([])
            fill = 0
        bins[-1].append(p)
        fill += p
    groups = n // cp
    bins += [[]] * (-len(bins) % groups)
    mb, start, k, padded = [], [], [], []
    for b, seqs in enumerate(bins):
        for p in seqs or [m]:
            mb.append(b // groups)
            start.append((b % groups) * cp)
            k.append(cp)
            padded.append(p)
    return simulate_step(cost, n, np.array(mb), np.array(start), np.array(k), np.array(padded))


def test_beats_static_cp_on_a_long_tail_mix() -> None:
    tab = table(long_tail(2000, 7, cap=32768))
    cfg = config(dp=8, cp=2, capacity=16384, gbs=200)
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    drawn, _ = draw_global_batches(tab.lengths, tab.lengths > 0, seed=0, epoch=0,
                                   global_batch_size=200)
    # The static baseline packs each drawn batch in its drawn order.
    static = sum(static_cp_step(tab.lengths[b], 2, 16, 16384, COST) for b in drawn)
    ours = plan.header.stats["simulated_seconds"]
    assert ours < 0.9 * static, (ours, static)
    assert ours <= 1.05 * plan.header.stats["lower_bound_seconds"]


def test_segments_longer_than_int32_are_long_sequences() -> None:
    # A group of N x C = 2^32 padded tokens is refused (int32 offsets: cu_seqlens, the rows);
    # at the largest capacity that fits, a 3e9-token sample must follow the long-sequence
    # policy instead of wrapping around.
    with pytest.raises(ValueError, match="more than the 2147483647 that int32 offsets"):
        config(dp=8, cp=1, capacity=2**29, gbs=2, effort="fast")
    tab = table([3_000_000_000, 100])
    cap = (2**31 - 1) // 8
    with pytest.raises(ValueError, match="sample 0 has 3000000000 tokens"):
        make_plan(tab, config(dp=8, cp=1, capacity=cap, gbs=2, effort="fast"), COST)
    cfg = config(dp=8, cp=1, capacity=cap, gbs=2, effort="fast", long_sequences="split")
    plan = make_plan(tab, cfg, COST)
    check_plan(plan, tab, cfg)
    assert plan.header.stats["split_samples"] == [0]
