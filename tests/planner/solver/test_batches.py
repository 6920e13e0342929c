"""Tests for planner.solver.batches: the seeded epoch permutation and global-batch drawing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solver.batches import draw_global_batches, epoch_permutation


def test_permutation_golden_values() -> None:
    # Fixed by formula (splitmix64 + stable argsort): these must never change, on any machine
    # or numpy version, or every existing plan's sample order changes with them.
    assert epoch_permutation(10, 0, 0).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]
    assert epoch_permutation(10, 1234, 3).tolist() == [5, 9, 1, 2, 7, 8, 0, 4, 3, 6]


@given(n=st.integers(0, 2000), seed=st.integers(-(2**70), 2**70), epoch=st.integers(0, 50))
@settings(max_examples=50, deadline=None)
def test_permutation_is_a_deterministic_permutation(n: int, seed: int, epoch: int) -> None:
    p = epoch_permutation(n, seed, epoch)
    assert p.dtype == np.int64
    assert np.array_equal(np.sort(p), np.arange(n))
    assert np.array_equal(p, epoch_permutation(n, seed, epoch))


def test_permutation_depends_on_seed_and_epoch() -> None:
    base = epoch_permutation(1000, 7, 0)
    assert not np.array_equal(base, epoch_permutation(1000, 8, 0))
    assert not np.array_equal(base, epoch_permutation(1000, 7, 1))


def test_batches_by_size_follow_the_permutation() -> None:
    lengths = np.arange(1, 101, dtype=np.int64)
    eligible = np.ones(100, dtype=np.bool_)
    eligible[[3, 50, 99]] = False
    batches, undrawn = draw_global_batches(lengths, eligible, seed=5, epoch=2,
                                           global_batch_size=16)
    perm = epoch_permutation(100, 5, 2)
    assert np.array_equal(np.concatenate(batches), perm[eligible[perm]])
    assert [len(b) for b in batches] == [16] * 6 + [1]
    assert undrawn.size == 0


def test_drop_last_by_size_returns_the_undrawn_samples() -> None:
    lengths = np.ones(50, dtype=np.int64)
    batches, undrawn = draw_global_batches(lengths, np.ones(50, np.bool_), seed=0, epoch=0,
                                           global_batch_size=16, drop_last=True)
    assert [len(b) for b in batches] == [16, 16, 16]
    perm = epoch_permutation(50, 0, 0)
    assert np.array_equal(undrawn, perm[48:])
    # An exact multiple leaves nothing undrawn.
    batches, undrawn = draw_global_batches(lengths[:48], np.ones(48, np.bool_), seed=0, epoch=0,
                                           global_batch_size=16, drop_last=True)
    assert len(batches) == 3
    assert undrawn.size == 0


def test_token_batches_docstring_example() -> None:
    # Lengths chosen so the permutation order reads [4, 5, 3, 12, 2] (see the module docstring).
    perm = epoch_permutation(5, 0, 0)
    lengths = np.zeros(5, dtype=np.int64)
    lengths[perm] = [4, 5, 3, 12, 2]
    batches, _ = draw_global_batches(lengths, np.ones(5, np.bool_), seed=0, epoch=0,
                                     global_batch_tokens=10)
    assert [lengths[b].tolist() for b in batches] == [[4, 5], [3], [12], [2]]
    batches, undrawn = draw_global_batches(lengths, np.ones(5, np.bool_), seed=0, epoch=0,
                                           global_batch_tokens=10, drop_last=True)
    assert [lengths[b].tolist() for b in batches] == [[4, 5], [3], [12]]
    assert lengths[undrawn].tolist() == [2]


@given(lengths=st.lists(st.integers(1, 100), min_size=0, max_size=300),
       tokens=st.integers(1, 400), seed=st.integers(0, 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_token_batches_are_greedy_fills(lengths: list[int], tokens: int, seed: int) -> None:
    arr = np.asarray(lengths, dtype=np.int64)
    batches, undrawn = draw_global_batches(arr, np.ones(len(arr), np.bool_), seed=seed, epoch=0,
                                           global_batch_tokens=tokens)
    assert undrawn.size == 0
    order = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    perm = epoch_permutation(len(arr), seed, 0)
    assert np.array_equal(order, perm)
    for i, b in enumerate(batches):
        total = int(arr[b].sum())
        assert total <= tokens or len(b) == 1
        if i + 1 < len(batches):
            # The batch closed because the next sample would have overflowed it.
            assert total + int(arr[batches[i + 1][0]]) > tokens


def test_exactly_one_batch_mode_is_required() -> None:
    lengths = np.ones(4, dtype=np.int64)
    ok = np.ones(4, np.bool_)
    with pytest.raises(ValueError, match="exactly one"):
        draw_global_batches(lengths, ok, seed=0, epoch=0)
    with pytest.raises(ValueError, match="exactly one"):
        draw_global_batches(lengths, ok, seed=0, epoch=0, global_batch_size=2,
                            global_batch_tokens=2)


def test_no_eligible_samples_gives_no_batches() -> None:
    lengths = np.ones(4, dtype=np.int64)
    for kw in ({"global_batch_size": 2}, {"global_batch_tokens": 3}):
        batches, undrawn = draw_global_batches(lengths, np.zeros(4, np.bool_), seed=0, epoch=0,
                                               drop_last=True, **kw)
        assert batches == []
        assert undrawn.size == 0
