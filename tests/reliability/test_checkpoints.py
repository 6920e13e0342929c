"""Checkpoints are data, and a save never costs the run or the user's files (issue 22).

Before: ``--resume`` called ``torch.load(weights_only=False)``: a crafted ``state.pt`` with a
matching manifest ran arbitrary code; a ``state.pt`` without ``meta`` gave a ``KeyError``
traceback. ``--save`` was checked only after training: a read-only target or an existing file
failed after all the steps ran, and ``--save DIR`` where ``DIR/step-00000001/`` was a user's own
directory deleted it. ``--resume`` from a step past ``--steps`` did nothing and said nothing; an
eval plan trained as a training plan; a negative token id was told to raise ``--vocab-size``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from planner.cli import main as plan_main
from runtime.train.cli import main as train_main
from tests.reliability.helpers import (
    TRAIN_FLAGS,
    no_traceback,
    pool1_plan,
    stderr_of,
    write_token_jsonl,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpt")
    data = write_token_jsonl(d / "data.jsonl")
    return {"dir": d, "data": data, "plan": pool1_plan(plan_main, data, d / "plan.arrow")}


def _train(run: dict[str, Path], *extra: str) -> int:
    return train_main(["--plan", str(run["plan"]), "--dataset", str(run["data"]), *TRAIN_FLAGS,
                       *extra])


def _saved(run: dict[str, Path], name: str, steps: int = 1) -> Path:
    ck = run["dir"] / name
    assert _train(run, "--steps", str(steps), "--save", str(ck)) == 0
    return ck


def _rewrite(step: Path, name: str, obj: Any) -> None:
    """Replace a checkpoint file with ``obj`` and update the manifest to match (what an
    attacker who can write the directory does)."""
    torch.save(obj, step / name)
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


class _Evil:
    """Unpickling this runs ``os.system`` (only ``weights_only=False`` would)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("target", ["state.pt", "rng-0.pt", "format-2 rng-0.pt"])
def test_a_crafted_checkpoint_runs_no_code(run: dict[str, Path], target: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ck = _saved(run, f"evil-{target.replace(' ', '-')}")
    step = ck / "step-00000001"
    marker = run["dir"] / f"pwned-{target.replace(' ', '-')}"
    state = torch.load(step / "state.pt", weights_only=True)
    if target == "state.pt":
        _rewrite(step, "state.pt", {**state, "meta": _Evil(marker)})
    else:
        if target.startswith("format-2"):  # format 2's numpy allowance must not open a door
            _rewrite(step, "state.pt", {**state, "format": 2})
        _rewrite(step, "rng-0.pt", {"torch": torch.get_rng_state(), "numpy": _Evil(marker)})
    assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
    err = stderr_of(capsys)
    assert "holds objects other than tensors and plain data" in err
    assert target.split()[-1] in err
    assert not marker.exists()


def test_every_key_of_the_state_is_named(run: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ck = _saved(run, "keys")
    step = ck / "step-00000001"
    state = torch.load(step / "state.pt", weights_only=True)
    for key in ("meta", "model", "optimizer", "next_step"):
        _rewrite(step, "state.pt", {k: v for k, v in state.items() if k != key})
        assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
        assert f"state.pt: checkpoint state has no {key!r}" in stderr_of(capsys)
    _rewrite(step, "state.pt", {**state, "meta": {"model": state["meta"]["model"]}})
    assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
    assert "checkpoint meta has no 'dataset'" in stderr_of(capsys)
    _rewrite(step, "state.pt", {**state, "next_step": "1"})
    assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
    assert "checkpoint 'next_step' is a str, expected a int" in stderr_of(capsys)
    _rewrite(step, "state.pt", state)
    _rewrite(step, "rng-0.pt", {"torch": torch.get_rng_state()})
    assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
    assert "rng-0.pt: RNG state 'numpy' is missing" in stderr_of(capsys)


def test_format_2_checkpoints_still_resume(run: dict[str, Path]) -> None:
    """What format 2 wrote (the numpy RNG state as ``np.random.get_state()``, an array) loads
    through the restricted unpickler and resumes with the uninterrupted losses; so does format
    1 (no manifest)."""
    full = run["dir"] / "full.jsonl"
    assert _train(run, "--steps", "3", "--log-jsonl", str(full)) == 0
    want = [json.loads(x)["loss"] for x in full.read_text().splitlines()][1:]
    ck = _saved(run, "format2")
    step = ck / "step-00000001"
    state = torch.load(step / "state.pt", weights_only=True)
    _rewrite(step, "state.pt", {**state, "format": 2})
    _rewrite(step, "rng-0.pt", {"torch": torch.get_rng_state(), "numpy": np.random.get_state()})
    log = run["dir"] / "format2.jsonl"
    assert _train(run, "--steps", "3", "--resume", str(ck), "--log-jsonl", str(log)) == 0
    assert [json.loads(x)["loss"] for x in log.read_text().splitlines()] == want
    one = run["dir"] / "format1"
    one.mkdir()
    torch.save({**state, "format": 1}, one / "state.pt")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state()}, one / "rng-0.pt")
    log1 = run["dir"] / "format1.jsonl"
    assert _train(run, "--steps", "3", "--resume", str(one), "--log-jsonl", str(log1)) == 0
    assert [json.loads(x)["loss"] for x in log1.read_text().splitlines()] == want


