"""Checkpoints as one verified unit, non-finite losses, bad records and stalled ranks.

Before: 3 flipped bytes in ``state.pt`` resumed with exit 0 and a NaN loss at the next step; a
truncated or empty checkpoint file gave ``PytorchStreamReader failed`` / ``EOFError`` per rank;
``kill -9`` during ``--save`` left the RNG files of the new step beside the old ``state.pt``; a plan
made with ``--skip-bad-records`` stopped ``dcp-train`` on the bad line; a stopped rank stalled the
job for gloo's 30-minute default.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.cli import main as plan_main
from runtime.train.cli import main as train_main
from tests.dist import run_distributed
from tests.reliability.helpers import ROOT, TRAIN_FLAGS, no_traceback, pool1_plan, write_token_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("train")
    data = write_token_jsonl(d / "data.jsonl")
    plan = pool1_plan(plan_main, data, d / "plan.arrow")
    return {"dir": d, "data": data, "plan": plan}


def _train(run: dict[str, Path], *extra: str) -> int:
    return train_main(["--plan", str(run["plan"]), "--dataset", str(run["data"]), *TRAIN_FLAGS,
                       *extra])


def _saved(run: dict[str, Path], name: str, steps: int = 2) -> Path:
    ck = run["dir"] / name
    assert _train(run, "--steps", str(steps), "--save", str(ck)) == 0
    return ck


@pytest.fixture(scope="module")
def saved(run: dict[str, Path]) -> Path:
    """One run's checkpoint after 2 steps; the tests that damage it damage copies."""
    return _saved(run, "ck-saved")


def test_checkpoint_layout_and_manifest(saved: Path) -> None:
    ck = saved
    assert (ck / "latest").read_text().strip() == "step-00000002"
    step = ck / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert set(manifest["files"]) == {"state.pt", "rng-0.pt"}
    assert manifest["next_step"] == 2
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002"]


