"""Gradient synchronisation over the pool: Megatron's ``DistributedDataParallel``, or the
adapter's plain all-reduce (``PoolGradSync``), both in the shape Megatron's schedules and
``finalize_model_grads`` call.

**Megatron's DDP** (``wrap_chunks(..., grad_sync="megatron-ddp")``, the default): every model
chunk is wrapped in ``megatron.core.distributed.DistributedDataParallel`` over the pool group
(``pg_collection.dp_cp``): fp32 ``main_grad`` buffers, buckets, ``overlap_grad_reduce`` (bucket
reductions launched during the backward of the step's last microbatch), and with the
distributed optimizer a reduce-scatter of each bucket instead of an all-reduce. Under the
per-token loss (``calculate_per_token_loss``) DDP sums, it does not average
(``gradient_scaling_factor = 1``); ``finalize_model_grads`` then divides every gradient by the
pool's token count. Chunks after the first are built with bucketing off, as Megatron-LM does
for the interleaved schedule. ``schedule_hooks`` sets the config callbacks the schedules use
(``no_sync_func`` so only the last microbatch reduces, ``grad_sync_func`` for the interleaved
schedule's aligned reductions).

**PoolGradSync** (``grad_sync="pool"``): one all-reduce (sum) per gradient over the pool when
the step finishes, no buckets, no overlap, gradients in ``p.grad``. It stays for one reason:
it is the baseline Megatron's DDP is benchmarked against (``BENCHMARKS.md``); nothing else
needs it.

``grad_tensors`` names where gradients live for the non-finite guard (``main_grad`` under
DDP, ``grad`` otherwise); ``reduced_grads`` gives each parameter's reduced gradient on this
rank (with the distributed optimizer only the elements of this rank's shard are reduced).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron.compat import mcore
from runtime.train.megatron_options import MegatronOptions


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


def ddp_config(options: MegatronOptions, *, bf16: bool) -> Any:
    """Megatron's ``DistributedDataParallelConfig`` for ``options`` (fp32 grads under bf16)."""
    return mcore.DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16,  # bf16 weights, fp32 main_grad: Megatron-LM's bf16 default
        overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather,
        use_distributed_optimizer=options.use_distributed_optimizer,
        bucket_size=options.ddp_bucket_size,
        average_in_collective=False,  # per-token loss: sum, then divide by the token count
    )


def wrap_chunks(chunks: list[nn.Module], config: Any, pg_collection: Any,
                pool_group: dist.ProcessGroup, options: MegatronOptions,
                caller_ddp_config: Any = None) -> tuple[list[nn.Module], MegatronOptions]:
    """Each chunk wrapped for gradient synchronisation over the pool (module docstring), and
    the options that then hold: ``caller_ddp_config`` (a ``DistributedDataParallelConfig``
    of the caller's) decides them when given; otherwise ``options`` does."""
    if caller_ddp_config is not None:
        cfg = caller_ddp_config
        options = MegatronOptions(use_distributed_optimizer=cfg.use_distributed_optimizer,
                                  overlap_grad_reduce=cfg.overlap_grad_reduce,
                                  overlap_param_gather=cfg.overlap_param_gather)
    elif options.grad_sync == "pool":
        return [PoolGradSync(c, pool_group) for c in chunks], options
    else:
        cfg = ddp_config(options, bf16=bool(config.bf16))
    wrapped: list[nn.Module] = [
        mcore.DistributedDataParallel(config, cfg, c, disable_bucketing=i > 0,
                                      pg_collection=pg_collection)
        for i, c in enumerate(chunks)]
    return wrapped, options


def schedule_hooks(config: Any, chunks: list[nn.Module], options: MegatronOptions) -> None:
    """The schedules' DDP callbacks on ``config`` (Megatron-LM's training loop sets the same)."""
    if options.grad_sync == "pool" or not options.overlap_grad_reduce:
        return
    # Without no_sync every microbatch's backward would launch the bucket reductions.
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
    # Aligned reductions: the interleaved schedule launches each chunk's reductions itself.
    start = [c.start_grad_sync for c in chunks]
    config.grad_sync_func = start[0] if len(chunks) == 1 else start


def grad_tensors(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """Where this rank's gradients live: ``main_grad`` under Megatron's DDP, else ``grad``."""
    out = []
    for c in chunks:
        for p in c.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                out.append(g)
    return out


def sync_params(chunks: list[nn.Module], options: MegatronOptions) -> None:
    """Finish any parameter all-gather still in flight (``--overlap-param-gather`` leaves them
    to the next forward): before the parameters are read, saved or compared."""
    if options.use_distributed_optimizer and options.grad_sync != "pool":
        for c in chunks:
            start: Any = c.start_param_sync
            start(force_sync=True)


def reduced_grads(chunk: nn.Module, options: MegatronOptions
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Local parameter name -> (flat element indices, values) of its reduced gradient on this
    rank: every element under a full reduction, this rank's shard of each bucket under the
    distributed optimizer (the rest of its buffer is unreduced)."""
    names = {id(p): n for n, p in _unwrap(chunk).named_parameters()}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if not options.use_distributed_optimizer or options.grad_sync == "pool":
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                out[names[id(p)]] = (torch.arange(g.numel()), g.detach().reshape(-1).cpu().clone())
        return out
    ddp: Any = chunk
    for buffer in ddp.buffers:
        size = buffer.data_parallel_world_size
        rank = dist.get_rank(buffer.data_parallel_group) if size > 1 else 0
        for p, (start, end, bucket_id) in buffer.param_index_map.items():
            # Buffer offsets (params are padded apart under the distributed optimizer); each
            # bucket is cut into `size` equal shards and shard `rank` is reduced here.
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // size
            lo, hi = bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard
            a, b = max(start, lo), min(end, hi)
            if a < b:
                values = buffer.grad_data[a:b].detach().cpu().clone()
                out[names[id(p)]] = (torch.arange(a - start, b - start), values)
    return out


def _unwrap(chunk: nn.Module) -> nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk
