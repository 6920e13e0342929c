"""``MegatronTrainer``: a plan replayed through Megatron-core's own engine, as ``dcp-train
--framework megatron`` runs it, built from the public ``PlanJob`` API (``job.py``).

One step:

1. ``zero_grad_buffer`` on every chunk and ``optimizer.zero_grad()``;
2. ``get_forward_backward_func(pp_size, vp_size)``'s schedule (no pipelining, 1F1B or
   interleaved) over the step's ``PlanJob.data_iterator`` and ``num_microbatches``, with
   ``PlanJob.forward_step`` (the microbatch's CP group bound into every layer, the per-token
   loss). Megatron's ``DistributedDataParallel`` reduces the gradients over the pool (during
   the last microbatch's backward with ``--overlap-grad-reduce``; reduce-scattered with
   ``--use-distributed-optimizer``); ``finalize_model_grads`` adds the TP all-reduce of
   sequence-parallel norm gradients and the tied-embedding all-reduce between the first and
   last stage, and divides every gradient by the pool's token count;
3. the non-finite guard over ``main_grad`` (every rank agrees), then Megatron's optimizer
   (``FP32Optimizer``, bf16's ``Float16OptimizerWithFloat16Params`` or the
   ``DistributedOptimizer``), which also clips (``--clip-grad``) and reports the gradient norm.

``--grad-sync pool`` keeps the adapter's former path (``PoolGradSync`` and plain AdamW; bf16 as
autocast over fp32 weights): the baseline the DDP path is benchmarked against. The step's
logged loss is the sum of the last stage's ``"lm loss"`` reports over the pool, sent to
pipeline rank 0, which writes the JSON line (the native trainer's format, plus ``grad_norm``).
Checkpoints (``--save`` / ``--resume``) go through Megatron's ``dist_checkpointing``
(``checkpoint.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron.binding.groups import MegatronGroups
from runtime.adapters.megatron.compat import mcore
from runtime.adapters.megatron.job import PlanJob
from runtime.adapters.megatron.model.gpt import (
    global_names,
    gpt_chunk,
    init_weights,
    moe_fields,
    shape_fields,
    unwrap,
)
from runtime.adapters.megatron.parallel import checkpoint, ddp, optim
from runtime.adapters.megatron.trainer.evaluate import MegatronEvaluator
from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import TokenSource
from runtime.train import checkpoint as native_checkpoint
from runtime.train.build import (
    check_saved_optimizer,
    check_saved_settings,
    checkpoint_meta,
    optimizer_settings,
)
from runtime.train.config import TrainConfig, should_evaluate, step_range
from runtime.train.megatron_options import MegatronOptions
from runtime.train.memcheck import check_adapter_memory
from runtime.train.model import GPTConfig
from runtime.train.preflight import check_resume_step, require_training_plan, run_inputs
from runtime.train.procgroup import resolve_device
from runtime.train.runlog import EvalLog, StepLog, StepLogger, TrainResult

ATTENTION_SPECS = {"reference": "plan", "te": "te"}
"""``--attention`` -> the core attention behind Megatron's spec (``model.layer_spec``)."""


