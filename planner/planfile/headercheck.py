"""The header fields that describe the steps, checked against the steps (``validate``).

A header's checksum proves only that nobody changed it without recomputing the checksum; these
checks (``validate(thorough=True)``, run by ``dcp-plan validate``) prove that what it says
about the steps is true of them:

- ``global_batch``: with ``size`` B, every step of an epoch holds B distinct samples (the last
  at most B; exactly B with ``drop_last``); with ``tokens`` T, a step holds at most T real
  tokens unless it is one sample, and a step that is not its epoch's last would have passed T
  with the next sample; a blend's per-group counts (``_check_blend_step`` in ``validate``);
- ``seed`` and the draw order: each epoch's steps are consecutive runs of the
  permutation of (``dataset.num_samples``, ``seed``, epoch) over the eligible samples (every
  sample but ``stats.dropped_samples``), per blend group for a blend, in file order for an
  eval plan; with ``drop_last``, ``stats.undrawn_samples`` is the rest of that order;
- ``stats``: ``StatsCheck`` recomputes every count and ratio, the simulated time
  and the lower bounds, whose terms depend on ``layout``, ``cp_sizes``, ``tp`` (with sequence
  parallelism) and the capacity, so an edit of those shows there too.

What no row can tell: ``tp`` without sequence parallelism and ``pp`` with ``vpp = 1`` shape the
job, not the rows (the runtime checks them against the live world), and ``candidate_steps``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from planner.planfile.schema import EVAL, PlanHeader

if TYPE_CHECKING:
    from planner.config import PlannerConfig
    from planner.planfile.stats import StatsAccumulator

_REL = 1e-9
"""Relative tolerance of recomputed float stats (sums may run in another order)."""
_MASK64 = (1 << 64) - 1


def _eligible(header: PlanHeader) -> NDArray[np.bool_] | None:
    """Samples an epoch draws from: all but ``stats.dropped_samples`` (None if not recorded)."""
    if "dropped_samples" not in header.stats:
        return None
    eligible = np.ones(header.dataset.num_samples, dtype=np.bool_)
    dropped = np.asarray(header.stats["dropped_samples"], dtype=np.int64)
    eligible[dropped[(dropped >= 0) & (dropped < len(eligible))]] = False
    return eligible


def _orders(header: PlanHeader, epoch: int, eligible: NDArray[np.bool_],
            bounds: NDArray[np.int64]) -> list[NDArray[np.int64]]:
    """The epoch's draw order: one array, or one per blend group."""
    from planner.solver.batches import epoch_permutation  # thorough only

    if header.kind == EVAL:
        return [np.flatnonzero(eligible).astype(np.int64)]
    seed = int(header.seed)
    if not header.global_batch.get("blend"):
        perm = epoch_permutation(len(eligible), seed, epoch)
        return [perm[eligible[perm]]]
    out = []
    for g in range(len(bounds) - 1):
        a, b = int(bounds[g]), int(bounds[g + 1])
        perm = a + epoch_permutation(b - a, (seed * 0x9E3779B1 + g + 1) & _MASK64, epoch)
        out.append(perm[eligible[perm]])
    return out


class EpochBatches:
    """One epoch's steps against ``global_batch`` and the seed: ``add`` each step, then
    ``finish``; errors are returned as messages."""

    def __init__(self, header: PlanHeader, epoch: int, first: int, count: int,
                 bounds: NDArray[np.int64]) -> None:
        self.header, self.epoch, self.last = header, epoch, first + count - 1
        gb = header.global_batch
        self.size = int(gb.get("size") or 0)
        self.tokens = int(gb.get("tokens") or 0)
        self.drop_last = bool(gb.get("drop_last"))
        self.blend = bool(gb.get("blend"))
        self.bounds = bounds
        eligible = _eligible(header)
        self.orders = _orders(header, epoch, eligible, bounds) if eligible is not None else None
        self.pos = [0] * (len(self.orders) if self.orders is not None else 0)
        self.open: tuple[int, int, int] | None = None  # tokens mode: (step, tokens, max sample)

    def add(self, i: int, sample: NDArray[Any], ntok: NDArray[Any]) -> list[str]:
        errors: list[str] = []
        real = sample >= 0
        uniq, inverse = np.unique(sample[real].astype(np.int64), return_inverse=True)
        per_sample = np.bincount(inverse, weights=ntok[real].astype(np.float64),
                                 minlength=len(uniq)).astype(np.int64)
        m, step_tokens = len(uniq), int(per_sample.sum())
        where = f"step {i}"
        if self.size and not self.blend and self.header.kind != EVAL and (
                m > self.size or ((i != self.last or self.drop_last) and m != self.size)):
            errors.append(f"{where}: holds {m} samples, the header's global_batch.size is "
                          f"{self.size} (only an epoch's last step may hold fewer, and none "
                          "with drop_last)")
        next_first: int | None = None
        if self.orders is not None:
            misplaced = self._in_order(where, uniq)
            errors += misplaced
            if self.tokens and m and not misplaced:
                # The first of this step's samples in draw order: the one that closed the last.
                order = self.orders[0]
                next_first = int(per_sample[np.searchsorted(uniq, order[self.pos[0] - m])])
        if self.tokens:
            if step_tokens > self.tokens and m > 1:
                errors.append(f"{where}: holds {step_tokens} real tokens in {m} samples, more "
                              f"than the header's global_batch.tokens {self.tokens} (only a "
                              "lone sample may exceed it)")
            if self.open is not None and m:
                prev, prev_tokens, _ = self.open
                # The next sample would have pushed the last step past T (it closed there).
                added = next_first if next_first is not None else int(per_sample.max())
                if prev_tokens + added <= self.tokens:
                    errors.append(f"step {prev}: closed at {prev_tokens} real tokens although "
                                  f"the next sample ({added} tokens) fits the header's "
                                  f"global_batch.tokens {self.tokens}")
            self.open = (i, step_tokens, int(per_sample.max(initial=0))) if i != self.last \
                else None
        return errors

    def _in_order(self, where: str, uniq: NDArray[np.int64]) -> list[str]:
        assert self.orders is not None
        groups = (np.searchsorted(uniq, self.bounds[1:-1]) if self.blend
                  else np.zeros(0, dtype=np.int64))
        parts = np.split(uniq, groups)
        for g, (order, got) in enumerate(zip(self.orders, parts, strict=True)):
            a = self.pos[g]
            want = np.sort(order[a:a + len(got)])
            self.pos[g] = a + len(got)
            if not np.array_equal(want, got):
                what = f"blend group {g}'s" if self.blend else "the"
                return [f"{where}: its samples are not the next {len(got)} of {what} epoch "
                        f"{self.epoch} order that the header's seed {self.header.seed} "
                        f"{'and file order ' if self.header.kind == EVAL else ''}gives (the "
                        "header's seed, epochs or global_batch do not describe the steps)"]
        return []

    def finish(self) -> list[str]:
        if self.orders is None or self.blend:
            return []  # a blend's per-epoch draw counts are validate's _check_blend_epoch
        order, drawn = self.orders[0], self.pos[0]
        rest = np.sort(order[drawn:])
        if not self.drop_last:
            if len(rest):
                return [f"epoch {self.epoch}: draws {drawn} of its {len(order)} eligible "
                        "samples without drop_last"]
            return []
        undrawn = self.header.stats.get("undrawn_samples")
        if undrawn is not None and self.epoch < len(undrawn) and \
                not np.array_equal(rest, np.asarray(undrawn[self.epoch], dtype=np.int64)):
            return [f"epoch {self.epoch}: stats undrawn_samples is not what the seed's order "
                    "leaves after the last step"]
        return []


