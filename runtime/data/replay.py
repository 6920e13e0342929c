"""Replay a plan on one rank: step -> this rank's microbatches, with their CP groups.

Every rank opens the same plan and the same dataset, finds its pool rank's group in each
microbatch and reads only that group's samples; there is no all-gather or reroute of samples and
nothing is re-planned (the plan header is the only source of the parallel layout). All pool ranks
get the same number of microbatches per step because the plan gives every rank a group in every
microbatch. TP ranks of one pool rank build identical inputs; pipeline stages build only what
they consume (``runtime.data.batch``).

Example: pool of 4, step 0 microbatch 0 holds groups (0, 2) and (2, 2): pool rank 3 gets the
inputs of group (2, 2) at ``cp_rank`` 1, ``cp_group = catalog.cp_group(2, 2)`` and
``cp_global_ranks`` the global ranks of pool ranks 2 and 3 in its tp/pp slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.data.batch import MicrobatchInputs, build_microbatch
from runtime.data.plan_reader import GroupRows, PlanReader, StepPlan
from runtime.data.tokens import TokenSource
from runtime.dist.topology import Topology

if TYPE_CHECKING:
    import torch.distributed as dist

    from runtime.dist.groups import GroupCatalog


@dataclass(frozen=True, slots=True)
class Microbatch:
    """One microbatch as this rank runs it."""

    inputs: MicrobatchInputs
    cp_group: dist.ProcessGroup | None
    """The group's process group (None with cp_size 1, or when no catalog was given)."""
    cp_global_ranks: tuple[int, ...]
    """Global ranks of the group in this rank's tp/pp slice, in CP order."""
    rows: GroupRows
    """The plan rows behind ``inputs`` (which samples this rank trains on, for logs and tests)."""


class Replayer:
    """Turns plan steps into this rank's ``Microbatch`` lists.

    Args:
        reader: the opened plan.
        source: the plan's dataset.
        topology: this rank's place in the job; checked against the plan header.
        catalog: process groups made with ``GroupCatalog.create``; None leaves ``cp_group``
            unset (data-only use: tests, benchmarks, dry runs).
        check_dataset: compare the dataset's length fingerprint with the plan's (hashes the
            lengths once: about 1 s per 100M samples).

    Raises:
        ValueError: the job or the dataset is not the one the plan was built for.
    """

    def __init__(self, reader: PlanReader, source: TokenSource, topology: Topology,
                 catalog: GroupCatalog | None = None, *, check_dataset: bool = True) -> None:
        reader.check_job(topology)
        if check_dataset:
            reader.check_dataset(source.lengths())
        self.reader = reader
        self.source = source
        self.topology = topology
        self.catalog = catalog
        self.pool_rank = topology.pool_rank
        self.is_first_stage = topology.pp_rank == 0
        self.is_last_stage = topology.pp_rank == topology.pp - 1

    @property
    def num_steps(self) -> int:
        return self.reader.num_steps

    def _global_ranks(self, rank_start: int, cp_size: int) -> tuple[int, ...]:
        if self.catalog is not None:
            return tuple(self.catalog.cp_global_ranks(rank_start, cp_size))
        t = self.topology
        return tuple(t.global_rank(p, t.tp_rank, t.pp_rank)
                     for p in range(rank_start, rank_start + cp_size))

    def microbatches(self, step: int) -> list[Microbatch]:
        """This rank's microbatches of ``step``, in the order they must run."""
        plan = self.reader.step(step)
        return [self.microbatch(plan, m) for m in range(plan.num_microbatches)]

    def microbatch(self, plan: StepPlan, m: int) -> Microbatch:
        """This rank's microbatch ``m`` of a step (``reader.step(i)``), for lazy iteration."""
        rows = plan.group_for(m, self.pool_rank)
        inputs = build_microbatch(rows, self.source, layout=self.reader.layout,
                                  is_first_stage=self.is_first_stage,
                                  is_last_stage=self.is_last_stage)
        group = None
        if self.catalog is not None and rows.cp_size > 1:
            group = self.catalog.cp_group(rows.rank_start, rows.cp_size)
        ranks = self._global_ranks(rows.rank_start, rows.cp_size)
        return Microbatch(inputs=inputs, cp_group=group, cp_global_ranks=ranks, rows=rows)

    def steps(self, start: int = 0) -> Iterator[tuple[int, list[Microbatch]]]:
        """``(step, microbatches)`` from ``start`` (a resumed run) to the end of the plan."""
        if not 0 <= start <= self.num_steps:
            raise ValueError(f"start step {start} out of range 0..{self.num_steps}")
        for i in range(start, self.num_steps):
            yield i, self.microbatches(i)
