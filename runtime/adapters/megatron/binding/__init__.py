"""The plan inside Megatron-core, microbatch by microbatch: what every way of running a plan
in Megatron needs (``PlanJob`` for one's own loop, ``dcp-train --framework megatron``, and a
launcher around Megatron-LM's own training loop).

- ``groups``: the plan's CP groups and Megatron's ``ProcessGroupCollection`` for them;
- ``batch``: ``PlanBatches``, a step's microbatches as Megatron's batches (``PackedSeqParams``);
- ``cp_group``: the microbatch's CP group bound into every attention layer (RoPE included) and
  router, restored after the forward;
- ``moe`` / ``mtp``: the same binding inside Megatron's router and multi-token prediction
  block (installed once by ``install``);
- ``forward``: the ``forward_step_func`` around all of it; ``loss`` / ``step_loss``: the
  per-token loss and a step's reduction; ``routers``: a MoE model's per-step statistics.

It builds no model and runs no loop (``model``, ``job`` and ``trainer`` do).
"""

__all__: list[str] = []
