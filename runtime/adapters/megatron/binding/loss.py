"""The per-token loss in Megatron's ``calculate_per_token_loss`` contract.

With ``TransformerConfig.calculate_per_token_loss=True`` a ``forward_step_func`` returns
``(output, loss_func)`` and ``loss_func(output)`` returns ``(loss_sum, num_tokens, report)``:
the *sum* of the microbatch's token losses (what the backward starts from), the number of tokens
it counts, and ``{"lm loss": [loss_sum, num_tokens]}`` for logging. The schedule adds up
``num_tokens`` over the step's microbatches and ``finalize_model_grads`` all-reduces it over the
pool (``pg_collection.dp_cp``) and divides every gradient by it, so the gradient is that of the
mean token loss of the global batch, whatever CP sizes the step used (a group of k ranks splits
its tokens and its loss k ways alike). The older ``loss * cp_size / num_microbatches`` scaling
would be wrong here: the CP size changes per microbatch and microbatches hold unequal token
counts (``runtime.train.loss`` gives the worked example).

The logits come gathered over the TP ranks (``runtime_gather_output=True``), so the loss is a
plain cross entropy: Megatron 0.16.1's vocab-parallel cross entropy reads the TP group from the
global ``parallel_state`` and cannot run on a model built from a ``pg_collection``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime.data.mtp import MTPInputs
from runtime.train.loss import per_token_loss


def loss_func(labels: Tensor, loss_mask: Tensor, output: Tensor, *,
              mtp: MTPInputs | None = None, mtp_scale: float = 0.0
              ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Megatron's per-token loss triple for one microbatch.

    Args:
        labels: int64 ``[1, T]`` (the batch's ``labels``).
        loss_mask: ``[1, T]``, 1 where the token's loss counts.
        output: the model's logits ``[1, T, V]`` (all of the vocabulary); with multi-token
            prediction ``[1, (1 + D) T, V]``: the LM's, then each MTP depth's (``mtp.py``).
        mtp: the microbatch's MTP targets (``runtime.data.mtp``); None: the LM loss only (an
            evaluation), whatever the output holds.
        mtp_scale: ``mtp_loss_scaling_factor / D``, the weight of each depth's loss sum.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``: a float32 0-d tensor
        carrying the gradient, an int32 0-d count (the schedules sum counts in int32) and a
        float64 pair for logging. With ``mtp`` the loss sum adds ``mtp_scale`` times each
        depth's masked loss sum (divided by the step's LM tokens with the rest) and the report
        adds ``"mtp loss"``: [sum_1, count_1, ..., sum_D, count_D] (unweighted).
    """
    logits = output.reshape(-1, output.shape[-1])
    tokens = labels.numel()
    loss_sum, count = per_token_loss(logits[:tokens], labels.reshape(-1), loss_mask.reshape(-1))
    num_tokens = count.to(torch.int)
    reports = {"lm loss": torch.stack([loss_sum.detach().double(), count.double()])}
    if mtp is not None:
        depth = mtp.labels.shape[0]
        if logits.shape[0] != (1 + depth) * tokens:
            raise AssertionError(f"{logits.shape[0]} logits rows for {tokens} tokens and "
                                 f"{depth} MTP depths")
        parts = []
        for d in range(depth):
            chunk = logits[(d + 1) * tokens:(d + 2) * tokens]
            mtp_sum, mtp_count = per_token_loss(chunk, mtp.labels[d], mtp.loss_mask[d])
            loss_sum = loss_sum + mtp_scale * mtp_sum
            parts += [mtp_sum.detach().double(), mtp_count.double()]
        reports["mtp loss"] = torch.stack(parts)
    return loss_sum, num_tokens, reports



def no_loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The statistics pass's loss function (``global_aux_loss``): nothing to learn, nothing to
    report."""
    return output.sum() * 0, torch.zeros((), dtype=torch.int, device=output.device), {}
