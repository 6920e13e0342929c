"""One step's assignment: search over microbatch counts and targets around the placement kernel.

Objective (issue 3), lexicographic: the simulated step time, then the microbatch count, then the
padding. The kernel (place.py) places every segment for a given microbatch count M and target T;
this module decides which (M, T) to try:

1. M starts at the fewest microbatches the tokens need, ceil(padded / (N C)), rounded up to the
   microbatch multiple, and grows until the kernel places every segment (balance mode, then pack
   mode, at T = the step's malleable bound, bounds.py).
2. Then M + multiple x (1, 2, ...) (fast: +1, +2; balanced: up to +8; max: up to +32), skipping
   any whose own lower bound rules out a win, and a bisection below the winner. The step keeps
   the fewest microbatches whose time is within ``microbatch_tolerance`` of the fastest tried:
   a larger M must be faster by at least the tolerance to be chosen.
3. ``balanced`` and ``max``, only when the time is still more than ``refine_gap`` over the bound:
   more targets T (the bound times 1 + delta, balance and pack mode) at the chosen M, step 2 again
   with those targets, then one CP-SAT call on the heaviest segments (cpsat.py) at the chosen M
   with the effort's deterministic-time budget. Every candidate is scored by the kernel's exact
   makespan and the best is kept, so refinement never makes a step worse.
``fast`` is steps 1-2. Extra microbatches loosen capacity for balance but cost fixed time and
leave slots empty: the tolerance keeps near-ties at the fewer microbatches (fuller slots).

Trade-off: ``fast`` is two to four kernel passes per step (each O(segments x blocks)); refinement
is 10-30 more passes and one bounded CP-SAT call, spent only on the steps whose gap to the bound
is large (on the 1M-sample Wikipedia file: none at the default gap, so balanced costs fast's time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.bounds import malleable_bound
from planner.config import PlannerConfig
from planner.cost import CostModel
from planner.emit import emit_rows
from planner.groups import pad_multiple
from planner.items import ItemTables, item_tables
from planner.place import BALANCE, PACK, place, spread

SOLVER_NAME = "greedy-lpt"
SOLVER_VERSION = 2

# Targets tried by refinement, as the bound times (1 + delta); max adds plain LPT (T = inf).
_DELTAS = {"balanced": (0.01, 0.03, 0.06, 0.1, 0.16, 0.25),
           "max": (0.005, 0.01, 0.02, 0.03, 0.045, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.35,
                   0.5, np.inf)}
# Larger microbatch counts tried: M + multiple x 2^j for j below this.
_EXTRA_MICROBATCHES = {"fast": 2, "balanced": 4, "max": 6}
_CPSAT_SECONDS = {"fast": 0.0, "balanced": 0.05, "max": 0.5}
_CPSAT_ITEMS = {"fast": 0, "balanced": 8, "max": 16}
# Optional kernel passes per step stop once segments x blocks summed over passes exceed this
# (about 0.1 s (balanced) and 0.4 s (max) of kernel time on this 2-core machine): a
# deterministic cap for huge steps (N = 64 and 20,000 segments reach it).
_PASS_BUDGET = {"fast": 0, "balanced": 1.5e8, "max": 6e8}


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingParams:
    """What the step solver needs from the config and the cost model."""

    pool_size: int
    capacity: int
    sizes: NDArray[np.int64]
    """Allowed group sizes, ascending."""
    multiples: NDArray[np.int64]
    """Padding multiple at each size (groups.pad_multiple)."""
    cost: NDArray[np.float64]
    """CostModel.as_array()."""
    microbatch_multiple: int
    """Every step's microbatch count is a multiple of this."""
    effort: str = "balanced"
    """fast, balanced or max (the module docstring says what each does)."""
    microbatch_tolerance: float = 0.01
    """SolverConfig.microbatch_tolerance."""
    refine_gap: float = 0.02
    """SolverConfig.refine_gap."""
    cpsat_seconds: float = 0.05
    """CP-SAT deterministic time per refined step (0: no CP-SAT)."""
    cpsat_items: int = 8
    """Heaviest segments in the CP-SAT model."""
    seed: int = 0
    """CP-SAT random seed."""
    deltas: tuple[float, ...] = ()
    """Refinement targets, as the bound times (1 + delta)."""

    @classmethod
    def from_config(cls, config: PlannerConfig, cost: CostModel) -> PackingParams:
        p = config.parallel
        s = config.solver
        sizes = np.asarray(config.sizes, dtype=np.int64)
        mults = np.array([pad_multiple(int(k), p.tp_eff, config.layout) for k in sizes], np.int64)
        cpsat = s.cpsat_seconds if s.cpsat_seconds >= 0 else _CPSAT_SECONDS[config.effort]
        return cls(pool_size=p.pool_size, capacity=config.capacity_tokens_per_rank, sizes=sizes,
                   multiples=mults, cost=cost.as_array(),
                   microbatch_multiple=p.microbatch_multiple, effort=config.effort,
                   microbatch_tolerance=s.microbatch_tolerance, refine_gap=s.refine_gap,
                   cpsat_seconds=cpsat, cpsat_items=_CPSAT_ITEMS[config.effort], seed=s.seed,
                   deltas=_DELTAS.get(config.effort, ()))

    def header(self) -> dict[str, Any]:
        """The solver settings for the plan header (everything that can change a plan)."""
        return {"name": SOLVER_NAME, "version": SOLVER_VERSION, "effort": self.effort,
                "microbatch_tolerance": self.microbatch_tolerance,
                "refine_gap": self.refine_gap,
                "extra_microbatches": _EXTRA_MICROBATCHES[self.effort],
                "targets": [d if np.isfinite(d) else "inf" for d in self.deltas],
                "cpsat": {"max_deterministic_time": self.cpsat_seconds,
                          "heavy_items": self.cpsat_items, "random_seed": self.seed,
                          "num_workers": 1, "ortools": _ortools_version()}
                if self.cpsat_seconds > 0 else None}


