"""Ranks and process groups: ``Topology`` (rank arithmetic in Megatron's order) and
``GroupCatalog`` (every CP group of a plan, created once in catalog order, or the caller's)."""

from __future__ import annotations

from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology

__all__ = ["GroupCatalog", "Topology"]
