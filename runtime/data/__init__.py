"""Plan and tokens in, this rank's microbatches out.

``plan_reader`` (memory-mapped plan, job and dataset checks) and ``tokens`` (token sources:
JSONL, Parquet/Arrow, Megatron) feed ``replay.Replayer``, which builds each microbatch with
``batch`` and shards it with ``shard`` (zigzag / contiguous index math, ``cu_seqlens``).
"""

from __future__ import annotations

from runtime.data.batch import MicrobatchInputs
from runtime.data.plan_reader import PlanReader
from runtime.data.replay import Microbatch, Replayer
from runtime.data.tokens import TokenSource, open_token_source

__all__ = ["Microbatch", "MicrobatchInputs", "PlanReader", "Replayer", "TokenSource",
           "open_token_source"]
