"""A plan inside Megatron-LM's own training loop: ``pretrain_gpt.py`` behind a launcher.

The user's command stays theirs; the launcher goes in front of it::

    torchrun --nproc-per-node 8 -m runtime.adapters.megatron_lm --plan plans/job.arrow \\
        [--eval-plan plans/eval.arrow] [--dataset FILES] [--log-jsonl train.jsonl] \\
        -- Megatron-LM/pretrain_gpt.py <their Megatron-LM flags>

The plan decides the data, the packing and each microbatch's CP group; Megatron-LM keeps the
model, DDP, the optimizer, the schedules, the LR schedule, recomputation, checkpoints, logging
and its evaluation loop. Every hook is a module attribute set at start-up (``hooks.Launcher``);
no Megatron-LM file is edited. ``install(options)`` does the same for a script of one's own
that calls ``pretrain()``. The pieces:

- ``mlm``: the only ``megatron.training`` import (releases, shims, ``pretrain()``'s signature);
- ``flags``: the flags the plan path needs or refuses, and the plan-vs-flags checks;
- ``session``: the plan bound to Megatron-LM's groups and model (batches, forward step);
- ``hooks``: where the launcher enters Megatron-LM's loop;
- ``model``: what the launcher does to the model Megatron-LM builds (CPU attention, weights);
- ``checkpoint``: the plan record beside Megatron-LM's checkpoints;
- ``cpu``: what ``pretrain()`` needs on a host without CUDA, one function per patch;
- ``oracle``: ``--reference``, the same job in one process, every sequence alone;
- ``cli``: the command line.

docs/megatron-lm.md is the user's page. Importing this package imports nothing of Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.adapters.megatron_lm.hooks import Launcher


class ReleaseError(ImportError):
    """The installed megatron-core has no ``megatron.training`` the launcher supports
    (``mlm.check_release``); an ImportError, so that tests skip on it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherOptions:
    """The launcher's own flags (those before ``--``)."""

    plan: str
    """The training plan (``dcp-plan``)."""
    eval_plan: str = ""
    """An evaluation plan (``dcp-plan --eval``) for Megatron-LM's ``evaluate()``; empty: none
    (then ``--eval-iters 0``)."""
    dataset: tuple[str, ...] = ()
    """The dataset the plan was made for; empty: the files its header lists (or
    ``--data-path``, when it names them)."""
    eval_dataset: tuple[str, ...] = ()
    """The eval plan's dataset; empty: the files its header lists."""
    log_jsonl: str = ""
    """Rank 0 appends one JSON line per step and per evaluation (``dcp-train``'s format)."""
    init_seed: int | None = None
    """Set every weight to the project's split-independent initial value for this seed
    (``model.init_weights``), so that runs of any split, and the oracle, start equal; None:
    Megatron-LM's own initialisation."""
    memory_check: bool = True
    """Before the first step, refuse a plan whose heaviest microbatch would not fit a rank
    (``memory``: ``dcp-train``'s check, the shape from Megatron-LM's arguments)."""


def install(options: LauncherOptions) -> Launcher:
    """Put the plan into Megatron-LM's loop for a script of one's own (before ``pretrain()``);
    returns the launcher holding the hooks."""
    from runtime.adapters.megatron_lm.hooks import Launcher

    launcher = Launcher(options)
    launcher.install()
    return launcher


__all__ = ["LauncherOptions", "ReleaseError", "install"]
