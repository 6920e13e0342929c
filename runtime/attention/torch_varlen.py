"""Context-parallel attention with torch's fused variable-length kernel (the GPU "torch" path).

Method: all-gather K and V inside the CP group (one collective per layer, K and V concatenated),
then one ``torch.nn.attention.varlen.varlen_attn`` call whose query segments are this rank's
pieces of each sequence and whose key segments are the matching causal prefixes of the gathered
sequence. The gather's backward is a reduce-scatter (sum), which routes each rank's K/V gradients
back to the rank that computed them.

Why per-piece segments: with zigzag a rank holds chunks r and 2k-1-r of every sequence, and with
the contiguous layout a rank may start in the middle of a sequence. flash-attention's causal mask
for a query segment shorter than its key segment is aligned to the bottom right (the last query
sees every key), so a piece covering positions [a, b) of a sequence is given the keys [0, b) of
that sequence and is then exactly causal. Padding rows (positions >= the real length) are left out
of the queries and keys and get zero outputs, as Transformer Engine's ``padding_causal`` does.

Example: k = 2, zigzag, one sequence of real length 7 padded to 8 (chunks of h = 2). Rank 0 holds
positions [0, 1, 6, 7]: query segments [0, 2) with keys [0, 2) and [6, 7) with keys [0, 7)
(position 7 is padding). Rank 1 holds [2, 3, 4, 5]: one segment [2, 6) with keys [0, 6).

The key index copies K/V once more (a sequence's prefix appears once per piece, so at most twice
with zigzag); that memory traffic is small next to the attention itself.

On CPU (tests) the kernel is replaced by per-segment SDPA with the same bottom-right causal mask,
so the index math and the gather's backward run under gloo too. Nothing here touches CUDA unless
the tensors are on a CUDA device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import Tensor

from runtime.data.shard import shard_indices_np
from runtime.train.model import AttentionFn, expand_kv


@dataclass(frozen=True, slots=True)
class VarlenIndex:
    """Query and key segments of one CP rank for one microbatch (numpy, CPU)."""

    q_rows: NDArray[np.int64]
    """Local rows holding real tokens, in segment order (ascending)."""
    kv_rows: NDArray[np.int64]
    """Rows of the gathered buffer (rank-major: rank j's shard at [j*n, (j+1)*n)), per segment."""
    cu_q: NDArray[np.int32]
    cu_k: NDArray[np.int32]
    max_q: int
    max_k: int
    num_local: int
    """Local rows n = T / cp_size."""


def build_varlen_index(cu_seqlens_padded: NDArray[np.integer] | Tensor,
                       cu_seqlens: NDArray[np.integer] | Tensor, layout: str, cp_size: int,
                       cp_rank: int) -> VarlenIndex:
    """Segments for CP rank ``cp_rank``; see the module docstring for the rule.

    Args:
        cu_seqlens_padded: global cumulative padded lengths of the group's packed buffer.
        cu_seqlens: global cumulative real lengths (same number of sequences).
        layout: ``zigzag`` or ``contiguous``.
        cp_size: the group's size k.
        cp_rank: this rank's index in the group.
    """
    cu_pad = np.asarray(cu_seqlens_padded, dtype=np.int64)
    real_len = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    shards = [shard_indices_np(layout, cu_pad, cp_size, j) for j in range(cp_size)]
    n = shards[0].size
    # inv[p]: where global row p lands in the all-gathered (rank-major) buffer.
    inv = np.empty(int(cu_pad[-1]), dtype=np.int64)
    inv[np.concatenate(shards)] = np.arange(n * cp_size, dtype=np.int64)
    g = shards[cp_rank]
    seq = np.searchsorted(cu_pad, g, side="right") - 1
    rel = g - cu_pad[seq]
    real = rel < real_len[seq]
    local = np.flatnonzero(real)
    g, seq, rel = g[real], seq[real], rel[real]
    # A segment is a run of local rows that are consecutive positions of one sequence.
    brk = (np.r_[True, (seq[1:] != seq[:-1]) | (g[1:] != g[:-1] + 1)] if g.size
           else np.zeros(0, bool))
    first = np.flatnonzero(brk)
    last = np.append(first[1:], g.size) - 1 if first.size else first
    q_len = last - first + 1
    k_len = rel[last] + 1  # keys: the sequence's positions [0, end of the piece)
    k_start = cu_pad[seq[first]]
    total_k = int(k_len.sum())
    offsets = np.cumsum(k_len) - k_len
    kv_global = np.arange(total_k, dtype=np.int64) + np.repeat(k_start - offsets, k_len)
    return VarlenIndex(
        q_rows=local.astype(np.int64), kv_rows=inv[kv_global],
        cu_q=np.r_[0, np.cumsum(q_len)].astype(np.int32),
        cu_k=np.r_[0, np.cumsum(k_len)].astype(np.int32),
        max_q=int(q_len.max()) if q_len.size else 0, max_k=int(k_len.max()) if k_len.size else 0,
        num_local=n)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 inside ``group``; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        ctx.group = group
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        group = ctx.group
        size = dist.get_world_size(group)
        grad = grad.contiguous()
        n = grad.shape[0] // size
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((n, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # gloo has no reduce_scatter: sum everything, keep this rank's slice (tests only).
        dist.all_reduce(grad, group=group)
        rank = dist.get_rank(group)
        return grad[rank * n:(rank + 1) * n].clone(), None


def _varlen_kernel() -> Callable[..., Tensor]:
    """``varlen_attn`` with causal masking, whichever spelling this torch has.

    torch 2.11 takes ``is_causal=True``; newer releases take ``window_size=(-1, 0)``. Keys with
    fewer heads than queries are expanded unless the function takes ``enable_gqa``.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = ({"is_causal": True} if "is_causal" in params
                              else {"window_size": (-1, 0)})
    gqa = "enable_gqa" in params

    def run(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
            max_k: int) -> Tensor:
        if k.shape[1] != q.shape[1]:
            if gqa:
                return cast(Tensor, varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k,
                                                enable_gqa=True, **causal))
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        return cast(Tensor, varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **causal))

    return run


def _varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                      max_k: int) -> Tensor:
    """Per-segment SDPA with a bottom-right causal mask: the CPU stand-in for the kernel.

    A segment whose queries are all of its keys (every CP=1 sequence) is plain causal: it goes
    to SDPA's fused kernel (4-D inputs, ``is_causal``), whose memory is linear in its length; a
    piece of a sequence (CP > 1) needs the explicit mask, and SDPA's math path holds its
    queries x keys scores per head.
    """
    del max_q, max_k
    h = q.shape[1]
    outs = []
    for i in range(cu_q.numel() - 1):
        qs = q[int(cu_q[i]):int(cu_q[i + 1])].transpose(0, 1)
        ks = expand_kv(k[int(cu_k[i]):int(cu_k[i + 1])], h).transpose(0, 1)
        vs = expand_kv(v[int(cu_k[i]):int(cu_k[i + 1])], h).transpose(0, 1)
        m, e = qs.shape[1], ks.shape[1]
        if m == e:
            out = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True)[0]
        else:
            mask = torch.ones(m, e, dtype=torch.bool, device=q.device).tril(e - m)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]


class TorchCPAttention:
    """The torch path: build the microbatch's index once, then one callable for every layer."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self._kernel: Callable[..., Tensor] | None = None

    def bind(self, cu_seqlens_padded: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int,
             cp_group: dist.ProcessGroup | None, device: torch.device) -> AttentionFn:
        """The attention callable for one microbatch of this rank."""
        idx = build_varlen_index(cu_seqlens_padded.cpu().numpy(), cu_seqlens.cpu().numpy(),
                                 self.layout, cp_size, cp_rank)
        if device.type == "cuda":
            if self._kernel is None:
                self._kernel = _varlen_kernel()
            kernel = self._kernel
        else:
            kernel = _varlen_reference
        q_rows = torch.from_numpy(idx.q_rows).to(device, non_blocking=True)
        kv_rows = torch.from_numpy(idx.kv_rows).to(device, non_blocking=True)
        cu_q = torch.from_numpy(idx.cu_q).to(device, non_blocking=True)
        cu_k = torch.from_numpy(idx.cu_k).to(device, non_blocking=True)
        all_real = idx.q_rows.size == idx.num_local

        def attention(q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
            del layer_index
            g = k.shape[1]
            kv = torch.cat([k, v], dim=1)
            if cp_group is not None and cp_size > 1:
                kv = _GatherRows.apply(kv, cp_group)  # type: ignore[no-untyped-call]
            dtype = q.dtype
            if device.type == "cuda" and dtype == torch.float32:
                # The fused kernel takes fp16/bf16 only; fp32 runs are for CPU equivalence tests.
                q, kv = q.to(torch.bfloat16), kv.to(torch.bfloat16)
            if idx.q_rows.size == 0:
                # No real token here; keep the gathered K/V in the graph so that this rank joins
                # the gather's backward collective like every other member of the group.
                return q.new_zeros(q.shape).to(dtype) + kv.sum().to(dtype) * 0
            keys = kv.index_select(0, kv_rows)
            qs = q if all_real else q.index_select(0, q_rows)
            out = kernel(qs, keys[:, :g], keys[:, g:], cu_q, cu_k, idx.max_q, idx.max_k).to(dtype)
            if all_real:
                return out
            return out.new_zeros((q.shape[0], *out.shape[1:])).index_copy(0, q_rows, out)

        return attention
