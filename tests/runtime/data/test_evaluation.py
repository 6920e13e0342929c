"""EvalSchedule in one process (no groups): counts, laziness, re-iteration and every refusal.

The 4-rank behaviour (every rank stops together, collectives in every microbatch) is in
test_eval_dist.py; here the schedule runs as one pool rank of a pool of 4 without a catalog.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.evaluation import EvalSchedule, check_eval_layout
from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import open_token_source
from runtime.dist.topology import Topology
from tests.runtime.data.test_eval_dist import _eval_lengths, write_eval_set


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_eval_set(tmp_path_factory.mktemp("evalset"), _eval_lengths())


def _topo(rank: int = 1, dp: int = 2, cp: int = 2) -> Topology:
    return Topology(world_size=dp * cp, rank=rank, dp=dp, cp=cp)


def test_counts_laziness_and_a_fresh_pass_per_iteration(eval_set: tuple[Path, Path]) -> None:
    plan, data = eval_set
    reader = PlanReader(plan)
    sched = EvalSchedule(reader, open_token_source(data), _topo())
    per_step = tuple(reader.step(i).num_microbatches for i in range(reader.num_steps))
    assert sched.num_steps == reader.num_steps > 2
    assert sched.step_num_microbatches == per_step
    assert sched.num_microbatches == len(sched) == sum(per_step)
    first = [(m.step, m.index, m.last_in_step) for m in sched]
    assert first == [(i, m, m == n - 1) for i, n in enumerate(per_step) for m in range(n)]
    assert [(m.step, m.index) for m in sched] == [(s, i) for s, i, _ in first]
    it = sched.step_microbatches(1)
    got = next(it)  # lazy: built on demand, in order
    assert got.rows.microbatch == 0
    assert len(list(it)) == per_step[1] - 1
    with pytest.raises(ValueError, match="eval step 99 out of range"):
        next(sched.step_microbatches(99))
    short = EvalSchedule(reader, open_token_source(data), _topo(), max_steps=2)
    assert (short.num_steps, short.num_microbatches) == (2, sum(per_step[:2]))
    longer = EvalSchedule(reader, open_token_source(data), _topo(), max_steps=10_000)
    assert longer.num_steps == reader.num_steps  # never more steps than the plan holds


def test_a_train_plan_is_refused(tmp_path: Path, eval_set: tuple[Path, Path]) -> None:
    _, data = eval_set
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=32,
                           global_batch_size=8)
    plan = make_plan(read_lengths(data), config, load_cost_model())
    path = write_plan(tmp_path / "train.arrow", plan.header, plan.record_batches())
    with pytest.raises(ValueError, match="not an evaluation plan .kind 'train'.; make one with "
                                         "dcp-plan DATASET --eval"):
        EvalSchedule(PlanReader(path), open_token_source(data), _topo())


def test_refusals(tmp_path: Path, eval_set: tuple[Path, Path]) -> None:
    plan, data = eval_set
    reader = PlanReader(plan)
    source = open_token_source(data)
    with pytest.raises(ValueError, match="max_steps must be >= 0"):
        EvalSchedule(reader, source, _topo(), max_steps=-1)
    with pytest.raises(ValueError, match="plan built for world_size=4 .* got world_size=8"):
        EvalSchedule(reader, source, _topo(dp=4))
    _, other = write_eval_set(tmp_path, _eval_lengths()[:-1])
    with pytest.raises(ValueError, match="plan built for a dataset of 39 samples"):
        EvalSchedule(reader, open_token_source(other), _topo())


def test_check_eval_layout_names_both_plans(eval_set: tuple[Path, Path]) -> None:
    plan, _ = eval_set
    ev = PlanReader(plan).header
    p = ev.parallel
    check_eval_layout(ev, replace(ev, kind="train"))
    # The pool may be split another way (dp 4 x cp 1 against dp 2 x cp 2): same pool ranks.
    check_eval_layout(ev, replace(ev, parallel=replace(p, dp=4, cp=1)))
    bigger = replace(ev, parallel=replace(p, dp=4, pool_size=8), cp_sizes=(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"e\.arrow is built for pool 4 \(dp 2 x cp 2\), tp 1, "
                                         r"pp 1, the training job \(t\.arrow\) for pool 8 "
                                         r"\(dp 4 x cp 2\), tp 1, pp 1"):
        check_eval_layout(ev, bigger, eval_source="e.arrow", train_source="t.arrow")
    with pytest.raises(ValueError, match="tp 2"):
        check_eval_layout(ev, replace(ev, parallel=replace(p, tp=2)))
    with pytest.raises(ValueError, match=r"uses CP sizes \[4\] that t\.arrow does not"):
        check_eval_layout(ev, replace(ev, cp_sizes=(1, 2)), train_source="t.arrow")
    assert np.array_equal(np.asarray(ev.cp_sizes), np.array([1, 2, 4]))


def test_pipeline_stages_get_the_same_pass(tmp_path: Path) -> None:
    """pp = 2: both stages of a pool rank run the same microbatches; the first builds tokens,
    the last labels (what a pipelined eval hook feeds each stage)."""
    plan, data = write_eval_set(tmp_path, _eval_lengths(), pp=2)
    reader = PlanReader(plan)
    passes = []
    for pp_rank in (0, 1):
        topo = Topology(world_size=8, rank=1 + 4 * pp_rank, dp=2, cp=2, pp=2)
        assert (topo.pp_rank, topo.pool_rank) == (pp_rank, 1)
        items = list(EvalSchedule(reader, open_token_source(data), topo))
        firsts = {m.micro.inputs.tokens is not None for m in items}
        lasts = {m.micro.inputs.labels is not None for m in items}
        assert (firsts, lasts) == (({True}, {False}) if pp_rank == 0 else ({False}, {True}))
        passes.append([(m.step, m.index, m.micro.rows.sample_index.tolist()) for m in items])
    assert passes[0] == passes[1]
    assert len(passes[0]) == sum(reader.step(i).num_microbatches
                                 for i in range(reader.num_steps))
