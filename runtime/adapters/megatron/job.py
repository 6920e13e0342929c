"""``PlanJob``: a plan bound to this rank of a Megatron-core job; the adapter's public API.

A Megatron user keeps their model provider, Megatron's DDP, optimizer and schedules; the plan
brings the data, the per-microbatch CP groups and the loss. After ``init_process_group``::

    job = PlanJob("plans/job.arrow", "data/train.jsonl", device="cuda")
    config = job.transformer_config(num_layers=..., hidden_size=..., ...)   # + the plan's fields
    model = job.get_model(model_provider, DistributedDataParallelConfig(...))
    optimizer = job.get_optimizer(OptimizerConfig(...), model)
    schedule = get_forward_backward_func(pp_size=job.pp, vp_size=job.vp_size)
    for step in job.steps():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = schedule(forward_step_func=job.forward_step,
                           data_iterator=job.data_iterator(step, model), model=model,
                           num_microbatches=job.num_microbatches(step),
                           seq_length=job.seq_length, micro_batch_size=1, forward_only=False,
                           **job.schedule_kwargs)
        loss = job.step_loss(reports)            # the step's per-token loss, on every rank
        if job.grads_finite(step, loss, model):  # main_grad on every rank, one verdict
            optimizer.step()

What each piece does (each method's docstring has the details): the constructor opens the plan
and its dataset (bad records as planned, fingerprints checked), installs the workarounds and
hooks (``binding.install``) and creates every process group unless ``groups`` is given
(``groups_from_parallel_state`` keeps Megatron's own). ``transformer_config`` adds the fields a
plan fixes (tp, pp, vpp, sequence parallelism, per-token loss, variable THD lengths, no static
CP, bf16) to the caller's and refuses one that contradicts them, and a MoE feature the binding
cannot run (``routers.check_config``). ``get_model`` is Megatron-LM's ``get_model`` over the
pool (chunks per virtual stage, ``Float16Module`` under bf16, Megatron's DDP and the schedules'
hooks). ``data_iterator`` / ``num_microbatches`` give a step's batches and count (which vary by
step; a MoE model's routing statistics open there), ``forward_step`` binds each microbatch
(``binding/forward.py``), ``step_loss`` / ``grads_finite`` reduce a step, ``save`` / ``load``
go through ``dist_checkpointing`` (``parallel/checkpoint.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.sources.dataset import plan_items
from runtime.adapters.megatron.binding import mtp
from runtime.adapters.megatron.binding.batch import Batch, PlanBatches
from runtime.adapters.megatron.binding.forward import ForwardOptions, forward_step
from runtime.adapters.megatron.binding.groups import MegatronGroups, create_groups
from runtime.adapters.megatron.binding.install import install
from runtime.adapters.megatron.binding.routers import RouterSteps, check_config
from runtime.adapters.megatron.binding.step_loss import StepLoss, reduce_reports
from runtime.adapters.megatron.compat import mcore, patches
from runtime.adapters.megatron.model.gpt import ModelParallel, check_split, layer_spec, plan_fields
from runtime.adapters.megatron.parallel import ddp
from runtime.data.plan_reader import PlanReader
from runtime.data.plan_source import check_plan_source, open_plan_source
from runtime.data.tokens import TokenSource
from runtime.dist.topology import Topology
from runtime.train.config import DTYPES
from runtime.train.guards import nonfinite_ok
from runtime.train.megatron_options import MegatronOptions

ModelProvider = Callable[..., nn.Module]
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "ffn_hidden_size", "normalization", "gated_linear_unit")
"""The TransformerConfig fields a checkpoint records as the model's shape (``save``)."""