class MegatronTrainer:
    """Replays a plan through Megatron's schedules on this rank (process group initialised by
    the caller), built from the public ``PlanJob`` API. ``groups`` takes groups the caller owns
    (``groups_from_parallel_state``); by default every group the plan needs is created here
    (collective)."""

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, *,
                 reader: PlanReader | None = None, source: TokenSource | None = None,
                 groups: MegatronGroups | None = None) -> None:
        if cfg.attention not in ATTENTION_SPECS:
            raise ValueError(f"--framework megatron: --attention {cfg.attention} is not "
                             f"available (choose {' or '.join(ATTENTION_SPECS)})")
        options = cfg.megatron
        self.cfg, self.options = cfg, options
        self.job = PlanJob(reader if reader is not None else cfg.plan,
                           source if source is not None else cfg.dataset_paths,
                           device=resolve_device(cfg), dtype=cfg.dtype, groups=groups,
                           field=cfg.field, timeout_minutes=cfg.distributed_timeout_minutes,
                           seed=cfg.seed, vocab_size=model_config.vocab_size,
                           attention=ATTENTION_SPECS[cfg.attention], tokenizer=cfg.tokenizer)
        try:
            self._build(cfg, model_config, options)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: TrainConfig, model_config: GPTConfig,
               options: MegatronOptions) -> None:
        job = self.job
        self.reader, self.source, self.device = job.reader, job.source, job.device
        require_training_plan(self.reader.header.kind, cfg.plan)
        self.groups, self.topology = job.groups, job.topology
        if options.grad_sync == "pool":  # the baseline: autocast over fp32 weights
            job.parallel = replace(job.parallel, megatron_precision=False)
        self.par = job.parallel
        self.model_config = model_config
        self.config = job.transformer_config(**shape_fields(model_config),
                                             **moe_fields(options, model_config))
        header = self.reader.header
        max_len = header.capacity_tokens_per_rank * header.parallel.pool_size

        def provider(*, pre_process: bool, post_process: bool, vp_stage: int | None,
                     pg_collection: Any) -> nn.Module:
            chunk = gpt_chunk(model_config, self.config, pg_collection,
                              spec=job.layer_spec(self.config, vp_stage),
                              pre_process=pre_process, post_process=post_process,
                              vp_stage=vp_stage, max_sequence_length=max_len,
                              use_te=job.attention == "te")
            init_weights([chunk], model_config, seed=cfg.seed, tp=self.topology.tp,
                         tp_rank=self.topology.tp_rank)
            return chunk

        self.chunks = job.get_model(provider, options=options)
        if options.grad_sync == "pool":
            self.optimizer: Any = optim.adamw(cfg, self.chunks)
            self.optimizer_name = "adamw"
            self.scheduler = None
        else:
            self.optimizer = job.get_optimizer(optim.optimizer_config(
                cfg, bf16=bool(self.config.bf16)), self.chunks)
            self.optimizer_name = optim.OPTIMIZER_NAMES[options.use_distributed_optimizer]
            self.scheduler = optim.param_scheduler(cfg, self.optimizer)
        self.schedule = mcore.get_forward_backward_func(pp_size=self.par.pp,
                                                        vp_size=job.vp_size)
        self.rank = dist.get_rank()
        self.start_step = 0
        self.meta = checkpoint_meta(model_config, self.reader)
        if options.model_meta():  # MoE / MTP: part of the model's shape
            self.meta["model"] = {**self.meta["model"], **options.model_meta()}
        self.has_steps = True
        # The groups' (lr, weight decay) as this run built them: saved with each checkpoint.
        self.settings = optimizer_settings(self.optimizer.param_groups)
        loaded = None
        if cfg.resume:
            # Rank 0 picks the checkpoint (latest may move meanwhile); every rank loads it.
            loaded = native_checkpoint.resolve_agreed(cfg.resume, self.rank)
            built = self.settings
            saved = checkpoint.saved_settings(loaded)
            if saved is not None and len(saved) == len(built):
                # Before the load: megatron-core 0.19's distributed optimizer matches groups by
                # their lr and fails on another --lr with its own words.
                check_saved_settings(loaded, built=built, loaded=saved)
            self.start_step = job.load(str(loaded), self.chunks, self.optimizer,
                                       scheduler=self.scheduler, meta=self.meta)
            # The loaded groups' lr and weight decay (and the scheduler's, which sets them
            # each step) are the checkpoint's: another --lr would be ignored, so refused.
            check_saved_optimizer(cfg, self.optimizer, loaded, built=built)
            self.has_steps = check_resume_step(cfg, self.start_step, self.reader.num_steps,
                                               notice=self.rank == 0)
            if self.rank == 0 and self.has_steps:
                print(f"dcp-train: resuming from {loaded} at step {self.start_step}",
                      file=sys.stderr, flush=True)
        if cfg.save:  # before any step: a target that cannot take these checkpoints fails now
            error = ""
            try:  # another run's checkpoints, or a latest that would move back
                native_checkpoint.check_continues(cfg.save, resumed=loaded,
                                                  start=self.start_step,
                                                  replace=cfg.replace_checkpoints)
            except ValueError as e:
                error = str(e)
            if not native_checkpoint.agree(not error, None):
                raise ValueError(error or f"--save {cfg.save}: refused on another rank")
            stop = step_range(cfg, self.start_step, self.reader.num_steps).stop
            checkpoint.check_target(cfg.save, start=self.start_step, stop=stop,
                                    save_every=cfg.save_every, inputs=run_inputs(cfg))
        self.evaluator: MegatronEvaluator | None = None
        if cfg.eval_plan:
            self.evaluator = MegatronEvaluator(cfg, self.reader, self.groups,
                                               num_chunks=len(self.chunks), device=self.device,
                                               vocab_size=model_config.vocab_size,
                                               mtp_depth=job.mtp_depth)

    @property
    def summary_fields(self) -> dict[str, Any]:
        """What ran, for the run summary (``--json`` / ``--summary-json``)."""
        fields = {"framework": "megatron", "megatron_core": mcore.VERSION,
                  "grad_sync": self.options.grad_sync, "optimizer": self.optimizer_name,
                  "overlap_grad_reduce": self.options.overlap_grad_reduce,
                  "overlap_param_gather": self.options.overlap_param_gather,
                  "dtype": self.cfg.dtype}
        if self.options.moe:
            fields.update(num_experts=self.options.num_experts,
                          moe_router_topk=self.options.moe_router_topk,
                          moe_load_balancing=self.options.load_balancing)
        if self.options.mtp_num_layers:
            fields["mtp_num_layers"] = self.options.mtp_num_layers
        return fields

    def forward_step(self, data_iterator: Any, model: nn.Module) -> tuple[Any, Any]:
        """Megatron's ``forward_step_func`` (``PlanJob.forward_step``)."""
        return self.job.forward_step(data_iterator, model)

    def step(self, step: int) -> StepLog:
        """One optimizer step (collective over the job); the returned log is rank 0's."""
        t0 = time.perf_counter()
        chunks: list[Any] = self.chunks
        for c in chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_microbatches = self.job.num_microbatches(step)
        reports = self.run_schedule(self.job.data_iterator(step, self.chunks), num_microbatches,
                                    False)
        loss = self.job.step_loss(reports)
        # Ranks hold different shards (TP, PP, the distributed optimizer): all agree.
        skipped = not self.job.grads_finite(step, loss, self.chunks,
                                            skip=self.cfg.skip_nonfinite_steps)
        grad_norm = None
        if not skipped:
            result = self.optimizer.step()
            if isinstance(result, tuple):  # Megatron's: (success, grad norm, zeros in grad)
                grad_norm = result[1]
            if self.scheduler is not None:
                self.scheduler.step(increment=1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens = int(np.asarray(self.reader.step(step).num_tokens, dtype=np.int64).sum())
        return StepLog(step=step, loss=loss.loss, tokens=tokens, loss_tokens=loss.loss_tokens,
                       microbatches=num_microbatches, seconds=time.perf_counter() - t0,
                       skipped=skipped,
                       grad_norm=None if grad_norm is None else float(grad_norm),
                       moe_aux_loss=loss.moe_aux_loss,
                       moe_tokens_per_expert=loss.moe_tokens_per_expert, mtp_loss=loss.mtp_loss)

    def run_schedule(self, data_iterator: Any, num_microbatches: int, forward_only: bool
                     ) -> list[dict[str, torch.Tensor]]:
        """Megatron's schedule over ``num_microbatches`` microbatches; the last stage's
        ``"lm loss"`` reports (empty elsewhere)."""
        reports: list[dict[str, torch.Tensor]] = self.schedule(
            forward_step_func=self.job.forward_step, data_iterator=data_iterator,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=num_microbatches, seq_length=self.job.seq_length,
            micro_batch_size=1, forward_only=forward_only, **self.job.schedule_kwargs)
        return reports

    def evaluate(self, at_step: int) -> EvalLog:
        """Run the eval plan through the forward-only schedule (collective); its record."""
        if self.evaluator is None:
            raise ValueError("no eval plan: pass --eval-plan and --eval-dataset")
        return self.evaluator.run(list(self.chunks), at_step, self.run_schedule,
                                  self._step_loss)

    def _step_loss(self, reports: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        loss = self.job.step_loss(reports)
        return loss.loss * max(loss.loss_tokens, 1), float(loss.loss_tokens)

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their global (unsplit) names, in fp32 (tests)."""
        ddp.sync_params(self.chunks, self.options)
        out = {}
        for c in self.chunks:
            names = global_names(c)
            for name, p in unwrap(c).named_parameters():
                if p.requires_grad:  # not the MTP stage's unused output weight (gpt_chunk)
                    out[names[name]] = p.detach().float().cpu().clone()
        return out

    def reduced_grads(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Global name -> (flat indices, values) of this rank's reduced gradient elements of
        the last step (tests: compared with the oracle's gradients)."""
        out = {}
        for c in self.chunks:
            names = global_names(c)
            for name, value in ddp.reduced_grads(c, self.options).items():
                out[names[name]] = value
        return out

    def close(self) -> None:
        """Close the plan and dataset this trainer opened itself."""
        for obj in (getattr(self, "evaluator", None), getattr(self, "job", None)):
            close = getattr(obj, "close", None)
            if close is not None:
                close()

    def check_memory(self, steps: range) -> None:
        """The native check (``runtime.train.memcheck``) before the first step, on every rank:
        the dense model at the experts' width for MoE, the distributed optimizer's moments
        split over the pool; skipped (a notice) under TP or PP, which the estimate lacks."""
        par, options = self.par, self.options
        shape = self.model_config
        if options.moe:
            shape = replace(shape, ffn_hidden_size=options.moe_ffn_hidden_size or shape.ffn_size)
        unmodelled = (f"tensor or pipeline parallelism (tp {par.tp}, pp {par.pp})"
                      if par.tp > 1 or par.pp > 1 else "")
        sharded = options.grad_sync != "pool" and options.use_distributed_optimizer
        check_adapter_memory(self.cfg, self.reader, shape, self.device, steps,
                             optimizer_shards=dist.get_world_size() if sharded else 1,
                             unmodelled=unmodelled)

    def run(self, after_step: Callable[[int], None] | None = None) -> TrainResult:
        """Steps [start, stop); rank 0 logs one JSON line per step. ``after_step(step)`` runs
        after each step's update (tests read the reduced gradients there)."""
        logger = StepLogger(self.cfg, enabled=self.rank == 0, summary_fields=self.summary_fields)
        result = TrainResult()
        try:
            steps = step_range(self.cfg, self.start_step, self.reader.num_steps)
            if not self.has_steps:  # resumed where the run ends (a notice was printed)
                steps = range(0)
            self.check_memory(steps)
            logger.begin(len(steps))
            for step in steps:
                log = self.step(step)
                result.logs.append(log)
                logger.write(log)
                if after_step is not None:
                    after_step(step)
                cfg = self.cfg
                if cfg.save and (step == steps[-1]
                                 or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
                    self.job.save(cfg.save, self.chunks, self.optimizer, next_step=step + 1,
                                  scheduler=self.scheduler,
                                  meta={**self.meta, "settings": self.settings})
                if self.evaluator is not None and should_evaluate(self.cfg, step, steps[-1]):
                    ev = self.evaluate(step + 1)
                    result.evals.append(ev)
                    logger.write(ev)
        finally:
            logger.close()
        return result
