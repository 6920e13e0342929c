"""Reference context-parallel attention in plain torch: the oracle for the fast paths.

``reference_cp_attention`` takes this rank's shard of a group's packed (THD) buffer and returns
the attention output for exactly those rows, as Transformer Engine's ``padding_causal`` THD
attention would. Method: all-gather K and V inside the CP group (one collective, K and V
concatenated), map every gathered row to its place in the global packed buffer with the shard
index math of ``runtime.data.shard`` (zigzag or contiguous), then compute dense causal attention per
sequence in float32. It is slow and memory-hungry on purpose: each sequence is a plain masked
softmax that anyone can check by eye, and nothing is shared with the optimised paths except the
index math, which has its own tests (and a GPU cross-check against TE).

Semantics (per sequence s with padded rows [p_s, p_s + P_s) and real length L_s <= P_s; the
padding is at the tail of each sequence):
- a real query at position i (0-based within s) attends to the keys of s at positions 0..i;
- padding rows attend to nothing and their output is zero; they are never attended to;
- sequences never see each other. Positions are global (within the whole sequence), not local
  to the shard, which is what makes the CP result equal to the single-process one.
- GQA: with H query heads and G key/value heads (G divides H), query head h uses kv head
  h // (H / G), the ``repeat_interleave`` convention of TE and flash-attention.

Example: k = 2, zigzag, one sequence of real length 7 padded to 8 (chunks of 2). Rank 0 holds
global rows [0, 1, 6, 7]: rows 0 and 1 attend to keys [0] and [0, 1], row 6 to keys [0..6], row 7
is padding (output 0). Rank 1 holds rows [2, 3, 4, 5].

The all-gather is differentiable: its backward sums the gradient of the gathered buffer over the
group and keeps this rank's slice (a reduce-scatter, written as all-reduce + slice because gloo
has no reduce_scatter). Every rank takes part in that backward collective even when it holds only
padding, or ranks would wait for each other forever.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray
from torch import Tensor

from runtime.data.shard import shard_indices_np


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's equal-sized [n, ...] tensor along dim 0, in group rank order."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        ctx.world = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        # Every rank's loss depends on every rank's copy of x: sum over the group, keep our rows.
        # Summed in fp32 so that bf16 gradients do not lose bits to the reduction order.
        total = grad.float().contiguous()
        dist.all_reduce(total, group=ctx.group)
        n = total.shape[0] // ctx.world
        return total[ctx.rank * n : (ctx.rank + 1) * n].to(grad.dtype), None


def all_gather_rows(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Differentiable all-gather along dim 0; backward sums over the group, keeps our rows."""
    out: Tensor = _AllGatherRows.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def _bounds(cu_seqlens_padded: Tensor, cu_seqlens: Tensor) -> tuple[NDArray[np.int64], ...]:
    cu_p = np.asarray(cu_seqlens_padded.detach().cpu().tolist(), dtype=np.int64)
    cu_r = np.asarray(cu_seqlens.detach().cpu().tolist(), dtype=np.int64)
    if cu_p.ndim != 1 or cu_r.shape != cu_p.shape:
        raise ValueError(
            f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded "
            f"{tuple(cu_seqlens_padded.shape)} must be 1-D and of equal length S+1"
        )
    lengths, padded = np.diff(cu_r), np.diff(cu_p)
    bad = (lengths < 0) | (lengths > padded)
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(
            f"sequence {j} has real length {int(lengths[j])} and padded length {int(padded[j])}"
        )
    return cu_p, lengths


def _attend(
    q: Tensor,
    q_global: NDArray[np.int64],
    kv: Tensor,
    kv_row_of_global: NDArray[np.int64],
    cu_p: NDArray[np.int64],
    lengths: NDArray[np.int64],
    head_dims: tuple[int, int, int, int],
    scale: float,
) -> Tensor:
    """Attention of the local queries (global rows ``q_global``) over the whole buffer's keys.

    ``kv`` is [rows, G*(Dk+Dv)] (K and V flattened side by side); global row g of the packed
    buffer is ``kv[kv_row_of_global[g]]``.
    """
    num_heads, num_kv_heads, dk, dv = head_dims
    seq = np.searchsorted(cu_p, q_global, side="right") - 1
    pos = q_global - cu_p[seq]
    real = pos < lengths[seq]
    # Local rows of real tokens, grouped by sequence (stable: positions stay ascending).
    rows = np.flatnonzero(real)
    rows = rows[np.argsort(seq[rows], kind="stable")]
    pieces: list[Tensor] = []
    starts = np.searchsorted(seq[rows], np.arange(len(lengths) + 1))
    for s in range(len(lengths)):
        mine = rows[starts[s] : starts[s + 1]]
        if mine.size == 0:
            continue
        num_keys = int(pos[mine].max()) + 1  # later keys are masked for every query here
        key_rows = kv_row_of_global[cu_p[s] : cu_p[s] + num_keys]
        kv_s = kv.index_select(0, torch.from_numpy(key_rows).to(kv.device)).float()
        k_s = kv_s[:, : num_kv_heads * dk].view(num_keys, num_kv_heads, dk)
        v_s = kv_s[:, num_kv_heads * dk :].view(num_keys, num_kv_heads, dv)
        rep = num_heads // num_kv_heads
        k_s = k_s.repeat_interleave(rep, dim=1)
        v_s = v_s.repeat_interleave(rep, dim=1)
        q_s = q.index_select(0, torch.from_numpy(mine).to(q.device)).float()
        scores = torch.einsum("qhd,khd->hqk", q_s, k_s) * scale
        q_pos = torch.from_numpy(pos[mine]).to(q.device)
        causal = torch.arange(num_keys, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~causal[None], float("-inf")).softmax(dim=-1)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, v_s))
    out = q.new_zeros(q.shape[0], num_heads, dv, dtype=torch.float32)
    if pieces:
        index = torch.from_numpy(rows).to(q.device)
        out = out.index_copy(0, index, torch.cat(pieces).to(out.dtype))  # autocast may give bf16
    # Keep q, K and V in the graph even when this rank has no real query: the gather's backward
    # collective runs on every rank of the group.
    out = out + (kv[:0].sum() + q[:0].sum())
    return out.to(q.dtype)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"q, k, v disagree on tokens or kv heads: {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{k.shape[1]} kv heads do not divide {q.shape[1]} query heads")
    return q.shape[1], k.shape[1], k.shape[2], v.shape[2]


