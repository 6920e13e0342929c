"""Per-token loss: the local sum and count, and the pool-wide count on a real 2-rank gloo world."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from runtime.train.loss import global_num_tokens, per_token_loss, step_loss
from tests.dist import run_distributed


def _data(seed: int, t: int = 12, vocab: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, vocab, generator=g)
    labels = torch.randint(0, vocab, (t,), generator=g)
    mask = (torch.rand(t, generator=g) < 0.6).float()
    labels[mask == 0] = 0  # padded slots hold label 0 (shared DOMAIN.md)
    return logits, labels, mask


def test_per_token_loss_matches_a_direct_sum() -> None:
    logits, labels, mask = _data(0)
    loss_sum, num_tokens = per_token_loss(logits, labels, mask)
    expected = 0.0
    for i in range(logits.shape[0]):
        if mask[i]:
            row = logits[i].double()
            expected += float(torch.logsumexp(row, 0) - row[labels[i]])
    assert math.isclose(float(loss_sum), expected, rel_tol=1e-6)
    assert float(num_tokens) == float(mask.sum())
    assert num_tokens.dtype == torch.int64
    assert loss_sum.dtype == torch.float32
    assert loss_sum.dim() == 0


def test_bool_mask_bf16_logits_and_gradient_only_on_masked_rows() -> None:
    logits, labels, mask = _data(1)
    x = logits.bfloat16().requires_grad_(True)
    loss_sum, num_tokens = per_token_loss(x, labels, mask.bool())
    ref, _ = per_token_loss(logits.bfloat16().float(), labels, mask)
    assert math.isclose(float(loss_sum.detach()), float(ref), rel_tol=1e-6)
    loss_sum.backward()
    assert x.grad is not None
    assert (x.grad[mask == 0] == 0).all()
    assert (x.grad[mask == 1] != 0).any()
    assert int(num_tokens) == int(mask.sum())


def test_shapes_are_checked() -> None:
    logits, labels, mask = _data(2)
    with pytest.raises(ValueError, match="expected logits"):
        per_token_loss(logits, labels[:-1], mask)
    with pytest.raises(ValueError, match="expected logits"):
        per_token_loss(logits[None], labels, mask)


def test_global_num_tokens_without_group_and_empty_step() -> None:
    n = torch.tensor(5.0)
    total = global_num_tokens(n, None)
    assert float(total) == 5.0
    assert total is not n
    assert float(step_loss(torch.tensor(0.0), torch.tensor(0.0))) == 0.0


def _pool_child(rank: int, world: int, store: str) -> dict[str, object]:
    del store
    # One buffer of 12 tokens split unevenly over 2 ranks (as a CP group of 2 would split it,
    # or as two groups of 1 would hold different sequences): rank 0 rows [0, 3), rank 1 [3, 12).
    logits, labels, mask = _data(3)
    rows = slice(0, 3) if rank == 0 else slice(3, 12)
    x = logits[rows].clone().requires_grad_(True)
    loss_sum, num_tokens = per_token_loss(x, labels[rows], mask[rows])
    total = global_num_tokens(num_tokens, dist.group.WORLD)
    loss = step_loss(loss_sum, total)
    loss.backward()
    pooled = loss.detach().clone()
    dist.all_reduce(pooled)
    assert x.grad is not None
    return {"local": float(num_tokens), "total": float(total), "loss": float(pooled.detach()),
            "grad": x.grad.numpy()}


@pytest.mark.dist
def test_pool_count_and_step_loss_on_two_ranks() -> None:
    r0, r1 = run_distributed(_pool_child, 2, timeout=60)
    logits, labels, mask = _data(3)
    assert r0["total"] == r1["total"] == float(mask.sum())
    assert r0["local"] + r1["local"] == float(mask.sum())
    assert r0["local"] != r1["local"]  # uneven split, so a mean of means would differ
    # The pooled per-token loss and its gradient equal the single-process mean over all tokens.
    x = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(x, labels, reduction="none")[mask == 1].mean()
    ref.backward()
    assert math.isclose(r0["loss"], float(ref.detach()), rel_tol=1e-6)
    assert r0["loss"] == r1["loss"]
    assert x.grad is not None
    grad = np.concatenate([r0["grad"], r1["grad"]])
    np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-5, atol=1e-7)