def _ortools_version() -> str:
    """The installed OR-Tools version (CP-SAT answers may differ between versions)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ortools")
    except PackageNotFoundError:
        return "missing"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepAssignment:
    """One step's rows (plan columns except ``step``), sorted as the plan format demands."""

    num_microbatches: int
    predicted_seconds: float
    """The kernel's critical path (fillers' token cost excluded)."""
    bound_seconds: float
    """The step's malleable lower bound (bounds.py) at its fewest microbatches."""
    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """One kernel pass that placed every segment."""

    num_mb: int
    seconds: float
    padded: int
    """Sum of the segments' padded tokens (the third objective)."""
    num_groups: int
    item_level: NDArray[np.int64]
    item_group: NDArray[np.int64]
    g_level: NDArray[np.int64]
    g_block: NDArray[np.int64]

    def better_than(self, other: Placement | None) -> bool:
        """Same M: faster (beyond rounding), or as fast with less padding."""
        if other is None:
            return True
        if self.seconds < other.seconds * (1 - 1e-12):
            return True
        return self.seconds <= other.seconds * (1 + 1e-12) and self.padded < other.padded


@dataclass(frozen=True, kw_only=True, slots=True)
class StepProblem:
    """A step's segments, their tables and bound, and the solver parameters."""

    tables: ItemTables
    params: PackingParams
    core_bound: float
    """bounds.malleable_bound: the step's bound without microbatch fixed costs."""
    spent: list[float]
    """Segments x blocks of the kernel passes run so far (one mutable cell)."""

    def exhausted(self) -> bool:
        """Whether optional passes (refinement, extra microbatches) are out of budget."""
        return self.spent[0] > _PASS_BUDGET[self.params.effort]

    @property
    def fixed_per_microbatch(self) -> float:
        """What each microbatch costs every rank at least (a k0 group's fixed time)."""
        c = self.params.cost
        return float(c[4] + (self.params.sizes[0] - 1) * c[2])

    def bound(self, num_mb: int) -> float:
        """The step's malleable lower bound with ``num_mb`` microbatches."""
        return self.core_bound + num_mb * self.fixed_per_microbatch

    def run(self, num_mb: int, target: float, mode: int = BALANCE,
            forced: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None
            ) -> Placement | None:
        """One kernel pass; None when some segment fits nowhere with ``num_mb`` microbatches."""
        t = self.tables
        n = len(t.order)
        p = self.params
        if forced is None:
            forced = (np.full(n, -1, np.int64), np.full(n, -1, np.int64))
        item_level = np.empty(n, np.int64)
        item_group = np.empty(n, np.int64)
        g_level = np.empty(n, np.int64)
        g_block = np.empty(n, np.int64)
        self.spent[0] += n * (2 * p.pool_size // int(p.sizes[0]))
        num_groups, seconds = place(t.padded, t.fits, t.time, t.min_level, t.order, p.sizes,
                                    p.capacity, p.pool_size, p.cost, num_mb, target, mode,
                                    forced[0], forced[1], item_level, item_group, g_level,
                                    g_block)
        if num_groups < 0:
            return None
        padded = int(t.padded[np.arange(n), item_level].sum())
        return Placement(num_mb=num_mb, seconds=seconds, padded=padded, num_groups=num_groups,
                         item_level=item_level, item_group=item_group,
                         g_level=g_level[:num_groups], g_block=g_block[:num_groups])

    def first_fit(self, num_mb: int) -> Placement | None:
        """Balance mode at the bound, else pack mode (a tight M may only pack that way)."""
        target = self.bound(num_mb)
        return self.run(num_mb, target, BALANCE) or self.run(num_mb, target, PACK)

    def gap(self, best: Placement) -> float:
        return best.seconds / max(self.bound(best.num_mb), 1e-300) - 1.0


def min_microbatches(tables: ItemTables, params: PackingParams) -> int:
    """ceil(padded tokens at the smallest sizes / (N C)), at least 1, rounded to the multiple."""
    n = len(tables.order)
    need = int(tables.padded[np.arange(n), tables.min_level].sum())
    m = max(1, -(-need // (params.pool_size * params.capacity)))
    mult = params.microbatch_multiple
    return -(-m // mult) * mult


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

    Tries M + multiple x (1, 2, 4, ...) (``_EXTRA_MICROBATCHES`` of them; geometric, so a step of
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

    for j in range(_EXTRA_MICROBATCHES[p.effort]):
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
    best = _more_microbatches(problem, best, do_refine=True)
    if p.cpsat_seconds > 0 and p.cpsat_items > 0 and problem.gap(best) > p.refine_gap:
        # One CP-SAT call per step, at the chosen M: the solver budget per step is bounded.
        from planner.cpsat import refine_heavy

        cand = refine_heavy(problem, best)
        if cand is not None and cand.better_than(best):
            best = cand
    return best


def make_problem(tokens: NDArray[np.int64], params: PackingParams) -> StepProblem:
    """Tables and bound of one step's segments."""
    t = item_tables(tokens, params.sizes, params.multiples, params.capacity, params.cost)
    core = malleable_bound(t.lone, t.work, t.fits, params.pool_size) if len(tokens) else 0.0
    return StepProblem(tables=t, params=params, core_bound=float(core), spent=[0.0])


def assign_step(sample_index: NDArray[np.int64], token_offset: NDArray[np.int64],
                num_tokens: NDArray[np.int64], params: PackingParams) -> StepAssignment:
    """Place one step's segments (each fits some allowed group) into groups and microbatches."""
    tokens = np.asarray(num_tokens, np.int64)
    problem = make_problem(tokens, params)
    best = solve_step(problem)
    t = problem.tables
    g_level = np.empty(len(tokens), np.int64)
    g_block = np.empty(len(tokens), np.int64)
    g_level[:best.num_groups] = best.g_level
    g_block[:best.num_groups] = best.g_block
    item_group = best.item_group.copy()
    num_groups = spread(t.padded, t.order, best.item_level, item_group, g_level, g_block,
                        best.num_groups, params.sizes, params.capacity, params.pool_size,
                        best.num_mb)
    mb, start, k, sample, offset, ntok, padded = emit_rows(
        np.asarray(sample_index, np.int64), np.asarray(token_offset, np.int64), tokens,
        t.padded, t.order, best.item_level, item_group, g_level, g_block, num_groups,
        params.sizes, params.pool_size, best.num_mb, int(params.multiples[0]))
    bound = problem.bound(min_microbatches(t, params))
    return StepAssignment(num_microbatches=best.num_mb, predicted_seconds=best.seconds,
                          bound_seconds=bound, microbatch=mb, rank_start=start, cp_size=k,
                          sample_index=sample, token_offset=offset, num_tokens=ntok,
                          padded_tokens=padded)
