"""A finite evaluation pass over an eval plan: the same steps and microbatches on every rank.

An evaluation plan (``dcp-plan DATA --eval``, header ``kind: eval``) holds a held-out set once,
in file order. ``EvalSchedule`` replays it on this rank for any loop (the native trainer, the
Megatron-core and torchtitan adapters): it yields this rank's microbatches with their CP groups
and then stops. Every count it reports comes from the plan file, which every rank reads alike,
so every rank runs the same number of steps and microbatches and stops at the same point: a
collective issued in a microbatch (the attention's all-gather inside a CP group, a loss reduce
over the pool) always finds every peer. Where a finite pass usually goes wrong:

- counts that differ by rank (a rank that read another file, a per-rank step limit): checked at
  construction by one all-reduce over the pool (``agree=True``), which raises the same
  ``ValueError`` on every rank instead of leaving a collective waiting later;
- phantom steps: ``num_steps`` and ``num_microbatches`` are those the pass runs (``max_steps``
  applied), never a padded or rounded count, and iteration ends with ``StopIteration`` after the
  last microbatch, on every rank;
- groups: none is created. The schedule looks groups up in the *training* ``GroupCatalog``
  (``catalog.cp_group``); an eval plan that needs a size the catalog lacks, or that was built
  for another job (pool, tp, pp, world size: ``PlanReader.check_job``), is refused at
  construction. ``check_eval_layout(eval_header, train_header)`` states the same rule in terms
  of the two plans and names both; loops that hold the training plan call it first.
- training state: none is touched. The schedule has its own reader and token source, reads no
  RNG and holds no model; the caller runs the forward (no gradients) and reduces the loss.

API (the whole of it)::

    schedule = EvalSchedule(reader, source, topology, catalog, max_steps=M)
    schedule.num_steps                    # steps this pass runs (M, or every step of the plan)
    schedule.step_num_microbatches[i]     # microbatches of step i (same on every rank)
    schedule.num_microbatches             # their sum
    for step in range(schedule.num_steps):          # Megatron-style: one call per eval step
        it = schedule.step_microbatches(step)       # lazy: exactly step_num_microbatches[step]
    for item in schedule:                           # or flat: every microbatch of the pass
        item.step, item.index, item.last_in_step, item.micro  # micro: replay.Microbatch

Each ``iter()`` is a fresh pass (evaluate every K training steps with one schedule); inputs are
built lazily, one microbatch at a time.

Example: an eval plan of 3 steps with 2, 1 and 3 microbatches on a pool of 4: every rank yields
6 microbatches, (0, 0) (0, 1) (1, 0) (2, 0) (2, 1) (2, 2), then stops; a rank in a CP group of
2 in microbatch (2, 1) finds its peer in the same microbatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.planfile.schema import EVAL, PlanHeader
from runtime.data.plan_reader import PlanReader, StepPlan
from runtime.data.replay import Microbatch, Replayer
from runtime.data.tokens import TokenSource
from runtime.dist.topology import Topology

if TYPE_CHECKING:
    from runtime.dist.groups import GroupCatalog


@dataclass(frozen=True, slots=True)
class EvalMicrobatch:
    """One microbatch of an evaluation pass, with its place in the pass."""

    step: int
    """Eval plan step (0 .. num_steps - 1)."""
    index: int
    """Microbatch index within the step."""
    last_in_step: bool
    """True for the step's last microbatch (reduce or log a step there)."""
    micro: Microbatch
    """This rank's inputs, CP group and plan rows (``runtime.data.replay.Microbatch``)."""


def _layout(header: PlanHeader) -> str:
    p = header.parallel
    return f"pool {p.pool_size} (dp {p.dp} x cp {p.cp}), tp {p.tp}, pp {p.pp}"


def check_eval_layout(eval_header: PlanHeader, train_header: PlanHeader, *,
                      eval_source: str = "eval plan", train_source: str = "training plan"
                      ) -> None:
    """Raise ValueError, naming both, unless the eval plan runs on the training job's layout.

    The eval plan must be one (header ``kind: eval``).
    The pool size, tp and pp must match (the split of the pool into dp x cp may differ: pool
    ranks are numbered alike), and every CP size of the eval plan must be one the training plan
    may use, since the training catalog holds only those groups.
    """
    if eval_header.kind != EVAL:
        raise ValueError(f"{eval_source}: not an evaluation plan (kind {eval_header.kind!r}); "
                         "make one with dcp-plan DATASET --eval")
    e, t = eval_header.parallel, train_header.parallel
    if (e.pool_size, e.tp, e.pp) != (t.pool_size, t.tp, t.pp):
        raise ValueError(f"{eval_source} is built for {_layout(eval_header)}, the training job "
                         f"({train_source}) for {_layout(train_header)}: an evaluation runs on "
                         "the training job's ranks and groups, so pool, tp and pp must match")
    missing = sorted(set(eval_header.cp_sizes) - set(train_header.cp_sizes))
    if missing:
        raise ValueError(f"{eval_source} uses CP sizes {missing} that {train_source} does not "
                         f"(its sizes: {list(train_header.cp_sizes)}); the training catalog "
                         "has no such groups: plan the eval set with --cp-sizes "
                         f"{','.join(str(k) for k in train_header.cp_sizes)}")


