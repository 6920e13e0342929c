"""dcp-planner runtime: replays a plan on every rank; never re-plans.

It reads the plan and the dataset through ``planner.schema`` / ``planner.io`` /
``planner.lengths`` (numpy and pyarrow only, never OR-Tools); Transformer Engine is imported by
``runtime.te_adapter`` alone, lazily.
"""

from __future__ import annotations

from runtime.shard import contiguous_indices, cu_seqlens, shard_indices, zigzag_indices

__all__ = ["contiguous_indices", "cu_seqlens", "shard_indices", "zigzag_indices"]
