"""``PlanSession``: a plan bound to the groups and the model of a running Megatron-LM job.

It owns what the launcher's hooks hand to Megatron-LM: per training step the plan's data
iterator (one per model chunk under virtual pipelining) and its microbatch count, per
evaluation iteration the eval plan's, and the ``forward_step_func`` that binds each
microbatch's CP group (``runtime.adapters.megatron.binding.forward``: RoPE and core attention)
and returns the per-token loss. For a MoE model the same forward step binds each microbatch's
CP and TP x CP groups and rows into every router, and a ``RouterSteps`` (``binding.routers``)
keeps each training step's load-balancing term and tokens per expert, as in ``PlanJob``; with
``global_aux_loss`` the launcher runs the step's forward-only statistics pass first
(``counting_step``). With multi-token prediction the batches carry each microbatch's MTP
targets and shift map (``mtp_depth``), the loss adds the MTP term, and its per-depth report is
split into the ``[sum, count]`` pairs Megatron-LM's ``train_step`` takes (``mtp_1 loss``, ...).
It reuses the adapter's binding as it is: ``PlanBatches``
turns plan rows into Megatron batches, ``groups_from_parallel_state`` wraps Megatron's own
hybrid DP x CP groups (the launcher asks ``initialize_model_parallel`` for them), so no group
is created twice.

FLOPs: Megatron-LM's throughput line counts packed work from ``cu_seqlens`` that every rank of
a data-parallel replica adds (``update_seqlen_stats_from_cu_seqlens``) and divides the world's
sum by tp x cp x pp. A CP group of k ranks shares one pack, so only its rank 0 adds the pack's
real ``cu_seqlens`` and the others add nothing but still take part in the all-reduce; only the
first model chunk adds (virtual stages see the same microbatch). Every rank of a TP group and
every pipeline stage adds, as Megatron-LM's own forward step does, and is divided out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.sources.dataset import plan_items
from runtime.adapters.megatron.binding.batch import Batch, PlanBatches
from runtime.adapters.megatron.binding.forward import ForwardOptions, forward_step
from runtime.adapters.megatron.binding.groups import MegatronGroups, groups_from_parallel_state
from runtime.adapters.megatron.binding.routers import RouterSteps
from runtime.adapters.megatron.binding.step_loss import StepLoss, reduce_reports
from runtime.adapters.megatron.compat import mcore
from runtime.data.evaluation import EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import open_plan_source
from runtime.data.tokens import TokenSource
from runtime.dist.topology import Topology

_CHUNK = "dcp_chunk"
"""The batch key that tells the forward step which model chunk it runs (FLOPs count once)."""


class PlanSession:
    """The training plan (and an eval plan) of this rank, attached to Megatron-LM's job.

    Built in two stages: ``open`` at argument validation (the plans and their datasets, before
    any group exists: every check can still fail cheaply), ``attach`` once Megatron-LM built
    its groups and model.
    """

    def __init__(self, plan: str, eval_plan: str = "") -> None:
        self.reader = PlanReader(plan)
        self.eval_reader: PlanReader | None = None
        try:
            if eval_plan:
                self.eval_reader = PlanReader(eval_plan)
                check_eval_layout(self.eval_reader.header, self.reader.header,
                                  eval_source=eval_plan, train_source=plan)
        except BaseException:
            self.close()
            raise
        self.source: TokenSource | None = None
        self.eval_source: TokenSource | None = None
        self.groups: MegatronGroups | None = None
        self.batches: PlanBatches | None = None
        self.eval_batches: PlanBatches | None = None
        self.eval_schedule: EvalSchedule | None = None
        self.options: ForwardOptions | None = None
        self.mtp_depth = 0
        """The model's multi-token prediction layers (0: none)."""
        self.routers: RouterSteps | None = None
        """A MoE model's per-step routing bookkeeping (None for a dense model)."""
        self.device = torch.device("cpu")
        self.count_flops = False
        """True while a training step runs (evaluation adds nothing to the FLOPs figure)."""

    @property
    def header(self) -> Any:
        return self.reader.header

    def open_sources(self, dataset: Sequence[str], eval_dataset: Sequence[str] = (), *,
                     tokenizer: str | None = None) -> None:
        """Open the plans' datasets (fingerprints checked: ``open_plan_source``); a text plan's
        records are tokenized with its tokenizer, read from ``tokenizer`` when given (Megatron-
        LM's ``--tokenizer-model``, checked by ``flags.text_tokenizer``)."""
        self.source = open_plan_source(self.reader, tuple(dataset) or _files(self.reader),
                                       tokenizer=tokenizer)
        if self.eval_reader is not None:
            text = bool(self.eval_reader.header.dataset.tokenizer)
            self.eval_source = open_plan_source(
                self.eval_reader, tuple(eval_dataset) or _files(self.eval_reader),
                tokenizer=tokenizer if text else None)

    def attach(self, model: Sequence[nn.Module], *, device: torch.device, vocab_size: int,
               eval_iters: int) -> None:
        """Bind to Megatron's initialised ``parallel_state`` and this rank's model chunks."""
        assert self.source is not None, "open_sources first"
        ps = mcore.parallel_state
        p = self.header.parallel
        topology = Topology.from_header(p, rank=dist.get_rank(),
                                        world_size=dist.get_world_size())
        megatron_pool_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        if megatron_pool_rank != topology.pool_rank or \
                ps.get_tensor_model_parallel_rank() != topology.tp_rank or \
                ps.get_pipeline_model_parallel_rank() != topology.pp_rank:
            raise ValueError(f"rank {dist.get_rank()}: Megatron-LM placed it at pool rank "
                             f"{megatron_pool_rank}, tp rank "
                             f"{ps.get_tensor_model_parallel_rank()}, pp rank "
                             f"{ps.get_pipeline_model_parallel_rank()}; the plan's order puts "
                             f"it at {topology.pool_rank}, {topology.tp_rank}, "
                             f"{topology.pp_rank} (use Megatron-LM's default tp-cp-ep-dp-pp "
                             "order, without --use-tp-pp-dp-mapping)")
        self.groups = groups_from_parallel_state(topology, self.header.cp_sizes)
        self.device = device
        from runtime.adapters.megatron_lm import mlm

        config = mlm.training.get_model_config(model[0])
        self.mtp_depth = int(config.mtp_num_layers or 0)
        self.batches = PlanBatches(self.reader, self.source, self.groups, num_chunks=len(model),
                                   device=device, vocab_size=vocab_size,
                                   mtp_depth=self.mtp_depth)
        if config.num_moe_experts:
            self.routers = RouterSteps(config, groups=self.groups, device=device,
                                       sequence_parallel=bool(config.sequence_parallel))
        scaling = float(config.mtp_loss_scaling_factor) if self.mtp_depth else 0.0
        self.options = ForwardOptions(tp_group=self.groups.pg_collection.tp,
                                      routers=self.routers, mtp_loss_scaling_factor=scaling)
        if self.eval_reader is not None and self.eval_source is not None:
            self.eval_schedule = EvalSchedule(self.eval_reader, self.eval_source, topology,
                                              self.groups.catalog, max_steps=eval_iters)
            self.eval_batches = PlanBatches(self.eval_reader, self.eval_source, self.groups,
                                            num_chunks=len(model), device=device,
                                            vocab_size=vocab_size, mtp_depth=self.mtp_depth)

    # ---- what the schedule gets --------------------------------------------------------------

    def num_microbatches(self, step: int) -> int:
        return self.reader.step(step).num_microbatches

    def data_iterator(self, step: int) -> Iterator[Batch] | list[Iterator[Batch]]:
        """Training step ``step``'s batches (a list of one iterator per chunk under vpp)."""
        assert self.batches is not None
        batches = self.batches

        def chunk(c: int) -> Iterator[Batch]:
            for m in range(batches.num_microbatches(step)):
                yield _tag(batches.batch(step, m, c), c)
        its = [chunk(c) for c in range(batches.num_chunks)]
        return its[0] if len(its) == 1 else its

    def begin_step(self, step: int) -> bool:
        """Open training step ``step``'s routing statistics (a MoE model); True when the step
        needs its statistics pass (``global_aux_loss``: ``counting_step`` over the step's
        batches, inside ``routers.counting()``) before the training forward."""
        if self.routers is None:
            return False
        assert self.batches is not None
        self.routers.begin(self.batches.step_tokens(step))
        return self.routers.needs_counts

    def eval_num_microbatches(self, step: int) -> int:
        assert self.eval_schedule is not None
        return self.eval_schedule.step_num_microbatches[step]

    def eval_data_iterator(self, step: int) -> Iterator[Batch] | list[Iterator[Batch]]:
        """Eval plan step ``step``'s batches, built as training's."""
        assert self.eval_schedule is not None
        assert self.eval_batches is not None
        schedule, batches = self.eval_schedule, self.eval_batches

        def chunk(c: int) -> Iterator[Batch]:
            for micro in schedule.step_microbatches(step):
                yield _tag(batches.to_batch(micro.inputs, micro.rows, c), c)
        its = [chunk(c) for c in range(batches.num_chunks)]
        return its[0] if len(its) == 1 else its

    def forward_step(self, data_iterator: Iterator[Batch], model: nn.Module
                     ) -> tuple[Any, Any]:
        """Megatron-LM's ``forward_step_func`` for a plan microbatch (module docstring)."""
        assert self.options is not None
        batch = next(data_iterator)
        if self.count_flops and batch.get(_CHUNK, 0) == 0:
            _add_seqlen_stats(batch)
        output, loss = forward_step(batch, model, self.options)
        if loss is None or not self.mtp_depth:
            return output, loss
        return output, functools.partial(_per_depth_reports, loss)

    def counting_step(self, data_iterator: Iterator[Batch], model: nn.Module
                      ) -> tuple[Any, Any]:
        """``global_aux_loss``'s statistics pass: routing only, no loss (``forward_step(...,
        counting=True)``)."""
        assert self.options is not None
        return forward_step(next(data_iterator), model, self.options, counting=True)

    def step_loss(self, reports: list[dict[str, torch.Tensor]], *, training: bool
                  ) -> StepLoss:
        """The step's per-token loss over the pool, on every rank (collective); a training
        step of a MoE model also reports its load-balancing term and tokens per expert."""
        assert self.groups is not None
        topology = self.groups.topology
        loss_sum, count, mtp_loss = reduce_reports(
            [_packed_reports(r) for r in reports], mtp_depth=self.mtp_depth, device=self.device,
            pool_group=self.groups.catalog.pool_group,
            pp_group=self.groups.pg_collection.pp if topology.pp > 1 else None)
        aux, tokens_per_expert = None, None
        if training and self.routers is not None:
            aux, tokens_per_expert = self.routers.report(count)
            if aux is not None:
                _track_load_balancing(self.routers, aux, first_stage=topology.pp_rank == 0)
        return StepLoss(loss=loss_sum / max(count, 1.0), loss_tokens=int(count),
                        moe_aux_loss=aux, moe_tokens_per_expert=tokens_per_expert,
                        mtp_loss=mtp_loss if training else None)

    def step_tokens(self, step: int) -> int:
        assert self.batches is not None
        return self.batches.step_tokens(step)

    def close(self) -> None:
        for obj in (self.reader, self.eval_reader, self.source, self.eval_source):
            close = getattr(obj, "close", None)
            if close is not None:
                close()


_TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss"}
"""Megatron's metric name of each load-balancing type (router.py)."""


def _track_load_balancing(routers: RouterSteps, aux: float, *, first_stage: bool) -> None:
    """Megatron-LM's log line (``track_moe_metrics``) reads the router methods' own records,
    which the binding replaces: record the step's term there instead, so that its figure is the
    adapter's load-balancing loss per MoE layer, unweighted (``aux / coeff / layers``). Megatron
    sums the records over the pipeline, averages them over the data-parallel ranks and scales
    them by ``1 / get_num_microbatches()`` (its global-batch count, not the plan's), so every
    rank of the first stage records the same value times that count, spread evenly over the
    layers (``--moe-per-layer-logging`` is refused)."""
    from runtime.adapters.megatron_lm import mlm

    config = routers.config
    (kind,) = routers.active  # one type: model_flags.refusals
    coeff = config.moe_aux_loss_coeff
    coeff = float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff)
    layers = int(config.num_layers)
    value = aux / coeff / layers * mlm.training.get_num_microbatches() if first_stage else 0.0
    for layer in range(1, layers + 1):
        mcore.moe_utils.save_to_aux_losses_tracker(
            _TRACKED[kind], torch.tensor(value, device=routers.device), layer, layers)


def _per_depth_reports(loss: Any, output: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
    # Megatron-LM's train_step takes report values of 1 or 2 elements: "mtp loss" ([sum_1,
    # count_1, ..., sum_D, count_D], loss.loss_func) becomes one [sum, count] pair per depth,
    # which its log line then prints as each depth's per-token loss.
    loss_sum, num_tokens, reports = loss(output)
    packed = reports.pop("mtp loss", None)
    if packed is not None:
        for d, pair in enumerate(packed.reshape(-1, 2)):
            reports[f"mtp_{d + 1} loss"] = pair
    return loss_sum, num_tokens, reports


def _packed_reports(report: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    depths = sorted((int(k[4:-5]), v) for k, v in report.items()
                    if k.startswith("mtp_") and k.endswith(" loss"))
    if not depths:
        return report
    return {**report, "mtp loss": torch.cat([v.reshape(-1) for _, v in depths])}


def _tag(batch: Batch, chunk: int) -> Batch:
    batch[_CHUNK] = chunk
    return batch


@functools.cache
def _seqlen_stats() -> Any:
    from runtime.adapters.megatron_lm import mlm

    # 0.19 counts packed work from cu_seqlens; earlier releases count GBS x seq_length.
    return getattr(mlm.training, "update_seqlen_stats_from_cu_seqlens", lambda cu: None)


def _add_seqlen_stats(batch: Batch) -> None:
    psp = batch["packed_seq_params"]
    group = psp.cp_group
    if group is None or group.size() == 1 or group.rank() == 0:
        _seqlen_stats()(psp.cu_seqlens_q)
    else:  # takes part in consume_seqlen_stats_in_iteration's all-reduce, adds nothing
        _seqlen_stats()(torch.zeros(2, dtype=psp.cu_seqlens_q.dtype,
                                    device=psp.cu_seqlens_q.device))


def _files(reader: PlanReader) -> tuple[str, ...]:
    return plan_items(reader.header.dataset.files, reader.header.dataset.path)
