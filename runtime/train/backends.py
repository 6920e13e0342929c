"""Attention backends: bind the model's attention to one microbatch and its CP group.

``backend.bind(mb, cp_group, cp_global_ranks)`` is a context manager that yields the
:data:`runtime.train.model.AttentionFn` every layer of the model calls for that microbatch; the
trainer
runs the microbatch's forward *and* backward inside it. Three backends:

- ``reference``: ``runtime.attention.reference.reference_cp_attention`` (all-gather K/V, dense
masked
  attention per sequence in fp32). Any device; the CPU tests use it.
- ``torch``: ``runtime.attention.torch_varlen`` (all-gather K/V, torch's fused ``varlen_attn`` on
CUDA,
  an SDPA stand-in on CPU).
- ``te``: Transformer Engine's THD ``DotProductAttention``, one module per layer, each bound to
  the microbatch's CP group with ``te_adapter.bind_cp_group`` and unbound in a ``finally``.

Transformer Engine is imported only when the ``te`` backend is built (through te_adapter).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch
import torch.distributed as dist

from runtime.data.batch import MicrobatchInputs
from runtime.train.model import AttentionFn, GPTConfig

ATTENTIONS = ("reference", "te", "torch")


class AttentionBackend:
    """Binds the model's attention to one microbatch and its CP group (a context manager)."""

    def bind(self, mb: MicrobatchInputs, cp_group: dist.ProcessGroup | None,
             cp_global_ranks: Sequence[int], *, host: MicrobatchInputs | None = None
             ) -> AbstractContextManager[AttentionFn]:
        """The attention callable for ``mb`` (on the training device).

        ``host`` is the same microbatch on the CPU, as ``runtime.data.batch`` built it: index math
        reads its cu_seqlens there instead of copying them back from the GPU (a sync).
        """
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """``runtime.attention.reference.reference_cp_attention``: all-gather K/V, dense masked
    attention."""

    def __init__(self, layout: str) -> None:
        self.layout = layout

    @contextmanager
    def bind(self, mb: MicrobatchInputs, cp_group: dist.ProcessGroup | None,
             cp_global_ranks: Sequence[int], *, host: MicrobatchInputs | None = None
             ) -> Iterator[AttentionFn]:
        from runtime.attention.reference import reference_cp_attention

        meta = host or mb

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      layer_index: int) -> torch.Tensor:
            del layer_index
            return reference_cp_attention(
                q, k, v, cu_seqlens_padded=meta.cu_seqlens_padded, cu_seqlens=meta.cu_seqlens,
                cp_size=mb.cp_size, cp_rank=mb.cp_rank, layout=self.layout, group=cp_group)

        yield attention


class TorchBackend(AttentionBackend):
    """``runtime.attention.torch_varlen``: all-gather K/V plus torch's fused varlen kernel
    (CUDA)."""

    def __init__(self, layout: str) -> None:
        from runtime.attention.torch_varlen import TorchCPAttention

        self.impl = TorchCPAttention(layout)

    @contextmanager
    def bind(self, mb: MicrobatchInputs, cp_group: dist.ProcessGroup | None,
             cp_global_ranks: Sequence[int], *, host: MicrobatchInputs | None = None
             ) -> Iterator[AttentionFn]:
        meta = host or mb
        device = mb.tokens.device if mb.tokens is not None else torch.device("cpu")
        yield self.impl.bind(meta.cu_seqlens_padded, meta.cu_seqlens, mb.cp_size, mb.cp_rank,
                             cp_group, device)


class TEBackend(AttentionBackend):
    """Transformer Engine's THD attention (one module per layer), CP group bound per microbatch."""

    def __init__(self, layout: str, model_config: GPTConfig) -> None:
        from runtime.attention import te as te_adapter

        if not te_adapter.te_available():
            raise ValueError("--attention te: Transformer Engine is not importable here")
        self.te = te_adapter
        self.modules = [te_adapter.TEAttention(
            num_heads=model_config.num_heads, head_dim=model_config.head_dim,
            num_query_groups=model_config.num_query_groups, layout=layout)
            for _ in range(model_config.num_layers)]

    @contextmanager
    def bind(self, mb: MicrobatchInputs, cp_group: dist.ProcessGroup | None,
             cp_global_ranks: Sequence[int], *, host: MicrobatchInputs | None = None
             ) -> Iterator[AttentionFn]:
        # Each bind_cp_group restores the build-time binding (no CP) in a finally on exit, even
        # when the forward or backward raises (Megatron #7045).
        with ExitStack() as stack:
            for m in self.modules:
                stack.enter_context(self.te.bind_cp_group(m, cp_group, cp_global_ranks))

            def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layer_index: int) -> torch.Tensor:
                out: torch.Tensor = self.modules[layer_index](q, k, v, mb)
                return out

            yield attention


def make_backend(name: str, layout: str, model_config: GPTConfig) -> AttentionBackend:
    """The attention backend called ``name`` (reference, torch or te)."""
    if name == "reference":
        return ReferenceBackend(layout)
    if name == "torch":
        return TorchBackend(layout)
    if name == "te":
        return TEBackend(layout, model_config)
    raise ValueError(f"unknown attention {name!r} (expected one of {', '.join(ATTENTIONS)})")

