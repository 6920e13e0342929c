"""GPU cross-checks against Transformer Engine (skipped without CUDA and TE).

1. ``runtime.data.shard.zigzag_indices`` equals TE's ``thd_get_partitioned_indices``.
2. ``TEAttention`` at cp_size 1 equals ``local_attention`` in bf16, forward and backward.
3. With two GPUs: TE's p2p CP attention (zigzag shards, NCCL) and ``reference_cp_attention`` on
   NCCL both equal ``local_attention``, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from planner.groups import ZIGZAG
from runtime.attention.reference import local_attention, reference_cp_attention
from runtime.data.shard import shard_indices_np, zigzag_indices
from tests.dist import run_distributed
from tests.runtime.attention.test_attention_dist import Case, make_case


def _te_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from runtime.attention.te import te_available

    return te_available()


def _why_not() -> str:
    from runtime.attention import te as te_adapter

    return f"needs CUDA and Transformer Engine ({te_adapter.te_import_error or 'no CUDA'})"


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _te_ready(), reason=_why_not()),
]

BF16_TOL = 3e-2


@dataclass(frozen=True)
class Packed:
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int


def _packed(data: dict[str, torch.Tensor], device: torch.device) -> Packed:
    cu_p = data["cu_padded"]
    return Packed(cu_seqlens=data["cu"].to(device), cu_seqlens_padded=cu_p.to(device),
                  max_seqlen=int((cu_p[1:] - cu_p[:-1]).max()))


def _real_rows(data: dict[str, torch.Tensor]) -> np.ndarray:
    cu, cu_p = data["cu"].numpy(), data["cu_padded"].numpy()
    return np.concatenate([np.arange(cu_p[s], cu_p[s] + cu[s + 1] - cu[s])
                           for s in range(len(cu) - 1)])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    diff = (got - want).abs().max()
    return float(diff / want.abs().max().clamp(min=1e-6))


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_zigzag_indices_equal_te(cp_size: int, seed: int) -> None:
    from runtime.attention.te import te_thd_partitioned_indices

    rng = np.random.default_rng(seed)
    m = 2 * cp_size
    padded = rng.integers(1, 20, size=int(rng.integers(1, 9))) * m
    cu_p = torch.tensor(np.r_[0, np.cumsum(padded)], dtype=torch.int32, device="cuda")
    total = int(cu_p[-1])
    for r in range(cp_size):
        te = te_thd_partitioned_indices(cu_p, total, cp_size, r).cpu()
        assert torch.equal(te, zigzag_indices(cu_p.cpu(), cp_size, r)), (padded, r)


def _te_case(seed: int, cp_size: int) -> Case:
    return Case(seed=seed, cp_size=cp_size, layout=ZIGZAG, dtype="bfloat16", num_heads=8,
                num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("seed", range(3))
def test_te_attention_cp1_equals_local_attention_bf16(seed: int) -> None:
    from runtime.attention.te import TEAttention

    dev = torch.device("cuda")
    data = make_case(_te_case(seed, 1))
    real = torch.from_numpy(_real_rows(data)).to(dev)
    q, k, v = (data[n].to(dev).requires_grad_(True) for n in ("q", "k", "v"))
    grad = torch.zeros_like(data["grad"].to(dev))
    grad[real] = data["grad"].to(dev)[real]  # padding rows: TE leaves them unspecified
    module = TEAttention(num_heads=8, head_dim=64, num_query_groups=2)
    out = module(q, k, v, _packed(data, dev))
    out.backward(grad)
    qr, kr, vr = (data[n].float().requires_grad_(True) for n in ("q", "k", "v"))
    ref = local_attention(qr, kr, vr, data["cu_padded"], data["cu"])
    ref.backward(grad.float().cpu())
    real_cpu = real.cpu()
    assert _rel_err(out[real].cpu(), ref[real_cpu]) < BF16_TOL
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        assert got is not None
        assert want is not None
        assert _rel_err(got[real].cpu(), want[real_cpu]) < BF16_TOL


def _cp2_child(rank: int, world: int, store: str, seed: int) -> dict[str, np.ndarray]:
    import torch.distributed as dist

    from runtime.attention.te import TEAttention, bind_cp_group

    del store
    dev = torch.device("cuda", torch.cuda.current_device())
    case = _te_case(seed, world)
    data = make_case(case)
    rows = torch.from_numpy(shard_indices_np(ZIGZAG, data["cu_padded"], world, rank)).to(dev)
    real = torch.from_numpy(_real_rows(data)).to(dev)
    mask = torch.zeros(data["q"].shape[0], dtype=torch.bool, device=dev)
    mask[real] = True
    grad = data["grad"].to(dev) * mask[:, None, None]
    results: dict[str, np.ndarray] = {}
    for name in ("te", "reference"):
        q, k, v = (data[n].to(dev)[rows].requires_grad_(True) for n in ("q", "k", "v"))
        if name == "te":
            module = TEAttention(num_heads=8, head_dim=64, num_query_groups=2)
            with bind_cp_group(module, dist.group.WORLD, list(range(world))):
                out = module(q, k, v, _packed(data, dev))
                out.backward(grad[rows])
            assert module.cp_size == 1  # restored after the block
        else:
            out = reference_cp_attention(
                q, k, v, cu_seqlens_padded=data["cu_padded"], cu_seqlens=data["cu"],
                cp_size=world, cp_rank=rank, layout=ZIGZAG, group=dist.group.WORLD)
            out.backward(grad[rows])
        for key, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            assert t is not None
            results[f"{name}.{key}"] = t.detach().float().cpu().numpy()
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("seed", range(2))
def test_cp2_te_and_reference_on_nccl_equal_local_attention(seed: int) -> None:
    world = 2
    results = run_distributed(_cp2_child, world, seed, backend="nccl", timeout=300)
    data = make_case(_te_case(seed, world))
    real = _real_rows(data)
    qr, kr, vr = (data[n].float().requires_grad_(True) for n in ("q", "k", "v"))
    mask = torch.zeros(data["q"].shape[0], dtype=torch.bool)
    mask[torch.from_numpy(real)] = True
    ref = local_attention(qr, kr, vr, data["cu_padded"], data["cu"])
    ref.backward(data["grad"].float() * mask[:, None, None])
    want = {"out": ref.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    for name in ("te", "reference"):
        for key, w in want.items():
            assert w is not None
            got = torch.zeros_like(w)
            for r in range(world):
                rows = torch.from_numpy(shard_indices_np(ZIGZAG, data["cu_padded"], world, r))
                got[rows] = torch.from_numpy(results[r][f"{name}.{key}"])
            err = _rel_err(got[real], w[real])
            assert err < BF16_TOL, f"{name} {key}: {err:.2e}"
