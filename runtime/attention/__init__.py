"""Context-parallel attention over a microbatch's CP group: ``reference`` (pure torch, all-gather
of K/V, any device: the oracle), ``torch_varlen`` (torch's fused varlen kernels on CUDA) and
``te`` (Transformer Engine, the only module that imports it, loaded lazily).
"""

from __future__ import annotations

from runtime.attention.reference import local_attention, reference_cp_attention

__all__ = ["local_attention", "reference_cp_attention"]
