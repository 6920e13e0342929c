"""Lengths -> plan: long-sequence policy, global batches, per-step greedy assignment, header stats.

Pure: no I/O, no clock, no randomness beyond the seeded permutation, so the same lengths, config
and cost model give the same arrays and (through io.write_plan) a byte-identical file.

Flow per epoch: ``draw_global_batches`` (eligible samples in permutation order) -> each batch's
samples become segments (one per sample; several for a sample the ``split`` policy cuts) ->
``greedy.assign_step`` per step (``parallel.plan_steps``: in ``workers`` processes or as Ray
tasks, same result) -> the step's rows. A step may reorder its own samples, never another's.
An eval plan (``config.kind == "eval"``) is one pass in file order (``eval_global_batches``),
planned with the cost model's forward-only cost (``CostModel.forward_only``).
The long-sequence policy (``error``, ``split``, ``truncate``, ``drop``) is ``planner.longseq``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from planner.config import PlannerConfig
from planner.cost import CostModel
from planner.longseq import (
    MAX_SEGMENTS_PER_SAMPLE,
    LongPolicyResult,
    apply_long_policy,
    segment_capacity,
    segments,
)
from planner.planfile.schema import (
    COLUMN_NAMES,
    EVAL,
    DatasetInfo,
    ParallelInfo,
    PlanHeader,
    arrow_schema,
    fingerprint_lengths,
    step_batch,
)
from planner.planfile.stats import StatsAccumulator
from planner.solver.batches import (
    draw_blended_batches,
    draw_global_batches,
    eval_global_batches,
)
from planner.solver.greedy import PackingParams
from planner.solver.jobs import StepJobs
from planner.solver.parallel import plan_steps
from planner.sources.content import content_fingerprint
from planner.sources.dataset import DataFile, blend_counts

__all__ = ["MAX_SEGMENTS_PER_SAMPLE", "WINDOW_SEGMENTS", "LongPolicyResult", "Plan",
           "PlanStream", "apply_long_policy", "dataset_files", "make_plan", "segment_capacity"]

if TYPE_CHECKING:
    from planner.sources.lengths import LengthTable


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A plan in memory: the header and, per step, the 8 plan columns as numpy arrays."""

    header: PlanHeader
    steps: list[dict[str, NDArray[Any]]]

    def record_batches(self) -> Iterator[pa.RecordBatch]:
        """Step i's record batch, for i in order (what io.write_plan and planfile.validate take)."""
        schema = arrow_schema(self.header)
        for cols in self.steps:
            yield step_batch(schema, cols)


WINDOW_SEGMENTS = 1 << 22
"""Segments a window of epochs gathers before its steps are planned (~100 MB of step jobs); an
epoch larger than that is a window of its own."""

def dataset_files(table: LengthTable) -> tuple[DataFile, ...]:
    """The table's files; a table built from arrays (no ``files``) is one file, its ``path``."""
    if table.files:
        return table.files
    lengths = np.asarray(table.lengths, dtype=np.int64)
    return (DataFile(path=str(table.path), format=str(table.format), num_samples=len(lengths),
                     num_tokens=int(lengths.sum()), fingerprint=fingerprint_lengths(lengths)),)


def _blend(files: tuple[DataFile, ...], config: PlannerConfig
           ) -> tuple[NDArray[np.int64], list[int]] | None:
    """(group sample bounds, samples per step of each group) of a blended config, else None."""
    if not config.blend:
        return None
    num_groups = max(f.group for f in files) + 1
    if len(config.blend) != num_groups:
        raise ValueError(f"blend has {len(config.blend)} weights for {num_groups} dataset "
                         "entries (one weight per entry)")
    sizes = np.zeros(num_groups, dtype=np.int64)
    for f in files:
        sizes[f.group] += f.num_samples
    groups = [f.group for f in files]
    if groups != sorted(groups):
        raise ValueError("blend groups must hold consecutive files")
    return np.r_[0, np.cumsum(sizes)].astype(np.int64), blend_counts(
        config.blend, config.global_batch_size)


