"""``dcp-train --reference --framework torchtitan``: the oracle of the torchtitan run.

One process, no CP, no packing, no FSDP: the same llama3 (same config, same seeded weights as
``PlanTrainer.load_seeded_weights``), each sample segment of a step alone as a batch of one with
positions 0..n-1 and plain causal SDPA, loss = sum of token losses / number of loss tokens of
the step, AdamW with the trainer's hyperparameters and per-tensor arithmetic. Labels follow the
plan's rule, written out here again on purpose (the oracle shares no data code with what it
checks): the next token of the same sample; a segment's last token is labelled only when its
sample continues past it.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import replace

import torch

from runtime.adapters.torchtitan.attention import PlanMasks
from runtime.adapters.torchtitan.config import ADAMW_BETAS, ADAMW_EPS
from runtime.adapters.torchtitan.model import build_llama3, llama3_config
from runtime.adapters.torchtitan.section import max_seq_len
from runtime.adapters.torchtitan.titan import LRSchedulersContainer
from runtime.adapters.torchtitan.trainer import PlanTrainer
from runtime.adapters.torchtitan.validate import PlanValidator
from runtime.data.evaluation import check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.tokens import TokenSource
from runtime.train.config import TrainConfig, should_evaluate
from runtime.train.model import GPTConfig, sequence_attention
from runtime.train.oracle import SegmentLogits, reference_eval, reference_step
from runtime.train.procgroup import resolve_device
from runtime.train.runlog import StepLogger, TrainResult


def _logits(model: torch.nn.Module, cfg: TrainConfig) -> SegmentLogits:
    """torchtitan's llama3 on one whole segment (positions 0..n-1): logits ``[n, V]``."""
    def logits_of(seq: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(seq), device=seq.device)[None]
        with torch.autocast(seq.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16"):
            out: torch.Tensor = model(seq[None], positions=positions,
                                      attention_masks=PlanMasks(sequence_attention))
        return out[0]
    return logits_of


def train_reference(cfg: TrainConfig, model_config: GPTConfig) -> TrainResult:
    """Run the oracle for ``cfg``'s steps; returns the logs and the final weights and grads."""
    if cfg.resume or cfg.save:
        raise ValueError("--reference --framework torchtitan does not checkpoint (--save, "
                         "--resume): run the whole range of steps instead")
    device = resolve_device(cfg)
    reader = PlanReader(cfg.plan)
    source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field,
                              tokenizer=cfg.tokenizer, vocab_size=model_config.vocab_size)
    evaluation: tuple[PlanReader, TokenSource] | None = None
    if cfg.eval_plan:
        # The same refusals as the replayed run: the oracle evaluates what it would evaluate.
        eval_reader = PlanReader(cfg.eval_plan)
        check_eval_layout(eval_reader.header, reader.header, eval_source=cfg.eval_plan,
                          train_source=cfg.plan)
        eval_source = open_plan_source(eval_reader, cfg.eval_dataset, field=cfg.eval_field,
                                       tokenizer=cfg.eval_tokenizer(eval_reader.header),
                                       vocab_size=model_config.vocab_size)
        evaluation = (eval_reader, eval_source)
    config = llama3_config(model_config, max_seq_len=max_seq_len(reader))
    model = build_llama3(config, seed=cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAMW_BETAS,
                                  eps=ADAMW_EPS, weight_decay=cfg.weight_decay, foreach=False)
    logger = StepLogger(cfg, enabled=True)
    result = TrainResult()
    stop = min(cfg.steps, reader.num_steps) if cfg.steps else reader.num_steps
    try:
        logits_of = _logits(model, cfg)
        vocab = model_config.vocab_size
        for step in range(stop):
            log = reference_step(model, optimizer, reader, source, step, vocab, cfg, device,
                                 logits_of)
            result.logs.append(log)
            logger.write(log)
            if evaluation is not None and should_evaluate(cfg, step, stop - 1):
                ev = reference_eval(model, *evaluation, cfg, step, vocab, device, logits_of)
                result.evals.append(ev)
                logger.write(ev)
    finally:
        logger.close()
        reader.close()
        if evaluation is not None:
            evaluation[0].close()
    result.state = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
    result.grads = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()
                    if p.grad is not None}
    return result


