"""Looking at a plan: ``read_plan`` gives a ``PlanView`` (header, O(1) steps, per-step summary,
pandas/polars conversions) and its matplotlib plots (``plot``, imported only when drawn).
"""

from __future__ import annotations

from planner.notebook.view import PlanView, read_plan

__all__ = ["PlanView", "read_plan"]
