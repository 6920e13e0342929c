"""``PlanJob.forward_step``: one plan microbatch through one Megatron model chunk.

Around the model's forward it binds what the microbatch carries: its CP group into every
attention layer (``binding.bind_cp_group``, RoPE included) and, for a MoE model, its CP and
TP x CP groups into every router (the same call) and its rows for the load-balancing terms
(``moe_step.RouterSteps.bind``), for multi-token prediction the microbatch's shift map into
Megatron's MTP rolls (``mtp.bind``), the TP group the padding-mask scatter needs
(``patches.sequence_parallel_group``) and, for the ``--grad-sync pool`` baseline in bf16,
autocast. The batch's padding mask (True on real tokens) is converted to Megatron's convention
here, at the adapter's boundary (``moe.megatron_padding_mask``). The last stage returns the
per-token loss function (``loss.loss_func``, with the MTP term when the batch has ``mtp``);
``counting`` (``global_aux_loss``'s statistics pass) returns one that learns nothing.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runtime.adapters.megatron import moe, mtp, patches
from runtime.adapters.megatron.binding import bind_cp_group
from runtime.adapters.megatron.loss import loss_func
from runtime.adapters.megatron.moe_step import no_loss

if TYPE_CHECKING:
    from runtime.adapters.megatron.batch import Batch
    from runtime.adapters.megatron.job import PlanJob


def forward_step(job: PlanJob, batch: Batch, model: nn.Module, *, counting: bool = False
                 ) -> tuple[Any, Any]:
    """Run ``batch`` through ``model`` (see the module docstring): (output, loss function or
    None on a stage that sends its output on)."""
    psp = batch["packed_seq_params"]
    routers: Any = contextlib.nullcontext()
    tp_cp = None
    if job.routers is not None:
        routers = job.routers.bind(batch, counting=counting)
        tp_cp = job.routers.tp_cp_group(batch)
    targets = batch.get("mtp")
    rolls = None if targets is None else mtp.MTPContext(successor=targets.successor,
                                                          group=psp.cp_group)
    with bind_cp_group(model, psp.cp_group, tp_cp), routers, mtp.bind(rolls), \
            patches.sequence_parallel_group(job.pg_collection.tp), _autocast(job):
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       packed_seq_params=psp, runtime_gather_output=True,
                       padding_mask=moe.megatron_padding_mask(batch["padding_mask"]))
    if batch["labels"] is None:  # not the last stage: the schedule sends output on
        return output, None
    if counting:
        return output, no_loss
    if targets is None:
        return output, functools.partial(loss_func, batch["labels"], batch["loss_mask"])
    scale = job.config.mtp_loss_scaling_factor / targets.labels.shape[0]
    return output, functools.partial(loss_func, batch["labels"], batch["loss_mask"],
                                     mtp=targets, mtp_scale=scale)


def _autocast(job: PlanJob) -> Any:
    dtype = job.parallel.dtype
    if dtype == torch.float32 or (job.config is not None and job.config.bf16):
        return contextlib.nullcontext()
    return torch.autocast(job.device.type, dtype=dtype)  # PoolGradSync's bf16
