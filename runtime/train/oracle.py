"""The oracle for the replayed run: one process, no CP, no packing (``dcp-train --reference``).

For each step it takes every sample segment of the step from the plan, runs each as its own
sequence with full causal attention (SDPA), and uses loss = sum over all loss tokens / count,
from the same initial weights (same seed) and with the same optimizer. Labels follow
``runtime.data.batch``'s rule, written out again here on purpose (an oracle shares no code with what
it checks beyond the model): the next token of the same sample, and for a segment that stops
before its sample's end, the sample's next token. With an eval plan, ``evaluate_reference`` runs
the same evaluation the same way (every segment alone, no gradients) at the same steps.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from runtime.data.evaluation import check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.tokens import TokenSource
from runtime.train import checkpoint
from runtime.train.build import (
    autocast_context,
    build_model,
    build_optimizer,
    check_saved_optimizer,
    checkpoint_meta,
    copy_final_state,
)
from runtime.train.config import TrainConfig, should_evaluate, step_range
from runtime.train.guards import nonfinite_ok
from runtime.train.model import GPT, GPTConfig, check_token_ids, sequence_attention
from runtime.train.preflight import (
    announce_resume,
    check_resume_step,
    require_training_plan,
    run_inputs,
)
from runtime.train.procgroup import resolve_device
from runtime.train.runlog import EvalLog, StepLog, StepLogger, TrainResult


def sequences_of_step(reader: PlanReader, source: TokenSource, step: int, vocab_size: int = 0
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens, labels, loss mask) of every sample segment of ``step``, in plan order.

    Labels are the next token of the same sample: inside the segment, and for its last token
    the sample's next token when the segment stops before the sample's end (split samples).
    """
    plan = reader.step(step)
    lengths = source.lengths()
    for s, off, n in zip(plan.sample_index.tolist(), plan.token_offset.tolist(),
                         plan.num_tokens.tolist(), strict=True):
        if s < 0:
            continue
        extra = 1 if off + n < int(lengths[s]) else 0
        read = torch.from_numpy(source.read(s, off, n + extra).astype(np.int64))
        if vocab_size:
            where = functools.partial("step {} sample {}".format, step, s)
            check_token_ids(read, vocab_size, where)
        tokens = read[:n]
        labels = torch.zeros(n, dtype=torch.int64)
        labels[: n + extra - 1] = read[1:]
        mask = torch.zeros(n, dtype=torch.float32)
        mask[: n + extra - 1] = 1.0
        yield tokens, labels, mask


SegmentLogits = Callable[[torch.Tensor], torch.Tensor]
"""One whole segment's token ids ``[n]`` (on the device) -> its logits ``[n, V]``: the framework's
model, positions 0..n-1, full causal attention, under the run's autocast."""

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(tokens, labels, loss mask) of one segment (``sequences_of_step``)."""


class SegmentTerms(Protocol):
    """Loss terms an engine's oracle adds to the LM loss (Megatron's MoE load balancing and
    multi-token prediction), computed with the same every-segment-alone rule."""

    def begin_step(self, step: int, segments: list[Segment]) -> None:
        """Before the step's first backward: every segment (on the device), in plan order."""

    def extra(self, index: int) -> torch.Tensor | None:
        """After segment ``index``'s forward: a term added to its loss sum (backpropagated;
        divided by the step's loss tokens with it), or None."""

    def end_step(self, loss_tokens: float) -> dict[str, Any]:
        """The step log's extra fields (``StepLog``)."""


