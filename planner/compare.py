"""``dcp-plan compare``'s numbers: one dataset planned under several setups, on sampled steps.

A setup is a pool of N ranks and a capacity C per rank: what a job asks the cluster for. How
the pool is written as dp x cp does not change a dynamic plan (its groups span the whole pool;
cp only names the static CP it would otherwise run), so the static CP sizes are columns, not
setups: each setup's steps are also scored under static CP at every listed cp that divides N
(``static_layout_of``, the planner's own baseline), next to Megatron's greedy. Every setup plans
the same global batches (the batch size or token budget is the job's, not the pool's), so step
times compare directly: tokens/s = the steps' real tokens over their simulated seconds.

Sampling: planning every step of every setup would take minutes at large pools, so
``evaluate`` plans K steps drawn without replacement by the project's seeded permutation
(solver/batches.py: the same K steps for every setup that has the same steps) and reports the
95% half-width of the mean step time's sampling error (normal approximation with the finite
population correction; 0 when every step is planned), estimated from each step's lower bound,
which is cheap and known for every step (``_mean_step``). Ratios (speed-ups, padding, idle) are
taken over the same sampled steps for the plan and its baselines (paired); BENCHMARKS.md
measures both against full plans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import CostModel, _simulate, step_lower_bound
from planner.planfile.stats import min_num_microbatches
from planner.solver.batches import epoch_permutation
from planner.solver.greedy import assign_step
from planner.solver.step import baselines_not_scored

if TYPE_CHECKING:
    from planner.sources.lengths import LengthTable

Z95 = 1.959964
"""Two-sided 95% quantile of the normal distribution."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """One candidate job: a pool of ``pool_size`` ranks and a capacity per rank."""

    pool_size: int
    capacity: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """One setup's figures over its sampled steps (module docstring)."""

    setup: Setup
    gpus: int
    """Ranks of the whole job: N x tp x pp."""
    num_steps: int
    sampled_steps: int
    step_seconds: float
    """Mean simulated seconds per step over the sampled steps."""
    step_seconds_error: float
    """95% half-width of the mean's sampling error, relative (0: every step planned)."""
    tokens_per_second: float
    tokens_per_second_per_gpu: float
    vs_static_cp: dict[int, float | None]
    """Per listed cp: static CP's total time over the plan's (None: no number, see notes)."""
    static_notes: dict[int, str]
    """Per listed cp without a number or with a partial one: why (cp does not divide N; steps
    it cannot run, its ratio then being over the others)."""
    vs_megatron: float | None
    megatron_note: str | None
    padding: float
    """(padded - real) / real tokens, fillers included."""
    idle: float
    """Share of rank-time in which ranks wait: 1 - busy / (N x step time)."""
    microbatches_per_step: float


def expand(pools: tuple[int, ...], capacities: tuple[int, ...]) -> list[Setup]:
    """Every pool x capacity, in that order."""
    return [Setup(pool_size=n, capacity=c) for n in pools for c in capacities]


def sampled_steps(num_steps: int, sample: int, seed: int) -> np.ndarray:
    """Which steps a run plans: all when ``sample`` is 0 or covers them, else ``sample`` of
    them drawn by the seeded permutation, in step order."""
    if sample <= 0 or sample >= num_steps:
        return np.arange(num_steps, dtype=np.int64)
    return np.sort(epoch_permutation(num_steps, seed, 0)[:sample])


def config_for(setup: Setup, base: PlannerConfig, cps: tuple[int, ...]) -> PlannerConfig:
    """``base`` (batch, policy, tp/pp, cost model, ...) at the setup's pool and capacity, written
    as dp x cp with the largest listed cp that divides the pool (the plan's own static CP
    candidate; 1 when none does)."""
    p = base.parallel
    cp = max([c for c in cps if setup.pool_size % c == 0] or [1])
    return PlannerConfig(
        parallel=ParallelConfig(dp=setup.pool_size // cp, cp=cp, tp=p.tp, pp=p.pp, vpp=p.vpp,
                                sequence_parallel=p.sequence_parallel,
                                microbatch_group_size=p.microbatch_group_size),
        capacity_tokens_per_rank=setup.capacity, global_batch_size=base.global_batch_size,
        global_batch_tokens=base.global_batch_tokens, seed=base.seed, layout=base.layout,
        min_cp=base.min_cp, long_sequences=base.long_sequences, effort=base.effort,
        cost_model=base.cost_model, solver=base.solver)


