"""torchtitan's own trainer replaying a plan on 4 real gloo ranks equals the one-process oracle.

One spawn of 4 ranks (pool dp 2 x cp 2, FSDP over all 4) runs, against the real torchtitan
package: the planner-made zigzag plan using CP groups of 1, 2 and 4 for 3 steps; the same plan
saved after step 2 through torchtitan's checkpointer and resumed for step 3; a resume of that
checkpoint with another plan (refused); evaluation of an eval plan (CP 1/2/4) through
torchtitan's validation hook after steps 2 and 3. The oracle (``--reference --framework
torchtitan``: the same llama3 and weights, every segment alone, no CP, no FSDP) runs in the test
process. fp32: per-step losses, the last step's gradients, the final parameters and the
evaluations agree to 1e-5 relative.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.train.config import TrainConfig
from runtime.train.model import GPTConfig
from runtime.train.runlog import StepLog, TrainResult
from tests.dist import run_distributed
from tests.runtime.data.test_eval_dist import _eval_lengths, write_eval_set
from tests.runtime.train.test_train_dist import _cp_sizes_used, _lengths, _plan, _write_dataset

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.dist

MODEL = GPTConfig(vocab_size=64, num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2)
STEPS = 3
TOL = 1e-5
# AdamW's first update is lr * sign(grad) wherever |grad| >> eps: an element whose gradient is
# near zero takes +-lr on fp32 rounding alone, so the parameters' relative difference between
# two correct fp32 runs grows with lr. At 3e-3 it reached 1.8e-5 under torch 2.11's CPU kernels
# (step-0 gradients 5e-7 apart; against an fp64 oracle the fp32 oracle itself was 1.3e-5 off):
# at 1e-3 the worst tensor was 7e-6 there, and a real error (a dropped token, a scale) is orders
# of magnitude larger.
LR = 1e-3


def _cfg(tmp: Path, plan: str = "zigzag", **kw: Any) -> TrainConfig:
    fields: dict[str, Any] = {"steps": STEPS, "seed": 7, "lr": LR, "quiet": True, **kw}
    return TrainConfig(plan=str(tmp / f"{plan}.arrow"), dataset=str(tmp / "data.arrow"),
                       **fields)


def _with_eval(tmp: Path, **kw: Any) -> TrainConfig:
    """Evaluate the eval plan after every 2 steps and after the last (steps 2 and 3)."""
    return _cfg(tmp, eval_plan=str(tmp / "eval-zigzag.arrow"),
                eval_dataset=str(tmp / "eval.arrow"), eval_interval=2, **kw)


def _run(cfg: TrainConfig, *, keep_state: bool) -> dict[str, Any]:
    from runtime.adapters.torchtitan import build_trainer

    trainer = build_trainer(cfg, MODEL)
    try:
        trainer.train()
        out: dict[str, Any] = {"logs": list(trainer.logs), "evals": trainer.evals}
        if keep_state:
            out["state"], out["grads"] = trainer.full_state()
    finally:
        trainer.close()
    return out


def _rank_fn(rank: int, world_size: int, store: str, tmp_dir: str) -> dict[str, Any]:
    tmp = Path(tmp_dir)
    ckpt = str(tmp / "ckpt")
    out = {"full": _run(_with_eval(tmp, log_jsonl=str(tmp / "full.jsonl")), keep_state=True),
           "save": _run(_cfg(tmp, steps=2, save=ckpt), keep_state=False),
           "resume": _run(_cfg(tmp, resume=ckpt), keep_state=True)}
    try:
        _run(_cfg(tmp, plan="contiguous", resume=ckpt), keep_state=False)
        out["other_plan"] = ""
    except ValueError as e:
        out["other_plan"] = str(e)
    try:
        _run(_cfg(tmp, resume=ckpt, lr=0.5), keep_state=False)
        out["other_lr"] = ""
    except ValueError as e:
        out["other_lr"] = str(e)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("titan")
    data = _write_dataset(tmp / "data.arrow", _lengths())
    _plan(tmp / "zigzag.arrow", data, "zigzag")
    _plan(tmp / "contiguous.arrow", data, "contiguous")
    write_eval_set(tmp, _eval_lengths(), layout="zigzag", name="eval-zigzag")
    results = run_distributed(_rank_fn, 4, str(tmp), timeout=400)
    results[0]["other_lr_by_rank"] = [r["other_lr"] for r in results]
    return tmp, results[0]


@pytest.fixture(scope="module")
def reference(world: tuple[Path, dict[str, Any]]) -> TrainResult:
    from runtime.adapters.torchtitan import train_reference

    return train_reference(_with_eval(world[0]), MODEL)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = float((got[name] - want[name]).norm() / want[name].norm())
        assert diff <= TOL, (name, diff)


def _assert_same_losses(got: list[StepLog], want: list[StepLog]) -> None:
    assert [g.step for g in got] == [w.step for w in want]
    for g, w in zip(got, want, strict=True):
        assert (g.tokens, g.loss_tokens) == (w.tokens, w.loss_tokens), g.step
        assert abs(g.loss - w.loss) <= TOL * abs(w.loss), (g.step, g.loss, w.loss)


def test_plan_uses_cp_sizes_1_2_and_4(world: tuple[Path, dict[str, Any]]) -> None:
    assert _cp_sizes_used(world[0] / "zigzag.arrow", STEPS) == {1, 2, 4}


def test_losses_grads_and_params_match_oracle(world: tuple[Path, dict[str, Any]],
                                              reference: TrainResult) -> None:
    full = world[1]["full"]
    assert len(reference.logs) == STEPS
    _assert_same_losses(full["logs"], reference.logs)
    # Gradients first: AdamW is nearly blind to a constant scale error in them. They are read
    # from the resumed run (its last step is step 2 too): the full run evaluated after step 2,
    # and FSDP's forward frees some sharded gradients of the step before (harmless: the next
    # step zeroes them anyway).
    _assert_close(world[1]["resume"]["grads"], reference.grads)
    _assert_close(full["state"], reference.state)
    assert [g.microbatches for g in full["logs"]] == [
        _num_microbatches(world[0], s) for s in range(STEPS)]


def _num_microbatches(tmp: Path, step: int) -> int:
    from runtime.data.plan_reader import PlanReader

    with PlanReader(tmp / "zigzag.arrow") as reader:
        return reader.step(step).num_microbatches


def test_evaluation_through_the_validation_hook_matches_oracle(
        world: tuple[Path, dict[str, Any]], reference: TrainResult) -> None:
    from runtime.data.plan_reader import PlanReader

    got = world[1]["full"]["evals"]
    assert [e.after_step for e in reference.evals] == [1, 2]  # 0-based steps
    assert [e.after_step for e in got] == [1, 2]
    with PlanReader(world[0] / "eval-zigzag.arrow") as reader:
        assert {int(k) for i in range(reader.num_steps) for k in reader.step(i).group_cp_size
                } == {1, 2, 4}
        num_microbatches = sum(reader.step(i).num_microbatches for i in range(reader.num_steps))
    for g, w in zip(got, reference.evals, strict=True):
        assert g.eval_tokens == w.eval_tokens > 0
        assert abs(g.eval_loss - w.eval_loss) <= TOL * abs(w.eval_loss), (g, w)
        assert g.eval_microbatches == num_microbatches
    assert got[0].eval_loss != got[1].eval_loss  # the model trained in between


def test_rank0_writes_one_json_line_per_step_and_evaluation(
        world: tuple[Path, dict[str, Any]]) -> None:
    every = [json.loads(x) for x in (world[0] / "full.jsonl").read_text().splitlines()]
    lines = [x for x in every if "step" in x]
    # Each evaluation right after the line of the step it follows (0-based, as "step").
    assert [x["step"] if "step" in x else f"after {x['after_step']}" for x in every] == [
        0, 1, "after 1", 2, "after 2"]
    assert [x["step"] for x in lines] == list(range(STEPS))
    assert {"step", "loss", "tokens", "loss_tokens", "microbatches", "seconds",
            "predicted_s", "tokens_per_s"} <= lines[0].keys()
    assert [x["loss"] for x in lines] == [g.loss for g in world[1]["full"]["logs"]]


def test_resume_gives_the_uninterrupted_losses(world: tuple[Path, dict[str, Any]]) -> None:
    tmp, results = world
    assert (tmp / "ckpt" / "step-2" / ".metadata").is_file()
    from runtime.adapters.torchtitan.config import is_titan_checkpoint

    # What --save's start-up check recognises as torchtitan's own (everything in it is DCP's).
    assert is_titan_checkpoint(tmp / "ckpt" / "step-2")
    full, saved, resumed = results["full"], results["save"], results["resume"]
    assert [g.step for g in saved["logs"]] == [0, 1]
    assert [g.step for g in resumed["logs"]] == [2]
    # Bit for bit on CPU: same data, exactly restored weights, optimizer and plan position;
    # and the uninterrupted run evaluated twice, the cut one never: evaluation changes nothing.
    assert [g.loss for g in saved["logs"] + resumed["logs"]] == [g.loss for g in full["logs"]]
    for name, want in full["state"].items():
        assert torch.equal(resumed["state"][name], want), name


def test_resume_with_another_plan_is_refused(world: tuple[Path, dict[str, Any]]) -> None:
    message = world[1]["other_plan"]
    assert "resume with the same plan" in message
    assert "contiguous.arrow" in message


def test_resume_with_another_lr_is_refused_on_every_rank(
        world: tuple[Path, dict[str, Any]]) -> None:
    step = world[0] / "ckpt" / "step-2"
    assert world[1]["other_lr_by_rank"] == [
        f"{step}: the checkpoint was saved with --lr {LR:g}, this run has --lr 0.5; resume with "
        f"--lr {LR:g} (the optimizer state carries it), or start a new run"] * 4


def test_cli_reference_writes_json_lines(world: tuple[Path, dict[str, Any]],
                                         reference: TrainResult, tmp_path: Path) -> None:
    from runtime.train.cli import main

    cfg = _cfg(world[0])
    log = tmp_path / "ref.jsonl"
    argv = ["--framework", "torchtitan", "--reference", "--plan", cfg.plan, "--dataset",
            cfg.dataset, "--steps", "1", "--seed", "7", "--lr", str(LR), "--quiet",
            "--log-jsonl", str(log), "--vocab-size", "64", "--layers", "2",
            "--hidden-size", "64", "--heads", "4", "--query-groups", "2"]
    assert main(argv) == 0
    line = json.loads(log.read_text())
    assert line["step"] == 0
    assert line["loss"] == pytest.approx(reference.logs[0].loss, rel=TOL)


def test_cli_refuses_a_save_directory_that_holds_checkpoints(
        world: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.adapters.torchtitan.config import checkpoint_config

    cfg = _cfg(world[0], save=str(world[0] / "ckpt"))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        checkpoint_config(cfg)
    assert checkpoint_config(replace(cfg, resume=cfg.save)).folder == cfg.save
    with pytest.raises(ValueError, match="no complete torchtitan checkpoint"):
        checkpoint_config(replace(cfg, save="", resume=str(world[0])))


def test_data_loader_refuses_a_job_the_plan_was_not_made_for(
        world: tuple[Path, dict[str, Any]]) -> None:
    from runtime.adapters.torchtitan import PlanDataLoader

    cfg = _cfg(world[0])
    config = PlanDataLoader.Config(plan=cfg.plan, dataset=cfg.dataset)
    with pytest.raises(ValueError, match="pool of 4 ranks, torchtitan's data-parallel world is 2"):
        PlanDataLoader(config, dp_world_size=2, dp_rank=0)
    with pytest.raises(ValueError, match="local_batch_size must be 1"):
        PlanDataLoader(config, dp_world_size=4, dp_rank=0, local_batch_size=8)
    with pytest.raises(ValueError, match="needs plan= and dataset="):
        PlanDataLoader(PlanDataLoader.Config(plan=cfg.plan), dp_world_size=4, dp_rank=0)