def segment_loss_sum(logits_of: SegmentLogits, seq: torch.Tensor, labels: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """The summed token loss of one segment (fp32 cross-entropy, masked)."""
    losses = F.cross_entropy(logits_of(seq).float(), labels, reduction="none")
    return (losses * mask).sum()


def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reader: PlanReader,
                   source: TokenSource, step: int, vocab_size: int, cfg: TrainConfig,
                   device: torch.device, logits_of: SegmentLogits, *,
                   clip_grad: float | None = None, terms: SegmentTerms | None = None) -> StepLog:
    """One oracle step, every framework's: each segment alone, loss = sum / loss tokens of the
    step (gradients likewise), the non-finite guard, then the optimizer.

    ``clip_grad`` (an engine whose optimizer reports the gradient norm, Megatron's): the
    global norm of the gradients is logged, and they are clipped to it when it is > 0.
    ``terms``: loss terms beyond the LM loss (``SegmentTerms``), in the gradient, not in the
    logged loss."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    total, count, tokens = 0.0, 0.0, 0
    segments: Iterable[Segment] = sequences_of_step(reader, source, step, vocab_size)
    if terms is not None:
        segments = [(a.to(device), b.to(device), c.to(device)) for a, b, c in segments]
        terms.begin_step(step, segments)
    for index, (seq, labels, mask) in enumerate(segments):
        seq, labels, mask = seq.to(device), labels.to(device), mask.to(device)
        loss_sum = segment_loss_sum(logits_of, seq, labels, mask)
        extra = terms.extra(index) if terms is not None else None
        (loss_sum if extra is None else loss_sum + extra).backward()  # type: ignore[no-untyped-call]
        total += float(loss_sum.detach())
        count += float(mask.sum())
        tokens += len(seq)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(max(count, 1.0))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    skipped = not nonfinite_ok(step, total / max(count, 1.0), grads,
                               skip=cfg.skip_nonfinite_steps)
    grad_norm = None
    if not skipped:
        if clip_grad is not None:
            norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad) if clip_grad
                    else torch.nn.utils.get_total_norm(grads))
            grad_norm = float(norm)
        optimizer.step()
    fields = terms.end_step(count) if terms is not None else {}
    return StepLog(step=step, loss=total / max(count, 1.0), tokens=tokens, loss_tokens=int(count),
                   microbatches=0, seconds=time.perf_counter() - t0, skipped=skipped,
                   grad_norm=grad_norm, **fields)


def reference_eval(model: torch.nn.Module, reader: PlanReader, source: TokenSource,
                   cfg: TrainConfig, after_step: int, vocab_size: int, device: torch.device,
                   logits_of: SegmentLogits) -> EvalLog:
    """The oracle's evaluation, every framework's, after training step ``after_step``
    (0-based): the eval plan's first ``cfg.eval_steps`` steps (0: all), every segment alone, no
    gradients; loss = sum over loss tokens / count."""
    t0 = time.perf_counter()
    num_steps = min(cfg.eval_steps, reader.num_steps) if cfg.eval_steps else reader.num_steps
    total, count = 0.0, 0.0
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            for step in range(num_steps):
                for seq, labels, mask in sequences_of_step(reader, source, step, vocab_size):
                    seq, labels, mask = seq.to(device), labels.to(device), mask.to(device)
                    total += float(segment_loss_sum(logits_of, seq, labels, mask))
                    count += float(mask.sum())
    finally:
        model.train(was_training)
    return EvalLog(after_step=after_step, eval_loss=total / max(count, 1.0),
                   eval_tokens=int(count), eval_microbatches=0,
                   seconds=time.perf_counter() - t0)


def _native_logits(model: GPT, cfg: TrainConfig, device: torch.device) -> SegmentLogits:
    def logits_of(seq: torch.Tensor) -> torch.Tensor:
        with autocast_context(cfg, device):
            out: torch.Tensor = model(seq, torch.arange(len(seq), device=device),
                                      sequence_attention)
        return out
    return logits_of


def evaluate_reference(model: GPT, reader: PlanReader, source: TokenSource, cfg: TrainConfig,
                       after_step: int, device: torch.device) -> EvalLog:
    """The native oracle's evaluation (``reference_eval`` with the native GPT)."""
    return reference_eval(model, reader, source, cfg, after_step, model.config.vocab_size,
                          device,
                          _native_logits(model, cfg, device))


def train_reference(cfg: TrainConfig, model_config: GPTConfig, *,
                    keep_state: bool = False) -> TrainResult:
    """The oracle: every sequence alone, full causal attention, loss = sum / count per step."""
    device = resolve_device(cfg)
    reader = PlanReader(cfg.plan)
    require_training_plan(reader.header.kind, cfg.plan)
    source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field,
                              tokenizer=cfg.tokenizer, vocab_size=model_config.vocab_size)
    eval_reader = eval_source = None
    if cfg.eval_plan:
        # The same refusals as the replayed run: the oracle evaluates what it would evaluate.
        eval_reader = PlanReader(cfg.eval_plan)
        check_eval_layout(eval_reader.header, reader.header, eval_source=cfg.eval_plan,
                          train_source=cfg.plan)
        eval_source = open_plan_source(eval_reader, cfg.eval_dataset, field=cfg.eval_field,
                                       tokenizer=cfg.eval_tokenizer(eval_reader.header),
                                       vocab_size=model_config.vocab_size)
    model = build_model(model_config, cfg.seed, device)
    optimizer = build_optimizer(model, cfg)
    meta = checkpoint_meta(model_config, reader)
    start = 0
    if cfg.resume:
        resumed = checkpoint.load(cfg.resume, model=model, optimizer=optimizer, rank=0,
                                  expect_meta=meta)
        check_saved_optimizer(cfg, optimizer, resumed.directory)
        start = resumed.next_step
        if check_resume_step(cfg, start, reader.num_steps):
            announce_resume(resumed.directory, start)  # the one loaded
    if cfg.save:
        stop = step_range(cfg, start, reader.num_steps).stop
        checkpoint.check_save_target(cfg.save, 0, writes=checkpoint.native_saves(
            start, stop, cfg.save_every), inputs=run_inputs(cfg))
    logger = StepLogger(cfg, enabled=True)
    result = TrainResult()
    try:
        steps = step_range(cfg, start, reader.num_steps)
        logger.begin(len(steps))
        logits_of = _native_logits(model, cfg, device)
        for step in steps:
            log = reference_step(model, optimizer, reader, source, step, model_config.vocab_size,
                                 cfg, device, logits_of)
            result.logs.append(log)
            logger.write(log)
            if eval_reader is not None and eval_source is not None \
                    and should_evaluate(cfg, step, steps[-1]):
                ev = evaluate_reference(model, eval_reader, eval_source, cfg, step, device)
                result.evals.append(ev)
                logger.write(ev)
            if cfg.save and (step == steps[-1] or (cfg.save_every
                                                  and (step + 1) % cfg.save_every == 0)):
                checkpoint.save(cfg.save, model=model, optimizer=optimizer, next_step=step + 1,
                                meta=meta, rank=0)
    finally:
        logger.close()
        for obj in (eval_reader, eval_source):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
    if keep_state:
        copy_final_state(result, model)
    return result


