"""The only module that imports Transformer Engine (TE), lazily: API churn stays here.

TE's THD contract (shared DOMAIN.md), which this module produces and nothing else spells out:
- ``qkv_format="thd"``, ``attn_mask_type="padding_causal"``;
- ``cu_seqlens_q = cu_seqlens_kv`` = cumulative real lengths and ``cu_seqlens_q_padded =
  cu_seqlens_kv_padded`` = cumulative padded lengths, 1-D int32, global (not divided by cp);
- ``max_seqlen`` from the plan (TE would otherwise read it off the device: a sync);
- ``pad_between_seqs=True`` always: TE's auto-detection misses tail padding (TE issue #3331);
- with CP, TE's THD path expects zigzag shards (its dual-chunk split); contiguous is refused.

CP binding: ``DotProductAttention.set_context_parallel_group(group, global_ranks, stream, "p2p")``
before the forward of each microbatch, with ``None`` when the group has one rank, and the
build-time binding (no CP) restored afterwards even when the forward raises (Megatron #7045).

Nothing here runs on a CPU-only host: TE fails to import there with RuntimeError/OSError rather
than ImportError, so ``te_available`` catches Exception and checks CUDA first (ENVIRONMENT.md).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from planner.groups import ZIGZAG


class PackedSeqs(Protocol):
    """The packing metadata of one microbatch (``runtime.data.batch.MicrobatchInputs`` has it)."""

    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int


@functools.cache
def te_available() -> bool:
    """True only with CUDA and an importable ``transformer_engine.pytorch``."""
    if not torch.cuda.is_available():
        return False
    global te_import_error
    try:
        _te()
    except Exception as e:  # TE raises RuntimeError/OSError, not ImportError, without CUDA libs
        te_import_error = f"{type(e).__name__}: {e}"
        return False
    return True


te_import_error = ""
"""Why the last ``te_available()`` said no (for skip reasons and logs)."""


def _te() -> Any:
    # TE warns at import (deprecations in its dependencies); under warnings-as-errors (our pytest
    # configuration) that would make the import fail, so silence warnings for the import only.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformer_engine.pytorch as te_pytorch  # type: ignore[import-not-found,unused-ignore]

    return te_pytorch


def _tex() -> Any:
    import transformer_engine_torch as tex  # type: ignore[import-not-found,unused-ignore]

    return tex


class TEAttention(torch.nn.Module):
    """TE ``DotProductAttention`` in THD format with padding-causal masking.

    Call as ``module(q, k, v, packed)`` with q ``[T, H, D]``, k and v ``[T, G, D]`` (this rank's
    rows) and ``packed`` holding the microbatch's cu_seqlens; returns ``[T, H, D]``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        num_query_groups: int | None = None,
        layout: str = ZIGZAG,
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.core = _te().DotProductAttention(
            num_heads,
            head_dim,
            num_gqa_groups=num_query_groups or num_heads,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            softmax_scale=softmax_scale,
        )
        # TE's p2p ring overlaps the K/V exchange with compute on this side stream.
        self.cp_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call,unused-ignore]
        self.cp_size = 1

    def forward(self, q: Tensor, k: Tensor, v: Tensor, packed: PackedSeqs) -> Tensor:
        out: Tensor = self.core(
            q,
            k,
            v,
            qkv_format="thd",
            cu_seqlens_q=packed.cu_seqlens,
            cu_seqlens_kv=packed.cu_seqlens,
            cu_seqlens_q_padded=packed.cu_seqlens_padded,
            cu_seqlens_kv_padded=packed.cu_seqlens_padded,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
            attn_mask_type="padding_causal",
            pad_between_seqs=True,
        )
        return out.view(q.shape[0], q.shape[1], -1)


class bind_cp_group:  # noqa: N801 - used like a function and like a context manager
    """Bind ``module`` to a CP group now; as a context manager, restore no-CP on exit.

    ``bind_cp_group(m, group, ranks)`` binds immediately (callers that manage the restore
    themselves); ``with bind_cp_group(m, group, ranks):`` also restores the build-time binding
    (no CP group) in a ``finally``, even when the forward raises.

    Args:
        module: a ``TEAttention``.
        group: the CP group, or None for a group of one rank.
        global_ranks: the group's global ranks in CP order (``GroupCatalog.cp_global_ranks``).
        stream: CUDA stream for TE's ring exchange; defaults to the module's own.

    Raises:
        ValueError: a CP group with the contiguous layout (TE shards THD in zigzag only).
    """

    def __init__(
        self,
        module: TEAttention,
        group: dist.ProcessGroup | None,
        global_ranks: Sequence[int],
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        size = 1 if group is None else dist.get_world_size(group)
        if size > 1 and module.layout != ZIGZAG:
            raise ValueError(
                f"Transformer Engine's THD context parallelism needs the zigzag layout; this "
                f"plan uses {module.layout!r} (cp_size {size})"
            )
        if size > 1 and len(global_ranks) != size:
            raise ValueError(f"group of {size} ranks given {len(global_ranks)} global ranks")
        self.module = module
        module.cp_size = size
        module.core.set_context_parallel_group(
            group, list(global_ranks) if size > 1 else None, stream or module.cp_stream, "p2p"
        )

    def __enter__(self) -> TEAttention:
        return self.module

    def __exit__(self, *exc: object) -> None:
        self.module.cp_size = 1
        self.module.core.set_context_parallel_group(None, None, self.module.cp_stream, "p2p")


def te_thd_partitioned_indices(
    cu_seqlens_padded: Tensor, total: int, cp_size: int, cp_rank: int
) -> Tensor:
    """TE's zigzag rows of CP rank ``cp_rank`` (``tex.thd_get_partitioned_indices``), as int64.

    ``cu_seqlens_padded`` must be a 1-D int32 CUDA tensor; for the GPU cross-check of
    ``runtime.data.shard.zigzag_indices``.
    """
    rows: Tensor = _tex().thd_get_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank)
    return rows.long()
