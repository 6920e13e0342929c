"""The fast path of a step's row invariants (numba): one pass that says whether all of them hold.

``validate._check_step`` checks PLAN_FORMAT's per-step invariants with numpy and words the
errors; on a valid step, which is every step a planner writes, that is ~30 array operations for
an answer of "nothing wrong", 0.3 ms a step at N = 64 (a third of validating a plan). ``rows_valid``
answers the same question in one pass over the rows; ``_check_step`` returns at once when it
says yes and otherwise runs its numpy checks, which word the errors. So messages come from one
place only, and this must hold: ``rows_valid`` is True exactly when the numpy checks find
nothing (tests/planner/planfile/test_stepcheck.py mutates valid steps to check both ways).

It is conservative where that is simpler: a row outside the pool (rank_start < 0 or >= N)
answers False, and the numpy checks then word it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel


@kernel
def rows_valid(i: int, step: NDArray[np.int32], mb: NDArray[np.int32],
               start: NDArray[np.int32], k: NDArray[np.int32], sample: NDArray[np.int64],
               ntok: NDArray[np.int32], padded: NDArray[np.int32], pool_size: int,
               capacity: int, mult_of: NDArray[np.int64], microbatch_multiple: int) -> bool:
    """Whether step ``i``'s rows hold every invariant of ``validate._check_step``.

    ``mult_of[s]`` is the padding multiple of an allowed size s and 0 for any other size
    (length pool_size + 1).
    """
    rows = len(step)
    if rows == 0 or mb[0] != 0:
        return False
    n = pool_size
    g_k = 0          # the current group's size, its first row's start and its padded tokens
    g_start = -1
    g_pad = 0
    covered = 0      # ranks covered by the current microbatch's groups so far
    for j in range(rows):
        kj = k[j]
        sj = start[j]
        if step[j] != i or sj < 0 or sj >= n or kj < 1 or kj > n or mult_of[kj] == 0:
            return False
        if j > 0:
            if mb[j] < mb[j - 1] or (mb[j] == mb[j - 1] and sj < start[j - 1]):
                return False          # not sorted by (microbatch, rank_start)
            if mb[j] > mb[j - 1] + 1:
                return False          # a gap in the microbatch numbers
        new_mb = j == 0 or mb[j] != mb[j - 1]
        new_group = new_mb or sj != start[j - 1]
        if new_group:
            if j > 0 and g_pad > g_k * capacity:
                return False          # the previous group is over capacity
            if new_mb:
                if j > 0 and covered != n:
                    return False      # the previous microbatch does not cover the pool
                if sj != 0:
                    return False      # a microbatch's first group starts at rank 0
                covered = 0
            elif sj != g_start + g_k:
                return False          # groups of a microbatch must tile the ranks
            if kj == n:
                if sj != 0:
                    return False
            elif sj % kj != 0 or sj + kj > n:
                return False          # not an aligned block
            g_k = kj
            g_start = sj
            g_pad = 0
            covered += kj
        elif kj != g_k:
            return False              # rows of one group disagree on cp_size
        p = int(padded[j])
        t = int(ntok[j])
        if p < t or t < 0 or p % mult_of[kj] != 0:
            return False
        if (sample[j] < 0) != (t == 0):
            return False              # fillers hold 0 tokens, samples more
        g_pad += p
    if g_pad > g_k * capacity or covered != n:
        return False
    return bool((int(mb[rows - 1]) + 1) % microbatch_multiple == 0)
