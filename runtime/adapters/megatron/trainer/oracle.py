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

from typing import Any

import torch
import torch.distributed as dist

from runtime.adapters.megatron.binding.groups import create_groups
from runtime.adapters.megatron.binding.install import install
from runtime.adapters.megatron.model.gpt import (
    ModelParallel,
    build_chunks,
    global_names,
    init_weights,
    transformer_config,
)
from runtime.adapters.megatron.model.oracle_terms import MoETerms, MTPTerms
from runtime.adapters.megatron.parallel import optim
from runtime.data.evaluation import check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.dist.topology import Topology
from runtime.train.config import DTYPES, TrainConfig, should_evaluate, step_range
from runtime.train.model import GPTConfig
from runtime.train.oracle import SegmentLogits, SegmentTerms, reference_eval, reference_step
from runtime.train.procgroup import pg_timeout, resolve_device
from runtime.train.runlog import StepLogger, TrainResult


def train_reference(cfg: TrainConfig, model_config: GPTConfig, *,
                    keep_state: bool = False) -> TrainResult:
    """Run the oracle; needs a process group of one rank (``init_process_group``)."""
    if dist.get_world_size() != 1:
        raise ValueError("--reference runs in one process; launch it without torchrun")
    if cfg.save or cfg.resume:
        raise ValueError("--reference --framework megatron saves no checkpoint: drop --save "
                         "and --resume")
    device = resolve_device(cfg)
    install(device)
    reader = PlanReader(cfg.plan)
    source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field,
                              tokenizer=cfg.tokenizer, vocab_size=model_config.vocab_size)
    try:
        header = reader.header
        par = ModelParallel(dtype=DTYPES[cfg.dtype])
        # Megatron's own load-balancing loss is off: MoETerms computes the adapter's definition.
        config = transformer_config(model_config, par, cfg.megatron,
                                    **({"moe_aux_loss_coeff": 0.0} if cfg.megatron.moe else {}))
        model = reference_model(model_config, config, header, seed=cfg.seed, device=device,
                                timeout=pg_timeout(cfg.distributed_timeout_minutes))
        # Megatron's parameter groups (no weight decay on 1-D parameters), plain AdamW.
        optimizer = optim.adamw(cfg, [model])
        eval_reader = eval_source = None
        if cfg.eval_plan:  # the same refusals as the distributed run
            eval_reader = PlanReader(cfg.eval_plan)
            check_eval_layout(eval_reader.header, header, eval_source=cfg.eval_plan,
                              train_source=cfg.plan)
            eval_source = open_plan_source(
                eval_reader, cfg.eval_dataset, field=cfg.eval_field,
                tokenizer=cfg.eval_tokenizer(eval_reader.header),
                vocab_size=model_config.vocab_size)
        logger = StepLogger(cfg, enabled=True)
        result = TrainResult()
        try:
            steps = step_range(cfg, 0, reader.num_steps)
            mtp_logits: dict[str, torch.Tensor] = {}
            logits_of = segment_logits(model, cfg, device, mtp_logits)
            terms: SegmentTerms | None = None
            if cfg.megatron.moe:
                terms = MoETerms(model, cfg.megatron, reader, logits_of)
            elif cfg.megatron.mtp_num_layers:
                terms = MTPTerms(cfg.megatron, mtp_logits)
            vocab = model_config.vocab_size
            for step in steps:
                result.logs.append(reference_step(model, optimizer, reader, source, step, vocab,
                                                  cfg, device, logits_of,
                                                  clip_grad=cfg.megatron.clip_grad, terms=terms))
                logger.write(result.logs[-1])
                if keep_state and step == steps[0]:  # the first step's gradients (tests)
                    names = global_names(model)
                    result.grads = {names[n]: p.grad.detach().cpu().clone()
                                    for n, p in model.named_parameters() if p.grad is not None}
                if eval_reader is not None and eval_source is not None \
                        and should_evaluate(cfg, step, steps[-1]):
                    result.evals.append(reference_eval(model, eval_reader, eval_source, cfg,
                                                       step, vocab, device, logits_of))
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


def reference_model(model_config: GPTConfig, config: Any, header: Any, *, seed: int,
                    device: torch.device, timeout: Any = None) -> torch.nn.Module:
    """The oracle's model: the adapter's GPTModel unsplit, whole-sequence attention, the
    split-independent weights of ``seed`` (shared with the Megatron-LM launcher's oracle)."""
    groups = create_groups(Topology(world_size=1, rank=0, dp=1, cp=1), (1,), timeout=timeout)
    chunks = build_chunks(model_config, config, groups.pg_collection, attention="sequence",
                          pp_rank=0, max_sequence_length=header.capacity_tokens_per_rank
                          * header.parallel.pool_size)
    init_weights(chunks, model_config, seed=seed, tp=1, tp_rank=0)
    return chunks[0].to(device)


def segment_logits(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
            mtp_logits: dict[str, torch.Tensor]) -> SegmentLogits:
    """Megatron's GPTModel on one whole segment as a ``[1, L]`` batch: logits ``[L, V]``; a
    model with multi-token prediction also returns each depth's (``mtp.py``), which go to
    ``mtp_logits["mtp"]`` (``[D * L, V]``, the last segment's)."""
    dtype = DTYPES[cfg.dtype]

    def logits_of(seq: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(seq), device=device)[None]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out: torch.Tensor = model(seq[None], positions, None)
        mtp_logits["mtp"] = out[0, len(seq):]
        return out[0, :len(seq)]
    return logits_of


__all__ = ["reference_model", "segment_logits", "train_reference"]
