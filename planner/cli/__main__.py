"""``python -m planner.cli``: the same as ``dcp-plan``."""

from __future__ import annotations

from planner.cli.dispatch import entry

entry()
