"""Baseline 2: Megatron-LM's ``default_dynamic_cp`` greedy, re-implemented from its behaviour.

Source of the behaviour: megatron/core/datasets/data_schedule.py (``DefaultDynamicCPScheduler``)
and data_schedule_utils.py (``next_hdp_group_packing_aware``, ``dcp_gpus_needed``) on Megatron's
``dev`` branch, read to get the rules right; no code is copied. Per step:

1. Padding: every sequence is padded to a multiple of 2*N*tp' (the whole pool), whatever size it
   then runs at. Since k divides N this also satisfies our format's 2*k*tp' rule, so Megatron's
   padding never breaks an invariant; it only wastes capacity.
2. Cost: attention only, work = P^2 / k per rank (P the padded length). No GEMM or ring term.
3. Sort descending by padded length (stable: ties keep the drawn order).
4. Microbatches repeat until the step's sequences are placed. Each one starts from the longest
   remaining sequence ("tall"): its smallest valid size k (>= ceil(P/C)) on ranks [0, k). The cap
   on any rank's work is tall * C * 1.05. Every later sequence (in order) considers each allowed
   size >= its minimum, smallest first: joining an existing group of that size (capacity
   sum(P)/k <= C) or opening a new group on the least-loaded free ranks; it takes the candidate
   with the smallest resulting maximum rank work (<= cap), the first one on ties. A sequence
   with no candidate waits for the next microbatch.
5. Empty ranks: grow the first group of the smallest size to the next allowed size, shifting the
   groups after it right; repeat. When that cannot fill the pool, the microbatch is replaced by
   one full-pool group holding, in order, every remaining sequence that fits N x C.

Where we had to deviate or guess (each marked below):
- Group placement. Megatron allocates ranks left to right in creation order, so a later, larger
  group can start at a rank its size does not divide (ranks [1, 3) for a size-2 group); its
  runtime then looks up the aligned group of that size, which is not the planned one. Our format
  demands aligned blocks, so when Megatron's order is not aligned we re-place the groups largest
  first (a permutation of ranks within the microbatch: same groups, same per-group work).
- Growing a group on a non-power-of-two pool (N=12: two groups of 4 and 4 empty ranks, next
  size 12) makes Megatron's code index past the pool; we treat it as "cannot fill" and take the
  full-pool fallback, which is what its docstring says it intends.
- VPP (``align_sample_id_groups``) is not modelled: vpp > 1 raises ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
from numpy.typing import NDArray

from bench.baseline_common import BaselineRun, GroupRows, run_baseline
from planner.config import PlannerConfig

SOLVER_NAME = "megatron-greedy"
WORK_CAP_DELTA = 0.05
"""Megatron's slack on the per-rank work cap (tall * C * (1 + delta))."""


@dataclass(slots=True)
class _Group:
    size: int
    tokens: int = 0
    """Padded tokens held (Megatron tracks tokens / size per rank)."""
    work: float = 0.0
    """Per-rank work, sum of P^2 / size, accumulated in placement order as Megatron does."""
    seqs: list[int] = field(default_factory=list)


