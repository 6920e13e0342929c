"""Reference CP attention on real gloo worlds equals single-process attention, forward and backward.

Every case is a random packed buffer of several sequences with padding (including a filler of
padding only and a sequence of one token), built from a seed so that the parent and the children
build the same tensors. Children run ``reference_cp_attention`` on their shard (forward, then
backward of a random upstream gradient) and return output and gradients; the parent puts the rows
back with the shard index math and compares with ``local_attention`` over the whole buffer, whose
own correctness is checked against per-sequence SDPA below.

Microbatch layouts mix group sizes in one world ("group mix"), as a plan does: e.g. world 4 with
groups of 1, 1 and 2 at the same time, each on its own buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from planner.groups import CONTIGUOUS, ZIGZAG, valid_cp_sizes
from runtime.attention.reference import local_attention, reference_cp_attention
from runtime.data.shard import cu_seqlens, shard_indices_np
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from tests.dist import run_distributed


@dataclass(frozen=True)
class Case:
    """One group's buffer: seeded data, group size, layout, dtype and head shape."""

    seed: int
    cp_size: int
    layout: str
    dtype: str = "float32"
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8


def make_case(case: Case) -> dict[str, torch.Tensor]:
    """Full buffer of a case: cu_seqlens, cu_seqlens_padded, q, k, v and upstream grad."""
    rng = np.random.default_rng(case.seed)
    k = case.cp_size
    lengths = [int(x) for x in rng.integers(2, 40, size=int(rng.integers(2, 5)))]
    lengths += [0, 1]  # a filler of padding only and a one-token sequence
    rng.shuffle(lengths)
    if case.layout == ZIGZAG:
        m = 2 * k if k > 1 else 1
        padded = [max(-(-n // m), 1) * m + m * int(rng.integers(0, 2)) for n in lengths]
    else:
        # Contiguous needs only the total to divide by k: rank boundaries cut sequences anywhere.
        padded = [max(n, 1) + int(rng.integers(0, 3)) for n in lengths]
        padded[-1] += -sum(padded) % k
    total = sum(padded)
    g = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    h, hk, d = case.num_heads, case.num_kv_heads, case.head_dim
    return {
        "cu": cu_seqlens(lengths),
        "cu_padded": cu_seqlens(padded),
        "q": rand(total, h, d),
        "k": rand(total, hk, d),
        "v": rand(total, hk, d),
        "grad": rand(total, h, d),
    }


def _arrays(out: torch.Tensor, *grads: torch.Tensor | None) -> dict[str, np.ndarray]:
    result = {"out": out.detach().float().numpy()}
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        assert g is not None, f"{name} is None"
        result[name] = g.float().numpy()
    return result


def run_shard(case: Case, cp_rank: int, group: Any) -> dict[str, np.ndarray]:
    """This rank's forward and backward for ``case``; returns numpy arrays (fp32)."""
    data = make_case(case)
    rows = torch.from_numpy(shard_indices_np(case.layout, data["cu_padded"], case.cp_size,
                                             cp_rank))
    q, k, v = (data[n][rows].clone().requires_grad_(True) for n in ("q", "k", "v"))
    out = reference_cp_attention(
        q, k, v, cu_seqlens_padded=data["cu_padded"], cu_seqlens=data["cu"],
        cp_size=case.cp_size, cp_rank=cp_rank, layout=case.layout, group=group)
    assert out.dtype == q.dtype
    assert out.shape == q.shape
    out.backward(data["grad"][rows])
    return _arrays(out, q.grad, k.grad, v.grad)


def reference(case: Case) -> dict[str, np.ndarray]:
    """Single-process output and gradients over the whole buffer, in float32."""
    data = make_case(case)
    q, k, v = (data[n].float().requires_grad_(True) for n in ("q", "k", "v"))
    out = local_attention(q, k, v, data["cu_padded"], data["cu"])
    out.backward(data["grad"].float())
    return _arrays(out, q.grad, k.grad, v.grad)


Layout = list[tuple[int, int, Case]]
"""One microbatch: (rank_start, cp_size, case) per group; the groups partition the pool."""


def _microbatches_child(rank: int, world: int, store: str,
                        microbatches: list[Layout]) -> list[dict[str, np.ndarray]]:
    del store
    topo = Topology(world_size=world, rank=rank, dp=world, cp=1)
    cat = GroupCatalog.create(topo, valid_cp_sizes(world))
    results = []
    for layout in microbatches:
        [(start, k, case)] = [(s, k, c) for s, k, c in layout if s <= rank < s + k]
        assert case.cp_size == k
        results.append(run_shard(case, rank - start, cat.cp_group(start, k)))
    return results


def _tolerance(case: Case) -> float:
    return 1e-5 if case.dtype == "float32" else 3e-2


def check_microbatches(world: int, microbatches: list[Layout]) -> None:
    results = run_distributed(_microbatches_child, world, microbatches)
    for m, layout in enumerate(microbatches):
        assert sum(k for _, k, _ in layout) == world
        for start, k, case in layout:
            ref = reference(case)
            data = make_case(case)
            seen = np.zeros(int(data["cu_padded"][-1]), dtype=np.int64)
            got = {name: np.zeros_like(a) for name, a in ref.items()}
            for r in range(k):
                rows = shard_indices_np(case.layout, data["cu_padded"], k, r)
                seen[rows] += 1
                for name in got:
                    got[name][rows] = results[start + r][m][name]
            assert (seen == 1).all()
            for name in got:
                scale = max(float(np.abs(ref[name]).max()), 1e-6)
                err = float(np.abs(got[name] - ref[name]).max()) / scale
                assert err <= _tolerance(case), (
                    f"microbatch {m} group ({start}, {k}) {case}: {name} off by {err:.2e} "
                    f"relative")


@pytest.mark.dist
def test_world_2_zigzag_contiguous_and_bf16() -> None:
    check_microbatches(2, [
        [(0, 2, Case(seed=1, cp_size=2, layout=ZIGZAG))],
        [(0, 2, Case(seed=2, cp_size=2, layout=CONTIGUOUS))],
        [(0, 2, Case(seed=3, cp_size=2, layout=ZIGZAG, num_heads=6, num_kv_heads=1))],
        [(0, 2, Case(seed=4, cp_size=2, layout=ZIGZAG, dtype="bfloat16"))],
        [(0, 1, Case(seed=5, cp_size=1, layout=ZIGZAG)),
         (1, 1, Case(seed=6, cp_size=1, layout=CONTIGUOUS))],
    ])


@pytest.mark.dist
def test_world_4_full_group_and_group_mix() -> None:
    check_microbatches(4, [
        [(0, 4, Case(seed=11, cp_size=4, layout=ZIGZAG))],
        [(0, 4, Case(seed=12, cp_size=4, layout=CONTIGUOUS, num_heads=2, num_kv_heads=2))],
        # Groups of size 1, 1 and 2 used at once, each on its own buffer.
        [(0, 1, Case(seed=13, cp_size=1, layout=ZIGZAG)),
         (1, 1, Case(seed=14, cp_size=1, layout=ZIGZAG)),
         (2, 2, Case(seed=15, cp_size=2, layout=ZIGZAG))],
        [(0, 2, Case(seed=16, cp_size=2, layout=CONTIGUOUS)),
         (2, 2, Case(seed=17, cp_size=2, layout=ZIGZAG, dtype="bfloat16"))],
    ])


@pytest.mark.dist
def test_world_8_and_world_6_group_mixes() -> None:
    check_microbatches(8, [
        [(0, 8, Case(seed=21, cp_size=8, layout=ZIGZAG))],
        [(0, 4, Case(seed=22, cp_size=4, layout=ZIGZAG)),
         (4, 2, Case(seed=23, cp_size=2, layout=CONTIGUOUS)),
         (6, 1, Case(seed=24, cp_size=1, layout=ZIGZAG)),
         (7, 1, Case(seed=25, cp_size=1, layout=ZIGZAG))],
    ])
    check_microbatches(6, [
        [(0, 6, Case(seed=31, cp_size=6, layout=ZIGZAG))],
        [(0, 2, Case(seed=32, cp_size=2, layout=ZIGZAG)),
         (2, 2, Case(seed=33, cp_size=2, layout=ZIGZAG)),
         (4, 1, Case(seed=34, cp_size=1, layout=ZIGZAG)),
         (5, 1, Case(seed=35, cp_size=1, layout=CONTIGUOUS))],
    ])


def _padding_only_child(rank: int, world: int, store: str) -> list[float]:
    # Rank 1 holds only padding rows of a contiguous buffer: its output does not depend on K/V,
    # yet it must join the gather's backward collective or rank 0 would hang.
    import torch.distributed as dist

    del store
    cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    cu_real = torch.tensor([0, 3, 3], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 4, generator=g).requires_grad_(True) for _ in range(3))
    out = reference_cp_attention(q, k, v, cu_seqlens_padded=cu_padded, cu_seqlens=cu_real,
                                 cp_size=2, cp_rank=rank, layout=CONTIGUOUS,
                                 group=dist.group.WORLD)
    out.sum().backward()
    assert q.grad is not None
    assert k.grad is not None
    return [float(out.detach().abs().sum()), float(k.grad.abs().sum())]


@pytest.mark.dist
def test_rank_with_only_padding_still_joins_backward() -> None:
    r0, r1 = run_distributed(_padding_only_child, 2, timeout=60)
    assert r1[0] == 0.0  # all padding: zero output
    assert r0[0] > 0.0


# Single-process checks of the oracle itself.


def _sdpa_per_sequence(data: dict[str, torch.Tensor]) -> torch.Tensor:
    cu, cu_p = data["cu"].tolist(), data["cu_padded"].tolist()
    q, k, v = data["q"].float(), data["k"].float(), data["v"].float()
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(cu) - 1):
        a, n = cu_p[s], cu[s + 1] - cu[s]
        if n == 0:
            continue
        qs, ks, vs = (x[a:a + n].transpose(0, 1) for x in (q, k, v))
        out[a:a + n] = F.scaled_dot_product_attention(
            qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0), is_causal=True
        ).transpose(0, 1)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_local_attention_equals_sdpa_per_sequence(seed: int, heads: int, kv_heads: int) -> None:
    data = make_case(Case(seed=seed, cp_size=2, layout=ZIGZAG, num_heads=heads,
                          num_kv_heads=kv_heads))
    out = local_attention(data["q"], data["k"], data["v"], data["cu_padded"], data["cu"])
    torch.testing.assert_close(out, _sdpa_per_sequence(data), rtol=1e-5, atol=1e-5)