@pytest.mark.parametrize("damage", ["flip3", "truncate", "empty", "delete", "manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(
        run: dict[str, Path], saved: Path, damage: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    ck = run["dir"] / f"ck-{damage}"
    shutil.copytree(saved, ck)  # a whole, valid checkpoint of its own to damage
    step = ck / "step-00000002"
    state = step / "state.pt"
    data = bytearray(state.read_bytes())
    if damage == "flip3":
        for i in (len(data) // 3, len(data) // 2, 2 * len(data) // 3):
            data[i] ^= 0xFF
        state.write_bytes(bytes(data))
        want = "state.pt: damaged checkpoint file: sha256 differs"
    elif damage == "truncate":
        state.write_bytes(bytes(data[: len(data) // 2]))
        want = "state.pt: damaged checkpoint file"
    elif damage == "empty":
        (step / "rng-0.pt").write_bytes(b"")
        want = "rng-0.pt: damaged checkpoint file: 0 bytes"
    elif damage == "delete":
        state.unlink()
        want = "state.pt: missing from the checkpoint"
    else:
        (step / "manifest.json").write_text('{"files": ')
        want = "manifest.json: damaged checkpoint manifest"
    assert _train(run, "--steps", "3", "--resume", str(ck)) == 2
    err = capsys.readouterr().err
    assert want in err
    assert no_traceback(err)


def test_resume_matches_and_a_killed_save_changes_nothing(run: dict[str, Path]) -> None:
    """A save killed (SIGKILL) midway leaves ``latest`` on the previous complete checkpoint;
    resuming from it gives the uninterrupted losses; the next save removes the leftovers."""
    full = run["dir"] / "full.jsonl"
    assert _train(run, "--steps", "3", "--log-jsonl", str(full)) == 0
    ck = _saved(run, "ck-kill", steps=1)
    # A real process killed while it stages the next checkpoint (it writes, then hangs).
    script = (
        "import sys, time, torch; from pathlib import Path; from runtime.train import checkpoint\n"
        "orig = checkpoint._write_synced\n"
        "def slow(path, data=None, obj=None):\n"
        "    orig(path, data, obj)\n"
        "    if path.name == 'state.pt': print('staged', flush=True); time.sleep(60)\n"
        "checkpoint._write_synced = slow\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.AdamW(m.parameters())\n"
        f"checkpoint.save({str(ck)!r}, model=m, optimizer=o, next_step=2, meta={{}}, rank=0)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "staged"
    proc.kill()
    proc.wait(timeout=30)
    assert (ck / ".step-00000002.tmp" / "state.pt").is_file()  # what the killed save left
    assert (ck / "latest").read_text().strip() == "step-00000001"
    resumed = run["dir"] / "resumed.jsonl"
    assert _train(run, "--steps", "3", "--resume", str(ck), "--log-jsonl", str(resumed),
                  "--save", str(ck)) == 0
    want = [json.loads(x) for x in full.read_text().splitlines()][1:]
    got = [json.loads(x) for x in resumed.read_text().splitlines()]
    assert [g["loss"] for g in got] == [w["loss"] for w in want]
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000001", "step-00000003"]


def test_a_signal_as_the_staging_directory_is_made_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython runs a signal's handler when the call it came during returns: a SIGHUP during
    the staging directory's ``mkdir`` raised out of it with the directory made, before the save
    knew it was its own, and left ``.step-00000001.tmp`` behind (seen once in CI, in
    ``test_dcp_train_ends_cleanly_on_every_ending_signal[SIGHUP]``). Here the handler's
    exception comes right as that mkdir returns."""
    import os

    from runtime.train import checkpoint
    from runtime.train.guards import Terminated

    real = os.mkdir

    def interrupted(path: object, *a: object, **kw: object) -> None:
        real(path, *a, **kw)  # type: ignore[arg-type]
        if str(path).endswith(".tmp"):
            raise Terminated(1)
    monkeypatch.setattr(os, "mkdir", interrupted)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(Terminated):
        checkpoint.save(tmp_path / "ck", model=model,
                        optimizer=torch.optim.AdamW(model.parameters()), next_step=1, meta={},
                        rank=0)
    assert list((tmp_path / "ck").iterdir()) == []


def test_full_disk_during_save_names_the_path_and_keeps_the_old_checkpoint(
        run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    try:
        ck = mnt / "ck"
        assert _train(run, "--steps", "1", "--save", str(ck)) == 0  # small: fits
        big = ["--hidden-size", "128"]  # later argparse value wins: a model that does not fit
        assert train_main(["--plan", str(run["plan"]), "--dataset", str(run["data"]),
                           *TRAIN_FLAGS, *big, "--steps", "1", "--save", str(ck),
                           "--replace-checkpoints"]) == 2  # another run's: replace it
        err = capsys.readouterr().err
        assert "No space left on device" in err
        assert str(ck) in err
        assert no_traceback(err)
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000001"]
        assert _train(run, "--steps", "2", "--resume", str(ck)) == 0
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(
        run: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # lr 1e30: the first update blows the weights up, so step 1's loss is not finite.
    assert _train(run, "--lr", "1e30", "--steps", "3") == 2
    err = capsys.readouterr().err
    assert re.search(r"step 1: the (loss is|gradients are) not finite", err)
    assert no_traceback(err)
    log = run["dir"] / "skip.jsonl"
    assert _train(run, "--lr", "1e30", "--steps", "3", "--skip-nonfinite-steps",
                  "--log-jsonl", str(log)) == 0
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r.get("skipped", False) for r in rows] == [False, True, True]
    assert "update skipped" in capsys.readouterr().err


def test_plan_made_with_skip_bad_records_trains(tmp_path: Path) -> None:
    data = write_token_jsonl(tmp_path / "bad.jsonl", bad_lines=(3, 10))
    assert plan_main([str(data), "-o", str(tmp_path / "x.arrow"), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "256", "--global-batch-size", "6",
                      "--quiet"]) == 2
    plan = pool1_plan(plan_main, data, tmp_path / "skip.arrow", "--skip-bad-records")
    common = ["--plan", str(plan), "--dataset", str(data), *TRAIN_FLAGS, "--steps", "2"]
    assert train_main(common) == 0
    assert train_main([*common, "--reference"]) == 0
    # An eval plan of a held-out set with bad records evaluates too (the evaluators open it
    # through the same runtime.data.plan_source.open_plan_source).
    held = write_token_jsonl(tmp_path / "held.jsonl", seed=5, bad_lines=(1,))
    eval_plan = tmp_path / "eval.arrow"
    assert plan_main([str(held), "--eval", "-o", str(eval_plan), "--dp", "1", "--cp", "1",
                      "--max-tokens-per-rank", "256", "--global-batch-size", "6", "--quiet",
                      "--skip-bad-records"]) == 0
    evals = ["--eval-plan", str(eval_plan), "--eval-dataset", str(held)]
    assert train_main([*common, *evals]) == 0
    assert train_main([*common, *evals, "--reference"]) == 0


def _stalled_peer(rank: int, world_size: int, store_path: str, timeout_s: float) -> float:
    store = dist.FileStore(store_path + ".pg", world_size)  # type: ignore[attr-defined]
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    from runtime.dist.groups import GroupCatalog
    from runtime.dist.topology import Topology

    try:
        topo = Topology(dp=2, cp=1, rank=rank, world_size=world_size)
        catalog = GroupCatalog.create(topo, (1, 2), timeout=timeout)
        group = catalog.pool_group
        if rank == 1:
            time.sleep(timeout_s + 8)  # stalled (as under SIGSTOP) well past the timeout
            return 0.0
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
            dist.all_reduce(torch.ones(1), group=group)
        return time.monotonic() - t0
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_stalled_rank_times_out_in_every_group() -> None:
    """The catalog's groups honour the timeout (torch's new_group default is 30 min for gloo,
    whatever init_process_group was given)."""
    results = run_distributed(_stalled_peer, 2, 3.0, backend=None, timeout=90)
    assert 2.5 < results[0] < 30


def test_timeout_flag_reaches_the_process_groups() -> None:
    from runtime.train.cli import parse_args
    from runtime.train.procgroup import pg_timeout

    cfg = parse_args(["--plan", "p", "--dataset", "d"])[0]
    assert pg_timeout(cfg.distributed_timeout_minutes) == timedelta(minutes=10)
    cfg = parse_args(["--plan", "p", "--dataset", "d", "--distributed-timeout-minutes", "0.5"])[0]
    assert pg_timeout(cfg.distributed_timeout_minutes) == timedelta(seconds=30)
    with pytest.raises(SystemExit):
        parse_args(["--plan", "p", "--dataset", "d", "--distributed-timeout-minutes", "0"])
