"""dcp-planner runtime: replays a plan on every rank; never re-plans.

The flow is the package layout: ``data`` (plan + tokens -> this rank's microbatches), ``dist``
(topology and process groups), ``attention`` (CP attention over a microbatch's group),
``train`` (the small GPT's loop, its oracle, ``dcp-train``), ``calibrate`` (``dcp-calibrate``)
and ``adapters`` (Megatron-core, torchtitan). It reads plans and datasets through
``planner.planfile`` and ``planner.sources`` (numpy and pyarrow only, never OR-Tools);
Transformer Engine is imported by ``runtime.attention.te`` alone, lazily.

The names a custom loop needs are exported here (lazily: ``import runtime`` stays cheap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy import lazy_exports

_EXPORTS = {
    "GroupCatalog": "runtime.dist.groups",
    "Microbatch": "runtime.data.replay",
    "MicrobatchInputs": "runtime.data.batch",
    "PlanReader": "runtime.data.plan_reader",
    "Replayer": "runtime.data.replay",
    "Topology": "runtime.dist.topology",
    "contiguous_indices": "runtime.data.shard",
    "cu_seqlens": "runtime.data.shard",
    "shard_indices": "runtime.data.shard",
    "zigzag_indices": "runtime.data.shard",
    "open_token_source": "runtime.data.tokens",
}

__all__ = ["GroupCatalog", "Microbatch", "MicrobatchInputs", "PlanReader", "Replayer",
           "Topology", "contiguous_indices", "cu_seqlens", "open_token_source", "shard_indices",
           "zigzag_indices"]

if TYPE_CHECKING:
    from runtime.data.batch import MicrobatchInputs
    from runtime.data.plan_reader import PlanReader
    from runtime.data.replay import Microbatch, Replayer
    from runtime.data.shard import contiguous_indices, cu_seqlens, shard_indices, zigzag_indices
    from runtime.data.tokens import open_token_source
    from runtime.dist.groups import GroupCatalog
    from runtime.dist.topology import Topology


__getattr__ = lazy_exports(__name__, _EXPORTS)
