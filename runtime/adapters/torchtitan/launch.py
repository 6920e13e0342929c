"""``dcp-train --framework torchtitan``: process group, ``PlanTrainer``, torchtitan's loop.

``launch`` is what ``runtime.train.cli`` calls for this framework. The process group comes from
the shared helper (torchrun's env://, or a world of one); torchtitan sees it initialised and
uses it. ``--reference`` runs ``oracle.train_reference`` in this one process instead.
"""

from __future__ import annotations

import torch.distributed as dist

from runtime.adapters.torchtitan.config import check_titan_start, trainer_config
from runtime.adapters.torchtitan.oracle import train_reference
from runtime.adapters.torchtitan.titan import DEVICE_TYPE, quiet_upstream_warnings
from runtime.adapters.torchtitan.trainer import PlanTrainer
from runtime.train.config import TrainConfig
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
    return PlanTrainer(trainer_config(cfg, model_config))


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
