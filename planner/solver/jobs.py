"""Step jobs: every step's segments, and the planning of a contiguous step range, which is what
every engine's worker runs (``parallel``: a process of ``--workers``; ``ray_engine``: a Ray task).

Each step is a pure function of its segments and the solver parameters, so a range planned
anywhere gives the same steps as in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from planner.solver.greedy import PackingParams, StepAssignment, assign_step
from planner.solver.step import run_tables

CHUNKS_PER_WORKER = 4
"""Step ranges per worker (several, so a range of heavy steps does not leave the others idle)."""


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


def plan_each(jobs: StepJobs, params: PackingParams) -> Iterator[StepAssignment]:
    """Every step of ``jobs``, in order, each as it is made; the tables of their lengths are
    built once for all of them (step.run_tables)."""
    if not jobs.num_steps:
        return
    run = run_tables(jobs.tokens, params)
    for j in range(jobs.num_steps):
        a, b = int(jobs.bounds[j]), int(jobs.bounds[j + 1])
        yield assign_step(jobs.sample[a:b], jobs.offset[a:b], jobs.tokens[a:b], params, run)


def plan_chunk(args: tuple[StepJobs, PackingParams]) -> list[StepAssignment]:
    """Every step of a chunk, in order (one argument: what ``Pool.imap`` passes)."""
    return list(plan_each(*args))


def plan_range(jobs: StepJobs, params: PackingParams, first: int, last: int
               ) -> list[StepAssignment]:
    """Steps first..last-1 of ``jobs``, in order (what one worker or one Ray task does)."""
    return plan_chunk((jobs.chunk(first, last), params))
