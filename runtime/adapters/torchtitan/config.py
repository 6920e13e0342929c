"""dcp-train's flags -> the torchtitan ``PlanTrainer.Config`` a torchtitan user would write.

``trainer_config`` is the single translation; docs/torchtitan.md's "Your own torchtitan job"
shows the same config written by hand. Fixed choices, each forced by the plan:

- ``parallelism``: FSDP over the whole pool (``data_parallel_shard_degree=-1``), torchtitan's
  own context parallelism off (the plan's groups replace it), ``partial_dtensor`` SPMD backend
  (torchtitan's default ``spmd_types`` refuses the adapter's plain-tensor attention inputs);
- ``training``: one packed buffer per microbatch (``local_batch_size=1``), ``seq_len`` = the
  longest padded segment a plan can hold (pool x capacity), so RoPE covers every position;
  no gradient clipping (``max_norm=inf``: the oracle has none), CUDA graphs off (shapes change
  every microbatch);
- AdamW with torchtitan's defaults (betas 0.9/0.95, eps 1e-8), the for-loop implementation
  (the oracle runs the same per-tensor arithmetic), constant learning rate;
- ``comm``: both timeouts = ``--distributed-timeout-minutes``;
- checkpointing through torchtitan's checkpointer: ``--save DIR`` writes ``DIR/step-N`` (every
  ``--save-every`` steps and at the end), ``--resume DIR`` loads the latest ``DIR/step-N``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from runtime.adapters.torchtitan.checkpointer import PlanCheckpointManager
from runtime.adapters.torchtitan.data import PlanDataLoader, PlanTokenizer
from runtime.adapters.torchtitan.model import llama3_config, model_spec
from runtime.adapters.torchtitan.section import max_seq_len
from runtime.adapters.torchtitan.titan import (
    CommConfig,
    CrossEntropyLoss,
    LRSchedulersContainer,
    ParallelismConfig,
    TrainingConfig,
    default_adamw,
)
from runtime.adapters.torchtitan.trainer import PlanMetrics, PlanTrainer
from runtime.adapters.torchtitan.validate import PlanValidator
from runtime.data.plan_reader import PlanReader
from runtime.train.build import SETTING_FLAGS
from runtime.train.checkpoint import check_save_target
from runtime.train.config import TrainConfig
from runtime.train.model import GPTConfig
from runtime.train.preflight import announce_resume, check_resume_step, run_inputs

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
_STEP_DIR = re.compile(r"step-(\d+)$")


def latest_checkpoint(folder: str) -> int:
    """Highest N of a complete ``folder/step-N`` (DCP writes ``.metadata`` last), else -1."""
    steps = [int(m.group(1)) for p in Path(folder).glob("step-*")
             if (m := _STEP_DIR.search(p.name)) and (p / ".metadata").is_file()]
    return max(steps, default=-1)


def agreed_latest(folder: str) -> int:
    """``latest_checkpoint`` as rank 0 sees it, on every rank (a collective when a process
    group is up): while another run adds a ``step-N``, every rank still loads the same one."""
    step = [latest_checkpoint(folder) if not dist.is_initialized() or dist.get_rank() == 0
            else -1]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(step, src=0)
    return int(step[0])


_DCP_FILE = re.compile(r"^(?:\.metadata(?:\.tmp)?|__\d+_\d+\.distcp)$")


def is_titan_checkpoint(p: Path) -> bool:
    """A directory torchtitan's checkpointer (torch.distributed.checkpoint) wrote, complete or
    killed midway: nothing but ``.metadata`` and ``__R_I.distcp`` files."""
    try:
        return p.is_dir() and not p.is_symlink() and all(
            _DCP_FILE.match(q.name) for q in p.iterdir())
    except OSError:
        return False


def titan_saves(start: int, stop: int, interval: int) -> Callable[[str], bool]:
    """The ``step-N`` names torchtitan's checkpointer writes in a run of steps [start, stop)
    (every ``interval`` steps and after the last; N counts completed steps)."""

    def writes(name: str) -> bool:
        m = _STEP_DIR.fullmatch(name)
        n = int(m.group(1)) if m else -1
        return start < n <= stop and (n == stop or n % interval == 0)

    return writes


def check_titan_start(cfg: TrainConfig, rank: int) -> None:
    """Before the first step (collective): a ``--resume`` that ends past this run is refused,
    and ``--save`` through ``checkpoint.check_save_target`` with torchtitan's layout."""
    if not cfg.save and not cfg.resume:
        return
    with PlanReader(cfg.plan) as reader:
        num_steps = reader.num_steps
    start = max(agreed_latest(cfg.resume), 0) if cfg.resume else 0
    # At the run's end: a notice (torchtitan's loop then runs no step); else where it continues.
    if cfg.resume and check_resume_step(cfg, start, num_steps, notice=rank == 0) and rank == 0:
        # torchtitan's step-N holds N completed steps: the next 0-based step is N.
        announce_resume(os.path.join(cfg.resume, f"step-{start}"), start)
    if cfg.save:
        stop = min(cfg.steps, num_steps) if cfg.steps else num_steps
        check_save_target(cfg.save, rank, writes=titan_saves(start, stop, cfg.save_every or stop),
                          is_ours=is_titan_checkpoint, inputs=run_inputs(cfg))


