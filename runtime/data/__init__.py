"""Plan and tokens in, this rank's microbatches out.

``plan_reader`` (memory-mapped plan, job and dataset checks) and ``tokens`` (token sources:
JSONL, Parquet/Arrow, Megatron) feed ``replay.Replayer``, which builds each microbatch with
``batch`` and shards it with ``shard`` (zigzag / contiguous index math, ``cu_seqlens``).
``evaluation.EvalSchedule`` replays an eval plan as a finite pass that ends on every rank at the
same microbatch, for any training loop. ``plan_source.open_plan_source`` opens the dataset a
plan was made for as every engine must: bad records as the planner counted them, lengths and
(``dcp-plan --fingerprint content``) token content checked.
"""

from __future__ import annotations

from runtime.data.batch import MicrobatchInputs
from runtime.data.evaluation import EvalMicrobatch, EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.replay import Microbatch, Replayer
from runtime.data.tokens import TokenSource, open_token_source

__all__ = ["EvalMicrobatch", "EvalSchedule", "Microbatch", "MicrobatchInputs", "PlanReader",
           "Replayer", "TokenSource", "check_eval_layout", "open_plan_source",
           "open_token_source"]
