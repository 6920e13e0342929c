"""What a run is built from and bound to: the native model (``build_model``: weights from the
seed, fp32 master weights), its optimizer (``build_optimizer``), the ``--dtype`` autocast
(``autocast_context``), the final state a caller asked for (``copy_final_state``), and what a
checkpoint records so that a resume can refuse another run's (``plan_meta``,
``checkpoint_meta``).

The replayed run (``runtime.train.trainer``) and its oracle (``runtime.train.oracle``) build
through these same functions, so the oracle's weights, optimizer arithmetic and autocast are the
run's by construction. Megatron's adapter builds Megatron's model but binds its checkpoints
with ``plan_meta`` / ``checkpoint_meta`` too.

Trade-off: AdamW runs per tensor (``foreach=False``), slower than the fused kernels, so that
every rank and the reference do the same arithmetic and their weights can be compared exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from runtime.data.plan_reader import PlanReader
from runtime.train import checkpoint
from runtime.train.config import DTYPES, TrainConfig
from runtime.train.model import GPT, GPTConfig
from runtime.train.runlog import TrainResult


def build_model(model_config: GPTConfig, seed: int, device: torch.device) -> GPT:
    """The model with weights from ``seed``, fp32 master weights on ``device``."""
    return GPT(model_config, seed=seed).to(device)


def build_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor arithmetic on every rank and in the reference.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             foreach=False)


def autocast_context(cfg: TrainConfig, device: torch.device) -> AbstractContextManager[Any]:
    """Autocast to ``cfg.dtype`` on ``device``'s type; nothing under fp32."""
    if cfg.dtype == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[cfg.dtype])


def plan_meta(reader: PlanReader) -> dict[str, Any]:
    """What a checkpoint records of its plan. The header digest: a resume must replay the same
    batches, and another plan of the same dataset and step count would pass every other check."""
    plan = hashlib.sha256(reader.header.to_json().encode()).hexdigest()[:16]
    return {"dataset": reader.header.dataset.fingerprint, "num_steps": reader.num_steps,
            "plan": plan}


def checkpoint_meta(model_config: GPTConfig, reader: PlanReader) -> dict[str, Any]:
    """What a checkpoint must match on resume: the model's shape and ``plan_meta``."""
    return {"model": checkpoint.config_meta(model_config), **plan_meta(reader)}


def copy_final_state(result: TrainResult, model: GPT) -> None:
    """Copy the weights and the last step's gradients (AdamW leaves ``.grad`` as it was)."""
    result.state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    result.grads = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()
                    if p.grad is not None}


SETTING_FLAGS = ("--lr", "--weight-decay")
"""dcp-train's flags for a parameter group's ``lr`` and ``weight_decay``, as refusals name them."""


def optimizer_settings(param_groups: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each parameter group's ``(lr, weight_decay)``; the lr as set, before a torch scheduler
    scales it (``initial_lr``, which ``LambdaLR`` keeps in the group)."""
    return [(float(g.get("initial_lr", g["lr"])), float(g["weight_decay"])) for g in param_groups]


def check_saved_settings(directory: str | Path, *, built: list[tuple[float, float]],
                         loaded: list[tuple[float, float]],
                         flags: tuple[str, str] = SETTING_FLAGS) -> None:
    """After a resume: every group's settings loaded from ``directory`` must be those this run
    built (``built``, from ``optimizer_settings`` before the load). An optimizer's
    ``load_state_dict`` restores the saved ``lr`` and ``weight_decay`` (as do Megatron's and
    torchtitan's schedulers from their own state), so another ``--lr`` would be ignored
    silently; it is refused, naming the saved value and this run's (by ``flags``).
    Groups hold what the engine built, so a group without decay (0.0) is compared with 0.0."""
    for i, flag in enumerate(flags):
        differ = [(got[i], ours[i]) for got, ours in zip(loaded, built, strict=True)
                  if got[i] != ours[i]]
        if differ:
            value = ", ".join(f"{v:g}" for v in sorted({got for got, _ in differ}))
            want = ", ".join(f"{v:g}" for v in sorted({ours for _, ours in differ}))
            raise ValueError(f"{directory}: the checkpoint was saved with {flag} {value}, this "
                             f"run has {flag} {want}; resume with {flag} {value} (the "
                             "optimizer state carries it), or start a new run")


def check_saved_optimizer(cfg: TrainConfig, optimizer: Any, directory: str | Path, *,
                          built: list[tuple[float, float]] | None = None) -> None:
    """``check_saved_settings`` for ``optimizer`` (torch's, or Megatron's: both have
    ``param_groups``) against ``--lr`` and ``--weight-decay``; ``built`` defaults to every group
    at the flags' values (the native AdamW's single group)."""
    loaded = optimizer_settings(optimizer.param_groups)
    check_saved_settings(directory, loaded=loaded, built=built if built is not None
                         else [(float(cfg.lr), float(cfg.weight_decay))] * len(loaded))
