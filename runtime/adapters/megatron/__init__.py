"""A plan replayed inside Megatron-core (megatron-core 0.16.1 through 0.19.x): one room.

The public API is ``PlanJob`` (``job.py``): a plan bound to this rank of a Megatron job. It
gives Megatron's ``TransformerConfig`` with the plan's fields, the layer spec, the model chunks
wrapped in Megatron's ``DistributedDataParallel`` (``get_model``), Megatron's optimizer
(``get_optimizer``), and per step the ``data_iterator``, ``num_microbatches``, the
``forward_step`` that binds each microbatch's CP group and returns the per-token loss, the
step's loss over the pool, the non-finite verdict, and ``save`` / ``load`` through Megatron's
``dist_checkpointing``. ``MegatronTrainer`` (``dcp-train --framework megatron``) is built from
it; docs/megatron.md's "Your own Megatron job" is a complete job.

The sub-packages are layers, each importing only from those before it:

- ``compat``: Megatron releases (``mcore``, the only ``megatron`` import) and the upstream
  workarounds, one function each;
- ``binding``: the plan per microbatch inside Megatron's modules (groups, batches, the CP-group
  binding, the router and MTP hooks, the forward step and the loss): what any loop needs;
- ``model``: the model ``dcp-train`` builds (spec, core attention, initial weights) and the
  oracle's terms;
- ``parallel``: Megatron's DDP, optimizer and ``dist_checkpointing`` over the plan's pool;
- ``job.py``: ``PlanJob``, for one's own loop;
- ``trainer``: ``dcp-train --framework megatron`` (loop, evaluation, oracle, entry).

Lower-level pieces stay importable from their modules for callers who assemble their own
(``binding.batch.PlanBatches``, ``binding.cp_group.bind_cp_group``, ``binding.forward``,
``binding.groups.create_groups`` / ``groups_from_parallel_state``, ``binding.install``).
Importing this package imports Megatron-core (a few seconds).
"""

from __future__ import annotations

from runtime.adapters.megatron.binding.groups import MegatronGroups, groups_from_parallel_state
from runtime.adapters.megatron.binding.step_loss import StepLoss
from runtime.adapters.megatron.job import PlanJob
from runtime.adapters.megatron.trainer.launch import launch
from runtime.adapters.megatron.trainer.oracle import train_reference
from runtime.adapters.megatron.trainer.train import MegatronTrainer

__all__ = [
    "MegatronGroups",
    "MegatronTrainer",
    "PlanJob",
    "StepLoss",
    "groups_from_parallel_state",
    "launch",
    "train_reference",
]
