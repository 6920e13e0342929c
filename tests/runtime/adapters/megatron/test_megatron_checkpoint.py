"""``--framework megatron --save / --resume`` through Megatron's ``dist_checkpointing``.

A resumed run equals the uninterrupted one bit for bit (losses and parameters): with PP 2 and
the distributed optimizer, and with dp 2 x cp 2, the distributed optimizer and every overlap.
The native trainer's checkpoint rules hold (``runtime.adapters.megatron.parallel.checkpoint``):
one unit renamed into place, the target checked before the first step, a damaged or mismatched
checkpoint refused naming the file, nothing of the user's deleted, and metadata that would run
code refused before anything unpickles it. Real gloo ranks, the real package.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.train import TrainConfig
from runtime.train.megatron_options import MegatronOptions
from runtime.train.model import GPTConfig
from tests.dist import run_distributed
from tests.runtime.adapters.megatron.harness import (
    MODEL,
    STEPS,
    cfg,
    lengths,
    plan,
    train_rank,
    write_dataset,
)

pytestmark = pytest.mark.dist

DIST_OPT = MegatronOptions(use_distributed_optimizer=True)


def _run(config: TrainConfig, world: int = 4) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = run_distributed(train_rank, world, config, MODEL, timeout=300)
    return out


def _resume_equals_uninterrupted(config: TrainConfig, save: Path) -> list[dict[str, Any]]:
    # The uninterrupted run saves after step 2 (save_every 2) and at its end; the resumed one
    # continues from the first checkpoint and must land on the same bits.
    full = _run(replace(config, save=str(save), save_every=2))
    assert (save / "latest").read_text().strip() == f"step-{STEPS:08d}"
    resumed = _run(replace(config, resume=str(save / "step-00000002")))
    assert [g.step for g in resumed[0]["logs"]] == [2]
    assert resumed[0]["logs"][0].loss == full[0]["logs"][2].loss
    for a, b in zip(full, resumed, strict=True):
        assert a["state"].keys() == b["state"].keys()
        for name, t in a["state"].items():
            assert torch.equal(t, b["state"][name]), name
    return full


def test_resume_pp2_distributed_optimizer_bit_for_bit(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data.arrow", lengths(long=0), MODEL.vocab_size)
    p = plan(tmp_path / "plan.arrow", data, capacity=32, batch=12, dp=1, cp=2, pp=2)
    save = tmp_path / "ckpt"
    _resume_equals_uninterrupted(cfg(p, data, megatron=DIST_OPT), save)
    step = save / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    # Megatron's own layout: its metadata (and common.pt in 0.16), a shard file per rank.
    assert {"model/metadata.json", "model/.metadata", "run.json"} \
        <= manifest["files"].keys()
    assert sum(f.endswith(".distcp") for f in manifest["files"]) >= 4
    assert {f"rng/rank-{r}.pt" for r in range(4)} <= manifest["files"].keys()
    run = json.loads((step / "run.json").read_text())
    assert run["next_step"] == 2
    assert run["use_distributed_optimizer"] is True


def test_resume_dp2_cp2_overlapped_bit_for_bit(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data.arrow", lengths(), MODEL.vocab_size)
    p = plan(tmp_path / "plan.arrow", data, capacity=32, batch=12, dp=2, cp=2)
    options = MegatronOptions(use_distributed_optimizer=True, overlap_grad_reduce=True,
                              overlap_param_gather=True, ddp_bucket_size=3000, clip_grad=0.5)
    _resume_equals_uninterrupted(cfg(p, data, weight_decay=0.1, megatron=options),
                                 tmp_path / "ckpt")


def _train_error(rank: int, world: int, store: str, config: TrainConfig,
                 model: GPTConfig) -> str:
    """The ValueError a run stops with on this rank ('' if it trains)."""
    try:
        train_rank(rank, world, store, config, model)
    except ValueError as e:
        return str(e)
    return ""


def _errors(config: TrainConfig, world: int = 2) -> list[str]:
    out: list[str] = run_distributed(_train_error, world, config, MODEL, timeout=300)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2-rank plan and a checkpoint after its step 2 (fp32, DDP, no distributed optimizer)."""
    tmp = tmp_path_factory.mktemp("megatron-ckpt")
    data = write_dataset(tmp / "data.arrow", lengths(long=0), MODEL.vocab_size)
    p = plan(tmp / "plan.arrow", data, capacity=32, batch=12, dp=1, cp=2)
    config = cfg(p, data, steps=2)
    _run(replace(config, save=str(tmp / "ckpt")), 2)
    return {"config": replace(config, steps=STEPS), "ckpt": tmp / "ckpt", "tmp": tmp}


def _copy(saved: dict[str, Any], name: str) -> Path:
    import shutil

    dst: Path = saved["tmp"] / name
    shutil.copytree(saved["ckpt"], dst)
    return dst / "step-00000002"


