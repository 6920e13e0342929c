"""The attention that replaces llama3's ``inner_attention``: the microbatch's CP group, per call.

torchtitan's ``GQAttention`` projects q, k, v, applies RoPE with the batch's ``positions`` and
calls its ``inner_attention(q, k, v, attention_masks=..., scale=..., enable_gqa=...)`` with
[B, L, heads, head_dim] tensors; ``attention_masks`` is whatever the trainer's
``post_dataloading_process`` passed to the model. The plan's trainer passes a
:class:`PlanMasks`: the attention callable that ``runtime.backends`` bound to this microbatch
(its cu_seqlens and cu_seqlens_padded, its CP size, rank and process group; the reference
all-gather attention on CPU, torch's fused varlen kernel or Transformer Engine on GPU). So the
CP group travels with the batch, the module holds no per-microbatch state, and a stale group
cannot leak into the next microbatch; the backend's binding (TE's ``set_context_parallel_group``)
is entered around the forward and backward of one microbatch and restored in its ``finally``.

Shapes: B = 1 (one packed THD buffer per rank and microbatch), L = this rank's T / cp_size rows
in the plan's layout (zigzag or contiguous), so q [1, L, H, D], k and v [1, L, G, D] with
query head h using kv head h // (H / G): torchtitan's fused-QKV split and our backends agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.adapters.torchtitan.titan import Module
from runtime.train.model import AttentionFn


@dataclass(frozen=True, slots=True)
class PlanMasks:
    """What the model's ``attention_masks`` argument carries for one microbatch."""

    attention: AttentionFn
    """(q [T, H, D], k [T, G, D], v [T, G, D], layer_index) -> [T, H, D]."""


class PlanAttention(Module):
    """llama3 inner attention over one microbatch's CP group (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layer_index: int = 0
        """Which layer this is (Transformer Engine keeps one module per layer)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer_index = config.layer_index

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: float | None = None,
                enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
        """Causal attention within each document of the packed buffer, over the CP group."""
        del enable_gqa, kwargs  # GQA follows from the shapes
        if not isinstance(attention_masks, PlanMasks):
            raise TypeError("PlanAttention needs the plan trainer's PlanMasks as attention_masks, "
                            f"got {type(attention_masks).__name__}")
        if scale is not None:
            # Our backends use 1/sqrt(head_dim), which is what llama3 passes (None) as well.
            raise ValueError(f"PlanAttention supports the default softmax scale only, got {scale}")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"one packed buffer per microbatch expected, got batch "
                             f"{q_BLNH.shape[0]}")
        out = attention_masks.attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], self.layer_index)
        return out.unsqueeze(0)
