"""Plan quality: ours against static CP and Megatron's greedy, all scored by one simulator.

For every workload x pool x cost model, plan the same global batches with ours
(``planner.plan.make_plan``), static CP with next-fit packing at the user's cp and at the
smallest static cp that fits every sample, and Megatron's ``default_dynamic_cp`` greedy; score
every step with ``planner.cost.simulate_step`` under the same cost model and print one table:

- T/LB: simulated time over ``step_lower_bound`` (the same bound for every method): over the
  run (sum/sum), and the mean and p95 of the per-step ratios; T/LB*: over the run, against
  planner.solver.bounds' tighter (malleable) bound at the same microbatch counts;
- ours x: the method's total simulated time over ours (> 1: ours is faster);
- pad%: padded over real tokens of the placed samples, minus 1; fill%: real tokens over the
  N x C x microbatches token slots; mb/step: microbatches per step; imb: mean over microbatches
  of (max rank time / mean rank time); kseq/s: thousands of sequences planned per second
  (baselines: their scheduler only; ours: the whole ``make_plan``).

Sizing: each workload holds about ``--steps`` + 1 global batches; the first ``--steps`` are
scored, never the epoch's partial last one. C is the workload's nominal capacity unless
``--capacity`` says otherwise, raised per pool so that the longest sample fits the whole pool
after Megatron's 2N padding (the table shows the C used). The user's static cp is ``--cp``
(default 4), so dp = N / cp.

Run: ``.venv/bin/python bench/quality.py [--workloads wikipedia,lognormal] [--pools 8,12]
[--cost-models dense-7b-h200] [--steps 32] [--capacity 8192] [--global-batch 4x]
[--effort balanced] [--microbatch-tolerance 0.01]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from numpy.typing import NDArray

from bench.baselines import (
    BaselineRun,
    StaticCPInfeasible,
    megatron_plan,
    smallest_static_cp,
    static_cp_plan,
)
from bench.workloads import NAMES, SPECS, make_workload
from planner.config import ParallelConfig, PlannerConfig, SolverConfig
from planner.cost import CostModel, load_cost_model, simulate_step, step_lower_bound
from planner.groups import ZIGZAG, pad_multiple, valid_cp_sizes
from planner.solver.greedy import PackingParams, make_problem


@dataclass(frozen=True, kw_only=True, slots=True)
class Score:
    """One method's numbers on one (workload, pool, cost model)."""

    method: str
    steps: int
    sim: NDArray[np.float64]
    bound: NDArray[np.float64]
    tight: NDArray[np.float64]
    pad: float
    fill: float
    microbatches: float
    imbalance: float
    kseq_per_s: float
    note: str = ""


def _batch_spec(text: str, pool: int, capacity: int) -> tuple[int, int]:
    """(global_batch_size, global_batch_tokens) from '4x' (x N x C tokens), '512' or '2000000t'."""
    if text.endswith("x"):
        return 0, int(float(text[:-1]) * pool * capacity)
    if text.endswith("t"):
        return 0, int(text[:-1])
    return int(text), 0


def _table(lengths: NDArray[np.int64], name: str) -> Any:
    from planner.sources.lengths import LengthTable

    # "text": the in-memory equivalent of a .txt file with one length per line.
    return LengthTable(path=f"bench:{name}", format="text", lengths=lengths,
                       skipped=np.zeros(0, dtype=np.int64))


