"""The optimizer of a Megatron run: Megatron's own (``get_megatron_optimizer``), or AdamW.

``megatron_optimizer`` builds Megatron's Adam from an ``OptimizerConfig`` over the DDP-wrapped
chunks: ``FP32Optimizer`` in fp32, ``Float16OptimizerWithFloat16Params`` under bf16 (fp32 main
weights and gradients inside the optimizer), ``DistributedOptimizer`` with
``--use-distributed-optimizer`` (main weights and Adam moments sharded over the pool, parameters
all-gathered after the step). Megatron's parameter groups are its standard ones: no weight
decay on biases and 1-D parameters (the norms); ``adamw_groups`` gives the oracle the same
groups. Megatron without Transformer Engine or Apex falls back to ``torch.optim.AdamW``, so the
arithmetic on the CPU is torch's.

``pool`` gradient sync (``PoolGradSync``, gradients in ``p.grad``) keeps the adapter's plain
``torch.optim.AdamW`` with the same groups: Megatron's optimizers read ``main_grad``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.adapters.megatron.compat import mcore
from runtime.train.config import TrainConfig
from runtime.train.megatron_options import MegatronOptions

OPTIMIZER_NAMES = {True: "megatron-distributed", False: "megatron"}
"""The run summary's ``optimizer`` for Megatron's optimizer, by ``use_distributed_optimizer``."""


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's standard rule: biases and 1-D parameters (norm scales) get no weight decay."""
    return param.dim() == 1 or name.endswith(".bias")


def adamw_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float
                 ) -> list[dict[str, Any]]:
    """Two AdamW parameter groups with Megatron's weight-decay rule (decayed first)."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, p in named:
        if p.requires_grad:
            (plain if no_weight_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def optimizer_config(cfg: TrainConfig, *, bf16: bool) -> Any:
    """Megatron's ``OptimizerConfig``: Adam (decoupled weight decay, AdamW), constant lr."""
    m: MegatronOptions = cfg.megatron
    return mcore.OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=m.clip_grad,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=m.use_distributed_optimizer,
        overlap_param_gather=m.overlap_param_gather)


def megatron_optimizer(cfg: TrainConfig, chunks: list[nn.Module], pg_collection: Any, *,
                       bf16: bool) -> Any:
    """Megatron's optimizer over the DDP-wrapped ``chunks`` (module docstring)."""
    return mcore.get_megatron_optimizer(optimizer_config(cfg, bf16=bf16), chunks,
                                        pg_collection=pg_collection)


def param_scheduler(cfg: TrainConfig, optimizer: Any) -> Any:
    """Megatron's ``OptimizerParamScheduler`` at a constant lr and weight decay: it is what
    applies each parameter group's ``wd_mult`` (no decay on 1-D parameters), as in every
    Megatron-LM job; ``dcp-train`` has no warmup or decay (the oracle's AdamW is constant)."""
    return mcore.OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr, max_lr=cfg.lr, min_lr=cfg.lr, lr_warmup_steps=0,
        lr_decay_steps=1, lr_decay_style="constant", start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


def adamw(cfg: TrainConfig, chunks: list[nn.Module]) -> torch.optim.Optimizer:
    """Plain AdamW with Megatron's groups (``--grad-sync pool``, and the oracle)."""
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    return torch.optim.AdamW(adamw_groups(named, cfg.weight_decay), lr=cfg.lr, foreach=False)
