"""Memory before launch: ``dcp-train`` refuses, before its first step, a run whose heaviest
microbatch would not fit a rank (``check_memory``), naming the step, the microbatch and both
figures, instead of ending in the kernel's OOM killer (torchrun's bare ``exitcode -9``).

The estimate is ``planner.memory``'s, from the plan's rows over the steps this run takes, the
model's shape and the attention backend. The budget: on CUDA the GPU's total memory (one rank a
GPU); on CPU the host's available memory (``MemAvailable``, or less under a cgroup limit) shared
by this host's ranks, plus the weights a rank already holds. Every rank computes the same
figures from the same plan, so every rank refuses alike (no rank waits on a collective that the
others left). ``--no-memory-check`` skips it (swap, or an estimate known to be pessimistic).

The adapters (``--framework megatron`` / ``torchtitan``) call ``check_adapter_memory``: the same
estimate of the same GPT shape, with the weights, gradients and Adam's moments divided over the
ranks that shard them (torchtitan's FSDP, Megatron's distributed optimizer), and skipped with a
notice where ``planner.memory`` does not model the run (tensor or pipeline parallelism).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from planner.memory import Heaviest, MemoryModel, gib, over_budget, step_heaviest
from runtime.data.plan_reader import PlanReader
from runtime.train.config import TrainConfig
from runtime.train.model import GPTConfig


def memory_model(model_config: GPTConfig, attention: str, device: torch.device) -> MemoryModel:
    """``planner.memory``'s model of this run's GPT and attention backend."""
    c = model_config
    return MemoryModel.from_shape(vocab_size=c.vocab_size, num_layers=c.num_layers,
                                  hidden_size=c.hidden_size, num_heads=c.num_heads,
                                  num_query_groups=c.num_query_groups,
                                  ffn_hidden_size=c.ffn_hidden_size,
                                  tie_embeddings=c.tie_embeddings, attention=attention,
                                  device=device.type)


def heaviest(reader: PlanReader, model: MemoryModel, steps: range) -> Heaviest | None:
    """The microbatch of ``steps`` with the highest per-rank peak."""
    best: Heaviest | None = None
    for step in steps:
        h = step_heaviest(model, step, reader.columns(step))
        if h is not None and (best is None or h.peak_bytes > best.peak_bytes):
            best = h
    return best


def _ranks_on_this_host() -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 1
    from runtime.calibrate.memory import ranks_on_this_host

    return ranks_on_this_host()


def device_budget(model: MemoryModel, device: torch.device) -> tuple[float, str] | None:
    """(bytes a rank may peak at, its description); None where the memory is unknown. A
    collective on CPU (the ranks on this host are counted)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total), f"the GPU's {gib(total)}"
    from runtime.calibrate.memory import host_available_bytes

    ranks = _ranks_on_this_host()
    available = host_available_bytes()
    if available is None:
        return None
    share = available / ranks + model.resident_bytes
    return share, (f"this host's available memory shared by its {ranks} rank(s) "
                   f"({gib(available)} available)")


def shard_state(model: MemoryModel, *, weights: int, optimizer: int) -> MemoryModel:
    """``model`` with its weights and gradients (8 of the 16 bytes a parameter) split over
    ``weights`` ranks and Adam's moments (the other 8) over ``optimizer`` ranks; what a rank holds
    at the check (its weights) over ``weights``. Sharding's gathered buffers are left out, so
    the figure stays below what a rank holds: it refuses only what cannot fit."""
    per_param = model.fixed_bytes / 16.0
    return replace(model, fixed_bytes=per_param * (8.0 / weights + 8.0 / optimizer),
                   resident_bytes=model.resident_bytes / weights)


REMEDY = ("plan with a smaller --max-tokens-per-rank (and --long-sequences split), use fused "
          "attention on CUDA (--attention te, or torch where the engine has it), or pass "
          "--no-memory-check")
"""What a refusal tells ``dcp-train``'s user to do (the Megatron-LM launcher says its own)."""


def check_memory(plan: str, reader: PlanReader, model_config: GPTConfig, attention: str,
                 device: torch.device, steps: range, *, weight_shards: int = 1,
                 optimizer_shards: int = 1, remedy: str = REMEDY) -> None:
    """Raise ValueError naming the heaviest microbatch of ``steps`` when it would not fit
    (``shard_state`` for the shards).

    On CPU every rank must call it (it counts the ranks on the host: a collective).
    """
    model = memory_model(model_config, attention, device)
    if weight_shards > 1 or optimizer_shards > 1:
        model = shard_state(model, weights=weight_shards, optimizer=optimizer_shards)
    budget = device_budget(model, device)
    found = heaviest(reader, model, steps)
    if budget is None or found is None or found.peak_bytes <= budget[0]:
        return
    raise ValueError(f"{plan}: {over_budget(found, model, budget[0], budget[1])}; {remedy}")


def check_adapter_memory(cfg: TrainConfig, reader: PlanReader, model_config: GPTConfig,
                         device: torch.device, steps: range, *, weight_shards: int = 1,
                         optimizer_shards: int = 1, unmodelled: str = "") -> None:
    """``check_memory`` for an adapter, before its first step, on every rank (the same figures
    from the same plan on each, so all refuse alike). Nothing with ``--no-memory-check``; a
    one-line notice (rank 0) instead of a check where ``unmodelled`` names what
    ``planner.memory`` does not model. MoE and MTP are estimated as the dense model (the caller
    passes the expert width as ``ffn_hidden_size``; the other experts and the MTP layers are not
    counted): rough and low, so it refuses only what even that part cannot fit."""
    if not cfg.memory_check:
        return
    if unmodelled:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"dcp-train: memory check skipped: planner/memory.py does not model "
                  f"{unmodelled} (--no-memory-check silences this)", file=sys.stderr, flush=True)
        return
    check_memory(cfg.plan, reader, model_config, cfg.attention, device, steps,
                 weight_shards=weight_shards, optimizer_shards=optimizer_shards)