def evaluate(table: LengthTable, setup: Setup, base: PlannerConfig, cost: CostModel, *,
             cps: tuple[int, ...], sample: int, sample_seed: int = 0) -> Result:
    """Plan ``sample`` steps (0: all) of ``table`` under ``setup``, score static CP at each of
    ``cps`` on them, and sum their figures.

    Raises:
        ValueError: the setup cannot plan this dataset (the planner's own message).
    """
    from planner.plan import PlanStream

    config = config_for(setup, base, cps)
    stream = PlanStream(table, config, cost)
    jobs, params = stream.jobs, stream.params
    steps = sampled_steps(jobs.num_steps, sample, sample_seed)
    n = setup.pool_size
    divides = [c for c in cps if n % c == 0]
    sim = np.zeros(len(steps))
    static = np.zeros((len(divides), len(steps)))
    mega = np.zeros(len(steps))
    busy = real = padded = mbs = 0.0
    for j, i in enumerate(steps.tolist()):
        a, b = int(jobs.bounds[i]), int(jobs.bounds[i + 1])
        out = assign_step(jobs.sample[a:b], jobs.offset[a:b], jobs.tokens[a:b], params)
        sim[j] = out.simulated_seconds
        mega[j] = out.megatron_seconds
        for q, c in enumerate(divides):
            static[q, j] = _static_seconds(jobs.tokens[a:b], n, c, config, params.cost)
        busy += _simulate(params.cost, n, out.microbatch, out.rank_start, out.cp_size,
                          out.padded_tokens)[1]
        real += int(out.num_tokens.sum(dtype=np.int64))
        padded += int(out.padded_tokens.sum(dtype=np.int64))
        mbs += out.num_microbatches
    k, m = len(steps), jobs.num_steps
    mean, err = _mean_step(sim, steps, jobs, config, cost)
    vs_static: dict[int, float | None] = {}
    notes: dict[int, str] = {}
    for c in cps:
        if c not in divides:
            vs_static[c], notes[c] = None, f"cp {c} does not divide the pool of {n}"
        else:
            vs_static[c], notes[c] = _ratio(static[divides.index(c)], sim, f"static CP {c}",
                                            f"a sequence longer than {c} x {setup.capacity:,} "
                                            "tokens")
    off = baselines_not_scored(config).get("megatron-greedy")
    vs_mega, mega_note = (None, off) if off else _ratio(
        mega, sim, "Megatron's greedy", "2N padding past the pool")
    gpus = n * config.parallel.tp * config.parallel.pp
    # Every step's real tokens are known without planning: the rate needs only the time.
    rate = float(jobs.tokens.sum()) / (mean * m) if mean > 0 else 0.0
    total = float(sim.sum())
    return Result(setup=setup, gpus=gpus, num_steps=m, sampled_steps=k, step_seconds=mean,
                  step_seconds_error=err, tokens_per_second=rate,
                  tokens_per_second_per_gpu=rate / gpus,
                  vs_static_cp=vs_static, static_notes={c: v for c, v in notes.items() if v},
                  vs_megatron=vs_mega, megatron_note=mega_note,
                  padding=(padded - real) / real if real else 0.0,
                  idle=1 - busy / (n * total) if total > 0 else 0.0,
                  microbatches_per_step=mbs / k)


def _ratio(base: np.ndarray, sim: np.ndarray, name: str, why: str) -> tuple[float | None, str]:
    """A baseline's time over the plan's on the steps it can run, and a note when it cannot run
    some ('' when it runs all)."""
    ok = np.isfinite(base)
    bad = int((~ok).sum())
    if not ok.any():
        return None, f"{name} cannot run any of the {len(sim)} steps ({why})"
    ratio = float(base[ok].sum() / sim[ok].sum())
    if not bad:
        return ratio, ""
    return ratio, (f"{name} cannot run {bad} of the {len(sim)} steps ({why}); its ratio is over "
                   "the others")


def _mean_step(sim: np.ndarray, steps: np.ndarray, jobs: Any, config: PlannerConfig,
               cost: CostModel) -> tuple[float, float]:
    """(mean step seconds, relative 95% half-width of its sampling error).

    Every step planned: the plain mean, no error. Sampled: a ratio estimator on each step's
    lower bound (cost.step_lower_bound, cheap and known for every step): the sampled steps'
    time over their bounds, times every step's bound. Step times are heavy-tailed (a step
    holding a 200K-token document costs several of the others) while time over bound is
    steady, so this has a fraction of the plain mean's error (BENCHMARKS.md).
    """
    k, m = len(steps), jobs.num_steps
    if k == m:
        return float(sim.sum()) / m, 0.0
    p = config.parallel
    lb = np.empty(m)
    for i in range(m):
        seg = jobs.tokens[int(jobs.bounds[i]):int(jobs.bounds[i + 1])]
        need = min_num_microbatches(seg, config.sizes, config.capacity_tokens_per_rank,
                                    p.tp_eff, config.layout, p.pool_size,
                                    p.microbatch_multiple)
        lb[i] = step_lower_bound(cost, p.pool_size, seg, config.sizes,
                                 config.capacity_tokens_per_rank, p.tp_eff, config.layout, need)
    picked = lb[steps]
    r = float(sim.sum() / picked.sum())
    mean = r * float(lb.sum()) / m
    resid = sim - r * picked
    err = Z95 * math.sqrt((1 - k / m) / k * float(resid.var(ddof=1))) / float(picked.mean()) / r \
        if k > 1 else 0.0
    return mean, err


def _static_seconds(tokens: np.ndarray, pool_size: int, cp: int, config: PlannerConfig,
                    cost: np.ndarray) -> float:
    """Static CP ``cp``'s simulated seconds on one step's segments (inf: it cannot run it)."""
    from planner.solver.candidates import INFEASIBLE, static_layout_of

    p = config.parallel
    layout = static_layout_of(np.asarray(tokens, np.int64), pool_size=pool_size, cp=cp,
                              capacity=config.capacity_tokens_per_rank, tp_eff=p.tp_eff,
                              layout=config.layout, multiple=p.microbatch_multiple)
    if layout is None:
        return INFEASIBLE
    return layout.seconds(cost, pool_size)
