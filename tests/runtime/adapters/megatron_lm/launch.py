"""Shared pieces of the launcher's tests: the data, the plans, the flags, the runs.

Every run is a real ``torchrun`` of ``python -m runtime.adapters.megatron_lm`` in fresh
processes (gloo, CPU), the user's command being the project's own ``pretrain_gpt.py`` driver,
so Megatron-LM's ``pretrain()`` runs as a user runs it and nothing is patched in the test
process. ``probe.py`` stands in front of the launcher when a run records what Megatron-LM saw
(the FLOPs figure's token counts) or carries a mutation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.adapters.megatron import harness

REPO = Path(__file__).resolve().parents[4]
DRIVER = "runtime/adapters/megatron_lm/pretrain_gpt.py"
PROBE = Path(__file__).with_name("probe.py")
TOL = 1e-5
INIT_SEED = 7

# The tiny GPT of the acceptance command, as written (plus the plan's batch).
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "256",
         "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--seq-length", "1024", "--max-position-embeddings",
         "4096", "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "3",
         "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
         "--calculate-per-token-loss", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
         "--transformer-impl", "local", "--no-persist-layer-norm",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"]


def need_megatron_training() -> None:
    """Skip unless megatron-core ships a ``megatron.training`` the launcher supports (0.17+;
    ``scripts/check_megatron_019.sh`` runs these tests against 0.19.2)."""
    pytest.importorskip("megatron.core")
    code = ("import sys; from runtime.adapters.megatron_lm import mlm")
    probe = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=300)
    if probe.returncode:
        pytest.skip(f"no supported megatron.training: {probe.stderr.strip().splitlines()[-1:]}")


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join([*(str(Path(p).resolve()) for p in paths), str(REPO)])
    out.setdefault("NO_VCS_VERSION", "1")
    out.update(extra)
    return out


def make_data(tmp: Path) -> dict[str, Path]:
    """The long-tail dataset, its plans (pool 4 with CP 1/2/4; pp 2 x pool 2; vpp 2; pool 1)
    and an eval set."""
    data = harness.write_dataset(tmp / "data.arrow", harness.lengths(0), 64)
    out = {"data": data,
           "pool4": harness.plan(tmp / "pool4.arrow", data, capacity=32, batch=16, dp=4, cp=1),
           "pp2": harness.plan(tmp / "pp2.arrow", data, capacity=64, batch=16, dp=2, cp=1,
                               pp=2),
           "vpp2": harness.plan(tmp / "vpp2.arrow", data, capacity=64, batch=16, dp=2, cp=1,
                                pp=2, vpp=2),
           "pool1": harness.plan(tmp / "pool1.arrow", data, capacity=512, batch=16, dp=1,
                                 cp=1)}
    ev = harness.eval_set(tmp, capacity=32, batch=8, dp=4, cp=1)
    out["eval_plan"], out["eval_data"] = Path(ev["eval_plan"]), Path(ev["eval_dataset"])
    return out


def launch(nproc: int, plan: Path, data: Path, log: Path, *, extra: Sequence[str] = (),
           own: Sequence[str] = (), probe: str = "", timeout: float = 600
           ) -> subprocess.CompletedProcess[str]:
    """torchrun of the launcher (``own``: its flags beyond the plan, dataset, log and seed;
    ``extra``: Megatron-LM flags after the acceptance command's; ``probe``: run through
    ``probe.py`` with that mode)."""
    entry = [str(PROBE), probe] if probe else ["-m", "runtime.adapters.megatron_lm"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *entry, "--plan", str(plan), "--dataset", str(data),
           "--init-seed", str(INIT_SEED), "--log-jsonl", str(log), *own, "--", DRIVER,
           *FLAGS, *extra]
    return subprocess.run(cmd, cwd=REPO, env=env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout)


def reference(plan: Path, data: Path, log: Path, *, extra: Sequence[str] = (),
              own: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """The launcher's oracle on the same command."""
    cmd = [sys.executable, "-m", "runtime.adapters.megatron_lm", "--reference", "--plan",
           str(plan), "--dataset", str(data), "--init-seed", str(INIT_SEED), "--log-jsonl",
           str(log), *own, "--", DRIVER, *FLAGS, *extra]
    return subprocess.run(cmd, cwd=REPO, env=env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)


def ok(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


def lines(log: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step lines, eval lines) of a --log-jsonl file."""
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return [r for r in rows if "step" in r], [r for r in rows if "eval_loss" in r]


def close(got: float, want: float, tol: float = TOL) -> bool:
    return abs(got - want) <= tol * max(abs(want), 1e-12)


def assert_same_steps(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss_tokens"] == w["loss_tokens"], (g, w)
        assert close(g["loss"], w["loss"]), (g, w)
        assert close(g["grad_norm"], w["grad_norm"]), (g, w)
