"""Baselines as candidates: no step of a plan is slower than static CP or Megatron's greedy, and
every step says by how much it beats them (the plan's predicted gain).

Per step, after the search (greedy.py) has placed the segments, two baselines are built and
scored by the same simulator (``cost.simulate_step``, critical path) as our own rows:

- ``static-cp``: static CP at the job's cp (static_cp.py): every microbatch cut into N / cp
  groups of size cp, next-fit packed in the drawn order (only when cp is an allowed size);
- ``megatron-greedy``: Megatron's ``default_dynamic_cp`` greedy (megatron.py): 2 N tp' padding,
  attention-only balance (only without VPP, which it does not model).

The step keeps the fastest; on equal time, fewer microbatches, then less padding, then ours.
So a plan's simulated time is never above either baseline's, step by step (a property test
checks it on random workloads), and a planner that can choose "all groups of cp" never loses to
plain static CP by a rounding of its heuristics.

Every step's baseline times are returned too (``Scored``), whether a baseline won or not: the
header's stats sum them into the predicted gain (planfile/stats.py). That is why both baselines
are built on every step rather than skipped when a lower bound rules them out (as they were
before the gain was recorded): their rows come from numba passes (``static_layout``,
``megatron_arrays``) and only a winner's rows are gathered into plan columns. Cost per step on
the Wikipedia lengths: BENCHMARKS.md ("Predicted gain").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from planner.cost import _simulate, step_terms
from planner.groups import MAX_SEGMENT_TOKENS, pad_multiple
from planner.solver.megatron import megatron_arrays, megatron_padded
from planner.solver.static_cp import padded_lengths, static_layout

OURS = "dcp"
STATIC = "static-cp"
MEGATRON = "megatron-greedy"
NOT_SCORED = float("nan")
"""A baseline's seconds when it is not scored for the plan (options, see ``Scored``)."""
INFEASIBLE = float("inf")
"""A baseline's seconds on a step it cannot run (a segment it cannot place)."""


class Rows(NamedTuple):
    """One step's 7 plan columns (all but ``step``), sorted as the plan format demands."""

    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]

    @property
    def num_microbatches(self) -> int:
        return int(self.microbatch[-1]) + 1 if len(self.microbatch) else 0


def simulate(rows: Rows, cost: NDArray[np.float64], pool_size: int) -> float:
    """The simulator's step time (``cost.simulate_step``) of ``rows``."""
    t, _ = _simulate(cost, pool_size, rows.microbatch, rows.rank_start, rows.cp_size,
                     rows.padded_tokens)
    return float(t)


class Layout(NamedTuple):
    """A baseline's rows before they are gathered into plan columns: per row its microbatch,
    rank start, size and position in the step (-1 - j: a filler of padded length j)."""

    microbatch: NDArray[np.int64]
    rank_start: NDArray[np.int64]
    cp_size: NDArray[np.int64]
    position: NDArray[np.int64]
    padded: NDArray[np.int64]
    """Padded length of every row (fillers included)."""

    def seconds(self, cost: NDArray[np.float64], pool_size: int) -> float:
        t, _ = _simulate(cost, pool_size, self.microbatch.astype(np.int32),
                         self.rank_start.astype(np.int32), self.cp_size.astype(np.int32),
                         self.padded.astype(np.int32))
        return float(t)

    def terms(self, cost: NDArray[np.float64], pool_size: int,
              tokens: NDArray[np.int64]) -> NDArray[np.float64]:
        """``cost.step_terms`` of this layout (fillers hold no real tokens)."""
        real = np.where(self.position >= 0, tokens[np.maximum(self.position, 0)], 0) \
            if len(tokens) else np.zeros(len(self.position), np.int64)
        return step_terms(cost, pool_size, self.microbatch, self.rank_start, self.cp_size,
                          self.padded, real)

    def key(self, seconds: float, rank: int) -> tuple[float, int, int, int]:
        """The candidates' order: time, microbatches, padding, then ours before the baselines."""
        mb = int(self.microbatch[-1]) + 1 if len(self.microbatch) else 0
        return (seconds, mb, int(self.padded.sum()), rank)

    def rows(self, sample: NDArray[np.int64], offset: NDArray[np.int64],
             tokens: NDArray[np.int64]) -> Rows:
        real = self.position >= 0
        q = np.where(real, self.position, 0)
        return Rows(microbatch=self.microbatch.astype(np.int32),
                    rank_start=self.rank_start.astype(np.int32),
                    cp_size=self.cp_size.astype(np.int32),
                    sample_index=np.where(real, sample[q], -1).astype(np.int64),
                    token_offset=np.where(real, offset[q], 0).astype(np.int64),
                    num_tokens=np.where(real, tokens[q], 0).astype(np.int32),
                    padded_tokens=self.padded.astype(np.int32))


def static_layout_of(tokens: NDArray[np.int64], *, pool_size: int, cp: int, capacity: int,
                     tp_eff: int, layout: str, multiple: int) -> Layout | None:
    """Static CP ``cp``'s layout of one step, or None when a segment does not fit cp x C."""
    padded = padded_lengths(tokens, cp, tp_eff, layout)
    if len(padded) and int(padded.max()) > min(cp * capacity, MAX_SEGMENT_TOKENS):
        return None
    mb, start, pos, count = static_layout(padded, pool_size, cp, capacity, multiple)
    mb, start, pos = mb[:count], start[:count], pos[:count]
    filler = pad_multiple(cp, tp_eff, layout)
    return Layout(microbatch=mb, rank_start=start, cp_size=np.full(count, cp, np.int64),
                  position=np.where(pos >= 0, pos, -1 - filler),
                  padded=np.where(pos >= 0, padded[np.maximum(pos, 0)], filler))