class PlanStream:
    """A plan made step by step: iterate ``steps()`` once (each step's 8 columns, in order,
    planned when asked for), then ``header()`` (its stats need every step).

    Memory: the segments of every step (O(samples)) and the stats' running sums; no step's rows
    are kept after it is yielded, so a writer that spills each step holds one step at a time.
    """

    def __init__(self, table: LengthTable, config: PlannerConfig, cost: CostModel, *,
                 progress: Callable[[int, int], None] | None = None) -> None:
        lengths = np.asarray(table.lengths, dtype=np.int64)
        policy = apply_long_policy(lengths, config, source=str(table.path))
        if config.kind == EVAL:
            # No backward in an evaluation: plan (and score) it with the forward-only cost.
            cost = cost.forward_only()
        self.table, self.config, self.cost, self.policy = table, config, cost, policy
        self.lengths = lengths
        self.params = PackingParams.from_config(config, cost)
        eligible = policy.tokens > 0
        self.files = dataset_files(table)
        blend = _blend(self.files, config)
        if blend is not None and config.kind == EVAL:
            raise ValueError("an eval plan is one pass in file order: it takes no blend weights")
        self.blend = blend
        self.eligible = eligible
        self.blended: list[list[int]] = []
        self.undrawn: list[NDArray[np.int64]] = []
        self.epochs: list[tuple[int, int]] = []
        # Epoch 0 now: a dataset the global batch cannot cut into steps fails before any
        # work (every epoch draws the same eligible samples, so the same number of steps in
        # size mode, and none in tokens mode only when all of them hold fewer than T).
        self._first = self._draw(0)
        if not self._first:
            raise ValueError(
                f"{table.path}: the plan would have no steps: "
                f"{int(np.count_nonzero(eligible))} plannable samples and "
                + (f"a global batch of {config.global_batch_size} samples"
                   if config.global_batch_size
                   else f"a global batch of {config.global_batch_tokens} tokens")
                + (" with --drop-last" if config.drop_last else ""))
        self._estimate = len(self._first) * config.epochs
        self.progress = progress
        self.stats = StatsAccumulator(config, cost)
        self.sources: dict[str, int] = {}
        self._done = False

    def _draw(self, epoch: int) -> list[NDArray[np.int64]]:
        """Epoch ``epoch``'s global batches (its undrawn samples and blend counts recorded)."""
        config, tokens, eligible = self.config, self.policy.tokens, self.eligible
        if config.kind == EVAL:
            batches = eval_global_batches(tokens, eligible,
                                          global_batch_size=config.global_batch_size,
                                          global_batch_tokens=config.global_batch_tokens)
            undrawn = np.zeros(0, dtype=np.int64)
        elif self.blend is not None:
            bounds, counts = self.blend
            batches, drawn = draw_blended_batches(eligible, bounds, counts, seed=config.seed,
                                                  epoch=epoch)
            self.blended.append(drawn)
            undrawn = np.zeros(0, np.int64)
        else:
            batches, undrawn = draw_global_batches(
                tokens, eligible, seed=config.seed, epoch=epoch,
                global_batch_size=config.global_batch_size,
                global_batch_tokens=config.global_batch_tokens, drop_last=config.drop_last)
        self.undrawn.append(undrawn)
        return batches

    def _windows(self) -> Iterator[StepJobs]:
        """The step jobs, a few epochs at a time: each epoch's permutation is drawn only when
        the steps before it are planned, so memory does not grow with ``epochs`` (a window
        holds at least one epoch, and epochs while it holds fewer than ``WINDOW_SEGMENTS``)."""
        first, draws, size = 0, [], 0
        for e in range(self.config.epochs):
            batches = self._first if e == 0 else self._draw(e)
            self.epochs.append((first, len(batches)))
            first += len(batches)
            draws.append(batches)
            size += sum(len(b) for b in batches)
            if size >= WINDOW_SEGMENTS or e == self.config.epochs - 1:
                yield _step_jobs(draws, self.policy)
                draws, size = [], 0
        self._first = []

    @property
    def num_steps(self) -> int:
        """The plan's steps: exact once ``steps()`` is consumed, and before that whenever the
        batch is a number of samples; with ``global_batch_tokens``, epoch 0's count times the
        epochs until then (each epoch's permutation cuts its own)."""
        return sum(c for _, c in self.epochs) if self._done else self._estimate

    @property
    def jobs(self) -> StepJobs:
        """Every step's segments at once (O(epochs x samples): for benchmarks of one epoch)."""
        keep = (self.undrawn, self.blended, self.epochs, self._first)
        self.undrawn, self.blended, self.epochs = [], [], []
        self._first = self._draw(0)
        try:
            parts = list(self._windows())
        finally:
            self.undrawn, self.blended, self.epochs, self._first = keep
        return parts[0] if len(parts) == 1 else _concat_jobs(parts)

    def steps(self) -> Iterator[dict[str, NDArray[Any]]]:
        """Each step's columns, planned on demand (``parallel.plan_steps``), epochs drawn as
        the steps stream (``_windows``); Ray, if it plans, is started once for every window."""
        progress = self.progress
        done = 0
        with _engine(self.config):
            for jobs in self._windows():
                base = done
                total = max(self._estimate, base + jobs.num_steps)
                report = None if progress is None else (
                    lambda d, base=base, total=total: progress(base + d, total))
                for j, out in enumerate(plan_steps(
                        jobs, self.params, self.config.workers, report,
                        engine=self.config.engine, ray_address=self.config.ray_address)):
                    self.sources[out.source] = self.sources.get(out.source, 0) + 1
                    cols: dict[str, NDArray[Any]] = {
                        "step": np.full(len(out.microbatch), base + j, dtype=np.int32),
                        "microbatch": out.microbatch, "rank_start": out.rank_start,
                        "cp_size": out.cp_size, "sample_index": out.sample_index,
                        "token_offset": out.token_offset, "num_tokens": out.num_tokens,
                        "padded_tokens": out.padded_tokens,
                    }
                    assert tuple(cols) == COLUMN_NAMES
                    self.stats.add(cols, jobs.tokens[jobs.bounds[j]:jobs.bounds[j + 1]],
                                   out.bound_seconds, out.simulated_seconds,
                                   (out.static_seconds, out.megatron_seconds), out.terms)
                    yield cols
                done = base + jobs.num_steps
        self._done = True

    def header(self) -> PlanHeader:
        """The plan header, once ``steps()`` has been consumed."""
        if not self._done:
            raise RuntimeError("PlanStream.header() needs every step: consume steps() first")
        config, policy, lengths, table = self.config, self.policy, self.lengths, self.table
        stats = self.stats.result()
        stats.update({
            "dropped_samples": policy.dropped.tolist(),
            "truncated_samples": policy.truncated,
            "split_samples": np.flatnonzero(policy.split).tolist(),
            "skipped_bad_records": int(len(table.skipped)),
            # Steps whose rows came from each candidate (solver/candidates.py), sorted by name.
            "candidate_steps": dict(sorted(self.sources.items())),
        })
        if config.max_segment_tokens:
            # Only with a memory cap: plans without one keep their bytes.
            stats["max_segment_tokens"] = config.max_segment_tokens
            stats["split_for_memory"] = policy.split_for_memory.tolist()
        if config.drop_last and self.blend is None:
            stats["undrawn_samples"] = [np.sort(u).tolist() for u in self.undrawn]
        global_batch: dict[str, Any] = {"size": config.global_batch_size,
                                        "tokens": config.global_batch_tokens,
                                        "drop_last": config.drop_last}
        if self.blend is not None:
            global_batch["blend"] = {"weights": list(config.blend),
                                     "samples_per_step": self.blend[1],
                                     "drawn_per_epoch": list(self.blended)}
        p = config.parallel
        return PlanHeader(
            dataset=DatasetInfo(path=str(table.path), num_samples=len(lengths),
                                num_tokens=int(lengths[lengths > 0].sum()),
                                fingerprint=fingerprint_lengths(lengths),
                                format=str(table.format),
                                files=[f.to_dict() for f in self.files],
                                content_fingerprint=content_fingerprint(self.files),
                                field=table.field or "",
                                tokenizer=dict(table.tokenizer or {}),
                                megatron_unit=table.megatron_unit),
            parallel=ParallelInfo(dp=p.dp, cp=p.cp, tp=p.tp, pp=p.pp, vpp=p.vpp,
                                  sequence_parallel=p.sequence_parallel, pool_size=p.pool_size,
                                  microbatch_group_size=p.group_size),
            capacity_tokens_per_rank=config.capacity_tokens_per_rank,
            cp_sizes=tuple(int(k) for k in config.sizes),
            layout=config.layout,
            global_batch=global_batch,
            seed=config.seed,
            cost_model=self.cost.to_header(),
            stats=stats,
            epochs=tuple(self.epochs),
            solver=self.params.header(),
            pad_to_multiple=config.pad_to_multiple,
            kind=config.kind,
        )