def checkpoint_config(cfg: TrainConfig) -> PlanCheckpointManager.Config:
    """torchtitan's checkpointer for ``--save`` / ``--resume`` (see the module docstring)."""
    if not cfg.save and not cfg.resume:
        return PlanCheckpointManager.Config(enable=False, initial_load_model_only=False)
    step = agreed_latest(cfg.resume) if cfg.resume else -1
    if cfg.resume and step < 0:
        raise ValueError(f"--resume {cfg.resume}: no complete torchtitan checkpoint (step-N with "
                         ".metadata) in it")
    save = os.path.abspath(cfg.save) if cfg.save else ""
    resume = os.path.abspath(cfg.resume) if cfg.resume else ""
    if save and save != resume and latest_checkpoint(save) >= 0:
        # torchtitan would silently continue from them (its fault-tolerance rule).
        if cfg.replace_checkpoints:
            raise ValueError(
                f"--save {cfg.save} already holds checkpoints, which --replace-checkpoints "
                "cannot replace with --framework torchtitan: torchtitan keeps no latest "
                "pointer (a resume loads the highest step-N), so theirs would stay the ones "
                "loaded; choose an empty directory, or remove them yourself")
        raise ValueError(f"--save {cfg.save} already holds checkpoints; pass --resume "
                         f"{cfg.save} to continue them, or choose an empty directory")
    initial = ""
    if resume and save != resume:
        initial = os.path.join(resume, f"step-{step}")
    return PlanCheckpointManager.Config(
        enable=True, folder=save or resume, load_only=not save,
        interval=cfg.save_every or 2**31 - 1, last_save_model_only=False,
        initial_load_path=initial or None, initial_load_model_only=False, keep_latest_k=0,
        # Loading from the folder itself: the step rank 0 chose, not each rank's own scan.
        load_step=step if resume and (not save or save == resume) else -1,
        resume_flags=SETTING_FLAGS)


def validator_config(cfg: TrainConfig, *, last_step: int) -> PlanValidator.Config:
    """torchtitan's validation hook for ``--eval-plan`` (disabled without one)."""
    if not cfg.eval_plan:
        return PlanValidator.Config(enable=False)
    return PlanValidator.Config(enable=True, plan=cfg.eval_plan, dataset=cfg.eval_dataset,
                                field=cfg.eval_field, max_steps=cfg.eval_steps,
                                interval=cfg.eval_interval, last_step=last_step)


def trainer_config(cfg: TrainConfig, model_config: GPTConfig, *,
                   dump_folder: str = "") -> PlanTrainer.Config:
    """The torchtitan config that replays ``cfg.plan`` with ``model_config``'s llama3."""
    with PlanReader(cfg.plan) as reader:
        seq_len = max_seq_len(reader)
        stop = min(cfg.steps, reader.num_steps) if cfg.steps else reader.num_steps
    checkpoint = checkpoint_config(cfg)
    optimizer = default_adamw(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAMW_BETAS,
                              eps=ADAMW_EPS)
    optimizer.implementation = "for-loop"
    param_dtype = "bfloat16" if cfg.dtype == "bf16" else "float32"
    timeout_s = max(1, round(cfg.distributed_timeout_minutes * 60))  # torchtitan takes int s
    return PlanTrainer.Config(
        model_spec=model_spec(llama3_config(model_config, max_seq_len=seq_len)),
        hf_assets_path="",
        dump_folder=dump_folder or os.getcwd(),
        tokenizer=PlanTokenizer.Config(vocab_size=model_config.vocab_size),
        dataloader=PlanDataLoader.Config(plan=cfg.plan, dataset=cfg.dataset,
                                         datasets=list(cfg.datasets), field=cfg.field,
                                         vocab_size=model_config.vocab_size,
                                         tokenizer_path=cfg.tokenizer),
        loss=CrossEntropyLoss.Config(),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(local_batch_size=1, seq_len=seq_len, steps=stop,
                                max_norm=math.inf, disable_cuda_graphs=True,
                                mixed_precision_param=param_dtype,
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, context_parallel_degree=1,
                                      spmd_backend="partial_dtensor"),
        metrics=PlanMetrics.Config(log_freq=1),
        checkpoint=checkpoint,
        # --distributed-timeout-minutes: torchtitan's two timeouts (start-up and first step;
        # later steps), which PlanTrainer also gives the mesh and the plan's CP groups.
        comm=CommConfig(init_timeout_seconds=timeout_s, train_timeout_seconds=timeout_s),
        validator=validator_config(cfg, last_step=stop),
        activation_checkpoint=None,
        attention=cfg.attention, seed=cfg.seed, log_jsonl=cfg.log_jsonl, quiet=cfg.quiet,
        summary_json=cfg.summary_json, json_summary=cfg.json, progress=cfg.progress,
        skip_nonfinite_steps=cfg.skip_nonfinite_steps, verbose=cfg.verbose)
