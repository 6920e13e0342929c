"""A plan replayed inside Megatron-core (megatron-core 0.16.1 through 0.19.x): one room.

The public API is ``PlanJob`` (``job.py``): a plan bound to this rank of a Megatron job. It
gives Megatron's ``TransformerConfig`` with the plan's fields, the layer spec, the model chunks
wrapped in Megatron's ``DistributedDataParallel`` (``get_model``), Megatron's optimizer
(``get_optimizer``), and per step the ``data_iterator``, ``num_microbatches``, the
``forward_step`` that binds each microbatch's CP group and returns the per-token loss, the
step's loss over the pool, the non-finite verdict, and ``save`` / ``load`` through Megatron's
``dist_checkpointing``. ``MegatronTrainer`` (``dcp-train --framework megatron``) is built from
it; docs/megatron.md's "Your own Megatron job" is a complete job.

Lower-level pieces stay importable from their modules for callers who assemble their own
(``batch.PlanBatches``, ``binding.bind_cp_group``, ``loss.loss_func``, ``groups.create_groups``
/ ``groups_from_parallel_state``, ``patches.apply_patches``). Every Megatron import goes
through ``mcore``; workarounds live in ``patches``, one function each. Importing this package
imports Megatron-core (a few seconds).
"""

from __future__ import annotations

from runtime.adapters.megatron.groups import MegatronGroups, groups_from_parallel_state
from runtime.adapters.megatron.job import PlanJob
from runtime.adapters.megatron.launch import launch
from runtime.adapters.megatron.oracle import train_reference
from runtime.adapters.megatron.step_loss import StepLoss
from runtime.adapters.megatron.train import MegatronTrainer

__all__ = [
    "MegatronGroups",
    "MegatronTrainer",
    "PlanJob",
    "StepLoss",
    "groups_from_parallel_state",
    "launch",
    "train_reference",
]
