"""A plan replayed inside Megatron-core's standard schedules (PP, VPP, TP, SP): one room.

Every Megatron import goes through ``mcore`` (pinned to megatron-core 0.16.x, the ``megatron``
extra); workarounds for it live in ``patches``, one function each. For a caller who owns the
Megatron setup:

- ``PlanBatches``: the ``data_iterator`` for ``get_forward_backward_func()`` (per step, per model
  chunk) and the step's ``num_microbatches``, batches with ``PackedSeqParams`` (``batch``);
- ``loss_func``: the per-token loss in Megatron's ``calculate_per_token_loss`` contract;
- ``bind_cp_group``: the microbatch's CP group in every layer, RoPE included, restored after;
- ``MegatronGroups`` from ``create_groups`` or ``groups_from_parallel_state`` (the caller's
  Megatron groups): nothing reads global parallel state when groups are given;
- ``PlanCoreAttention`` / ``SequenceParallelRMSNorm``: what the CPU spec swaps in;
- ``MegatronTrainer``, ``train_reference`` and ``launch`` (``dcp-train --framework megatron``).

Importing this package imports Megatron-core (a few seconds).
"""

from __future__ import annotations

from runtime.adapters.megatron.attention import (
    PlanCoreAttention,
    SequenceCoreAttention,
    SequenceParallelRMSNorm,
)
from runtime.adapters.megatron.batch import PlanBatches, packed_seq_params, padding_mask
from runtime.adapters.megatron.binding import bind_cp_group
from runtime.adapters.megatron.groups import (
    MegatronGroups,
    create_groups,
    groups_from_parallel_state,
)
from runtime.adapters.megatron.launch import launch
from runtime.adapters.megatron.loss import loss_func
from runtime.adapters.megatron.oracle import train_reference
from runtime.adapters.megatron.patches import apply_patches
from runtime.adapters.megatron.train import MegatronTrainer

__all__ = [
    "MegatronGroups",
    "MegatronTrainer",
    "PlanBatches",
    "PlanCoreAttention",
    "SequenceCoreAttention",
    "SequenceParallelRMSNorm",
    "apply_patches",
    "bind_cp_group",
    "create_groups",
    "groups_from_parallel_state",
    "launch",
    "loss_func",
    "packed_seq_params",
    "padding_mask",
    "train_reference",
]
