"""A step's loss from the last stage's per-microbatch reports (``PlanJob.step_loss``).

``loss.loss_func`` reports, per microbatch, ``"lm loss"`` = [loss sum, loss tokens] and, with
multi-token prediction, ``"mtp loss"`` = [sum_1, count_1, ..., sum_D, count_D].
``reduce_reports`` sums them over the step's microbatches and the pool and broadcasts the
totals along the pipeline, so every rank logs the same step line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class StepLoss:
    """A step's loss: the per-token mean over the pool and the loss tokens it averaged; for a
    MoE model also the load-balancing term and each layer's tokens per expert; with
    multi-token prediction each depth's loss."""

    loss: float
    loss_tokens: int
    moe_aux_loss: float | None = None
    """The step's load-balancing term (already weighted by its coefficient: what the gradient
    adds to the LM loss's); None without a MoE load-balancing loss."""
    moe_tokens_per_expert: list[list[int]] | None = None
    """Per MoE layer (global layer order), the step's real tokens routed to each expert."""
    mtp_loss: list[float] | None = None
    """Multi-token prediction: each depth's per-token loss over the step (unweighted)."""


def reduce_reports(reports: list[dict[str, torch.Tensor]], *, mtp_depth: int, device: torch.device,
           pool_group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None
           ) -> tuple[float, float, list[float] | None]:
    """(loss sum, loss tokens, each depth's per-token MTP loss or None) of the step on every
    rank (collective over the pool, then along the pipeline when ``pp_group`` is given)."""
    total = torch.zeros(2 + 2 * mtp_depth, dtype=torch.float64, device=device)
    for r in reports:
        total[:2] += r["lm loss"].to(device)
        if mtp_depth and "mtp loss" in r:
            total[2:] += r["mtp loss"].to(device)
    if pool_group is not None:
        dist.all_reduce(total, group=pool_group)
    if pp_group is not None:
        src = dist.get_global_rank(pp_group, pp_group.size() - 1)
        dist.broadcast(total, src=src, group=pp_group)
    loss_sum, count, *per_depth = total.tolist()
    mtp_loss = [s / max(c, 1.0) for s, c in zip(per_depth[::2], per_depth[1::2], strict=True)]
    return loss_sum, count, mtp_loss or None
