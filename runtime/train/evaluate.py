"""The native loop's evaluation: an eval plan run forward only, per-token loss over the pool.

``Evaluator`` opens the eval plan and its dataset once, checks the plan against the training
plan's layout (``runtime.data.evaluation.check_eval_layout``: pool, tp and pp must match; the
message names both plans) and replays it through an ``EvalSchedule`` on the *training* job's
``GroupCatalog``. ``run(model, after_step)``:

1. the model in eval mode, ``torch.no_grad`` (no graph, no gradient touched);
2. per microbatch of the pass: forward with the attention bound to the microbatch's CP group,
   ``per_token_loss`` -> (sum of token losses, token count), both accumulated in float64;
3. one all-reduce of [loss sum, count] over the pool: eval_loss = sum / count, the mean over
   every loss token of the evaluated steps, whatever CP sizes they used (the training rule).

It touches no training state: the optimizer, gradients and RNG are not used, and the model's
train/eval mode is restored in a ``finally``; so a run with evaluation trains bit for bit as
the same run without it (tests/runtime/train/test_train_dist.py). The oracle's evaluation is
``runtime.train.oracle.evaluate_reference``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from runtime.data.batch import to_device
from runtime.data.evaluation import EvalMicrobatch, EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from runtime.train.backends import AttentionBackend, make_backend
from runtime.train.build import autocast_context
from runtime.train.config import TrainConfig
from runtime.train.loss import per_token_loss
from runtime.train.model import GPT, GPTConfig, check_token_ids
from runtime.train.runlog import EvalLog


class Evaluator:
    """Forward-only passes over ``cfg.eval_plan`` on this rank (collective over the pool).

    Args:
        cfg: the run's config (``eval_plan``, ``eval_dataset``, ``eval_steps``, attention, dtype).
        train_reader: the training plan (its layout is the one the eval plan must match).
        topology: this rank's place in the training job.
        catalog: the training job's groups (no group is created here).
        model_config: the model's shape (vocabulary check, attention backend).
        backend: the training attention backend, reused when the eval plan's layout is the
            training plan's (otherwise one is made for the eval layout).
        device: where the model lives.

    Raises:
        ValueError: not an eval plan, another layout, the wrong dataset, or a CP size the
            catalog lacks (on every rank alike, before any evaluation runs).
    """

    def __init__(self, cfg: TrainConfig, train_reader: PlanReader, topology: Topology,
                 catalog: GroupCatalog, model_config: GPTConfig, backend: AttentionBackend,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.reader = PlanReader(cfg.eval_plan)
        try:
            self.source = open_plan_source(
                self.reader, cfg.eval_dataset, field=cfg.eval_field,
                tokenizer=cfg.eval_tokenizer(self.reader.header),
                vocab_size=model_config.vocab_size)
        except BaseException:
            self.reader.close()
            raise
        try:
            header = self.reader.header
            check_eval_layout(header, train_reader.header, eval_source=cfg.eval_plan,
                              train_source=cfg.plan)
            self.schedule = EvalSchedule(self.reader, self.source, topology, catalog,
                                         max_steps=cfg.eval_steps)
        except BaseException:
            self.close()
            raise
        self.pool_group = catalog.pool_group
        self.vocab_size = model_config.vocab_size
        self.device = device
        same_layout = header.layout == train_reader.header.layout
        self.backend = backend if same_layout else make_backend(cfg.attention, header.layout,
                                                                model_config)

    def _where(self, item: EvalMicrobatch) -> str:
        samples = sorted(set(item.micro.rows.sample_index.tolist()) - {-1})
        return (f"{self.cfg.eval_dataset}: eval step {item.step} microbatch {item.index} "
                f"(samples {samples})")

    def run(self, model: GPT, after_step: int) -> EvalLog:
        """One pass of the eval plan (its first ``eval_steps`` steps) after training step
        ``after_step`` (0-based)."""
        t0 = time.perf_counter()
        device = self.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        microbatches = 0
        was_training = model.training
        model.train(False)
        try:
            with torch.no_grad():
                for item in self.schedule:
                    host = item.micro.inputs
                    if host.tokens is not None:
                        check_token_ids(host.tokens, self.vocab_size,
                                        functools.partial(self._where, item))
                    mb = to_device(host, device)
                    assert mb.tokens is not None
                    assert mb.labels is not None
                    assert mb.loss_mask is not None
                    with self.backend.bind(mb, item.micro.cp_group, item.micro.cp_global_ranks,
                                           host=host) as attention:
                        with autocast_context(self.cfg, device):
                            logits = model(mb.tokens, mb.position_ids, attention)
                        local_sum, local_count = per_token_loss(logits, mb.labels, mb.loss_mask)
                    loss_sum += local_sum.double()
                    count += local_count.double()
                    microbatches += 1
        finally:
            model.train(was_training)
        totals = torch.stack([loss_sum, count])
        if self.pool_group is not None:  # None: a pool of one rank
            dist.all_reduce(totals, group=self.pool_group)
        global_sum, global_count = totals.tolist()
        return EvalLog(after_step=after_step, eval_loss=global_sum / max(global_count, 1.0),
                       eval_tokens=int(global_count), eval_microbatches=microbatches,
                       seconds=time.perf_counter() - t0)

    def close(self) -> None:
        """Close the eval plan and dataset."""
        closers: list[Any] = [self.reader, self.source]
        for obj in closers:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
