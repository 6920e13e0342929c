"""The plan file: its contract (``schema``: columns, Arrow schema, header), the one ``validate``
of every invariant, the atomic writer and the memory-mapped reader (``io``), and the header's
statistics (``stats``). docs/PLAN_FORMAT.md is the contract these modules implement.
"""

from __future__ import annotations

from planner.planfile.io import PlanFile, write_plan
from planner.planfile.schema import FORMAT_VERSION, HEADER_KEY, PlanHeader
from planner.planfile.validate import validate

__all__ = ["FORMAT_VERSION", "HEADER_KEY", "PlanFile", "PlanHeader", "validate", "write_plan"]
