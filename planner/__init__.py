"""dcp-planner: offline dynamic context-parallel planning. Never imports torch.

Public API: ``make_plan`` (lengths + config -> Plan), ``write_plan`` / ``read_plan`` (files),
``validate`` (every invariant of the plan format), ``read_lengths`` (datasets), and the frozen
configs ``ParallelConfig`` / ``PlannerConfig`` / ``SolverConfig``.

The names load lazily (PEP 562): ``import planner.planfile.schema`` on every runtime rank must
not pay for the solver's imports (numba and its kernels); only ``from planner import make_plan``
does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner import numbacache
from planner.lazy import lazy_exports

# Before any kernel module is imported: the kernels cache per user, never in the install tree
# (planner/numbacache.py). Imports no numba.
numbacache.prepare()

_EXPORTS = {
    "FORMAT_VERSION": "planner.planfile.schema",
    "PlanHeader": "planner.planfile.schema",
    "validate": "planner.planfile.validate",
    "ParallelConfig": "planner.config",
    "PlannerConfig": "planner.config",
    "SolverConfig": "planner.config",
    "CostModel": "planner.cost",
    "load_cost_model": "planner.cost",
    "PlanFile": "planner.planfile.io",
    "write_plan": "planner.planfile.io",
    "LengthTable": "planner.sources.lengths",
    "read_lengths": "planner.sources.lengths",
    "PlanView": "planner.notebook.view",
    "read_plan": "planner.notebook.view",
    "Plan": "planner.plan",
    "make_plan": "planner.plan",
}

__all__ = [
    "CostModel",
    "FORMAT_VERSION",
    "LengthTable",
    "ParallelConfig",
    "Plan",
    "PlanFile",
    "PlanHeader",
    "PlanView",
    "PlannerConfig",
    "SolverConfig",
    "load_cost_model",
    "make_plan",
    "read_lengths",
    "read_plan",
    "validate",
    "write_plan",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from planner.config import ParallelConfig, PlannerConfig, SolverConfig
    from planner.cost import CostModel, load_cost_model
    from planner.notebook.view import PlanView, read_plan
    from planner.plan import Plan, make_plan
    from planner.planfile.io import PlanFile, write_plan
    from planner.planfile.schema import FORMAT_VERSION, PlanHeader
    from planner.planfile.validate import validate
    from planner.sources.lengths import LengthTable, read_lengths


__getattr__ = lazy_exports(__name__, _EXPORTS)
