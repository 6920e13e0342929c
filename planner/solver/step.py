"""A step's problem for the solver: parameters, per-segment tables and bound, kernel passes.

``PackingParams`` holds what the solver needs from the config and the cost model, including the
effort's search settings (which targets, how many extra microbatch counts, the CP-SAT budget)
and a per-step budget of kernel work, so that refinement stays bounded on huge steps.
``StepProblem`` is one step: its segments' tables (items.py), the same rows in placement order
for the kernel (``InOrder``), its malleable bound (bounds.py) and ``run``, one pass of the
placement kernel (place.py) returning a ``Placement``. The search
over passes lives in greedy.py; CP-SAT in cpsat.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.cost import CostModel
from planner.groups import pad_multiple
from planner.solver.bounds import full_pool_bound, malleable_bound
from planner.solver.items import ItemTables, RunTables
from planner.solver.place import (
    BALANCE,
    LEVEL_TREE_MIN,
    PACK,
    UNIT_TREE_MIN,
    place,
    work_to_come,
)

SOLVER_NAME = "greedy-lpt"
SOLVER_VERSION = 4

# Targets tried by refinement, as the bound times (1 + delta); max adds plain LPT (T = inf).
DELTAS = {"balanced": (0.01, 0.03, 0.06, 0.1, 0.16, 0.25),
          "max": (0.005, 0.01, 0.02, 0.03, 0.045, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.25, 0.35,
                  0.5, np.inf)}
# Larger microbatch counts tried: M + multiple x 2^j for j below this. Whether that search is
# repeated with refinement (more targets at every M tried) is REFINE_EXTRA_MICROBATCHES.
# Balanced went from 4 to 2 and stopped repeating the search refined (issue 14): on the 1M
# Wikipedia lengths at pools 16-1024 that cut its kernel work 1.02-2.5x for at most +0.034% of
# simulated time (N = 32, 64), none at N = 256 and -0.06% at 1024 (a different M won); on
# bench/quality.py's workloads (pools 8-64) every T/LB stayed equal to 3 decimals but one
# (1.029 -> 1.030).
EXTRA_MICROBATCHES = {"fast": 2, "balanced": 2, "max": 6}
REFINE_EXTRA_MICROBATCHES = {"fast": False, "balanced": False, "max": True}
CPSAT_SECONDS = {"fast": 0.0, "balanced": 0.05, "max": 0.5}
CPSAT_ITEMS = {"fast": 0, "balanced": 8, "max": 16}
# Balanced calls CP-SAT only on pools of at most this many smallest-size blocks (the model's
# units): on the Wikipedia lengths its calls cost 0.13 s (N = 64) to 0.2 s (N = 256) each,
# 44-60% of the whole run, and bought 0.005% of simulated time at N = 64 and nothing at 256
# or 1024, while at pools 8-32 they buy 0.1-0.2% on average per call (up to 1.2%). The
# effort's own default only: an explicit SolverConfig.cpsat_seconds applies at any pool.
CPSAT_MAX_UNITS = {"fast": 0, "balanced": 32, "max": 1 << 30}
# Optional kernel passes per step stop once segments x blocks summed over passes exceed this
# (about 0.1 s (balanced) and 0.4 s (max) of kernel time on this 2-core machine): a
# deterministic cap for huge steps (N = 64 and 20,000 segments reach it).
PASS_BUDGET = {"fast": 0, "balanced": 1.5e8, "max": 6e8}
# CP-SAT only models the heaviest segments, so it runs only when they hold at least this share
# of the step's work: below it, 28 calls on the quality workloads gained 0.011% on average
# (0.07% at best) while each cost 0.1-2 s; above 0.5, 0.12% on average and up to 2.2%.
HEAVY_SHARE = 0.25
# A step is not tried at a single microbatch when its tokens fill more than this of N x C, on
# pools of at least SINGLE_MICROBATCH_MIN_POOL ranks: there such attempts were never chosen and
# cost 2 of 3 kernel passes per step (N = 1024). On small pools an attempt is cheap and can win
# exactly: Megatron's own case, twelve 1024-token rows on 6 ranks of C = 2048 (fill 1.0), fits
# in one microbatch, which Megatron's 2N padding rule turns into two.
SINGLE_MICROBATCH_FILL = 0.95
SINGLE_MICROBATCH_MIN_POOL = 64


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
    """fast, balanced or max (greedy.py's module docstring says what each does)."""
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
    static_cp: int = 0
    """Static CP size scored as a candidate per step (candidates.py); 0: none."""
    megatron: bool = False
    """Whether Megatron's greedy is scored as a candidate per step (not with VPP)."""
    tp_eff: int = 1
    """tp' (padding of the static candidate)."""
    layout: str = "zigzag"
    """Layout (padding of the static candidate)."""

    @classmethod
    def from_config(cls, config: PlannerConfig, cost: CostModel) -> PackingParams:
        p = config.parallel
        s = config.solver
        sizes = np.asarray(config.sizes, dtype=np.int64)
        mults = np.array([pad_multiple(int(k), p.tp_eff, config.layout, config.pad_to_multiple)
                          for k in sizes], np.int64)
        off = baselines_not_scored(config)
        cpsat = s.cpsat_seconds
        if cpsat < 0:
            units = p.pool_size // int(sizes[0])
            cpsat = CPSAT_SECONDS[config.effort] if units <= CPSAT_MAX_UNITS[config.effort] else 0.0
        return cls(pool_size=p.pool_size, capacity=config.capacity_tokens_per_rank, sizes=sizes,
                   multiples=mults, cost=cost.as_array(),
                   microbatch_multiple=p.microbatch_multiple, effort=config.effort,
                   microbatch_tolerance=s.microbatch_tolerance, refine_gap=s.refine_gap,
                   cpsat_seconds=cpsat, cpsat_items=CPSAT_ITEMS[config.effort], seed=s.seed,
                   deltas=DELTAS.get(config.effort, ()),
                   static_cp=0 if "static-cp" in off else p.cp,
                   megatron="megatron-greedy" not in off, tp_eff=p.tp_eff,
                   layout=config.layout)

    def header(self) -> dict[str, Any]:
        """The solver settings for the plan header (everything that can change a plan)."""
        return {"name": SOLVER_NAME, "version": SOLVER_VERSION, "effort": self.effort,
                "microbatch_tolerance": self.microbatch_tolerance,
                "refine_gap": self.refine_gap,
                "extra_microbatches": EXTRA_MICROBATCHES[self.effort],
                "refine_extra_microbatches": REFINE_EXTRA_MICROBATCHES[self.effort],
                "single_microbatch_fill": SINGLE_MICROBATCH_FILL,
                "single_microbatch_min_pool": SINGLE_MICROBATCH_MIN_POOL,
                "targets": [d if np.isfinite(d) else "inf" for d in self.deltas],
                "cpsat": {"max_deterministic_time": self.cpsat_seconds,
                          "heavy_items": self.cpsat_items, "random_seed": self.seed,
                          "num_workers": 1, "ortools": _ortools_version(),
                          "min_heavy_share": HEAVY_SHARE}
                if self.cpsat_seconds > 0 else None,
                "candidates": self.candidates()}

    def candidates(self) -> list[str]:
        """Names of the per-step candidates besides our search (candidates.py)."""
        return ([f"static-cp-{self.static_cp}"] if self.static_cp else []) + (
            ["megatron-greedy"] if self.megatron else [])


def baselines_not_scored(config: PlannerConfig) -> dict[str, str]:
    """Why a baseline candidate (candidates.py) is not scored for ``config``: name -> reason,
    as a user reads it (the summary prints it in place of a gain); absent names are scored."""
    p = config.parallel
    if not config.solver.baselines:
        reason = "baselines turned off (SolverConfig.baselines=False)"
        return {"static-cp": reason, "megatron-greedy": reason}
    if config.pad_to_multiple > 1:
        # Their rows pad by their own rules, which an extra padding multiple would break.
        reason = (f"--pad-to-multiple {config.pad_to_multiple}: the baselines pad by their own "
                  "rules, so they are not scored")
        return {"static-cp": reason, "megatron-greedy": reason}
    out = {}
    if p.cp not in config.sizes:
        out["static-cp"] = (f"static CP {p.cp} (--cp) is not an allowed group size "
                            f"{list(config.sizes)}")
    if p.microbatch_multiple > 1:
        out["megatron-greedy"] = "Megatron's greedy does not model VPP (--vpp > 1)"
    return out


def _ortools_version() -> str:
    """The installed OR-Tools version (CP-SAT answers may differ between versions)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ortools")
    except PackageNotFoundError:
        return "missing"


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
class InOrder:
    """What the kernel reads besides the run's tables: each segment's table row in placement
    order, and the work to come summed in step order (the kernel's scores need those bits)."""

    rows: NDArray[np.int64]
    to_come: float

    @classmethod
    def of(cls, t: ItemTables, sizes: NDArray[np.int64]) -> InOrder:
        return cls(rows=t.row[t.order],
                   to_come=float(work_to_come(t.run.time, t.run.min_level, sizes, t.row)))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepProblem:
    """A step's segments, their tables and bound, and the solver parameters."""

    tables: ItemTables
    in_order: InOrder
    params: PackingParams
    core_bound: float
    """bounds.malleable_bound: the step's bound without microbatch fixed costs (the target)."""
    tight_core: float = 0.0
    """max(core_bound, bounds.full_pool_bound): the reported bound, without fixed costs. Not
    the kernel's target: a target change would change plans this bound only describes."""
    spent: list[float]
    """Segments x blocks of the kernel passes run so far (one mutable cell)."""

    def fill(self, num_mb: int) -> float:
        """Padded tokens (each segment at its smallest size) over N x C x ``num_mb``."""
        need = self.tables.padded_total()
        return need / (self.params.pool_size * self.params.capacity * num_mb)

    def heavy_share(self) -> float:
        """Share of the step's work (each segment at its cheapest size) in its heaviest
        ``cpsat_items`` segments: what CP-SAT's model can move."""
        t = self.tables
        work = t.run.work[t.row, t.cheapest()]
        total = float(work.sum())
        return float(work[t.order[:self.params.cpsat_items]].sum()) / total if total > 0 else 0.0

    def exhausted(self) -> bool:
        """Whether optional passes (refinement, extra microbatches) are out of budget."""
        return self.spent[0] > PASS_BUDGET[self.params.effort]

    @property
    def fixed_per_microbatch(self) -> float:
        """What each microbatch costs every rank at least (a k0 group's fixed time)."""
        c = self.params.cost
        return float(c[4] + (self.params.sizes[0] - 1) * c[2])

    def bound(self, num_mb: int) -> float:
        """The step's malleable lower bound with ``num_mb`` microbatches."""
        return self.core_bound + num_mb * self.fixed_per_microbatch

    def tight_bound(self, num_mb: int) -> float:
        """The reported lower bound with ``num_mb`` microbatches (``tight_core`` + fixed)."""
        return max(self.core_bound, self.tight_core) + num_mb * self.fixed_per_microbatch

    def run(self, num_mb: int, target: float, mode: int = BALANCE,
            forced: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None
            ) -> Placement | None:
        """One kernel pass; None when some segment fits nowhere with ``num_mb`` microbatches."""
        t = self.tables
        q = self.in_order
        r = t.run
        n = len(t.order)
        p = self.params
        if forced is None:
            forced_level = forced_block = np.full(n, -1, np.int64)
        else:
            forced_level, forced_block = forced[0][t.order], forced[1][t.order]
        placed_level = np.empty(n, np.int64)
        placed_group = np.empty(n, np.int64)
        g_level = np.empty(n, np.int64)
        g_block = np.empty(n, np.int64)
        self.spent[0] += n * (2 * p.pool_size // int(p.sizes[0]))
        num_groups, seconds = place(r.padded, r.fits, r.time, r.min_level, q.rows, p.sizes,
                                    p.capacity, p.pool_size, p.cost, num_mb, target, mode,
                                    q.to_come, forced_level, forced_block,
                                    UNIT_TREE_MIN, LEVEL_TREE_MIN, placed_level,
                                    placed_group, g_level, g_block)
        if num_groups < 0:
            return None
        item_level = np.empty(n, np.int64)
        item_group = np.empty(n, np.int64)
        item_level[t.order] = placed_level
        item_group[t.order] = placed_group
        padded = t.padded_total(item_level)
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
    need = tables.padded_total()
    m = max(1, -(-need // (params.pool_size * params.capacity)))
    mult = params.microbatch_multiple
    return -(-m // mult) * mult


def run_tables(tokens: NDArray[np.int64], params: PackingParams) -> RunTables:
    """The tables of every distinct length in ``tokens`` (a run's, or a worker's step range's:
    built once and shared by their steps)."""
    return RunTables.of(tokens, params.sizes, params.multiples, params.capacity, params.cost)


def make_problem(tokens: NDArray[np.int64], params: PackingParams,
                 run: RunTables | None = None) -> StepProblem:
    """Tables and bound of one step's segments; ``run`` must hold every length of ``tokens``
    (``run_tables``; built from ``tokens`` alone when None)."""
    tokens = np.asarray(tokens, np.int64)
    t = (run_tables(tokens, params) if run is None else run).step(tokens)
    r = t.run
    core = malleable_bound(r.lone, r.work, r.fits, t.row, params.pool_size) if len(tokens) else 0.0
    full = 0.0
    if len(tokens) and int(params.sizes[-1]) == params.pool_size:
        full = full_pool_bound(r.padded, r.time, r.work, r.fits, r.min_level, t.row,
                               params.sizes, params.capacity, params.cost)
    return StepProblem(tables=t, in_order=InOrder.of(t, params.sizes), params=params,
                       core_bound=float(core),
                       tight_core=max(float(core), float(full)), spent=[0.0])


def tight_lower_bound(tokens: NDArray[np.int64], sizes: tuple[int, ...], capacity: int,
                      tp_eff: int, layout: str, pool_size: int, cost: NDArray[np.float64],
                      num_mb: int, pad_to: int = 1) -> float:
    """A step's tight bound (``StepProblem.tight_bound``) from its segment lengths alone."""
    k = np.asarray(sizes, dtype=np.int64)
    mults = np.array([pad_multiple(int(s), tp_eff, layout, pad_to) for s in k], dtype=np.int64)
    p = PackingParams(pool_size=pool_size, capacity=capacity, sizes=k, multiples=mults,
                      cost=np.asarray(cost, np.float64), microbatch_multiple=1)
    return make_problem(np.asarray(tokens, np.int64), p).tight_bound(num_mb)
