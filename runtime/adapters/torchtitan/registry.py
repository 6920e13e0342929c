"""A torchtitan ``config_registry`` whose configs replay a plan: torchtitan's own entry point.

::

    torchrun --nproc-per-node 4 -m torchtitan.train \\
        --module runtime.adapters.torchtitan.registry --config llama3_debugmodel \\
        --plan.path PLAN --plan.dataset DATA [--plan.eval_path EVAL] [other tyro overrides]

torchtitan's ``ConfigManager`` imports this module (``--module`` takes a fully qualified name),
calls the function named by ``--config`` and parses every other flag onto its result with tyro.
Each function here is torchtitan's llama3 config of that name (``torchtitan.models.llama3.
config_registry``) with what a plan needs changed, and nothing else:

- the trainer is ``PlanTrainer`` (its ``Config``, with the ``plan`` section of
  ``section.PlanSection``), every layer's inner attention is the plan's (``PlanAttention``);
- loss: torchtitan's cross entropy itself (a ``ChunkedLossWrapper``'s inner loss: the plan's
  per-token rule divides its sum by the step's global count);
- data loader and tokenizer: the plan's (``PlanDataLoader`` over a pre-tokenized dataset),
  ``training.seq_len`` and ``training.steps`` from the plan (``-1`` until ``--plan.path`` is
  parsed), ``local_batch_size`` 1, FSDP over the whole pool (``data_parallel_shard_degree
  -1``), the ``partial_dtensor`` SPMD backend (the plan's attention takes plain tensors),
  CUDA graphs off (shapes change every microbatch);
- metrics, validator and checkpointer: the plan trainer's subclasses of torchtitan's, with the
  same fields (``PlanCheckpointManager``: a load runs no code from the checkpoint, and a resume
  with another lr or weight decay (``--optimizer.param-groups.0.optimizer-kwargs.lr``) than
  the checkpoint's is refused, naming the saved value, where torchtitan would train at the
  saved one silently).

Everything else is torchtitan's config and its flags: optimizer, lr scheduler, clipping,
activation checkpointing, compile, checkpoint, metrics backends, comm. The names cover
torchtitan's llama3 registry (``llama3_debugmodel``, ``llama3_8b``, ...); the adapter's model
is llama3 only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from runtime.adapters.torchtitan.checkpointer import PlanCheckpointManager
from runtime.adapters.torchtitan.data import PlanDataLoader, PlanTokenizer
from runtime.adapters.torchtitan.model import with_plan_attention
from runtime.adapters.torchtitan.section import FROM_PLAN, recast
from runtime.adapters.torchtitan.titan import Llama3Model, Trainer
from runtime.adapters.torchtitan.titan import llama3_registry as _llama3
from runtime.adapters.torchtitan.trainer import PlanMetrics, PlanTrainer
from runtime.adapters.torchtitan.validate import PlanValidator

_PREFIX = "llama3_"


def with_plan(config: Trainer.Config) -> PlanTrainer.Config:
    """torchtitan's trainer ``config`` (a llama3 one) as a ``PlanTrainer.Config`` whose
    ``plan`` section is still empty (the command line fills it)."""
    spec = config.model_spec
    if spec is None or not isinstance(spec.model, Llama3Model.Config):
        raise SystemExit(f"{getattr(spec, 'name', None)}: the torchtitan adapter replays plans "
                         "in llama3 models only")
    with_plan_attention(spec.model)
    values: dict[str, Any] = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    training, parallelism = config.training, config.parallelism
    training.seq_len = FROM_PLAN
    training.steps = FROM_PLAN
    training.local_batch_size = 1
    training.global_batch_size = -1
    training.disable_cuda_graphs = True
    parallelism.data_parallel_shard_degree = -1
    parallelism.spmd_backend = "partial_dtensor"
    values.update(
        hf_assets_path=".",  # the plan's datasets are pre-tokenized: nothing to load
        loss=getattr(config.loss, "loss_fn", config.loss),
        dataloader=PlanDataLoader.Config(),
        tokenizer=PlanTokenizer.Config(),
        metrics=recast(PlanMetrics.Config, config.metrics),
        validator=recast(PlanValidator.Config, config.validator),
        checkpoint=recast(PlanCheckpointManager.Config, config.checkpoint),
    )
    return PlanTrainer.Config(**values)


def _names() -> list[str]:
    return [name for name in dir(_llama3)
            if name.startswith(_PREFIX) and callable(getattr(_llama3, name))]


def llama3_debugmodel() -> PlanTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` replaying ``--plan.path``."""
    return with_plan(_llama3.llama3_debugmodel())


def __getattr__(name: str) -> Callable[[], PlanTrainer.Config]:
    # Every other config of torchtitan's llama3 registry, by its own name (PEP 562).
    if name in _names():
        def config() -> PlanTrainer.Config:
            made: Trainer.Config = getattr(_llama3, name)()
            return with_plan(made)

        config.__name__ = name
        config.__doc__ = f"torchtitan's ``{name}`` replaying ``--plan.path``."
        return config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_names()))
