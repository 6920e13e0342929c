"""Baseline 1: static context parallelism with next-fit packing (Megatron's ``dp_balanced``).

The packing rules live in planner/solver/static_cp.py (the planner scores them as a candidate
for every step); this module plans whole datasets with them for the quality bench.

The rules (written from the behaviour of Megatron-LM's ``DpBalancedScheduler``, not from its
code) are listed in that module's docstring.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numpy.typing import NDArray

from bench.baseline_common import BaselineRun, GroupRows, lengths_of, run_baseline
from planner.config import PlannerConfig
from planner.groups import pad_multiple, valid_cp_sizes
from planner.solver.static_cp import padded_lengths, static_bins

SOLVER_NAME = "static-cp-nextfit"


class StaticCPInfeasible(ValueError):
    """A sample does not fit cp x C after padding; ``smallest_cp`` is the least size that would."""

    def __init__(self, cp: int, sample: int, length: int, capacity: int, smallest_cp: int | None):
        self.cp = cp
        self.sample = sample
        self.length = length
        self.smallest_cp = smallest_cp
        need = f"needs static cp >= {smallest_cp}" if smallest_cp else "fits no static cp"
        super().__init__(f"static cp={cp}: sample {sample} ({length} tokens) does not fit "
                         f"{cp} x {capacity} tokens after padding; {need}")


def smallest_static_cp(lengths: NDArray[np.int64], pool_size: int, capacity: int, tp_eff: int,
                       layout: str) -> int | None:
    """Least valid size k whose groups hold every sample after padding, or None."""
    longest = int(np.max(lengths)) if len(lengths) else 0
    for k in valid_cp_sizes(pool_size):
        if int(padded_lengths(np.array([longest]), k, tp_eff, layout)[0]) <= k * capacity:
            return k
    return None


def static_step(samples: NDArray[np.int64], lengths: NDArray[np.int64], *, pool_size: int,
                cp: int, capacity: int, tp_eff: int, layout: str,
                microbatch_multiple: int = 1) -> list[list[GroupRows]]:
    """One step under static CP ``cp``: next-fit bins dealt to the N/cp groups of each microbatch.

    Raises:
        StaticCPInfeasible: a sample of the step does not fit cp x C after padding.
    """
    padded = padded_lengths(lengths, cp, tp_eff, layout)
    over = np.flatnonzero(padded > cp * capacity)
    if over.size:
        j = int(over[0])
        raise StaticCPInfeasible(cp, int(samples[j]), int(lengths[j]), capacity,
                                 smallest_static_cp(lengths, pool_size, capacity, tp_eff, layout))
    num_groups = pool_size // cp
    bins, num_mb = static_bins(padded, pool_size=pool_size, cp=cp, capacity=capacity,
                               microbatch_multiple=microbatch_multiple)
    filler = pad_multiple(cp, tp_eff, layout)
    samples_l, lengths_l, padded_l = samples.tolist(), lengths.tolist(), padded.tolist()
    out: list[list[GroupRows]] = []
    for m in range(num_mb):
        groups = []
        for j in range(num_groups):
            g = GroupRows(rank_start=j * cp, cp_size=cp)
            b = m * num_groups + j
            if b < len(bins):
                g.samples = [samples_l[i] for i in bins[b]]
                g.num_tokens = [lengths_l[i] for i in bins[b]]
                g.padded = [padded_l[i] for i in bins[b]]
            else:
                # An empty group still runs the microbatch (PP, collectives): one padding-only
                # filler row of the smallest buffer the layout allows.
                g.samples, g.num_tokens, g.padded = [-1], [0], [filler]
            groups.append(g)
        out.append(groups)
    return out


def static_cp_plan(table: object, config: PlannerConfig, *, cp: int | None = None) -> BaselineRun:
    """Plan ``table`` with static CP ``cp`` (default: the config's cp) over our global batches.

    Raises:
        StaticCPInfeasible: some sample does not fit cp x C (checked over the whole dataset
            first, so the error names the smallest static cp that fits everything).
        ValueError: ``cp`` is not a valid size for the pool.
    """
    p = config.parallel
    cp = p.cp if cp is None else cp
    if cp not in valid_cp_sizes(p.pool_size):
        raise ValueError(f"static cp {cp} is not a valid group size for a pool of {p.pool_size} "
                         f"(valid: {valid_cp_sizes(p.pool_size)})")
    lengths = lengths_of(table)[0]
    live = lengths[lengths > 0]
    padded = padded_lengths(live, cp, p.tp_eff, config.layout)
    cap = config.capacity_tokens_per_rank
    # With "error" every live sample is drawn, so check them all up front and name the smallest
    # static cp that fits the whole dataset; with "drop" static_step checks each step.
    if config.long_sequences == "error" and live.size and padded.max() > cp * cap:
        j = int(np.argmax(padded))
        sample = int(np.flatnonzero(lengths > 0)[j])
        raise StaticCPInfeasible(cp, sample, int(live[j]), cap, smallest_static_cp(
            live, p.pool_size, cap, p.tp_eff, config.layout))
    step_fn = partial(static_step, pool_size=p.pool_size, cp=cp,
                      capacity=config.capacity_tokens_per_rank, tp_eff=p.tp_eff,
                      layout=config.layout, microbatch_multiple=p.microbatch_multiple)
    solver = {"name": SOLVER_NAME, "static_cp": cp, "order": "drawn", "packing": "next-fit"}
    return run_baseline(table, config, step_fn, solver=solver, cp_sizes=(cp,), cp=cp)
