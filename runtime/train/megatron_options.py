"""Megatron-core's settings of a run (``TrainConfig.megatron``): mixture-of-experts and
multi-token prediction on top of ``dcp-train``'s model shape, data parallelism and the optimizer.

Plain data, no Megatron import: every engine's config carries them, and the engines other than
``--framework megatron`` refuse any that is not the default (``dcp-train`` says so at parse
time). Field names are Megatron-LM's flags (``num_experts`` is ``--num-experts``).
"""

from __future__ import annotations

from dataclasses import dataclass

GRAD_SYNCS = ("megatron-ddp", "pool")
"""``--grad-sync`` under ``--framework megatron``: Megatron's ``DistributedDataParallel``, or the
adapter's plain all-reduce per gradient (``PoolGradSync``: the baseline it is benchmarked
against)."""

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
"""``--moe-router-load-balancing-type``: what each means under dynamic CP is in
``runtime.adapters.megatron.binding.moe`` (and docs/megatron.md)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronOptions:
    """Megatron-core's MoE, MTP, data-parallel and optimizer settings (its flag names); only
    ``--framework megatron`` reads them, the other engines refuse any that is not the default."""

    num_experts: int = 0
    """Experts per MoE layer (every layer's MLP); 0: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (dropless: every token reaches all of them)."""
    moe_ffn_hidden_size: int = 0
    """Each expert's SwiGLU width; 0: the dense ``--ffn-hidden-size``."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: none)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``aux_loss`` (per microbatch CP group), ``seq_aux_loss`` (per sequence),
    ``global_aux_loss`` (per step) or ``none``."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth: layer d predicts the token d + 1 ahead (0: none)."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight S of the MTP loss: ``S / D`` times each depth's loss sum, per LM loss token."""

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
        self._check_moe()
        if self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")
        if not self.mtp_loss_scaling_factor >= 0:
            raise ValueError("--mtp-loss-scaling-factor must be >= 0, got "
                             f"{self.mtp_loss_scaling_factor}")

    def _check_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"--num-experts must be >= 0, got {self.num_experts}")
        if self.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError("--moe-router-load-balancing-type must be one of "
                             f"{', '.join(LOAD_BALANCING_TYPES)}, got "
                             f"{self.moe_router_load_balancing_type!r}")
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_ffn_hidden_size < 0:
            raise ValueError(f"--moe-ffn-hidden-size must be >= 0, got "
                             f"{self.moe_ffn_hidden_size}")
        if not self.num_experts:
            moe = [f for f in ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
                               "moe_router_load_balancing_type")
                   if getattr(self, f) != _default(f)]
            if moe:
                raise ValueError(f"{', '.join('--' + f.replace('_', '-') for f in moe)}: "
                                 "MoE options; set --num-experts")
        elif not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk must be in 1..{self.num_experts} (the "
                             f"experts), got {self.moe_router_topk}")

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model."""
        return self.num_experts > 0

    @property
    def load_balancing(self) -> str | None:
        """The load-balancing loss in effect (None: no MoE, ``none`` or a zero coefficient)."""
        if (not self.moe or self.moe_router_load_balancing_type == "none"
                or self.moe_aux_loss_coeff == 0):
            return None
        return self.moe_router_load_balancing_type

    def model_meta(self) -> dict[str, object]:
        """The model fields a checkpoint must match (empty for a dense model without MTP)."""
        if not (self.moe or self.mtp_num_layers):
            return {}
        names = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "mtp_num_layers")
        return {n: getattr(self, n) for n in names}

    def changed(self) -> list[str]:
        """The fields that differ from the defaults (what another engine must refuse)."""
        return [f for f in self.__slots__ if getattr(self, f) != _default(f)]


def _default(name: str) -> object:
    return MegatronOptions.__dataclass_fields__[name].default