def _close(got: Any, want: Any) -> bool:
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and math.isclose(float(got), float(want),
                                                              rel_tol=_REL, abs_tol=1e-12)
    return bool(got == want)


def compare_stats(stats: dict[str, Any], recomputed: dict[str, Any]) -> list[str]:
    """Every key of ``recomputed`` (nested one level) that the header's ``stats`` holds (an
    older writer recorded fewer) against it."""
    errors = []
    for key, want in recomputed.items():
        if key not in stats:
            continue
        got = stats[key]
        if isinstance(want, dict):
            same = isinstance(got, dict) and got.keys() == want.keys() and all(
                _close(got[k], want[k]) for k in want)
        else:
            same = _close(got, want)
        if not same:
            errors.append(f"header: stats {key} is {got!r}, the steps give {want!r}")
    return errors


def _config(header: PlanHeader) -> PlannerConfig:
    """The planner config the header describes, as far as the stats depend on it."""
    from planner.config import ParallelConfig, PlannerConfig  # planner.config imports planfile

    p = header.parallel
    gb = header.global_batch
    tokens = int(gb.get("tokens") or 0)
    return PlannerConfig(
        parallel=ParallelConfig(dp=p.dp, cp=p.cp, tp=p.tp, pp=p.pp, vpp=p.vpp,
                                sequence_parallel=p.sequence_parallel,
                                microbatch_group_size=p.microbatch_group_size),
        capacity_tokens_per_rank=header.capacity_tokens_per_rank,
        global_batch_size=0 if tokens else max(int(gb.get("size") or 0), 1),
        global_batch_tokens=tokens, layout=header.layout, cp_sizes=tuple(header.cp_sizes),
        pad_to_multiple=header.pad_to_multiple)


class StatsCheck:
    """The header's stats recomputed from the steps (``add`` each, then ``finish``): every
    number ``StatsAccumulator`` gives the planner, the tight bound as the notebook computes it."""

    def __init__(self, header: PlanHeader) -> None:
        from planner.cost import CostModel
        from planner.planfile.stats import StatsAccumulator

        self.header = header
        try:
            config = _config(header)
        except ValueError as e:
            self.acc: StatsAccumulator | None = None
            self.error = f"header: {e}"
            return
        cm = header.cost_model
        self.cost = CostModel.from_dict({"name": cm.get("name", "plan"),
                                         "parameters": cm.get("parameters", {})})
        self.acc = StatsAccumulator(config, self.cost)
        self.error = ""

    def add(self, cols: dict[str, NDArray[Any]]) -> None:
        if self.acc is None:
            return
        from planner.planfile.stats import min_num_microbatches
        from planner.solver.step import tight_lower_bound  # thorough only

        h = self.header
        seg = cols["num_tokens"][cols["sample_index"] >= 0].astype(np.int64)
        n, cap, tp_eff = h.parallel.pool_size, h.capacity_tokens_per_rank, h.parallel.tp_eff
        need = min_num_microbatches(seg, h.cp_sizes, cap, tp_eff, h.layout, n,
                                    h.parallel.microbatch_multiple, h.pad_to_multiple)
        tight = tight_lower_bound(seg, h.cp_sizes, cap, tp_eff, h.layout, n,
                                  self.cost.as_array(), need, h.pad_to_multiple) \
            if len(seg) else 0.0
        self.acc.add(cols, seg, tight)

    def finish(self) -> list[str]:
        if self.acc is None:
            return [self.error]
        return compare_stats(self.header.stats, self.acc.result())
