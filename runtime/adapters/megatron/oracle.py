"""The oracle of ``--framework megatron``: ``dcp-train --reference --framework megatron``.

One process, no CP, no TP, no PP, no packing: the same Megatron ``GPTModel`` (same shape, same
split-independent initial weights, ``model.init_weights``) with ``SequenceCoreAttention`` (plain
causal SDPA), and every sample segment of a step run alone as a ``[1, L]`` batch. The step's
loss is the sum over every loss token divided by their count, the gradients likewise, then the
same AdamW. Segments and labels come from the native oracle's rule
(``runtime.train.oracle.sequences_of_step``), which shares nothing with the replay path
(``runtime.data.batch``) that the Megatron run uses.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron import patches
from runtime.adapters.megatron.groups import create_groups
from runtime.adapters.megatron.loss import sequence_loss
from runtime.adapters.megatron.model import (
    ModelParallel,
    build_chunks,
    global_names,
    init_weights,
    transformer_config,
)
from runtime.data.evaluation import check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.dist.topology import Topology
from runtime.train.common import (
    DTYPES,
    EvalLog,
    StepLog,
    StepLogger,
    TrainConfig,
    TrainResult,
    pg_timeout,
    resolve_device,
    should_evaluate,
    step_range,
)
from runtime.train.guards import nonfinite_ok
from runtime.train.model import GPTConfig
from runtime.train.oracle import sequences_of_step


def train_reference(cfg: TrainConfig, model_config: GPTConfig, *,
                    keep_state: bool = False) -> TrainResult:
    """Run the oracle; needs a process group of one rank (``init_process_group``)."""
    if dist.get_world_size() != 1:
        raise ValueError("--reference runs in one process; launch it without torchrun")
    if cfg.save or cfg.resume:
        raise ValueError("--framework megatron: --save/--resume are not supported yet")
    device = resolve_device(cfg)
    patches.apply_patches(device)
    reader = PlanReader(cfg.plan)
    source = open_plan_source(reader, cfg.dataset_paths)
    try:
        header = reader.header
        par = ModelParallel(dtype=DTYPES[cfg.dtype])
        config = transformer_config(model_config, par)
        groups = create_groups(Topology(world_size=1, rank=0, dp=1, cp=1), (1,),
                               timeout=pg_timeout(cfg.distributed_timeout_minutes))
        chunks = build_chunks(model_config, config, groups.pg_collection, attention="sequence",
                              pp_rank=0, max_sequence_length=header.capacity_tokens_per_rank
                              * header.parallel.pool_size)
        init_weights(chunks, model_config, seed=cfg.seed, tp=1, tp_rank=0)
        model = chunks[0].to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                      weight_decay=cfg.weight_decay, foreach=False)
        eval_reader = eval_source = None
        if cfg.eval_plan:  # the same refusals as the distributed run
            eval_reader = PlanReader(cfg.eval_plan)
            check_eval_layout(eval_reader.header, header, eval_source=cfg.eval_plan,
                              train_source=cfg.plan)
            eval_source = open_plan_source(eval_reader, cfg.eval_dataset)
        logger = StepLogger(cfg, enabled=True)
        result = TrainResult()
        try:
            steps = step_range(cfg, 0, reader.num_steps)
            for step in steps:
                result.logs.append(_step(model, optimizer, reader, source, step, model_config,
                                         cfg, device))
                logger.write(result.logs[-1])
                if eval_reader is not None and should_evaluate(cfg, step, steps[-1]):
                    result.evals.append(_evaluate(model, eval_reader, eval_source, cfg,
                                                  step + 1, device, model_config.vocab_size))
                    logger.write(result.evals[-1])
        finally:
            logger.close()
            for obj in (eval_reader, eval_source):
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
        if keep_state:
            names = global_names(model)
            result.state = {names[n]: p.detach().cpu().clone()
                            for n, p in model.named_parameters()}
        return result
    finally:
        reader.close()
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _evaluate(model: torch.nn.Module, reader: PlanReader, source: Any, cfg: TrainConfig,
              at_step: int, device: torch.device, vocab_size: int) -> EvalLog:
    """The oracle's evaluation: the eval plan's first ``eval_steps`` steps, every segment alone,
    no gradients; loss = sum over loss tokens / count."""
    t0 = time.perf_counter()
    num_steps = min(cfg.eval_steps, reader.num_steps) if cfg.eval_steps else reader.num_steps
    total, count = 0.0, 0.0
    dtype = DTYPES[cfg.dtype]
    model.train(False)
    try:
        with torch.no_grad():
            for step in range(num_steps):
                for seq, labels, mask in sequences_of_step(reader, source, step, vocab_size):
                    seq, labels, mask = seq.to(device), labels.to(device), mask.to(device)
                    positions = torch.arange(len(seq), device=device)[None]
                    with torch.autocast(device.type, dtype=dtype,
                                        enabled=dtype != torch.float32):
                        logits = model(seq[None], positions, None)
                    total += float(sequence_loss(logits, labels, mask))
                    count += float(mask.sum())
    finally:
        model.train(True)
    return EvalLog(eval_at_step=at_step, eval_loss=total / max(count, 1.0),
                   eval_tokens=int(count), eval_microbatches=0,
                   seconds=time.perf_counter() - t0)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader: PlanReader,
          source: object, step: int, model_config: GPTConfig, cfg: TrainConfig,
          device: torch.device) -> StepLog:
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    total, count, tokens = 0.0, 0.0, 0
    dtype = DTYPES[cfg.dtype]
    for seq, labels, mask in sequences_of_step(reader, source, step,  # type: ignore[arg-type]
                                               model_config.vocab_size):
        seq, labels, mask = seq.to(device), labels.to(device), mask.to(device)
        positions = torch.arange(len(seq), device=device)[None]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(seq[None], positions, None)
        loss_sum = sequence_loss(logits, labels, mask)
        loss_sum.backward()  # type: ignore[no-untyped-call]
        total += float(loss_sum.detach())
        count += float(mask.sum())
        tokens += len(seq)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(max(count, 1.0))
    skipped = not nonfinite_ok(step, total / max(count, 1.0),
                               [p.grad for p in model.parameters() if p.grad is not None],
                               skip=cfg.skip_nonfinite_steps)
    if not skipped:
        optimizer.step()
    return StepLog(step=step, loss=total / max(count, 1.0), tokens=tokens, loss_tokens=int(count),
                   microbatches=0, seconds=time.perf_counter() - t0, skipped=skipped)


__all__ = ["train_reference"]
