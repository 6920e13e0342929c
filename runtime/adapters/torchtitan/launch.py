"""``dcp-train --framework torchtitan``: process group, ``PlanTrainer``, torchtitan's loop.

``launch`` is what ``runtime.train.cli`` calls for this framework. The process group comes from
the shared helper (torchrun's env://, or a world of one); torchtitan sees it initialised and
uses it. Before the first step every rank checks the heaviest microbatch against its memory
(``check_titan_memory``, the native ``runtime.train.memcheck``; ``--no-memory-check`` skips it).
``--reference`` runs ``oracle.train_reference`` in this one process instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from runtime.adapters.torchtitan.config import agreed_latest, check_titan_start, trainer_config
from runtime.adapters.torchtitan.model import ffn_hidden_size
from runtime.adapters.torchtitan.oracle import train_reference
from runtime.adapters.torchtitan.titan import DEVICE_TYPE, quiet_upstream_warnings
from runtime.adapters.torchtitan.trainer import PlanTrainer
from runtime.train.config import TrainConfig, step_range
from runtime.train.memcheck import check_adapter_memory
from runtime.train.model import GPTConfig
from runtime.train.procgroup import process_group, require_one_process

SUPPORTS_EVAL = True
"""This adapter runs ``--eval-plan`` (torchtitan's validation hook on ``EvalSchedule``)."""


def build_trainer(cfg: TrainConfig, model_config: GPTConfig) -> PlanTrainer:
    """The torchtitan trainer for ``cfg`` (the process group must exist)."""
    if cfg.device != DEVICE_TYPE:
        raise ValueError(f"--device {cfg.device}: torchtitan runs on {DEVICE_TYPE} here (it "
                         "takes the accelerator whenever one is present)")
    check_titan_start(cfg, dist.get_rank())
    trainer = PlanTrainer(trainer_config(cfg, model_config))
    try:
        check_titan_memory(cfg, model_config, trainer)
    except BaseException:
        trainer.close()
        raise
    return trainer


def check_titan_memory(cfg: TrainConfig, model_config: GPTConfig, trainer: PlanTrainer) -> None:
    """The native check (``runtime.train.memcheck``) before the first step, on every rank: the
    llama3's SwiGLU width, its weights, gradients and moments split by FSDP over the pool, the
    steps from the checkpoint ``--resume`` continues at (collective)."""
    reader = trainer.dataloader.reader
    start = max(agreed_latest(cfg.resume), 0) if cfg.resume else 0
    shape = replace(model_config, ffn_hidden_size=ffn_hidden_size(model_config))
    world = dist.get_world_size()
    check_adapter_memory(cfg, reader, shape, trainer.device,
                         step_range(cfg, start, reader.num_steps),
                         weight_shards=world, optimizer_shards=world)


def launch(cfg: TrainConfig, model_config: GPTConfig, *, reference: bool) -> int:
    """Train ``cfg.plan`` through torchtitan (or run its oracle); returns the exit status."""
    if not cfg.verbose:  # torchtitan's known warnings (titan.KNOWN_WARNINGS) stay quiet
        quiet_upstream_warnings()
    if reference:
        require_one_process()
        train_reference(cfg, model_config)
        return 0
    with process_group(cfg):
        trainer = build_trainer(cfg, model_config)
        try:
            trainer.train()
        finally:
            trainer.close()
    return 0
