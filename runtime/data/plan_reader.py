"""Read a plan on every rank: O(1) step access, job and dataset checks, one rank's group rows.

The plan file is memory-mapped (``planner.planfile.io.PlanFile``); ``step(i)`` touches only record
batch i,
so a resumed run starts at any step without reading the ones before. The runtime takes the
parallel layout *from the plan header* and only checks the live job against it: there is no
second source of truth and nothing here re-plans.

Validation on load (``validate=True``, the default) runs ``planner.planfile.validate.validate``
over every
step on every rank: vectorised numpy per step, measured at 0.11-0.15 s of CPU for a 300K-row plan
(293 steps of ~1K rows), so about 0.5 s per million rows, plus reading the whole file once from
the page cache. Pass ``validate=False`` for plans of tens of millions of rows that were validated
when written (``dcp-plan`` validates before it renames the file into place). ``step(i)`` itself
costs about 0.3 ms for a 1K-row step.

Example: a step whose microbatch 0 has groups (rank_start 0, cp_size 2) and (2, 2) gives pool
rank 3 the rows of group (2, 2) with ``cp_rank == 1``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from planner.planfile.io import PlanFile
from planner.planfile.schema import (
    COLUMN_NAMES,
    TRAIN_COMMAND,
    PlanHeader,
    column_numpy,
    fingerprint_lengths,
)
from planner.planfile.validate import validate as validate_plan

if TYPE_CHECKING:
    from runtime.dist.topology import Topology


@dataclass(frozen=True, slots=True)
class GroupRows:
    """The rows of one CP group in one microbatch, seen from one pool rank, in packing order."""

    microbatch: int
    rank_start: int
    cp_size: int
    cp_rank: int
    """This pool rank's index in the group: ``pool_rank - rank_start``."""
    sample_index: NDArray[np.int64]
    """Dataset rows; -1 marks a padding-only filler."""
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int64]
    padded_tokens: NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's rows as numpy columns (sorted by microbatch, rank_start, packing order).

    ``group_first`` holds the first row of every group and one past the last row at the end;
    ``group_microbatch``, ``group_rank_start`` and ``group_cp_size`` describe each group.
    """

    step: int
    pool_size: int
    num_microbatches: int
    microbatch: NDArray[np.int32]
    rank_start: NDArray[np.int32]
    cp_size: NDArray[np.int32]
    sample_index: NDArray[np.int64]
    token_offset: NDArray[np.int64]
    num_tokens: NDArray[np.int32]
    padded_tokens: NDArray[np.int32]
    group_first: NDArray[np.int64]
    group_microbatch: NDArray[np.int64]
    group_rank_start: NDArray[np.int64]
    group_cp_size: NDArray[np.int64]

    @classmethod
    def from_columns(cls, step: int, pool_size: int, cols: dict[str, NDArray[np.generic]]
                     ) -> StepPlan:
        """Build from a step's columns; groups are the runs of equal (microbatch, rank_start)."""
        mb = cols["microbatch"].astype(np.int64)
        start = cols["rank_start"].astype(np.int64)
        key = mb * (pool_size + 1) + start
        first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, int)
        return cls(
            step=step,
            pool_size=pool_size,
            num_microbatches=int(mb.max()) + 1 if mb.size else 0,
            microbatch=cols["microbatch"].astype(np.int32, copy=False),
            rank_start=cols["rank_start"].astype(np.int32, copy=False),
            cp_size=cols["cp_size"].astype(np.int32, copy=False),
            sample_index=cols["sample_index"].astype(np.int64, copy=False),
            token_offset=cols["token_offset"].astype(np.int64, copy=False),
            num_tokens=cols["num_tokens"].astype(np.int32, copy=False),
            padded_tokens=cols["padded_tokens"].astype(np.int32, copy=False),
            group_first=np.r_[first, key.size].astype(np.int64),
            group_microbatch=mb[first], group_rank_start=start[first],
            group_cp_size=cols["cp_size"][first].astype(np.int64),
        )

    def group_for(self, microbatch: int, pool_rank: int) -> GroupRows:
        """The group that holds ``pool_rank`` in ``microbatch``, with its rows in packing order."""
        if not 0 <= microbatch < self.num_microbatches:
            raise ValueError(f"step {self.step}: microbatch {microbatch} out of range "
                             f"0..{self.num_microbatches - 1}")
        if not 0 <= pool_rank < self.pool_size:
            raise ValueError(f"pool rank {pool_rank} out of range 0..{self.pool_size - 1}")
        # Groups are sorted by (microbatch, rank_start): bisect on that key.
        key = self.group_microbatch * (self.pool_size + 1) + self.group_rank_start
        g = int(np.searchsorted(key, microbatch * (self.pool_size + 1) + pool_rank, "right")) - 1
        start = int(self.group_rank_start[g]) if g >= 0 else -1
        k = int(self.group_cp_size[g]) if g >= 0 else 0
        if (g < 0 or int(self.group_microbatch[g]) != microbatch
                or not start <= pool_rank < start + k):
            raise ValueError(f"step {self.step} microbatch {microbatch}: no group holds pool rank "
                             f"{pool_rank} (invalid plan)")
        rows = slice(int(self.group_first[g]), int(self.group_first[g + 1]))
        return GroupRows(
            microbatch=microbatch, rank_start=start, cp_size=k, cp_rank=pool_rank - start,
            sample_index=self.sample_index[rows].astype(np.int64, copy=False),
            token_offset=self.token_offset[rows].astype(np.int64, copy=False),
            num_tokens=self.num_tokens[rows].astype(np.int64),
            padded_tokens=self.padded_tokens[rows].astype(np.int64),
        )


