"""dcp-planner: offline dynamic context-parallel planning. Never imports torch.

Public API: ``make_plan`` (lengths + config -> Plan), ``write_plan`` / ``read_plan`` (files),
``validate`` (every invariant of the plan format), ``read_lengths`` (datasets), and the frozen
configs ``ParallelConfig`` / ``PlannerConfig``.
"""

from __future__ import annotations

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import CostModel, load_cost_model
from planner.io import PlanFile, write_plan
from planner.lengths import LengthTable, read_lengths
from planner.notebook import PlanView, read_plan
from planner.plan import Plan, make_plan
from planner.schema import FORMAT_VERSION, PlanHeader, validate

__all__ = [
    "FORMAT_VERSION",
    "CostModel",
    "LengthTable",
    "ParallelConfig",
    "Plan",
    "PlanFile",
    "PlanHeader",
    "PlanView",
    "PlannerConfig",
    "load_cost_model",
    "make_plan",
    "read_lengths",
    "read_plan",
    "validate",
    "write_plan",
]
