"""``validate``: every invariant of the plan format (docs/PLAN_FORMAT.md), in one function.

One ``validate`` serves the writer, ``dcp-plan validate``, the runtime's loader and the tests.
It is vectorised with numpy so that a plan of a million rows checks in well under a second.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from planner.groups import LAYOUTS, MAX_GROUP_TOKENS, pad_multiple, valid_cp_sizes
from planner.planfile.coverage import Coverage
from planner.planfile.gain import gain_errors
from planner.planfile.headercheck import EpochBatches, StatsCheck
from planner.planfile.schema import (
    COLUMN_NAMES,
    EVAL,
    MEGATRON_UNITS,
    NUMPY_DTYPES,
    PLAN_KINDS,
    PlanHeader,
    column_numpy,
    dataset_content_fingerprint,
    fingerprint_lengths,
)
from planner.planfile.stepcheck import rows_valid


class _Errors:
    def __init__(self, limit: int = 20) -> None:
        self.items: list[str] = []
        self.limit = limit

    def add(self, msg: str) -> None:
        if len(self.items) < self.limit:
            self.items.append(msg)

    def raise_if_any(self, source: str) -> None:
        if self.items:
            more = "" if len(self.items) < self.limit else "\n  ... (more errors not shown)"
            raise ValueError(f"{source}: invalid plan:\n  " + "\n  ".join(self.items) + more)


@functools.lru_cache(maxsize=8)
def _multiples(n: int, sizes: tuple[int, ...], tp_eff: int, layout: str,
               pad_to: int) -> NDArray[np.int64]:
    """Per size 0..n, its padding multiple (0: not an allowed size): once per plan, not per
    step (read only)."""
    mult_of = np.zeros(n + 1, dtype=np.int64)
    for s in sizes:
        if 1 <= s <= n:
            mult_of[s] = pad_multiple(int(s), tp_eff, layout, pad_to)
    return mult_of


def _fast_valid(i: int, cols: dict[str, NDArray[Any]], header: PlanHeader) -> bool:
    """stepcheck.rows_valid on the step (False, so the numpy checks run, for unusual dtypes)."""
    if any(cols[name].dtype != dtype for name, dtype in NUMPY_DTYPES.items()):
        return False
    n = header.parallel.pool_size
    mult_of = _multiples(n, tuple(header.cp_sizes), header.parallel.tp_eff, header.layout,
                         header.pad_to_multiple)
    return bool(rows_valid(i, cols["step"], cols["microbatch"], cols["rank_start"],
                           cols["cp_size"], cols["sample_index"], cols["num_tokens"],
                           cols["padded_tokens"], n, header.capacity_tokens_per_rank, mult_of,
                           header.parallel.microbatch_multiple))


def _check_step(
    i: int, cols: dict[str, NDArray[Any]], header: PlanHeader, err: _Errors
) -> None:
    if not _fast_valid(i, cols, header):
        _word_step_errors(i, cols, header, err)


def _word_step_errors(
    i: int, cols: dict[str, NDArray[Any]], header: PlanHeader, err: _Errors
) -> None:
    """The per-step invariants, with numpy, each violation worded into ``err``."""
    n = header.parallel.pool_size
    cap = header.capacity_tokens_per_rank
    tp_eff = header.parallel.tp_eff
    sizes = np.asarray(header.cp_sizes, dtype=np.int64)
    step, mb, start = cols["step"], cols["microbatch"], cols["rank_start"]
    k = cols["cp_size"].astype(np.int64)
    sample, ntok = cols["sample_index"], cols["num_tokens"].astype(np.int64)
    padded = cols["padded_tokens"].astype(np.int64)
    where = f"step {i}"
    if len(step) == 0:
        err.add(f"{where}: has no rows")
        return
    if np.any(step != i):
        err.add(f"{where}: column step holds {int(step[step != i][0])}, expected {i}")
    key = mb.astype(np.int64) * (n + 1) + start
    if np.any(np.diff(key) < 0):
        err.add(f"{where}: rows are not sorted by (microbatch, rank_start)")
        return
    num_mb = int(mb.max()) + 1
    if int(mb.min()) != 0 or len(np.unique(mb)) != num_mb:
        err.add(f"{where}: microbatches are not numbered 0..{num_mb - 1} without gaps")
        return
    bad = ~np.isin(k, sizes)
    if bad.any():
        err.add(f"{where}: cp_size {int(k[bad][0])} is not in cp_sizes {list(header.cp_sizes)}")
        return
    aligned = np.where(k == n, start == 0, (start % k == 0) & (start >= 0) & (start + k <= n))
    if not aligned.all():
        j = int(np.argmax(~aligned))
        err.add(f"{where} microbatch {int(mb[j])}: group at rank {int(start[j])} of size "
                f"{int(k[j])} is not an aligned block of the pool of {n}")
        return
    # Groups: runs of equal (microbatch, rank_start); their rows must agree on cp_size.
    first = np.flatnonzero(np.r_[True, np.diff(key) != 0])
    g_k = k[first]
    if np.any(np.repeat(g_k, np.diff(np.r_[first, len(key)])) != k):
        err.add(f"{where}: rows of one group disagree on cp_size")
        return
    g_mb = mb[first].astype(np.int64)
    g_start = start[first].astype(np.int64)
    # Partition: per microbatch the group sizes sum to n and groups do not overlap (sorted starts
    # with start[j+1] == start[j] + k[j] and the first at 0).
    covered = np.bincount(g_mb, weights=g_k, minlength=num_mb)
    if np.any(covered != n):
        m = int(np.argmax(covered != n))
        err.add(f"{where} microbatch {m}: groups cover {int(covered[m])} rank slots, pool is {n}")
    nxt = g_start + g_k
    same_mb = g_mb[1:] == g_mb[:-1]
    if np.any(same_mb & (g_start[1:] != nxt[:-1])) or np.any(g_start[np.r_[True, ~same_mb]] != 0):
        err.add(f"{where}: groups of a microbatch do not partition ranks 0..{n - 1}")
    # Capacity per group.
    g_padded = np.add.reduceat(padded, first)
    over = g_padded > g_k * cap
    if over.any():
        j = int(np.argmax(over))
        err.add(f"{where} microbatch {int(g_mb[j])}: group at rank {int(g_start[j])} holds "
                f"{int(g_padded[j])} padded tokens, capacity {int(g_k[j])} x {cap}")
    # Padding rules.
    if np.any(padded < ntok) or np.any(ntok < 0):
        err.add(f"{where}: a segment has padded_tokens < num_tokens or negative num_tokens")
    pad_to = header.pad_to_multiple
    mult = np.where(k == 1, pad_multiple(1, tp_eff, header.layout, pad_to), 0)
    for kk in header.cp_sizes:
        if kk > 1:
            mult = np.where(k == kk, pad_multiple(int(kk), tp_eff, header.layout, pad_to), mult)
    # Zigzag needs 2k*tp' (PLAN_FORMAT invariant 4); our contiguous layout pads to k*tp'; with
    # the header's pad_to_multiple N, every padded length is also a multiple of N.
    bad = padded % mult != 0
    if bad.any():
        j = int(np.argmax(bad))
        err.add(f"{where}: sample {int(sample[j])} padded to {int(padded[j])}, not a multiple "
                f"of {int(mult[j])} at cp_size {int(k[j])}")
    filler = sample < 0
    if np.any(filler & (ntok != 0)) or np.any(~filler & (ntok <= 0)):
        err.add(f"{where}: fillers must have num_tokens 0 and samples num_tokens > 0")
    mm = header.parallel.microbatch_multiple
    if num_mb % mm != 0:
        err.add(f"{where}: {num_mb} microbatches is not a multiple of the microbatch group "
                f"size {mm} (vpp={header.parallel.vpp})")


def _check_eval_step(i: int, sample: NDArray[Any], last_max: int, header: PlanHeader,
                     err: _Errors) -> int:
    """Eval order: step i's samples all follow step i-1's in file order; returns the new max.

    With coverage (every sample once), this makes each step a consecutive run of the dataset's
    samples in file order. With a sample-count batch every step but the last holds exactly
    ``global_batch.size`` samples and the last at most that many (it is kept, never dropped).
    """
    real = np.unique(sample[sample >= 0])
    if real.size == 0:
        return last_max
    if int(real[0]) <= last_max:
        err.add(f"step {i}: eval plan out of file order: sample {int(real[0])} after sample "
                f"{last_max} of an earlier step")
    size = int(header.global_batch.get("size") or 0)
    if size > 0 and (real.size > size or (i + 1 < header.num_steps and real.size != size)):
        err.add(f"step {i}: eval step holds {real.size} samples, the global batch size is {size}"
                " (only the last step may hold fewer)")
    return max(last_max, int(real[-1]))
def group_bounds(header: PlanHeader) -> NDArray[np.int64]:
    """Sample index bounds of the blend groups of a format-2 header (one group without files)."""
    files = header.dataset.files
    if not files:
        return np.array([0, header.dataset.num_samples], dtype=np.int64)
    num_groups = max(int(f["group"]) for f in files) + 1
    sizes = np.zeros(num_groups, dtype=np.int64)
    for f in files:
        sizes[int(f["group"])] += int(f["num_samples"])
    bounds: NDArray[np.int64] = np.r_[0, np.cumsum(sizes)].astype(np.int64)
    return bounds


def _check_blend_epoch(header: PlanHeader, blend: dict[str, Any], placed: NDArray[np.bool_],
                       epoch: int, err: _Errors) -> None:
    """Each group gave exactly ``drawn_per_epoch[epoch][g]`` distinct samples this epoch."""
    bounds = group_bounds(header)
    drawn = blend.get("drawn_per_epoch", [])
    if epoch >= len(drawn) or len(drawn[epoch]) != len(bounds) - 1:
        err.add(f"header: blend drawn_per_epoch does not list epoch {epoch}'s "
                f"{len(bounds) - 1} groups")
        return
    for g in range(len(bounds) - 1):
        got = int(placed[bounds[g]:bounds[g + 1]].sum())
        if got != int(drawn[epoch][g]):
            err.add(f"epoch {epoch}: blend group {g} placed {got} samples, the header says "
                    f"{int(drawn[epoch][g])}")


def _check_blend_step(i: int, sample: NDArray[Any], header: PlanHeader, err: _Errors) -> None:
    """A blended step draws ``samples_per_step[g]`` distinct samples from every group g."""
    blend = header.global_batch["blend"]
    bounds = group_bounds(header)
    want = [int(c) for c in blend.get("samples_per_step", [])]
    uniq = np.unique(sample[sample >= 0])
    got = np.diff(np.searchsorted(uniq, bounds)).tolist()
    if got != want:
        err.add(f"step {i}: draws {got} samples from the blend groups, the header's "
                f"samples_per_step is {want}")


def _check_files(header: PlanHeader, lengths: NDArray[np.integer] | None, err: _Errors) -> None:
    """Format 2: the files add up to the dataset, and each one still has its fingerprint."""
    files = header.dataset.files
    if not files:
        return
    total = sum(int(f["num_samples"]) for f in files)
    if total != header.dataset.num_samples:
        err.add(f"header: dataset files hold {total} samples, the dataset "
                f"{header.dataset.num_samples}")
        return
    fps = [str(f.get("content_fingerprint", "")) for f in files]
    if any(fps) and header.dataset.content_fingerprint != dataset_content_fingerprint(fps):
        err.add("header: dataset content_fingerprint does not combine the files' content "
                "fingerprints")
    elif header.dataset.content_fingerprint and not any(fps):
        err.add("header: dataset content_fingerprint without files' content fingerprints")
    if lengths is None or len(lengths) != total:
        return
    start = 0
    for f in files:
        n = int(f["num_samples"])
        fp = fingerprint_lengths(np.asarray(lengths[start:start + n]))
        if fp != f["fingerprint"]:
            err.add(f"dataset file {f['path']} (samples {start}..{start + n - 1}) does not match "
                    "the plan's fingerprint of it: it changed since planning, or the files are "
                    "in another order")
        start += n


def _check_header(header: PlanHeader, err: _Errors) -> None:
    """The header fields the row checks rely on (a bad one would crash them or skip steps)."""
    if header.kind not in PLAN_KINDS:
        err.add(f"header: kind {header.kind!r} is not one of {', '.join(PLAN_KINDS)}")
    if header.kind == EVAL:
        # An evaluation is one pass in file order with every sample kept: no epochs, no drops.
        if len(header.epochs) != 1:
            err.add(f"header: an eval plan is one pass, the header lists {len(header.epochs)} "
                    "epochs")
        if header.global_batch.get("drop_last"):
            err.add("header: an eval plan keeps its last partial batch (drop_last is set)")
    p = header.parallel
    for name in ("dp", "cp", "tp", "pp", "vpp", "pool_size", "microbatch_group_size"):
        if not isinstance(getattr(p, name), int) or getattr(p, name) < 1:
            err.add(f"header: {name} {getattr(p, name)!r} is not a positive integer")
            return
    if p.pool_size != p.dp * p.cp:
        err.add(f"header: pool_size {p.pool_size} != dp x cp = {p.dp * p.cp}")
    bad_sizes = set(header.cp_sizes) - set(valid_cp_sizes(p.pool_size))
    if bad_sizes or not header.cp_sizes:
        err.add(f"header: cp_sizes {sorted(bad_sizes)} are not valid for a pool of {p.pool_size}")
    if not isinstance(header.dataset.field, str):
        err.add(f"header: dataset field {header.dataset.field!r} is not a field name (a string)")
    if header.dataset.megatron_unit not in ("", *MEGATRON_UNITS):
        err.add(f"header: dataset megatron_unit {header.dataset.megatron_unit!r} is not one of "
                f"{', '.join(MEGATRON_UNITS)}")
    if header.layout not in LAYOUTS:
        err.add(f"header: layout {header.layout!r} is not one of {', '.join(LAYOUTS)}")
    if header.pad_to_multiple < 1:
        err.add(f"header: pad_to_multiple {header.pad_to_multiple} is not >= 1")
    if header.capacity_tokens_per_rank < 1:
        err.add(f"header: capacity_tokens_per_rank {header.capacity_tokens_per_rank} is not >= 1")
    elif header.cp_sizes and \
            header.capacity_tokens_per_rank * max(header.cp_sizes) > MAX_GROUP_TOKENS:
        err.add(f"header: a group of {max(header.cp_sizes)} ranks may hold "
                f"{max(header.cp_sizes)} x {header.capacity_tokens_per_rank} padded tokens, "
                f"more than the {MAX_GROUP_TOKENS} that int32 offsets (cu_seqlens) address")
    # Epochs must tile the steps in order: a gap or an overlap would leave steps unchecked.
    expected = 0
    for e, (first, count) in enumerate(header.epochs):
        if first != expected or count < 0:
            err.add(f"header: epoch {e} starts at step {first}, expected {expected} "
                    f"(holds {count} steps)")
            return
        expected += count
    num_samples = header.dataset.num_samples
    stats = header.stats
    listed = [("dropped_samples", list(stats.get("dropped_samples", [])))]
    listed.append(("truncated_samples", [s for s, _ in stats.get("truncated_samples", [])]))
    undrawn = stats.get("undrawn_samples", [])
    if header.global_batch.get("drop_last") and "undrawn_samples" in stats \
            and len(undrawn) != len(header.epochs):
        err.add(f"header: stats undrawn_samples lists {len(undrawn)} epochs, the plan has "
                f"{len(header.epochs)}")
    listed += [("undrawn_samples", list(u)) for u in undrawn]
    for msg in gain_errors(stats, expected):  # the predicted gain's shape (planfile/gain.py)
        err.add(msg)
    for name, indices in listed:
        bad = [s for s in indices if not 0 <= s < num_samples]
        if bad:
            err.add(f"header: stats {name} holds sample {bad[0]}, the dataset has {num_samples}")


def validate(
    header: PlanHeader,
    steps: list[pa.RecordBatch] | Any,
    lengths: NDArray[np.integer] | None = None,
    *,
    source: str = "plan",
    on_step: Callable[[pa.RecordBatch, dict[str, NDArray[Any]]], None] | None = None,
    thorough: bool = False,
) -> None:
    """Check every invariant of PLAN_FORMAT.md; raise ValueError listing the first problems.

    Eval plans (header ``kind: eval``) also hold the eval rules: one pass, no dropped last
    batch, and every sample exactly once in file order across steps.

    Args:
        header: the plan header.
        steps: the record batches, batch i holding step i (a list or anything indexable).
        lengths: the dataset's sample lengths in file order; when given, coverage is checked to
            the last token and the fingerprint is compared.
        source: a name for error messages (the plan's path).
        on_step: called with each step's batch and columns, in step order, once its own checks
            ran (its epoch's coverage is checked at the epoch's end): the streaming writer copies
            the steps this way in the same pass. Nothing it wrote counts until this returns.
        thorough: also check the header fields that describe the steps against them
            (``headercheck``: the global batch per step, the seed's draw order, every stat);
            ``dcp-plan validate`` does. The writer (which derived them from the steps) and the
            runtime (which replays rows, not those fields) do not: it costs a permutation per
            epoch and a simulation per step.
    """
    err = _Errors()
    _check_header(header, err)
    _check_files(header, lengths, err)
    if lengths is not None:
        fp = fingerprint_lengths(lengths)
        if fp != header.dataset.fingerprint:
            err.add(f"dataset fingerprint {fp} does not match the plan's "
                    f"{header.dataset.fingerprint}")
    num_steps = len(steps)
    if num_steps != header.num_steps:
        err.add(f"file holds {num_steps} steps, header epochs list {header.num_steps}")
    elif num_steps == 0:
        err.add("the plan has no steps (nothing to train)")
    err.raise_if_any(source)
    stats = StatsCheck(header) if thorough else None
    bounds = group_bounds(header)
    for e, (first, count) in enumerate(header.epochs):
        coverage = Coverage(header, e)
        batches = EpochBatches(header, e, first, count, bounds) if thorough else None
        last_max = -1
        for i in range(first, first + count):
            b = steps[i]
            cols = {n: column_numpy(b, n) for n in COLUMN_NAMES}
            _check_step(i, cols, header, err)
            if batches is not None:
                for msg in batches.add(i, cols["sample_index"], cols["num_tokens"]):
                    err.add(msg)
            if stats is not None:
                stats.add(cols)
            if header.kind == EVAL:
                last_max = _check_eval_step(i, cols["sample_index"], last_max, header, err)
            if header.global_batch.get("blend"):
                _check_blend_step(i, cols["sample_index"], header, err)
            coverage.add(cols["sample_index"], cols["token_offset"], cols["num_tokens"])
            if on_step is not None:
                on_step(b, cols)
        blend = header.global_batch.get("blend")
        check = None
        if blend:
            def check(placed: NDArray[np.bool_], epoch: int = e,
                      blend: dict[str, Any] = blend) -> None:
                _check_blend_epoch(header, blend, placed, epoch, err)
        for msg in coverage.finish(lengths, blend_check=check):
            err.add(msg)
        for msg in batches.finish() if batches is not None else ():
            err.add(msg)
        err.raise_if_any(source)
    for msg in stats.finish() if stats is not None else ():
        err.add(msg)
    err.raise_if_any(source)
