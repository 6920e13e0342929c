"""Replayed training on 8 real gloo ranks: CP groups of 1, 2, 4 and 8 against the reference.

Issue 6's CPU part. One world of 8 ranks (pool 8, as dp 4 x cp 2 and as dp 2 x cp 4) runs, in
sequence so the interpreters start once, four plans of the same three global batches:

- dynamic: the planner with every group size allowed, at C = 32 tokens per rank, on a long-tail
  mix whose samples need 1, 2, 4 and 8 ranks; every size occurs (asserted);
- static: the planner with ``cp_sizes=(cp,)``, the job's static CP size only, at C = 256 / cp,
  which gives a group of cp the 256 tokens a group of 8 holds at C = 32, so the longest sample
  fits without splitting and the global batches stay the same samples (asserted).

Checks (fp32, 1e-5 relative): each dynamic run's per-step losses, last-step gradients and final
parameters equal the single-process reference's (``runtime.train.oracle``, run in the test process),
and each static run's per-step losses equal the dynamic run's of the same layout. The helpers
come from test_train_dist.py (the 4-rank test); only the data and the 8-rank world are new here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.train import Trainer, TrainResult
from tests.dist import run_distributed
from tests.runtime.train.test_train_dist import (
    MODEL,
    STEPS,
    _assert_same_losses,
    _assert_same_params,
    _cfg,
    _cp_sizes_used,
    _one_thread,  # noqa: F401 - autouse fixture: the reference runs on one thread
    _reference,
    _write_dataset,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

POOL = 8
CAPACITY = 32
GLOBAL_BATCH = 12
LAYOUTS = ((4, 2), (2, 4))  # (dp, cp)


def _lengths(seed: int = 0) -> np.ndarray:
    """A long-tail mix for pool 8, C = 32: most fit one rank, a few need 2, 4 or all 8 ranks."""
    rng = np.random.default_rng(seed)
    short = rng.integers(3, 29, size=24)
    medium = rng.integers(40, 60, size=6)  # > C: at least 2 ranks
    long = rng.integers(70, 120, size=3)  # > 2C: 4 ranks
    longest = rng.integers(140, 240, size=3)  # > 4C: 8 ranks
    lengths = np.concatenate([short, medium, long, longest])
    return lengths[rng.permutation(len(lengths))]


def _name(kind: str, dp: int, cp: int) -> str:
    return f"{kind}_dp{dp}_cp{cp}"


def _plan(path: Path, data: Path, dp: int, cp: int, static: bool) -> Path:
    capacity = CAPACITY * POOL // cp if static else CAPACITY
    config = PlannerConfig(parallel=ParallelConfig(dp=dp, cp=cp),
                           capacity_tokens_per_rank=capacity, global_batch_size=GLOBAL_BATCH,
                           cp_sizes=(cp,) if static else (), seed=3)
    plan = make_plan(read_lengths(data), config, load_cost_model("default"))
    return write_plan(path, plan.header, plan.record_batches())


def _names() -> list[str]:
    return [_name(kind, dp, cp) for dp, cp in LAYOUTS for kind in ("dynamic", "static")]


def _rank_fn(rank: int, world_size: int, store: str, tmp: str) -> dict[str, TrainResult]:
    data = Path(tmp) / "data.arrow"
    out: dict[str, TrainResult] = {}
    for name in _names():
        cfg = _cfg(Path(tmp) / f"{name}.arrow", data)
        out[name] = Trainer(cfg, MODEL).run(keep_state=rank == 0)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, TrainResult]]:
    tmp = tmp_path_factory.mktemp("train8")
    data = _write_dataset(tmp / "data.arrow", _lengths())
    for dp, cp in LAYOUTS:
        for kind in ("dynamic", "static"):
            _plan(tmp / f"{_name(kind, dp, cp)}.arrow", data, dp, cp, static=kind == "static")
    results = run_distributed(_rank_fn, POOL, str(tmp), timeout=240)
    return tmp, results[0]


def _samples_per_step(plan: Path) -> list[list[int]]:
    reader = PlanReader(plan)
    return [sorted({int(s) for s in reader.step(i).sample_index if s >= 0})
            for i in range(reader.num_steps)]


def test_plans_mix_sizes_1_2_4_8_over_the_same_global_batches(
        world: tuple[Path, dict[str, TrainResult]]) -> None:
    tmp, _ = world
    for dp, cp in LAYOUTS:
        dynamic, static = (tmp / f"{_name(k, dp, cp)}.arrow" for k in ("dynamic", "static"))
        assert PlanReader(dynamic).header.parallel.cp == cp
        assert _cp_sizes_used(dynamic, STEPS) == {1, 2, 4, 8}, (dp, cp)
        assert _cp_sizes_used(static, STEPS) == {cp}, (dp, cp)
        batches = _samples_per_step(dynamic)
        assert len(batches) == STEPS
        assert sum(len(b) for b in batches) == len(_lengths())  # nothing dropped or split away
        assert batches == _samples_per_step(static), (dp, cp)


@pytest.mark.parametrize(("dp", "cp"), LAYOUTS)
def test_dynamic_plan_matches_reference(world: tuple[Path, dict[str, TrainResult]], dp: int,
                                        cp: int) -> None:
    tmp, results = world
    got = results[_name("dynamic", dp, cp)]
    ref = _reference(_cfg(tmp / f"{_name('dynamic', dp, cp)}.arrow", tmp / "data.arrow"))
    assert len(ref.logs) == STEPS
    _assert_same_losses(got, ref)
    # Gradients first: AdamW is nearly blind to a constant scale error in them.
    _assert_same_params(got.grads, ref.grads)
    _assert_same_params(got.state, ref.state)


@pytest.mark.parametrize(("dp", "cp"), LAYOUTS)
def test_static_plan_has_the_same_losses(world: tuple[Path, dict[str, TrainResult]], dp: int,
                                         cp: int) -> None:
    _, results = world
    dynamic, static = results[_name("dynamic", dp, cp)], results[_name("static", dp, cp)]
    assert len(static.logs) == STEPS
    _assert_same_losses(static, dynamic)  # token counts equal, losses to 1e-5 relative
