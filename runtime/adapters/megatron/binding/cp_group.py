"""Bind one microbatch's CP group into every layer of a Megatron model, restored afterwards.

``PackedSeqParams.cp_group`` reaches the core attention (ours, or ``TEDotProductAttention``,
which calls TE's ``set_context_parallel_group`` with it) and the rotary table, but not RoPE's
application: ``transformer/attention.py`` rotates q and k with ``self.pg_collection.cp``, the
build-time group, so with a microbatch group of another size the THD split fails
(``split_with_sizes``) or, worse, rotates with the wrong positions. ``bind_cp_group`` therefore
gives each ``Attention`` module a copy of its collection whose ``cp`` is the microbatch's group,
points the model's own ``cp_group`` (multi-token prediction) at it too, gives every MoE router
(``TopKRouter``) the microbatch's ``cp_group`` and TP x CP ``tp_cp_group`` (which its token
counts and load-balancing statistics reduce over; ``moe.py``), and in a ``finally``
restores every module, including TE attention modules that re-bound themselves during the
forward (Megatron #7045 added the same try/finally upstream).

Only the forward needs the binding: every backward that communicates (the K/V all-gather, TE's
ring) captured its group when its forward ran, so the pipeline schedules may run the backward of
a microbatch long after the binding is gone. A recomputed forward (activation recomputation) is a
forward again: ``recompute.py`` re-enters the binding that was active when it was checkpointed,
which ``active()`` gives.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron.compat import mcore


def _unwrap(chunk: nn.Module) -> nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk


def _te_state(module: nn.Module) -> tuple[Any, ...]:
    return (getattr(module, "cp_group", None), getattr(module, "cp_global_ranks", None),
            getattr(module, "cp_stream", None), getattr(module, "cp_comm_type", "p2p"))


@dataclass(frozen=True, slots=True, eq=False)
class Binding:
    """One ``bind_cp_group`` call's arguments (identity compared: the same call)."""

    model: nn.Module | Sequence[nn.Module]
    cp_group: dist.ProcessGroup
    tp_cp_group: dist.ProcessGroup | None


_ACTIVE: list[Binding] = []


def active() -> Binding | None:
    """The innermost binding in force, None outside every ``bind_cp_group`` block."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def bind_cp_group(model: nn.Module | Sequence[nn.Module], cp_group: dist.ProcessGroup,
                  tp_cp_group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Every layer of ``model`` (a chunk or a list of chunks) uses ``cp_group`` inside the block.

    Args:
        model: Megatron model chunk(s), wrapped (DDP) or not.
        cp_group: the microbatch's CP group (a group of one rank for a lone rank, never None:
            Megatron's RoPE reads its size and rank).
        tp_cp_group: the microbatch's TP x CP group, for MoE routers (default: ``cp_group``,
            right at tp 1).
    """
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    binding = Binding(model, cp_group, tp_cp_group)
    saved_pgc: list[tuple[nn.Module, Any]] = []
    saved_te: list[tuple[nn.Module, tuple[Any, ...]]] = []
    saved_lm: list[tuple[nn.Module, Any]] = []
    saved_router: list[tuple[nn.Module, tuple[Any, Any]]] = []
    router_cls = mcore.moe_router.Router
    te_cls = _te_class()
    try:
        for chunk in chunks:
            inner = _unwrap(chunk)
            if hasattr(inner, "cp_group"):
                saved_lm.append((inner, inner.cp_group))
                setattr(inner, "cp_group", cp_group)  # noqa: B010 - GPTModel attribute
            for module in inner.modules():
                if isinstance(module, mcore.Attention):
                    saved_pgc.append((module, module.pg_collection))
                    bound = copy.copy(module.pg_collection)
                    bound.cp = cp_group
                    module.pg_collection = bound
                elif isinstance(module, router_cls):
                    saved_router.append((module, (module.cp_group, module.tp_cp_group)))
                    module.cp_group = cp_group
                    module.tp_cp_group = cp_group if tp_cp_group is None else tp_cp_group
                elif te_cls is not None and isinstance(module, te_cls):
                    saved_te.append((module, _te_state(module)))
        _ACTIVE.append(binding)
        try:
            yield
        finally:
            _ACTIVE.pop()
    finally:
        for module, pgc in saved_pgc:
            module.pg_collection = pgc
        for module, (cp, tp_cp) in saved_router:
            module.cp_group, module.tp_cp_group = cp, tp_cp
        for inner, group in saved_lm:
            setattr(inner, "cp_group", group)  # noqa: B010
        for module, (group, ranks, stream, comm_type) in saved_te:
            if _te_state(module)[0] is not group:
                rebind: Any = module.set_context_parallel_group
                rebind(group, ranks, stream, comm_type)
                setattr(module, "cp_group", group)  # noqa: B010


_TE: list[type | None] = []


def _te_class() -> type | None:
    """Megatron's TEDotProductAttention when TE is importable here, else None (cached)."""
    if not _TE:
        if not torch.cuda.is_available():  # TE cannot load without CUDA; nothing to restore
            _TE.append(None)
            return None
        try:
            _TE.append(mcore.te_attention_class())
        except Exception:  # noqa: BLE001 - TE raises RuntimeError/OSError on CPU hosts
            _TE.append(None)
    return _TE[0]