def megatron_padded(lengths: NDArray[np.int64], pool_size: int, tp_eff: int) -> NDArray[np.int64]:
    """Megatron's padding: every length rounded up to a multiple of 2 * N * tp'."""
    m = 2 * pool_size * tp_eff
    return -(-np.asarray(lengths, dtype=np.int64) // m) * m


def _min_size(padded: int, capacity: int, sizes: tuple[int, ...]) -> int:
    need = -(-padded // capacity)
    for k in sizes:
        if k >= need:
            return k
    raise ValueError(f"a sequence of {padded} padded tokens needs {need} ranks of {capacity} "
                     f"tokens; the largest group has {sizes[-1]}")


def _fill_once(groups: list[_Group], padded: list[int], pool_size: int,
               sizes: tuple[int, ...]) -> bool:
    """Grow the first smallest group to the next size; False when Megatron's rule cannot."""
    empty = pool_size - sum(g.size for g in groups)
    smallest = min(g.size for g in groups)
    i = sizes.index(smallest)
    if i + 1 >= len(sizes):
        return False
    grow = sizes[i + 1] - smallest
    if grow > empty:
        # Guess: Megatron's code would write past the pool here (see module docstring).
        return False
    start = 0
    for g in groups:
        end = start + g.size - 1
        if g.size == smallest and end + grow < pool_size:
            g.size = sizes[i + 1]
            g.work = sum(padded[j] * padded[j] / g.size for j in g.seqs)
            return True
        start += g.size
    return False


def _microbatch(order: list[int], padded: list[int], pool_size: int, capacity: int,
                sizes: tuple[int, ...]) -> tuple[list[_Group], list[int]]:
    """One microbatch from the remaining sequences ``order`` (sorted descending).

    Returns the groups in Megatron's rank order and the sequences left for later microbatches.
    """
    tall = padded[order[0]]
    cap = float(tall) * float(capacity) * (1.0 + WORK_CAP_DELTA)
    k0 = _min_size(tall, capacity, sizes)
    first = _Group(size=k0, tokens=tall, work=tall * tall / k0, seqs=[order[0]])
    groups = [first]
    by_size: dict[int, list[_Group]] = {k: [] for k in sizes}
    by_size[k0].append(first)
    free = pool_size - k0
    top = first.work
    leftovers: list[int] = []
    for j in order[1:]:
        p = padded[j]
        need = _min_size(p, capacity, sizes)
        best: _Group | None = None
        best_size = 0
        best_max = 0.0
        for k in sizes:
            if k < need:
                continue
            w = p * p / k
            limit = k * capacity - p
            for g in by_size[k]:
                if g.tokens > limit:
                    continue
                projected = max(top, g.work + w)
                if projected <= cap and (best_size == 0 or projected < best_max):
                    best, best_size, best_max = g, k, projected
            if free >= k:
                projected = max(top, w)
                if projected <= cap and (best_size == 0 or projected < best_max):
                    best, best_size, best_max = None, k, projected
        if best_size == 0:
            leftovers.append(j)
            continue
        if best is None:
            # New group on the least-loaded free ranks: free ranks have no work, and Megatron's
            # stable sort then takes the lowest-numbered ones, i.e. the next ranks to the right.
            best = _Group(size=best_size)
            groups.append(best)
            by_size[best_size].append(best)
            free -= best_size
        best.tokens += p
        best.work += p * p / best_size
        best.seqs.append(j)
        top = max(top, best.work)
    while sum(g.size for g in groups) < pool_size:
        if not _fill_once(groups, padded, pool_size, sizes):
            # Fallback: one full-pool group of everything that fits, in order.
            whole = _Group(size=pool_size)
            rest: list[int] = []
            for j in order:
                if whole.tokens + padded[j] <= pool_size * capacity:
                    whole.tokens += padded[j]
                    whole.seqs.append(j)
                else:
                    rest.append(j)
            return [whole], rest
    return groups, leftovers


def _aligned(groups: list[_Group], pool_size: int) -> list[tuple[int, _Group]]:
    """(rank_start, group) in Megatron's order if aligned, else re-placed largest first."""
    starts = np.cumsum([0] + [g.size for g in groups[:-1]]).tolist()
    if all(g.size == pool_size or s % g.size == 0 for s, g in zip(starts, groups, strict=False)):
        return list(zip(starts, groups, strict=False))
    # Deviation (module docstring): sizes are powers of two dividing N, so largest-first is
    # always aligned.
    placed = sorted(groups, key=lambda g: -g.size)
    starts = np.cumsum([0] + [g.size for g in placed[:-1]]).tolist()
    assert all(s % g.size == 0 for s, g in zip(starts, placed, strict=False))
    return list(zip(starts, placed, strict=False))


def megatron_step(samples: NDArray[np.int64], lengths: NDArray[np.int64], *, pool_size: int,
                  capacity: int, tp_eff: int, sizes: tuple[int, ...]) -> list[list[GroupRows]]:
    """One step under Megatron's ``default_dynamic_cp`` rules (module docstring)."""
    padded_arr = megatron_padded(lengths, pool_size, tp_eff)
    if padded_arr.size and int(padded_arr.max()) > pool_size * capacity:
        j = int(np.argmax(padded_arr))
        raise ValueError(f"sample {int(samples[j])} ({int(lengths[j])} tokens) pads to "
                         f"{int(padded_arr[j])} > N x C = {pool_size * capacity}: Megatron's "
                         f"scheduler cannot place it")
    padded = padded_arr.tolist()
    remaining = np.argsort(-padded_arr, kind="stable").tolist()
    samples_l, lengths_l = samples.tolist(), lengths.tolist()
    out: list[list[GroupRows]] = []
    while remaining:
        groups, remaining = _microbatch(remaining, padded, pool_size, capacity, sizes)
        rows = []
        for start, g in _aligned(groups, pool_size):
            rows.append(GroupRows(rank_start=int(start), cp_size=g.size,
                                  samples=[samples_l[j] for j in g.seqs],
                                  num_tokens=[lengths_l[j] for j in g.seqs],
                                  padded=[padded[j] for j in g.seqs]))
        out.append(rows)
    return out


def megatron_plan(table: object, config: PlannerConfig) -> BaselineRun:
    """Plan ``table`` with Megatron's greedy over the same global batches as ours.

    Raises:
        ValueError: vpp > 1 (not modelled), or a sample longer than N x C after 2N padding.
    """
    p = config.parallel
    if p.vpp > 1:
        raise ValueError("the Megatron baseline does not model VPP microbatch alignment (vpp > 1)")
    step_fn = partial(megatron_step, pool_size=p.pool_size,
                      capacity=config.capacity_tokens_per_rank, tp_eff=p.tp_eff,
                      sizes=tuple(config.sizes))
    solver = {"name": SOLVER_NAME, "work_cap_delta": WORK_CAP_DELTA,
              "padding_multiple": 2 * p.pool_size * p.tp_eff, "min_cp": config.min_cp}
    cost = {"name": "megatron-attention-only",
            "parameters": {"attention_s_per_token2": 1.0, "linear_s_per_token": 0.0},
            "description": "Megatron balances P^2 / k work units (attention only)"}
    return run_baseline(table, config, step_fn, solver=solver, cp_sizes=tuple(config.sizes),
                        cost_model=cost)
