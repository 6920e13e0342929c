"""The replayed run: ``Trainer`` trains the small GPT on this rank by replaying a plan.

Launch: ``torchrun --nproc-per-node N -m runtime.train --plan P --dataset D`` (gloo on CPU, NCCL
on CUDA), or one plain process for a plan whose pool is 1 and for ``--reference``. The parallel
layout comes from the plan header; the live job is only checked against it.

One step (``Trainer.step``):

1. ``Replayer.microbatches(step)``: this rank's packed shard of every microbatch, with its CP
   group (every rank runs the same number of microbatches, in order).
2. Per microbatch: forward on the local shard with the attention bound to that microbatch's
   group, ``per_token_loss`` -> (sum of token losses, token count), ``backward`` of the *sum*.
   Ranks of one CP group hold different tokens of the same sequences; the attention's all-gather
   of K/V has a reduce-scatter backward that routes every K/V gradient back to its owner, so the
   group's ranks together accumulate the gradient of the group's summed loss.
3. All-reduce (sum) the token count and every gradient over the pool, divide the gradients by
   the global count, AdamW step. dp and cp are merged into one pool of replicated parameters, so
   this single all-reduce over the pool group is the whole data-parallel reduction: the sum over
   all ranks of d(loss sum)/d(params) is the gradient of the step's summed loss, and dividing by
   the global token count gives exactly the gradient of the per-token mean loss, whatever CP
   sizes the step used.

``--reference`` runs the oracle (``runtime.train.oracle``): one process, no CP, no packing, every
sample segment of a step as its own sequence, same initial weights. In fp32 the replayed run
matches it to float rounding, losses, gradients and weights
(tests/runtime/train/test_train_dist.py).
Attention backends (reference, torch, te) live in ``runtime.train.backends``; the model in
``runtime.train.model``; checkpoints in ``runtime.train.checkpoint``.

``--steps K`` is the absolute step to stop before (the run executes steps [start, K), start = 0
or the resumed step), so a resumed run with the same ``--steps`` ends where the uninterrupted
one does. One JSON line per step (rank 0): step, loss, tokens (real tokens of the step), loss
tokens, microbatches, seconds, tokens_per_s.

``--eval-plan P --eval-dataset D --eval-interval K [--eval-steps M]``: after every K-th step
and after the last, ``runtime.train.evaluate.Evaluator`` runs the eval plan (its first M steps)
forward only on the same groups and rank 0 writes one more line after that step's: after_step
(the 0-based step it follows), eval_loss, eval_tokens, eval_microbatches, seconds.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runtime.data.batch import to_device
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import check_plan_source, open_plan_source
from runtime.data.replay import Microbatch, Replayer
from runtime.data.tokens import TokenSource
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from runtime.train import checkpoint
from runtime.train.backends import make_backend
from runtime.train.build import (
    autocast_context,
    build_model,
    build_optimizer,
    check_saved_optimizer,
    checkpoint_meta,
    copy_final_state,
)
from runtime.train.config import TrainConfig, should_evaluate, step_range
from runtime.train.evaluate import Evaluator
from runtime.train.guards import nonfinite_ok
from runtime.train.loss import per_token_loss
from runtime.train.memcheck import check_memory
from runtime.train.model import GPTConfig, check_token_ids
from runtime.train.preflight import (
    announce_resume,
    check_resume_step,
    require_training_plan,
    run_inputs,
)
from runtime.train.procgroup import pg_timeout, resolve_device
from runtime.train.runlog import EvalLog, StepLog, StepLogger, TrainResult


class Trainer:
    """Replays a plan on this rank; the process group must be initialised by the caller.

    ``catalog`` takes process groups the caller already owns (``GroupCatalog.from_groups``, for
    example from a DeviceMesh); by default every group of the plan is created here.
    """

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, *,
                 reader: PlanReader | None = None, source: TokenSource | None = None,
                 catalog: GroupCatalog | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        # What the trainer opens it closes (close()); what the caller passes stays the caller's.
        self._owned: list[Any] = []
        if reader is None:
            reader = PlanReader(cfg.plan)
            self._owned.append(reader)
        if source is None:
            # Read as the planner counted (bad records skipped), lengths and content checked.
            source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field,
                                      tokenizer=cfg.tokenizer,
                                      vocab_size=model_config.vocab_size)
            self._owned.append(source)
        else:
            check_plan_source(reader, source)
        self.reader = reader
        self.source = source
        header = self.reader.header
        require_training_plan(self.reader.header.kind, cfg.plan)
        self.topology = Topology.from_header(header.parallel, rank=dist.get_rank(),
                                             world_size=dist.get_world_size())
        self.reader.check_job(self.topology)
        if header.parallel.tp > 1 or header.parallel.pp > 1:
            raise ValueError(f"{cfg.plan}: plan uses tp={header.parallel.tp}, "
                             f"pp={header.parallel.pp}; dcp-train's model has no tensor or "
                             "pipeline parallelism (tp = pp = 1 only)")
        if catalog is None:
            # Collective: every rank creates every group of the catalog, in catalog order.
            catalog = GroupCatalog.create(self.topology, header.cp_sizes,
                                          timeout=pg_timeout(cfg.distributed_timeout_minutes))
        elif catalog.topology != self.topology:
            raise ValueError(f"catalog built for {catalog.topology}, the plan needs "
                             f"{self.topology}")
        self.catalog = catalog
        self.pool_group = self.catalog.pool_group
        self.replayer = Replayer(self.reader, self.source, self.topology, self.catalog,
                                 check_dataset=False)  # checked above
        self.model_config = model_config
        self.model = build_model(model_config, cfg.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg)
        self.backend = make_backend(cfg.attention, header.layout, model_config)
        self.rank = dist.get_rank()
        self.evaluator: Evaluator | None = None
        if cfg.eval_plan:
            # Collective (EvalSchedule checks that every rank built the same pass).
            self.evaluator = Evaluator(cfg, self.reader, self.topology, self.catalog,
                                       model_config, self.backend, self.device)
            self._owned.append(self.evaluator)
        self.start = 0
        loaded: Path | None = None
        if cfg.resume:
            # Rank 0 picks the checkpoint (latest may move meanwhile); every rank loads it.
            loaded = checkpoint.resolve_agreed(cfg.resume, self.rank)
            resumed = checkpoint.load(loaded, model=self.model, optimizer=self.optimizer,
                                      rank=self.rank,
                                      expect_meta=checkpoint_meta(model_config, self.reader))
            check_saved_optimizer(cfg, self.optimizer, resumed.directory)
            self.start = resumed.next_step
            if check_resume_step(cfg, self.start, self.reader.num_steps,
                                 notice=self.rank == 0) and self.rank == 0:
                announce_resume(resumed.directory, self.start)
        if cfg.save:
            # Before the first step: a save that would fail, or replace what is not ours, or
            # another run's checkpoints, or move latest back.
            error = ""
            try:
                checkpoint.check_continues(cfg.save, resumed=loaded, start=self.start,
                                           replace=cfg.replace_checkpoints)
            except ValueError as e:
                error = str(e)
            if not checkpoint.agree(not error, None):
                raise ValueError(error or f"--save {cfg.save}: refused on another rank")
            stop = step_range(cfg, self.start, self.reader.num_steps).stop
            checkpoint.check_save_target(
                cfg.save, self.rank, writes=checkpoint.native_saves(self.start, stop,
                                                                    cfg.save_every),
                inputs=run_inputs(cfg))

    def _where(self, step: int, micro: Microbatch) -> str:
        samples = sorted(set(micro.rows.sample_index.tolist()) - {-1})
        return (f"{self.cfg.dataset}: step {step} microbatch {micro.rows.microbatch} "
                f"(samples {samples})")

    def step(self, step: int) -> StepLog:
        """Run one optimizer step (collective over the pool); return its log record."""
        t0 = time.perf_counter()
        model, device = self.model, self.device
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        microbatches = self.replayer.microbatches(step)
        for micro in microbatches:
            if micro.inputs.tokens is not None:  # CPU tensor: a cheap check, no device sync
                check_token_ids(micro.inputs.tokens, self.model_config.vocab_size,
                                functools.partial(self._where, step, micro))
            mb = to_device(micro.inputs, device)
            assert mb.tokens is not None
            assert mb.labels is not None
            assert mb.loss_mask is not None
            # The backward runs inside the binding too: the CP group stays bound until the
            # microbatch's gradients exist, whatever the attention saves for its backward.
            with self.backend.bind(mb, micro.cp_group, micro.cp_global_ranks,
                                   host=micro.inputs) as attention:
                with autocast_context(self.cfg, device):
                    logits = model(mb.tokens, mb.position_ids, attention)
                local_sum, local_count = per_token_loss(logits, mb.labels, mb.loss_mask)
                # Backward of the *sum*: the division by the global count happens once, after
                # the all-reduce, so the runtime CP size and the microbatch split cancel exactly.
                local_sum.backward()  # type: ignore[no-untyped-call]
            loss_sum += local_sum.detach().double()
            count += local_count.double()
        totals = torch.stack([loss_sum, count])
        if self.pool_group is not None:  # None: a pool of one rank, nothing to reduce
            dist.all_reduce(totals, group=self.pool_group)
        global_sum, global_count = totals.tolist()
        self._reduce_gradients(max(global_count, 1.0))
        # Every rank holds the same reduced loss and gradients, so all decide alike.
        skipped = not nonfinite_ok(step, global_sum / max(global_count, 1.0),
                                   [p.grad for p in model.parameters() if p.grad is not None],
                                   skip=self.cfg.skip_nonfinite_steps)
        if not skipped:
            self.optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tokens = int(np.asarray(self.reader.step(step).num_tokens, dtype=np.int64).sum())
        return StepLog(step=step, loss=global_sum / max(global_count, 1.0), tokens=tokens,
                       loss_tokens=int(global_count), microbatches=len(microbatches),
                       seconds=time.perf_counter() - t0, skipped=skipped)

    def _reduce_gradients(self, global_count: float) -> None:
        """Sum every gradient over the pool (one async all-reduce each), then divide by count."""
        handles = []
        grads = []
        for p in self.model.parameters():
            if p.grad is None:  # unused parameter on every rank: still reduce a zero
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
            if self.pool_group is not None:
                handles.append(dist.all_reduce(p.grad, group=self.pool_group, async_op=True))
        for h in handles:
            h.wait()
        torch._foreach_div_(grads, global_count)

    def evaluate(self, after_step: int) -> EvalLog:
        """Run the eval plan forward only after training step ``after_step`` (0-based;
        collective over the pool); return its record."""
        if self.evaluator is None:
            raise ValueError("no eval plan: pass --eval-plan and --eval-dataset")
        return self.evaluator.run(self.model, after_step)

    def close(self) -> None:
        """Close the plan and dataset this trainer opened itself."""
        for obj in self._owned:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self._owned.clear()

    def run(self, *, keep_state: bool = False) -> TrainResult:
        """Steps [start, stop); checkpoints as configured; rank 0 logs."""
        cfg = self.cfg
        logger = StepLogger(cfg, enabled=self.rank == 0)
        result = TrainResult()
        meta = checkpoint_meta(self.model_config, self.reader)
        try:
            steps = step_range(cfg, self.start, self.reader.num_steps)
            if cfg.memory_check:  # before the first step (runtime/train/memcheck.py)
                check_memory(cfg.plan, self.reader, self.model_config, cfg.attention,
                             self.device, steps)
            logger.begin(len(steps))
            for step in steps:
                log = self.step(step)
                result.logs.append(log)
                logger.write(log)
                if self.evaluator is not None and should_evaluate(cfg, step, steps[-1]):
                    ev = self.evaluate(step)
                    result.evals.append(ev)
                    logger.write(ev)
                last = step == steps[-1]
                if cfg.save and (last or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
                    checkpoint.save(cfg.save, model=self.model, optimizer=self.optimizer,
                                    next_step=step + 1, meta=meta, rank=self.rank,
                                    group=self.pool_group)
        finally:
            logger.close()
        if keep_state:
            copy_final_state(result, self.model)
        return result