class PlanJob:
    """A plan replayed by this rank inside Megatron-core (see the module docstring).

    Args:
        plan: the plan file (or an opened ``PlanReader``, kept open by the caller).
        dataset: the dataset the plan was made for (paths, or an opened ``TokenSource``);
            None: the files the plan's header lists.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        dtype: ``fp32``, or ``bf16`` (Megatron's mixed precision; GPU).
        groups: groups the caller owns (``groups_from_parallel_state``); default: created.
        field: the token field, overriding the plan's recorded one.
        timeout_minutes: every group's collective timeout.
        seed: seed of Megatron's model-parallel RNG tracker (CUDA).
        vocab_size: when set, token ids (and a text plan's tokenizer) must fit in it.
        tokenizer: a text plan's tokenizer.json, if not where the plan says (same sha256).
        attention: ``plan`` (the adapter's core attention, any device) or ``te``.

    Raises:
        ValueError: a job that is not the plan's (world size, layout), or a dataset that is
            not the plan's, on every rank alike.
    """

    def __init__(self, plan: str | PlanReader, dataset: str | Sequence[str] | TokenSource | None
                 = None, *, device: str | torch.device = "cpu", dtype: str = "fp32",
                 groups: MegatronGroups | None = None, field: str | None = None,
                 timeout_minutes: float = 10.0, seed: int = 0, vocab_size: int = 0,
                 attention: str = "plan", tokenizer: str | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        install(self.device)
        self._owned: list[Any] = []
        if isinstance(plan, PlanReader):
            reader = plan
        else:
            reader = PlanReader(plan)
            self._owned.append(reader)
        try:
            source: TokenSource
            if dataset is None or isinstance(dataset, (str, list, tuple)):
                paths = (dataset,) if isinstance(dataset, str) else tuple(dataset or ())
                paths = paths or plan_items(reader.header.dataset.files, reader.header.dataset.path)
                source = open_plan_source(reader, paths, field=field, tokenizer=tokenizer,
                                          vocab_size=vocab_size)
                self._owned.append(source)
            else:
                assert not isinstance(dataset, str)
                source = dataset  # type: ignore[assignment]
                check_plan_source(reader, source)
            self.reader, self.source = reader, source
            header = reader.header
            topology = Topology.from_header(header.parallel, rank=dist.get_rank(),
                                            world_size=dist.get_world_size())
            if groups is None:
                groups = create_groups(topology, header.cp_sizes,
                                       timeout=timedelta(minutes=timeout_minutes))
            elif groups.topology != topology:
                raise ValueError(f"groups built for {groups.topology}, the plan needs "
                                 f"{topology}")
            self.groups, self.topology = groups, topology
            p = header.parallel
            self.parallel = ModelParallel(
                tp=p.tp, pp=p.pp, vpp=p.vpp, sequence_parallel=p.sequence_parallel,
                microbatch_group_size=p.microbatch_group_size, dtype=DTYPES[dtype])
            self.attention = attention
            self.vocab_size = vocab_size
            self.config: Any = None
            self._batches: PlanBatches | None = None
            if self.device.type == "cuda":
                mcore.tp_random.model_parallel_cuda_manual_seed(
                    seed, tp_rank=topology.tp_rank, ep_rank=0, etp_rank=topology.tp_rank)
            self.p2p: patches.TaggedP2PCommunicator | None = None
            self.options = MegatronOptions()
            self.routers: RouterSteps | None = None
            """A MoE model's per-step routing bookkeeping (set by ``transformer_config``)."""
        except BaseException:
            self.close()
            raise

    # ---- the job's shape -------------------------------------------------------------------

    @property
    def pg_collection(self) -> mcore.ProcessGroupCollection:
        """Megatron's groups for DDP, the optimizer and the schedules."""
        return self.groups.pg_collection

    @property
    def num_steps(self) -> int:
        return self.reader.num_steps

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def vp_size(self) -> int | None:
        """``get_forward_backward_func``'s ``vp_size`` (None without virtual stages)."""
        return self.parallel.vpp if self.parallel.vpp > 1 else None

    @property
    def mtp_depth(self) -> int:
        """The config's multi-token prediction layers (0: none, or no config yet)."""
        return int(self.config.mtp_num_layers or 0) if self.config is not None else 0

    @property
    def seq_length(self) -> int:
        """The schedules' ``seq_length`` (the plan's capacity; THD lengths vary below it)."""
        return self.reader.header.capacity_tokens_per_rank

    def steps(self, start: int = 0, stop: int = 0) -> range:
        """Steps [start, stop) of the plan (stop 0: to the end)."""
        return range(start, min(stop, self.num_steps) if stop else self.num_steps)

    # ---- model, DDP, optimizer -------------------------------------------------------------

    def transformer_config(self, **fields: Any) -> mcore.TransformerConfig:
        """Megatron's ``TransformerConfig``: ``fields`` (the model) plus the plan's fields."""
        fixed = plan_fields(self.parallel)
        clash = {k: v for k, v in fields.items() if k in fixed and fixed[k] != v}
        if clash:
            raise ValueError(f"TransformerConfig fields the plan fixes: {clash} (the plan "
                             f"needs {({k: fixed[k] for k in clash})})")
        check_split(self.parallel, vocab_size=self.vocab_size or None,
                    num_query_groups=fields.get("num_query_groups")
                    or fields.get("num_attention_heads"), num_layers=fields.get("num_layers"))
        config = mcore.TransformerConfig(**{**fields, **fixed})
        check_config(config, tp=self.parallel.tp,
                     sequence_parallel=self.parallel.sequence_parallel)
        mtp.check_config(config, tp=self.parallel.tp, vpp=self.parallel.vpp)
        config.finalize_model_grads_func = mcore.finalize_model_grads
        self.config = config
        self.routers = None
        if config.num_moe_experts:
            self.routers = RouterSteps(config, groups=self.groups, device=self.device,
                                       sequence_parallel=self.parallel.sequence_parallel)
        return config

    def layer_spec(self, config: mcore.TransformerConfig, vp_stage: int | None = None) -> object:
        """The block spec for one chunk: Megatron's local spec with the adapter's core
        attention (``attention="plan"``, any device) or Megatron's TE spec (``"te"``).

        Raises:
            ValueError: ``attention="plan"`` with a normalization other than RMSNorm (its spec
                swaps in a sequence-parallel RMSNorm; Megatron's torch fallbacks refuse SP).
        """
        if self.attention != "te" and config.normalization != "RMSNorm":
            raise ValueError(f"attention {self.attention!r} builds RMSNorm layers; the config "
                             f"says normalization={config.normalization!r} (use RMSNorm, or "
                             "attention='te' on a GPU)")
        return layer_spec(config, attention=self.attention, vp_stage=vp_stage,
                          pp_rank=self.topology.pp_rank)

    def get_model(self, provider: ModelProvider, ddp_config: Any = None, *,
                  options: MegatronOptions | None = None) -> list[nn.Module]:
        """This rank's model chunks, wrapped for data parallelism (module docstring).

        ``ddp_config``: Megatron's ``DistributedDataParallelConfig`` (default: built from
        ``options``, whose ``grad_sync="pool"`` wraps in ``PoolGradSync`` instead).
        """
        if self.config is None:
            raise ValueError("call transformer_config(...) before get_model(...)")
        options = options or MegatronOptions()
        config = self.config
        pp, vpp, rank = self.parallel.pp, self.parallel.vpp, self.topology.pp_rank
        # Built without the embedding group: GPTModel would all-reduce the tied embedding
        # copies through .cuda() at construction (language_module.py); the schedules get the
        # real group for the gradient all-reduce.
        build_pgc = mcore.process_group_collection({**vars(self.pg_collection), "embd": None})
        chunks: list[nn.Module] = []
        for c in range(vpp):
            # A multi-token prediction block builds from the chunk's groups (mtp.building).
            with mtp.building(build_pgc) if self.mtp_depth else contextlib.nullcontext():
                chunk = provider(pre_process=rank == 0 and c == 0,
                                 post_process=rank == pp - 1 and c == vpp - 1,
                                 vp_stage=c if vpp > 1 else None, pg_collection=build_pgc)
            chunk = chunk.to(self.device)
            if config.bf16:
                chunk = mcore.Float16Module(config, chunk)
            chunks.append(chunk)
        wrapped, options = ddp.wrap_chunks(chunks, config, self.pg_collection,
                                           self.groups.pool_group, options, ddp_config)
        ddp.schedule_hooks(config, wrapped, options)
        self.options = options
        if pp > 1:
            self.p2p = patches.TaggedP2PCommunicator(self.pg_collection.pp, config)
        self._batches = PlanBatches(self.reader, self.source, self.groups,
                                    num_chunks=len(wrapped), device=self.device,
                                    vocab_size=self.vocab_size, mtp_depth=self.mtp_depth)
        return wrapped

    def get_optimizer(self, optimizer_config: Any, model: list[nn.Module]) -> Any:
        """Megatron's optimizer (``get_megatron_optimizer``) over ``model`` with the job's
        groups."""
        return mcore.get_megatron_optimizer(optimizer_config, model, self.pg_collection)

    # ---- one step ----------------------------------------------------------------------------

    @property
    def batches(self) -> PlanBatches:
        if self._batches is None:
            raise ValueError("call get_model(...) first (the batches need the chunk count)")
        return self._batches

    def num_microbatches(self, step: int) -> int:
        """The plan's microbatch count of ``step`` (the same on every rank)."""
        return self.reader.step(step).num_microbatches

    def data_iterator(self, step: int, model: Sequence[nn.Module] | None = None
                      ) -> Iterator[Batch] | list[Iterator[Batch]]:
        """``step``'s batches: an iterator, or one per chunk with virtual stages.

        For a MoE model this opens the step's routing statistics; with ``global_aux_loss`` it
        first runs the step's forward-only statistics pass over ``model`` (every microbatch's
        routing before any backward: ``moe.py``), so pass the model then (collective).
        """
        if self.routers is not None:
            self.routers.begin(self.batches.step_tokens(step))
            if self.routers.needs_counts:
                if model is None:
                    raise ValueError("global_aux_loss: pass the model to data_iterator(step, "
                                     "model) (the step's routing statistics need a forward "
                                     "pass)")
                with self.routers.counting():
                    self._statistics_pass(step, list(model))
        return self.batches.data_iterator(step)

    def _statistics_pass(self, step: int, chunks: list[nn.Module]) -> None:
        # global_aux_loss: the step's forward through Megatron's own schedule (PP included),
        # routing only: every microbatch's counts before any backward needs them.
        schedule = mcore.get_forward_backward_func(pp_size=self.pp, vp_size=self.vp_size)

        def counting_step(data_iterator: Iterator[Batch], model: nn.Module) -> tuple[Any, Any]:
            return self.forward_step(data_iterator, model, counting=True)

        schedule(forward_step_func=counting_step, data_iterator=self.batches.data_iterator(step),
                 model=chunks if len(chunks) > 1 else chunks[0],
                 num_microbatches=self.num_microbatches(step), seq_length=self.seq_length,
                 micro_batch_size=1, forward_only=True, **self.schedule_kwargs)

    @property
    def schedule_kwargs(self) -> dict[str, Any]:
        """The schedules' keyword arguments beyond the standard ones (groups, P2P)."""
        kwargs: dict[str, Any] = {"pg_collection": self.pg_collection}
        if self.p2p is not None:
            kwargs["p2p_communicator"] = self.p2p
        return kwargs

    def forward_step(self, data_iterator: Iterator[Batch], model: nn.Module, *,
                     counting: bool = False) -> tuple[Any, Any]:
        """Megatron's ``forward_step_func``: one microbatch through one chunk
        (``binding/forward.py``; ``counting``: ``global_aux_loss``'s statistics pass, forward
        only, no loss)."""
        return forward_step(next(data_iterator), model, self.forward_options, counting=counting)

    @property
    def forward_options(self) -> ForwardOptions:
        """What ``forward_step`` binds besides the microbatch's groups (from the config)."""
        config = self.config
        dtype = self.parallel.dtype
        autocast = None
        if dtype != torch.float32 and not (config is not None and config.bf16):
            autocast = (self.device.type, dtype)  # PoolGradSync's bf16
        scaling = 0.0
        if config is not None and self.mtp_depth:
            scaling = float(config.mtp_loss_scaling_factor)
        return ForwardOptions(tp_group=self.pg_collection.tp, routers=self.routers,
                              autocast=autocast, mtp_loss_scaling_factor=scaling)

    def step_loss(self, reports: list[dict[str, torch.Tensor]]) -> StepLoss:
        """The step's per-token loss on every rank: the last stage's reports summed over the
        microbatches and the pool, then broadcast along the pipeline (``step_loss.py``)."""
        loss_sum, count, mtp_loss = reduce_reports(
            reports, mtp_depth=self.mtp_depth, device=self.device,
            pool_group=self.groups.catalog.pool_group,
            pp_group=self.pg_collection.pp if self.topology.pp > 1 else None)
        aux, tokens_per_expert = (self.routers.report(count) if self.routers is not None
                                  else (None, None))
        return StepLoss(loss=loss_sum / max(count, 1.0), loss_tokens=int(count),
                        moe_aux_loss=aux, moe_tokens_per_expert=tokens_per_expert,
                        mtp_loss=mtp_loss)

    def grads_finite(self, step: int, loss: StepLoss, model: list[nn.Module], *,
                     skip: bool = False) -> bool:
        """Whether the step's loss and gradients (``main_grad`` under DDP) are finite, agreed
        by every rank; a ValueError naming the step unless ``skip`` (then False: skip)."""
        return nonfinite_ok(step, loss.loss, ddp.grad_tensors(model), skip=skip, agree=True)

    # ---- checkpoints -----------------------------------------------------------------------

    def checkpoint_meta(self, model: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint must match on resume: the plan (header digest), its dataset and
        step count, and ``model`` (the model's shape; default: the TransformerConfig's)."""
        from runtime.train.build import plan_meta

        if model is None and self.config is not None:
            model = {k: getattr(self.config, k) for k in _SHAPE_FIELDS}
        return {**plan_meta(self.reader), "model": model}

    def save(self, directory: str, model: list[nn.Module], optimizer: Any, *, next_step: int,
             scheduler: Any = None, meta: dict[str, Any] | None = None) -> Any:
        """Checkpoint through Megatron's ``dist_checkpointing`` (collective; ``checkpoint``):
        ``DIR/step-<next_step>``, made the latest once complete."""
        from runtime.adapters.megatron.parallel import checkpoint

        return checkpoint.save(directory, chunks=model, optimizer=optimizer,
                               scheduler=scheduler, groups=self.groups, options=self.options,
                               next_step=next_step, meta=meta or self.checkpoint_meta())

    def load(self, directory: str, model: list[nn.Module], optimizer: Any, *,
             scheduler: Any = None, meta: dict[str, Any] | None = None) -> int:
        """Restore a checkpoint (or the latest under ``directory``) after verifying it;
        collective. Returns the step to continue at."""
        from runtime.adapters.megatron.parallel import checkpoint

        resumed = checkpoint.load(directory, chunks=model, optimizer=optimizer,
                                  scheduler=scheduler, groups=self.groups, options=self.options,
                                  expect_meta=meta or self.checkpoint_meta())
        return resumed.next_step

    def close(self) -> None:
        """Close the plan and dataset this job opened."""
        for obj in self._owned:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        self._owned.clear()

