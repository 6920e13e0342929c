"""Core-attention modules behind Megatron's layer spec (``submodules.core_attention``).

Megatron's ``SelfAttention`` computes q, k, v (with RoPE) and hands them to its core attention;
these modules replace that last piece on the CPU, where Megatron's local ``DotProductAttention``
refuses packed sequences and context parallelism and Transformer Engine cannot load:

- ``PlanCoreAttention``: a packed THD shard of one CP group (``packed_seq_params`` of the plan's
  microbatch): ``runtime.attention.reference.reference_cp_attention`` over the microbatch's
  ``cp_group``, zigzag layout, ``padding_causal`` semantics. Any device; on GPU the adapter uses
  Megatron's ``TEDotProductAttention`` instead.
- ``SequenceCoreAttention``: one whole sequence, no packing, no CP (the oracle): plain causal
  SDPA, sharing nothing with the packed path.

Shapes (Megatron's): THD q ``[T, heads, head_dim]``, k/v ``[T, query_groups, head_dim]`` -> out
``[T, heads, head_dim]`` (Megatron reshapes it to ``[T, 1, hidden]``); SBHD q ``[S, B, heads,
head_dim]`` -> ``[S, B, heads * head_dim]``. Heads are this TP rank's heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from planner.groups import ZIGZAG
from runtime.attention.reference import reference_cp_attention


class PlanCoreAttention(nn.Module):
    """Packed (THD) attention of one microbatch's CP group, as the plan replays it."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **kwargs: Any) -> None:
        super().__init__()
        del attn_mask_type, attention_type, kwargs
        if (attention_dropout if attention_dropout is not None else config.attention_dropout):
            raise ValueError("PlanCoreAttention has no dropout; set attention_dropout=0")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        del attention_mask, attn_mask_type
        p = packed_seq_params
        if p is None or p.qkv_format != "thd":
            raise ValueError("PlanCoreAttention needs the microbatch's packed_seq_params (thd)")
        if attention_bias is not None:
            raise ValueError("PlanCoreAttention does not take an attention bias")
        group = p.cp_group
        k = 1 if group is None else group.size()
        rank = 0 if group is None else group.rank()
        if p.local_cp_size is not None and p.local_cp_size != k:
            raise ValueError(f"packed_seq_params: local_cp_size {p.local_cp_size} but cp_group "
                             f"has {k} ranks")
        out: Tensor = reference_cp_attention(
            query, key, value, cu_seqlens_padded=p.cu_seqlens_q_padded, cu_seqlens=p.cu_seqlens_q,
            cp_size=k, cp_rank=rank, layout=ZIGZAG, group=group if k > 1 else None,
            softmax_scale=self.softmax_scale)
        return out


class SequenceCoreAttention(nn.Module):
    """Full causal attention over whole sequences ``[S, B, ...]`` (the oracle's attention)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **kwargs: Any) -> None:
        super().__init__()
        del config, layer_number, attn_mask_type, attention_type, attention_dropout, kwargs
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        del attention_mask, attn_mask_type, attention_bias
        if packed_seq_params is not None:
            raise ValueError("SequenceCoreAttention runs whole sequences, not packed ones")
        s, b, h, d = query.shape
        groups = key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k = key.repeat_interleave(h // groups, dim=2).permute(1, 2, 0, 3)
        v = value.repeat_interleave(h // groups, dim=2).permute(1, 2, 0, 3)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """RMSNorm that Megatron can use under sequence parallelism without Apex or TE.

    Megatron's torch fallback (``WrappedTorchNorm``) refuses ``sequence_parallel``: it does not
    mark its weight, so ``finalize_model_grads`` would not all-reduce the weight's gradient over
    the TP ranks (each saw only its slice of the sequence). This one sets the same
    ``sequence_parallel`` attribute Megatron's fused norms set.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        del kwargs
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(x)
        return out
