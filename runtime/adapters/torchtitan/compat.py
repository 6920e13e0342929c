"""torch APIs that torchtitan 0.3.0 calls and the installed torch lacks, supplied before its import.

torchtitan 0.3.0 is written against a torch newer than both torches this project runs on: CI's
2.13.0 and the GPU machines' 2.11.0 (which cannot be changed there). ``install`` (called by
``titan`` before it imports torchtitan) puts each missing name in place *only when the running
torch lacks it*; where torch has the real thing nothing is touched. Found by importing and
running torchtitan on the paths this adapter and ``bench/torchtitan_static_cp.py`` use (llama3,
``spmd_backend="partial_dtensor"``, FSDP2, checkpointer, validator, FlexAttention masks) under
both torches, and by diffing the signatures of every torch name torchtitan imports between them
(``scripts/check_torchtitan_torch211.sh`` reruns the check).

- ``torch.distributed.fsdp.DataParallelMeshDims``: absent in 2.11 (present in 2.13), imported at
  module level; only a name on the ``partial_dtensor`` path.
- ``flex_attention.create_block_mask(..., separate_full_blocks=)``: the argument is absent in
  2.11; torchtitan's document mask passes it (FlexAttention: the static-CP baseline).

``torch.distributed.set_timeout`` (absent in 2.11 and 2.13; torchtitan's ``set_pg_timeouts``
calls it after the first step) is not shimmed here: ``titan._pg_timeouts`` replaces that
function wherever torch lacks it. Left alone, because these paths never reach them:
``_fsdp_common.ShardPlacementResult`` (2.11 lacks it; imported inside ``apply_fsdp_to_decoder``
for expert parallelism only) and ``_mesh_layout._FlatLayout`` (2.11 lacks it; ``spmd_types``
falls back to ``_MeshLayout`` itself).

This module imports torch only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.fsdp as _fsdp
import torch.nn.attention.flex_attention as _flex

INSTALLED: list[str] = []
"""The shims ``install`` put in place in this process (which depends on the running torch)."""


@dataclass
class DataParallelMeshDims:
    """``torch.distributed.fsdp.DataParallelMeshDims`` as torch 2.13 defines it
    (``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``): which axes of a full SPMD mesh are
    data parallel, for ``fully_shard(..., dp_mesh_dims=...)``.

    torchtitan imports it at module level (``distributed/fsdp.py``, ``distributed/
    full_dtensor.py``) but constructs it only under the ``full_dtensor`` / ``spmd_types``
    backends; under ``partial_dtensor`` (the adapter's) ``parallelize_llama`` passes
    ``dp_mesh_dims=None`` and ``apply_fsdp_to_decoder`` leaves the argument out of
    ``fully_shard``. Were one ever passed, torch 2.11's ``fully_shard`` would reject the unknown
    keyword (``TypeError``): the shim cannot make a run silently differ.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        if self.shard is None:
            return ()
        return (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        if self.replicate is None:
            return ()
        return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


DataParallelMeshDims.__module__ = "torch.distributed.fsdp"


def with_separate_full_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """``create_block_mask`` accepting torch 2.12+'s ``separate_full_blocks`` (default True).

    True is what every older torch always did (full blocks listed apart from partial ones, so
    the kernel skips their mask): the original is called without the argument; on CPU torch 2.11's
    mask equals torch 2.13's with ``separate_full_blocks=True`` index for index. torchtitan
    passes False only in its batch-invariant mode (off unless asked for), which this refuses.
    """

    def create_block_mask(mask_mod: Callable[..., Any], B: int | None, H: int | None,
                          Q_LEN: int, KV_LEN: int, device: Any = None,
                          BLOCK_SIZE: int | tuple[int, int] = 128, _compile: bool = False,
                          separate_full_blocks: bool = True) -> Any:
        if not separate_full_blocks:
            raise NotImplementedError(
                f"create_block_mask(separate_full_blocks=False) (torchtitan's batch-invariant "
                f"mode) needs torch >= 2.12; this is torch {torch.__version__}")
        return original(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE,
                        _compile=_compile)

    create_block_mask.__doc__ = original.__doc__
    return create_block_mask


def _takes(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


def install() -> list[str]:
    """Put every missing name in place (idempotent); returns ``INSTALLED``."""
    if not hasattr(_fsdp, "DataParallelMeshDims"):
        setattr(_fsdp, "DataParallelMeshDims", DataParallelMeshDims)  # noqa: B010
        INSTALLED.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not _takes(_flex.create_block_mask, "separate_full_blocks"):
        setattr(_flex, "create_block_mask",  # noqa: B010
                with_separate_full_blocks(_flex.create_block_mask))
        INSTALLED.append("torch.nn.attention.flex_attention.create_block_mask"
                         "(separate_full_blocks=)")
    return INSTALLED
