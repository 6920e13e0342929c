"""Evaluation through torchtitan's validation hook: an eval plan, forward only, per-token loss.

torchtitan's ``Trainer.train`` calls ``validator.validate(model_parts, step)`` after the steps
``validator.should_validate(step)`` picks. ``PlanValidator`` is that validator for an eval plan
(``dcp-plan DATA --eval``): it replays the plan with ``runtime.data.evaluation.EvalSchedule``
(the same steps and microbatches on every rank, a finite pass) on the *training* job's groups,
runs each microbatch's forward with its CP attention bound, sums torchtitan's summed cross
entropy and the valid labels over the pass, reduces both over the pool once and reports
eval_loss = sum / count to torchtitan's metrics (``log_validation``) and to the run's JSON lines
(``EvalLog``, the native format). When: after every ``interval`` completed steps (counted from
step 0, so a resumed run evaluates where the uninterrupted one does) and after the last step,
the native rule (``runtime.train.config.should_evaluate``).

The validator touches no training state (``torch.no_grad``, the model's mode restored), so a
run with evaluation trains bit for bit as the same run without it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from runtime.adapters.torchtitan.attention import PlanMasks
from runtime.adapters.torchtitan.data import titan_batch
from runtime.adapters.torchtitan.titan import IGNORE_INDEX, Validator
from runtime.data.batch import to_device
from runtime.data.evaluation import EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.train.backends import AttentionBackend
from runtime.train.runlog import EvalLog

if TYPE_CHECKING:
    from runtime.adapters.torchtitan.data import PlanDataLoader


class PlanValidator(Validator):
    """torchtitan validator over an eval plan (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        plan: str = ""
        """Evaluation plan (kind eval) for the training job's pool, tp and pp."""
        dataset: str = ""
        """The dataset the eval plan was made for."""
        field: str | None = None
        """Record field or column of its tokens; None: the one the eval plan was made with."""
        max_steps: int = 0
        """Evaluate only the eval plan's first steps; 0: all of it."""
        interval: int = 0
        """Evaluate after every ``interval`` completed steps; 0: only after the last."""
        last_step: int = 0
        """The run's last step (torchtitan's count: ``training.steps``); evaluated once."""

    config: Config

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not config.plan or not config.dataset:
            raise ValueError("PlanValidator.Config needs plan= and dataset=")
        self.schedule: EvalSchedule | None = None
        self.logs: list[EvalLog] = []

    def attach(self, loader: PlanDataLoader, backend_for: Callable[[str], AttentionBackend],
               device: torch.device, write: Callable[[EvalLog], None]) -> None:
        """Bind to the training job: its plan (layout check), groups, device and JSON lines;
        ``backend_for(layout)`` gives the attention backend for the eval plan's shard layout.

        Collective (``EvalSchedule`` checks that every rank built the same pass).
        """
        self.reader = PlanReader(self.config.plan)
        text = bool(self.reader.header.dataset.tokenizer)
        self.source = open_plan_source(
            self.reader, self.config.dataset, field=self.config.field,
            tokenizer=loader.config.tokenizer_path if text else None,
            vocab_size=loader.config.vocab_size)
        check_eval_layout(self.reader.header, loader.reader.header,
                          eval_source=self.config.plan, train_source=loader.config.plan)
        self.schedule = EvalSchedule(self.reader, self.source, loader.topology, loader.catalog,
                                     max_steps=self.config.max_steps)
        self.pool_group = loader.catalog.pool_group
        self.backend = backend_for(self.reader.header.layout)
        self.device, self.write = device, write
        self.vocab_size = loader.config.vocab_size

    def should_validate(self, step: int) -> bool:
        return step == self.config.last_step or (
            self.config.interval > 0 and step % self.config.interval == 0)

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        assert self.schedule is not None, "PlanValidator.attach was not called"
        t0 = time.perf_counter()
        model = model_parts[0]
        was_training = model.training
        model.train(False)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        microbatches = 0
        try:
            for item in self.schedule:
                where = functools.partial("{}: eval step {} microbatch {}".format,
                                          self.config.dataset, item.step, item.index)
                inputs, labels = titan_batch(item.micro, self.vocab_size, where)
                positions = inputs["positions"].to(self.device)
                tokens, labels = inputs["input"].to(self.device), labels.to(self.device)
                mb = to_device(item.micro.inputs, self.device)
                with self.backend.bind(mb, item.micro.cp_group, item.micro.cp_global_ranks,
                                       host=item.micro.inputs) as attention, \
                        self.validation_context():
                    pred = model(tokens, positions=positions,
                                 attention_masks=PlanMasks(attention))
                    loss_sum, _ = self.loss_fn(pred, labels)
                totals[0] += loss_sum.detach().double()
                totals[1] += (labels != IGNORE_INDEX).sum().double()
                microbatches += 1
        finally:
            model.train(was_training)
        if self.pool_group is not None:  # None: a pool of one rank
            dist.all_reduce(totals, group=self.pool_group)
        loss_sum_all, count = totals.tolist()
        loss = loss_sum_all / max(count, 1.0)
        self.metrics_processor.log_validation(loss=loss, step=step)
        # torchtitan counts steps from 1 (its ``step`` is the steps done); ours are 0-based.
        log = EvalLog(after_step=step - 1, eval_loss=loss, eval_tokens=int(count),
                      eval_microbatches=microbatches, seconds=time.perf_counter() - t0)
        self.logs.append(log)
        self.write(log)

    def close(self) -> None:
        """Close the eval plan and dataset."""
        for obj in (getattr(self, "reader", None), getattr(self, "source", None)):
            close = getattr(obj, "close", None)
            if close is not None:
                close()