def static_rows(sample: NDArray[np.int64], offset: NDArray[np.int64],
                tokens: NDArray[np.int64], *, pool_size: int, cp: int, capacity: int,
                tp_eff: int, layout: str, multiple: int) -> Rows:
    """Static CP ``cp`` rows of one step (every segment fits cp x C)."""
    got = static_layout_of(np.asarray(tokens, np.int64), pool_size=pool_size, cp=cp,
                           capacity=capacity, tp_eff=tp_eff, layout=layout, multiple=multiple)
    assert got is not None, "a segment does not fit cp x C"
    return got.rows(sample, offset, tokens)


def megatron_layout(tokens: NDArray[np.int64], *, pool_size: int, capacity: int, tp_eff: int,
                    sizes: NDArray[np.int64]) -> Layout | None:
    """Megatron's layout of one step, or None when it cannot place a segment or would need a
    size the plan may not use (its full-pool fallback needs N, which cp_sizes may leave out)."""
    padded = megatron_padded(tokens, pool_size, tp_eff)
    if len(padded) and int(padded.max()) > min(pool_size * capacity, MAX_SEGMENT_TOKENS):
        return None
    try:
        mb, start, k, pos = megatron_arrays(padded, pool_size=pool_size, capacity=capacity,
                                            sizes=tuple(int(x) for x in sizes))
    except ValueError:
        return None
    allowed = np.zeros(pool_size + 1, dtype=np.bool_)
    allowed[sizes] = True
    if not allowed[k].all():  # (np.isin: ~50 us a step)
        return None
    return Layout(microbatch=mb, rank_start=start, cp_size=k, position=pos, padded=padded[pos])


def megatron_rows(sample: NDArray[np.int64], offset: NDArray[np.int64],
                  tokens: NDArray[np.int64], *, pool_size: int, capacity: int, tp_eff: int,
                  sizes: NDArray[np.int64]) -> Rows | None:
    """Megatron's rows of one step, or None (see ``megatron_layout``)."""
    got = megatron_layout(np.asarray(tokens, np.int64), pool_size=pool_size, capacity=capacity,
                          tp_eff=tp_eff, sizes=sizes)
    return None if got is None else got.rows(sample, offset, tokens)


class Scored(NamedTuple):
    """One step's winning rows, and every candidate's simulated seconds.

    A baseline's seconds are ``NOT_SCORED`` (nan) when the plan does not score it (static CP
    when cp is not an allowed size; Megatron with VPP; both with ``--pad-to-multiple`` or
    ``SolverConfig.baselines=False``) and ``INFEASIBLE`` (inf) on a step it cannot run.
    """

    rows: Rows
    source: str
    seconds: float
    static_seconds: float
    megatron_seconds: float
    terms: NDArray[np.float64]
    """(3, 3): rows the winner's, static CP's and Megatron's ``cost.step_terms`` (padding,
    ring, microbatch seconds); nan where a baseline is not scored or cannot run the step."""


def best_rows(ours: Rows, sample: NDArray[np.int64], offset: NDArray[np.int64],
              tokens: NDArray[np.int64], *, cost: NDArray[np.float64], pool_size: int,
              capacity: int, sizes: NDArray[np.int64], static_cp: int, megatron: bool,
              tp_eff: int, layout: str, multiple: int) -> Scored:
    """The best candidate of one step and the baselines' simulated seconds.

    ``static_cp`` 0 leaves static CP out; ``megatron`` False leaves Megatron's greedy out (it
    does not model VPP: callers pass False when ``multiple`` > 1).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    key = (simulate(ours, cost, pool_size), ours.num_microbatches,
           int(ours.padded_tokens.sum(dtype=np.int64)), 0)
    best: Layout | None = None
    name = OURS
    times = [NOT_SCORED, NOT_SCORED]
    terms = np.full((3, 3), np.nan)
    terms[0] = step_terms(cost, pool_size, ours.microbatch, ours.rank_start, ours.cp_size,
                          ours.padded_tokens, ours.num_tokens)
    for rank, label in ((1, STATIC), (2, MEGATRON)):
        if label == STATIC:
            if not static_cp:
                continue
            cand = static_layout_of(tokens, pool_size=pool_size, cp=static_cp,
                                    capacity=capacity, tp_eff=tp_eff, layout=layout,
                                    multiple=multiple)
        else:
            if not megatron or multiple != 1:
                continue
            cand = megatron_layout(tokens, pool_size=pool_size, capacity=capacity,
                                   tp_eff=tp_eff, sizes=sizes)
        if cand is None:
            times[rank - 1] = INFEASIBLE
            continue
        times[rank - 1] = t = cand.seconds(cost, pool_size)
        terms[rank] = cand.terms(cost, pool_size, tokens)
        k = cand.key(t, rank)
        if k < key:
            best, name, key = cand, label, k
            terms[0] = terms[rank]
    rows = ours if best is None else best.rows(sample, offset, tokens)
    return Scored(rows=rows, source=name, seconds=key[0], static_seconds=times[0],
                  megatron_seconds=times[1], terms=terms)
