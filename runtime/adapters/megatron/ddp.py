"""Gradient synchronisation over the pool, in the shape Megatron's ``finalize_model_grads`` calls.

Megatron's ``DistributedDataParallel`` keeps gradients in contiguous CUDA buffers (its
``param_and_grad_buffer.py`` allocates on ``torch.cuda.current_device()`` and uses CUDA streams),
so on the CPU the adapter wraps each model chunk in ``PoolGradSync`` instead: the same methods
``finalize_model_grads`` and the schedules use (``finish_grad_sync``, ``scale_gradients``,
``zero_grad_buffer``, ``ddp_config``), implemented as one all-reduce (sum) per gradient over the
pool group. Summing, not averaging, is Megatron's rule under ``calculate_per_token_loss``
(``gradient_scaling_factor = 1``): ``finalize_model_grads`` divides by the pool's token count
afterwards. No overlap with the backward and no bucketing: it is exact and simple, not fast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron import mcore


class PoolGradSync(nn.Module):
    """A model chunk whose gradients are summed over ``group`` when the step finishes."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.module = module
        self.group = group if group is not None and group.size() > 1 else None
        self.ddp_config = mcore.DistributedDataParallelConfig()
        self.config = module.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: Any) -> None:
        setter: Any = self.module.set_input_tensor
        setter(tensor)

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Sum every gradient over the pool (zeros for parameters this rank did not use)."""
        del force_all_reduce
        handles = []
        for p in self.module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.group is not None:
                handles.append(dist.all_reduce(p.grad, group=self.group, async_op=True))
        for h in handles:
            h.wait()

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, scaling_factor)