def test_local_attention_bf16_and_scale() -> None:
    data = make_case(Case(seed=7, cp_size=1, layout=ZIGZAG, dtype="bfloat16"))
    out = local_attention(data["q"], data["k"], data["v"], data["cu_padded"], data["cu"])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _sdpa_per_sequence(data), rtol=2e-2, atol=2e-2)
    scaled = local_attention(data["q"].float() * 2, data["k"].float(), data["v"].float(),
                             data["cu_padded"], data["cu"], softmax_scale=0.5 / np.sqrt(8))
    torch.testing.assert_close(scaled, _sdpa_per_sequence(data), rtol=1e-5, atol=1e-5)


def test_errors_are_value_errors() -> None:
    data = make_case(Case(seed=0, cp_size=2, layout=ZIGZAG))
    q, k, v = data["q"], data["k"], data["v"]
    cu_p, cu = data["cu_padded"], data["cu"]
    half = q.shape[0] // 2
    with pytest.raises(ValueError, match="needs a process group"):
        reference_cp_attention(q[:half], k[:half], v[:half], cu_seqlens_padded=cu_p,
                               cu_seqlens=cu, cp_size=2, cp_rank=0, layout=ZIGZAG, group=None)
    with pytest.raises(ValueError, match="holds .* rows"):
        reference_cp_attention(q, k, v, cu_seqlens_padded=cu_p, cu_seqlens=cu, cp_size=2,
                               cp_rank=0, layout=ZIGZAG, group=None)
    with pytest.raises(ValueError, match="kv heads do not divide"):
        local_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1),
                        data["cu_padded"], data["cu"])
    with pytest.raises(ValueError, match="real length"):
        local_attention(q, k, v, data["cu_padded"], data["cu_padded"] * 2)