def _describe(world_size: int, dp: int, cp: int, tp: int, pp: int) -> str:
    return f"world_size={world_size} (dp {dp} x cp {cp} x tp {tp} x pp {pp})"


class PlanReader:
    """A plan opened for replay; see the module docstring for the cost of ``validate``."""

    def __init__(self, path: str | os.PathLike[str], *, validate: bool = True) -> None:
        # PlanFile refuses unknown format versions, naming both
        # (planner.planfile.schema.PlanHeader).
        self._file = PlanFile(path)
        self.path = self._file.path
        self.header: PlanHeader = self._file.header
        if validate:
            validate_plan(self.header, self._file, source=str(self.path))

    @property
    def num_steps(self) -> int:
        return self._file.num_steps

    @property
    def layout(self) -> str:
        return self.header.layout

    @property
    def pool_size(self) -> int:
        return self.header.parallel.pool_size

    def check_job(self, topology: Topology) -> None:
        """Raise ValueError, naming both layouts, unless the live job can replay this plan.

        Pool size, tp, pp and the world size must match; the split of the pool into dp x cp may
        differ, since pool ranks are numbered the same way for any split.
        """
        p = self.header.parallel
        want = _describe(p.pool_size * p.tp * p.pp, p.dp, p.cp, p.tp, p.pp)
        got = _describe(topology.world_size, topology.dp, topology.cp, topology.tp, topology.pp)
        if (topology.world_size != p.pool_size * p.tp * p.pp
                or topology.dp * topology.cp != p.pool_size
                or topology.tp != p.tp or topology.pp != p.pp):
            hint = (f": launch {p.launch_hint(TRAIN_COMMAND)}"
                    if topology.world_size != p.world_size else "")
            from runtime.dist.topology import SameOnEveryRank

            raise SameOnEveryRank(f"{self.path}: plan built for {want}, got {got}{hint}")

    def check_dataset(self, lengths: NDArray[np.integer],
                      names: Sequence[str] = ()) -> None:
        """Raise ValueError naming both fingerprints unless ``lengths`` are the plan's dataset,
        and, for a plan that lists its files, the files whose lengths changed (``names``: the
        files read, in the plan's order; default the plan's paths)."""
        d = self.header.dataset
        n = len(lengths)
        changed = self._changed_files(np.asarray(lengths), names)
        if n != d.num_samples:
            raise ValueError(f"{self.path}: plan built for a dataset of {d.num_samples} samples "
                             f"({d.path}), got {n}{changed}")
        fp = fingerprint_lengths(np.asarray(lengths))
        if fp != d.fingerprint:
            raise ValueError(f"{self.path}: plan built for dataset fingerprint {d.fingerprint} "
                             f"({d.path}), got {fp}{changed}")

    def _changed_files(self, lengths: NDArray[np.integer], names: Sequence[str]) -> str:
        """``; the dataset changed since planning: FILE (...)`` for the files whose sample
        count or lengths fingerprint differ from the plan's, else ''."""
        files = self.header.dataset.files
        names = list(names) if len(names) == len(files) else [str(f["path"]) for f in files]
        out, start = [], 0
        for f, name in zip(files, names, strict=True):
            k = int(f["num_samples"])
            part = lengths[start:start + k]
            start += k
            if len(part) != k:
                out.append(f"{name} ({len(part)} samples, the plan's {k})")
            elif fingerprint_lengths(part) != f.get("fingerprint"):
                out.append(f"{name} (other sample lengths than planned)")
        if not out:
            return ""
        return f"; the dataset changed since planning: {', '.join(out)}"

    def step(self, i: int) -> StepPlan:
        """Step ``i``'s rows (O(1): one record batch of the memory-mapped file)."""
        batch = self._file.step(i)
        cols = {n: column_numpy(batch, n) for n in COLUMN_NAMES}
        return StepPlan.from_columns(i, self.pool_size, cols)

    def columns(self, i: int) -> dict[str, NDArray[np.int64]]:
        """Step ``i``'s plan columns as numpy arrays (``planner.memory`` reads them)."""
        batch = self._file.step(i)
        return {n: column_numpy(batch, n) for n in COLUMN_NAMES}

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PlanReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
