"""Memory before the first step, for Megatron-LM's loop: ``dcp-train``'s check
(``runtime.train.memcheck``) of the plan's heaviest microbatch against the device, with the
model's shape read from Megatron-LM's arguments.

The attention is what the launcher runs: Transformer Engine's fused kernel on a GPU, the
reference packed attention (L x L scores) on a host without CUDA. The distributed optimizer's
moments are split over the data-parallel ranks; MoE is counted at its experts' width (the
dense part, as ``dcp-train``). Tensor or pipeline parallelism is not modelled by
``planner.memory``: a notice (rank 0) instead of a check. ``--no-memory-check`` skips it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from runtime.data.plan_reader import PlanReader
from runtime.train.memcheck import check_memory
from runtime.train.model import GPTConfig

REMEDY = ("plan with a smaller --max-tokens-per-rank (and --long-sequences split), use "
          "--transformer-impl transformer_engine on a GPU (fused attention), or give the "
          "launcher --no-memory-check")


def model_shape(args: Any) -> GPTConfig:
    """The GPT shape of Megatron-LM's arguments, as ``planner.memory`` estimates it."""
    heads = int(args.num_attention_heads)
    groups = int(args.num_query_groups) if args.group_query_attention else heads
    ffn = int(getattr(args, "moe_ffn_hidden_size", None) or 0) if args.num_experts else 0
    return GPTConfig(vocab_size=int(args.padded_vocab_size), num_layers=int(args.num_layers),
                     hidden_size=int(args.hidden_size), num_heads=heads, num_query_groups=groups,
                     ffn_hidden_size=ffn or int(args.ffn_hidden_size),
                     tie_embeddings=not args.untie_embeddings_and_output_weights)


def check_launch_memory(plan: str, reader: PlanReader, args: Any, device: torch.device,
                        start: int) -> None:
    """Raise ValueError naming the heaviest microbatch of iterations ``start`` to
    ``--train-iters`` when it would not fit a rank; on every rank (a collective on CPU)."""
    tp, pp = int(args.tensor_model_parallel_size), int(args.pipeline_model_parallel_size)
    if tp > 1 or pp > 1:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dcp launcher: memory check skipped: planner/memory.py does not model tensor "
                  f"or pipeline parallelism (tp {tp}, pp {pp}); --no-memory-check silences "
                  "this", file=sys.stderr, flush=True)
        return
    attention = "reference" if device.type == "cpu" else "te"
    shards = dist.get_world_size() if args.use_distributed_optimizer else 1
    check_memory(plan, reader, model_shape(args), attention, device,
                 range(start, min(int(args.train_iters), reader.num_steps)),
                 optimizer_shards=shards, remedy=REMEDY)