def score(method: str, plan: Any, lengths: NDArray[np.int64], batches: list[NDArray[np.int64]],
          cost: CostModel, capacity: int, max_steps: int, seconds: float, num_seqs: int,
          note: str = "") -> Score:
    """Simulate the first ``max_steps`` steps of ``plan`` and collect the table's numbers."""
    n = plan.header.parallel.pool_size
    tp_eff = 1
    sizes = valid_cp_sizes(n)
    num = min(max_steps, len(plan.steps))
    sim, bound, tight = np.zeros(num), np.zeros(num), np.zeros(num)
    params = PackingParams(pool_size=n, capacity=capacity, sizes=np.asarray(sizes, np.int64),
                           multiples=np.array([pad_multiple(k, tp_eff, ZIGZAG) for k in sizes]),
                           cost=cost.as_array(), microbatch_multiple=1)
    real = padded = slots = mbs = 0
    imb: list[float] = []
    for i in range(num):
        c = plan.steps[i]
        mb, start, k, pt = c["microbatch"], c["rank_start"], c["cp_size"], c["padded_tokens"]
        sim[i] = simulate_step(cost, n, mb, start, k, pt)
        step_len = lengths[batches[i]]
        need = -(-int(step_len.sum()) // (n * capacity))
        bound[i] = step_lower_bound(cost, n, step_len, sizes, capacity, tp_eff, ZIGZAG, need)
        tight[i] = make_problem(step_len, params).bound(need)
        m = int(mb.max()) + 1
        real += int(c["num_tokens"].sum())
        padded += int(pt[c["sample_index"] >= 0].sum())
        slots += n * capacity * m
        mbs += m
        imb += _imbalance(cost, n, mb, start, k, pt)
    return Score(method=method, steps=num, sim=sim, bound=bound, tight=tight,
                 pad=padded / max(real, 1) - 1,
                 fill=real / max(slots, 1), microbatches=mbs / max(num, 1),
                 imbalance=float(np.mean(imb)) if imb else float("nan"),
                 kseq_per_s=num_seqs / seconds / 1e3 if seconds > 0 else float("inf"), note=note)


def _imbalance(cost: CostModel, n: int, mb: NDArray[Any], start: NDArray[Any], k: NDArray[Any],
               padded: NDArray[Any]) -> list[float]:
    """Per microbatch: max over ranks of the rank's group time / mean over ranks."""
    first = np.flatnonzero(np.r_[True, (np.diff(mb) != 0) | (np.diff(start) != 0)])
    ends = np.r_[first[1:], len(mb)]
    per_mb: dict[int, list[tuple[float, int]]] = {}
    for a, b in zip(first.tolist(), ends.tolist(), strict=False):
        t = cost.group_time(int(k[a]), padded[a:b])
        per_mb.setdefault(int(mb[a]), []).append((t, int(k[a])))
    out = []
    for groups in per_mb.values():
        top = max(t for t, _ in groups)
        mean = sum(t * kk for t, kk in groups) / n
        out.append(top / mean)
    return out


def _same_batches(run: BaselineRun, plan: Any, num: int) -> None:
    """Fairness guard: step i of the baseline holds the same samples as step i of ours."""
    for i in range(min(num, len(plan.steps), len(run.plan.steps))):
        a = np.unique(plan.steps[i]["sample_index"])
        b = np.unique(run.plan.steps[i]["sample_index"])
        if not np.array_equal(a[a >= 0], b[b >= 0]):
            raise AssertionError(f"step {i}: baseline {run.plan.header.solver['name']} drew "
                                 f"other samples than ours")


def evaluate(workload: str, pool: int, cost_names: list[str], args: argparse.Namespace
             ) -> list[tuple[str, int, int, str, Score]]:
    """All rows of one (workload, pool): ours and the baselines under each cost model."""
    from bench.baseline_common import draw_epochs
    from planner.plan import make_plan

    spec = SPECS[workload]
    nominal = args.capacity or spec.capacity
    size, tokens = _batch_spec(args.global_batch, pool, nominal)
    # One batch more than scored, so every scored step is a full one (the epoch's last is not).
    total = (args.steps + 1) * (tokens or size * spec.mean_tokens or 4 * pool * nominal)
    lengths = make_workload(workload, num_tokens=int(total), pool_size=pool, capacity=nominal,
                            seed=args.seed)
    mult = 2 * pool
    capacity = max(nominal, -(-(-(-int(lengths.max()) // mult) * mult) // pool))
    cp = args.cp if args.cp in valid_cp_sizes(pool) else valid_cp_sizes(pool)[-2]
    config = PlannerConfig(parallel=ParallelConfig(dp=pool // cp, cp=cp),
                           capacity_tokens_per_rank=capacity, global_batch_size=size,
                           global_batch_tokens=tokens, seed=args.seed, effort=args.effort)
    table = _table(lengths, workload)
    batches = draw_epochs(lengths, config)[0][0]
    scored = min(args.steps, max(len(batches) - 1, 1))
    best = smallest_static_cp(lengths, pool, capacity, 1, ZIGZAG)
    runs: list[tuple[str, BaselineRun | None, str]] = []
    label = f"static cp={cp}" + (" (= best fit)" if best == cp else "")
    try:
        runs.append((label, static_cp_plan(table, config, cp=cp), ""))
    except StaticCPInfeasible as e:
        runs.append((label, None, f"infeasible: needs static cp>={e.smallest_cp}"))
    if best is not None and best != cp:
        runs.append((f"static cp={best} (best fit)", static_cp_plan(table, config, cp=best), ""))
    runs.append(("megatron-greedy", megatron_plan(table, config), ""))
    rows = []
    for cost_name in cost_names:
        cost = load_cost_model(cost_name)
        cfg = PlannerConfig(parallel=config.parallel, capacity_tokens_per_rank=capacity,
                            global_batch_size=size, global_batch_tokens=tokens, seed=args.seed,
                            effort=args.effort, cost_model=cost_name,
                            solver=SolverConfig(microbatch_tolerance=args.microbatch_tolerance))
        t0 = time.perf_counter()
        ours = make_plan(table, cfg, cost)
        dt = time.perf_counter() - t0
        scores = [score("ours", ours, lengths, batches, cost, capacity, scored, dt,
                        sum(len(b) for b in batches))]
        for label, run, note in runs:
            if run is None:
                scores.append(Score(method=label, steps=0, sim=np.zeros(0), bound=np.zeros(0),
                                    tight=np.zeros(0), pad=math.nan, fill=math.nan,
                                    microbatches=math.nan,
                                    imbalance=math.nan, kseq_per_s=math.nan, note=note))
                continue
            _same_batches(run, ours, scored)
            scores.append(score(label, run.plan, lengths, batches, cost, capacity, scored,
                                run.scheduling_seconds, run.num_sequences, note))
        for s in scores:
            rows.append((workload, pool, capacity, cost_name, s))
            print(f"  {workload} N={pool} {cost_name} {s.method}: " + _cells(s, scores[0]),
                  file=sys.stderr, flush=True)
    return rows


HEADER = (f"{'workload':<10} {'N':>3} {'C':>7} {'cost model':<15} {'method':<26} {'steps':>5} "
          f"{'T/LB':>6} {'mean':>6} {'p95':>6} {'T/LB*':>6} {'ours x':>7} {'pad%':>6} {'fill%':>6} "
          f"{'mb/step':>7} {'imb':>5} {'kseq/s':>8}")


def _cells(s: Score, ours: Score) -> str:
    if s.steps == 0:
        return f"{'-':>5} {s.note}"
    ratio = s.sim / s.bound
    x = s.sim.sum() / ours.sim.sum() if ours.steps else math.nan
    return (f"{s.steps:>5} {s.sim.sum() / s.bound.sum():>6.3f} {ratio.mean():>6.3f} "
            f"{np.percentile(ratio, 95):>6.3f} {s.sim.sum() / s.tight.sum():>6.3f} {x:>7.3f} "
            f"{100 * s.pad:>6.2f} {100 * s.fill:>6.1f} "
            f"{s.microbatches:>7.2f} {s.imbalance:>5.2f} {s.kseq_per_s:>8.1f}"
            + (f"  {s.note}" if s.note else ""))


def _warm_up() -> None:
    """Compile our planner's numba kernels (and import OR-Tools) once, so no row pays for it."""
    import planner.solver.cpsat  # noqa: F401
    from planner.plan import make_plan

    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=4), capacity_tokens_per_rank=4096,
                           global_batch_tokens=4 * 8 * 4096)
    lengths = make_workload("lognormal", num_tokens=2 * 4 * 8 * 4096, pool_size=8, capacity=4096)
    make_plan(_table(lengths, "warm-up"), config, load_cost_model("default"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(NAMES), help="comma list of workloads")
    ap.add_argument("--pools", default="8,16,64,12", help="comma list of pool sizes N")
    ap.add_argument("--cost-models", default="dense-7b-h200,small-2048-h200",
                    help="comma list of cost-model presets or JSON paths")
    ap.add_argument("--steps", type=int, default=32, help="global batches per run (scored)")
    ap.add_argument("--capacity", type=int, default=0,
                    help="C, tokens per rank (default: each workload's nominal C)")
    ap.add_argument("--global-batch", default="4x",
                    help="'4x' = 4 x N x C tokens, '2000000t' = tokens, '512' = samples")
    ap.add_argument("--cp", type=int, default=4, help="the user's static CP size")
    ap.add_argument("--seed", type=int, default=0, help="workload and permutation seed")
    ap.add_argument("--effort", default="balanced", help="our planner's effort")
    ap.add_argument("--microbatch-tolerance", type=float,
                    default=SolverConfig().microbatch_tolerance,
                    help="our planner: a larger microbatch count must be this much faster")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    _warm_up()
    rows = []
    for w in args.workloads.split(","):
        for pool in (int(x) for x in args.pools.split(",")):
            rows += evaluate(w, pool, args.cost_models.split(","), args)
    print(HEADER)
    print("-" * len(HEADER))
    last: tuple[Any, ...] = ()
    ours: Score | None = None
    for w, pool, cap, cost_name, s in rows:
        if s.method == "ours":
            ours = s
        key = (w, pool, cost_name)
        lead = (f"{w:<10} {pool:>3} {cap:>7} {cost_name:<15}" if key != last
                else " " * 38)
        last = key
        assert ours is not None
        print(f"{lead} {s.method:<26} {_cells(s, ours)}")
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
