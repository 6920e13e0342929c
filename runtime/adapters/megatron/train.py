"""``MegatronTrainer``: a plan replayed through Megatron-core's own schedules.

One step:

1. ``PlanBatches.data_iterator(step)`` and ``num_microbatches(step)`` from the plan (the count
   varies by step; every pool rank gets the same).
2. ``get_forward_backward_func(pp_size, vp_size)`` picks Megatron's schedule: no pipelining,
   1F1B (``forward_backward_pipelining_without_interleaving``) or interleaved (vpp > 1). It calls
   ``forward_step`` once per microbatch and chunk, runs the backward, and, because
   ``config.finalize_model_grads_func`` is Megatron's ``finalize_model_grads``, ends with the
   pool all-reduce of gradients (``PoolGradSync``), the TP all-reduce of sequence-parallel norm
   gradients, the tied-embedding all-reduce between the first and last stage, and the division
   of every gradient by the pool's token count.
3. AdamW (``foreach=False``, as the oracle) on this rank's parameters.

``forward_step`` binds the microbatch's CP group into every layer for the forward only
(``binding.bind_cp_group``) and hands ``loss.loss_func`` back to the schedule on the last stage.
The step's logged loss is the sum of the last stage's ``"lm loss"`` reports, all-reduced over
the pool and sent to pipeline rank 0, which writes the JSON line (the native trainer's format).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from runtime.adapters.megatron import mcore, patches
from runtime.adapters.megatron.batch import Batch, PlanBatches
from runtime.adapters.megatron.binding import bind_cp_group
from runtime.adapters.megatron.ddp import PoolGradSync
from runtime.adapters.megatron.evaluate import MegatronEvaluator
from runtime.adapters.megatron.groups import MegatronGroups, create_groups
from runtime.adapters.megatron.loss import loss_func
from runtime.adapters.megatron.model import (
    ModelParallel,
    build_chunks,
    init_weights,
    transformer_config,
)
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import check_plan_source, open_plan_source
from runtime.data.tokens import TokenSource
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

ATTENTION_SPECS = {"reference": "plan", "te": "te"}
"""``--attention`` -> the core attention behind Megatron's spec (``model.layer_spec``)."""


def model_parallel(reader: PlanReader, cfg: TrainConfig) -> ModelParallel:
    """The model split the plan header asks for."""
    p = reader.header.parallel
    return ModelParallel(tp=p.tp, pp=p.pp, vpp=p.vpp, sequence_parallel=p.sequence_parallel,
                         microbatch_group_size=p.microbatch_group_size, dtype=DTYPES[cfg.dtype])


