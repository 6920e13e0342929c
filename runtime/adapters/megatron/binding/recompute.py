"""Activation recomputation under the plan's binding: the recomputed forward sees the same CP
group as the first one.

Megatron recomputes a checkpointed region (``--recompute-granularity full``: whole layers;
``selective``: the core attention) in the backward pass, after ``bind_cp_group``'s block has
ended, so RoPE would rotate with the build-time group and the core attention's group would be
the wrong size. ``install`` wraps ``megatron.core.tensor_parallel.checkpoint`` (which the
transformer block, the layer and the attention call through that attribute) so that the
checkpointed function carries the binding active when it was checkpointed
(``cp_group.active``) and re-enters it when it runs again. In the first forward the binding is
already in force and nothing is re-entered. Transformer Engine's ``te_checkpoint`` (fp8
recomputation) is not wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from runtime.adapters.megatron.binding.cp_group import Binding, active, bind_cp_group
from runtime.adapters.megatron.compat import mcore


def rebound(function: Callable[..., Any], binding: Binding | None) -> Callable[..., Any]:
    """``function`` run under ``binding`` (as it was checkpointed)."""
    if binding is None:
        return function

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        if active() is binding:  # the first forward: already bound
            return function(*args)
        with bind_cp_group(binding.model, binding.cp_group, binding.tp_cp_group):
            return function(*args)
    return run


def install() -> None:
    """Wrap Megatron's ``tensor_parallel.checkpoint`` (once per process)."""
    tp = mcore.tensor_parallel
    original = tp.checkpoint

    @functools.wraps(original)
    def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool,
                   *args: Any) -> Any:
        return original(rebound(function, active()), distribute_saved_activations, *args)

    tp.checkpoint = checkpoint
