"""Evaluation through Megatron's forward-only schedule, with an eval plan (``--eval-plan``).

``MegatronEvaluator`` opens the eval plan once, checks it against the training plan
(``runtime.data.evaluation.check_eval_layout``: pool, tp and pp must match, its CP sizes must be
in the training catalog; with vpp > 1 each step's microbatch count must be a multiple of the
microbatch group size, as the interleaved schedule needs) and replays it with an
``EvalSchedule`` on the training job's groups. ``run(at_step)`` calls the training schedule once
per eval step with ``forward_only=True`` and ``num_microbatches`` = that step's count, under
``torch.no_grad`` with the chunks in eval mode (restored in a ``finally``), and the same
``forward_step`` as training (CP-group binding, per-token loss). Every rank runs the same steps
and microbatches and stops at the same point (the counts come from the plan). The eval loss is
the sum of the last stage's reports over the pass, all-reduced over the pool: the mean over every
loss token evaluated, whatever CP sizes the eval plan uses. No gradient, optimizer state or RNG
is touched, so training is bit-for-bit the same with or without evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from runtime.adapters.megatron.binding.batch import Batch, PlanBatches
from runtime.adapters.megatron.binding.groups import MegatronGroups
from runtime.data.evaluation import EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.train.config import TrainConfig
from runtime.train.runlog import EvalLog


class MegatronEvaluator:
    """Forward-only passes over ``cfg.eval_plan`` (collective over the job).

    Args:
        cfg: the run's config (``eval_plan``, ``eval_dataset``, ``eval_steps``).
        train_reader: the training plan.
        groups: the training job's groups (none is created).
        num_chunks: model chunks on this rank.
        device: where the model lives.
        vocab_size: token ids are checked against it.

    Raises:
        ValueError: not an eval plan, another layout, the wrong dataset, or microbatch counts
            the interleaved schedule cannot run (on every rank alike, before any evaluation).
    """

    def __init__(self, cfg: TrainConfig, train_reader: PlanReader, groups: MegatronGroups, *,
                 num_chunks: int, device: torch.device, vocab_size: int,
                 mtp_depth: int = 0) -> None:
        self.reader = PlanReader(cfg.eval_plan)
        try:
            self.source = open_plan_source(self.reader, cfg.eval_dataset, field=cfg.eval_field,
                                           tokenizer=cfg.eval_tokenizer(self.reader.header),
                                           vocab_size=vocab_size)
        except BaseException:
            self.reader.close()
            raise
        try:
            check_eval_layout(self.reader.header, train_reader.header,
                              eval_source=cfg.eval_plan, train_source=cfg.plan)
            self.schedule = EvalSchedule(self.reader, self.source, groups.topology,
                                         groups.catalog, max_steps=cfg.eval_steps)
            mult = train_reader.header.parallel.microbatch_multiple
            odd = [m for m in self.schedule.step_num_microbatches if m % mult]
            if odd:
                raise ValueError(f"{cfg.eval_plan}: eval steps with {odd} microbatches; the "
                                 f"interleaved schedule needs multiples of {mult} (plan the "
                                 "eval set with the training job's --vpp)")
            # The same conversion as training (stage fields, padding mask, PackedSeqParams).
            self.batches = PlanBatches(self.reader, self.source, groups, num_chunks=num_chunks,
                                       device=device, vocab_size=vocab_size,
                                       mtp_depth=mtp_depth)
        except BaseException:
            self.close()
            raise
        self.num_chunks = num_chunks

    def _iterator(self, step: int, chunk: int) -> Iterator[Batch]:
        for micro in self.schedule.step_microbatches(step):
            yield self.batches.to_batch(micro.inputs, micro.rows, chunk)

    def run(self, chunks: list[nn.Module], at_step: int,
            schedule_step: Callable[[Any, int, bool], list[dict[str, torch.Tensor]]],
            step_loss: Callable[[list[dict[str, torch.Tensor]]], tuple[float, float]]
            ) -> EvalLog:
        """One pass of the eval plan after ``at_step`` training steps.

        ``schedule_step(data_iterator, num_microbatches, forward_only)`` runs the training
        schedule; ``step_loss(reports)`` reduces the last stage's reports over the pool and
        the pipeline (``MegatronTrainer``'s own helpers, so evaluation and training agree).
        """
        t0 = time.perf_counter()
        reports: list[dict[str, torch.Tensor]] = []
        modes = [c.training for c in chunks]
        for c in chunks:
            c.train(False)
        try:
            with torch.no_grad():
                for step in range(self.schedule.num_steps):
                    its = [self._iterator(step, c) for c in range(self.num_chunks)]
                    data = its[0] if self.num_chunks == 1 else its
                    reports += schedule_step(data, self.schedule.step_num_microbatches[step],
                                             True)
        finally:
            for c, mode in zip(chunks, modes, strict=True):
                c.train(mode)
        loss_sum, count = step_loss(reports)
        return EvalLog(after_step=at_step - 1, eval_loss=loss_sum / max(count, 1.0),
                       eval_tokens=int(count), eval_microbatches=self.schedule.num_microbatches,
                       seconds=time.perf_counter() - t0)

    def close(self) -> None:
        """Close the eval plan and dataset."""
        for obj in (getattr(self, "reader", None), getattr(self, "source", None)):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
