"""stepcheck.rows_valid (the fast path) agrees with the worded numpy checks, both ways.

Real plans from the planner (several pools, tp', layouts, padding and VPP multiples) are valid
step by step; then each step is mutated at random (a value changed, rows swapped, dropped or
duplicated) and the fast path must say "invalid" exactly when the numpy checks word an error.
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.schema import NUMPY_DTYPES
from planner.planfile.validate import _Errors, _fast_valid, _word_step_errors
from planner.sources.lengths import LengthTable

CONFIGS = [
    dict(parallel=ParallelConfig(dp=2, cp=4), capacity_tokens_per_rank=4096),
    dict(parallel=ParallelConfig(dp=4, cp=2, tp=2), capacity_tokens_per_rank=4096,
         layout="contiguous"),
    dict(parallel=ParallelConfig(dp=3, cp=2), capacity_tokens_per_rank=2048, pad_to_multiple=48),
    dict(parallel=ParallelConfig(dp=2, cp=2, pp=2, vpp=2), capacity_tokens_per_rank=4096),
]


def _plan_steps(config: dict[str, object], seed: int) -> tuple[object, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(6.5, 1.3, 300).astype(np.int64).clip(1, 30_000)
    table = LengthTable(path="mem.txt", format="text", lengths=lengths,
                        skipped=np.zeros(0, np.int64))
    plan = make_plan(table, PlannerConfig(**config, global_batch_size=48,  # type: ignore[arg-type]
                                          long_sequences="split"),
                     load_cost_model("dense-7b-h200"))
    return plan.header, plan.steps


def _worded(i: int, cols: dict[str, np.ndarray], header: object) -> list[str]:
    err = _Errors(limit=1000)
    _word_step_errors(i, cols, header, err)  # type: ignore[arg-type]
    return err.items


def _mutate(cols: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in cols.items()}
    rows = len(out["step"])
    kind = rng.integers(0, 4)
    if kind == 0 or rows < 2:            # one value changed
        name = str(rng.choice(list(out)))
        j = int(rng.integers(0, rows))
        delta = int(rng.choice([-1, 1, 2, -2, 7, 64, -64, 1000]))
        out[name][j] = out[name][j] + delta
    elif kind == 1:                      # two rows swapped
        a, b = rng.choice(rows, 2, replace=False)
        for v in out.values():
            v[[a, b]] = v[[b, a]]
    elif kind == 2:                      # a row dropped
        j = int(rng.integers(0, rows))
        out = {k: np.delete(v, j) for k, v in out.items()}
    else:                                # a row duplicated
        j = int(rng.integers(0, rows))
        out = {k: np.insert(v, j, v[j]) for k, v in out.items()}
    return {k: v.astype(NUMPY_DTYPES[k]) for k, v in out.items()}


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_fast_path_agrees_with_the_worded_checks(index: int) -> None:
    header, steps = _plan_steps(CONFIGS[index], index)
    rng = np.random.default_rng(100 + index)
    mutated_bad = 0
    for i, cols in enumerate(steps):
        assert _fast_valid(i, cols, header)  # type: ignore[arg-type]
        assert _worded(i, cols, header) == []
        for _ in range(60):
            bad = _mutate(cols, rng)
            worded = _worded(i, bad, header)
            assert _fast_valid(i, bad, header) == (not worded), worded  # type: ignore[arg-type]
            mutated_bad += bool(worded)
    assert mutated_bad > 100       # the mutations do reach the checks


def test_wrong_step_number_and_dtypes() -> None:
    header, steps = _plan_steps(CONFIGS[0], 7)
    assert not _fast_valid(1, steps[0], header)  # type: ignore[arg-type]
    assert _worded(1, steps[0], header)
    wide = {k: v.astype(np.int64) for k, v in steps[0].items()}
    assert not _fast_valid(0, wide, header)      # type: ignore[arg-type]
    assert _worded(0, wide, header) == []        # the numpy checks take any integer dtype
