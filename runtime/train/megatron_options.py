"""Megatron-core's data-parallel and optimizer settings of a run (``TrainConfig.megatron``).

Plain data, no Megatron import: every engine's config carries them, and the engines other than
``--framework megatron`` refuse any that is not the default (``dcp-train`` says so at parse
time).
"""

from __future__ import annotations

from dataclasses import dataclass

GRAD_SYNCS = ("megatron-ddp", "pool")
"""``--grad-sync`` under ``--framework megatron``: Megatron's ``DistributedDataParallel``, or the
adapter's plain all-reduce per gradient (``PoolGradSync``: the baseline it is benchmarked
against)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronOptions:
    """Megatron-core's data-parallel and optimizer settings (its flag names); only
    ``--framework megatron`` reads them, the other engines refuse any that is not the default."""

    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: optimizer state and fp32 master weights sharded over
    the pool, gradients reduce-scattered, parameters all-gathered after the step."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during the backward of the step's last microbatch."""
    overlap_param_gather: bool = False
    """All-gather parameter buckets during the next forward (distributed optimizer only)."""
    ddp_bucket_size: int | None = None
    """Elements per gradient bucket (None: Megatron's default, max(4e7, 1e6 x pool))."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value (0: off; Megatron-LM's default is 1.0)."""
    grad_sync: str = "megatron-ddp"
    """``megatron-ddp`` (Megatron's DistributedDataParallel) or ``pool`` (PoolGradSync)."""

    def __post_init__(self) -> None:
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNCS)}, got "
                             f"{self.grad_sync!r}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        if self.grad_sync == "pool" and (self.use_distributed_optimizer
                                         or self.overlap_grad_reduce):
            raise ValueError("--grad-sync pool has no distributed optimizer and no overlap: "
                             "drop --use-distributed-optimizer / --overlap-grad-reduce")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1, got {self.ddp_bucket_size}")
        if not self.clip_grad >= 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")

    def changed(self) -> list[str]:
        """The fields that differ from the defaults (what another engine must refuse)."""
        default = MegatronOptions()
        return [f for f in self.__slots__ if getattr(self, f) != getattr(default, f)]
