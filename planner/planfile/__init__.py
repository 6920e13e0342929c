"""The plan file: its contract (``schema``: columns, Arrow schema, header), the one ``validate``
of every invariant, the atomic writer and the memory-mapped reader (``io``), and the header's
statistics (``stats``). docs/PLAN_FORMAT.md is the contract these modules implement.

The names load lazily (PEP 562): ``planner.config`` and ``dcp-plan --version`` import
``planner.planfile.version`` and must not pay for pyarrow and numba (issue 29).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy import lazy_exports

_EXPORTS = {
    "FORMAT_VERSION": "planner.planfile.version",
    "HEADER_KEY": "planner.planfile.version",
    "PlanFile": "planner.planfile.io",
    "PlanHeader": "planner.planfile.schema",
    "validate": "planner.planfile.validate",
    "write_plan": "planner.planfile.io",
}

__all__ = ["FORMAT_VERSION", "HEADER_KEY", "PlanFile", "PlanHeader", "validate", "write_plan"]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from planner.planfile.io import PlanFile, write_plan
    from planner.planfile.schema import PlanHeader
    from planner.planfile.validate import validate
    from planner.planfile.version import FORMAT_VERSION, HEADER_KEY


__getattr__ = lazy_exports(__name__, _EXPORTS)
