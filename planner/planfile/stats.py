"""Header statistics of a plan, computed from its rows (vectorised; no wall-clock numbers).

Definitions (all over every step of every epoch):
- ``padding_overhead`` = (padded - real) / real, fillers' padded tokens included;
  ``alignment_padding`` = the same ratio for real segments only (what alignment to 2k*tp' costs),
  ``alignment_padding_tokens`` that padding in tokens.
- ``slot_fill`` = real tokens / (N x C x microbatches): how much of the memory slots carries data.
- ``simulated_seconds`` = sum of cost.simulate_step; ``lower_bound_seconds`` = sum of
  cost.step_lower_bound with the step's segment lengths and its minimum microbatch count
  (ceil(padded at the smallest fitting size / (N x C)), rounded up to the microbatch multiple):
  issue 3's bound, max(cheapest work / N, costliest single sequence) per step.
  ``malleable_lower_bound_seconds`` = the sum of the tight bound per step (bounds.py: every
  sequence at one size for both terms, and segments that need the whole pool add their whole
  groups' time to everything else), at the same microbatch counts;
  ``time_over_tight_bound`` = simulated / that sum, ``time_over_tight_bound_max`` the largest
  ratio of one step (what a user waits for beyond what any schedule needs, in total and at
  worst).
- ``vs_static_cp``, ``vs_megatron`` and ``baselines``: the predicted gain (gain.py), from the
  baselines' simulated seconds the solver scored on every step.
- ``cp_size_groups`` counts groups that hold at least one real segment, per size (keys are
  strings so the header round-trips through JSON unchanged); ``filler_rows`` counts the rest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.cost import CostModel, simulate_step, step_lower_bound
from planner.groups import MAX_SEGMENT_TOKENS, pad_multiple
from planner.jit import kernel
from planner.planfile.gain import GainAccumulator
from planner.solver.step import baselines_not_scored


def min_padded(tokens: NDArray[np.int64], sizes: tuple[int, ...], capacity: int, tp_eff: int,
               layout: str, pad_to: int = 1) -> NDArray[np.int64]:
    """Each segment's padded length at the smallest group size that holds it (0: none does).

    A group holds k x C padded tokens, and one segment at most MAX_SEGMENT_TOKENS (int32 rows).
    """
    ks = np.sort(np.asarray(sizes, dtype=np.int64))
    mults = np.array([pad_multiple(int(k), tp_eff, layout, pad_to) for k in ks], dtype=np.int64)
    return _min_padded(np.asarray(tokens, dtype=np.int64), ks, mults, capacity, MAX_SEGMENT_TOKENS)


@kernel
def _min_padded(tokens: NDArray[np.int64], sizes: NDArray[np.int64], mults: NDArray[np.int64],
                capacity: int, max_segment: int) -> NDArray[np.int64]:
    out = np.zeros(len(tokens), dtype=np.int64)
    for i in range(len(tokens)):
        for lv in range(len(sizes)):
            m = mults[lv]
            p = -(-tokens[i] // m) * m
            if p <= min(sizes[lv] * capacity, max_segment):
                out[i] = p
                break
    return out


def min_num_microbatches(tokens: NDArray[np.int64], sizes: tuple[int, ...], capacity: int,
                         tp_eff: int, layout: str, pool_size: int, multiple: int,
                         pad_to: int = 1) -> int:
    """ceil(padded tokens at the smallest sizes / (N C)), at least 1, rounded up to ``multiple``.

    The microbatch count the step's lower bound assumes; ``plan_stats`` and the notebook's
    per-step summary both use it, so their bounds agree.
    """
    need = -(-int(min_padded(tokens, sizes, capacity, tp_eff, layout, pad_to).sum())
             // (pool_size * capacity))
    return -(-max(need, 1) // multiple) * multiple


class StatsAccumulator:
    """The header's ``stats`` numbers, one step at a time (memory independent of the steps).

    ``add`` each step's columns in order, then ``result``: the same numbers, to the last bit,
    as summing over the whole plan (sums run in step order; per-step microbatch counts, a few
    bytes a step, are kept for the mean).
    """

    def __init__(self, config: PlannerConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.sim = 0.0
        self.bound = 0.0
        self.tight = 0.0
        self.worst = 0.0
        self.mb: list[int] = []
        self.real = 0
        self.padded = 0
        self.real_padded = 0
        self.fillers = 0
        self.groups = {k: 0 for k in config.sizes}
        self.gain: GainAccumulator | None = None

    def add(self, cols: dict[str, NDArray[Any]], seg: NDArray[np.int64],
            tight_bound: float | None = None, simulated: float | None = None,
            baselines: tuple[float, float] | None = None,
            terms: NDArray[np.float64] | None = None) -> None:
        """One step: its 8 plan columns, its segments' lengths and its tight bound.

        ``simulated``: the step's ``cost.simulate_step`` when the caller has it already (the
        solver scores its rows with it), so that it is not simulated twice. ``baselines``:
        static CP's and Megatron's simulated seconds on the step (``StepAssignment``), given
        for every step or none; the stats then hold the predicted gain. ``terms``: the step's
        ``StepAssignment.terms``, for the gain's parts (gain.py).
        """
        config, cost = self.config, self.cost
        n = config.parallel.pool_size
        cap = config.capacity_tokens_per_rank
        tp_eff = config.parallel.tp_eff
        mb = cols["microbatch"]
        self.mb.append(int(mb[-1]) + 1)
        t = simulated if simulated is not None else simulate_step(
            cost, n, mb, cols["rank_start"], cols["cp_size"], cols["padded_tokens"])
        self.sim += t
        if baselines is not None:
            if self.gain is None:
                self.gain = GainAccumulator(baselines_not_scored(config), config.parallel.cp)
            self.gain.add(t, *baselines, terms=terms)
        if tight_bound is not None:
            self.tight += tight_bound
            if tight_bound > 0:
                self.worst = max(self.worst, t / tight_bound)
        pad_to = config.pad_to_multiple
        need = min_num_microbatches(seg, config.sizes, cap, tp_eff, config.layout, n,
                                    config.parallel.microbatch_multiple, pad_to)
        self.bound += step_lower_bound(cost, n, seg, config.sizes, cap, tp_eff, config.layout,
                                       need, pad_to=pad_to)
        real_rows = cols["sample_index"] >= 0
        self.real += int(cols["num_tokens"].sum(dtype=np.int64))
        self.padded += int(cols["padded_tokens"].sum(dtype=np.int64))
        self.real_padded += int(cols["padded_tokens"][real_rows].sum(dtype=np.int64))
        self.fillers += int((~real_rows).sum())
        # A group is a run of rows with equal (microbatch, rank_start); fillers sit alone.
        key = mb.astype(np.int64) * (n + 1) + cols["rank_start"]
        first = np.ones(len(key), dtype=np.bool_)
        np.not_equal(key[1:], key[:-1], out=first[1:])
        per_size = np.bincount(cols["cp_size"][first & real_rows], minlength=n + 1)
        for k in self.groups:
            self.groups[k] += int(per_size[k])

    def result(self, with_tight: bool = True) -> dict[str, Any]:
        """The stats of the steps added so far (policy lists are added by the caller)."""
        n = self.config.parallel.pool_size
        cap = self.config.capacity_tokens_per_rank
        mb = np.asarray(self.mb, dtype=np.int64)
        real, padded = self.real, self.padded
        align = self.real_padded - real
        total_mb = int(mb.sum())
        return {
            "num_steps": len(mb),
            "num_microbatches": total_mb,
            "microbatches_per_step": {
                "min": int(mb.min()) if len(mb) else 0,
                "mean": float(mb.mean()) if len(mb) else 0.0,
                "max": int(mb.max(initial=0)),
            },
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_overhead": (padded - real) / real if real else 0.0,
            "alignment_padding": align / real if real else 0.0,
            "alignment_padding_tokens": align,
            "slot_fill": real / (n * cap * total_mb) if total_mb else 0.0,
            "simulated_seconds": self.sim,
            "lower_bound_seconds": self.bound,
            **({"malleable_lower_bound_seconds": float(self.tight),
                "time_over_tight_bound": self.sim / float(self.tight) if self.tight else 0.0,
                "time_over_tight_bound_max": self.worst}
               if with_tight else {}),
            "cp_size_groups": {str(k): v for k, v in self.groups.items()},
            "filler_rows": self.fillers,
            **(self.gain.result() if self.gain is not None else {}),
        }


def plan_stats(steps: list[dict[str, NDArray[Any]]], step_segments: list[NDArray[np.int64]],
               config: PlannerConfig, cost: CostModel,
               tight_bounds: list[float] | None = None) -> dict[str, Any]:
    """The header's ``stats`` numbers for the given steps (policy lists are added by the caller).

    ``tight_bounds``: each step's tight lower bound (greedy.StepAssignment.bound_seconds),
    summed into ``malleable_lower_bound_seconds`` when given.
    """
    acc = StatsAccumulator(config, cost)
    for i, (cols, seg) in enumerate(zip(steps, step_segments, strict=True)):
        acc.add(cols, seg, None if tight_bounds is None else tight_bounds[i])
    return acc.result(with_tight=tight_bounds is not None)