def _step_jobs(draws: list[list[NDArray[np.int64]]], policy: LongPolicyResult) -> StepJobs:
    """The segments of the steps of ``draws`` (epochs' batches, in order)."""
    parts: list[tuple[NDArray[np.int64], ...]] = []
    for batches in draws:
        if not batches:
            continue
        sample, offset, tokens, count = segments(np.concatenate(batches), policy)
        per_step = np.add.reduceat(count, np.cumsum([0] + [len(b) for b in batches[:-1]]))
        parts.append((sample, offset, tokens, per_step))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return StepJobs(sample=empty, offset=empty, tokens=empty, bounds=np.zeros(1, np.int64))
    if len(parts) == 1:
        # One epoch: no concatenation (at 20M samples a copy would add ~0.5 GB to the peak).
        sample, offset, tokens, per_step = parts[0]
        return StepJobs(sample=sample, offset=offset, tokens=tokens,
                        bounds=np.r_[0, np.cumsum(per_step)])
    return StepJobs(sample=np.concatenate([q[0] for q in parts]),
                    offset=np.concatenate([q[1] for q in parts]),
                    tokens=np.concatenate([q[2] for q in parts]),
                    bounds=np.r_[0, np.cumsum(np.concatenate([q[3] for q in parts]))])


def _concat_jobs(parts: list[StepJobs]) -> StepJobs:
    offsets = np.cumsum([0] + [int(p.bounds[-1]) for p in parts[:-1]])
    return StepJobs(sample=np.concatenate([p.sample for p in parts]),
                    offset=np.concatenate([p.offset for p in parts]),
                    tokens=np.concatenate([p.tokens for p in parts]),
                    bounds=np.concatenate([parts[0].bounds[:1]] + [
                        p.bounds[1:] + o for p, o in zip(parts, offsets, strict=True)]))


