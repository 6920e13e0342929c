"""Per-length tables the step kernels share: padded length, time and work at every group size.

For the allowed sizes s_0 < ... < s_{L-1} (levels), the tables give, per segment length and
level l (cost.py's formula, split into the parts the kernels need):

- ``padded[r, l]``: the length padded to the level's multiple (groups.pad_multiple);
- ``fits[r, l]``: whether it fits one group of the level (padded <= s_l * C, and <= 2^31-1);
- ``time[r, l]``: its share of a group's per-rank time, (a P + b P^2) / s_l plus the ring's
  per-token term (s_l - 1) * cp_token * P / s_l, without any per-group fixed cost;
- ``lone[r, l]``: the time of a group holding it alone, with the ring latency beyond what a
  group of the smallest size k0 pays ((s_l - k0) * cp_fixed: every microbatch of every rank
  pays k0's, and the callers count that with the microbatch cost);
- ``work[r, l]`` = s_l * time[r, l] plus its share of that extra latency, (s_l - k0) * cp_fixed
  * P / C (a group holds at most s_l * C tokens, so the shares never exceed the latency it
  pays): rank-seconds a schedule must spend on the segment at that size. Work grows
  with the size (the ring adds work and padding only grows): the smallest fitting level is the
  cheapest.

Everything depends on the length alone, so ``RunTables`` computes one row per *distinct* length
of a whole run (or of a worker's step range), once: the 1M Wikipedia lengths have 18,154, while
a step at N = 1024 has 16,384 segments whose tables (5 x 11 numbers each) cost 4 ms to compute
and as much to write, every step. A step's ``ItemTables`` is then a view: each segment's row
(``row``) and the placement order.

``min_level[r]`` is the smallest fitting level, and the placement order is largest work at the
smallest level first (LPT), ties by position in the step (the drawn order), so the result does
not depend on the sort algorithm. Rows are stored in that order of their work (``rank``:
equal works share a rank), so a step's segments in placement order read the tables forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from planner.groups import MAX_SEGMENT_TOKENS
from planner.jit import kernel

DENSE_LENGTHS = 1 << 23
"""Runs whose longest segment is shorter map lengths to rows through a dense array (4 bytes per
possible length, at most 32 MB); longer ones by binary search."""


@kernel
def seq_time(c: NDArray[np.float64], k: int, p: float) -> float:
    """A sequence's share of its group's per-rank time (cost.py's t without fixed terms)."""
    t = (c[0] * p + c[1] * p * p) / k
    if k > 1:
        t += (k - 1) * c[3] * p / k
    return float(t)


@kernel
def _tables(tokens: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
            capacity: int, c: NDArray[np.float64], max_segment: int
            ) -> tuple[NDArray[np.int64], NDArray[np.bool_], NDArray[np.float64],
                       NDArray[np.float64], NDArray[np.float64], NDArray[np.int64]]:
    n = len(tokens)
    num_levels = len(sizes)
    padded = np.empty((n, num_levels), dtype=np.int64)
    fits = np.empty((n, num_levels), dtype=np.bool_)
    time = np.empty((n, num_levels), dtype=np.float64)
    lone = np.empty((n, num_levels), dtype=np.float64)
    work = np.empty((n, num_levels), dtype=np.float64)
    min_level = np.full(n, -1, dtype=np.int64)
    k0 = sizes[0]
    # Power-of-two multiples (every one but a pad_to_multiple's) round up with a mask: an
    # integer division per segment and level was a third of this function's time.
    mask = np.zeros(num_levels, dtype=np.int64)
    for lv in range(num_levels):
        if mults[lv] & (mults[lv] - 1) == 0:
            mask[lv] = -mults[lv]
    for i in range(n):
        for lv in range(num_levels):
            k = sizes[lv]
            m = mults[lv]
            p = (tokens[i] + m - 1) & mask[lv] if mask[lv] != 0 else (tokens[i] + m - 1) // m * m
            padded[i, lv] = p
            # Plan rows are int32: a segment never pads past MAX_SEGMENT_TOKENS.
            fits[i, lv] = p <= k * capacity and p <= max_segment
            t = seq_time(c, k, float(p))
            time[i, lv] = t
            # Ring latency beyond the smallest size's, which every microbatch of every rank
            # pays anyway (counted with the microbatch cost). A group's extra latency,
            # (k - k0) c2 on each of k ranks, is shared by at most k C padded tokens: charging
            # each segment its token share keeps the bound valid.
            lone[i, lv] = t + (k - k0) * c[2]
            work[i, lv] = k * t + (k - k0) * c[2] * p / capacity
            if min_level[i] < 0 and fits[i, lv]:
                min_level[i] = lv
        if min_level[i] < 0:
            raise ValueError("a segment does not fit the largest group")
    return padded, fits, time, lone, work, min_level


@kernel
def _distinct(tokens: NDArray[np.int64], longest: int) -> NDArray[np.int64]:
    """The distinct values of ``tokens`` (all in 0..longest), ascending."""
    seen = np.zeros(longest + 1, dtype=np.bool_)
    for x in tokens:
        seen[x] = True
    return np.flatnonzero(seen).astype(np.int64)


@kernel
def _rank_order(key: NDArray[np.float64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(rows by descending key, stable; the rank of each in that order: equal keys, equal
    rank). Keys are works >= 0, whose IEEE bits order as their values."""
    bits = key.view(np.uint64)
    order = np.argsort(~bits, kind="mergesort")
    rank = np.empty(len(key), dtype=np.int64)
    r = -1
    for j in range(len(order)):
        if j == 0 or bits[order[j]] != bits[order[j - 1]]:
            r += 1
        rank[j] = r
    return order, rank


@kernel
def _dense_rows(values: NDArray[np.int64], longest: int) -> NDArray[np.int32]:
    row_of = np.full(longest + 1, -1, dtype=np.int32)
    for r in range(len(values)):
        row_of[values[r]] = r
    return row_of


@kernel
def placement_order(rank: NDArray[np.int64]) -> NDArray[np.int64]:
    """The stable argsort of ``rank`` (small non-negative ints): LSD radix, 8 bits a pass, only
    as many passes as the largest rank needs."""
    n = len(rank)
    perm = np.arange(n)
    if n == 0:
        return perm
    top = rank.max()
    tmp = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    shift = 0
    while top >> shift:
        count[:] = 0
        for i in range(n):
            count[((rank[perm[i]] >> shift) & 255) + 1] += 1
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = (rank[perm[i]] >> shift) & 255
            tmp[count[d]] = perm[i]
            count[d] += 1
        perm, tmp = tmp, perm
        shift += 8
    return perm


@dataclass(frozen=True, kw_only=True, slots=True)
class RunTables:
    """One row of tables per distinct segment length (the module docstring), in order of
    descending work at the cheapest size."""

    padded: NDArray[np.int64]
    fits: NDArray[np.bool_]
    time: NDArray[np.float64]
    lone: NDArray[np.float64]
    work: NDArray[np.float64]
    min_level: NDArray[np.int64]
    rank: NDArray[np.int64]
    """Per row, the rank of its work at the cheapest size, descending (equal works, equal
    rank): the placement order sorts segments by it."""
    lengths: NDArray[np.int64]
    """Per row, its segment length."""
    row_of: NDArray[np.int32]
    """Length -> row, for lengths below DENSE_LENGTHS (empty: ``lengths`` by binary search)."""
    by_length: NDArray[np.int64]
    """Rows in ascending length (the binary search's order)."""

    @classmethod
    def of(cls, tokens: NDArray[np.int64], sizes: NDArray[np.int64],
           mults: NDArray[np.int64], capacity: int, cost: NDArray[np.float64], *,
           dense_lengths: int = DENSE_LENGTHS) -> RunTables:
        """Tables of every distinct length in ``tokens`` (``cost`` is CostModel.as_array());
        raises if a segment fits no size. Lengths map to rows through a dense array when the
        longest is below ``dense_lengths``."""
        tokens = np.asarray(tokens, np.int64)
        longest = int(tokens.max()) if len(tokens) else 0
        dense = longest < dense_lengths
        values = _distinct(tokens, longest) if dense else np.unique(tokens).astype(np.int64)
        padded, fits, time, lone, work, min_level = _tables(values, sizes, mults, capacity, cost,
                                                            MAX_SEGMENT_TOKENS)
        key = work[np.arange(len(values)), min_level] if len(values) else np.zeros(0)
        order, rank = _rank_order(key)
        values = values[order]
        row_of = _dense_rows(values, longest) if dense else np.zeros(0, np.int32)
        return cls(padded=padded[order], fits=fits[order], time=time[order], lone=lone[order],
                   work=work[order], min_level=min_level[order], rank=rank, lengths=values,
                   row_of=row_of, by_length=np.argsort(values, kind="stable"))

    def rows(self, tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Each segment's row (its length must be one of these tables')."""
        tokens = np.asarray(tokens, np.int64)
        if len(self.row_of):
            return self.row_of[tokens].astype(np.int64)
        return self.by_length[np.searchsorted(self.lengths[self.by_length], tokens)]

    def step(self, tokens: NDArray[np.int64]) -> ItemTables:
        """One step's view of these tables."""
        row = self.rows(tokens)
        return ItemTables(run=self, row=row, order=placement_order(self.rank[row]))


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemTables:
    """One step's segments: their rows of the run's tables and the placement order."""

    run: RunTables
    row: NDArray[np.int64]
    """Per segment (in step order), its row of ``run``."""
    order: NDArray[np.int64]
    """The placement order: largest work at the cheapest size first, ties by position."""

    def at(self, level: NDArray[np.int64]) -> NDArray[np.int64]:
        """Each segment's padded length at ``level`` (one level per segment)."""
        return _padded_at(self.run.padded, self.row, level)

    def cheapest(self) -> NDArray[np.int64]:
        """Each segment's smallest fitting level."""
        return self.run.min_level[self.row]

    def padded_total(self, level: NDArray[np.int64] | None = None) -> int:
        """The segments' padded tokens, each at ``level`` (default: its cheapest)."""
        return int(_padded_sum(self.run.padded, self.run.min_level, self.row,
                               self.row if level is None else level, level is None))


@kernel
def _padded_at(padded: NDArray[np.int64], row: NDArray[np.int64],
               level: NDArray[np.int64]) -> NDArray[np.int64]:
    out = np.empty(len(row), dtype=np.int64)
    for i in range(len(row)):
        out[i] = padded[row[i], level[i]]
    return out


@kernel
def _padded_sum(padded: NDArray[np.int64], min_level: NDArray[np.int64],
                row: NDArray[np.int64], level: NDArray[np.int64], cheapest: bool) -> int:
    total = 0
    for i in range(len(row)):
        total += padded[row[i], min_level[row[i]] if cheapest else level[i]]
    return total


def item_tables(tokens: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
                capacity: int, cost: NDArray[np.float64]) -> ItemTables:
    """One step's tables on their own (``RunTables`` of its lengths alone)."""
    return RunTables.of(tokens, sizes, mults, capacity, cost).step(tokens)