def _flat_kv(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_padded: Tensor,
    cu_seqlens: Tensor,
    *,
    softmax_scale: float | None = None,
) -> Tensor:
    """Single-process reference over a whole packed buffer (same semantics as the CP version).

    Args:
        q: [T, H, D] queries of the whole buffer, T = cu_seqlens_padded[-1].
        k: [T, G, D] keys, G dividing H.
        v: [T, G, Dv] values.
        cu_seqlens_padded: 1-D cumulative padded lengths (S+1 entries).
        cu_seqlens: 1-D cumulative real lengths (S+1 entries).
        softmax_scale: defaults to 1/sqrt(D).

    Returns:
        [T, H, Dv] in q's dtype; padding rows are zero.
    """
    head_dims = _check_shapes(q, k, v)
    cu_p, lengths = _bounds(cu_seqlens_padded, cu_seqlens)
    if q.shape[0] != int(cu_p[-1]):
        raise ValueError(f"q has {q.shape[0]} rows, cu_seqlens_padded ends at {int(cu_p[-1])}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    every = np.arange(q.shape[0], dtype=np.int64)
    return _attend(q, every, _flat_kv(k, v), every, cu_p, lengths, head_dims, scale)


def reference_cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_padded: Tensor,
    cu_seqlens: Tensor,
    cp_size: int,
    cp_rank: int,
    layout: str,
    group: dist.ProcessGroup | None,
    softmax_scale: float | None = None,
) -> Tensor:
    """Causal per-sequence attention of this rank's shard, with K/V gathered over the CP group.

    Args:
        q: [T/cp_size, H, D] this rank's query rows, in the ``layout`` shard order.
        k: [T/cp_size, G, D] this rank's key rows (G divides H).
        v: [T/cp_size, G, Dv] this rank's value rows.
        cu_seqlens_padded: 1-D int32 cumulative padded lengths of the group's whole buffer
            (global, not divided by cp_size), S+1 entries.
        cu_seqlens: 1-D int32 cumulative real lengths, S+1 entries.
        cp_size: ranks in the group.
        cp_rank: this rank's index in the group (its rank in ``group``).
        layout: ``zigzag`` or ``contiguous``.
        group: the CP process group; None only when cp_size == 1.
        softmax_scale: defaults to 1/sqrt(D).

    Returns:
        [T/cp_size, H, Dv] in q's dtype: the output rows of this rank's queries; padding is zero.

    Raises:
        ValueError: inconsistent shapes, lengths, group size or layout preconditions.
    """
    head_dims = _check_shapes(q, k, v)
    cu_p, lengths = _bounds(cu_seqlens_padded, cu_seqlens)
    total = int(cu_p[-1])
    if q.shape[0] * cp_size != total:
        raise ValueError(
            f"this rank holds {q.shape[0]} rows; with cp_size {cp_size} the buffer of {total} "
            f"padded tokens needs {total / cp_size:g} per rank"
        )
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    kv = _flat_kv(k, v)
    q_global = shard_indices_np(layout, cu_p, cp_size, cp_rank)
    if cp_size == 1:
        every = np.arange(total, dtype=np.int64)
        return _attend(q, q_global, kv, every, cu_p, lengths, head_dims, scale)
    if group is None:
        raise ValueError(f"cp_size {cp_size} needs a process group, got None")
    if dist.get_world_size(group) != cp_size or dist.get_rank(group) != cp_rank:
        raise ValueError(
            f"group has {dist.get_world_size(group)} ranks and this rank is its rank "
            f"{dist.get_rank(group)}; expected cp_size {cp_size}, cp_rank {cp_rank}"
        )
    gathered = all_gather_rows(kv, group)
    # Gathered row j*n + i is rank j's local row i, i.e. global row shard_indices(j)[i].
    global_of_gathered = np.concatenate(
        [shard_indices_np(layout, cu_p, cp_size, r) for r in range(cp_size)]
    )
    kv_row_of_global = np.empty(total, dtype=np.int64)
    kv_row_of_global[global_of_gathered] = np.arange(total, dtype=np.int64)
    return _attend(q, q_global, gathered, kv_row_of_global, cu_p, lengths, head_dims, scale)
