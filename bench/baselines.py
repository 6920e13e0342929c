"""The baselines ours is compared with, behind one import.

- ``static_cp_plan``: static CP with next-fit packing, Megatron's ``dp_balanced``
  (bench/baseline_static.py over planner/solver/static_cp.py); ``smallest_static_cp`` finds
  the best-fitting static size.
- ``megatron_plan``: Megatron's ``default_dynamic_cp`` greedy (bench/baseline_megatron.py over
  planner/solver/megatron.py).

Both schedule the global batches ``planner.plan.make_plan`` draws (bench/baseline_common.py) and
return a ``BaselineRun``: a ``planner.plan.Plan`` that passes
``planner.planfile.validate.validate`` and the
seconds the scheduler took.
"""

from __future__ import annotations

from bench.baseline_common import BaselineRun, GroupRows, draw_epochs, step_columns
from bench.baseline_megatron import SOLVER_NAME as MEGATRON_SOLVER
from bench.baseline_megatron import megatron_padded, megatron_plan, megatron_step
from bench.baseline_static import SOLVER_NAME as STATIC_SOLVER
from bench.baseline_static import (
    StaticCPInfeasible,
    smallest_static_cp,
    static_cp_plan,
    static_step,
)
from planner.solver.static_cp import next_fit, round_bins_up

__all__ = [
    "MEGATRON_SOLVER",
    "STATIC_SOLVER",
    "BaselineRun",
    "GroupRows",
    "StaticCPInfeasible",
    "draw_epochs",
    "megatron_padded",
    "megatron_plan",
    "megatron_step",
    "next_fit",
    "round_bins_up",
    "smallest_static_cp",
    "static_cp_plan",
    "static_step",
    "step_columns",
]
