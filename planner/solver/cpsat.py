"""CP-SAT refinement of a step's heaviest segments: the only module that imports OR-Tools.

Why a sub-problem. A per-segment x per-rank model does not solve at this scale (ENVIRONMENT.md:
no feasible solution in 20 s at 1,158 sequences x 256 ranks), while the heuristic is within a
few percent of the bound. What the heuristic gets wrong is the few heaviest segments: which
group size each takes and which aligned block it sits on, decisions that fix most of the
critical path. So the model holds only those h segments (h = 8 balanced, 16 max) and treats all
other work as a fluid that spreads evenly:

    x[i, l, b] in {0, 1}: heavy segment i runs on block b of level l (size s_l);
    g[l, b] >= 0: groups opened on that block, s_l C g[l, b] >= sum_i padded[i, l] x[i, l, b];
    sum_{l, b} x[i, l, b] = 1                                  for every heavy segment i;
    base + sum time[i, l] x + sum open(l) g over blocks covering unit u <= Z   for every unit u;
    sum of g over blocks covering unit u <= M                  (microbatches per rank);
    N Z >= N base + sum s_l (time[i, l] x + open(l) g) + light work           (fluid rest);
    minimise Z.

Times are integers in units of bound / 20000 (0.005% resolution). The heuristic's placement
of the heavy segments is the hint (add_hint) and its makespan an upper bound on Z, so the search
starts from a feasible point. The kernel then places the heavy segments where CP-SAT put them
(place.py ``forced``) and everything else with Z as the target; greedy.py keeps the result only
if it is better, so CP-SAT never makes a step worse.

Reproducibility: ``max_deterministic_time`` (not wall time), a fixed ``random_seed`` and one
search worker, so the same step gives the same answer on every machine and in every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray
from ortools.sat.python import cp_model

from planner.solver.place import BALANCE, PACK, block_layout

if TYPE_CHECKING:
    from planner.solver.step import Placement, StepProblem

RESOLUTION = 20000


def solve_heavy(problem: StepProblem, best: Placement
                ) -> tuple[NDArray[np.int64], NDArray[np.int64], float] | None:
    """(forced level, forced block, fluid makespan Z in seconds) for the heavy segments."""
    t = problem.tables
    p = problem.params
    m = best.num_mb
    n = len(t.order)
    h = min(p.cpsat_items, n)
    if h == 0:
        return None
    heavy = t.order[:h]
    sizes = p.sizes
    k0 = int(sizes[0])
    num_blocks, _ = block_layout(sizes, p.pool_size)
    units = int(num_blocks[0])
    unit = problem.bound(m) / RESOLUTION
    base = int(round(m * problem.fixed_per_microbatch / unit))
    is_heavy = np.zeros(n, dtype=np.bool_)
    is_heavy[heavy] = True
    # Each segment's table rows (items.py: one row per distinct length).
    time, fits, padded = t.run.time[t.row], t.run.fits[t.row], t.run.padded[t.row]
    min_level = t.cheapest()
    light = float(sum(time[i, min_level[i]] * sizes[min_level[i]]
                      for i in np.flatnonzero(~is_heavy)))
    light_units = int(round(light / unit))
    upper = int(np.ceil(best.seconds / unit))

    model = cp_model.CpModel()
    z = model.new_int_var(0, 2 * upper + base + 1, "z")
    cover: list[list[tuple[cp_model.IntVar, int]]] = [[] for _ in range(units)]
    count: list[list[cp_model.IntVar]] = [[] for _ in range(units)]
    total: list[tuple[cp_model.IntVar, int]] = []
    choice: dict[tuple[int, int, int], cp_model.IntVar] = {}
    members: dict[tuple[int, int], list[tuple[cp_model.IntVar, int]]] = {}
    for i in heavy.tolist():
        options: list[cp_model.IntVar] = []
        for lv in range(int(min_level[i]), len(sizes)):
            if not fits[i, lv]:
                continue
            k = int(sizes[lv])
            cost = int(round(time[i, lv] / unit))
            for b in range(int(num_blocks[lv])):
                x = model.new_bool_var(f"x{i}_{lv}_{b}")
                choice[(i, lv, b)] = x
                options.append(x)
                members.setdefault((lv, b), []).append((x, int(padded[i, lv])))
                # The segment's share of its group occupies every unit of the block.
                for u in range(b * (k // k0), (b + 1) * (k // k0)):
                    cover[u].append((x, cost))
                total.append((x, cost * k))
        # Each heavy segment runs at exactly one size on exactly one block.
        model.add_exactly_one(options)
    for (lv, b), xs in members.items():
        k = int(sizes[lv])
        # Groups opened on the block: enough to hold its heavy segments' padded tokens.
        g = model.new_int_var(0, min(len(xs), m), f"g{lv}_{b}")
        model.add(k * p.capacity * g >= cp_model.LinearExpr.weighted_sum(
            [x for x, _ in xs], [pad for _, pad in xs]))
        open_cost = int(round((k - k0) * p.cost[2] / unit))
        for u in range(b * (k // k0), (b + 1) * (k // k0)):
            count[u].append(g)
            if open_cost:
                cover[u].append((g, open_cost))
        if open_cost:
            total.append((g, open_cost * k))
    for u in range(units):
        if not cover[u]:
            continue
        # A unit's load: the microbatches' fixed cost plus the heavy groups that cover it.
        model.add(base + cp_model.LinearExpr.weighted_sum([x for x, _ in cover[u]],
                                                         [c for _, c in cover[u]]) <= z)
        # Each group takes one of the unit's M microbatches.
        model.add(cp_model.LinearExpr.sum(count[u]) <= m)
    # The rest of the work spreads as a fluid: the average load is a floor under Z.
    model.add(p.pool_size * z >= p.pool_size * base + light_units
              + cp_model.LinearExpr.weighted_sum([x for x, _ in total], [c for _, c in total]))
    model.minimize(z)
    # Warm start: the heuristic's level and block for every heavy segment.
    for (i, lv, b), x in choice.items():
        model.add_hint(x, int(lv == best.item_level[i]
                             and b == best.g_block[best.item_group[i]]))

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = p.cpsat_seconds
    solver.parameters.random_seed = p.seed
    solver.parameters.num_workers = 1
    solver.parameters.log_search_progress = False
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    level = np.full(n, -1, dtype=np.int64)
    block = np.full(n, -1, dtype=np.int64)
    for (i, lv, b), x in choice.items():
        if solver.boolean_value(x):
            level[i] = lv
            block[i] = b
    return level, block, solver.value(z) * unit


def refine_heavy(problem: StepProblem, best: Placement) -> Placement | None:
    """The best kernel placement with the heavy segments where CP-SAT puts them, or None."""
    answer = solve_heavy(problem, best)
    if answer is None:
        return None
    level, block, target = answer
    out = None
    for mode in (BALANCE, PACK):
        cand = problem.run(best.num_mb, target, mode, forced=(level, block))
        if cand is not None and cand.better_than(out):
            out = cand
    return out