def test_a_damaged_shard_is_named(saved: dict[str, Any]) -> None:
    step = _copy(saved, "damaged")
    shard = sorted((step / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    errors = _errors(replace(saved["config"], resume=str(step)))
    assert all(f"{shard}: damaged checkpoint file: sha256" in e for e in errors), errors


def test_another_plan_or_optimizer_is_refused(saved: dict[str, Any]) -> None:
    config = saved["config"]
    other = plan(saved["tmp"] / "other.arrow", Path(config.dataset), capacity=40, batch=12,
                 dp=1, cp=2)
    errors = _errors(replace(config, plan=str(other), resume=str(saved["ckpt"])))
    assert all("run.json: checkpoint has plan=" in e for e in errors), errors
    errors = _errors(replace(config, resume=str(saved["ckpt"]), megatron=DIST_OPT))
    assert all("saved without --use-distributed-optimizer" in e for e in errors), errors


class _Exploit:
    """Unpickling this would create a file (what a crafted checkpoint would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def test_metadata_that_would_run_code_is_refused(saved: dict[str, Any]) -> None:
    step = _copy(saved, "crafted")
    marker = saved["tmp"] / "pwned"
    meta = step / "model" / ".metadata"
    meta.write_bytes(pickle.dumps(_Exploit(str(marker))))
    # A crafted checkpoint comes with a matching manifest: recompute it as an attacker would.
    manifest = json.loads((step / "manifest.json").read_text())
    import hashlib

    manifest["files"]["model/.metadata"] = {"bytes": meta.stat().st_size,
                                            "sha256": hashlib.sha256(meta.read_bytes())
                                            .hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    errors = _errors(replace(saved["config"], resume=str(step)))
    assert all("refusing to load a checkpoint that could run code" in e for e in errors), errors
    assert not marker.exists()


def test_save_target_checked_before_the_first_step(saved: dict[str, Any]) -> None:
    tmp: Path = saved["tmp"]
    mine = tmp / "users" / "step-00000003"  # a user's own directory where a save would go
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    log = tmp / "steps.jsonl"
    config = replace(saved["config"], save=str(tmp / "users"), log_jsonl=str(log))
    errors = _errors(config)
    assert all(f"{mine}: exists and is a directory that is not a checkpoint" in e
               for e in errors), errors
    assert (mine / "notes.txt").read_text() == "mine"
    assert not log.exists() or not log.read_text()  # no step ran
    afile = tmp / "a-file"
    afile.write_text("x")
    errors = _errors(replace(saved["config"], save=str(afile)))
    assert all(f"{afile}: exists and is a file, not a directory" in e
               for e in errors), errors


def test_resume_from_a_native_checkpoint_is_refused(saved: dict[str, Any],
                                                    tmp_path: Path) -> None:
    fake = tmp_path / "native" / "step-00000002"
    fake.mkdir(parents=True)
    (fake / "manifest.json").write_text(json.dumps({"format": 2, "next_step": 2, "files": {}}))
    (fake / "state.pt").write_bytes(b"")
    errors = _errors(replace(saved["config"], resume=str(fake)))
    assert all("a checkpoint of another --framework" in e for e in errors), errors


def test_another_runs_checkpoints_are_not_replaced(saved: dict[str, Any]) -> None:
    """A run without --resume (another seed) saving into a directory of checkpoints would
    replace them and move latest (issue 32); refused on every rank before the first step."""
    ck = _copy(saved, "other-run").parent
    before = sorted(p.name for p in ck.iterdir())
    latest = (ck / "latest").read_text()
    errors = _errors(replace(saved["config"], steps=2, seed=5, save=str(ck)))
    assert all(f"--save {ck}: holds the checkpoints of another run (latest step-00000002)"
               in e for e in errors), errors
    assert sorted(p.name for p in ck.iterdir()) == before
    assert (ck / "latest").read_text() == latest


def test_another_lr_or_weight_decay_is_refused(saved: dict[str, Any]) -> None:
    """Saved at step 2 with --lr 0.003: a resume with --lr 0.5 trained at 0.003 (the optimizer's
    groups and Megatron's scheduler restore theirs; issue 32). Refused on every rank, naming
    the saved value, as the native trainer does; so is another --weight-decay."""
    step = saved["ckpt"] / "step-00000002"
    errors = _errors(replace(saved["config"], resume=str(saved["ckpt"]), lr=0.5))
    assert errors == [f"{step}: the checkpoint was saved with --lr 0.003, this run has --lr "
                      "0.5; resume with --lr 0.003 (the optimizer state carries it), or start "
                      "a new run"] * 2, errors
    errors = _errors(replace(saved["config"], resume=str(saved["ckpt"]), weight_decay=0.1))
    assert all(f"{step}: the checkpoint was saved with --weight-decay 0, this run has "
               "--weight-decay 0.1" in e for e in errors), errors
