"""``PlanTrainer``: torchtitan's ``Trainer`` replaying a plan, dynamic CP per microbatch, FSDP.

What it changes in torchtitan's loop, and nothing else (the forward, loss, FSDP gradient
reduction, clipping, optimizer, LR schedule, checkpointer and validator are torchtitan's):

- ``train_step``: the step's gradient-accumulation count is the plan step's microbatch count
  (the same on every rank; it may differ between steps). torchtitan counts the valid labels of
  all of them, sums the count over its "batch" mesh (the whole dp x cp pool: every pool rank is
  an FSDP data-parallel replica, ``data_parallel_shard_degree=-1``, torchtitan's own CP off) and
  divides every microbatch's summed cross entropy by that global count: the per-token loss rule,
  so the result does not depend on the CP sizes a step uses. FSDP sums (not averages) gradients.
- ``forward_backward_step``: binds the microbatch's attention backend (``runtime.backends``: its
  cu_seqlens, CP size and rank, process group) around torchtitan's forward *and* backward; the
  binding is undone in a ``finally`` before the next microbatch.
- ``post_dataloading_process`` (torchtitan's hook between loader and model): hands the bound
  attention to the model as ``attention_masks`` (``PlanMasks``), next to ``positions``.
- weights: when ``Config.seed`` is set, every parameter shard is overwritten with the slice of
  one full CPU model initialised from that seed, so the oracle starts from the same weights.

Rank 0 writes one JSON line per step (the native ``StepLog`` format); the loss is torchtitan's
own global mean, caught by ``PlanMetrics``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from runtime.adapters.torchtitan.attention import PlanMasks
from runtime.adapters.torchtitan.checkpointer import PlanCheckpointManager
from runtime.adapters.torchtitan.data import MICROBATCH_KEY, PlanDataLoader, PlanTokenizer
from runtime.adapters.torchtitan.model import build_llama3, gpt_shape, memory_shape
from runtime.adapters.torchtitan.section import FROM_PLAN, PlanSection, apply_plan
from runtime.adapters.torchtitan.titan import (
    BaseCheckpointManager,
    BaseLoss,
    BaseTokenizer,
    CrossEntropyLoss,
    MetricsProcessor,
    Trainer,
    gloo_sum_reduction,
    mesh_groups,
    quiet_cpu_dtensor_warnings,
    quiet_upstream_warnings,
)
from runtime.adapters.torchtitan.validate import PlanValidator
from runtime.data.batch import to_device
from runtime.dist.groups import set_group_timeout
from runtime.train.backends import ATTENTIONS, AttentionBackend, make_backend
from runtime.train.config import TrainConfig
from runtime.train.guards import nonfinite_ok
from runtime.train.memcheck import check_adapter_memory
from runtime.train.runlog import EvalLog, StepLog, StepLogger


class PlanMetrics(MetricsProcessor):
    """torchtitan's metrics processor, keeping the last logged training and validation loss."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    last_loss: float = float("nan")
    last_validation_loss: float = float("nan")

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        self.last_loss = global_avg_loss
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    def log_validation(self, loss: float, step: int,
                       extra_metrics: dict[str, Any] | None = None) -> None:
        self.last_validation_loss = loss
        super().log_validation(loss, step, extra_metrics)


def _canonical(name: str) -> str:
    # Activation checkpointing and torch.compile wrap modules; the weights' names do not change.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@torch.no_grad()
def copy_seeded_weights(model: torch.nn.Module, model_config: Any, seed: int) -> None:
    """Overwrite ``model``'s (FSDP-sharded or plain) parameters with the matching slices of one
    full CPU llama3 built from ``model_config`` and initialised from ``seed``, on every rank."""
    full = dict(build_llama3(model_config, seed=seed).named_parameters())
    for name, p in model.named_parameters():
        src = full[_canonical(name)].detach().to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds the full tensor, so no scatter is needed.
            shard = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(src)


def _no_checkpoint() -> BaseCheckpointManager.Config:
    return PlanCheckpointManager.Config(enable=False, initial_load_model_only=False)


def _vocab_from_model(config: PlanTrainer.Config) -> None:
    """The data loader's token-id check and the tokenizer's size default to the model's
    vocabulary (an id past it was an ``IndexError`` inside the embedding); a loader size above
    the model's is refused, since it would let such ids through."""
    if config.model_spec is None:
        return
    vocab = int(config.model_spec.model.vocab_size)
    loader = config.dataloader
    if isinstance(loader, PlanDataLoader.Config):
        if loader.vocab_size == 0:
            loader.vocab_size = vocab
        elif loader.vocab_size > vocab:
            raise ValueError(f"dataloader vocab_size {loader.vocab_size} is above the model's "
                             f"{vocab}: token ids up to it would index past the embedding")
    if isinstance(config.tokenizer, PlanTokenizer.Config) and config.tokenizer.vocab_size == 0:
        config.tokenizer.vocab_size = vocab