class EvalSchedule:
    """A finite, re-iterable evaluation pass over an eval plan on this rank.

    Args:
        reader: the opened eval plan (header ``kind: eval``).
        source: the eval plan's dataset.
        topology: this rank's place in the job (the training job's).
        catalog: the training job's groups; None leaves ``cp_group`` unset (data-only use).
        max_steps: run only the plan's first ``max_steps`` steps; 0: every step.
        agree: check, with one all-reduce over ``catalog.pool_group``, that every pool rank
            built the same pass (plan digest and counts). Collective: call the constructor on
            every rank. Skipped without a catalog or with a pool of one rank.
        check_dataset: compare the dataset's length fingerprint with the plan's.

    Raises:
        ValueError: not an eval plan, a layout or CP size the catalog cannot run, a negative
            ``max_steps``, the wrong dataset, or ranks that disagree on the pass (on every rank).
    """

    def __init__(self, reader: PlanReader, source: TokenSource, topology: Topology,
                 catalog: GroupCatalog | None = None, *, max_steps: int = 0, agree: bool = True,
                 check_dataset: bool = True) -> None:
        header = reader.header
        if header.kind != EVAL:
            raise ValueError(f"{reader.path}: not an evaluation plan (kind {header.kind!r}); "
                             "make one with dcp-plan DATASET --eval")
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        if catalog is not None:
            if catalog.topology != topology:
                raise ValueError(f"catalog built for {catalog.topology}, the evaluation runs on "
                                 f"{topology}")
            have = {k for _, k in catalog.member_blocks()} | {1}
            missing = sorted(set(header.cp_sizes) - have)
            if missing:
                raise ValueError(f"{reader.path}: eval plan uses CP sizes {missing}, the "
                                 f"training catalog has only {sorted(have)}")
        # Checks pool, tp, pp and world size against the live job (naming both) and the dataset.
        self._replayer = Replayer(reader, source, topology, catalog, check_dataset=check_dataset)
        self.reader = reader
        self.topology = topology
        self.catalog = catalog
        self.num_steps = min(max_steps, reader.num_steps) if max_steps else reader.num_steps
        self.step_num_microbatches: tuple[int, ...] = tuple(
            reader.step(i).num_microbatches for i in range(self.num_steps))
        """Microbatches of each step of the pass (from the plan: the same on every rank)."""
        self.num_microbatches = sum(self.step_num_microbatches)
        """Microbatches of the whole pass, per rank."""
        if agree and catalog is not None and topology.pool_size > 1:
            self._agree(catalog)

    def _agree(self, catalog: GroupCatalog) -> None:
        """Every pool rank must have built this pass: same plan bytes' digest, same counts."""
        import torch
        import torch.distributed as dist

        digest = hashlib.sha256(self.reader.header.to_json().encode()).digest()
        key = [int.from_bytes(digest[:7], "little"), self.num_steps, self.num_microbatches]
        # MAX of (x, -x) gives max and -min in one all-reduce; equal on every rank afterwards, so
        # a disagreement raises on every rank alike (none is left in a later collective).
        mine = torch.tensor(key + [-x for x in key], dtype=torch.int64)
        group = catalog.pool_group
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        both = mine.to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        got = both.cpu().tolist()
        n = len(key)
        if any(got[i] != -got[n + i] for i in range(n)):
            raise ValueError(
                f"{self.reader.path}: the pool's ranks disagree on the evaluation pass "
                f"(this rank: {self.num_steps} steps, {self.num_microbatches} microbatches); "
                "every rank must open the same eval plan with the same max_steps")

    def step_microbatches(self, step: int) -> Iterator[Microbatch]:
        """This rank's microbatches of eval step ``step``, built one at a time, in order."""
        if not 0 <= step < self.num_steps:
            raise ValueError(f"eval step {step} out of range 0..{self.num_steps - 1}")
        plan: StepPlan = self.reader.step(step)
        assert plan.num_microbatches == self.step_num_microbatches[step]
        for m in range(plan.num_microbatches):
            yield self._replayer.microbatch(plan, m)

    def __iter__(self) -> Iterator[EvalMicrobatch]:
        for step in range(self.num_steps):
            last = self.step_num_microbatches[step] - 1
            for m, micro in enumerate(self.step_microbatches(step)):
                yield EvalMicrobatch(step=step, index=m, last_in_step=m == last, micro=micro)

    def __len__(self) -> int:
        return self.num_microbatches

