"""The small GPT and the torch CP path's index math, in one process on CPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.groups import CONTIGUOUS, ZIGZAG, padded_length
from runtime.attention.torch_varlen import TorchCPAttention, build_varlen_index
from runtime.data.shard import cu_seqlens_np, shard_indices_np
from runtime.train.model import GPT, GPTConfig, sequence_attention

TINY = GPTConfig(vocab_size=97, num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2)


def _packed(lengths: list[int], pad_to: int, seed: int = 0
            ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random sequences and their packed (padded) buffer, positions and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, TINY.vocab_size, (n,), generator=gen) for n in lengths]
    padded = [padded_length(n, pad_to, 1, ZIGZAG) if pad_to > 1 else n for n in lengths]
    tokens = torch.zeros(sum(padded), dtype=torch.long)
    positions = torch.zeros_like(tokens)
    start = 0
    for s, p in zip(seqs, padded, strict=True):
        tokens[start:start + len(s)] = s
        positions[start:start + len(s)] = torch.arange(len(s))
        start += p
    return (seqs, tokens, positions, torch.from_numpy(cu_seqlens_np(lengths)),
            torch.from_numpy(cu_seqlens_np(padded)))


def test_same_seed_same_weights_and_different_seed_different() -> None:
    a, b, c = GPT(TINY, seed=3), GPT(TINY, seed=3), GPT(TINY, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name


def test_untied_head_has_its_own_weight() -> None:
    m = GPT(GPTConfig(vocab_size=50, hidden_size=16, num_heads=2, num_query_groups=1,
                      tie_embeddings=False))
    assert m.lm_head is not None
    assert not torch.equal(m.lm_head.weight, m.embed.weight)


@pytest.mark.parametrize(("field", "value"), [("hidden_size", 30), ("num_query_groups", 3),
                                              ("num_layers", 0), ("ffn_hidden_size", -1)])
def test_config_rejects_bad_shapes(field: str, value: int) -> None:
    kwargs: dict[str, Any] = {"vocab_size": 10, "hidden_size": 32, "num_heads": 4,
                              "num_query_groups": 2, field: value}
    with pytest.raises(ValueError, match=field.split("_")[0]):
        GPTConfig(**kwargs)


def test_packed_forward_equals_each_sequence_alone() -> None:
    """Packing with padding changes nothing for the real tokens (the torch path at cp 1)."""
    torch.manual_seed(0)
    model = GPT(TINY, seed=1)
    seqs, tokens, positions, cu, cu_pad = _packed([5, 9, 1, 12], pad_to=4)
    attn = TorchCPAttention(ZIGZAG).bind(cu_pad, cu, 1, 0, None, torch.device("cpu"))
    packed = model(tokens, positions, attn)
    for s, start in zip(seqs, cu_pad[:-1].tolist(), strict=True):
        alone = model(s, torch.arange(len(s)), sequence_attention)
        torch.testing.assert_close(packed[start:start + len(s)], alone, rtol=1e-5, atol=1e-5)


def test_rope_sees_relative_positions_only() -> None:
    """A common shift of positions changes nothing; a different spacing does."""
    model = GPT(TINY, seed=1)
    tokens = torch.tensor([3, 4, 5, 6])
    a = model(tokens, torch.arange(4), sequence_attention)
    b = model(tokens, torch.arange(4) + 7, sequence_attention)
    c = model(tokens, torch.arange(4) * 2, sequence_attention)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(a, c, rtol=1e-3, atol=1e-4)


def _segment_mask(cu_pad: np.ndarray, cu: np.ndarray, layout: str, k: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Global (query row, key row) pairs the index lets attend, and the causal pairs expected."""
    got: set[tuple[int, int]] = set()
    for r in range(k):
        idx = build_varlen_index(cu_pad, cu, layout, k, r)
        shards = [shard_indices_np(layout, cu_pad, k, j) for j in range(k)]
        gathered = np.concatenate(shards)
        mine = shards[r]
        for s in range(len(idx.cu_q) - 1):
            qs = mine[idx.q_rows[idx.cu_q[s]:idx.cu_q[s + 1]]]
            ks = gathered[idx.kv_rows[idx.cu_k[s]:idx.cu_k[s + 1]]]
            m, e = len(qs), len(ks)
            for i, q in enumerate(qs):  # bottom-right aligned causal mask
                got.update((int(q), int(kk)) for kk in ks[: e - m + i + 1])
    want: set[tuple[int, int]] = set()
    for s in range(len(cu) - 1):
        base, n = int(cu_pad[s]), int(cu[s + 1] - cu[s])
        want.update((base + i, base + j) for i in range(n) for j in range(i + 1))
    return np.array(sorted(got)), np.array(sorted(want))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       k=st.sampled_from([1, 2, 4]), layout=st.sampled_from([ZIGZAG, CONTIGUOUS]))
def test_varlen_index_gives_exactly_causal_attention(lengths: list[int], k: int,
                                                     layout: str) -> None:
    padded = [padded_length(max(n, 1), k, 1, layout) for n in lengths]
    if layout == CONTIGUOUS and sum(padded) % k:
        padded[-1] += k - sum(padded) % k
    cu_pad, cu = cu_seqlens_np(padded), cu_seqlens_np(lengths)
    got, want = _segment_mask(cu_pad, cu, layout, k)
    assert got.shape == want.shape
    assert (got == want).all()


def test_varlen_index_worked_example() -> None:
    """The module docstring's example: k = 2, zigzag, real length 7 padded to 8."""
    r0 = build_varlen_index(np.array([0, 8]), np.array([0, 7]), ZIGZAG, 2, 0)
    assert r0.q_rows.tolist() == [0, 1, 2]
    assert r0.cu_q.tolist() == [0, 2, 3]
    assert r0.cu_k.tolist() == [0, 2, 9]
    r1 = build_varlen_index(np.array([0, 8]), np.array([0, 7]), ZIGZAG, 2, 1)
    assert r1.q_rows.tolist() == [0, 1, 2, 3]
    assert r1.cu_k.tolist() == [0, 6]
    assert (r0.max_q, r0.max_k, r1.max_q, r1.max_k) == (2, 7, 4, 6)

