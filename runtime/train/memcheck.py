"""Memory before launch: ``dcp-train`` refuses, before its first step, a run whose heaviest
microbatch would not fit a rank (``check_memory``), naming the step, the microbatch and both
figures, instead of ending in the kernel's OOM killer (torchrun's bare ``exitcode -9``).

The estimate is ``planner.memory``'s, from the plan's rows over the steps this run takes, the
model's shape and the attention backend. The budget: on CUDA the GPU's total memory (one rank a
GPU); on CPU the host's available memory (``MemAvailable``, or less under a cgroup limit) shared
by this host's ranks, plus the weights a rank already holds. Every rank computes the same
figures from the same plan, so every rank refuses alike (no rank waits on a collective that the
others left). ``--no-memory-check`` skips it (swap, or an estimate known to be pessimistic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planner.memory import Heaviest, MemoryModel, gib, over_budget, step_heaviest
from runtime.data.plan_reader import PlanReader
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


def check_memory(plan: str, reader: PlanReader, model_config: GPTConfig, attention: str,
                 device: torch.device, steps: range) -> None:
    """Raise ValueError naming the heaviest microbatch of ``steps`` when it would not fit.

    On CPU every rank must call it (it counts the ranks on the host: a collective).
    """
    model = memory_model(model_config, attention, device)
    budget = device_budget(model, device)
    found = heaviest(reader, model, steps)
    if budget is None or found is None or found.peak_bytes <= budget[0]:
        return
    raise ValueError(f"{plan}: {over_budget(found, model, budget[0], budget[1])}; plan with a "
                     f"smaller --max-tokens-per-rank (and --long-sequences split), use fused "
                     f"attention (--attention te or torch on CUDA), or pass --no-memory-check")
