"""A checkpoint never runs code, and a resume says what it loaded (issue 32, item 2).

Before: ``--framework torchtitan --resume DIR`` whose ``step-N/.metadata`` was a crafted pickle
ran its payload (``os.system``), then failed with a traceback: torchtitan's checkpointer reads
that file with ``pickle.load`` and the objects in the ``.distcp`` shards with
``torch.load(weights_only=False)``. Now both go through ``runtime.train.dcpsafe`` (the
allow-list unpickler the Megatron adapter uses), and the file is refused by name.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.cli import main as plan_main
from tests.reliability.helpers import ROOT, TRAIN_FLAGS, no_traceback, pool1_plan, write_token_jsonl


class _Evil:
    """Unpickling this runs ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _train(d: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``dcp-train --framework torchtitan`` in its own process (a world of one)."""
    argv = [sys.executable, "-m", "runtime.train", "--plan", str(d / "plan.arrow"),
            "--dataset", str(d / "data.jsonl"), *TRAIN_FLAGS, "--framework", "torchtitan",
            *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=d, env=env)


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torchtitan")
    d = tmp_path_factory.mktemp("titan")
    pool1_plan(plan_main, write_token_jsonl(d / "data.jsonl"), d / "plan.arrow")
    done = _train(d, "--steps", "2", "--save", str(d / "ck"))
    assert done.returncode == 0, done.stderr
    assert (d / "ck" / "step-2" / ".metadata").is_file()
    return d


def _copy(titan: Path, name: str) -> Path:
    shutil.copytree(titan / "ck", titan / name)
    return titan / name / "step-2"


def test_torchtitan_crafted_metadata_runs_no_code(titan: Path) -> None:
    step = _copy(titan, "evil-meta")
    marker = titan / "pwned-meta"
    (step / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    done = _train(titan, "--steps", "3", "--resume", str(step.parent))
    assert done.returncode == 2, done.stderr
    assert no_traceback(done.stderr), done.stderr
    assert f"{step / '.metadata'}: refers to posix.system" in done.stderr
    assert "refusing to load a checkpoint that could run code" in done.stderr
    assert not marker.exists()


def test_torchtitan_crafted_shard_object_runs_no_code(titan: Path) -> None:
    """An object in ``__0_0.distcp`` replaced by a pickle that runs code, with metadata that
    points at it (what an attacker who can write the directory does)."""
    step = _copy(titan, "evil-shard")
    marker = titan / "pwned-shard"
    with open(step / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the genuine file, written by this test's own run
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    shard = step / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    for index, info in meta.storage_data.items():
        if index.fqn == "train_state.step":
            info.offset, info.length = offset, len(buf.getvalue())
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    done = _train(titan, "--steps", "3", "--resume", str(step.parent))
    assert done.returncode == 2, done.stderr
    assert no_traceback(done.stderr), done.stderr
    assert f"{step}: an object stored in the checkpoint's .distcp shards is not plain data" \
        in done.stderr
    assert "posix.system" in done.stderr
    assert not marker.exists()


def test_torchtitan_genuine_checkpoint_still_resumes(titan: Path) -> None:
    done = _train(titan, "--steps", "3", "--resume", str(titan / "ck"))
    assert done.returncode == 0, done.stderr
    assert f"resuming from {titan / 'ck' / 'step-2'}" in done.stderr


def test_torchtitan_resume_refuses_another_lr_or_weight_decay(titan: Path) -> None:
    """Saved with --lr 0.001: a resume with --lr 0.5 trained at 0.001 (torchtitan's checkpointer
    restores the optimizer's groups and the scheduler's base rates). Refused as the native
    trainer refuses it, before a step, the flag and the saved value named."""
    step = titan / "ck" / "step-2"
    done = _train(titan, "--steps", "3", "--resume", str(titan / "ck"), "--lr", "0.5")
    assert done.returncode == 2, done.stderr
    assert no_traceback(done.stderr), done.stderr
    assert f"{step}: the checkpoint was saved with --lr 0.001, this run has --lr 0.5; resume " \
        "with --lr 0.001 (the optimizer state carries it), or start a new run" in done.stderr
    assert '"step"' not in done.stdout
    done = _train(titan, "--steps", "3", "--resume", str(titan / "ck"), "--weight-decay", "0.1")
    assert done.returncode == 2, done.stderr
    assert f"{step}: the checkpoint was saved with --weight-decay 0, this run has " \
        "--weight-decay 0.1" in done.stderr


def test_torchtitan_replace_checkpoints_is_refused_not_ignored(titan: Path) -> None:
    """Another run (no --resume) saving into a directory of torchtitan checkpoints is refused;
    --replace-checkpoints was ignored silently (the same refusal, the flag not named). It cannot
    be honoured: torchtitan's resume loads the highest step-N, no latest pointer to move, so the
    other run's checkpoints would stay the ones loaded. Now refused saying so."""
    ck = titan / "ck"
    before = _digest(ck)
    done = _train(titan, "--steps", "2", "--seed", "1", "--save", str(ck))
    assert done.returncode == 2, done.stderr
    assert f"--save {ck} already holds checkpoints; pass --resume" in done.stderr
    done = _train(titan, "--steps", "2", "--seed", "1", "--save", str(ck),
                  "--replace-checkpoints")
    assert done.returncode == 2, done.stderr
    assert no_traceback(done.stderr), done.stderr
    assert f"--save {ck} already holds checkpoints, which --replace-checkpoints cannot " \
        "replace with --framework torchtitan: torchtitan keeps no latest pointer" in done.stderr
    assert '"step"' not in done.stdout
    assert _digest(ck) == before


# ------------------------------------------------------------------ native: what a run resumes

def _native(d: Path, *extra: str) -> int:
    from runtime.train.cli import main as train_main

    return train_main(["--plan", str(d / "plan.arrow"), "--dataset", str(d / "data.jsonl"),
                       *TRAIN_FLAGS, *extra])


@pytest.fixture
def native(tmp_path: Path) -> Path:
    """Run A: 6 steps saved every 2 into ``ck`` (latest step-00000006)."""
    pool1_plan(plan_main, write_token_jsonl(tmp_path / "data.jsonl"), tmp_path / "plan.arrow",
               "--global-batch-size", "2")
    assert _native(tmp_path, "--steps", "6", "--save-every", "2", "--save",
                   str(tmp_path / "ck")) == 0
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000006"
    return tmp_path


def _digest(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_another_run_never_replaces_the_checkpoints(native: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Run B (another seed, no --resume) with A's --save: it replaced step-00000002 and moved
    latest from 6 back to 2. Now refused before the first step; --replace-checkpoints lets it."""
    ck = native / "ck"
    before = _digest(ck)
    capsys.readouterr()
    assert _native(native, "--steps", "2", "--seed", "1", "--save", str(ck)) == 2
    err = capsys.readouterr()
    assert no_traceback(err.err)
    assert f"--save {ck}: holds the checkpoints of another run (latest step-00000006)" in err.err
    assert "--replace-checkpoints" in err.err
    assert '"step"' not in err.out  # no step ran
    assert _digest(ck) == before
    # Resuming from an earlier checkpoint into the same directory would move latest back.
    assert _native(native, "--steps", "4", "--resume", str(ck / "step-00000002"), "--save",
                   str(ck)) == 2
    err = capsys.readouterr().err
    assert "its latest checkpoint is step-00000006" in err
    assert "move latest back" in err
    assert _digest(ck) == before
    assert _native(native, "--steps", "2", "--seed", "1", "--save", str(ck),
                   "--replace-checkpoints") == 0
    assert (ck / "latest").read_text().strip() == "step-00000002"


def test_resume_names_the_checkpoint_and_refuses_another_lr(
        native: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = native / "ck"
    capsys.readouterr()
    assert _native(native, "--steps", "6", "--resume", str(ck), "--lr", "0.5") == 2
    err = capsys.readouterr().err
    assert no_traceback(err)
    assert f"{ck / 'step-00000006'}: the checkpoint was saved with --lr 0.001, this run has " \
        "--lr 0.5" in err
    assert _native(native, "--steps", "8", "--resume", str(ck), "--save", str(ck)) == 0
    err = capsys.readouterr().err
    assert f"resuming from {ck / 'step-00000006'} at step 6" in err
    assert (ck / "latest").read_text().strip() == "step-00000008"


def _resolve_rank(rank: int, world: int, store: str, dirs: list[str]) -> str:
    from runtime.train.checkpoint import resolve_agreed

    os.chdir(dirs[rank])  # each rank sees its own "ck": a latest that moved between them
    return str(resolve_agreed("ck", rank))


def test_ranks_load_the_checkpoint_rank_0_chose(tmp_path: Path) -> None:
    from runtime.train.savetarget import MANIFEST_FILE
    from tests.dist import run_distributed

    dirs = []
    for r, step in ((0, 6), (1, 2)):
        d = tmp_path / f"view{r}" / "ck" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / MANIFEST_FILE).write_text("{}")
        (d.parent / "latest").write_text(d.name + "\n")
        dirs.append(str(tmp_path / f"view{r}"))
    assert run_distributed(_resolve_rank, 2, dirs, timeout=120) == ["ck/step-00000006"] * 2


def _titan_latest_rank(rank: int, world: int, store: str, dirs: list[str]) -> int:
    from runtime.adapters.torchtitan.config import agreed_latest

    os.chdir(dirs[rank])  # each rank sees its own "ck"
    return agreed_latest("ck")


def test_torchtitan_ranks_load_the_step_rank_0_chose(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from tests.dist import run_distributed

    dirs = []
    for r, step in ((0, 6), (1, 2)):
        d = tmp_path / f"view{r}" / "ck" / f"step-{step}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"")
        dirs.append(str(tmp_path / f"view{r}"))
    assert run_distributed(_titan_latest_rank, 2, dirs, timeout=200) == [6, 6]
