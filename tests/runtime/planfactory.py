"""Small valid plans built without the solver, and a token-by-token reference packed buffer.

``random_plan`` partitions the pool of every microbatch into aligned groups at random, places the
samples round-robin (splitting some into two segments placed in different groups) and puts a
filler in every group left empty; the capacity is set to what the plan needs, so it validates.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from planner.groups import padded_length, valid_cp_sizes
from planner.planfile.io import write_plan
from planner.planfile.schema import (
    COLUMN_NAMES,
    DatasetInfo,
    ParallelInfo,
    PlanHeader,
    arrow_schema,
    fingerprint_lengths,
    step_batch,
)

if TYPE_CHECKING:
    from runtime.data.plan_reader import GroupRows

Row = tuple[int, int, int, int, int, int, int]  # microbatch, start, k, sample, offset, ntok, padded


def header(lengths: NDArray[np.int64], *, dp: int, cp: int, tp: int = 1, pp: int = 1,
           sequence_parallel: bool = False, layout: str = "zigzag", capacity: int = 1 << 20,
           num_steps: int = 1, cp_sizes: tuple[int, ...] | None = None,
           stats: dict[str, object] | None = None) -> PlanHeader:
    n = dp * cp
    return PlanHeader(
        dataset=DatasetInfo(path="test", num_samples=len(lengths), num_tokens=int(lengths.sum()),
                            fingerprint=fingerprint_lengths(lengths), format="test"),
        parallel=ParallelInfo(dp=dp, cp=cp, tp=tp, pp=pp, vpp=1,
                              sequence_parallel=sequence_parallel, pool_size=n,
                              microbatch_group_size=pp),
        capacity_tokens_per_rank=capacity, cp_sizes=cp_sizes or valid_cp_sizes(n), layout=layout,
        global_batch={"size": len(lengths), "tokens": 0, "drop_last": False}, seed=0,
        cost_model={"name": "t", "parameters": {}},
        stats=stats or {"dropped_samples": [], "truncated_samples": []},
        epochs=((0, num_steps),),
    )


def write(path: Path, hdr: PlanHeader, steps: list[list[Row]], *, check: bool = True) -> Path:
    """Write ``steps`` (rows per step, already in plan order) under ``hdr``.

    ``check=False`` writes a deliberately invalid plan (tests of validation on load).
    """
    schema = arrow_schema(hdr)
    batches = []
    for i, rows in enumerate(steps):
        a = np.array([(i, *r) for r in rows], dtype=np.int64).reshape(-1, 8)
        batches.append(step_batch(schema, {n: a[:, j] for j, n in enumerate(COLUMN_NAMES)}))
    return write_plan(path, hdr, batches, check=check)


def _partition(pool: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """A random partition of ranks 0..pool-1 into aligned blocks of valid sizes."""
    sizes = valid_cp_sizes(pool)
    out: list[tuple[int, int]] = []
    todo = [(0, pool)]
    while todo:
        start, k = todo.pop()
        smaller = [s for s in sizes if s < k and k % s == 0]
        if smaller and rng.random() < 0.6:
            s = max(smaller)
            todo.extend((start + j * s, s) for j in range(k // s))
        else:
            out.append((start, k))
    return sorted(out)


def random_plan(path: Path, lengths: NDArray[np.int64], *, dp: int, cp: int, tp: int = 1,
                pp: int = 1, sequence_parallel: bool = False, layout: str = "zigzag",
                num_steps: int = 2, microbatches: int = 2, split_fraction: float = 0.2,
                seed: int = 0) -> Path:
    """A valid plan over ``lengths``, one epoch of ``num_steps`` steps (see module docstring)."""
    rng = np.random.default_rng(seed)
    pool = dp * cp
    tp_eff = tp if sequence_parallel else 1
    order = rng.permutation(len(lengths))
    steps: list[list[Row]] = []
    cap = 1
    for sample_block in np.array_split(order, num_steps):
        # Segments to place: whole samples, or two halves of a sample.
        segs: list[tuple[int, int, int]] = []
        for s in sample_block:
            n = int(lengths[s])
            if n >= 2 and rng.random() < split_fraction:
                cut = int(rng.integers(1, n))
                segs += [(int(s), 0, cut), (int(s), cut, n - cut)]
            else:
                segs.append((int(s), 0, n))
        segs = [segs[j] for j in rng.permutation(len(segs))]
        groups = [(m, st, k) for m in range(microbatches) for st, k in _partition(pool, rng)]
        placed: list[list[tuple[int, int, int]]] = [[] for _ in groups]
        for j, seg in enumerate(segs):
            placed[j % len(groups)].append(seg)
        rows: list[Row] = []
        for (m, st, k), members in zip(groups, placed, strict=True):
            if not members:
                members = [(-1, 0, 0)]
            total = 0
            for s, off, n in members:
                p = padded_length(max(n, 1), k, tp_eff, layout)
                rows.append((m, st, k, s, off, n, p))
                total += p
            cap = max(cap, -(-total // k))
        rows.sort(key=lambda r: (r[0], r[1]))  # stable: keeps packing order inside a group
        steps.append(rows)
    hdr = header(lengths, dp=dp, cp=cp, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                 layout=layout, capacity=cap, num_steps=num_steps)
    return write(path, hdr, steps)


def reference_group(g: GroupRows, seqs: list[np.ndarray]) -> dict[str, list[int]]:
    """The full packed buffer of a group, token by token (independent of runtime.data.batch)."""
    out: dict[str, list[int]] = dict(tokens=[], position_ids=[], labels=[], loss_mask=[])
    for s, off, n, p in zip(g.sample_index, g.token_offset, g.num_tokens, g.padded_tokens,
                            strict=True):
        for i in range(p):
            real = i < n
            seq = seqs[s] if s >= 0 else np.zeros(0)
            has_label = real and off + i + 1 < len(seq)
            out["tokens"].append(int(seq[off + i]) if real else 0)
            out["position_ids"].append(i if real else 0)
            out["labels"].append(int(seq[off + i + 1]) if has_label else 0)
            out["loss_mask"].append(1 if has_label else 0)
    return out
