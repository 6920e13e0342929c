from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.groups import (
    catalog,
    check_cp_sizes,
    is_aligned,
    min_cp_size,
    pad_multiple,
    padded_length,
    valid_cp_sizes,
)


@pytest.mark.parametrize(
    ("n", "sizes"),
    [(1, (1,)), (2, (1, 2)), (6, (1, 2, 6)), (8, (1, 2, 4, 8)), (12, (1, 2, 4, 12)),
     (16, (1, 2, 4, 8, 16)), (24, (1, 2, 4, 8, 24)), (7, (1, 7))],
)
def test_valid_sizes_match_megatron(n: int, sizes: tuple[int, ...]) -> None:
    assert valid_cp_sizes(n) == sizes


def test_check_sizes_names_the_bad_size() -> None:
    with pytest.raises(ValueError, match="cp size 4 is not valid for a pool of 6"):
        check_cp_sizes(6, [1, 4])
    assert check_cp_sizes(8, [4, 1, 4]) == (1, 4)


@given(st.integers(1, 96))
def test_catalog_tiles_the_pool_for_every_size(n: int) -> None:
    groups = catalog(n, valid_cp_sizes(n))
    for k in valid_cp_sizes(n):
        blocks = [s for s, kk in groups if kk == k]
        covered = sorted(r for s in blocks for r in range(s, s + k))
        assert covered == list(range(n))
        assert all(is_aligned(s, k, n) for s in blocks)
    # creation order: size ascending, then start
    assert groups == sorted(groups, key=lambda g: (g[1], g[0]))


def test_padding_rules() -> None:
    assert pad_multiple(1, 1, "zigzag") == 1
    assert pad_multiple(1, 4, "zigzag") == 4
    assert pad_multiple(4, 1, "zigzag") == 8
    assert pad_multiple(4, 3, "zigzag") == 24
    assert pad_multiple(4, 2, "contiguous") == 8
    assert padded_length(1000, 4, 3, "zigzag") == 1008
    assert padded_length(1024, 2, 1, "zigzag") == 1024
    # Megatron would pad 1024 to 1032 at N=6 (2*6); we pad only for the size used.
    assert padded_length(1024, 1, 1, "zigzag") == 1024
    with pytest.raises(ValueError, match="unknown layout"):
        pad_multiple(2, 1, "ring")


@given(st.integers(1, 200_000), st.sampled_from([1, 2, 4]),
       st.sampled_from(["zigzag", "contiguous"]))
def test_min_cp_size_is_minimal_and_fits(length: int, tp: int, layout: str) -> None:
    sizes = valid_cp_sizes(16)
    cap = 4096
    k = min_cp_size(length, cap, sizes, tp, layout)
    if k is None:
        assert padded_length(length, 16, tp, layout) > 16 * cap
        return
    assert padded_length(length, k, tp, layout) <= k * cap
    for smaller in sizes:
        if smaller < k:
            assert padded_length(length, smaller, tp, layout) > smaller * cap