class PlanTrainer(Trainer):
    """torchtitan's trainer over a plan (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        # torchtitan's defaults that a plan's job cannot use: a tokenizer to load from
        # hf_assets_path (the plan's datasets are pre-tokenized) and an abstract loss (the
        # plan's contract is torchtitan's cross entropy summed over valid labels and divided
        # by the step's global count). The vocabulary sizes default to the model's. And no
        # checkpointing, without torchtitan's default initial_load_model_only=True, which
        # warns on every rank that it has no effect without an initial_load_path.
        tokenizer: BaseTokenizer.Config = field(default_factory=PlanTokenizer.Config)
        loss: BaseLoss.Config = field(default_factory=CrossEntropyLoss.Config)
        checkpoint: BaseCheckpointManager.Config = field(default_factory=_no_checkpoint)
        attention: str = "reference"
        """CP attention backend: reference (all-gather, any device), torch (torch's fused varlen
        kernel on CUDA), te (Transformer Engine, CUDA)."""
        seed: int | None = None
        """Overwrite torchtitan's initial weights with a full model initialised from this seed
        (every rank and the oracle get the same weights); None keeps torchtitan's."""
        log_jsonl: str = ""
        """Rank 0 appends one JSON line per step here; empty: stdout only."""
        quiet: bool = False
        """Do not print the JSON lines."""
        json_summary: bool = False
        """Print the end-of-run summary as one JSON line on stdout."""
        summary_json: str = ""
        """File the end-of-run summary is written to as JSON."""
        progress: bool = True
        """A progress bar on stderr when it is a terminal (rank 0)."""
        skip_nonfinite_steps: bool = False
        """Skip the optimizer update of a step whose loss or gradients are not finite (logged
        ``"skipped": true``) instead of stopping with an error naming the step."""
        memory_check: bool = True
        """Registry route (``--plan.path``): before the first step, refuse a plan whose
        heaviest microbatch would not fit a rank (``runtime.train.memcheck``, as ``dcp-train``
        does); ``--no-memory-check`` skips it."""
        verbose: bool = False
        """Show torchtitan's known warnings (``titan.KNOWN_WARNINGS``: each is listed with why
        it does not apply), silenced by default; unknown ones always show."""
        plan: PlanSection = field(default_factory=PlanSection)
        """``--plan.*`` (``runtime.adapters.torchtitan.registry``): the plan fills the data
        loader, batch sizes, seq_len and validator (``section.apply_plan``); empty: they are
        set directly, as ``trainer_config`` does."""

        def __post_init__(self) -> None:
            # slots=True rebuilds the class: zero-argument super() would name the old one.
            Trainer.Config.__post_init__(self)
            if self.plan.path:
                apply_plan(self)

    config: Config
    dataloader: PlanDataLoader

    def __init__(self, config: Config) -> None:
        if config.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got "
                             f"{config.attention!r}")
        if config.training.seq_len == FROM_PLAN:
            # The registry's configs leave seq_len to the plan section.
            raise SystemExit("--plan.path PLAN is required: the registry's configs replay a plan "
                             "(runtime.adapters.torchtitan.registry)")
        if not config.verbose:
            quiet_upstream_warnings()
        _vocab_from_model(config)
        if config.dataloader.timeout_seconds is None:
            # The plan's CP groups carry the training timeout from the start (they are used in
            # training steps only); torchtitan's own groups follow its two-phase rule below.
            config.dataloader.timeout_seconds = config.comm.train_timeout_seconds
        with quiet_cpu_dtensor_warnings():
            super().__init__(config)
        # torchtitan's mesh groups are made with torch's default timeout (30 min for gloo);
        # its comm.init_timeout_seconds holds until the first step, comm.train_timeout_seconds
        # after it (torchtitan's set_pg_timeouts).
        for group in mesh_groups(self.parallel_dims):
            set_group_timeout(group, timedelta(seconds=config.comm.init_timeout_seconds))
        model = self.model_parts[0]
        if dist.get_backend() == "gloo":
            gloo_sum_reduction(model)
        if config.seed is not None:
            self.load_seeded_weights(config.seed)
        shape = gpt_shape(self.model_config)
        self.backend = make_backend(config.attention, self.dataloader.reader.layout, shape)
        self._masks: PlanMasks | None = None
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        loader = self.dataloader.config
        self.step_logger = StepLogger(
            TrainConfig(plan=loader.plan, dataset=loader.dataset, datasets=tuple(loader.datasets),
                        log_jsonl=config.log_jsonl, quiet=config.quiet,
                        json=config.json_summary, summary_json=config.summary_json,
                        progress=config.progress),
            enabled=dist.get_rank() == 0)
        self.logs: list[StepLog] = []
        if config.plan.path:
            try:
                self._check_memory()
            except BaseException:
                self.close()  # torchtitan's main has no trainer to close yet
                raise
        if config.validator.enable:
            if not isinstance(self.validator, PlanValidator):
                raise ValueError("validator: use PlanValidator.Config (an eval plan)")
            train_layout = self.dataloader.reader.layout

            def backend_for(layout: str) -> AttentionBackend:
                if layout == train_layout:
                    return self.backend
                return make_backend(config.attention, layout, shape)

            # Collective: every rank builds the same evaluation pass here.
            self.validator.attach(self.dataloader, backend_for, self.device,
                                  self.step_logger.write)

    def _check_memory(self) -> None:
        """``dcp-train``'s check before the first step (``launch.check_titan_memory``) for the
        registry route, on every rank: the model's llama3 shape, FSDP over the pool, every
        step up to ``training.steps`` (a resume is loaded later, inside ``train``)."""
        reader = self.dataloader.reader
        loader = self.dataloader.config
        cfg = TrainConfig(plan=loader.plan, dataset=loader.dataset,
                          attention=self.config.attention, memory_check=self.config.memory_check)
        world = dist.get_world_size()
        check_adapter_memory(cfg, reader, memory_shape(self.model_config), self.device,
                             range(min(self.config.training.steps, reader.num_steps)),
                             weight_shards=world, optimizer_shards=world)

    def load_seeded_weights(self, seed: int) -> None:
        """Every rank copies its shard of one full CPU model initialised from ``seed``."""
        copy_seeded_weights(self.model_parts[0], self.model_config, seed)

    # -- torchtitan hooks --------------------------------------------------------------------

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor],
                                 labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        inputs, labels, extra_kwargs = super().post_dataloading_process(input_dict, labels)
        if self._masks is None:
            raise RuntimeError("post_dataloading_process ran outside a bound microbatch")
        extra_kwargs["attention_masks"] = self._masks
        return inputs, labels, extra_kwargs

    def forward_backward_step(self, *, input_dict: Any, labels: Any,
                              global_valid_tokens: torch.Tensor) -> torch.Tensor:
        micro = input_dict.pop(MICROBATCH_KEY)
        mb = to_device(micro.inputs, self.device)
        with self.backend.bind(mb, micro.cp_group, micro.cp_global_ranks,
                               host=micro.inputs) as attention:
            self._masks = PlanMasks(attention)
            try:
                loss: torch.Tensor = super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens)
            finally:
                self._masks = None
        self._loss_sum += loss.detach().double()  # this rank's share of the step's mean loss
        return loss

    def _guarded_optimizer_step(self, plan_step: int) -> bool:
        """The non-finite guard (``runtime.train.guards.nonfinite_ok``, as the native trainer)
        before torchtitan's optimizer step: every rank holds other FSDP shards, so the ranks
        agree on the verdict. True if the update ran."""
        loss = self._loss_sum.clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(loss)  # every pool rank is a data-parallel replica
        grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        return nonfinite_ok(plan_step, float(loss), grads,
                            skip=self.config.skip_nonfinite_steps, agree=True)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Any], torch.Tensor]]) -> None:
        plan_step = self.step - 1  # torchtitan counts steps from 1, plans from 0
        if self.dataloader.next_step != plan_step:
            raise RuntimeError(f"trainer at step {plan_step}, data loader at plan step "
                               f"{self.dataloader.next_step}")
        self.gradient_accumulation_steps = self.dataloader.num_microbatches(plan_step)
        if not self.logs:
            self.step_logger.begin(self.config.training.steps - plan_step)
        t0 = time.perf_counter()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        optimizers = self.optimizers
        update = optimizers.step
        skipped = False

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            nonlocal skipped
            if self._guarded_optimizer_step(plan_step):
                return update(*args, **kwargs)
            skipped = True
            return None

        # torchtitan's train_step calls optimizers.step() right after its gradient clipping:
        # the guard runs there, for this step only.
        optimizers.step = guarded_step
        try:
            super().train_step(data_iterator)
        finally:
            del optimizers.step  # the class's method again
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        metrics = self.metrics_processor
        assert isinstance(metrics, PlanMetrics)
        tokens, loss_tokens = self.dataloader.token_counts(plan_step)
        log = StepLog(step=plan_step, loss=metrics.last_loss, tokens=tokens,
                      loss_tokens=loss_tokens,
                      microbatches=self.gradient_accumulation_steps,
                      seconds=time.perf_counter() - t0, skipped=skipped)
        self.logs.append(log)
        self.step_logger.write(log)

    # -- results -----------------------------------------------------------------------------

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Full (unsharded) weights and gradients on the CPU; collective over the pool."""
        state, grads = {}, {}
        for name, p in self.model_parts[0].named_parameters():
            key = _canonical(name)
            state[key] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            if p.grad is not None:
                g = p.grad
                grads[key] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu()
        return state, grads

    @property
    def evals(self) -> list[EvalLog]:
        """The evaluations this run made (empty without an eval plan)."""
        validator = getattr(self, "validator", None)
        return list(validator.logs) if isinstance(validator, PlanValidator) else []

    def close(self) -> None:
        validator = getattr(self, "validator", None)
        if isinstance(validator, PlanValidator):
            validator.close()
        self.step_logger.close()
        self.dataloader.close()
        super().close()
