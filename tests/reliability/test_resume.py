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