def _no_step_ran(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert '"step"' not in captured.out
    assert no_traceback(captured.err)
    return captured.err


def test_save_target_is_checked_before_the_first_step(
        run: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a_file = run["dir"] / "a-file"
    a_file.write_text("mine")
    assert _train(run, "--steps", "2", "--save", str(a_file)) == 2
    assert f"{a_file}: exists and is a file, not a directory" in _no_step_ran(capsys)
    assert a_file.read_text() == "mine"
    # A user's own directory where a save would go: refused before training, never deleted.
    mine = run["dir"] / "mine"
    (mine / "step-00000002").mkdir(parents=True)
    (mine / "step-00000002" / "notes.txt").write_text("keep")
    assert _train(run, "--steps", "2", "--save", str(mine)) == 2
    assert "step-00000002: exists and is a directory that is not a checkpoint" in \
        _no_step_ran(capsys)
    assert (mine / "step-00000002" / "notes.txt").read_text() == "keep"
    (mine / "step-00000002" / "notes.txt").unlink()
    (mine / "step-00000002").rmdir()
    (mine / ".step-00000002.tmp").mkdir()
    (mine / ".step-00000002.tmp" / "draft.txt").write_text("keep too")
    assert _train(run, "--steps", "2", "--save", str(mine)) == 2  # the staging name too
    assert ".step-00000002.tmp: exists and is a directory that is not a checkpoint" in \
        _no_step_ran(capsys)
    assert (mine / ".step-00000002.tmp" / "draft.txt").read_text() == "keep too"
    # A step this run does not save is left alone, and the run saves beside it.
    (mine / ".step-00000002.tmp" / "draft.txt").unlink()
    (mine / ".step-00000002.tmp").rmdir()
    (mine / "step-00000007").mkdir()
    assert _train(run, "--steps", "2", "--save", str(mine)) == 0
    assert sorted(p.name for p in mine.iterdir()) == ["latest", "step-00000002", "step-00000007"]
    latest = run["dir"] / "latest-file"
    latest.mkdir()
    (latest / "latest").write_text("my shopping list\n")
    assert _train(run, "--steps", "2", "--save", str(latest)) == 2
    assert "latest: exists and is a file that is not a checkpoint" in _no_step_ran(capsys)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_read_only_save_target_is_refused_before_training(
        run: dict[str, Path], read_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(run, "--steps", "2", "--save", str(read_only / "ck")) == 2
    assert f"cannot write in {read_only}: Read-only file system (EROFS)" in _no_step_ran(capsys)


def test_resume_past_the_run_and_eval_plans(run: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ck = _saved(run, "past", steps=3)
    assert _train(run, "--steps", "2", "--resume", str(ck)) == 2
    assert "the checkpoint continues at step 3, past the end of this run" in _no_step_ran(capsys)
    assert _train(run, "--steps", "3", "--resume", str(ck)) == 0
    assert "continues at step 3, where this run ends (--steps 3): nothing left to train" in \
        _no_step_ran(capsys)
    assert _train(run, "--steps", "3", "--resume", str(ck), "--reference") == 0
    assert "nothing left to train" in _no_step_ran(capsys)
    eval_plan = run["dir"] / "eval.arrow"
    assert plan_main([str(run["data"]), "--eval", "-o", str(eval_plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "256", "--global-batch-size", "6",
                      "--quiet"]) == 0
    for extra in ((), ("--reference",)):
        assert train_main(["--plan", str(eval_plan), "--dataset", str(run["data"]), *TRAIN_FLAGS,
                           "--steps", "1", *extra]) == 2
        assert "is an evaluation plan (dcp-plan --eval" in _no_step_ran(capsys)


def test_negative_token_id_is_not_a_vocabulary_problem(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "neg.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": [1, 2, -5, 3] if i == 2 else [1, 2, 3]})
                              for i in range(6)) + "\n")
    plan = pool1_plan(plan_main, data, tmp_path / "neg.arrow")
    assert train_main(["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS,
                       "--steps", "1"]) == 2
    err = stderr_of(capsys)
    assert "token id -5 is negative" in err
    assert "--vocab-size" not in err


def test_torchtitan_save_target_uses_its_own_layout(run: dict[str, Path]) -> None:
    """torchtitan's checkpointer writes ``DIR/step-N`` (N steps done) into any directory of that
    name: a user's own one is refused before training, a killed save's DCP files are not."""
    pytest.importorskip("torchtitan")
    from dataclasses import replace

    from runtime.adapters.torchtitan.config import check_titan_start
    from runtime.train.config import TrainConfig

    cfg = TrainConfig(plan=str(run["plan"]), dataset=str(run["data"]), steps=4, save_every=2,
                      save=str(run["dir"] / "titan"))
    mine = run["dir"] / "titan" / "step-2"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="step-2: exists and is a directory that is not a "
                                         "checkpoint"):
        check_titan_start(cfg, 0)
    check_titan_start(replace(cfg, save_every=3), 0)  # saves step-3 and step-4 only
    (mine / "notes.txt").unlink()
    (mine / "__0_0.distcp").write_bytes(b"killed midway")
    check_titan_start(cfg, 0)
    assert (mine / "__0_0.distcp").read_bytes() == b"killed midway"
