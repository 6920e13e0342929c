"""The torch shims torchtitan 0.3.0 needs (``runtime.adapters.torchtitan.compat``) behave as the
torch APIs they stand in for, and are installed only where torch lacks them.

CI runs torch 2.13, where both are torch's own and the shims are tested directly;
``scripts/check_torchtitan_torch211.sh`` runs this file and the adapter's other tests under torch
2.11, the GPU machines' torch, where both shims are installed.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from runtime.adapters.torchtitan import compat


def test_install_adds_only_what_torch_lacks_and_is_idempotent() -> None:
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    own_dims = getattr(fsdp, "DataParallelMeshDims", None)
    first = list(compat.install())
    assert compat.install() == first  # a second call changes nothing
    assert ("torch.distributed.fsdp.DataParallelMeshDims" in first) == (
        own_dims in (None, compat.DataParallelMeshDims))
    assert fsdp.DataParallelMeshDims is (own_dims or compat.DataParallelMeshDims)
    assert "separate_full_blocks" in inspect.signature(flex.create_block_mask).parameters


def test_titan_installs_the_shims_before_torchtitan() -> None:
    pytest.importorskip("torchtitan")
    import torch.distributed.fsdp as fsdp

    from runtime.adapters.torchtitan import titan

    assert titan.compat is compat
    assert hasattr(fsdp, "DataParallelMeshDims")


@pytest.mark.parametrize("cls", ["shim", "torch"])
def test_data_parallel_mesh_dims_matches_torch(cls: str) -> None:
    import torch.distributed.fsdp._fully_shard as fully_shard

    dims: Any = (compat.DataParallelMeshDims if cls == "shim"
                 else getattr(fully_shard, "DataParallelMeshDims", None))
    if dims is None:
        pytest.skip(f"torch {torch.__version__} has no DataParallelMeshDims of its own")
    both = dims(shard=("dp_shard", "cp"), replicate="dp_replicate")
    assert (both.shard_names, both.replicate_names) == (("dp_shard", "cp"), ("dp_replicate",))
    assert dims(shard="dp_shard").replicate_names == ()
    assert dims(shard="dp_shard") == dims(shard="dp_shard")
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        dims()


def _document_causal(lengths: tuple[int, ...]) -> tuple[Any, int]:
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc = torch.cumsum((positions == 0).int(), dim=1) - 1

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (doc[b, q] == doc[b, kv]) & (kv <= q)

    return mask_mod, positions.shape[1]


def test_create_block_mask_shim_gives_the_plain_mask() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    # Documents long enough to have full 128-blocks (the part separate_full_blocks is about).
    mask_mod, n = _document_causal((100, 37, 700, 75, 400))
    shim = compat.with_separate_full_blocks(create_block_mask)
    got = shim(mask_mod, 1, None, n, n, device="cpu", BLOCK_SIZE=128, separate_full_blocks=True)
    want = create_block_mask(mask_mod, 1, None, n, n, device="cpu", BLOCK_SIZE=128)
    assert int(got.full_kv_num_blocks.sum()) > 0
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    with pytest.raises(NotImplementedError, match=r"needs torch >= 2.12"):
        shim(mask_mod, 1, None, n, n, device="cpu", separate_full_blocks=False)