@contextmanager
def _engine(config: PlannerConfig) -> Iterator[None]:
    """One Ray for every window of steps (``ray_engine.connected``; a second window finds it
    running and uses it), none for the local engine."""
    if config.engine != "ray":
        yield
        return
    from planner.solver.ray_engine import connected

    with connected(config.workers, config.ray_address):
        yield


def make_plan(table: LengthTable, config: PlannerConfig, cost: CostModel, *,
              progress: Callable[[int, int], None] | None = None) -> Plan:
    """Plan every epoch of ``table`` under ``config``; each plan passes ``planfile.validate``.

    Holds every step in memory; ``PlanStream`` with ``planfile.io.write_plan_stream`` writes
    a plan of any length in memory independent of its number of steps.

    Args:
        table: sample lengths in file order (0 for skipped bad records, listed in ``skipped``).
        config: the planner configuration.
        cost: the cost model that guides the assignment and scores the plan.
        progress: called as ``progress(steps_done, steps_total)`` after each step.

    Returns:
        The plan: header (with stats) and per-step columns.

    Raises:
        ValueError: a sample no group holds under ``long_sequences="error"``, or a capacity no
            segment can use.
    """
    stream = PlanStream(table, config, cost, progress=progress)
    steps = list(stream.steps())
    return Plan(header=stream.header(), steps=steps)
