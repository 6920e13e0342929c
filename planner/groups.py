"""Valid CP group sizes, aligned rank blocks and alignment padding.

One implementation shared by the planner and the runtime, so the two can never disagree on which
groups exist or how a sequence is padded.

Rules (Megatron's dynamic CP, see shared DOMAIN.md):
- For a pool of N = dp x cp ranks the valid group sizes are the powers of two that divide N and
  are smaller than N, plus N itself: N=8 -> (1, 2, 4, 8), N=6 -> (1, 2, 6), N=12 -> (1, 2, 4, 12).
- A group of size k is an aligned block of ranks [i*k, (i+1)*k); the only group of size N is the
  whole pool.
- Padding is to the group size actually used (not Megatron's 2*N*tp'): with zigzag sharding and
  k > 1 a sequence is padded to a multiple of 2*k*tp', with contiguous sharding to k*tp', and at
  k == 1 to tp' (tp' = tp with sequence parallelism, else 1).
- ``pad_to`` (``dcp-plan --pad-to-multiple N``, e.g. 16 for FP8 GEMMs) makes every padded length
  also a multiple of N: the multiple becomes lcm(rule above, N). The padding counts in capacity.

Example: N=8, sizes (1, 2, 4, 8): the catalog is 8 groups of 1, 4 of 2, 2 of 4 and 1 of 8, in that
order; a 1000-token sequence at k=4 with zigzag and tp'=1 pads to 1000 (a multiple of 8), at
k=4 with tp'=3 to 1008 (a multiple of 24).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_SEGMENT_TOKENS = 2**31 - 1
"""Most padded tokens one plan row can hold: ``num_tokens`` and ``padded_tokens`` are int32."""
MAX_GROUP_TOKENS = 2**31 - 1
"""Padded tokens one CP group may hold in a microbatch (k x capacity at most): the runtime
addresses a group's packed buffer with int32 offsets (TE's ``cu_seqlens``)."""

ZIGZAG = "zigzag"
CONTIGUOUS = "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)


def valid_cp_sizes(pool_size: int) -> tuple[int, ...]:
    """Megatron's valid dynamic-CP group sizes for a pool of ``pool_size`` ranks, ascending."""
    if pool_size < 1:
        raise ValueError(f"pool size must be >= 1, got {pool_size}")
    sizes = []
    k = 1
    while k < pool_size:
        if pool_size % k == 0:
            sizes.append(k)
        k *= 2
    sizes.append(pool_size)
    return tuple(sizes)


def check_cp_sizes(pool_size: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` sorted and deduplicated, or ValueError naming a size that is invalid."""
    valid = set(valid_cp_sizes(pool_size))
    out = sorted(set(int(s) for s in sizes))
    if not out:
        raise ValueError("cp sizes must not be empty")
    for s in out:
        if s not in valid:
            raise ValueError(
                f"cp size {s} is not valid for a pool of {pool_size} ranks "
                f"(valid: {', '.join(map(str, sorted(valid)))})"
            )
    return tuple(out)


def block_starts(pool_size: int, size: int) -> range:
    """First ranks of the aligned blocks of ``size`` ranks in a pool of ``pool_size``."""
    if size == pool_size:
        return range(0, 1)
    if size < 1 or pool_size % size != 0:
        raise ValueError(f"group size {size} does not tile a pool of {pool_size} ranks")
    return range(0, pool_size, size)


def catalog(pool_size: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Every group a plan may use, as (rank_start, cp_size), in the canonical creation order.

    The order is by size ascending, then rank_start ascending; the runtime creates process groups
    in exactly this order on every rank (``new_group`` is collective).
    """
    return [(start, k) for k in sorted(set(sizes)) for start in block_starts(pool_size, k)]


def is_aligned(rank_start: int, size: int, pool_size: int) -> bool:
    """True when [rank_start, rank_start+size) is a valid aligned block of the pool."""
    if size == pool_size:
        return rank_start == 0
    return size >= 1 and rank_start % size == 0 and 0 <= rank_start <= pool_size - size


def pad_multiple(cp_size: int, tp_eff: int, layout: str, pad_to: int = 1) -> int:
    """The multiple a sequence's padded length must be at group size ``cp_size``.

    ``pad_to``: an extra alignment every padded length must also meet (the result is the least
    common multiple); 1 leaves the sharding rule alone.
    """
    if cp_size == 1:
        base = tp_eff
    elif layout == ZIGZAG:
        base = 2 * cp_size * tp_eff
    elif layout == CONTIGUOUS:
        base = cp_size * tp_eff
    else:
        raise ValueError(f"unknown layout {layout!r} (expected one of {', '.join(LAYOUTS)})")
    return base if pad_to == 1 else math.lcm(base, pad_to)


def padded_length(num_tokens: int, cp_size: int, tp_eff: int, layout: str,
                  pad_to: int = 1) -> int:
    """``num_tokens`` rounded up to the alignment multiple of the group size."""
    m = pad_multiple(cp_size, tp_eff, layout, pad_to)
    return -(-num_tokens // m) * m


def min_cp_size(
    num_tokens: int, capacity: int, sizes: Sequence[int], tp_eff: int, layout: str,
    pad_to: int = 1,
) -> int | None:
    """Smallest size k in ``sizes`` whose k ranks hold the padded sequence, or None if none does."""
    for k in sorted(sizes):
        if padded_length(num_tokens, k, tp_eff, layout, pad_to) <= k * capacity:
            return k
    return None
