"""runtime.data.evaluation on 4 real gloo ranks: a finite pass that stops on every rank together.

The eval plan (dp 2 x cp 2, C = 32) mixes CP groups of 1, 2 and 4 and steps of different
microbatch counts. Every rank drives ``EvalSchedule`` with collectives in *every* microbatch: an
all-reduce over the pool (it completes only if all four ranks are in a microbatch at the same
time, and its max/min of the (step, microbatch) key proves they are in the same one) and an
all-gather inside the microbatch's CP group. After the pass each rank runs one more pool
all-reduce: a rank that stopped early or ran on would leave a peer waiting, and the harness's
timeout turns that hang into a failure. The parent checks that each rank saw exactly the plan's
microbatches and rows, and that the union over ranks is every eval sample once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
import torch.distributed as dist

from planner.config import ParallelConfig, PlannerConfig
from planner.cost import load_cost_model
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.evaluation import EvalSchedule
from runtime.data.plan_reader import PlanReader
from runtime.data.tokens import open_token_source
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from tests.dist import run_distributed

pytestmark = pytest.mark.dist

TIMEOUT_S = 120


def _eval_lengths() -> np.ndarray:
    rng = np.random.default_rng(11)
    lengths = np.concatenate([rng.integers(3, 29, size=30), rng.integers(40, 60, size=6),
                              rng.integers(70, 120, size=3)])
    return lengths[rng.permutation(len(lengths))]


def write_eval_set(tmp: Path, lengths: np.ndarray, *, vocab_size: int = 64,
                   global_batch_size: int = 8, layout: str = "zigzag", dp: int = 2, cp: int = 2,
                   pp: int = 1, name: str = "eval-plan") -> tuple[Path, Path]:
    """A token dataset (Arrow) and its eval plan for dp x cp (default 2 x 2), C = 32."""
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, vocab_size, size=int(n)).astype(np.int32) for n in lengths]
    data = tmp / "eval.arrow"
    table = pa.table({"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(data), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    config = PlannerConfig(parallel=ParallelConfig(dp=dp, cp=cp, pp=pp),
                           capacity_tokens_per_rank=32,
                           global_batch_size=global_batch_size, kind="eval", layout=layout)
    plan = make_plan(read_lengths(data), config, load_cost_model("default"))
    return write_plan(tmp / f"{name}.arrow", plan.header, plan.record_batches()), data


def _drive(schedule: EvalSchedule, rank: int) -> list[dict[str, Any]]:
    pool = schedule.catalog.pool_group if schedule.catalog is not None else None
    seen = []
    for item in schedule:
        x = item.micro.inputs
        key = item.step * 1000 + item.index
        t = torch.tensor([1, key, -key], dtype=torch.int64)
        ones = torch.tensor([1], dtype=torch.int64)
        dist.all_reduce(ones, group=pool)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pool)
        gathered = x.cp_size
        if item.micro.cp_group is not None:
            assert x.tokens is not None
            parts = [torch.empty_like(x.tokens) for _ in range(x.cp_size)]
            dist.all_gather(parts, x.tokens, group=item.micro.cp_group)
            gathered = len(parts)
        seen.append(dict(step=item.step, index=item.index, last=item.last_in_step,
                         ranks_here=int(ones), key_max=int(t[1]), key_min=-int(t[2]),
                         cp_size=x.cp_size, gathered=gathered,
                         samples=item.micro.rows.sample_index.tolist(),
                         offsets=item.micro.rows.token_offset.tolist(),
                         num_tokens=item.micro.rows.num_tokens.tolist(),
                         cp_rank=x.cp_rank))
    # One more collective after the pass: it completes only if every rank stopped here too.
    done = torch.tensor([len(seen)], dtype=torch.int64)
    dist.all_reduce(done, group=pool)
    seen.append(dict(done=int(done)))
    return seen


def _rank_fn(rank: int, world_size: int, store: str, plan: str, data: str) -> dict[str, Any]:
    topo = Topology(world_size=world_size, rank=rank, dp=2, cp=2)
    catalog = GroupCatalog.create(topo, (1, 2, 4))
    out: dict[str, Any] = {}
    with PlanReader(plan) as reader:
        source = open_token_source(data)
        schedule = EvalSchedule(reader, source, topo, catalog)
        out["counts"] = (schedule.num_steps, schedule.step_num_microbatches,
                         schedule.num_microbatches, len(schedule))
        out["first"] = _drive(schedule, rank)
        out["again"] = _drive(schedule, rank)  # a second pass of the same schedule
        short = EvalSchedule(reader, source, topo, catalog, max_steps=2)
        out["short"] = _drive(short, rank)
        # Ranks that would run different passes: refused on every rank, nobody left waiting.
        try:
            EvalSchedule(reader, source, topo, catalog, max_steps=1 if rank == 0 else 0)
            out["disagree"] = "built"
        except ValueError as e:
            out["disagree"] = str(e)
        # A catalog without the eval plan's CP size 4: refused before anything runs.
        small = GroupCatalog.create(topo, (1, 2))
        try:
            EvalSchedule(reader, source, topo, small)
            out["small"] = "built"
        except ValueError as e:
            out["small"] = str(e)
        # Still in lockstep after the refusals: one collective every rank reaches.
        t = torch.ones(1)
        dist.all_reduce(t)
        out["after"] = float(t)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("evaldist")
    plan, data = write_eval_set(tmp, _eval_lengths())
    return plan, data, run_distributed(_rank_fn, 4, str(plan), str(data), timeout=TIMEOUT_S)


def _plan_micro(plan: Path, steps: int) -> list[tuple[int, int]]:
    reader = PlanReader(plan)
    return [(i, m) for i in range(steps) for m in range(reader.step(i).num_microbatches)]


def test_the_eval_plan_mixes_cp_sizes_and_microbatch_counts(world: Any) -> None:
    plan, _, _ = world
    reader = PlanReader(plan)
    assert reader.header.kind == "eval"
    steps = [reader.step(i) for i in range(reader.num_steps)]
    assert {int(k) for s in steps for k in s.group_cp_size} == {1, 2, 4}
    assert len({s.num_microbatches for s in steps}) > 1


@pytest.mark.parametrize("name", ["first", "again", "short"])
def test_every_rank_runs_the_same_microbatches_then_stops(world: Any, name: str) -> None:
    plan, _, results = world
    steps = 2 if name == "short" else PlanReader(plan).num_steps
    want = _plan_micro(plan, steps)
    for rank, res in enumerate(results):
        seen = res[name]
        assert seen[-1] == {"done": 4 * len(want)}, rank
        micro = seen[:-1]
        assert [(s["step"], s["index"]) for s in micro] == want, rank
        for s in micro:
            assert s["ranks_here"] == 4
            assert s["key_max"] == s["key_min"] == s["step"] * 1000 + s["index"]
            assert s["gathered"] == s["cp_size"]
        lasts = [s["last"] for s in micro]
        assert lasts == [i + 1 == len(want) or want[i + 1][0] != want[i][0]
                         for i in range(len(want))]


def test_counts_come_from_the_plan(world: Any) -> None:
    plan, _, results = world
    reader = PlanReader(plan)
    per_step = tuple(reader.step(i).num_microbatches for i in range(reader.num_steps))
    for res in results:
        assert res["counts"] == (reader.num_steps, per_step, sum(per_step), sum(per_step))


def test_union_over_ranks_is_every_sample_once(world: Any) -> None:
    plan, data, results = world
    lengths = read_lengths(data).lengths
    placed: dict[int, int] = {}
    for res in results:
        for s in res["first"][:-1]:
            if s["cp_rank"] != 0:
                continue  # one rank per group reports the group's rows
            for sample, off, n in zip(s["samples"], s["offsets"], s["num_tokens"], strict=True):
                if sample >= 0:
                    assert placed.get(sample, 0) == off
                    placed[sample] = off + n
    assert placed == {i: int(n) for i, n in enumerate(lengths)}


def test_disagreeing_ranks_are_refused_on_every_rank(world: Any) -> None:
    _, _, results = world
    for res in results:
        assert "disagree on the evaluation pass" in res["disagree"]
        assert "eval plan uses CP sizes [4], the training catalog has only [1, 2]" in res["small"]
        assert res["after"] == 4.0
