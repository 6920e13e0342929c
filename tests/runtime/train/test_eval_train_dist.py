"""``dcp-train --eval-plan`` on 4 real gloo ranks: eval losses, training untouched, resume.

One spawn of 4 ranks (dp 2 x cp 2) trains 3 steps of a zigzag plan: without evaluation; with an
eval plan whose steps mix CP 1, 2 and 4 every 2 steps (evaluations after steps 2 and 3); the
same run cut in two by a save after step 2 (just after an evaluation) and a resume; and one
that evaluates only the first 2 steps of a *contiguous* eval plan, only after the last step.
fp32 throughout. Checks: every evaluation equals the single-process oracle's
(``--reference``, every sequence alone) to 1e-5 relative with the same token count; training
losses and final weights with evaluation equal those without it bit for bit; the save/resume
pair gives the uninterrupted run's losses and evaluations bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.data.plan_reader import PlanReader
from runtime.train import TrainConfig, Trainer, TrainResult, main, train_reference
from tests.dist import run_distributed
from tests.runtime.data.test_eval_dist import _eval_lengths, write_eval_set
from tests.runtime.train.test_train_dist import (
    MODEL,
    STEPS,
    TOL,
    _cfg,
    _lengths,
    _plan,
    _write_dataset,
)

pytestmark = pytest.mark.dist


def _variants(tmp: Path) -> dict[str, TrainConfig]:
    data, zz = tmp / "data.arrow", tmp / "zigzag.arrow"
    ev = dict(eval_plan=str(tmp / "eval-zigzag.arrow"), eval_dataset=str(tmp / "eval.arrow"))
    ck = str(tmp / "ckpt")
    return {
        "plain": _cfg(zz, data),
        "eval": _cfg(zz, data, eval_interval=2, log_jsonl=str(tmp / "eval.jsonl"), **ev),
        "eval_save": replace(_cfg(zz, data, eval_interval=2, save=ck, **ev), steps=2),
        "eval_resume": _cfg(zz, data, eval_interval=2, resume=ck, **ev),
        "eval_contiguous": _cfg(zz, data, eval_steps=2, **{
            **ev, "eval_plan": str(tmp / "eval-contiguous.arrow")}),
    }


def _rank_fn(rank: int, world_size: int, store: str, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cfg in _variants(Path(tmp)).items():
        trainer = Trainer(cfg, MODEL)
        try:
            out[name] = trainer.run(keep_state=True)
        finally:
            trainer.close()
    return out


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, TrainResult]]]:
    tmp = tmp_path_factory.mktemp("evaltrain")
    data = _write_dataset(tmp / "data.arrow", _lengths())
    _plan(tmp / "zigzag.arrow", data, "zigzag")
    for layout in ("zigzag", "contiguous"):
        write_eval_set(tmp, _eval_lengths(), layout=layout, name=f"eval-{layout}")
    return tmp, run_distributed(_rank_fn, 4, str(tmp), timeout=300)


def _eval_microbatches(plan: str, steps: int = 0) -> int:
    reader = PlanReader(plan)
    n = min(steps, reader.num_steps) if steps else reader.num_steps
    return sum(reader.step(i).num_microbatches for i in range(n))


def test_eval_plan_mixes_cp_1_2_and_4(world: tuple[Path, list[dict[str, TrainResult]]]) -> None:
    tmp, _ = world
    reader = PlanReader(tmp / "eval-zigzag.arrow")
    assert reader.header.kind == "eval"
    assert {int(k) for i in range(reader.num_steps)
            for k in reader.step(i).group_cp_size} == {1, 2, 4}


@pytest.mark.parametrize("name", ["eval", "eval_contiguous"])
def test_eval_losses_equal_the_reference(world: tuple[Path, list[dict[str, TrainResult]]],
                                         name: str) -> None:
    tmp, results = world
    cfg = _variants(tmp)[name]
    ref = train_reference(replace(cfg, log_jsonl=""), MODEL)
    want_at = [1, 2] if name == "eval" else [2]  # 0-based: the 3-step run's last step is 2
    assert [e.after_step for e in ref.evals] == want_at
    for rank, res in enumerate(results):
        got = res[name].evals
        assert [e.after_step for e in got] == want_at, rank
        for g, w in zip(got, ref.evals, strict=True):
            assert g.eval_tokens == w.eval_tokens > 0
            assert abs(g.eval_loss - w.eval_loss) <= TOL * abs(w.eval_loss), (g, w)
            assert g.eval_microbatches == _eval_microbatches(cfg.eval_plan, cfg.eval_steps)
    # The evaluations after steps 1 and 2 differ (the model trained in between).
    if name == "eval":
        assert ref.evals[0].eval_loss != ref.evals[1].eval_loss


def test_training_with_evaluation_is_bit_for_bit_the_same(
        world: tuple[Path, list[dict[str, TrainResult]]]) -> None:
    _, results = world
    for res in results:
        plain = res["plain"]
        for name in ("eval", "eval_contiguous"):
            got = res[name]
            assert [g.loss for g in got.logs] == [w.loss for w in plain.logs]
            assert [g.loss_tokens for g in got.logs] == [w.loss_tokens for w in plain.logs]
            for key, value in plain.state.items():
                assert torch.equal(got.state[key], value), (name, key)
            for key, value in plain.grads.items():
                assert torch.equal(got.grads[key], value), (name, key)
        assert plain.evals == []


def test_save_and_resume_across_an_evaluation(
        world: tuple[Path, list[dict[str, TrainResult]]]) -> None:
    _, results = world
    for res in results:
        whole, first, second = res["eval"], res["eval_save"], res["eval_resume"]
        assert [g.step for g in first.logs] == [0, 1]
        assert [g.step for g in second.logs] == [2]
        assert [g.loss for g in first.logs + second.logs] == [w.loss for w in whole.logs]
        assert [e.after_step for e in first.evals] == [1]
        assert [e.after_step for e in second.evals] == [2]
        pairs = zip(first.evals + second.evals, whole.evals, strict=True)
        for g, w in pairs:
            assert (g.eval_loss, g.eval_tokens, g.eval_microbatches) == (
                w.eval_loss, w.eval_tokens, w.eval_microbatches)


def test_rank_0_writes_one_json_line_per_evaluation(
        world: tuple[Path, list[dict[str, TrainResult]]]) -> None:
    tmp, results = world
    lines = [json.loads(x) for x in (tmp / "eval.jsonl").read_text().splitlines()]
    # Each evaluation right after the line of the 0-based step it follows; the final one
    # after step 2 of the 3-step run.
    assert [("step", x["step"]) if "step" in x else ("after_step", x["after_step"])
            for x in lines] == [("step", 0), ("step", 1), ("after_step", 1), ("step", 2),
                                ("after_step", 2)]
    evals = [x for x in lines if "after_step" in x]
    assert [set(x) for x in evals] == [{"after_step", "eval_loss", "eval_tokens",
                                        "eval_microbatches", "seconds"}] * 2
    assert [x["eval_loss"] for x in evals] == [e.eval_loss for e in results[0]["eval"].evals]
    assert STEPS == 3


def test_reference_cli_evaluates_and_refuses_another_layout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write_dataset(tmp_path / "data.arrow", _lengths(seed=2))
    plan = _plan(tmp_path / "plan.arrow", data, "zigzag")
    good, eval_data = write_eval_set(tmp_path, _eval_lengths())
    pool8, _ = write_eval_set(tmp_path, _eval_lengths(), dp=4, name="pool8")
    common = ["--plan", str(plan), "--dataset", str(data), "--reference", "--vocab-size", "64",
              "--hidden-size", "32", "--steps", "2", "--eval-dataset", str(eval_data)]
    assert main([*common, "--eval-plan", str(good), "--eval-interval", "1"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x.get("step"), x.get("after_step")) for x in out] == [
        (0, None), (None, 0), (1, None), (None, 1)]
    assert main([*common, "--eval-plan", str(pool8)]) == 2
    err = capsys.readouterr().err
    assert f"{pool8} is built for pool 8 (dp 4 x cp 2), tp 1, pp 1, the training job " \
           f"({plan}) for pool 4 (dp 2 x cp 2), tp 1, pp 1" in err
    assert main([*common, "--eval-plan", str(plan)]) == 2
    assert "not an evaluation plan (kind 'train')" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--eval-interval", "2"], "need --eval-plan"),
    (["--eval-plan", "e.arrow"], "--eval-plan needs --eval-dataset"),
    (["--eval-plan", "e.arrow", "--eval-dataset", "d", "--eval-steps", "-1"],
     "argument --eval-steps: expected an integer >= 0, got -1"),
])
def test_eval_flags_are_checked(capsys: pytest.CaptureFixture[str], flags: list[str],
                                message: str) -> None:
    with pytest.raises(SystemExit):
        main(["--plan", "p", "--dataset", "d", *flags])
    assert message in capsys.readouterr().err


def test_adapters_without_evaluation_refuse_eval_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--eval-plan is never silently ignored: an adapter must declare SUPPORTS_EVAL."""
    import importlib

    from runtime.adapters import FRAMEWORKS

    checked = 0
    for name, module_name in FRAMEWORKS.items():
        if name == "native":
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if getattr(module, "SUPPORTS_EVAL", False):
            continue
        checked += 1
        assert main(["--plan", str(tmp_path / "p.arrow"), "--dataset", "d", "--framework", name,
                     "--eval-plan", "e.arrow", "--eval-dataset", "d"]) == 2
        assert f"--framework {name} does not run --eval-plan yet" in capsys.readouterr().err
    if checked == 0:
        pytest.skip("every installed adapter evaluates")
