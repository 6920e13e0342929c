"""runtime.data.shard: cu_seqlens and the zigzag / contiguous rows of each CP rank."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.data.shard import (
    contiguous_indices,
    contiguous_indices_np,
    cu_seqlens,
    cu_seqlens_np,
    ranges_to_indices,
    shard_indices,
    zigzag_indices,
    zigzag_indices_np,
)


def zigzag_reference(cu: list[int], k: int, r: int) -> list[int]:
    """DOMAIN.md's formula, token by token."""
    out = []
    for s, e in itertools.pairwise(cu):
        h = (e - s) // (2 * k)
        for i in range(2 * h):
            out.append(s + i + h * r if i < h else s + (i - h) + h * (2 * k - 1 - r))
    return out


@st.composite
def padded_buffers(draw: st.DrawFn) -> tuple[list[int], int]:
    k = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    chunks = draw(st.lists(st.integers(0, 6), min_size=0, max_size=12))
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + c * 2 * k)
    return cu, k


def test_worked_example() -> None:
    assert cu_seqlens([3, 2, 4]).tolist() == [0, 3, 5, 9]
    assert cu_seqlens([3, 2, 4]).dtype == torch.int32
    assert cu_seqlens(np.array([3, 2, 4])).dim() == 1
    cu = [0, 4, 8, 12]
    assert zigzag_indices(cu, 2, 0).tolist() == [0, 3, 4, 7, 8, 11]
    assert zigzag_indices(cu, 2, 1).tolist() == [1, 2, 5, 6, 9, 10]
    assert contiguous_indices(cu, 2, 1).tolist() == [6, 7, 8, 9, 10, 11]
    assert zigzag_indices(torch.tensor(cu, dtype=torch.int32), 2, 0).dtype == torch.int64


@given(padded_buffers())
@settings(max_examples=200, deadline=None)
def test_zigzag_matches_formula_and_partitions(case: tuple[list[int], int]) -> None:
    cu, k = case
    shards = [zigzag_indices_np(np.array(cu, np.int32), k, r) for r in range(k)]
    for r, idx in enumerate(shards):
        assert idx.tolist() == zigzag_reference(cu, k, r)
        assert len(idx) == cu[-1] // k
    allidx = np.concatenate(shards) if shards else np.zeros(0)
    assert sorted(allidx.tolist()) == list(range(cu[-1]))


@given(st.integers(1, 8), st.integers(0, 40))
@settings(max_examples=100, deadline=None)
def test_contiguous_partitions(k: int, per_rank: int) -> None:
    cu = [0, per_rank * k]  # one sequence; contiguous ignores boundaries anyway
    shards = [contiguous_indices_np(cu, k, r) for r in range(k)]
    assert np.concatenate(shards).tolist() == list(range(per_rank * k))
    assert all(s.tolist() == list(range(r * per_rank, (r + 1) * per_rank))
               for r, s in enumerate(shards))


@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 5)), max_size=10))
def test_ranges_to_indices(ranges: list[tuple[int, int]]) -> None:
    starts = np.array([a for a, _ in ranges], np.int64)
    lens = np.array([n for _, n in ranges], np.int64)
    want = [a + i for a, n in ranges for i in range(n)]
    assert ranges_to_indices(starts, lens).tolist() == want


def test_cp_size_one_is_identity_for_odd_lengths() -> None:
    # At k == 1 padding is only to tp' (possibly odd): no split, no 2k precondition.
    assert shard_indices("zigzag", [0, 3, 8], 1, 0).tolist() == list(range(8))
    assert shard_indices("contiguous", [0, 3, 8], 1, 0).tolist() == list(range(8))


def test_errors() -> None:
    with pytest.raises(ValueError, match="multiples of 4; sequence 1 has 6"):
        zigzag_indices([0, 4, 10], 2, 0)
    with pytest.raises(ValueError, match="multiple of cp_size 4"):
        contiguous_indices([0, 6], 4, 0)
    with pytest.raises(ValueError, match="cp_rank 2 out of range"):
        zigzag_indices([0, 4], 2, 2)
    with pytest.raises(ValueError, match="must start at 0"):
        zigzag_indices([1, 4], 1, 0)
    with pytest.raises(ValueError, match="decreases"):
        contiguous_indices([0, 4, 2], 1, 0)
    with pytest.raises(ValueError, match="1-D"):
        zigzag_indices(torch.zeros(1, 3, dtype=torch.int32), 1, 0)
    with pytest.raises(ValueError, match="unknown layout"):
        shard_indices("ring", [0, 4], 2, 0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        cu_seqlens_np([3, -1])


@pytest.mark.gpu
def test_zigzag_matches_transformer_engine() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tex = pytest.importorskip("transformer_engine_torch")
    rng = np.random.default_rng(0)
    for k in (2, 4, 8):
        cu = np.r_[0, np.cumsum(rng.integers(1, 50, size=20) * 2 * k)].astype(np.int32)
        t = torch.from_numpy(cu).cuda()
        for r in range(k):
            got = tex.thd_get_partitioned_indices(t, int(cu[-1]), k, r).cpu().long()
            assert got.tolist() == zigzag_indices(cu, k, r).tolist(), (k, r)
