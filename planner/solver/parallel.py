"""Plan a list of steps, in this process or in worker processes; the result is the same either way.

Each step is a pure function of its segments and the solver parameters (greedy.assign_step; the
CP-SAT refinement is bounded by deterministic time with a fixed seed and one search worker), so
splitting the steps among processes cannot change any step. Steps go out in contiguous chunks
(several per worker, so a chunk of heavy steps does not leave the other workers idle) and come
back in order, so the plan, and the file written from it, are byte-identical for every number of
workers.

Workers are started with ``spawn``: a fresh interpreter that imports the planner and loads the
numba kernels from their on-disk cache. That costs about a second per worker, so ``workers`` > 1
pays off only for plans of many steps; below ``MIN_STEPS_PER_WORKER`` steps per worker the plan is
made in this process.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from planner.solver.greedy import PackingParams, StepAssignment, assign_step

CHUNKS_PER_WORKER = 4
MIN_STEPS_PER_WORKER = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class StepJobs:
    """Every step's segments, as one array per column and the step boundaries into them."""

    sample: NDArray[np.int64]
    offset: NDArray[np.int64]
    tokens: NDArray[np.int64]
    bounds: NDArray[np.int64]
    """Step j holds segments bounds[j]:bounds[j+1]."""

    @property
    def num_steps(self) -> int:
        return len(self.bounds) - 1

    def chunk(self, first: int, last: int) -> StepJobs:
        """Steps first..last-1, with bounds rebased to the chunk."""
        a, b = int(self.bounds[first]), int(self.bounds[last])
        return StepJobs(sample=self.sample[a:b], offset=self.offset[a:b],
                        tokens=self.tokens[a:b], bounds=self.bounds[first:last + 1] - a)


def _plan_chunk(args: tuple[StepJobs, PackingParams]) -> list[StepAssignment]:
    jobs, params = args
    out = []
    for j in range(jobs.num_steps):
        a, b = int(jobs.bounds[j]), int(jobs.bounds[j + 1])
        out.append(assign_step(jobs.sample[a:b], jobs.offset[a:b], jobs.tokens[a:b], params))
    return out


def plan_steps(jobs: StepJobs, params: PackingParams, workers: int = 1,
               progress: Callable[[int], None] | None = None) -> Iterator[StepAssignment]:
    """Every step's assignment, in step order, as it is made; ``progress(steps_done)`` after
    each step (one process) or chunk (workers). A generator: the caller can write each step
    before the next is planned."""
    n = jobs.num_steps
    workers = min(workers, max(1, n // MIN_STEPS_PER_WORKER))
    if workers <= 1:
        for j in range(n):
            yield from _plan_chunk((jobs.chunk(j, j + 1), params))
            if progress is not None:
                progress(j + 1)
        return
    edges = np.linspace(0, n, workers * CHUNKS_PER_WORKER + 1).round().astype(np.int64)
    chunks = [(jobs.chunk(int(a), int(b)), params)
              for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    done = 0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        # imap keeps the chunks' order, whatever order the workers finish them in.
        for part in pool.imap(_plan_chunk, chunks):
            yield from part
            done += len(part)
            if progress is not None:
                progress(done)
