"""Replayed training on 4 real gloo ranks equals the single-process reference, step by step.

One spawn of 4 ranks (dp 2 x cp 2, pool 4) runs every variant in sequence, so the interpreters
start once (the expensive part on a 2-core machine): a planner-made zigzag plan that uses CP
groups of 1, 2 and 4; the same with the contiguous layout; a hand-made plan with split samples
and padding-only fillers; the torch CP path (its CPU stand-in kernel) on the zigzag plan; and a
save at step 2 followed by a resume. The reference runs in the test process. fp32 throughout:
per-step losses and the final parameters must agree to 1e-5 relative.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
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
from planner.groups import catalog
from planner.plan import make_plan
from planner.planfile.io import write_plan
from planner.sources.lengths import read_lengths
from runtime.data.plan_reader import PlanReader
from runtime.dist.groups import GroupCatalog
from runtime.dist.topology import Topology
from runtime.train import TrainConfig, Trainer, TrainResult, main, train_reference
from runtime.train.model import GPTConfig
from tests.dist import run_distributed
from tests.runtime.planfactory import random_plan

pytestmark = pytest.mark.dist

MODEL = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2)
STEPS = 3
CAPACITY = 32
TOL = 1e-5


def _lengths(seed: int = 0) -> np.ndarray:
    """A long-tail mix for pool 4, C = 32: most fit one rank, some need 2 or 4 ranks."""
    rng = np.random.default_rng(seed)
    short = rng.integers(3, 29, size=36)
    medium = rng.integers(40, 60, size=8)  # > C: at least 2 ranks
    long = rng.integers(70, 120, size=4)  # > 2C: 4 ranks
    lengths = np.concatenate([short, medium, long])
    return lengths[rng.permutation(len(lengths))]


def _write_dataset(path: Path, lengths: np.ndarray, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, MODEL.vocab_size, size=int(n)).astype(np.int32) for n in lengths]
    table = pa.table({"input_ids": pa.array(seqs, type=pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=16)
    return path


def _plan(path: Path, data: Path, layout: str) -> Path:
    table = read_lengths(data)
    config = PlannerConfig(parallel=ParallelConfig(dp=2, cp=2), capacity_tokens_per_rank=CAPACITY,
                           global_batch_size=12, layout=layout, seed=3)
    plan = make_plan(table, config, load_cost_model("default"))
    return write_plan(path, plan.header, plan.record_batches())


def _cp_sizes_used(plan: Path, steps: int) -> set[int]:
    reader = PlanReader(plan)
    return {int(k) for i in range(steps) for k in reader.step(i).group_cp_size}


def _cfg(plan: Path, data: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(plan=str(plan), dataset=str(data), steps=STEPS, seed=7, lr=3e-3,
                       quiet=True, **kw)


def _variants(tmp: Path) -> dict[str, TrainConfig]:
    data = tmp / "data.arrow"
    zz, ct, rnd = tmp / "zigzag.arrow", tmp / "contiguous.arrow", tmp / "random.arrow"
    ck = str(tmp / "ckpt")
    return {
        "zigzag": _cfg(zz, data, log_jsonl=str(tmp / "zigzag.jsonl")),
        "contiguous": _cfg(ct, data),
        "random": _cfg(rnd, data),
        "torch": _cfg(zz, data, attention="torch"),
        "save": replace(_cfg(zz, data), steps=2, save=ck),
        "resume": _cfg(zz, data, resume=ck),
    }


def _caller_catalog(rank: int, world_size: int, plan: Path) -> GroupCatalog:
    """Groups made by the caller (as a DeviceMesh would), wrapped with ``from_groups``."""
    header = PlanReader(plan).header
    topo = Topology.from_header(header.parallel, rank=rank, world_size=world_size)
    mapping: dict[tuple[int, int], dist.ProcessGroup | None] = {}
    for start, k in catalog(topo.pool_size, header.cp_sizes):
        group = dist.new_group(list(range(start, start + k))) if k > 1 else None
        if start <= topo.pool_rank < start + k:
            mapping[(start, k)] = group
    return GroupCatalog.from_groups(topo, mapping)


def _rank_fn(rank: int, world_size: int, store: str, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cfg in _variants(Path(tmp)).items():
        result = Trainer(cfg, MODEL).run(keep_state=rank == 0)
        out[name] = result
    cfg = _variants(Path(tmp))["zigzag"]
    cat = _caller_catalog(rank, world_size, Path(cfg.plan))
    out["caller_groups"] = Trainer(replace(cfg, log_jsonl=""), MODEL, catalog=cat).run(
        keep_state=rank == 0)
    return out


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The reference's tiny matmuls run faster on one thread, beside 4 busy ranks on 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, TrainResult]]:
    tmp = tmp_path_factory.mktemp("train")
    data = _write_dataset(tmp / "data.arrow", _lengths())
    _plan(tmp / "zigzag.arrow", data, "zigzag")
    _plan(tmp / "contiguous.arrow", data, "contiguous")
    random_plan(tmp / "random.arrow", read_lengths(data).lengths, dp=2, cp=2, num_steps=STEPS,
                microbatches=2, split_fraction=0.3, seed=5)
    results = run_distributed(_rank_fn, 4, str(tmp), timeout=240)
    return tmp, results[0]


def _assert_same_losses(got: TrainResult, want: TrainResult) -> None:
    assert [g.step for g in got.logs] == [w.step for w in want.logs]
    for g, w in zip(got.logs, want.logs, strict=True):
        assert g.loss_tokens == w.loss_tokens, g.step
        assert g.tokens == w.tokens, g.step
        assert abs(g.loss - w.loss) <= TOL * abs(w.loss), (g.step, g.loss, w.loss)


def _assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = float((got[name] - want[name]).norm() / want[name].norm())
        assert diff <= TOL, (name, diff)


_REFERENCES: dict[str, TrainResult] = {}


def _reference(cfg: TrainConfig) -> TrainResult:
    """The oracle's run for ``cfg``'s plan (cached: the zigzag and torch variants share it)."""
    if cfg.plan not in _REFERENCES:
        _REFERENCES[cfg.plan] = train_reference(
            replace(cfg, resume="", save="", log_jsonl="", attention="reference"), MODEL,
            keep_state=True)
    return _REFERENCES[cfg.plan]


def _check_against_reference(world: tuple[Path, dict[str, TrainResult]], name: str) -> None:
    tmp, results = world
    cfg = _variants(tmp)[name]
    ref = _reference(cfg)
    assert len(ref.logs) == STEPS
    _assert_same_losses(results[name], ref)
    # Gradients first: AdamW is nearly blind to a constant scale error in them.
    _assert_same_params(results[name].grads, ref.grads)
    _assert_same_params(results[name].state, ref.state)


def test_plans_use_cp_sizes_1_2_and_4(world: tuple[Path, dict[str, TrainResult]]) -> None:
    tmp, _ = world
    for layout in ("zigzag", "contiguous"):
        assert _cp_sizes_used(tmp / f"{layout}.arrow", STEPS) == {1, 2, 4}, layout


def test_zigzag_plan_matches_reference(world: tuple[Path, dict[str, TrainResult]]) -> None:
    _check_against_reference(world, "zigzag")
    lines = (world[0] / "zigzag.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(STEPS))
    assert {"step", "loss", "tokens", "seconds", "predicted_s",
            "tokens_per_s"} <= json.loads(lines[0]).keys()
    # Rank 0 of 4 writes the plan's simulated time of each step beside the measured one.
    from planner import read_plan

    simulated = read_plan(world[0] / "zigzag.arrow").summary().column("simulated_s").to_pylist()
    for x in lines:
        d = json.loads(x)
        assert d["predicted_s"] == pytest.approx(simulated[d["step"]], rel=1e-8)


def test_contiguous_plan_matches_reference(world: tuple[Path, dict[str, TrainResult]]) -> None:
    _check_against_reference(world, "contiguous")


def test_split_samples_and_fillers_match_reference(
        world: tuple[Path, dict[str, TrainResult]]) -> None:
    _check_against_reference(world, "random")


def test_torch_cp_path_matches_reference(world: tuple[Path, dict[str, TrainResult]]) -> None:
    _check_against_reference(world, "torch")


def test_caller_owned_groups_give_the_same_run(
        world: tuple[Path, dict[str, TrainResult]]) -> None:
    _, results = world
    got, want = results["caller_groups"], results["zigzag"]
    assert [g.loss for g in got.logs] == [w.loss for w in want.logs]
    _assert_same_params(got.state, want.state)


def test_resume_continues_with_identical_losses(
        world: tuple[Path, dict[str, TrainResult]]) -> None:
    _, results = world
    assert [g.step for g in results["save"].logs] == [0, 1]
    assert [g.step for g in results["resume"].logs] == list(range(2, STEPS))
    for g, w in zip(results["resume"].logs, results["zigzag"].logs[2:], strict=True):
        assert g.loss == w.loss, g.step
    _assert_same_params(results["resume"].state, results["zigzag"].state)


def test_reference_cli_resume_matches_uninterrupted(tmp_path: Path) -> None:
    """``dcp-train --reference`` end to end: save after step 0, resume, same loss at step 1."""
    data = _write_dataset(tmp_path / "data.arrow", _lengths(seed=2))
    plan = _plan(tmp_path / "plan.arrow", data, "zigzag")
    common = ["--plan", str(plan), "--dataset", str(data), "--reference", "--quiet",
              "--vocab-size", "64", "--hidden-size", "32", "--seed", "3", "--steps", "2"]
    assert main([*common, "--log-jsonl", str(tmp_path / "full.jsonl")]) == 0
    assert main([*common, "--steps", "1", "--save", str(tmp_path / "ck")]) == 0
    assert main([*common, "--resume", str(tmp_path / "ck"),
                 "--log-jsonl", str(tmp_path / "resumed.jsonl")]) == 0
    full = [json.loads(x) for x in (tmp_path / "full.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1]
    assert resumed[0]["loss"] == full[1]["loss"]


def test_resume_refuses_another_plan(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint resumes only the plan it was saved with (same dataset and step count or not):
    another plan would replay other batches and the losses would silently diverge."""
    data = _write_dataset(tmp_path / "data.arrow", _lengths(seed=2))
    zz = _plan(tmp_path / "zz.arrow", data, "zigzag")
    ct = _plan(tmp_path / "ct.arrow", data, "contiguous")
    assert PlanReader(zz).num_steps == PlanReader(ct).num_steps
    common = ["--dataset", str(data), "--reference", "--quiet", "--vocab-size", "64",
              "--hidden-size", "32", "--steps", "2"]
    assert main([*common, "--plan", str(zz), "--steps", "1", "--save", str(tmp_path / "ck")]) == 0
    assert main([*common, "--plan", str(ct), "--resume", str(tmp_path / "ck")]) == 2
    assert "checkpoint has plan=" in capsys.readouterr().err


def test_bad_flags_are_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--plan", "p", "--dataset", "d", "--attention", "te"])
    assert "needs --device cuda" in capsys.readouterr().err
    assert main(["--plan", str(tmp_path / "none.arrow"), "--dataset", "d", "--reference"]) == 2



def test_token_ids_beyond_the_vocabulary_are_a_clear_error(tmp_path: Path) -> None:
    """The sample data's ids go up to 32000; a 256-token model must say so, not IndexError."""
    from runtime.train.model import check_token_ids

    with pytest.raises(ValueError, match=r"step 3 sample 7: token id 300 is outside the model's "
                       r"vocabulary \[0, 256\)"):
        check_token_ids(torch.tensor([1, 300, 2]), 256, lambda: "step 3 sample 7")
    check_token_ids(torch.tensor([0, 255]), 256, lambda: "unused")
