"""Baseline 2: Megatron-LM's ``default_dynamic_cp`` greedy over whole datasets.

The greedy's rules, and where we had to deviate from or guess at Megatron's code, are in
planner/solver/megatron.py (the planner scores it as a candidate for every step); this module
plans whole datasets with it for the quality bench. VPP (``align_sample_id_groups``) is not
modelled: vpp > 1 raises ValueError.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numpy.typing import NDArray

from bench.baseline_common import BaselineRun, GroupRows, run_baseline
from planner.config import PlannerConfig
from planner.solver.megatron import (
    SOLVER_NAME,
    WORK_CAP_DELTA,
    megatron_groups,
    megatron_padded,
)

__all__ = ["SOLVER_NAME", "WORK_CAP_DELTA", "megatron_padded", "megatron_plan", "megatron_step"]


def megatron_step(samples: NDArray[np.int64], lengths: NDArray[np.int64], *, pool_size: int,
                  capacity: int, tp_eff: int, sizes: tuple[int, ...]) -> list[list[GroupRows]]:
    """One step under Megatron's ``default_dynamic_cp`` rules (planner/solver/megatron.py)."""
    padded_arr = megatron_padded(lengths, pool_size, tp_eff)
    if padded_arr.size and int(padded_arr.max()) > pool_size * capacity:
        j = int(np.argmax(padded_arr))
        raise ValueError(f"sample {int(samples[j])} ({int(lengths[j])} tokens) pads to "
                         f"{int(padded_arr[j])} > N x C = {pool_size * capacity}: Megatron's "
                         f"scheduler cannot place it")
    padded = padded_arr.tolist()
    samples_l, lengths_l = samples.tolist(), lengths.tolist()
    out: list[list[GroupRows]] = []
    for groups in megatron_groups(padded_arr, pool_size=pool_size, capacity=capacity,
                                  sizes=sizes):
        out.append([GroupRows(rank_start=start, cp_size=k, samples=[samples_l[j] for j in seqs],
                              num_tokens=[lengths_l[j] for j in seqs],
                              padded=[padded[j] for j in seqs]) for start, k, seqs in groups])
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
