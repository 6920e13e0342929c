"""Solving: global batches per step, then each step's microbatches, CP groups and packing.

Flow: ``batches`` (seeded permutation -> global batches) -> ``items`` (per-segment size, time
and work tables) -> ``step``/``greedy`` (microbatch-count search over ``place``'s numba placement
kernel, ``bounds`` as the refinement trigger, ``cpsat`` as the optional refinement) -> ``emit``
(assignments -> sorted plan rows with fillers). ``parallel`` spreads step ranges (``jobs``) over
processes, or as Ray tasks through ``ray_engine``.
"""

from __future__ import annotations

from planner.solver.batches import draw_global_batches
from planner.solver.greedy import PackingParams, StepAssignment, assign_step
from planner.solver.jobs import StepJobs
from planner.solver.parallel import plan_steps

__all__ = ["PackingParams", "StepAssignment", "StepJobs", "assign_step", "draw_global_batches",
           "plan_steps"]
