"""``install(device)``: everything a plan's job puts into Megatron-core, once per process.

Two kinds of hook, installed together because every run of a plan needs both: the release
workarounds for the device (``compat.patches.apply_patches``: the CPU redirects, the upstream
fixes, TE's CP stream on a GPU) and the binding's own hooks inside Megatron's modules (the
router's groups and load-balancing terms, ``moe.install``; the MTP block's rolls,
``mtp.install``; recomputation under the binding, ``recompute.install``). Each is idempotent,
so ``PlanJob``, the oracle and a launcher may all call it.
It lives here and not in ``compat`` because the hooks belong to the binding: ``compat`` knows
nothing of plans.
"""

from __future__ import annotations

import torch

from runtime.adapters.megatron.binding import moe, mtp, recompute
from runtime.adapters.megatron.compat import patches
from runtime.adapters.megatron.compat.cpu_patches import once


def install(device: torch.device) -> None:
    """Apply the workarounds for ``device`` and the binding's hooks (idempotent)."""
    patches.apply_patches(device)
    for fn in (moe.install, mtp.install, recompute.install):
        once(f"{fn.__module__}.{fn.__name__}", fn)  # three functions named install
