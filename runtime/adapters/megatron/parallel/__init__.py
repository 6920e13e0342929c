"""Megatron's own data-parallel stack set up over a plan's pool: ``ddp`` (Megatron's
``DistributedDataParallel``, or the ``PoolGradSync`` baseline; the schedules' hooks; where the
gradients live), ``optim`` (``get_megatron_optimizer`` and its scheduler; the oracle's AdamW
groups), ``checkpoint`` (``dist_checkpointing`` in atomic, verified step directories).
"""

__all__: list[str] = []
