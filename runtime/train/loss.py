"""Per-token loss: each rank sums its tokens' losses; the step divides by the pool's token count.

With dynamic CP a token's loss is computed on exactly one rank (the one holding its row of the
packed buffer), whatever the size of the group it ran in. So

    step loss = (sum over ranks, over microbatches of loss_sum) / (sum over ranks of num_tokens)

is the mean over every loss token of the global batch, and the group size never appears: it
cancels because a group of k ranks splits its tokens k ways and its loss k ways alike. The older
``loss * cp_size / num_microbatches`` scaling assumes one static CP size and equal token counts
per microbatch, both false here (shared DOMAIN.md).

How a training step uses this module:
1. per microbatch: ``loss_sum, num_tokens = per_token_loss(logits, labels, loss_mask)``; backward
   of ``loss_sum`` (not of a mean);
2. after the step's microbatches: ``total = global_num_tokens(sum of num_tokens, pool_group)``;
3. all-reduce the gradients with SUM over the pool (not average) and divide them by ``total``.
Tensor-parallel peers hold the same tokens, so counts are reduced over the pool of this rank's
tp/pp slice only (``GroupCatalog.pool_group``), never over the whole world.
``runtime.train.trainer``
does step 2 as one all-reduce of ``[loss_sum, num_tokens]`` (float64) so the logged loss and the
count share a collective; ``global_num_tokens`` / ``step_loss`` are the same rule for loops that
only need the count.

Example: a pool of 2, one microbatch. Rank 0 (a group of 1) has 3 loss tokens whose losses sum
to 3.0; rank 1 has 1 token of loss 5.0. Step loss = (3 + 5) / (3 + 1) = 2.0, the mean over the 4
tokens; averaging the ranks' own means would give (1.0 + 5.0) / 2 = 3.0.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def per_token_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross entropy over the masked tokens, and their number.

    Args:
        logits: [T, V] (any float dtype; the loss is computed in float32).
        labels: [T] int64 target token ids (padding rows hold 0).
        loss_mask: [T], 1 where the token's loss counts and 0 elsewhere (bool or float).

    Returns:
        (loss_sum, num_tokens): a float32 0-d tensor that carries the gradient, and an int64 0-d
        tensor with the number of counted tokens (a tensor, so no host sync is forced here; an
        integer, so pool-wide sums stay exact past float32's 2**24).

    Raises:
        ValueError: the shapes disagree.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or loss_mask.shape != labels.shape:
        raise ValueError(
            f"expected logits [T, V], labels [T], loss_mask [T]; got {tuple(logits.shape)}, "
            f"{tuple(labels.shape)}, {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.float()
    losses = F.cross_entropy(logits.float(), labels, reduction="none")
    # Masked by multiplication, not indexing: no data-dependent shape, no host sync. Padding rows
    # have label 0 and a finite loss, so 0 * loss is exactly 0.
    return (losses * mask).sum(), (loss_mask != 0).sum()


def global_num_tokens(num_tokens: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum ``num_tokens`` over the pool group; returns a new tensor (the input is untouched).

    Args:
        num_tokens: this rank's count (a 0-d or 1-element tensor on the group's device).
        group: the pool group (``GroupCatalog.pool_group``). None means a pool of one rank, where
            the local count is the global count; it does NOT mean the default (world) group,
            which would also count tensor- and pipeline-parallel peers.
    """
    total = num_tokens.detach().clone()
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def step_loss(loss_sums: Tensor, global_tokens: Tensor) -> Tensor:
    """This rank's share of the step loss: its summed loss over the pool's token count.

    Summing this over the pool ranks (as the gradient all-reduce does) gives the mean loss per
    token of the global batch. A count of zero (a step of padding only) gives zero, not NaN.
    """
    return loss_sums / global_tokens.clamp(min=1)
