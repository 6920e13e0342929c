"""One step's assignment: search over microbatch counts and targets around the placement kernel.

Objective (issue 3), lexicographic: the simulated step time, then the microbatch count, then the
padding. The kernel (place.py) places every segment for a given microbatch count M and target T;
this module decides which (M, T) to try:

1. M starts at the fewest microbatches the tokens need, ceil(padded / (N C)), rounded up to the
   microbatch multiple (2, not 1, when one microbatch would be more than
   ``SINGLE_MICROBATCH_FILL`` full on a pool of ``SINGLE_MICROBATCH_MIN_POOL`` ranks or more),
   and grows until the kernel places every segment (balance mode, then pack mode, at T = the
   step's malleable bound, bounds.py).
2. Then M + multiple x (1, 2, ...) (fast and balanced: +1, +2; max: up to +32), skipping
   any whose own lower bound rules out a win, and a bisection below the winner. The step keeps
   the fewest microbatches whose time is within ``microbatch_tolerance`` of the fastest tried:
   a larger M must be faster by at least the tolerance to be chosen.
3. ``balanced`` and ``max``, only when the time is still more than ``refine_gap`` over the bound:
   more targets T (the bound times 1 + delta, balance and pack mode) at the chosen M, (max only)
   step 2 again with those targets, then one CP-SAT call on the heaviest segments (cpsat.py) at
   the chosen M with the effort's deterministic-time budget, when those segments hold at least
   ``HEAVY_SHARE`` of the step's work (below it CP-SAT's model cannot move what matters) and,
   for balanced, the pool has at most ``CPSAT_MAX_UNITS`` smallest blocks (step.py: above that
   its calls cost much and bought nothing measurable).
   Every candidate is scored by the kernel's exact makespan and the best is kept, so
   refinement never makes a step worse.
``fast`` is steps 1-2. Extra microbatches loosen capacity for balance but cost fixed time and
leave slots empty: the tolerance keeps near-ties at the fewer microbatches (fuller slots).

Trade-off: ``fast`` is two to four kernel passes per step (each O(segments x levels x log N) in
balance mode); balanced refinement is a few more passes (up to 2 per target) and at most one
bounded CP-SAT call, spent only on the steps whose gap to the bound is large and, for CP-SAT,
whose heaviest segments matter (on the 1M Wikipedia lengths with C = 16384 and a global batch
of 16 N, 47 of 3907 steps call it at N = 16; at N = 64, where balanced no longer calls it,
30 of 977 would).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from planner.solver.candidates import Rows, best_rows
from planner.solver.emit import emit_rows
from planner.solver.items import RunTables
from planner.solver.place import BALANCE, PACK
from planner.solver.spread import spread
from planner.solver.step import (
    EXTRA_MICROBATCHES,
    HEAVY_SHARE,
    REFINE_EXTRA_MICROBATCHES,
    SINGLE_MICROBATCH_FILL,
    SINGLE_MICROBATCH_MIN_POOL,
    SOLVER_NAME,
    SOLVER_VERSION,
    PackingParams,
    Placement,
    StepProblem,
    make_problem,
    min_microbatches,
)

__all__ = ["SOLVER_NAME", "SOLVER_VERSION", "PackingParams", "StepAssignment", "assign_step",
           "make_problem", "min_microbatches", "refine", "solve_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepAssignment:
    """One step's rows (plan columns except ``step``), sorted as the plan format demands."""

    num_microbatches: int
    simulated_seconds: float
    """The simulator's critical path of these rows (cost.simulate_step)."""
    predicted_seconds: float
    """Our search's kernel makespan (fillers' token cost excluded), whichever rows won."""
    bound_seconds: float
    """The step's tight lower bound at its fewest microbatches: the malleable bound, tightened
    where segments need the whole pool (bounds.py)."""
    source: str
    """Which candidate the rows come from: ``dcp`` (our search), ``static-cp`` or
    ``megatron-greedy`` (candidates.py)."""
    static_seconds: float
    """Static CP's simulated seconds on this step (nan: not scored, inf: it cannot run it)."""
    megatron_seconds: float
    """Megatron's greedy's simulated seconds on this step (nan: not scored, inf: cannot)."""
    terms: NDArray[np.float64]
    """(3, 3) ``cost.step_terms`` of these rows, static CP's and Megatron's (candidates.py's
    ``Scored.terms``): the predicted gain's parts (planfile/gain.py)."""
    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]


def refine(problem: StepProblem, best: Placement) -> Placement:
    """More targets (balance and pack mode) at ``best``'s M; keep the best."""
    p = problem.params
    m = best.num_mb
    bound = problem.bound(m)
    if problem.gap(best) <= p.refine_gap:
        return best
    for delta in (0.0, *p.deltas):
        target = bound * (1.0 + delta)
        if (target >= best.seconds and np.isfinite(delta)) or problem.exhausted():
            break
        # Pack mode wins where capacity binds (tight M), balance mode elsewhere: try both.
        for mode in (BALANCE, PACK):
            cand = problem.run(m, target, mode)
            if cand is not None and cand.better_than(best):
                best = cand
    return best