class MegatronTrainer:
    """Replays a plan through Megatron's schedules on this rank (process group initialised by
    the caller). ``groups`` takes groups the caller owns (``groups_from_parallel_state``); by
    default every group the plan needs is created here (collective)."""

    def __init__(self, cfg: TrainConfig, model_config: GPTConfig, *,
                 reader: PlanReader | None = None, source: TokenSource | None = None,
                 groups: MegatronGroups | None = None) -> None:
        if cfg.attention not in ATTENTION_SPECS:
            raise ValueError(f"--framework megatron: --attention {cfg.attention} is not "
                             f"available (choose {' or '.join(ATTENTION_SPECS)})")
        if cfg.save or cfg.resume:
            raise ValueError("--framework megatron: --save/--resume are not supported yet")
        self.cfg = cfg
        self.device = resolve_device(cfg)
        patches.apply_patches(self.device)
        self._owned: list[Any] = []
        if reader is None:
            reader = PlanReader(cfg.plan)
            self._owned.append(reader)
        if source is None:
            # Read as the planner counted (bad records skipped), lengths and content checked.
            source = open_plan_source(reader, cfg.dataset_paths, field=cfg.field)
            self._owned.append(source)
        else:
            check_plan_source(reader, source)
        self.reader, self.source = reader, source
        header = reader.header
        topology = Topology.from_header(header.parallel, rank=dist.get_rank(),
                                        world_size=dist.get_world_size())
        if groups is None:
            groups = create_groups(topology, header.cp_sizes,
                                   timeout=pg_timeout(cfg.distributed_timeout_minutes))
        elif groups.topology != topology:
            raise ValueError(f"groups built for {groups.topology}, the plan needs {topology}")
        self.groups, self.topology = groups, topology
        self.par = model_parallel(reader, cfg)
        self.model_config = model_config
        self.config = transformer_config(model_config, self.par)
        self.config.finalize_model_grads_func = mcore.finalize_model_grads
        if self.device.type == "cuda":
            mcore.tp_random.model_parallel_cuda_manual_seed(
                cfg.seed, tp_rank=topology.tp_rank, ep_rank=0, etp_rank=0)
        pgc = groups.pg_collection
        chunks = build_chunks(model_config, self.config, pgc,
                              attention=ATTENTION_SPECS[cfg.attention], pp_rank=topology.pp_rank,
                              max_sequence_length=header.capacity_tokens_per_rank
                              * header.parallel.pool_size)
        init_weights(chunks, model_config, seed=cfg.seed, tp=topology.tp,
                     tp_rank=topology.tp_rank)
        self.chunks = [PoolGradSync(c.to(self.device), groups.pool_group) for c in chunks]
        params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           foreach=False)
        self.batches = PlanBatches(reader, source, groups, num_chunks=len(self.chunks),
                                   device=self.device, vocab_size=model_config.vocab_size)
        vpp = self.par.vpp if self.par.vpp > 1 else None
        self.schedule = mcore.get_forward_backward_func(pp_size=self.par.pp, vp_size=vpp)
        self.p2p = (patches.TaggedP2PCommunicator(pgc.pp, self.config) if self.par.pp > 1
                    else None)
        self.rank = dist.get_rank()
        self.evaluator: MegatronEvaluator | None = None
        if cfg.eval_plan:
            self.evaluator = MegatronEvaluator(cfg, reader, groups, num_chunks=len(self.chunks),
                                               device=self.device,
                                               vocab_size=model_config.vocab_size)
            self._owned.append(self.evaluator)

    def forward_step(self, data_iterator: Any, model: nn.Module) -> tuple[Any, Any]:
        """Megatron's ``forward_step_func``: one microbatch through one model chunk."""
        batch: Batch = next(data_iterator)
        psp = batch["packed_seq_params"]
        autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.par.dtype != torch.float32:
            autocast = torch.autocast(self.device.type, dtype=self.par.dtype)
        with bind_cp_group(model, psp.cp_group), \
                patches.sequence_parallel_group(self.groups.pg_collection.tp), autocast:
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                           packed_seq_params=psp, runtime_gather_output=True,
                           padding_mask=batch["padding_mask"])
        if batch["labels"] is None:  # not the last stage: the schedule sends output on
            return output, None
        return output, functools.partial(loss_func, batch["labels"], batch["loss_mask"])

    def step(self, step: int) -> StepLog:
        """One optimizer step (collective over the job); the returned log is rank 0's."""
        t0 = time.perf_counter()
        for c in self.chunks:
            c.zero_grad_buffer()
        num_microbatches = self.batches.num_microbatches(step)
        reports = self.run_schedule(self.batches.data_iterator(step), num_microbatches, False)
        loss_sum, count = self._step_loss(reports)
        # Ranks hold different shards (TP) and stages (PP): all agree on the verdict.
        grads = [p.grad for c in self.chunks for p in c.parameters() if p.grad is not None]
        skipped = not nonfinite_ok(step, loss_sum / max(count, 1.0), grads,
                                   skip=self.cfg.skip_nonfinite_steps, agree=True)
        if not skipped:
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens = int(np.asarray(self.reader.step(step).num_tokens, dtype=np.int64).sum())
        return StepLog(step=step, loss=loss_sum / max(count, 1.0), tokens=tokens,
                       loss_tokens=int(count), microbatches=num_microbatches,
                       seconds=time.perf_counter() - t0, skipped=skipped)

    def run_schedule(self, data_iterator: Any, num_microbatches: int, forward_only: bool
                     ) -> list[dict[str, torch.Tensor]]:
        """Megatron's schedule over ``num_microbatches`` microbatches; the last stage's
        ``"lm loss"`` reports (empty elsewhere)."""
        kwargs: dict[str, Any] = {"pg_collection": self.groups.pg_collection}
        if self.p2p is not None:
            kwargs["p2p_communicator"] = self.p2p
        reports: list[dict[str, torch.Tensor]] = self.schedule(
            forward_step_func=self.forward_step, data_iterator=data_iterator,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=num_microbatches,
            seq_length=self.reader.header.capacity_tokens_per_rank, micro_batch_size=1,
            forward_only=forward_only, **kwargs)
        return reports

    def evaluate(self, at_step: int) -> EvalLog:
        """Run the eval plan through the forward-only schedule (collective); its record."""
        if self.evaluator is None:
            raise ValueError("no eval plan: pass --eval-plan and --eval-dataset")
        return self.evaluator.run(list(self.chunks), at_step, self.run_schedule,
                                  self._step_loss)

    def _step_loss(self, reports: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """(loss sum, loss tokens) of the whole step, on every rank: summed over the last
        stage's microbatches and the pool, then broadcast along the pipeline."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for r in reports:
            total += r["lm loss"].to(self.device)
        pool = self.groups.catalog.pool_group
        if pool is not None:
            dist.all_reduce(total, group=pool)
        if self.topology.pp > 1:
            pp_group = self.groups.pg_collection.pp
            src = dist.get_global_rank(pp_group, pp_group.size() - 1)
            dist.broadcast(total, src=src, group=pp_group)
        loss_sum, count = total.tolist()
        return loss_sum, count

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their global (unsplit) names (tests)."""
        from runtime.adapters.megatron.model import global_names

        out = {}
        for c in self.chunks:
            names = global_names(c.module)
            for name, p in c.module.named_parameters():
                out[names[name]] = p.detach().cpu().clone()
        return out

    def close(self) -> None:
        """Close the plan and dataset this trainer opened itself."""
        for obj in self._owned:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self._owned.clear()

    def run(self) -> TrainResult:
        """Steps [0, stop); rank 0 logs one JSON line per step."""
        logger = StepLogger(self.cfg, enabled=self.rank == 0)
        result = TrainResult()
        try:
            steps = step_range(self.cfg, 0, self.reader.num_steps)
            logger.begin(len(steps))
            for step in steps:
                log = self.step(step)
                result.logs.append(log)
                logger.write(log)
                if self.evaluator is not None and should_evaluate(self.cfg, step, steps[-1]):
                    ev = self.evaluate(step + 1)
                    result.evals.append(ev)
                    logger.write(ev)
        finally:
            logger.close()
        return result
