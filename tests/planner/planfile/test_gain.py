"""The predicted gain's header keys: their text for every case, and validate's shape checks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import Plan, make_plan
from planner.planfile.gain import NOT_RECORDED, gain_text
from planner.planfile.validate import validate
from planner.sources.lengths import LengthTable

COST = load_cost_model("default")


def _plan(lengths: np.ndarray) -> Plan:
    table = LengthTable(path="mem.txt", format="text", lengths=lengths,
                        skipped=np.zeros(0, np.int64))
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=2048,
                           global_batch_size=16, long_sequences="split")
    return make_plan(table, config, COST)


def test_text_gives_a_number_a_partial_view_or_the_reason() -> None:
    rng = np.random.default_rng(1)
    short = rng.integers(100, 1500, 64).astype(np.int64)
    plan = _plan(short)
    stats = plan.header.stats
    lines = gain_text(stats, 2)
    assert lines[0].startswith(f"{stats['vs_static_cp']:.3f}x over static CP 2 (per step: min")
    assert lines[1].startswith(f"{stats['vs_megatron']:.3f}x over Megatron's greedy")
    # A sample longer than cp x C: static CP cannot run its step, the rest is still described.
    long = np.r_[short, 6000].astype(np.int64)
    stats = _plan(long).header.stats
    assert stats["vs_static_cp"] is None
    assert stats["baselines"]["static-cp"]["infeasible_steps"] == 1
    assert gain_text(stats, 2)[0].startswith("static CP 2: cannot run 1 of 5 steps (")
    assert "on the steps it can run, median" in gain_text(stats, 2)[0]
    assert gain_text({"num_steps": 3}, 2) == [NOT_RECORDED]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b["static-cp"]["per_step"].pop(), "per_step holds 3 steps, the plan has 4"),
    (lambda b: b["megatron-greedy"]["per_step"].__setitem__(0, 0.5), "a ratio below 1"),
    (lambda b: b.pop("megatron-greedy"), "no 'megatron-greedy' entry"),
    (lambda b: b["static-cp"]["parts"].__setitem__("ring", b["static-cp"]["parts"]["ring"] + 1),
     "parts sum to .* not the baseline's seconds less the plan's"),
    (lambda b: b["megatron-greedy"]["parts"].pop("padding"), "parts must hold numbers"),
])
def test_validate_refuses_a_gain_of_the_wrong_shape(edit: Callable[[dict[str, Any]], object],
                                                    message: str) -> None:
    plan = _plan(np.full(64, 1000, np.int64))
    header = plan.header
    stats = json.loads(json.dumps(header.stats))
    validate(header, list(plan.record_batches()))
    edit(stats["baselines"])
    bad = dataclasses.replace(header, stats=stats)
    with pytest.raises(ValueError, match=message):
        validate(bad, list(plan.record_batches()))
