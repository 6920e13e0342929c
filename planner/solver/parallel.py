"""Plan a list of steps, in this process or in worker processes; the result is the same either way.

Each step is a pure function of its segments and the solver parameters (greedy.assign_step; the
CP-SAT refinement is bounded by deterministic time with a fixed seed and one search worker), so
splitting the steps among processes cannot change any step. Steps go out in contiguous chunks
(several per worker, so a chunk of heavy steps does not leave the other workers idle) and come
back in order, so the plan, and the file written from it, are byte-identical for every number of
workers.

Two engines share this fan-out (``config.ENGINES``): ``local`` (this machine: ``workers``
spawned processes) and ``ray`` (``ray_engine``: the same step ranges as Ray tasks, on a local Ray
or a cluster). Both plan a range with ``jobs.plan_range`` and hand the steps back in order.

Local workers are started with ``spawn``: a fresh interpreter that imports the planner and loads
the numba kernels from their on-disk cache. That costs about a second per worker, so ``workers`` >
1 pays off only for plans of many steps; below ``MIN_STEPS_PER_WORKER`` steps per worker the plan
is made in this process.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator

import numpy as np

from planner.config import ENGINES
from planner.solver.greedy import PackingParams, StepAssignment
from planner.solver.jobs import CHUNKS_PER_WORKER, StepJobs, plan_chunk, plan_each

MIN_STEPS_PER_WORKER = 8


def plan_steps(jobs: StepJobs, params: PackingParams, workers: int = 1,
               progress: Callable[[int], None] | None = None, *, engine: str = "local",
               ray_address: str = "") -> Iterator[StepAssignment]:
    """Every step's assignment, in step order, as it is made; ``progress(steps_done)`` after
    each step (one process) or chunk (workers, Ray tasks). A generator: the caller can write
    each step before the next is planned.

    ``engine="ray"`` plans the ranges as Ray tasks (``ray_engine.plan_steps_ray``): on the
    cluster at ``ray_address``, else a local Ray of ``workers`` CPUs (0: every CPU here).
    """
    if engine == "ray":
        from planner.solver.ray_engine import plan_steps_ray

        yield from plan_steps_ray(jobs, params, workers, progress, address=ray_address)
        return
    if engine != "local":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    n = jobs.num_steps
    workers = min(workers, max(1, n // MIN_STEPS_PER_WORKER))
    if workers <= 1:
        for j, out in enumerate(plan_each(jobs, params)):
            yield out
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
        for part in pool.imap(plan_chunk, chunks):
            yield from part
            done += len(part)
            if progress is not None:
                progress(done)
