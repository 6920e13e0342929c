"""The ``forward_step_func`` of a plan: one plan microbatch through one Megatron model chunk.

Around the model's forward it binds what the microbatch carries: its CP group into every
attention layer (``cp_group.bind_cp_group``, RoPE included) and, for a MoE model, its CP and
TP x CP groups into every router (the same call) and its rows for the load-balancing terms
(``routers.RouterSteps.bind``), for multi-token prediction the microbatch's shift map into
Megatron's MTP rolls (``mtp.bind``), the TP group the padding-mask scatter needs
(``patches.sequence_parallel_group``) and, for the ``--grad-sync pool`` baseline in bf16,
autocast. The batch's padding mask (True on real tokens) is converted to Megatron's convention
here, at the adapter's boundary (``moe.megatron_padding_mask``). The last stage returns the
per-token loss function (``loss.loss_func``, with the MTP term when the batch has ``mtp``);
``counting`` (``global_aux_loss``'s statistics pass) returns one that learns nothing.

What the step needs beyond the batch and the chunk is a ``ForwardOptions`` value, so that
every caller (``PlanJob``, a launcher around Megatron-LM's loop) builds it from what it owns;
nothing here knows who runs the loop.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron.binding import moe, mtp
from runtime.adapters.megatron.binding.batch import Batch
from runtime.adapters.megatron.binding.cp_group import bind_cp_group
from runtime.adapters.megatron.binding.loss import loss_func, no_loss
from runtime.adapters.megatron.binding.routers import RouterSteps
from runtime.adapters.megatron.compat import patches


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardOptions:
    """What ``forward_step`` binds besides the microbatch's own groups."""

    tp_group: dist.ProcessGroup | None
    """The model's TP group (the padding-mask scatter under sequence parallelism)."""
    routers: RouterSteps | None = None
    """A MoE model's per-step routing bookkeeping; None for a dense model."""
    mtp_loss_scaling_factor: float = 0.0
    """Megatron's ``mtp_loss_scaling_factor`` (the MTP term's weight over all depths)."""
    autocast: tuple[str, torch.dtype] | None = None
    """(device type, dtype) of autocast around the forward: the ``--grad-sync pool``
    baseline's bf16; None under fp32 or Megatron's own mixed precision."""


def forward_step(batch: Batch, model: nn.Module, options: ForwardOptions, *,
                 counting: bool = False) -> tuple[Any, Any]:
    """Run ``batch`` through ``model`` (see the module docstring): (output, loss function or
    None on a stage that sends its output on)."""
    psp = batch["packed_seq_params"]
    routers: Any = contextlib.nullcontext()
    tp_cp = None
    if options.routers is not None:
        routers = options.routers.bind(batch, counting=counting)
        tp_cp = options.routers.tp_cp_group(batch)
    targets = batch.get("mtp")
    rolls = None if targets is None else mtp.MTPContext(successor=targets.successor,
                                                          group=psp.cp_group)
    autocast: Any = (contextlib.nullcontext() if options.autocast is None
                     else torch.autocast(options.autocast[0], dtype=options.autocast[1]))
    with bind_cp_group(model, psp.cp_group, tp_cp), routers, mtp.bind(rolls), \
            patches.sequence_parallel_group(options.tp_group), autocast:
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       packed_seq_params=psp, runtime_gather_output=True,
                       padding_mask=moe.megatron_padding_mask(batch["padding_mask"]))
    if batch["labels"] is None:  # not the last stage: the schedule sends output on
        return output, None
    if counting:
        return output, no_loss
    if targets is None:
        return output, functools.partial(loss_func, batch["labels"], batch["loss_mask"])
    scale = options.mtp_loss_scaling_factor / targets.labels.shape[0]
    return output, functools.partial(loss_func, batch["labels"], batch["loss_mask"],
                                     mtp=targets, mtp_scale=scale)
