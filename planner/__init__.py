"""dcp-planner: offline dynamic context-parallel planning. Never imports torch."""

from __future__ import annotations

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import CostModel, load_cost_model
from planner.io import PlanFile, write_plan
from planner.schema import FORMAT_VERSION, PlanHeader, validate

__all__ = [
    "FORMAT_VERSION",
    "CostModel",
    "ParallelConfig",
    "PlanFile",
    "PlanHeader",
    "PlannerConfig",
    "load_cost_model",
    "validate",
    "write_plan",
]
