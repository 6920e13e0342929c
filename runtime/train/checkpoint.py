"""Save and resume training: model, optimizer, next step and RNG states, one directory per save.

Layout of a checkpoint directory::

    DIR/state.pt        model and optimizer state dicts, next step, ``meta`` (checked on load)
    DIR/rng-<rank>.pt   that rank's torch (CPU and CUDA) and numpy RNG states

Parameters and optimizer states are replicated on every pool rank (plain data parallelism over
the pool; nothing is sharded), so rank 0 alone writes ``state.pt``; every rank writes its own RNG
file because RNG streams are per process. Each file is written to a temporary name and renamed,
and ``state.pt`` is written last of rank 0's files after a barrier, so a directory with a
``state.pt`` is complete. Resuming with the same plan reproduces the losses of an uninterrupted
run bit for bit on CPU: the plan fixes the data of every step, and the state is restored exactly.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STATE_FILE = "state.pt"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Resumed:
    """What :func:`load` restored: the next step to run and the saved metadata."""

    next_step: int
    meta: dict[str, Any]


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(directory: str | os.PathLike[str], *, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, next_step: int, meta: dict[str, Any],
         rank: int, group: dist.ProcessGroup | None = None) -> Path:
    """Save a checkpoint (collective over ``group``: every rank calls it).

    Args:
        directory: where to write; created when missing, files in it replaced.
        model: the model (its state is identical on every rank).
        optimizer: its optimizer.
        next_step: the first step a resumed run executes.
        meta: small JSON-like facts kept for checks on resume (model config, plan digest).
        rank: this process's rank in ``group`` (rank 0 writes the shared state).
        group: the ranks that save together; None for the default group.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _atomic_save(_rng_state(), path / f"rng-{rank}.pt")
    if dist.is_initialized():
        dist.barrier(group=group)
    if rank == 0:
        _atomic_save({"format": FORMAT, "model": model.state_dict(),
                      "optimizer": optimizer.state_dict(), "next_step": next_step,
                      "meta": meta}, path / STATE_FILE)
    if dist.is_initialized():
        dist.barrier(group=group)
    return path


def load(directory: str | os.PathLike[str], *, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, rank: int, expect_meta: dict[str, Any]) -> Resumed:
    """Restore a checkpoint written by :func:`save` into ``model`` and ``optimizer``.

    Raises:
        ValueError: no checkpoint in ``directory``, an unknown format, or metadata that differs
            from ``expect_meta`` (another model shape or plan), naming the key.
    """
    path = Path(directory)
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"{path}: no checkpoint ({STATE_FILE} missing)")
    # Load on the CPU: load_state_dict moves every tensor to its parameter's device, except
    # AdamW's "step" counters, which must stay on the CPU (on the GPU each step would read them
    # back with .item(): a host-device sync per parameter per step).
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{state_path}: checkpoint format {state.get('format')!r}, expected "
                         f"{FORMAT}")
    for key, want in expect_meta.items():
        got = state["meta"].get(key)
        if got != want:
            raise ValueError(f"{state_path}: checkpoint has {key}={got!r}, this run {want!r}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng_path = path / f"rng-{rank}.pt"
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return Resumed(next_step=int(state["next_step"]), meta=dict(state["meta"]))


def config_meta(config: object) -> dict[str, Any]:
    """A dataclass config as a plain dict, for ``meta``."""
    return asdict(config)  # type: ignore[call-overload, no-any-return]
