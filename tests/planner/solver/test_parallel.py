"""``workers``: the plan file is byte-identical for every number of worker processes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from planner.config import ParallelConfig, PlannerConfig, SolverConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import LengthTable


def test_workers_give_byte_identical_plans(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    lengths = np.where(rng.random(6000) < 0.02, rng.integers(20_000, 200_000, 6000),
                       rng.lognormal(6.5, 1.2, 6000).astype(np.int64) + 1)
    table = LengthTable(path="mem.txt", format="text", lengths=lengths.astype(np.int64),
                        skipped=np.zeros(0, np.int64))
    digests = []
    for workers in (1, 2):
        # refine_gap 0: CP-SAT runs in the workers too, and must agree with this process.
        cfg = PlannerConfig(parallel=ParallelConfig(dp=4, cp=2), capacity_tokens_per_rank=32_768,
                            global_batch_size=200, long_sequences="split", workers=workers,
                            solver=SolverConfig(refine_gap=0.0))
        plan = make_plan(table, cfg, load_cost_model())
        assert plan.header.stats["num_steps"] >= 16
        path = write_plan(tmp_path / f"w{workers}.arrow", plan.header, plan.record_batches())
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
