"""The run's process group and device: ``init_process_group`` joins the torchrun world
(``env://``) or makes a world of one, ``process_group`` holds it for a run (every framework's
launcher runs inside one), ``pg_timeout`` is the timeout every group gets
(``--distributed-timeout-minutes``), ``resolve_device`` names the device the group set, and
``require_one_process`` refuses a ``--reference`` run under torchrun.

These sit in ``runtime.train``, not in ``runtime.dist`` (rank arithmetic and the catalog's
groups, from explicit ints): they are the entry point's work, reading ``TrainConfig`` and the
launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) once, before any engine
builds a ``Topology`` or a ``GroupCatalog`` on the world they make.

Trade-off: a run outside torchrun still gets a real process group (one rank, an in-memory
``HashStore``), so the engines (and Megatron's oracle, which builds its model on one) run their
collectives unchanged at world size 1 instead of branching on it; that costs a group set-up per
run. The group is destroyed only by the call that made it, so a caller (a test) that made its
own keeps it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.train.config import TrainConfig


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pg_timeout(minutes: float) -> timedelta:
    """The timeout given to every process group (``--distributed-timeout-minutes``)."""
    return timedelta(minutes=minutes)


def init_process_group(device: str, timeout_minutes: float = 10.0) -> bool:
    """Join the torchrun world (env://), or make a world of one; True if this call created it.

    ``timeout_minutes`` bounds every collective of the default group (groups made later take
    it too: ``GroupCatalog.create(timeout=...)``); torch's own default for gloo is 30 min.
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = pg_timeout(timeout_minutes)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return True


@contextmanager
def process_group(cfg: TrainConfig) -> Iterator[None]:
    """The run's process group (``init_process_group`` with its device and timeout), destroyed
    on the way out if this call created it: every framework's launcher runs inside one."""
    created = init_process_group(cfg.device, cfg.distributed_timeout_minutes)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def require_one_process() -> None:
    """Refuse a ``--reference`` run launched under torchrun (the oracle is one process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--reference runs in one process; launch it without torchrun")