def lr_factor(step: int, config: LRSchedulersContainer.Config, training_steps: int) -> float:
    """The learning-rate factor torchtitan's warmup-stable-decay schedule gives 0-based
    ``step`` (written out here from its documented rule, not imported): linear warmup over
    ``warmup_steps`` (step k at (k+1)/warmup), flat, then ``decay_type`` over the last
    ``decay_ratio`` of the steps (all after warmup when None) towards ``min_lr_factor``, with a
    virtual step past the end so the last rate is not 0."""
    total = config.total_steps if config.total_steps is not None else training_steps
    warmup = min(int(config.warmup_steps), total)
    decay = total - warmup if config.decay_ratio is None else round(total * config.decay_ratio)
    decay = min(decay, total - warmup)
    flat_end = total + 1 - decay  # warmup + stable steps
    if step < warmup:
        return (step + 1) / warmup
    if step < flat_end:
        return 1.0
    progress = (step + 1 - flat_end) / decay
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[config.decay_type]
    floor = float(config.min_lr_factor)
    return floor + (1 - floor) * shape


def _adamw(model: torch.nn.Module, config: PlanTrainer.Config) -> torch.optim.AdamW:
    groups = config.optimizer.param_groups
    if len(groups) != 1 or groups[0].optimizer_name != "AdamW" or groups[0].pattern != ".*":
        raise ValueError("the oracle runs torchtitan's default_adamw (one AdamW group) only")
    kwargs = groups[0].optimizer_kwargs
    return torch.optim.AdamW(model.parameters(), lr=kwargs["lr"], betas=tuple(kwargs["betas"]),
                             eps=kwargs["eps"], weight_decay=kwargs["weight_decay"],
                             foreach=False)


def reference_of_config(config: PlanTrainer.Config, *, steps: int = 0) -> TrainResult:
    """The oracle of a registry job (``--module runtime.adapters.torchtitan.registry``): its
    parsed ``config`` (plan section applied, ``seed`` set), one process, every segment alone,
    the same AdamW, lr schedule (``lr_factor``) and gradient clipping (``max_norm``), and the
    eval plan after the steps torchtitan's validator runs it. ``steps``: the first ones only
    (0: ``training.steps``). The final weights and gradients are not kept."""
    loader, training, validator = config.dataloader, config.training, config.validator
    if config.seed is None or config.model_spec is None:
        raise ValueError("the oracle needs --seed (the trainer's weights) and a model")
    evaluates = isinstance(validator, PlanValidator.Config) and validator.enable
    cfg = TrainConfig(plan=loader.plan, dataset=loader.dataset, datasets=tuple(loader.datasets),
                      field=loader.field, tokenizer=loader.tokenizer_path, quiet=True)
    model = build_llama3(config.model_spec.model, seed=config.seed)
    optimizer = _adamw(model, config)
    base_lr = float(optimizer.param_groups[0]["lr"])
    logits_of = _logits(model, cfg)
    vocab = int(config.model_spec.model.vocab_size)
    cpu = torch.device("cpu")
    result = TrainResult()
    with ExitStack() as stack:
        reader = stack.enter_context(PlanReader(loader.plan))
        source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field,
                                  tokenizer=cfg.tokenizer, vocab_size=vocab)
        if evaluates:
            eval_reader = stack.enter_context(PlanReader(validator.plan))
            eval_source = open_plan_source(eval_reader, validator.dataset, field=validator.field)
            eval_cfg = replace(cfg, eval_plan=validator.plan, eval_dataset=validator.dataset,
                               eval_steps=validator.max_steps)
        for step in range(steps or training.steps):
            for group in optimizer.param_groups:
                group["lr"] = base_lr * lr_factor(step, config.lr_scheduler, training.steps)
            result.logs.append(reference_step(model, optimizer, reader, source, step, vocab,
                                              cfg, cpu, logits_of,
                                              clip_grad=float(training.max_norm)))
            # torchtitan's validator counts completed steps (step + 1).
            if evaluates and (step + 1 == validator.last_step or (
                    validator.interval > 0 and (step + 1) % validator.interval == 0)):
                result.evals.append(reference_eval(model, eval_reader, eval_source, eval_cfg,
                                                   step, vocab, cpu, logits_of))
    return result
