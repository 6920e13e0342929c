"""What the baselines share: the same global batches as ours, row assembly and the plan header.

Fairness rule: a baseline schedules exactly the global batches that ``planner.plan.make_plan``
draws (``planner.solver.batches.draw_global_batches`` over the same eligible samples, seed and
epochs),
so step i of a baseline and step i of our plan hold the same samples and per-step times compare
like for like. A baseline only decides, per step, the microbatches, the groups and the padding.

A baseline's step function returns ``list[list[GroupRows]]``: per microbatch, its groups sorted
by ``rank_start``, each with its sequences in packing order. ``step_columns`` turns that into the
8 plan columns; ``run_baseline`` drives a step function over every epoch and times only the
scheduling (what Megatron runs online), not the row assembly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.plan import Plan, apply_long_policy
from planner.planfile.schema import (
    COLUMN_NAMES,
    DatasetInfo,
    ParallelInfo,
    PlanHeader,
    fingerprint_lengths,
)
from planner.solver.batches import draw_global_batches


@dataclass(slots=True)
class GroupRows:
    """One CP group of one microbatch while a baseline builds it (mutable on purpose)."""

    rank_start: int
    cp_size: int
    samples: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    padded: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineRun:
    """A baseline's plan and the seconds its scheduler took (row assembly excluded)."""

    plan: Plan
    scheduling_seconds: float
    num_sequences: int


StepFn = Callable[[NDArray[np.int64], NDArray[np.int64]], list[list[GroupRows]]]
"""(sample indices of the step in drawn order, their lengths) -> microbatches of groups."""


def lengths_of(table: Any) -> tuple[NDArray[np.int64], str, str, int]:
    """(lengths, path, format, skipped count) of a ``LengthTable`` or a plain length array."""
    if hasattr(table, "lengths"):
        return (np.asarray(table.lengths, dtype=np.int64), str(table.path), str(table.format),
                int(len(table.skipped)))
    return np.asarray(table, dtype=np.int64), "memory", "array", 0


Batches = list[list[NDArray[np.int64]]]


def draw_epochs(lengths: NDArray[np.int64], config: PlannerConfig
                ) -> tuple[Batches, list[NDArray[np.int64]], NDArray[np.int64]]:
    """Our planner's global batches: (per epoch the batches, per epoch the undrawn, dropped).

    Baselines cannot split or truncate a sample, so only the ``error`` and ``drop`` policies are
    accepted; with them the eligible set is exactly the one ``make_plan`` uses.
    """
    if config.long_sequences not in ("error", "drop"):
        raise ValueError(f"baselines support long_sequences error or drop, not "
                         f"{config.long_sequences!r} (they cannot split or truncate a sample)")
    policy = apply_long_policy(lengths, config)
    eligible = policy.tokens > 0
    batches, undrawn = [], []
    for e in range(config.epochs):
        b, u = draw_global_batches(policy.tokens, eligible, seed=config.seed, epoch=e,
                                   global_batch_size=config.global_batch_size,
                                   global_batch_tokens=config.global_batch_tokens,
                                   drop_last=config.drop_last)
        batches.append(b)
        undrawn.append(u)
    return batches, undrawn, policy.dropped


def step_columns(step: int, microbatches: list[list[GroupRows]]) -> dict[str, NDArray[Any]]:
    """The 8 plan columns of one step, rows sorted by (microbatch, rank_start, packing order)."""
    mb: list[int] = []
    start: list[int] = []
    size: list[int] = []
    sample: list[int] = []
    ntok: list[int] = []
    padded: list[int] = []
    for m, groups in enumerate(microbatches):
        for g in groups:
            n = len(g.samples)
            mb += [m] * n
            start += [g.rank_start] * n
            size += [g.cp_size] * n
            sample += g.samples
            ntok += g.num_tokens
            padded += g.padded
    cols: dict[str, NDArray[Any]] = {
        "step": np.full(len(mb), step, dtype=np.int32),
        "microbatch": np.asarray(mb, dtype=np.int32),
        "rank_start": np.asarray(start, dtype=np.int32),
        "cp_size": np.asarray(size, dtype=np.int32),
        "sample_index": np.asarray(sample, dtype=np.int64),
        "token_offset": np.zeros(len(mb), dtype=np.int64),
        "num_tokens": np.asarray(ntok, dtype=np.int32),
        "padded_tokens": np.asarray(padded, dtype=np.int32),
    }
    assert tuple(cols) == COLUMN_NAMES
    return cols


def run_baseline(table: Any, config: PlannerConfig, step_fn: StepFn, *, solver: dict[str, Any],
                 cp_sizes: tuple[int, ...], cp: int | None = None,
                 cost_model: dict[str, Any] | None = None) -> BaselineRun:
    """Schedule every step of every epoch with ``step_fn`` and wrap the rows as a ``Plan``.

    Args:
        table: a ``LengthTable`` or a length array (file order).
        config: the planner configuration ours runs with (batches, seed, epochs, C, layout).
        step_fn: the baseline's per-step scheduler.
        solver: the header's ``solver`` entry (name and settings).
        cp_sizes: the group sizes the baseline may use (header ``cp_sizes``).
        cp: the static CP size to record in the header's ``parallel`` (default: config's).
        cost_model: the header's ``cost_model`` entry (what the baseline balances, if anything).
    """
    lengths, path, fmt, skipped = lengths_of(table)
    draws, undrawn, dropped = draw_epochs(lengths, config)
    steps: list[dict[str, NDArray[Any]]] = []
    epochs: list[tuple[int, int]] = []
    seconds = 0.0
    num_sequences = 0
    microbatches_per_step: list[int] = []
    for batches in draws:
        epochs.append((len(steps), len(batches)))
        for b in batches:
            t0 = time.perf_counter()
            mbs = step_fn(b, lengths[b])
            seconds += time.perf_counter() - t0
            num_sequences += len(b)
            microbatches_per_step.append(len(mbs))
            steps.append(step_columns(len(steps), mbs))
    p = config.parallel
    static_cp = p.cp if cp is None else cp
    stats: dict[str, Any] = {
        "dropped_samples": dropped.tolist(),
        "truncated_samples": [],
        "skipped_bad_records": skipped,
        "num_steps": len(steps),
        "num_microbatches": int(sum(microbatches_per_step)),
    }
    if config.drop_last:
        stats["undrawn_samples"] = [np.sort(u).tolist() for u in undrawn]
    header = PlanHeader(
        dataset=DatasetInfo(path=path, num_samples=len(lengths),
                            num_tokens=int(lengths[lengths > 0].sum()),
                            fingerprint=fingerprint_lengths(lengths), format=fmt),
        parallel=ParallelInfo(dp=p.pool_size // static_cp, cp=static_cp, tp=p.tp, pp=p.pp,
                              vpp=p.vpp, sequence_parallel=p.sequence_parallel,
                              pool_size=p.pool_size, microbatch_group_size=p.group_size),
        capacity_tokens_per_rank=config.capacity_tokens_per_rank,
        cp_sizes=tuple(int(k) for k in cp_sizes),
        layout=config.layout,
        global_batch={"size": config.global_batch_size, "tokens": config.global_batch_tokens,
                      "drop_last": config.drop_last},
        seed=config.seed,
        cost_model=cost_model or {"name": "none", "parameters": {}},
        stats=stats,
        epochs=tuple(epochs),
        solver=solver,
    )
    return BaselineRun(plan=Plan(header=header, steps=steps), scheduling_seconds=seconds,
                       num_sequences=num_sequences)
