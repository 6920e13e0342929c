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


def min_padded(tokens: NDArray[np.int64], sizes: tuple[int, ...], capacity: int, tp_eff: int,
               layout: str, pad_to: int = 1) -> NDArray[np.int64]:
    """Each segment's padded length at the smallest group size that holds it (0: none does).

    A group holds k x C padded tokens, and one segment at most MAX_SEGMENT_TOKENS (int32 rows).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    out = np.zeros(len(tokens), dtype=np.int64)
    for k in sorted(sizes, reverse=True):
        m = pad_multiple(k, tp_eff, layout, pad_to)
        p = -(-tokens // m) * m
        out = np.where(p <= min(k * capacity, MAX_SEGMENT_TOKENS), p, out)
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


def plan_stats(steps: list[dict[str, NDArray[Any]]], step_segments: list[NDArray[np.int64]],
               config: PlannerConfig, cost: CostModel,
               tight_bounds: list[float] | None = None) -> dict[str, Any]:
    """The header's ``stats`` numbers for the given steps (policy lists are added by the caller).

    ``tight_bounds``: each step's malleable lower bound (greedy.StepAssignment.bound_seconds),
    summed into ``malleable_lower_bound_seconds`` when given.
    """
    n = config.parallel.pool_size
    cap = config.capacity_tokens_per_rank
    mult = config.parallel.microbatch_multiple
    sim = 0.0
    bound = 0.0
    worst = 0.0
    mb_per_step = np.zeros(len(steps), dtype=np.int64)
    for i, (cols, seg) in enumerate(zip(steps, step_segments, strict=True)):
        mb_per_step[i] = int(cols["microbatch"][-1]) + 1
        t = simulate_step(cost, n, cols["microbatch"], cols["rank_start"], cols["cp_size"],
                          cols["padded_tokens"])
        sim += t
        if tight_bounds is not None and tight_bounds[i] > 0:
            worst = max(worst, t / tight_bounds[i])
        tp_eff = config.parallel.tp_eff
        pad_to = config.pad_to_multiple
        need = min_num_microbatches(seg, config.sizes, cap, tp_eff, config.layout, n, mult,
                                    pad_to)
        bound += step_lower_bound(cost, n, seg, config.sizes, cap, tp_eff, config.layout, need,
                                  pad_to=pad_to)
    if steps:
        cat = {c: np.concatenate([s[c] for s in steps])
               for c in ("step", "microbatch", "rank_start", "cp_size", "sample_index",
                         "num_tokens", "padded_tokens")}
    else:
        cat = {c: np.zeros(0, dtype=np.int64) for c in ("step", "microbatch", "rank_start",
                                                         "cp_size", "sample_index", "num_tokens",
                                                         "padded_tokens")}
    real_rows = cat["sample_index"] >= 0
    real = int(cat["num_tokens"].sum(dtype=np.int64))
    padded = int(cat["padded_tokens"].sum(dtype=np.int64))
    align = int(cat["padded_tokens"][real_rows].sum(dtype=np.int64)) - real
    # A group is a run of rows with equal (step, microbatch, rank_start); fillers sit alone.
    key = (cat["step"].astype(np.int64) * (int(mb_per_step.max(initial=0)) + 1)
           + cat["microbatch"]) * (n + 1) + cat["rank_start"]
    first = np.r_[True, key[1:] != key[:-1]] if len(key) else np.zeros(0, np.bool_)
    first_real = first & real_rows
    group_k = cat["cp_size"][first_real]
    total_mb = int(mb_per_step.sum())
    return {
        "num_steps": len(steps),
        "num_microbatches": total_mb,
        "microbatches_per_step": {
            "min": int(mb_per_step.min()) if len(steps) else 0,
            "mean": float(mb_per_step.mean()) if len(steps) else 0.0,
            "max": int(mb_per_step.max(initial=0)),
        },
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_overhead": (padded - real) / real if real else 0.0,
        "alignment_padding": align / real if real else 0.0,
        "alignment_padding_tokens": align,
        "slot_fill": real / (n * cap * total_mb) if total_mb else 0.0,
        "simulated_seconds": sim,
        "lower_bound_seconds": bound,
        **({"malleable_lower_bound_seconds": float(sum(tight_bounds)),
            "time_over_tight_bound": sim / float(sum(tight_bounds)) if sum(tight_bounds) else 0.0,
            "time_over_tight_bound_max": worst}
           if tight_bounds is not None else {}),
        "cp_size_groups": {str(k): int((group_k == k).sum()) for k in config.sizes},
        "filler_rows": int((~real_rows).sum()),
    }