def _more_microbatches(problem: StepProblem, best: Placement, do_refine: bool) -> Placement:
    """The fewest microbatches whose time is within the tolerance of the fastest tried.

    Tries M + multiple x (1, 2, 4, ...) (``EXTRA_MICROBATCHES`` of them; geometric, so a step of
    60 microbatches can reach 90 in a few passes), skipping those whose own bound rules out
    beating the fastest by the tolerance, then bisects the gap below the winner.
    """
    p = problem.params
    tol = p.microbatch_tolerance
    mult = p.microbatch_multiple
    tried = {best.num_mb: best}

    def attempt(m: int) -> None:
        cand = problem.first_fit(m)
        if cand is not None and do_refine:
            cand = refine(problem, cand)
        if cand is not None:
            tried[m] = cand

    def fastest() -> float:
        return min(c.seconds for c in tried.values())

    for j in range(EXTRA_MICROBATCHES[p.effort]):
        m = best.num_mb + mult * (1 << j)
        # A larger M only wins if its own bound leaves room to beat the fastest by the tolerance.
        if fastest() * (1.0 - tol) <= problem.bound(m) or (do_refine and problem.exhausted()):
            break
        attempt(m)

    def choice() -> int:
        return min(m for m, c in tried.items() if c.seconds * (1.0 - tol) <= fastest())

    # Bisect between the chosen M and the largest tried M below it (which lost).
    while True:
        hi = choice()
        below = [m for m in tried if m < hi]
        lo = max(below) if below else hi
        mid = lo + (hi - lo) // (2 * mult) * mult
        if mid <= lo or mid in tried or (do_refine and problem.exhausted()):
            break
        attempt(mid)
        if mid not in tried:
            break
    return tried[choice()]


def solve_step(problem: StepProblem) -> Placement:
    """The step's placement under the lexicographic objective (module docstring)."""
    p = problem.params
    m = min_microbatches(problem.tables, p)
    if (m == 1 and p.pool_size >= SINGLE_MICROBATCH_MIN_POOL
            and problem.fill(1) > SINGLE_MICROBATCH_FILL):
        # One bin per rank this full packs badly: on the quality workloads and the Wikipedia
        # lengths at pools 8-1024, 87 such attempts (fill > 0.95) were never the step's choice
        # and 77% of them failed after a full pass (two, balance and pack mode). Small pools
        # still try (step.py: an exact fit can win, and the attempt is cheap there).
        m += p.microbatch_multiple
    best = problem.first_fit(m)
    while best is None:
        # With one microbatch per segment every segment has a block of its own, so this ends.
        m += p.microbatch_multiple
        best = problem.first_fit(m)
    # Cheap passes first: more microbatches without refinement often close the gap alone.
    best = _more_microbatches(problem, best, do_refine=False)
    if p.effort == "fast" or problem.gap(best) <= p.refine_gap:
        return best
    best = refine(problem, best)
    if REFINE_EXTRA_MICROBATCHES[p.effort]:
        best = _more_microbatches(problem, best, do_refine=True)
    if (p.cpsat_seconds > 0 and p.cpsat_items > 0 and problem.gap(best) > p.refine_gap
            and problem.heavy_share() >= HEAVY_SHARE):
        # One CP-SAT call per step, at the chosen M: the solver budget per step is bounded.
        from planner.solver.cpsat import refine_heavy

        cand = refine_heavy(problem, best)
        if cand is not None and cand.better_than(best):
            best = cand
    return best


def assign_step(sample_index: NDArray[np.int64], token_offset: NDArray[np.int64],
                num_tokens: NDArray[np.int64], params: PackingParams,
                run: RunTables | None = None) -> StepAssignment:
    """Place one step's segments (each fits some allowed group) into groups and microbatches;
    ``run``: tables holding every length of the step (step.run_tables), shared by a run's
    steps (None: built for this step)."""
    tokens = np.asarray(num_tokens, np.int64)
    problem = make_problem(tokens, params, run)
    best = solve_step(problem)
    t = problem.tables
    g_level = np.empty(len(tokens), np.int64)
    g_block = np.empty(len(tokens), np.int64)
    g_level[:best.num_groups] = best.g_level
    g_block[:best.num_groups] = best.g_block
    item_group = best.item_group.copy()
    num_groups = spread(t.at(np.zeros(len(tokens), np.int64)), t.order, best.item_level,
                        item_group, g_level, g_block, best.num_groups, params.sizes,
                        params.capacity, params.pool_size, best.num_mb)
    mb, start, k, sample, offset, ntok, padded = emit_rows(
        np.asarray(sample_index, np.int64), np.asarray(token_offset, np.int64), tokens,
        t.at(best.item_level), t.order, best.item_level, item_group, g_level, g_block,
        num_groups, params.sizes, params.pool_size, best.num_mb, int(params.multiples[0]))
    bound = problem.tight_bound(min_microbatches(t, params))
    scored = best_rows(
        Rows(mb, start, k, sample, offset, ntok, padded), np.asarray(sample_index, np.int64),
        np.asarray(token_offset, np.int64), tokens, cost=params.cost,
        pool_size=params.pool_size, capacity=params.capacity, sizes=params.sizes,
        static_cp=params.static_cp, megatron=params.megatron, tp_eff=params.tp_eff,
        layout=params.layout, multiple=params.microbatch_multiple)
    rows = scored.rows
    return StepAssignment(num_microbatches=rows.num_microbatches,
                          simulated_seconds=scored.seconds, predicted_seconds=best.seconds,
                          bound_seconds=bound, source=scored.source,
                          static_seconds=scored.static_seconds,
                          megatron_seconds=scored.megatron_seconds, terms=scored.terms,
                          microbatch=rows.microbatch,
                          rank_start=rows.rank_start, cp_size=rows.cp_size,
                          sample_index=rows.sample_index, token_offset=rows.token_offset,
                          num_tokens=rows.num_tokens, padded_tokens=rows.padded_tokens)
